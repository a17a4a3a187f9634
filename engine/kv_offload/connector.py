"""The KV connector: the tiers under the prefix cache, walked in order.

Its three calls have the shape of vLLM's KV connector (save blocks, look a prefix up, load it):

- ``fetch(hashes, keys)``: the scheduler, admitting a prompt, asks for the blocks past its pool
  hits; it gets the bytes of the longest leading run that some tier holds (a block found lower
  down is put in the tiers above it on the way), and loads them into fresh pool blocks;
- ``save_pool_blocks(backend, blocks)``: the model runner, before a step's forward, hands over
  the cached blocks that the step's allocations evicted from the pool (read from the pool in one
  copy, then ``save``); each tier that lacks a block stores it (the disk tier on a writer
  thread of its own, so the step does not wait for the disk);
- ``missing(h)``: whether some tier lacks a block (an evicted block that every tier already
  holds is not read from the pool at all).

A block is a (L, 2, block_size, Hkv, hd) array in the cache's dtype, exactly the bytes the pool
held, so a prompt served from a tier computes what it would have computed from the pool. A
grouped model's block (engine/backends/kv_groups.py) is (G, 2, block_size, Hkv, hd), one KV
group's G slots: the tiers keep each group's block of a hash apart (``group`` in every call),
so a sliding group's block is stored when that group's cache evicts it and loaded only where
that group's window needs it.
"""

from __future__ import annotations

import logging

import numpy as np

from engine.kv_offload.disk_tier import DiskTier
from engine.kv_offload.host_tier import HostTier
from engine.kv_offload.tier import BlockKey, KVTier, TierStats

log = logging.getLogger("engine")


class KVConnector:
    """``tiers`` in lookup order (host memory before disk); ``block_shape`` and ``dtype``: a
    block's array."""

    def __init__(self, tiers: list[KVTier], block_shape: tuple[int, ...], dtype: np.dtype):
        self.tiers = tiers
        self.block_shape = block_shape  # (L, 2, block_size, Hkv, hd); grouped: (G, 2, ...)
        self.dtype = np.dtype(dtype)
        self.block_bytes = int(np.prod(block_shape)) * self.dtype.itemsize

    def fetch(self, hashes: list[int], keys: list[BlockKey], group: int = 0) -> list[np.ndarray]:
        """The blocks of the longest leading run of ``hashes`` that the tiers hold, in order."""
        found = []
        for h, key in zip(hashes, keys, strict=True):
            data = self.get(h, key, group)
            if data is None:
                break
            found.append(data)
        return found

    def get(self, h: int, key: BlockKey, group: int = 0) -> np.ndarray | None:
        """Group ``group``'s block ``h`` from the first tier that holds it, or None."""
        for i, tier in enumerate(self.tiers):
            tier.stats.queries += 1
            data = tier.get(h, key, group)
            if data is None:
                continue
            tier.stats.hits += 1
            tier.stats.loads += 1
            tier.stats.load_bytes += data.nbytes
            for above in self.tiers[:i]:  # found lower down: kept nearer from now on
                above.put(h, key, data, group)
            return data
        return None

    def missing(self, h: int, group: int = 0) -> bool:
        """Whether some tier lacks group ``group``'s block ``h``."""
        return any(not tier.holds(h, group) for tier in self.tiers)

    def save(self, entries: list[tuple]) -> None:
        """Blocks evicted from the pool: (hash, key, data) each, or (hash, key, data, group)
        of a grouped model's, into every tier that lacks it."""
        for h, key, data, *group in entries:
            g = group[0] if group else 0
            assert data.shape == self.block_shape, f"a block of shape {data.shape}"
            for tier in self.tiers:
                if not tier.holds(h, g):
                    tier.put(h, key, data, g)

    def save_pool_blocks(self, backend, blocks: list[tuple[int, int, BlockKey, int]]) -> None:
        """Pool blocks (block id, hash, key, KV group) into the tiers, their bytes read from
        ``backend`` in one copy (``Backend.read_blocks``)."""
        ids, groups = [b[0] for b in blocks], [b[3] for b in blocks]
        data = backend.read_blocks(ids, groups)  # (L, 2, n, bs, Hkv, hd)
        self.save(
            [
                (h, key, np.ascontiguousarray(data[:, :, i]), g)
                for i, (_, h, key, g) in enumerate(blocks)
            ]
        )

    def stats(self) -> list[TierStats]:
        return [tier.stats for tier in self.tiers]

    def flush(self) -> None:
        for tier in self.tiers:
            tier.flush()

    def close(self) -> None:
        """Close every tier; the connector is empty from then on (no tier to look in or
        store to), so a pool that still evicts into it stores nothing."""
        tiers, self.tiers = self.tiers, []
        for tier in tiers:
            tier.close()


def make_connector(config, key, block_shape: tuple[int, ...], dtype) -> KVConnector | None:
    """The connector ``config`` asks for (``kv_offload_bytes``, ``kv_cache_dir``), or None."""
    tiers: list[KVTier] = []
    if config.kv_offload_bytes:
        tiers.append(HostTier(config.kv_offload_bytes))
    if config.kv_cache_dir:
        tiers.append(DiskTier(config.kv_cache_dir, config.kv_disk_limit, key, block_shape, dtype))
    if not tiers:
        return None
    connector = KVConnector(tiers, block_shape, dtype)
    log.info(
        "KV tiers under the prefix cache: %s; %d bytes a block (%s)",
        ", ".join(f"{t.name} {t.stats.capacity_bytes / 2**20:.0f} MiB" for t in tiers),
        connector.block_bytes,
        key.describe(),
    )
    return connector
