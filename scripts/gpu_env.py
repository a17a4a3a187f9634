"""The GPU check's first stage: what this machine has, one line each, never stopping early.

    python scripts/gpu_env.py [--emulate]

Python and package versions, the CUDA devices CuPy sees (or why none), NVRTC's version, the
CUDA headers the kernels compile against, the cuBLAS library the engine's handle loads, and
whether the project imports. A line that fails says why and the next one still runs; the exit
status counts the failures (with ``--emulate``, not those of the GPU's own libraries).
"""

from __future__ import annotations

import importlib
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def version(module: str) -> str:
    return getattr(importlib.import_module(module), "__version__", "?")


def devices() -> str:
    from engine.devices.device import gpu_status

    n, why = gpu_status()
    return f"{n}" if n else f"0 ({why})"


def nvrtc() -> str:
    from cupy.cuda import nvrtc

    return ".".join(map(str, nvrtc.getVersion()))


def headers() -> str:
    from engine.kernels import cuda_include_dirs

    return ", ".join(map(str, cuda_include_dirs())) or "none found"


def cublas() -> str:
    from engine.kernels.cublas import find_cublas

    return find_cublas()


def project() -> str:
    import engine.backends.cupy_backend  # noqa: F401
    import engine.tools.bench_gpu  # noqa: F401
    import model_loader.load  # noqa: F401

    return "imports ok"


CHECKS = {
    "python": lambda: f"{platform.python_version()} ({sys.executable})",
    **{m: (lambda m=m: version(m)) for m in ("numpy", "cupy", "ml_dtypes", "safetensors")},
    **{m: (lambda m=m: version(m)) for m in ("tokenizers", "jinja2", "tqdm", "pytest")},
    "cuda devices": devices,
    "nvrtc": nvrtc,
    "cuda headers": headers,
    "libcublas": cublas,
    "project": project,
}


GPU_ONLY = ("libcublas",)


def main(argv: list[str]) -> int:
    emulate, failed = "--emulate" in argv, 0
    for name, check in CHECKS.items():
        try:
            value = check()
        except Exception as exc:  # one line on what failed, then the next check
            value = f"FAILED {type(exc).__name__}: {exc}".splitlines()[0]
            failed += not (emulate and name in GPU_ONLY)
        print(f"{name:13s} {value}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
