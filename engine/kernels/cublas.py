"""cuBLAS through a handle of the engine's own, so matrix products can be captured in CUDA graphs.

CuPy's ``cupy.cuda.cublas`` cannot serve a graph: every call there first sets the handle's stream
and refuses while that stream captures (``NotImplementedError: calling cuBLAS API during stream
capture is currently unsupported``). So the engine calls the C library itself, through ctypes,
following what cuBLAS asks of graph capture:

    cublasCreate_v2         one handle per device
    cublasSetStream_v2      bound once to the device's stream, before any capture
    cublasSetWorkspace_v2   a fixed workspace, so cuBLAS allocates nothing while capturing;
                            set after the stream (setting the stream resets the workspace)
    cublasSetPointerMode_v2 host alpha/beta (a graph keeps their values)
    cublasGemmEx            the only call made while capturing

``Cublas`` takes any object with those five functions: ``load_cublas()`` (the C library CuPy
loads, on a GPU) or ``engine.emulation.runtime.EmulatedCublas`` (the same calls on host memory,
with the capture rules checked). Every function returns a ``cublasStatus_t``; a non-zero one
raises ``CublasError`` naming the call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path

import numpy as np

from engine.kernels.gemm import GemmPlan

POINTER_MODE_HOST = 0
WORKSPACE_BYTES = 32 << 20  # cuBLAS's recommendation for Hopper (4 MiB suffices before it)
STATUS = {
    0: "CUBLAS_STATUS_SUCCESS",
    1: "CUBLAS_STATUS_NOT_INITIALIZED",
    3: "CUBLAS_STATUS_ALLOC_FAILED",
    7: "CUBLAS_STATUS_INVALID_VALUE",
    8: "CUBLAS_STATUS_ARCH_MISMATCH",
    11: "CUBLAS_STATUS_MAPPING_ERROR",
    13: "CUBLAS_STATUS_EXECUTION_FAILED",
    14: "CUBLAS_STATUS_INTERNAL_ERROR",
    15: "CUBLAS_STATUS_NOT_SUPPORTED",
    16: "CUBLAS_STATUS_LICENSE_ERROR",
}

_p, _i, _sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
SIGNATURES = {
    "cublasCreate_v2": [ctypes.POINTER(_p)],
    "cublasDestroy_v2": [_p],
    "cublasSetStream_v2": [_p, _p],
    "cublasSetWorkspace_v2": [_p, _p, _sz],
    "cublasSetPointerMode_v2": [_p, _i],
    "cublasGetVersion_v2": [_p, ctypes.POINTER(_i)],
    # handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc,
    # computeType, algo
    "cublasGemmEx": [_p, _i, _i, _i, _i, _i, _p, _p, _i, _i, _p, _i, _i, _p, _p, _i, _i, _i, _i],
}


class CublasError(RuntimeError):
    """A cuBLAS call returned a status other than CUBLAS_STATUS_SUCCESS."""


def check(call: str, status: int) -> None:
    if status != 0:
        raise CublasError(f"{call} failed: {STATUS.get(status, f'status {status}')}")


def loaded_library_path(stem: str) -> Path | None:
    """The file of a shared library this process has already loaded (``/proc/self/maps``)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        path = line.split()[-1]
        if Path(path).name.startswith(f"{stem}.so"):
            return Path(path)
    return None


def find_cublas() -> str:
    """libcublas as CuPy loads it: imported through CuPy first, so both share one library."""
    from cupy.cuda import cublas as _  # noqa: F401  (loads libcublas into the process)

    path = loaded_library_path("libcublas")
    if path is not None:
        return str(path)
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        return load_nvidia_dynamic_lib("cublas").abs_path
    except Exception:  # no cuda-pathfinder, or it found nothing: the system's search path
        name = ctypes.util.find_library("cublas")
        if name is None:
            raise OSError("libcublas not found (neither loaded by CuPy nor on the path)") from None
        return name


def load_cublas() -> ctypes.CDLL:
    """The C library with the argument types of every function the engine calls."""
    lib = ctypes.CDLL(find_cublas())
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return lib


_scalars: dict[float, np.ndarray] = {}


def host_scalar(value: float) -> int:
    """Address of a float32 kept for the process (alpha and beta are read from the host)."""
    if value not in _scalars:
        _scalars[value] = np.array(value, dtype=np.float32)
    return _scalars[value].ctypes.data


class Cublas:
    """One cuBLAS handle bound to one stream and one workspace: ``gemm(plan, w, x, out)``."""

    def __init__(self, lib, stream_ptr: int, workspace_ptr: int, workspace_bytes: int):
        self.lib = lib
        handle = ctypes.c_void_p()
        check("cublasCreate_v2", lib.cublasCreate_v2(ctypes.byref(handle)))
        self.handle = handle.value
        check("cublasSetStream_v2", lib.cublasSetStream_v2(self.handle, stream_ptr))
        check(
            "cublasSetWorkspace_v2",
            lib.cublasSetWorkspace_v2(self.handle, workspace_ptr, workspace_bytes),
        )
        check("cublasSetPointerMode_v2", lib.cublasSetPointerMode_v2(self.handle, 0))

    def version(self) -> int:
        v = ctypes.c_int()
        check("cublasGetVersion_v2", self.lib.cublasGetVersion_v2(self.handle, ctypes.byref(v)))
        return v.value

    def gemm(self, p: GemmPlan, a_ptr: int, b_ptr: int, c_ptr: int) -> None:
        """C = A op B as planned, alpha 1, beta 0, float32 sums."""
        args = p.ex_args(a_ptr, b_ptr, c_ptr, host_scalar(1.0), host_scalar(0.0))
        check("cublasGemmEx", self.lib.cublasGemmEx(self.handle, *args))
