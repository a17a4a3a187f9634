"""The native CPU kernels of ``cpu_src/``: built with g++ at first use into one shared library
(cached by the sources' hash, the flags and this CPU's instruction set), loaded with ctypes, and
the threads they run on.

Instruction set: ``-march=native`` unless ``PAGEDLLM_CPU_ISA`` names another target
(``ISAS``): ``x86-64-v3`` (AVX2, FMA, F16C: what most x86 machines of the last decade have),
``x86-64-v4`` (AVX-512), or ``generic`` (the architecture's baseline: SSE2 on x86-64, NEON on
aarch64), so one machine can build, test and time the paths another one runs. A target this
CPU cannot run is refused by name before anything is built.

Threads: as many as the cores this process may use (``os.sched_getaffinity``), or
``PAGEDLLM_CPU_THREADS``. OpenMP's idle threads sleep rather than spin (``OMP_WAIT_POLICY``
defaults to PASSIVE here), so between two kernels they leave the cores to the matrix library's
threads; nothing is pinned. A machine whose load average is above its cores is logged once:
a run under contention was measured many times slower.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engine.kernels.build import REPO, build_dir

log = logging.getLogger("engine.backend")

SRC = REPO / "cpu_src"
FLAGS = [
    "-O3",
    "-fno-trapping-math",
    "-fopenmp",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-Wall",
    "-Werror",
    "-Wno-psabi",  # the vector types' calling convention: every such function is the library's own
]
THREADS_ENV = "PAGEDLLM_CPU_THREADS"
ISA_ENV = "PAGEDLLM_CPU_ISA"
# target -> (g++'s -march on x86-64, the /proc/cpuinfo flags it needs)
ISAS = {
    "native": ("native", ()),
    "x86-64-v4": ("x86-64-v4", ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")),
    "x86-64-v3": ("x86-64-v3", ("avx2", "fma", "f16c", "bmi2", "movbe")),
    "generic": ("x86-64", ()),
}

_lock = threading.Lock()
_lib: list = []  # [the loaded library], once built


class NativeBuildError(RuntimeError):
    """No C++ compiler, or it rejected cpu_src/."""


def cpuinfo(*fields: str) -> str:
    """The value of the first /proc/cpuinfo line that starts with one of ``fields`` ("" if
    none: not Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(fields):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> str:
    """This CPU's instruction-set flags (/proc/cpuinfo), part of the build's cache key."""
    return cpuinfo("flags")


def isa(name: str | None = None) -> str:
    """The target the kernels are built for: name, else PAGEDLLM_CPU_ISA, else native.
    ValueError for a name not in ISAS or a target whose instructions this CPU lacks."""
    name = name or os.environ.get(ISA_ENV) or "native"
    if name not in ISAS:
        raise ValueError(f"{ISA_ENV} must be one of {', '.join(ISAS)}; got {name!r}")
    have = set(cpu_flags().split())
    lacking = [f for f in ISAS[name][1] if f not in have]
    if lacking and platform.machine() == "x86_64":
        raise ValueError(f"{ISA_ENV}={name} needs {lacking[0]}, which this CPU lacks")
    return name


def march(name: str | None = None) -> str:
    """g++'s -march for the target (aarch64: native or its baseline, armv8-a)."""
    name = isa(name)
    if platform.machine() == "x86_64":
        return f"-march={ISAS[name][0]}"
    if name in ("x86-64-v3", "x86-64-v4"):
        raise ValueError(f"{ISA_ENV}={name} is an x86-64 target; this CPU is {platform.machine()}")
    return "-march=native" if name == "native" else "-march=armv8-a"


def compiler_available() -> bool:
    return shutil.which("g++") is not None


def library_path(target: str | None = None) -> Path:
    """Build cpu_src/ for the target (isa()) if this exact build is not cached -> the shared
    library's path. A build logs what it builds before and its time after."""
    if not compiler_available():
        raise NativeBuildError("the cpu backend needs g++ (apt install g++); none on the PATH")
    sources = sorted(SRC.glob("*.cpp"))
    flags = [*FLAGS, march(target)]
    h = hashlib.sha256(" ".join(flags).encode() + cpu_flags().encode())
    for f in sources + sorted(SRC.glob("*.h")):
        h.update(f.name.encode() + f.read_bytes())
    out = build_dir() / "native" / f"libpagedllm_cpu-{h.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    what = f"the native CPU kernels for {target_name(target)}"
    jobs = min(len(sources), available_cores())
    log.info("building %s (g++, %d files, %d at a time) -> %s", what, len(sources), jobs, out)
    t0 = time.perf_counter()
    compile_and_link(sources, flags, out, jobs)
    log.info("built %s in %.1f s", what, time.perf_counter() - t0)
    return out


def target_name(target: str | None = None) -> str:
    """The target in words: "this CPU (AVX-512)", "x86-64-v3 (AVX2)", "the baseline (x86_64)"."""
    name = isa(target)
    if name == "generic":
        return f"the baseline ({platform.machine()})"
    if name != "native":
        return f"{name} ({'AVX-512' if name == 'x86-64-v4' else 'AVX2'})"
    flags = set(cpu_flags().split())
    best = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else platform.machine()
    return f"this CPU ({best})"


def compile_and_link(
    sources: list[Path], flags: list[str], out: Path, jobs: int, cxx: str = "g++"
) -> None:
    """Each source to an object file, ``jobs`` compilers at a time (largest first), then linked
    with ``flags`` (a shared library with -shared) at ``out``, written whole (a reader never
    sees half a file). NativeBuildError with the compiler's messages if it rejects one."""
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f"{out.stem}-") as tmp:
        objects = [Path(tmp) / f"{src.stem}.o" for src in sources]
        compile_flags = [f for f in flags if f != "-shared"]
        order = sorted(zip(sources, objects, strict=True), key=lambda so: -so[0].stat().st_size)

        def one(job: tuple[Path, Path]) -> subprocess.CompletedProcess:
            cmd = [cxx, *compile_flags, "-c", str(job[0]), "-o", str(job[1])]
            return subprocess.run(cmd, capture_output=True, text=True)

        with ThreadPoolExecutor(jobs) as pool:
            errors = [r.stderr for r in pool.map(one, order) if r.returncode != 0]
        if not errors:
            lib = Path(tmp) / out.name
            link = [cxx, *flags, *map(str, objects), "-o", str(lib)]
            result = subprocess.run(link, capture_output=True, text=True)
            errors = [result.stderr] if result.returncode != 0 else []
        if errors:
            raise NativeBuildError(f"{cxx} failed on cpu_src/:\n" + "".join(errors))
        os.replace(lib, out)


def library() -> ctypes.CDLL:
    """The native kernels, built and loaded once per process."""
    if _lib:  # every kernel call asks: no lock once loaded
        return _lib[0]
    with _lock:
        if not _lib:
            lib = ctypes.CDLL(str(library_path()))
            _declare(lib)
            built = lib.matmul_quant_isa().decode()
            dot = "AVX512-BF16 dot products" if lib.matmul_panels_bf16_dot() else "float32 FMAs"
            log.info(
                "native CPU kernels loaded; products built for %s, bf16 weights with %s",
                built,
                dot,
            )
            _lib.append(lib)
        return _lib[0]


P, I, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


def _declare(lib: ctypes.CDLL) -> None:
    lib.paged_attention_decode.argtypes = [P, P, P, P, I, P, P, I, I, I, I, I, I, F, I, F, P, I]
    lib.paged_attention_decode.restype = I
    lib.paged_attention_prefill.argtypes = [P, P, P, P, I, P, P, P, I, I, I, I, I, I, F, I, F, P, I]
    lib.paged_attention_prefill.restype = I
    lib.rotary_cache.argtypes = [P, P, P, I, P, P, P, P, P, P, P, F, I, I, I, I, I]
    lib.rotary_cache.restype = I
    lib.fused_add_rms_norm.argtypes = [P, P, P, P, F, I, I, I]
    lib.fused_add_rms_norm.restype = None
    lib.silu_and_mul.argtypes = [P, P, I, I, I]
    lib.silu_and_mul.restype = None
    lib.argmax_rows.argtypes = [P, P, I, ctypes.c_long, I]
    lib.argmax_rows.restype = None
    lib.matmul_init.argtypes = [P, P, P]
    lib.matmul_init.restype = None
    lib.matmul_f32.argtypes = [P, P, P, ctypes.c_long, ctypes.c_long, ctypes.c_long, I]
    lib.matmul_f32.restype = None
    L = ctypes.c_long
    lib.matmul_panels_f32.argtypes = [P, P, P, L, L, L, I]
    lib.matmul_panels_f32.restype = None
    lib.matmul_panels_int8.argtypes = [P, P, P, P, L, L, L, I]
    lib.matmul_panels_int8.restype = None
    lib.matmul_panels_bf16.argtypes = [P, P, P, L, L, L, I]
    lib.matmul_panels_bf16.restype = None
    lib.matmul_panels_bf16_dot.argtypes = []
    lib.matmul_panels_bf16_dot.restype = I
    lib.matmul_bf16.argtypes = [P, P, P, L, L, L, I]
    lib.matmul_bf16.restype = None
    lib.matmul_int8.argtypes = [P, P, P, P, L, L, L, I]
    lib.matmul_int8.restype = None
    lib.matmul_blocks.argtypes = [P, P, P, P, I, L, L, L, I]
    lib.matmul_blocks.restype = I
    lib.matmul_kquants.argtypes = [P, P, P, I, L, L, L, I]
    lib.matmul_kquants.restype = I
    lib.matmul_q5.argtypes = [P, P, P, I, L, L, L, I]
    lib.matmul_q5.restype = I
    lib.matmul_mxfp4.argtypes = [P, P, P, L, L, L, I]
    lib.matmul_mxfp4.restype = I
    lib.matmul_iq4.argtypes = [P, P, P, I, L, L, L, I]
    lib.matmul_iq4.restype = I
    lib.matmul_fp8.argtypes = [P, P, P, P, L, L, L, L, I]
    lib.matmul_fp8.restype = I
    lib.matmul_matrix.argtypes = [P, P, P, L, L, L, I]
    lib.matmul_matrix.restype = I
    lib.matmul_seconds.argtypes = [P, P, P, L, L, L, I, I]
    lib.matmul_seconds.restype = ctypes.c_double
    lib.decode_layers.argtypes = [P, I, P]
    lib.decode_layers.restype = I
    lib.lora_add.argtypes = [P, P, P, P, P, P, P, L, L, L, I]
    lib.lora_add.restype = I
    lib.moe_experts.argtypes = [P, P, L, L, L, I, P, P, P, P, P, I, P, P, F, F, I]
    lib.moe_experts.restype = I
    lib.matmul_quant_isa.argtypes = []
    lib.matmul_quant_isa.restype = ctypes.c_char_p
    blas = numpy_blas()
    names = ("scipy_cblas_sgemm64_", "scipy_cblas_sgemv64_", "openblas_set_num_threads_local")
    missing = [name for name in names if not hasattr(blas, name)]
    if missing:
        raise NativeBuildError(
            f"the cpu backend needs the OpenBLAS that NumPy's PyPI wheels bundle "
            f"(scipy-openblas64); this NumPy's lacks {missing[0]}"
        )
    lib.matmul_init(*(ctypes.cast(getattr(blas, name), P) for name in names))


def numpy_blas() -> ctypes.CDLL:
    """The OpenBLAS that NumPy loaded (its wheels bundle one), as threadpoolctl finds it."""
    import numpy  # noqa: F401  (importing NumPy loads its BLAS)
    from threadpoolctl import threadpool_info

    found = [i["filepath"] for i in threadpool_info() if i["internal_api"] == "openblas"]
    if not found:
        raise NativeBuildError("the cpu backend needs NumPy built with OpenBLAS; this one is not")
    return ctypes.CDLL(found[0])


_threads: list = []  # [the thread count], once decided


def available_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads() -> int:
    """The kernels' thread count: PAGEDLLM_CPU_THREADS, else the cores this process may use.
    Logs once when the machine is oversubscribed (load average above the cores)."""
    if not _threads:
        cores = available_cores()
        raw = os.environ.get(THREADS_ENV)
        if raw is not None:
            try:
                n = int(raw)
            except ValueError:
                n = 0
            if n < 1:
                raise ValueError(f"{THREADS_ENV} must be a positive int, got {raw!r}")
        else:
            n = cores
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        if load > (os.cpu_count() or cores) + 0.5:
            log.warning(
                "the machine is oversubscribed (load average %.1f on %d cores): every step "
                "waits for the cores, expect it many times slower",
                load,
                os.cpu_count() or cores,
            )
        _threads.append(n)
    return _threads[0]
