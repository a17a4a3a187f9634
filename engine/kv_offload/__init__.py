"""KV-cache tiers under the prefix cache: a block's K/V outlives its place in the pool.

The pool's prefix cache keeps a full block under the chained hash of its tokens until allocation
takes it for something else. With tiers on, that eviction stores the block's bytes first: in
host memory (``HostTier``, LRU by bytes) and on disk (``DiskTier``, files that survive a
restart, LRU by bytes). When a prompt is admitted, the scheduler looks its blocks up in the pool
first, then through the tiers (``KVConnector.get``), and a block found below is loaded into a
fresh pool block before the step's forward instead of being computed. The same hash names a
block in every tier (a grouped model's: one block of each KV group, kept apart); each stored
block also keeps the key its hash was made of (the parent block's hash and its own token ids),
checked again on every lookup.

tier.py        what a tier is (KVTier), a block's key, the counters
connector.py   the connector: the tiers in order, fetch / save, counters per tier
host_tier.py   blocks in host memory
disk_tier.py   blocks in files, one a block, checked against the model and the layout
cache_key.py   what decides a block's bytes (model, dtypes, layout, backend), as one digest
"""

from engine.kv_offload.connector import KVConnector, TierStats, make_connector

__all__ = ["KVConnector", "TierStats", "make_connector"]
