"""Matrix products for the device backend: ``out = x @ w.T`` with weights kept as (out, in).

Every product over a plain weight (a GGUF matrix kept in blocks: engine/backends/cupy_blocks.py),
in every dtype, is one cuBLAS ``GemmEx`` with float32 accumulation (CUBLAS_COMPUTE_32F: plain
float32 math for float32, no TF32) on the device's own handle
(``engine.kernels.cublas.Cublas``), so a CUDA graph can capture it. Operands are CUDA_R_32F,
CUDA_R_16F or CUDA_R_16BF; a bfloat16 array may be an ``ml_dtypes.bfloat16`` array or 16-bit storage
(``uint16``); ``out`` may be float32 (the logits) while the operands are 16-bit.

cuBLAS is column-major. A row-major (M, N) ``out`` is the column-major (N, M) ``out.T``, and
``out.T = w @ x.T``: with ``w`` (N, K) row-major read as the column-major (K, N) matrix, that is
``gemm(op(A)=T, op(B)=N, m=N, n=M, k=K, A=w, lda=K, B=x, ldb=K, C=out, ldc=N)``. ``GemmPlan``
holds those numbers (``columns_plan``: the same with ldc a wider out's width, for a product
that writes some of its columns); the emulated cuBLAS (``engine.emulation.runtime``) carries a
plan out on raw host memory exactly as cuBLAS reads it, so every CPU run checks them.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass
from typing import NamedTuple

import ml_dtypes
import numpy as np

# CUDA / cuBLAS enum values (cudaDataType_t, cublasComputeType_t, cublasOperation_t, algo).
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_GEMM_DEFAULT = -1

BF16 = np.dtype(ml_dtypes.bfloat16)
CUDA_TYPES = {
    np.dtype(np.float32): CUDA_R_32F,
    np.dtype(np.float16): CUDA_R_16F,
    BF16: CUDA_R_16BF,
    np.dtype(np.uint16): CUDA_R_16BF,  # bfloat16 held as 16-bit storage
}


@dataclass(frozen=True)
class GemmPlan:
    """The arguments of one column-major cuBLAS call computing row-major ``out = x @ w.T``."""

    transa: int
    transb: int
    m: int
    n: int
    k: int
    lda: int
    ldb: int
    ldc: int
    a_type: int  # w's data type
    b_type: int  # x's data type
    c_type: int  # out's data type
    compute: int = CUBLAS_COMPUTE_32F
    algo: int = CUBLAS_GEMM_DEFAULT

    def ex_args(self, a: int, b: int, c: int, alpha: int, beta: int) -> GemmExArgs:
        """cublasGemmEx's arguments after the handle, for operands and scalars at these
        addresses."""
        p = self
        return GemmExArgs(
            p.transa,
            p.transb,
            p.m,
            p.n,
            p.k,
            alpha,
            a,
            p.a_type,
            p.lda,
            b,
            p.b_type,
            p.ldb,
            beta,
            c,
            p.c_type,
            p.ldc,
            p.compute,
            p.algo,
        )


class GemmExArgs(NamedTuple):
    """``cublasGemmEx(handle, *args)``: C = alpha op(A) op(B) + beta C, column-major."""

    transa: int
    transb: int
    m: int
    n: int
    k: int
    alpha: int  # address of a float32
    a: int  # addresses of the matrices
    a_type: int
    lda: int
    b: int
    b_type: int
    ldb: int
    beta: int
    c: int
    c_type: int
    ldc: int
    compute: int
    algo: int


def check_gemm(x, w, out) -> tuple[int, int, int]:
    """(M, N, K) for x (M, K), w (N, K), out (M, N), all C-contiguous; ValueError otherwise."""
    if x.ndim != 2 or w.ndim != 2 or out.ndim != 2:
        raise ValueError(f"gemm: x, w, out must be 2-D, got {x.shape}, {w.shape}, {out.shape}")
    (M, K), N = x.shape, w.shape[0]
    if w.shape[1] != K or out.shape != (M, N):
        raise ValueError(
            f"gemm: want x (M, K), w (N, K), out (M, N); got {x.shape}, {w.shape}, {out.shape}"
        )
    if np.dtype(x.dtype) != np.dtype(w.dtype):
        raise ValueError(f"gemm: x and w must share a dtype, got {x.dtype} and {w.dtype}")
    for name, a in (("x", x), ("w", w), ("out", out)):
        if not a.flags.c_contiguous:
            raise ValueError(f"gemm: {name} must be C-contiguous, got strides {a.strides}")
    return M, N, K


def gemm_plan(x, w, out) -> GemmPlan:
    """The cuBLAS arguments for ``out = x @ w.T`` (see the module docstring)."""
    M, N, K = check_gemm(x, w, out)
    for name, a in (("x", x), ("out", out)):
        if np.dtype(a.dtype) not in CUDA_TYPES:
            raise ValueError(f"gemm: {name} dtype {a.dtype} has no cuBLAS type")
    t_in, t_out = CUDA_TYPES[np.dtype(x.dtype)], CUDA_TYPES[np.dtype(out.dtype)]
    if t_out not in (t_in, CUDA_R_32F):  # what gemmEx accepts with CUBLAS_COMPUTE_32F
        raise ValueError(f"gemm: out must be {x.dtype} or float32 for {x.dtype} operands")
    return GemmPlan(CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, K, K, N, t_in, t_in, t_out)


def columns_plan(x, w, out, col: int) -> GemmPlan:
    """The cuBLAS arguments for ``out[:, col:col + N] = x @ w.T``, w (N, K), into a wider
    C-contiguous out (M, ldo): the same call as ``gemm_plan``'s with ldc the full width (the
    caller offsets C's address by ``col`` elements)."""
    if getattr(out, "ndim", 0) != 2 or getattr(w, "ndim", 0) != 2 or x.ndim != 2:
        raise ValueError("gemm: x, w, out must be 2-D")
    (M, ldo), N = out.shape, w.shape[0]
    if out.shape[0] != x.shape[0] or not 0 <= col <= ldo - N:
        raise ValueError(
            f"gemm: columns {col}..{col + N} of out {tuple(out.shape)} for x {tuple(x.shape)}"
        )
    if not out.flags.c_contiguous:
        raise ValueError(f"gemm: out must be C-contiguous, got strides {out.strides}")
    head = gemm_plan(x, w, _Shape((M, N), out.dtype))
    return dataclasses.replace(head, ldc=ldo)


class _Shape:
    """A C-contiguous stand-in of an array's shape and dtype (what ``gemm_plan`` reads)."""

    ndim = 2

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype
        self.flags = types.SimpleNamespace(c_contiguous=True)


class Gemm:
    """``gemm(x, w, out)``: out = x @ w.T on a device, through its cuBLAS handle;
    ``gemm.columns(x, w, out, col)``: w's rows give columns col.. of a wider out.

    ``ptr(a)`` is the device address of an array (CuPy's ``a.data.ptr``; a host address on the
    emulated device). No temporaries, no host synchronisation: a graph can capture it."""

    def __init__(self, cublas, ptr):
        self.cublas, self.ptr = cublas, ptr

    def __call__(self, x, w, out) -> None:
        plan = gemm_plan(x, w, out)
        if plan.m and plan.n:  # an empty out: nothing to do (and ldc=0 would be invalid)
            self.cublas.gemm(plan, self.ptr(w), self.ptr(x), self.ptr(out))

    def columns(self, x, w, out, col: int) -> None:
        plan = columns_plan(x, w, out, col)
        if plan.m and plan.n:
            at = self.ptr(out) + col * np.dtype(out.dtype).itemsize
            self.cublas.gemm(plan, self.ptr(w), self.ptr(x), at)
