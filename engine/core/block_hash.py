"""A full block's prefix-cache hash, chained to its parent's (vLLM's ``hash_block_tokens``)."""

from __future__ import annotations

from collections.abc import Iterable

BlockKey = tuple[int | None, tuple[int, ...]]  # (parent block's hash, this block's token ids)

NO_PARENT = -1  # the first block's parent in the hash: no hash is -1 (Python reserves it)


def hash_block(parent_hash: int | None, tokens: Iterable[int]) -> int:
    """A full block's hash: it chains the parent's, so equal hashes mean equal prefixes.

    Python's 64-bit hash of a tuple of ints: the same in every process of one Python version
    (the KV tiers' files outlive the process), so the first block's missing parent enters as
    NO_PARENT, not None (whose hash is its address before Python 3.12). A collision would
    reuse a wrong block, as in vLLM's first versions; the odds are about n^2 / 2^64 for n
    cached blocks (the tiers check a block's parent and tokens as well).
    """
    return hash((NO_PARENT if parent_hash is None else parent_hash, tuple(tokens)))
