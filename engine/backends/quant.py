"""Weights in fewer bytes: the int8 quantization (``--quantization int8``) and the matrices the
cpu backend keeps as bf16 or int8 (``QuantWeight``; ``cpu_ops.matmul`` multiplies them).

int8 is weight-only and symmetric: one float32 scale per output channel (a column of the
(in, out) matrix), ``absmax / 127``, each weight rounded to the nearest ``q * scale`` with q in
[-127, 127]; a column of zeros has scale 0 and q 0. Activations and accumulation stay float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

F32 = np.dtype(np.float32)


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w (K, N) -> (q (K, N) int8, scales (N,) float32), w ~ q * scales, |w - q*s| <= s/2."""
    w = np.asarray(w, F32)
    scales = (np.abs(w).max(axis=0) / np.float32(127)).astype(F32)  # (N,)
    safe = np.where(scales > 0, scales, np.float32(1))  # a zero column: q = 0, nothing divided
    r = np.divide(w, safe)  # (K, N) float32, rounded and clipped in place
    np.clip(np.rint(r, out=r), -127, 127, out=r)
    return r.astype(np.int8), scales


def dequantize_int8(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """(K, N) int8, (N,) float32 -> (K, N) float32 q * scales."""
    return q.astype(F32) * scales


@dataclass
class QuantWeight:
    """A (K, N) weight matrix in fewer bytes. kind "bf16": ``data`` (K, N) ml_dtypes.bfloat16,
    the float32 values exactly; kind "int8": ``data`` (K, N) int8 and ``scales`` (N,) float32."""

    kind: str
    data: np.ndarray  # (K, N)
    scales: np.ndarray | None = None  # (N,) int8 only

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (0 if self.scales is None else self.scales.nbytes)

    def dequantize(self) -> np.ndarray:
        """(K, N) float32: the values the products use."""
        if self.kind == "int8":
            return dequantize_int8(self.data, self.scales)
        return self.data.astype(F32)


def to_bf16(w: np.ndarray) -> QuantWeight:
    """(K, N) float32 whose values are bf16 already (pack_weights rounded them) -> bf16 bits."""
    from .base import numpy_dtype

    data = np.ascontiguousarray(w).astype(numpy_dtype("bfloat16"))
    return QuantWeight("bf16", data)


def to_int8(w: np.ndarray) -> QuantWeight:
    return QuantWeight("int8", *quantize_int8(w))
