"""The kernel sources of ``cuda_src/`` and their builds: NVRTC for the GPU, g++ for the CPU.

``read_source(name)`` is cuda_src/<name>.cu after a ``#line`` directive, so compiler errors
point at the ``.cu`` line; ``entry_points(source)`` lists its ``extern "C"`` kernel names.
  ``compile_nvrtc(name, arch, defines)``  NVRTC through ``cupy.cuda.nvrtc`` (no device
                                 needed): a cubin and the ptxas report; the production compiler.
  ``compile_cpu(name, defines=defines)``  g++ with ``cuda_src/cpu/cuda_emu.h``: a shared
                                 library, cached by content hash and defines, exporting each
                                 kernel for ``emulator.py``.
The GPU backend hands the same ``read_source(name)``, ``include_options()`` and
``define_options(defines)`` to ``cupy.RawModule``.

Defines: a file may need compile-time constants (``{"HEAD_DIM": 64, "BLOCK_SIZE": 16}``), one
build per set; ``REQUIRED_DEFINES`` names them per file and ``define_sets(name)`` lists the
sets that the compile checks and ``build_all_cpu`` build.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("engine.kernels")

REPO = Path(__file__).resolve().parents[2]
SRC_DIR = REPO / "cuda_src"
EMU_DIR = SRC_DIR / "cpu"
ASAN_ENV = "PAGEDLLM_EMU_ASAN"  # "1": build the CPU kernels with AddressSanitizer
BUILD_ENV = "PAGEDLLM_BUILD_DIR"  # where CPU builds are cached (default build/cuda_cpu)

ENTRY_SUFFIXES = ("f32", "f16", "bf16")  # what DTYPE_ENTRY_POINTS (common.cuh) defines, in order

# An entry point written out, or a line DTYPE_ENTRY_POINTS(name, n).
_ENTRY_RE = re.compile(
    r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(|^[ \t]*DTYPE_ENTRY_POINTS\(\s*(\w+)\s*,',
    re.MULTILINE,
)


# Files built once per set of compile-time constants: file -> the names each build must define.
REQUIRED_DEFINES = {"paged_attention_decode": ("HEAD_DIM", "BLOCK_SIZE")}
# The sets built ahead (compile checks, build_all_cpu): every head dim the tests and the bundled
# models use, and the largest, at the default block size (another block size is another build
# of the same code).
_PREBUILT = {
    "paged_attention_decode": [{"HEAD_DIM": hd, "BLOCK_SIZE": 16} for hd in (16, 64, 128, 256)]
}

Defines = tuple[tuple[str, int], ...]  # sorted (name, value) pairs: hashable, one per build


class KernelBuildError(RuntimeError):
    """A compiler rejected a kernel source; the message holds its log."""


# ---- sources ------------------------------------------------------------------------------------


def kernel_names() -> list[str]:
    """Every kernel file's stem: cuda_src/<name>.cu."""
    return sorted(p.stem for p in SRC_DIR.glob("*.cu"))


def normalize_defines(name: str, defines=None) -> Defines:
    """``defines`` (a dict or pairs) as sorted pairs, checked against what ``name`` needs."""
    pairs = tuple(sorted(dict(defines or {}).items()))
    need = REQUIRED_DEFINES.get(name, ())
    if sorted(need) != [k for k, _ in pairs]:
        got = [k for k, _ in pairs]
        raise ValueError(f"{name}.cu needs defines {sorted(need)}, got {got}")
    for key, value in pairs:
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name}.cu: define {key} must be a positive int, got {value!r}")
    return pairs


def define_sets(name: str, defines=None) -> list[Defines]:
    """The define sets to build ``name`` with: ``[()]`` for a file that needs none; for one that
    needs some, ``defines`` if given (a model's), else every set built ahead."""
    if name in REQUIRED_DEFINES and defines is not None:
        return [normalize_defines(name, defines)]
    return [normalize_defines(name, d) for d in _PREBUILT.get(name, [{}])]


def define_options(defines: Defines) -> list[str]:
    """``-DNAME=value`` for each define (g++, NVRTC and CuPy alike)."""
    return [f"-D{k}={v}" for k, v in defines]


def define_tag(defines: Defines) -> str:
    """A file-name-safe label of a define set: ``HEAD_DIM64-BLOCK_SIZE16``."""
    return "-".join(f"{k}{v}" for k, v in defines)


def read_source(name: str) -> str:
    """The source of cuda_src/<name>.cu with a ``#line`` directive naming the file."""
    path = SRC_DIR / f"{name}.cu"
    return f'#line 1 "{path}"\n' + path.read_text()


def entry_points(source: str) -> list[str]:
    """The ``extern "C" __global__`` kernels a source defines, in order: those written out, and
    name_f32, name_f16, name_bf16 for each ``DTYPE_ENTRY_POINTS(name, n)``."""
    names = []
    for written, name in _ENTRY_RE.findall(source):
        names += [written] if written else [f"{name}_{s}" for s in ENTRY_SUFFIXES]
    return names


def cuda_include_dirs() -> list[Path]:
    """CUDA headers from pip's nvidia-cuda-runtime (nvidia/cu13/include or nvidia/*/include)."""
    import site
    import sys

    roots = [Path(p) for p in site.getsitepackages() + [site.getusersitepackages()] + sys.path]
    found = []
    for root in roots:
        for inc in sorted(root.glob("nvidia/*/include")):
            if (inc / "cuda_fp16.h").exists() and inc not in found:
                found.append(inc)
    return found


# ---- NVRTC ------------------------------------------------------------------------------------


@dataclass
class NvrtcResult:
    cubin: bytes  # the device code for ``arch``
    log: str  # compiler and ptxas output (``--ptxas-options=-v``)


def include_options() -> list[str]:
    """``-I`` for cuda_src/ and pip's CUDA headers: every NVRTC compile (here and CuPy's)."""
    return [f"-I{SRC_DIR}"] + [f"-I{d}" for d in cuda_include_dirs()]


def nvrtc_options(arch: str) -> list[str]:
    return [f"-arch={arch}", "--ptxas-options=-v", "-std=c++17", *include_options()]


def compile_nvrtc(name: str, arch: str = "sm_90", defines=None) -> NvrtcResult:
    """Compile cuda_src/<name>.cu with NVRTC for a real architecture (sm_80, sm_90)."""
    from cupy.cuda import nvrtc

    defs = normalize_defines(name, defines)
    prog = nvrtc.createProgram(read_source(name), f"{name}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, nvrtc_options(arch) + define_options(defs))
        except nvrtc.NVRTCError as exc:
            where = f"{arch} {define_tag(defs)}".strip()
            raise KernelBuildError(f"{name}.cu ({where}):\n{nvrtc.getProgramLog(prog)}") from exc
        return NvrtcResult(nvrtc.getCUBIN(prog), nvrtc.getProgramLog(prog))
    finally:
        nvrtc.destroyProgram(prog)


# ---- CPU build --------------------------------------------------------------------------------


def asan_enabled() -> bool:
    return os.environ.get(ASAN_ENV, "") == "1"


def asan_env(base: dict | None = None) -> dict:
    """Environment for a process that runs ASan builds: the runtime preloaded, no leak report."""
    env = dict(os.environ if base is None else base)
    lib = subprocess.run(["g++", "-print-file-name=libasan.so"], capture_output=True, text=True)
    env.update(LD_PRELOAD=lib.stdout.strip(), ASAN_OPTIONS="detect_leaks=0")
    env[ASAN_ENV] = "1"
    return env


def build_dir() -> Path:
    return Path(os.environ.get(BUILD_ENV, REPO / "build" / "cuda_cpu"))


# A counting build: every load ("reads") or every store ("writes") calls a hook of
# cuda_src/cpu/emu_traffic.h. Loads and stores get separate builds because g++ drops a check
# that an earlier check of the same address covers, and a load's check covers a later store.
COUNTING_FLAGS = [
    "-DEMU_COUNT_BYTES",
    "-fsanitize=kernel-address",
    "--param=asan-instrumentation-with-call-threshold=0",
    "--param=asan-stack=0",
    "--param=asan-globals=0",
]
COUNTING_KINDS = {
    "reads": ["--param=asan-instrument-writes=0"],
    "writes": ["--param=asan-instrument-reads=0"],
}


def gxx_flags(asan: bool, counting: str | None = None) -> list[str]:
    base = ["-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-Wall", "-Werror"]
    base += ["-Wno-unknown-pragmas", "-include", str(EMU_DIR / "cuda_emu.h")]
    base += [f"-I{EMU_DIR / 'shim'}", f"-I{SRC_DIR}"]
    if asan and counting:
        raise ValueError("a CPU build is either ASan or counting, not both")
    if asan:
        return base + ["-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer"]
    if counting and counting not in COUNTING_KINDS:
        raise ValueError(f"counting must be one of {sorted(COUNTING_KINDS)}, got {counting!r}")
    return base + ["-O2"] + (COUNTING_FLAGS + COUNTING_KINDS[counting] if counting else [])


def _with_exports(source: str) -> str:
    """The source unchanged, then one EMU_EXPORT per kernel (the launch and signature entries)."""
    exports = "".join(f"EMU_EXPORT({fn})\n" for fn in entry_points(source))
    return f'{source}\n#line 1 "<emu exports>"\n{exports}'


def _dependencies_digest() -> str:
    files = sorted(SRC_DIR.glob("*.cuh")) + sorted(EMU_DIR.rglob("*.h"))
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def compile_cpu(
    name: str, asan: bool | None = None, counting: str | None = None, defines=None
) -> Path:
    """Build cuda_src/<name>.cu into a shared library (cached by content hash and defines);
    its path. ``counting``: the build that counts each array argument's global memory
    traffic."""
    defs = normalize_defines(name, defines)
    tag = f"{name}-{define_tag(defs)}" if defs else name
    return build_cpu_library(_with_exports(read_source(name)), tag, asan, counting, defs)


def compile_cpu_source(source: str, tag: str, counting: str | None = None) -> Path:
    """Build kernel source text, not a file (tests of the emulator), as ``compile_cpu`` does."""
    return build_cpu_library(_with_exports(f'#line 1 "{tag}.cu"\n{source}'), tag, None, counting)


def build_cpu_library(
    source: str, tag: str, asan: bool | None = None, counting: str | None = None, defines=()
) -> Path:
    """Compile kernel ``source`` (ending with its EMU_EXPORT lines) with g++, cached by hash."""
    asan = False if counting else asan_enabled() if asan is None else asan
    flags = gxx_flags(asan, counting) + define_options(defines)
    key = hashlib.sha256((source + _dependencies_digest() + " ".join(flags)).encode()).hexdigest()
    variant = "-asan" if asan else f"-count-{counting}" if counting else ""
    out = build_dir() / f"{tag}-{key[:16]}{variant}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    cpp = out.with_suffix(f".{os.getpid()}.{threading.get_ident()}.cpp")
    tmp = cpp.with_suffix(".tmp")
    cpp.write_text(source)
    cmd = ["g++", *flags, "-x", "c++", str(cpp), "-o", str(tmp)]
    t0 = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True)
    cpp.unlink()
    if result.returncode != 0:
        raise KernelBuildError(f"g++ failed on {tag}:\n{result.stderr}")
    os.replace(tmp, out)
    kind = " (ASan)" if asan else f" (counting {counting})" if counting else ""
    log.info("built %s%s for the CUDA emulation in %.1f s", tag, kind, time.perf_counter() - t0)
    return out


def build_all_cpu(names: list[str] | None = None, workers: int = 2, defines=None) -> None:
    """Compile several kernel files in parallel (g++ runs as separate processes): a file that
    needs compile-time constants with ``defines`` if given, else with each of its
    ``define_sets``."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(n, d) for n in names or kernel_names() for d in define_sets(n, defines)]
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda job: compile_cpu(job[0], defines=job[1]), jobs))


def build_everything(workers: int = 2) -> None:
    """``make test``'s setup: every kernel's CPU build, plain and under ASan (what the tests load),
    ahead of the tests; cached by content hash, so a build already there is skipped."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(n, d, asan) for asan in (False, True) for n in kernel_names() for d in define_sets(n)]
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda j: compile_cpu(j[0], asan=j[2], defines=j[1]), jobs))
