"""Checked launches of the GGUF block kernels (cuda_src/gguf_matvec.cu, gguf_dequantize.cu):
``GgufLaunches`` is a part of ``Kernels`` (its ``_fn`` loader and ``_empty``).

A weight is a GGUF matrix W (N, K) kept as the file stores it: ``w`` (N, bytes of a row) uint8
on the device, ``kind`` one of GGUF_KINDS, aligned as the kernels load it (GGUF_ALIGN: Q4_K's
header in 4-byte words, every other format's float16 factors in 2-byte ones).
``gguf_matvec`` multiplies a batch of up to GGUF_MATVEC_MAX_BATCH rows of x by it directly;
``gguf_dequantize`` widens it into a (N, K) tile in x's dtype for the cuBLAS product of a
larger batch.
"""

from __future__ import annotations

import numpy as np

from engine.utils import cdiv

# kind -> (gguf.cuh format id, values per block, bytes per block, units per block: kUnits)
GGUF_KINDS = {
    "q8_0": (0, 32, 34, 32),
    "q4_0": (1, 32, 18, 16),
    "q5_0": (2, 32, 22, 16),
    "q4_k": (3, 256, 144, 32),
    "q6_k": (4, 256, 210, 32),
}
GGUF_ALIGN = {kind: 4 if kind == "q4_k" else 2 for kind in GGUF_KINDS}
GGUF_MATVEC_ROWS = 4  # gguf_matvec.cu kMatvecWarps: one warp per output row
GGUF_MATVEC_MAX_BATCH = 8  # gguf_matvec.cu kMaxBatch
GGUF_DEQUANT_THREADS = 256
_SUFFIX = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
i32 = np.int32


def gguf_row_bytes(kind: str, K: int) -> int:
    """The bytes of a row of K values in ``kind``; ValueError if K is not whole blocks."""
    if kind not in GGUF_KINDS:
        raise ValueError(f"gguf: kind must be one of {', '.join(GGUF_KINDS)}, got {kind!r}")
    _, per, size, _ = GGUF_KINDS[kind]
    if K <= 0 or K % per:
        raise ValueError(f"gguf: {kind} rows must be whole blocks of {per} values, got K={K}")
    return K // per * size


def _address(a) -> int:
    iface = getattr(a, "__cuda_array_interface__", None) or a.__array_interface__
    return int(iface["data"][0])


def _check_array(op: str, name: str, a, shape: tuple, dtype=None) -> None:
    if not hasattr(a, "shape") or tuple(a.shape) != shape:
        got = tuple(a.shape) if hasattr(a, "shape") else type(a).__name__
        raise ValueError(f"{op}: {name} must have shape {shape}, got {got}")
    if dtype is not None and np.dtype(a.dtype) != np.dtype(dtype):
        raise ValueError(f"{op}: {name} must be {np.dtype(dtype).name}, got {a.dtype}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{op}: {name} must be C-contiguous, got strides {a.strides}")


def _check_blocks(op: str, w, kind: str, N: int, K: int) -> int:
    """w must be (N, row bytes) uint8, aligned as GGUF_ALIGN says; the format id."""
    _check_array(op, "w", w, (N, gguf_row_bytes(kind, K)), np.uint8)
    if _address(w) % GGUF_ALIGN[kind]:
        raise ValueError(f"{op}: {kind} blocks must start on a {GGUF_ALIGN[kind]}-byte boundary")
    return GGUF_KINDS[kind][0]


def _suffix(op: str, a) -> str:
    name = np.dtype(a.dtype).name
    if name not in _SUFFIX:
        raise ValueError(f"{op}: dtype must be one of float32, float16, bfloat16, got {name}")
    return _SUFFIX[name]


class GgufLaunches:
    def gguf_matvec(self, out, x, w, kind: str, col: int = 0) -> None:
        """out[:, col:col+N] = x (M, K) @ W^T, M <= GGUF_MATVEC_MAX_BATCH, W (N, K) in its
        blocks ``w``; out (M, ldo) in x's dtype or float32 (the logits)."""
        op = "gguf_matvec"
        M, K = x.shape
        N = w.shape[0] if hasattr(w, "shape") else 0
        fmt = _check_blocks(op, w, kind, N, K)
        _check_array(op, "x", x, (M, K))
        if not 1 <= M <= GGUF_MATVEC_MAX_BATCH:
            raise ValueError(f"{op}: x must have 1 to {GGUF_MATVEC_MAX_BATCH} rows, got {M}")
        ldo = out.shape[1] if getattr(out, "ndim", 0) == 2 else -1
        if not 0 <= col <= ldo - N:
            raise ValueError(f"{op}: columns {col}..{col + N} do not fit out of width {ldo}")
        _check_array(op, "out", out, (M, ldo))
        out_f32 = np.dtype(out.dtype) == np.float32
        if not out_f32 and np.dtype(out.dtype) != np.dtype(x.dtype):
            raise ValueError(f"{op}: out must be {x.dtype} or float32, got {out.dtype}")
        if N:
            fn = self._fn(op, f"{op}_{_suffix(op, x)}")
            args = (out, x, w, i32(N), i32(K), i32(M), i32(ldo), i32(col), i32(fmt))
            fn((cdiv(N, GGUF_MATVEC_ROWS),), (32 * GGUF_MATVEC_ROWS,), args + (i32(out_f32),))

    def gguf_dequantize(self, out, w, kind: str) -> None:
        """out (N, K) = W's values in out's dtype, W (N, K) in its blocks ``w``."""
        op = "gguf_dequantize"
        N, K = out.shape
        fmt = _check_blocks(op, w, kind, N, K)
        _check_array(op, "out", out, (N, K))
        if N:
            _, per, _, units = GGUF_KINDS[kind]
            grid = (cdiv(N * (K // per) * units, GGUF_DEQUANT_THREADS),)
            fn = self._fn(op, f"{op}_{_suffix(op, out)}")
            fn(grid, (GGUF_DEQUANT_THREADS,), (out, w, i32(N), i32(K), i32(fmt)))
