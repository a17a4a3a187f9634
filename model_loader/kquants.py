"""GGUF's k-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), 5-bit formats (Q5_0, Q5_1), MXFP4 and
IQ4_NL/IQ4_XS: their block layouts and a NumPy dequantizer per type, written from the formats'
definitions (ggml's block structs). The values they give are the semantics the cpu backend's
kernels (cpu_src/matmul_kquants.cpp, matmul_q5.cpp, matmul_mxfp4.cpp, matmul_iq4.cpp) are
checked against; every product is float32, in ggml's order.

A matrix row is a run of blocks; a block's bytes, in file order:
  Q4_K (256 values, 144 bytes): d, dmin (float16); 12 bytes of eight 6-bit scales and eight
       6-bit mins; 128 bytes of nibbles. Values in 8 groups of 32: group g uses byte 32 (g // 2)
       + l of the nibbles, low nibble for even g, high for odd: w = (d sc_g) q - (dmin m_g).
  Q5_K (256 values, 176 bytes): Q4_K's header, then qh (32 bytes: bit g of byte l is the fifth
       bit of value l of group g), then the nibbles as Q4_K's: w = (d sc_g) (q + 16 h) - dmin m_g.
  Q6_K (256 values, 210 bytes): ql (128 bytes of nibbles), qh (64 bytes of 2-bit pairs),
       16 int8 scales, d (float16). Two halves of 128: value 32 j + l of a half (j = 0..3)
       takes ql[64 h + l + 32 (j % 2)]'s low (j < 2) or high nibble and bits 2j, 2j+1 of
       qh[32 h + l]: w = (d sc_(8h + 2j + l // 16)) (q - 32).
  Q2_K (256 values, 84 bytes): 16 bytes of scales (byte j: low nibble sc_j, high nibble m_j,
       for values 16 j .. 16 j + 15), qs (64 bytes of 2-bit q), d, dmin (float16). Value
       128 h + 32 j + l (j = 0..3) is bits 2j, 2j+1 of qs[32 h + l]: w = (d sc) q - dmin m.
  Q3_K (256 values, 110 bytes): hmask (32 bytes), qs (64 bytes, as Q2_K's), 12 bytes of
       sixteen 6-bit scales s, d (float16). Value 128 h + 32 j + l: its low bits from qs as
       Q2_K's, its high bit bit 4h + j of hmask[l]: w = d (s - 32) (low + 4 high - 4). Scale i
       is byte i % 8's low (i < 8) or high nibble, with bits 2 (i // 4), + 1 of byte 8 + i % 4
       on top.
  Q5_0 (32 values, 22 bytes): d (float16), qh (uint32, bit i the fifth bit of value i),
       16 bytes of nibbles (byte j: value j low, value j + 16 high): w = d (q - 16).
  Q5_1 (32 values, 24 bytes): d, m (float16), qh, nibbles: w = d q + m.
  MXFP4 (32 values, 17 bytes): an e8m0 exponent, 16 bytes of e2m1 codes in Q5_0's nibble
       order (model_loader/mxfp4.py).
  IQ4_NL (32 values, 18 bytes), IQ4_XS (256 values, 136 bytes): 4-bit indices into sixteen
       int8 levels times a block's scale (model_loader/iq4.py).
The 6-bit scales of Q4_K/Q5_K: for j < 4, sc_j = b[j] & 63, m_j = b[j + 4] & 63; for j >= 4,
sc_j = (b[j + 4] & 15) | (b[j - 4] >> 6) << 4, m_j = (b[j + 4] >> 4) | (b[j] >> 6) << 4.
"""

from __future__ import annotations

import numpy as np

from model_loader import iq4, mxfp4

F32 = np.dtype(np.float32)
QK_K = 256

# type name -> (values per block, bytes per block)
LAYOUTS = {
    "Q2_K": (256, 84),
    "Q3_K": (256, 110),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "MXFP4": (mxfp4.QK, mxfp4.BLOCK_BYTES),
    **iq4.LAYOUTS,
}


def _halves(b: np.ndarray, a: int, z: int) -> np.ndarray:
    """Bytes a..z of each block as float16 -> float32: (n,)."""
    return np.ascontiguousarray(b[:, a:z]).view(np.float16)[:, 0].astype(F32)


def scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(n, 12) packed bytes -> (sc (n, 8), m (n, 8)) uint8, the 6-bit scales and mins."""
    lo = s[:, 0:4]  # sc 0..3 (bits 0-5), high bits of sc 4..7 (bits 6-7)
    mid = s[:, 4:8]  # m 0..3, high bits of m 4..7
    hi = s[:, 8:12]  # low nibbles: sc 4..7; high nibbles: m 4..7
    sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=1)
    m = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc, m


def _groups_of_nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 128) nibbles -> (n, 8, 32) uint8: group g from bytes 32 (g // 2).., low then high."""
    b = qs.reshape(len(qs), 4, 1, 32)
    return np.concatenate([b & 15, b >> 4], axis=2).reshape(len(qs), 8, 32)


def _k_affine(b: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: (n, 8, 32) q -> (n, 256) float32 (d sc) q - (dmin m)."""
    d, dmin = _halves(b, 0, 2), _halves(b, 2, 4)  # (n,)
    sc, m = scales_mins(b[:, 4:16])  # (n, 8)
    ds = (d[:, None] * sc.astype(F32))[:, :, None]  # (n, 8, 1)
    dm = (dmin[:, None] * m.astype(F32))[:, :, None]
    return (ds * q.astype(F32) - dm).reshape(len(b), QK_K)


def dequantize_q4_k(b: np.ndarray) -> np.ndarray:
    """(n, 144) uint8 blocks -> (n, 256) float32."""
    return _k_affine(b, _groups_of_nibbles(b[:, 16:144]))


def dequantize_q5_k(b: np.ndarray) -> np.ndarray:
    """(n, 176) uint8 blocks -> (n, 256) float32."""
    qh = b[:, 16:48][:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]  # (n, 8, 32)
    return _k_affine(b, _groups_of_nibbles(b[:, 48:176]) | ((qh & 1) << 4))


def dequantize_q6_k(b: np.ndarray) -> np.ndarray:
    """(n, 210) uint8 blocks -> (n, 256) float32."""
    n = len(b)
    ql = b[:, 0:128].reshape(n, 2, 1, 2, 32)  # (half, _, which 32 bytes, l)
    low = np.concatenate([ql & 15, ql >> 4], axis=2)  # (n, 2, 2 nibble, 2, 32): j = 2 nib + x
    qh = (
        b[:, 128:192].reshape(n, 2, 1, 32)
        >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    )
    q = low.reshape(n, 2, 4, 32) | ((qh & 3) << 4)  # (n, 2, 4, 32): value 128 h + 32 j + l
    sc = b[:, 192:208].view(np.int8).astype(F32)  # (n, 16)
    ds = (_halves(b, 208, 210)[:, None] * sc).reshape(n, 16, 1)  # (n, 16, 1): per 16 values
    v = q.astype(np.int8) - np.int8(32)  # (n, 2, 4, 32)
    return (ds * v.reshape(n, 16, 16).astype(F32)).reshape(n, QK_K)


def _pairs(qs: np.ndarray) -> np.ndarray:
    """(n, 64) bytes of 2-bit values -> (n, 256) uint8: value 128 h + 32 j + l from bits 2j, 2j+1
    of byte 32 h + l."""
    b = qs.reshape(len(qs), 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    return (b & 3).reshape(len(qs), QK_K)


def dequantize_q2_k(b: np.ndarray) -> np.ndarray:
    """(n, 84) uint8 blocks -> (n, 256) float32."""
    n = len(b)
    sc, m = (b[:, 0:16] & 15).astype(F32), (b[:, 0:16] >> 4).astype(F32)  # (n, 16)
    ds = (_halves(b, 80, 82)[:, None] * sc)[:, :, None]  # (n, 16, 1): per 16 values
    dm = (_halves(b, 82, 84)[:, None] * m)[:, :, None]
    q = _pairs(b[:, 16:80]).reshape(n, 16, 16).astype(F32)
    return (ds * q - dm).reshape(n, QK_K)


def q3_scales(s: np.ndarray) -> np.ndarray:
    """(n, 12) packed bytes -> (n, 16) int8, Q3_K's sixteen 6-bit scales less 32."""
    low = np.concatenate([s[:, 0:8] & 15, s[:, 0:8] >> 4], axis=1)  # (n, 16)
    top = s[:, 8:12, None] >> (2 * np.arange(4, dtype=np.uint8))[None, None, :]  # (n, 4, 4)
    top = np.ascontiguousarray((top & 3).transpose(0, 2, 1)).reshape(len(s), 16)  # i // 4, i % 4
    return (low | (top << 4)).astype(np.int8) - np.int8(32)


def dequantize_q3_k(b: np.ndarray) -> np.ndarray:
    """(n, 110) uint8 blocks -> (n, 256) float32."""
    n = len(b)
    high = (b[:, None, 0:32] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # (n, 8, 32)
    q = _pairs(b[:, 32:96]).astype(np.int8) + (high.reshape(n, QK_K) << 2).astype(np.int8) - 4
    ds = (_halves(b, 108, 110)[:, None] * q3_scales(b[:, 96:108]).astype(F32))[:, :, None]
    return (ds * q.reshape(n, 16, 16).astype(F32)).reshape(n, QK_K)


def _q5_values(b: np.ndarray, at: int) -> np.ndarray:
    """Q5_0/Q5_1: (n, bytes) blocks with qh at bytes at..at+4 -> (n, 32) uint8 q in [0, 31]."""
    qh = np.ascontiguousarray(b[:, at : at + 4]).view("<u4")  # (n, 1)
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # (n, 32)
    qs = b[:, at + 4 : at + 20]
    return np.concatenate([qs & 15, qs >> 4], axis=1) | (high << 4)


def dequantize_q5_0(b: np.ndarray) -> np.ndarray:
    """(n, 22) uint8 blocks -> (n, 32) float32."""
    v = _q5_values(b, 2).astype(np.int8) - np.int8(16)
    return _halves(b, 0, 2)[:, None] * v.astype(F32)


def dequantize_q5_1(b: np.ndarray) -> np.ndarray:
    """(n, 24) uint8 blocks -> (n, 32) float32."""
    d, m = _halves(b, 0, 2)[:, None], _halves(b, 2, 4)[:, None]
    return d * _q5_values(b, 4).astype(F32) + m


DEQUANTIZE = {
    "Q2_K": dequantize_q2_k,
    "Q3_K": dequantize_q3_k,
    "Q4_K": dequantize_q4_k,
    "Q5_K": dequantize_q5_k,
    "Q6_K": dequantize_q6_k,
    "Q5_0": dequantize_q5_0,
    "Q5_1": dequantize_q5_1,
    "MXFP4": mxfp4.dequantize_blocks,
    "IQ4_NL": iq4.dequantize_iq4_nl,
    "IQ4_XS": iq4.dequantize_iq4_xs,
}


def row_values(type_name: str, row_bytes: int) -> int:
    """The values a row of ``row_bytes`` holds in the type."""
    per, size = LAYOUTS[type_name]
    if row_bytes % size:
        raise ValueError(f"{type_name}: a row of {row_bytes} bytes is not whole blocks of {size}")
    return row_bytes // size * per


def dequantize(raw: np.ndarray, type_name: str) -> np.ndarray:
    """(..., bytes of a row) uint8 rows of blocks -> (..., values of a row) float32."""
    if type_name not in DEQUANTIZE:
        raise ValueError(f"no dequantizer for GGUF type {type_name!r} (have {', '.join(LAYOUTS)})")
    raw = np.asarray(raw, np.uint8)
    per, size = LAYOUTS[type_name]
    width = row_values(type_name, raw.shape[-1])
    blocks = np.ascontiguousarray(raw).reshape(-1, size)  # (rows * blocks a row, bytes)
    return DEQUANTIZE[type_name](blocks).reshape(*raw.shape[:-1], width)
