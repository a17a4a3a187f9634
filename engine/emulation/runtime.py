"""The rules of CUDA, cuBLAS and CuPy that the GPU backend lives by, kept on the host.

``EmulatedDevice`` (in ``devices.py``) runs the GPU backend's own code on the CPU: the kernels'
CPU builds, NumPy arrays for device memory, and the pieces here, which behave as their GPU
counterparts do, errors included, so that a mistake that would stop the engine on a GPU stops
it on every CPU run first:

    EmuStream          a stream that captures: while it captures, a host synchronisation
                       raises (and spoils the capture, as CUDA does), H2D/D2H copies raise
                       (CuPy's rule), and every launch is logged so a replay can be compared
    EmulatedCublas     the cuBLAS C functions the engine calls (``engine.kernels.cublas``), carried
    out
                       on raw host memory exactly as cuBLAS reads column-major operands; while
                       capturing, a GemmEx needs a user workspace and a handle bound to the
                       capturing stream
    EmulatedCupyCublas CuPy's ``cupy.cuda.cublas`` rule: any call sets the stream first, and
                       refuses while the current stream captures

What is only the engine's own rule, stricter than CUDA's relaxed capture mode, is said so where
it is checked (no fresh device allocation while capturing).
"""

from __future__ import annotations

import ctypes
import itertools
import weakref

import ml_dtypes
import numpy as np

from engine.kernels.gemm import (
    CUBLAS_COMPUTE_32F,
    CUBLAS_OP_T,
    CUDA_R_16BF,
    CUDA_R_16F,
    CUDA_R_32F,
    GemmExArgs,
)

CUBLAS_STATUS_SUCCESS, CUBLAS_STATUS_NOT_INITIALIZED, CUBLAS_STATUS_INVALID_VALUE = 0, 1, 7
CUBLAS_STATUS_NOT_SUPPORTED = 15
CAPTURE_UNSUPPORTED = (
    "cudaErrorStreamCaptureUnsupported: operation not permitted when stream is capturing"
)
CAPTURE_INVALIDATED = (
    "cudaErrorStreamCaptureInvalidated: operation failed due to a previous error during capture"
)
CUPY_CUBLAS_REFUSAL = "calling cuBLAS API during stream capture is currently unsupported"
TYPES = {CUDA_R_32F: np.float32, CUDA_R_16F: np.float16, CUDA_R_16BF: ml_dtypes.bfloat16}


class EmuCudaError(RuntimeError):
    """What CuPy raises for a failed CUDA runtime call (its CUDARuntimeError)."""


# ---- streams and graphs -------------------------------------------------------------------------

_streams: weakref.WeakValueDictionary[int, EmuStream] = weakref.WeakValueDictionary()
_current: list[EmuStream] = []  # the stack of ``with stream:`` blocks
_ids = itertools.count(0x5000)


def current_stream() -> EmuStream | None:
    return _current[-1] if _current else None


def stream_is_capturing(ptr: int) -> bool:
    """cudaStreamIsCapturing for an emulated stream's handle (0: the legacy stream, never)."""
    stream = _streams.get(ptr)
    return stream is not None and stream.is_capturing()


class EmuStream:
    """A non-blocking stream that can capture. ``status``: None, "capturing", "invalidated"
    (a forbidden call happened; end_capture will fail) or "replaying" (a graph runs)."""

    def __init__(self):
        self.ptr = next(_ids)
        self.status: str | None = None
        self.log: list[tuple] = []  # launches while capturing or replaying
        _streams[self.ptr] = self

    def __enter__(self):
        _current.append(self)
        return self

    def __exit__(self, *exc):
        _current.pop()

    def is_capturing(self) -> bool:
        return self.status is not None

    def begin_capture(self) -> None:
        if self.status is not None:
            raise EmuCudaError("cudaErrorIllegalState: the stream is already capturing")
        self.status, self.log = "capturing", []

    def end_capture(self) -> list[tuple]:
        """The captured launches (the "graph"); raises if the capture was spoilt."""
        status, self.status = self.status, None
        if status is None:
            raise EmuCudaError("cudaErrorIllegalState: the stream is not capturing")
        if status == "invalidated":
            raise EmuCudaError(CAPTURE_INVALIDATED)
        return self.log

    def refuse(self, message: str = CAPTURE_UNSUPPORTED) -> None:
        """A call CUDA forbids while capturing: the capture is spoilt, the call raises."""
        if self.status == "capturing":
            self.status = "invalidated"
        raise EmuCudaError(message)

    def synchronize(self) -> None:
        if self.is_capturing():
            self.refuse()

    def record(self, entry: tuple) -> None:
        """Log one launch (a kernel or a cuBLAS call) while capturing or replaying."""
        if self.status in ("capturing", "replaying"):
            self.log.append(entry)


def arg_signature(a) -> tuple:
    """What a graph freezes of one launch argument: an array's address and size, a value."""
    if isinstance(a, np.ndarray):
        return ("ptr", a.ctypes.data, a.nbytes)
    return (type(a).__name__, a.item() if hasattr(a, "item") else a)


class LoggedModule:
    """A CPU kernel module whose launches are logged on the device's stream."""

    def __init__(self, module, stream: EmuStream):
        self.module, self.stream = module, stream

    def get_function(self, name: str):
        fn = self.module.get_function(name)
        stream = self.stream

        def launch(grid, block, args, shared_mem: int = 0):
            stream.record((name, grid, block, tuple(map(arg_signature, args)), shared_mem))
            fn(grid, block, args, shared_mem=shared_mem)

        return launch


# ---- cuBLAS ------------------------------------------------------------------------------------


def _matrix(ptr: int, type_: int, rows: int, cols: int, ld: int) -> np.ndarray:
    """The column-major (rows, cols) matrix at ``ptr`` with leading dimension ``ld``, as cuBLAS
    reads it: element (i, j) at ptr + (i + j * ld) * itemsize."""
    dtype = np.dtype(TYPES[type_])
    count = ld * (cols - 1) + rows
    buf = (ctypes.c_char * (count * dtype.itemsize)).from_address(ptr)
    flat = np.frombuffer(buf, dtype)
    return np.lib.stride_tricks.as_strided(
        flat, (rows, cols), (dtype.itemsize, ld * dtype.itemsize)
    )


class _Handle:
    def __init__(self):
        self.stream_ptr = 0
        self.workspace: tuple[int, int] | None = None
        self.pointer_mode = 0


class EmulatedCublas:
    """The cuBLAS C functions of ``engine.kernels.cublas.SIGNATURES`` on host memory; each returns a
    cublasStatus_t. Capture rules (``cublasGemmEx`` while its stream captures): the handle
    must be bound to the capturing stream (else the product would run once, now, outside the
    graph) and have a workspace of the caller's (else cuBLAS would allocate one mid-capture)."""

    VERSION = 130000

    def __init__(self):
        self.handles: dict[int, _Handle] = {}
        self._ids = itertools.count(0x7000)

    def cublasCreate_v2(self, out) -> int:
        handle = next(self._ids)
        self.handles[handle] = _Handle()
        out._obj.value = handle  # out is ctypes.byref(c_void_p)
        return CUBLAS_STATUS_SUCCESS

    def cublasDestroy_v2(self, handle) -> int:
        return CUBLAS_STATUS_SUCCESS if self.handles.pop(handle, None) else 1

    def cublasSetStream_v2(self, handle, stream_ptr) -> int:
        h = self.handles.get(handle)
        if h is None:
            return CUBLAS_STATUS_NOT_INITIALIZED
        h.stream_ptr, h.workspace = stream_ptr or 0, None  # cuBLAS: resets the workspace
        return CUBLAS_STATUS_SUCCESS

    def cublasSetWorkspace_v2(self, handle, ptr, size) -> int:
        h = self.handles.get(handle)
        if h is None:
            return CUBLAS_STATUS_NOT_INITIALIZED
        h.workspace = (ptr, size) if size else None
        return CUBLAS_STATUS_SUCCESS

    def cublasSetPointerMode_v2(self, handle, mode) -> int:
        h = self.handles.get(handle)
        if h is None:
            return CUBLAS_STATUS_NOT_INITIALIZED
        h.pointer_mode = mode
        return CUBLAS_STATUS_SUCCESS

    def cublasGetVersion_v2(self, handle, out) -> int:
        out._obj.value = self.VERSION
        return CUBLAS_STATUS_SUCCESS

    def cublasGemmEx(self, handle, *args) -> int:
        g = GemmExArgs(*args)
        h = self.handles.get(handle)
        if h is None:
            return CUBLAS_STATUS_NOT_INITIALIZED
        status = gemm_status(g, h.pointer_mode)
        if status != CUBLAS_STATUS_SUCCESS:
            return status
        self._check_capture(h)
        stream = _streams.get(h.stream_ptr)
        if stream is not None:
            stream.record(("cublasGemmEx", handle, *g))
        if g.m and g.n:
            self._gemm(g)
        return CUBLAS_STATUS_SUCCESS

    def _check_capture(self, h: _Handle) -> None:
        capturing = [s for s in _current if s.is_capturing()]
        if not capturing:
            return
        if h.stream_ptr != capturing[-1].ptr:
            raise EmuCudaError(
                "cublasGemmEx during stream capture on a handle bound to another stream: it "
                "would run once now and not be part of the graph; bind the handle "
                "(cublasSetStream_v2) to the capturing stream before capture"
            )
        if h.workspace is None:
            raise EmuCudaError(
                "cublasGemmEx during stream capture without a workspace of the caller's: cuBLAS "
                "would allocate one mid-capture; call cublasSetWorkspace_v2 before capture "
                "(after cublasSetStream_v2, which resets it)"
            )

    @staticmethod
    def _gemm(g: GemmExArgs) -> None:
        """C (m, n) = alpha op(A) (m, k) @ op(B) (k, n) + beta C, float32 sums."""
        alpha = ctypes.c_float.from_address(g.alpha).value
        beta = ctypes.c_float.from_address(g.beta).value
        c_mat = _matrix(g.c, g.c_type, g.m, g.n, g.ldc)  # (m, n) column-major
        acc = np.zeros((g.m, g.n), np.float32)
        if g.k:
            acc = alpha * (
                _op(g.a, g.a_type, g.transa, g.m, g.k, g.lda)
                @ _op(g.b, g.b_type, g.transb, g.k, g.n, g.ldb)
            )
        if beta:
            acc += beta * c_mat.astype(np.float32)
        c_mat[...] = acc.astype(c_mat.dtype)


def _op(ptr: int, type_: int, trans: int, rows: int, cols: int, ld: int) -> np.ndarray:
    """op(X) (rows, cols) in float32: X as stored, or its transpose (stored (cols, rows))."""
    if trans == CUBLAS_OP_T:
        return _matrix(ptr, type_, cols, rows, ld).T.astype(np.float32)
    return _matrix(ptr, type_, rows, cols, ld).astype(np.float32)


def gemm_status(g: GemmExArgs, pointer_mode: int) -> int:
    """What cuBLAS answers before computing: the modes the engine uses, sizes, types, ld's."""
    if g.compute != CUBLAS_COMPUTE_32F or pointer_mode != 0:
        return CUBLAS_STATUS_NOT_SUPPORTED
    if min(g.m, g.n, g.k) < 0 or g.transa not in (0, 1) or g.transb not in (0, 1):
        return CUBLAS_STATUS_INVALID_VALUE
    if g.a_type != g.b_type or g.a_type not in TYPES or g.c_type not in (g.a_type, CUDA_R_32F):
        return CUBLAS_STATUS_NOT_SUPPORTED
    a_rows = g.k if g.transa == CUBLAS_OP_T else g.m  # A as stored, column-major
    b_rows = g.n if g.transb == CUBLAS_OP_T else g.k
    if g.ldc < max(1, g.m) or g.lda < max(1, a_rows) or g.ldb < max(1, b_rows):
        return CUBLAS_STATUS_INVALID_VALUE
    return CUBLAS_STATUS_SUCCESS


class EmulatedCupyCublas:
    """CuPy's ``cupy.cuda.cublas`` as far as its capture rule goes: every call first binds CuPy's
    handle to the current stream (``setStream``), which raises NotImplementedError while that
    stream captures (cupy_backends/cuda/libs/cublas.pyx, CuPy 14.2)."""

    def __init__(self, lib: EmulatedCublas):
        self.lib = lib
        out = ctypes.c_void_p()
        lib.cublasCreate_v2(ctypes.byref(out))
        self.handle = out.value

    def setStream(self, handle: int, stream_ptr: int) -> None:
        if stream_is_capturing(stream_ptr):
            raise NotImplementedError(CUPY_CUBLAS_REFUSAL)
        self.lib.cublasSetStream_v2(handle, stream_ptr)

    def setPointerMode(self, handle: int, mode: int) -> None:
        self.lib.cublasSetPointerMode_v2(handle, mode)

    def gemmEx(self, handle: int, *args) -> None:
        """cublasGemmEx's arguments after the handle (``GemmExArgs``), as CuPy takes them."""
        stream = current_stream()
        self.setStream(handle, stream.ptr if stream is not None else 0)
        status = self.lib.cublasGemmEx(handle, *args)
        if status:
            raise RuntimeError(f"cublasGemmEx: status {status}")
