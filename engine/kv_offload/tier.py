"""What a KV tier is: a store of blocks by KV group and hash (``KVTier``), the key each block
is checked against (``BlockKey``) and its counters (``TierStats``); the tiers (host_tier.py,
disk_tier.py) and the connector that walks them (connector.py) import it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

BlockKey = tuple[int | None, tuple[int, ...]]  # (parent block's hash, this block's token ids)


@dataclass
class TierStats:
    """One tier's counters (cumulative) and its fill."""

    name: str
    capacity_bytes: int
    used_bytes: int = 0
    queries: int = 0  # blocks looked up here (those the tiers above did not have)
    hits: int = 0  # of those, found
    loads: int = 0  # blocks handed to the pool from this tier
    load_bytes: int = 0
    stores: int = 0  # blocks written to this tier
    store_bytes: int = 0
    evictions: int = 0  # blocks dropped to stay within capacity_bytes
    rejected: int = 0  # stored blocks that failed their checks (the disk tier's files)


class KVTier(ABC):
    """A store of blocks by (KV group, hash), LRU within ``stats.capacity_bytes``. A grouped
    model's block holds one group's layers: the same hash names a block of each group, each
    stored apart; a model of one group stores every block as group 0's."""

    name: str
    stats: TierStats

    @abstractmethod
    def get(self, h: int, key: BlockKey, group: int = 0) -> np.ndarray | None:
        """Group ``group``'s block stored under hash ``h`` whose key is ``key``, or None."""

    @abstractmethod
    def put(self, h: int, key: BlockKey, data: np.ndarray, group: int = 0) -> None:
        """Store a block (the caller no longer changes ``data``)."""

    @abstractmethod
    def holds(self, h: int, group: int = 0) -> bool:
        """Whether group ``group``'s block is stored under ``h`` (no key check, nothing read)."""

    def __contains__(self, h: int) -> bool:
        """``holds`` of group 0 (a one-group model's blocks)."""
        return self.holds(h)

    def flush(self) -> None:  # noqa: B027 - a tier that stores as it is handed has nothing to do
        """Every block put so far is stored."""

    def close(self) -> None:
        """Flush, and stop any worker."""
        self.flush()
