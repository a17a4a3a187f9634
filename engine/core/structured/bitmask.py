"""Token bitmasks: one bit per vocabulary id, 32 to an int32 word, as llguidance writes them.

Row r of a (B, W) int32 bitmask, W = ceil(V / 32), allows token t when bit t % 32 of word t // 32
is set (the low bit is the lowest id). ``allocate_bitmask`` starts every row all-allowed (-1), so
a row that no matcher fills leaves its logits alone; ``apply_bitmask`` sets the logits of the
disallowed tokens to -inf in place, for the whole batch at once. Ids past 32 * W are disallowed.
NumPy only.
"""

from __future__ import annotations

import numpy as np


def bitmask_width(vocab_size: int) -> int:
    """W: the int32 words that hold one bit per id of a vocab_size vocabulary."""
    return (vocab_size + 31) // 32


def allocate_bitmask(batch_size: int, vocab_size: int) -> np.ndarray:
    """A (B, W) int32 bitmask with every token allowed."""
    return np.full((batch_size, bitmask_width(vocab_size)), -1, dtype=np.int32)


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """(..., W) int32 -> (..., V) bool, True where allowed (False past 32 * W)."""
    words = np.ascontiguousarray(bitmask, dtype="<i4")  # little-endian: byte k holds ids 8k..8k+7
    bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")  # (..., 32W) 0/1
    if bits.shape[-1] < vocab_size:
        pad = np.zeros((*bits.shape[:-1], vocab_size - bits.shape[-1]), dtype=np.uint8)
        bits = np.concatenate([bits, pad], axis=-1)
    return bits[..., :vocab_size].view(bool)


def apply_bitmask(logits: np.ndarray, bitmask: np.ndarray, rows: np.ndarray | None = None):
    """Disallowed tokens' logits -> -inf, in place.

    Args:
        logits: (B, V) float32.
        bitmask: (K, W) int32; row k masks logits row ``rows[k]``, or row k when rows is None
            (then K == B).
        rows: (K,) distinct row indices into logits, or None.
    """
    _check(logits, bitmask, rows)
    allowed = unpack_bitmask(bitmask, logits.shape[1])  # (K, V) bool
    if rows is None:
        np.copyto(logits, -np.inf, where=~allowed)
        return
    picked = logits[rows]  # (K, V) copy
    np.copyto(picked, -np.inf, where=~allowed)
    logits[rows] = picked


def _check(logits: np.ndarray, bitmask: np.ndarray, rows) -> None:
    if logits.ndim != 2 or logits.dtype != np.float32:
        raise ValueError(
            f"apply_bitmask: logits must be (B, V) float32, got {logits.shape} {logits.dtype}"
        )
    if bitmask.ndim != 2 or bitmask.dtype != np.int32:
        raise ValueError(
            f"apply_bitmask: bitmask must be (K, W) int32, got {bitmask.shape} {bitmask.dtype}"
        )
    k = logits.shape[0] if rows is None else len(rows)
    if bitmask.shape[0] != k:
        raise ValueError(f"apply_bitmask: bitmask has {bitmask.shape[0]} rows, expected {k}")
