"""Blocks in host memory, LRU by bytes: the tier just under the pool."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from engine.kv_offload.tier import BlockKey, KVTier, TierStats


class HostTier(KVTier):
    name = "host"

    def __init__(self, capacity_bytes: int):
        self.stats = TierStats(self.name, capacity_bytes)
        # (group, hash) -> (key, block), the least recently used first
        self._blocks: OrderedDict[tuple[int, int], tuple[BlockKey, np.ndarray]] = OrderedDict()

    def holds(self, h: int, group: int = 0) -> bool:
        return (group, h) in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, h: int, key: BlockKey, group: int = 0) -> np.ndarray | None:
        entry = self._blocks.get((group, h))
        if entry is None or entry[0] != key:
            return None
        self._blocks.move_to_end((group, h))  # most recently used
        return entry[1]

    def put(self, h: int, key: BlockKey, data: np.ndarray, group: int = 0) -> None:
        s = self.stats
        if data.nbytes > s.capacity_bytes:
            return
        old = self._blocks.pop((group, h), None)
        if old is not None:
            s.used_bytes -= old[1].nbytes
        while self._blocks and s.used_bytes + data.nbytes > s.capacity_bytes:
            _, (_, dropped) = self._blocks.popitem(last=False)  # the least recently used
            s.used_bytes -= dropped.nbytes
            s.evictions += 1
        self._blocks[(group, h)] = (key, data)
        s.used_bytes += data.nbytes
        s.stores += 1
        s.store_bytes += data.nbytes
