"""Weights in fewer bytes: the quantizations of ``--quantization`` (int8, q8_0, q4_0, q4_1) and
the matrices the cpu backend keeps as bf16, int8 or GGUF blocks (``QuantWeight``;
``cpu_ops.matmul`` multiplies them).

int8 is weight-only and symmetric: one float32 scale per output channel (a column of the
(in, out) matrix), ``absmax / 127``, each weight rounded to the nearest ``q * scale`` with q in
[-127, 127]; a column of zeros has scale 0 and q 0. Activations and accumulation stay float32.

Q8_0, Q4_0 and Q4_1 are llama.cpp's block formats (GGUF types 8, 2, 3): each output channel's
weights in blocks of 32 consecutive inputs with float16 scales, computed as ggml's reference
quantizers compute them:
  Q8_0: d = absmax / 127, q = round(w / d) (half away from zero) in [-127, 127], w = q d;
  Q4_0: d = -(the value of largest magnitude) / 8, q = trunc(w / d + 8.5) in [0, 15],
        w = (q - 8) d;
  Q4_1: d = (max - min) / 15, m = min, q = trunc((w - m) / d + 0.5) in [0, 15], w = q d + m.
Kept transposed as a GGUF file stores them: ``data`` (N, K/32 * bytes of a block's q) uint8
(Q4: byte j of a block holds q[j] in its low nibble, q[j + 16] in its high one), ``scales``
(N, K/32 * scales of a block) float16 (Q4_1: d, m per block). The cpu backend quantizes x the
same way as Q8_0 and multiplies with integer dot products (cpu_src/matmul_blocks.cpp).

Q4_Z ("q4_z") is a 4-bit checkpoint's (AWQ, GPTQ) groups as the loader repacks them
(model_loader/int4_checkpoint.py): Q4_1's layout with the group's zero point z, an integer
0..16 held exactly in float16, in place of m: w = (q - z) d. (Q4_1's m = -d z would have to
round in float16.) It is not a ``--quantization``: nothing quantizes to it here.

An FP8 checkpoint's matrices are kind "fp8": ``data`` (N, K) uint8, the float8_e4m3fn bytes,
``scales`` (N, nbk) float32, one per row and run of K / nbk inputs; w = float32(q) * s
(model_loader/fp8_checkpoint.py; cpu_src/matmul_fp8.cpp multiplies them, x in float32).

A GGUF file's k-quant, 5-bit, MXFP4 and IQ4 matrices (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q5_0,
Q5_1, MXFP4, IQ4_NL, IQ4_XS: RAW_FORMATS) are kept as the file's bytes, ``data`` (N, bytes of
a row) uint8, no scales (model_loader.kquants lays the blocks out and dequantizes them;
cpu_src/matmul_kquants.cpp, matmul_q5.cpp, matmul_mxfp4.cpp and matmul_iq4.cpp multiply them);
a gpt-oss checkpoint's MXFP4 matrices come repacked into the same blocks (model_loader.mxfp4).
A fused matrix whose parts are stored in different types (a Q4_K_M file's Q4_K q and k beside
its Q6_K v) is kind "parts": ``parts`` the QuantWeights (or float32 arrays) of its runs of
columns, in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

F32 = np.dtype(np.float32)


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w (K, N) -> (q (K, N) int8, scales (N,) float32), w ~ q * scales, |w - q*s| <= s/2."""
    w = np.ascontiguousarray(w, F32)  # q comes out row-major, as the kernels read it
    scales = (np.abs(w).max(axis=0) / np.float32(127)).astype(F32)  # (N,)
    safe = np.where(scales > 0, scales, np.float32(1))  # a zero column: q = 0, nothing divided
    r = np.divide(w, safe)  # (K, N) float32, rounded and clipped in place
    np.clip(np.rint(r, out=r), -127, 127, out=r)
    return r.astype(np.int8), scales


def dequantize_int8(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """(K, N) int8, (N,) float32 -> (K, N) float32 q * scales."""
    return q.astype(F32) * scales


QK = 32  # weights per block of the GGUF formats
BLOCK_FORMATS = ("q8_0", "q4_0", "q4_1")  # QuantWeight kinds, in matmul_blocks' format order
KEPT_BLOCKS = (*BLOCK_FORMATS, "q4_z")  # and the kind only a checkpoint brings (format 3)
# the kinds kept as the file's bytes: matmul_kquants' first formats, matmul_q5's, MXFP4,
# matmul_iq4's, then matmul_kquants' 2- and 3-bit ones
RAW_FORMATS = ("q4_k", "q5_k", "q6_k", "q5_0", "q5_1", "mxfp4", "iq4_nl", "iq4_xs")
RAW_FORMATS += ("q2_k", "q3_k")
IQ4_FORMATS = ("iq4_nl", "iq4_xs")  # matmul_iq4's formats, in order
KQUANT_FORMATS = ("q4_k", "q5_k", "q6_k", "q2_k", "q3_k")  # matmul_kquants' formats, in order


def _blocks(w: np.ndarray, fmt: str) -> np.ndarray:
    """(K, N) -> (N, K/32, 32) float32, each output channel's blocks."""
    k, n = w.shape
    if k % QK:
        raise ValueError(f"{fmt}: a matrix's input size must be a multiple of 32, got ({k}, {n})")
    return np.ascontiguousarray(np.asarray(w, F32).T).reshape(n, k // QK, QK)


def _inverse(d: np.ndarray) -> np.ndarray:
    return np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """(N, K/32, 32) in [0, 15] -> (N, K/32 * 16) uint8: byte j = q[j] | q[j + 16] << 4."""
    q = q.astype(np.uint8)
    return (q[..., :16] | (q[..., 16:] << np.uint8(4))).reshape(q.shape[0], -1)


def _unnibble(data: np.ndarray) -> np.ndarray:
    """(N, K/32 * 16) uint8 -> (N, K/32, 32) float32 q."""
    b = data.reshape(data.shape[0], -1, 16)
    return np.concatenate([b & np.uint8(15), b >> np.uint8(4)], axis=2).astype(F32)


def quantize_q8_0(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w (K, N), K a multiple of 32 -> (q (N, K) int8, d (N, K/32) float16): w.T ~ q * d."""
    blocks = _blocks(w, "q8_0")
    n, nb, _ = blocks.shape
    d = np.abs(blocks).max(axis=2) / np.float32(127)  # (N, K/32) float32
    r = blocks * _inverse(d)[:, :, None]  # (N, K/32, 32) float32, |r| <= 127
    q = np.trunc(r)
    q += np.sign(r) * (np.abs(r - q) >= 0.5)  # C's roundf: half away from zero (exact)
    return q.astype(np.int8).reshape(n, nb * QK), d.astype(np.float16)


def quantize_q4_0(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w (K, N) -> (nibbles (N, K/2) uint8, d (N, K/32) float16): w.T ~ (q - 8) * d."""
    blocks = _blocks(w, "q4_0")
    i = np.abs(blocks).argmax(axis=2)[:, :, None]  # the first of the largest magnitude
    d = np.take_along_axis(blocks, i, axis=2)[:, :, 0] / np.float32(-8)  # (N, K/32)
    d[d == 0] = np.float32(-0.0)  # ggml's 0 / -8: kept when a block of zeros comes back as -0
    q = np.trunc(blocks * _inverse(d)[:, :, None] + np.float32(8.5))
    return _nibbles(np.clip(q, 0, 15)), d.astype(np.float16)


def quantize_q4_1(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w (K, N) -> (nibbles (N, K/2) uint8, (d, m) (N, K/32 * 2) float16): w.T ~ q * d + m."""
    blocks = _blocks(w, "q4_1")
    lo, hi = blocks.min(axis=2), blocks.max(axis=2)  # (N, K/32)
    d = (hi - lo) / np.float32(15)
    q = np.trunc((blocks - lo[:, :, None]) * _inverse(d)[:, :, None] + np.float32(0.5))
    scales = np.stack([d, lo], axis=2).astype(np.float16)  # (N, K/32, 2)
    return _nibbles(np.clip(q, 0, 15)), scales.reshape(len(scales), -1)


def dequantize_blocks(kind: str, data: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """A block format's (data, scales) -> (K, N) float32 values."""
    n = data.shape[0]
    s = scales.astype(F32).reshape(n, -1, 1 if kind in ("q8_0", "q4_0") else 2)  # (N, K/32, .)
    if kind == "q8_0":
        v = data.reshape(n, -1, QK).astype(F32) * s
    elif kind == "q4_0":
        v = (_unnibble(data) - np.float32(8)) * s
    elif kind == "q4_z":  # (q - z) d: both exact in float32
        v = (_unnibble(data) - s[:, :, 1:]) * s[:, :, :1]
    else:
        v = _unnibble(data) * s[:, :, :1] + s[:, :, 1:]
    return np.ascontiguousarray(v.reshape(n, -1).T)


def dequantize_fp8(data: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """(N, K) e4m3 bytes, (N, nbk) float32 -> (K, N) float32 e4m3(q) * s."""
    import ml_dtypes

    n, k = data.shape
    v = data.view(ml_dtypes.float8_e4m3fn).astype(F32).reshape(n, scales.shape[1], -1)
    return np.ascontiguousarray((v * scales[:, :, None]).reshape(n, k).T)


PANEL = 16  # columns of a float32 panel


@dataclass
class QuantWeight:
    """A (K, N) weight matrix in fewer bytes, or in another order. kind "bf16": ``data`` (K, N)
    ml_dtypes.bfloat16, the float32 values exactly; kind "int8": ``data`` (K, N) int8 and
    ``scales`` (N,) float32; a block format ("q8_0", "q4_0", "q4_1"): ``data`` and ``scales``
    per output channel, as the module's docstring lays them out; kind "panels": ``data``
    (N/16, K, 16) float32, the matrix's columns 16 at a time, each panel's rows one after
    another (the order cpu_src/matmul_panels.cpp reads them in); kind "int8_panels": int8's
    values so, and its ``scales`` (N,); kind "bf16_panels": ``data``
    (N/16, K/2, 32) bf16, the same with each panel's rows in pairs, the pair's two values of a
    column side by side (cpu_src/matmul_panels_bf16.cpp, which rounds x to bf16 as well)."""

    kind: str
    data: np.ndarray | None  # (K, N); a block format: (N, bytes); "parts": None
    scales: np.ndarray | None = None  # int8: (N,); a block format: (N, K/32 * scales a block)
    parts: tuple = ()  # "parts": (K, N_i) QuantWeights or float32 arrays, N = sum(N_i)

    @property
    def shape(self) -> tuple[int, int]:
        """(K, N): the matrix it stands for."""
        if self.kind == "parts":
            return self.parts[0].shape[0], sum(p.shape[1] for p in self.parts)
        if self.kind in RAW_FORMATS:
            from model_loader.kquants import row_values

            return row_values(self.kind.upper(), self.data.shape[1]), self.data.shape[0]
        if self.kind == "fp8":
            return self.data.shape[::-1]
        if self.kind in KEPT_BLOCKS:
            n, nbytes = self.data.shape
            return (nbytes if self.kind == "q8_0" else 2 * nbytes), n
        if self.kind in ("panels", "int8_panels"):
            p, k, _ = self.data.shape
            return k, p * PANEL
        if self.kind == "bf16_panels":
            p, j, _ = self.data.shape
            return 2 * j, p * PANEL
        return self.data.shape

    @property
    def nbytes(self) -> int:
        if self.kind == "parts":
            return sum(p.nbytes for p in self.parts)
        return self.data.nbytes + (0 if self.scales is None else self.scales.nbytes)

    def dequantize(self) -> np.ndarray:
        """(K, N) float32: the values the products use."""
        if self.kind == "parts":
            return np.concatenate([np.asarray(_values(p), F32) for p in self.parts], axis=1)
        if self.kind in RAW_FORMATS:
            from model_loader.kquants import dequantize

            return np.ascontiguousarray(dequantize(self.data, self.kind.upper()).T)
        if self.kind == "int8":
            return dequantize_int8(self.data, self.scales)
        if self.kind == "fp8":
            return dequantize_fp8(self.data, self.scales)
        if self.kind in KEPT_BLOCKS:
            return dequantize_blocks(self.kind, self.data, self.scales)
        if self.kind == "panels":
            return from_panels(self.data)
        if self.kind == "int8_panels":
            return dequantize_int8(from_panels(self.data), self.scales)
        if self.kind == "bf16_panels":
            return from_bf16_panels(self.data)
        return self.data.astype(F32)


def _values(p) -> np.ndarray:
    return p.dequantize() if isinstance(p, QuantWeight) else p


def keep_stored(w) -> QuantWeight | None:
    """A (K, N) GGUF matrix kept in blocks (model_loader.gguf_blocks.TransposedBlocks) as its
    QuantWeight: the file's bytes (a k-quant, 5-bit or MXFP4 type; Q8_0/Q4_0/Q4_1 split into q and
    scales), a fused one's parts each so. None for any other matrix, and for a table or LM
    head kept in blocks only to be read by row (a file with no k-quants)."""
    stored = getattr(w, "stored", None)
    parts = getattr(stored, "parts", [stored])
    if stored is None or not any(getattr(p, "as_stored", False) for p in parts):
        return None
    kept = tuple(_kept_part(p) for p in parts)
    return kept[0] if len(kept) == 1 else QuantWeight("parts", None, parts=kept)


def _kept_part(p):
    """One stored (N_i, K) part -> (K, N_i): its QuantWeight, or float32 for a part stored
    wider."""
    if not hasattr(p, "qtype"):
        return np.ascontiguousarray(np.asarray(p, F32).T)
    if p.kind in RAW_FORMATS:
        return QuantWeight(p.kind, np.ascontiguousarray(p.raw))
    return QuantWeight(p.kind, *p.blocks())


def bytes_by_kind(arrays) -> dict[str, int]:
    """Weights (arrays, QuantWeights, GGUF BlockMatrix tables) -> bytes held per kind
    ("float32", "q4_k", ...; a "parts" weight counted by its parts' kinds)."""
    out: dict[str, int] = {}
    for a in arrays:
        if isinstance(a, QuantWeight) and a.kind == "parts":
            for kind, n in bytes_by_kind(a.parts).items():
                out[kind] = out.get(kind, 0) + n
            continue
        kind = getattr(a, "kind", None) or np.dtype(a.dtype).name
        out[kind] = out.get(kind, 0) + int(a.nbytes)
    return out


def to_bf16(w: np.ndarray) -> QuantWeight:
    """(K, N) float32 whose values are bf16 already (pack_weights rounded them), or bf16 itself
    (a view of the checkpoint's LM head) -> bf16 bits, in one copy."""
    from engine.backends.base import numpy_dtype

    data = np.ascontiguousarray(w, dtype=numpy_dtype("bfloat16"))
    return QuantWeight("bf16", data)


def to_panels(w: np.ndarray) -> QuantWeight:
    """(K, N) float32 (or int8), N a multiple of 16 -> its (N/16, K, 16) panels: the same
    values."""
    k, n = w.shape
    if n % PANEL:
        raise ValueError(f"panels: a matrix's output size must be a multiple of 16, got ({k}, {n})")
    panels = w.reshape(k, n // PANEL, PANEL).transpose(1, 0, 2)  # a view, any layout
    dtype = np.int8 if w.dtype == np.int8 else F32
    return QuantWeight("panels", np.ascontiguousarray(panels, dtype))


def to_int8_panels(w: np.ndarray) -> QuantWeight:
    """(K, N) float32, N a multiple of 16 -> int8 (quantize_int8's values and scales) with the
    values in (N/16, K, 16) panels."""
    q = quantize(w, "int8")
    return QuantWeight("int8_panels", to_panels(q.data).data, q.scales)


def to_bf16_panels(w: np.ndarray) -> QuantWeight:
    """(K, N) float32 whose values are bf16 already, K even and N a multiple of 16 -> its
    (N/16, K/2, 32) bf16 panels: for each pair of rows, the 16 columns' two values side by side."""
    k, n = w.shape
    if k % 2 or n % PANEL:
        raise ValueError(f"bf16 panels: a matrix must be (even, a multiple of 16), got ({k}, {n})")
    from engine.backends.base import numpy_dtype

    pairs = w.reshape(k // 2, 2, n // PANEL, PANEL)  # (K/2, 2, P, 16): a view, any layout
    panels = np.ascontiguousarray(pairs.transpose(2, 0, 3, 1), dtype=numpy_dtype("bfloat16"))
    return QuantWeight("bf16_panels", panels.reshape(n // PANEL, k // 2, 2 * PANEL))


def from_bf16_panels(panels: np.ndarray) -> np.ndarray:
    """(N/16, K/2, 32) bf16 -> (K, N) float32."""
    p, j, _ = panels.shape
    pairs = panels.reshape(p, j, PANEL, 2).transpose(1, 3, 0, 2)  # (K/2, 2, P, 16)
    return np.ascontiguousarray(pairs.reshape(2 * j, p * PANEL)).astype(F32)


def from_panels(panels: np.ndarray) -> np.ndarray:
    """(N/16, K, 16) -> (K, N), the same dtype."""
    p, k, _ = panels.shape
    return np.ascontiguousarray(panels.transpose(1, 0, 2).reshape(k, p * PANEL))


QUANTIZE = {
    "int8": quantize_int8,
    "q8_0": quantize_q8_0,
    "q4_0": quantize_q4_0,
    "q4_1": quantize_q4_1,
}
# The LM head's format under each --quantization: 4-bit layers keep an 8-bit head, as
# llama.cpp's quantizer keeps the output tensor in more bits.
HEAD_FORMAT = {"int8": "int8", "q8_0": "q8_0", "q4_0": "q8_0", "q4_1": "q8_0"}


COLUMNS_AT_ONCE = 2048  # a block format's output channels quantized together


def quantize(w: np.ndarray, kind: str) -> QuantWeight:
    """(K, N) float32 -> QuantWeight of an --quantization kind. The block formats go
    COLUMNS_AT_ONCE output channels at a time (each block is its own: the same bytes as all at
    once), so their float temporaries are a slice's, not five copies of an LM head. A GGUF
    matrix already in ``kind`` (model_loader.gguf_file.TransposedBlocks) keeps the file's blocks:
    what quantizing its values again would give, without widening them."""
    stored = getattr(w, "stored", None)
    if stored is not None and getattr(stored, "kind", None) == kind and kind in BLOCK_FORMATS:
        return QuantWeight(kind, *stored.blocks())
    if kind not in BLOCK_FORMATS or w.shape[1] <= COLUMNS_AT_ONCE:
        return QuantWeight(kind, *QUANTIZE[kind](w))
    data = scales = None  # (N, ...) each, filled a slice at a time
    for c in range(0, w.shape[1], COLUMNS_AT_ONCE):
        d, s = QUANTIZE[kind](w[:, c : c + COLUMNS_AT_ONCE])
        if data is None:
            data = np.empty((w.shape[1], *d.shape[1:]), d.dtype)
            scales = np.empty((w.shape[1], *s.shape[1:]), s.dtype)
        data[c : c + len(d)], scales[c : c + len(s)] = d, s
    return QuantWeight(kind, data, scales)


def to_int8(w: np.ndarray) -> QuantWeight:
    return quantize(w, "int8")
