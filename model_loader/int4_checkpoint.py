"""AWQ and GPTQ 4-bit checkpoints -> ``ZeroPointBlocks``: each group of ``group_size`` inputs
(scale s, zero z) cut into blocks of 32 of the engine's "q4_z" kind, w = (q - z) s, the same
values, nothing rounded.

A quantized linear layer ``P`` (out N, in K, groups of G) is stored as
  AWQ (``version: gemm``): ``P.qweight`` (K, N/8) int32, eight 4-bit q of one input per int32
    along the outputs, nibble i (bits 4i..4i+3) holding output 8c + AWQ_ORDER[i];
    ``P.qzeros`` (K/G, N/8) int32, the zeros packed the same way; ``P.scales`` (K/G, N) float16;
  GPTQ: ``P.qweight`` (K/8, N) int32, nibble j of row r holding input 8r + j; ``P.qzeros``
    (K/G, N/8) int32, nibble j holding output 8c + j, the zero minus 1 in the v1 format
    (``checkpoint_format: gptq``; the stored zero itself in ``gptq_v2``); ``P.scales`` (K/G, N)
    float16; ``P.g_idx`` (K,) int32, each input's group, here always input // G.
A q4_z block is Q4_1's 20 bytes with z where Q4_1 keeps m: float16 d (= s, float16 already),
float16 z (an integer 0..16: exact), 16 bytes of nibbles (byte j: q[j] low, q[j + 16] high).
Q4_1 itself could not hold these values: its m = -s z needs up to 15 significant bits, and
float16 has 11.
"""

from __future__ import annotations

import numpy as np

from model_loader.gguf_blocks import BlockMatrix

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output 8c + AWQ_ORDER[i] sits in nibble i
QK = 32  # inputs a block


class _Q4Z:
    """The qtype of ZeroPointBlocks (no GGUF type is this)."""

    name = "Q4_Z"


Q4_Z = _Q4Z()


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """(..., n) int32 -> (..., n, 8) uint8: nibble i of each (bits 4i..4i+3)."""
    u = packed.view(np.uint32)[..., None]  # (..., n, 1)
    shifts = np.arange(0, 32, 4, dtype=np.uint32)  # (8,)
    return ((u >> shifts) & np.uint32(15)).astype(np.uint8)


class ZeroPointBlocks(BlockMatrix):
    """A (N, K) matrix in q4_z blocks: ``raw`` (N, K/32 * 20) uint8, per block d, z (float16)
    and 16 bytes of nibbles. Rows widen to float32 (q - z) d, exactly."""

    def __init__(self, name: str, qtype, raw: np.ndarray, shape, as_stored: bool = True):
        super().__init__(name, Q4_Z, raw, shape, as_stored)

    def __getitem__(self, index) -> np.ndarray:
        rows, cols = index if isinstance(index, tuple) else (index, slice(None))
        data, scales = _split(np.asarray(self.raw[rows]))
        lead = data.shape[:-1]
        b = data.reshape(*lead, -1, 16)  # (..., K/32, 16)
        q = np.concatenate([b & np.uint8(15), b >> np.uint8(4)], axis=-1).astype(np.float32)
        s = scales.astype(np.float32).reshape(*lead, -1, 2)  # (..., K/32, (d, z))
        values = ((q - s[..., 1:]) * s[..., :1]).reshape(*lead, -1)  # (..., K)
        whole = isinstance(cols, slice) and cols == slice(None)
        return values if whole else values[..., cols]

    def blocks(self) -> tuple[np.ndarray, np.ndarray]:
        """(nibbles (N, K/2) uint8, (d, z) (N, K/32 * 2) float16), as quant.QuantWeight keeps
        kind "q4_z"."""
        data, scales = _split(self.raw)
        return np.ascontiguousarray(data), np.ascontiguousarray(scales)


def _split(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(..., K/32 * 20) uint8 -> (nibbles (..., K/2), (d, z) (..., K/32 * 2) float16)."""
    b = raw.reshape(*raw.shape[:-1], -1, 20)  # (..., K/32, 20)
    lead = raw.shape[:-1]
    scales = np.ascontiguousarray(b[..., :4]).view(np.float16).reshape(*lead, -1)
    return np.ascontiguousarray(b[..., 4:]).reshape(*lead, -1), scales


def pack_blocks(name: str, q: np.ndarray, scales: np.ndarray, zeros: np.ndarray):
    """q (N, K) in 0..15, scales (N, K/G) float16, zeros (N, K/G) integers 0..16 ->
    ZeroPointBlocks: each group's s and z repeated over its G/32 blocks."""
    n, k = q.shape
    per = k // scales.shape[1] // QK  # blocks a group
    d = np.repeat(scales, per, axis=1)  # (N, K/32) float16
    z = np.repeat(zeros, per, axis=1).astype(np.float16)  # (N, K/32): exact
    qb = q.reshape(n, k // QK, QK).astype(np.uint8)
    nib = qb[..., :16] | (qb[..., 16:] << np.uint8(4))  # (N, K/32, 16)
    dz = np.stack([d, z], axis=2).view(np.uint8)  # (N, K/32, 4)
    raw = np.concatenate([dz, nib], axis=2).reshape(n, -1)  # (N, K/32 * 20)
    return ZeroPointBlocks(name, Q4_Z, raw, (n, k))


def _want(t: np.ndarray, name: str, shape: tuple, dtype) -> None:
    if tuple(t.shape) != shape or t.dtype != np.dtype(dtype):
        raise ValueError(
            f"checkpoint: tensor {name!r} is {t.dtype}{tuple(t.shape)}, the quantization "
            f"config implies {np.dtype(dtype)}{shape}"
        )


def awq_matrix(prefix: str, t, group: int) -> ZeroPointBlocks:
    """An AWQ gemm layer's qweight, qzeros, scales (``t``: name -> array) -> (N, K) blocks."""
    qw = t[prefix + ".qweight"]
    k, n = qw.shape[0], qw.shape[1] * 8
    g = group if group > 0 else k
    _check_group(prefix, k, g)
    _want(qw, prefix + ".qweight", (k, n // 8), np.int32)
    _want(t[prefix + ".qzeros"], prefix + ".qzeros", (k // g, n // 8), np.int32)
    _want(t[prefix + ".scales"], prefix + ".scales", (k // g, n), np.float16)
    order = np.argsort(AWQ_ORDER)  # nibble holding output j of a group of 8

    def unpack(packed):  # (rows, N/8) -> (rows, N), outputs in order
        return _nibbles(packed)[..., order].reshape(len(packed), -1)

    q = unpack(qw).T  # (N, K)
    zeros = unpack(t[prefix + ".qzeros"]).T  # (N, K/G)
    scales = np.asarray(t[prefix + ".scales"]).T  # (N, K/G)
    return pack_blocks(prefix + ".weight", q, scales, zeros)


def gptq_matrix(prefix: str, t, group: int, zero_offset: int) -> ZeroPointBlocks:
    """A GPTQ layer's qweight, qzeros, scales, g_idx -> (N, K) blocks (zeros + zero_offset)."""
    qw = t[prefix + ".qweight"]
    k, n = qw.shape[0] * 8, qw.shape[1]
    g = group if group > 0 else k
    _check_group(prefix, k, g)
    _want(qw, prefix + ".qweight", (k // 8, n), np.int32)
    _want(t[prefix + ".qzeros"], prefix + ".qzeros", (k // g, n // 8), np.int32)
    _want(t[prefix + ".scales"], prefix + ".scales", (k // g, n), np.float16)
    if prefix + ".g_idx" in t:
        g_idx = np.asarray(t[prefix + ".g_idx"])
        if g_idx.shape != (k,) or not np.array_equal(g_idx, np.arange(k) // g):
            raise ValueError(
                f"checkpoint: {prefix}.g_idx is not input // group_size (act-order "
                "groups, desc_act): not supported"
            )
    q = _nibbles(qw).transpose(0, 2, 1).reshape(k, n).T  # (N, K): input 8r + j
    zeros = _nibbles(t[prefix + ".qzeros"]).reshape(k // g, n).T.astype(np.int32) + zero_offset
    scales = np.asarray(t[prefix + ".scales"]).T  # (N, K/G)
    return pack_blocks(prefix + ".weight", q, scales, zeros)


def _check_group(prefix: str, k: int, g: int) -> None:
    if g % QK or k % g:
        raise ValueError(
            f"checkpoint: {prefix} has {k} inputs in groups of {g}: a group must be a "
            f"multiple of {QK} inputs that divides them"
        )


def int4_parts(prefix: str, method: str) -> tuple[str, ...]:
    """The tensors of one quantized layer ``prefix`` (g_idx: GPTQ's, where stored)."""
    names = ("qweight", "qzeros", "scales") + (("g_idx",) if method == "gptq" else ())
    return tuple(f"{prefix}.{n}" for n in names)
