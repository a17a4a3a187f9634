"""The kernel sources of ``cuda_src/`` and their builds: NVRTC for the GPU, g++ for the CPU.

``read_source(name)`` is cuda_src/<name>.cu after a ``#line`` directive, so compiler errors
point at the ``.cu`` line; ``entry_points(source)`` lists its ``extern "C"`` kernel names.
  ``compile_nvrtc(name, arch)``  NVRTC through ``cupy.cuda.nvrtc`` (no device needed): a cubin
                                 and the ptxas report; the production compiler.
  ``compile_cpu(name)``          g++ with ``cuda_src/cpu/cuda_emu.h``: a shared library, cached
                                 by content hash, exporting each kernel for ``emulator.py``.
The GPU backend hands the same ``read_source(name)`` and ``include_options()`` to
``cupy.RawModule``.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

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


class KernelBuildError(RuntimeError):
    """A compiler rejected a kernel source; the message holds its log."""


# ---- sources ------------------------------------------------------------------------------------


def kernel_names() -> list[str]:
    """Every kernel file's stem: cuda_src/<name>.cu."""
    return sorted(p.stem for p in SRC_DIR.glob("*.cu"))


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


def compile_nvrtc(name: str, arch: str = "sm_90") -> NvrtcResult:
    """Compile cuda_src/<name>.cu with NVRTC for a real architecture (sm_80, sm_90)."""
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(read_source(name), f"{name}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, nvrtc_options(arch))
        except nvrtc.NVRTCError as exc:
            raise KernelBuildError(f"{name}.cu ({arch}):\n{nvrtc.getProgramLog(prog)}") from exc
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


# A counting build: every load and store calls a hook of cuda_src/cpu/emu_traffic.h.
COUNTING_FLAGS = [
    "-DEMU_COUNT_BYTES",
    "-fsanitize=kernel-address",
    "--param=asan-instrumentation-with-call-threshold=0",
    "--param=asan-stack=0",
    "--param=asan-globals=0",
]


def gxx_flags(asan: bool, counting: bool = False) -> list[str]:
    base = ["-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-Wall", "-Werror"]
    base += ["-Wno-unknown-pragmas", "-include", str(EMU_DIR / "cuda_emu.h")]
    base += [f"-I{EMU_DIR / 'shim'}", f"-I{SRC_DIR}"]
    if asan and counting:
        raise ValueError("a CPU build is either ASan or counting, not both")
    if asan:
        return base + ["-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer"]
    return base + ["-O2"] + (COUNTING_FLAGS if counting else [])


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


def compile_cpu(name: str, asan: bool | None = None, counting: bool = False) -> Path:
    """Build cuda_src/<name>.cu into a shared library (cached by content hash); its path.
    ``counting``: the build that counts each array argument's global memory traffic."""
    return build_cpu_library(_with_exports(read_source(name)), name, asan, counting)


def compile_cpu_source(source: str, tag: str, counting: bool = False) -> Path:
    """Build kernel source text, not a file (tests of the emulator), as ``compile_cpu`` does."""
    return build_cpu_library(_with_exports(f'#line 1 "{tag}.cu"\n{source}'), tag, None, counting)


def build_cpu_library(
    source: str, tag: str, asan: bool | None = None, counting: bool = False
) -> Path:
    """Compile kernel ``source`` (ending with its EMU_EXPORT lines) with g++, cached by hash."""
    asan = False if counting else asan_enabled() if asan is None else asan
    flags = gxx_flags(asan, counting)
    key = hashlib.sha256((source + _dependencies_digest() + " ".join(flags)).encode()).hexdigest()
    variant = "-asan" if asan else "-count" if counting else ""
    out = build_dir() / f"{tag}-{key[:16]}{variant}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    cpp = out.with_suffix(f".{os.getpid()}.{threading.get_ident()}.cpp")
    tmp = cpp.with_suffix(".tmp")
    cpp.write_text(source)
    cmd = ["g++", *flags, "-x", "c++", str(cpp), "-o", str(tmp)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    cpp.unlink()
    if result.returncode != 0:
        raise KernelBuildError(f"g++ failed on {tag}:\n{result.stderr}")
    os.replace(tmp, out)
    return out


def build_all_cpu(names: list[str] | None = None, workers: int = 2) -> None:
    """Compile several kernel files in parallel (g++ runs as separate processes)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(compile_cpu, names or kernel_names()))
