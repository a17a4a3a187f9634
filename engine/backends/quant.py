"""Weights in fewer bytes: the int8 and Q8_0 quantizations (``--quantization int8|q8_0``) and
the matrices the cpu backend keeps as bf16, int8 or Q8_0 (``QuantWeight``; ``cpu_ops.matmul``
multiplies them).

int8 is weight-only and symmetric: one float32 scale per output channel (a column of the
(in, out) matrix), ``absmax / 127``, each weight rounded to the nearest ``q * scale`` with q in
[-127, 127]; a column of zeros has scale 0 and q 0. Activations and accumulation stay float32.

Q8_0 is llama.cpp's 8-bit format (GGUF type 8): each output channel's weights in blocks of 32
consecutive inputs, one float16 scale per block, ``d = absmax / 127`` and ``q = round(w / d)``
(ties away from zero, as ggml's reference quantizer). Kept transposed, (N, K) int8 and (N, K/32)
float16, the layout a GGUF file stores, so its tensors are used as they are. The cpu backend
quantizes activations the same way (blocks of 32, float32 scales) and multiplies with integer
dot products.
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


QK8_0 = 32  # weights per Q8_0 block


def quantize_q8_0(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w (K, N), K a multiple of 32 -> (q (N, K) int8, d (N, K/32) float16): w.T ~ q * d."""
    k, n = w.shape
    if k % QK8_0:
        raise ValueError(f"q8_0: a matrix's input size must be a multiple of 32, got ({k}, {n})")
    blocks = np.ascontiguousarray(np.asarray(w, F32).T).reshape(n, k // QK8_0, QK8_0)
    d = np.abs(blocks).max(axis=2) / np.float32(127)  # (N, K/32) float32
    inv = np.divide(1, d, out=np.zeros_like(d), where=d > 0)
    r = blocks * inv[:, :, None]  # (N, K/32, 32) float32, |r| <= 127
    q = np.trunc(r)
    q += np.sign(r) * (np.abs(r - q) >= 0.5)  # C's roundf: half away from zero (exact)
    return q.astype(np.int8).reshape(n, k), d.astype(np.float16)


def dequantize_q8_0(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """(N, K) int8, (N, K/32) float16 -> (K, N) float32 q * d."""
    n, k = q.shape
    blocks = q.reshape(n, k // QK8_0, QK8_0).astype(F32) * d.astype(F32)[:, :, None]
    return np.ascontiguousarray(blocks.reshape(n, k).T)


@dataclass
class QuantWeight:
    """A (K, N) weight matrix in fewer bytes. kind "bf16": ``data`` (K, N) ml_dtypes.bfloat16,
    the float32 values exactly; kind "int8": ``data`` (K, N) int8 and ``scales`` (N,) float32;
    kind "q8_0": ``data`` (N, K) int8 (transposed) and ``scales`` (N, K/32) float16."""

    kind: str
    data: np.ndarray  # (K, N); q8_0: (N, K)
    scales: np.ndarray | None = None  # int8: (N,); q8_0: (N, K/32)

    @property
    def shape(self) -> tuple[int, int]:
        """(K, N): the matrix it stands for."""
        return self.data.shape[::-1] if self.kind == "q8_0" else self.data.shape

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (0 if self.scales is None else self.scales.nbytes)

    def dequantize(self) -> np.ndarray:
        """(K, N) float32: the values the products use."""
        if self.kind == "int8":
            return dequantize_int8(self.data, self.scales)
        if self.kind == "q8_0":
            return dequantize_q8_0(self.data, self.scales)
        return self.data.astype(F32)


def to_bf16(w: np.ndarray) -> QuantWeight:
    """(K, N) float32 whose values are bf16 already (pack_weights rounded them) -> bf16 bits."""
    from .base import numpy_dtype

    data = np.ascontiguousarray(w).astype(numpy_dtype("bfloat16"))
    return QuantWeight("bf16", data)


def to_int8(w: np.ndarray) -> QuantWeight:
    return QuantWeight("int8", *quantize_int8(w))


def to_q8_0(w: np.ndarray) -> QuantWeight:
    return QuantWeight("q8_0", *quantize_q8_0(w))


QUANTIZERS = {"int8": to_int8, "q8_0": to_q8_0}  # --quantization -> (K, N) float32 -> QuantWeight
