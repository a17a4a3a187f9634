"""The part of a waiting prompt's prefix that the KV tiers serve (engine/kv_offload), past the
blocks its pool hits hold: how long it is, which blocks are loaded into which groups' tables,
and whether it fits. The scheduler asks ``tier_prefix`` while a prompt waits (the tiers' blocks
are read once: ``memo`` keeps them) and ``TierPrefix.fits`` before it admits it; the block
manager's ``extend_tables`` then takes the blocks.

One group (every layer alike, or one sliding window for all): the tiers' leading run of blocks
after the H hits; with a window, those that lead before the window of the first token after
the run are not loaded, and then no hit block is taken either (``hidden_loads``).

KV groups (engine/backends/kv_groups.py): the tiers keep each group's block of a hash apart.
The prefix grows to the longest m past the hits such that, in every group, each block the first
token after m sees (all of them in a full-attention group, its window's in a sliding one) is in
that group's pool cache or in the tiers under that group: a full group's blocks are looked up
from H on, a sliding group's from m's window down, so a sliding group reads only what its window
needs. Each group's table then starts NO_BLOCK up to its window (the hits there not taken),
takes the pool's blocks and loads the tiers' into fresh ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.core.block_manager import NO_BLOCK, GroupHits
from engine.core.window_blocks import first_visible_block, hidden_loads


@dataclass
class TierPrefix:
    """The tiers' part of one prompt's prefix: ``num_blocks`` blocks after ``hits`` pool hits."""

    hits: int  # H: the pool's blocks it follows
    num_blocks: int  # blocks past them, every group's entries (loaded, taken or hidden)
    taken: list  # the pool hits as taken (a grouped pool's: a GroupHits)
    rows: list[list]  # per group, its entries after ``taken``'s: NO_BLOCK, a pool block or an
    # (L, 2, bs, Hkv, hd) array to load (a grouped pool's: (G, 2, ...))

    @property
    def num_loads(self) -> int:
        return sum(isinstance(r, np.ndarray) for rows in self.rows for r in rows)

    def fits(self, bm, seq, num_new_tokens: int) -> bool:
        """Room for the loads and seq's ``num_new_tokens`` after them, the taken pool blocks
        that wait in the free queue counted too (``BlockManager.can_allocate``'s rule)."""
        end = self.hits + self.num_blocks  # blocks in each table once the prefix is taken
        new = bm.blocks_for_tokens(end * bm.block_size + num_new_tokens) - end  # each group's
        fresh = self.num_loads + new * bm.num_groups
        tables = self.taken.tables if isinstance(self.taken, GroupHits) else [self.taken]
        pool = [b for t in tables for b in t] + [r for t in self.rows for r in t if _id(r)]
        revived = sum(b != NO_BLOCK and bm.ref_counts[b] == 0 for b in pool)
        return fresh + revived <= bm.num_free_blocks


def _id(entry) -> bool:
    return not isinstance(entry, np.ndarray)


def tier_prefix(bm, seq, hits: list, memo: dict) -> TierPrefix:
    """The tiers' part of seq's prefix after its pool hits ``hits`` (``cached_prefix``);
    ``memo``: (group, block index) -> the tiers' array or None, kept while seq waits."""
    bs, start = bm.block_size, len(hits)
    limit = (seq.num_tokens - 1) // bs  # as cached_prefix: its last token is computed
    hashes = bm.block_hashes(seq)[:limit]

    def tiers(g: int, i: int):
        if (g, i) not in memo:
            memo[g, i] = bm.connector.get(hashes[i], bm.block_key(seq, i), g)
        return memo[g, i]

    if bm.num_groups == 1:
        run = 0
        while start + run < limit and tiers(0, start + run) is not None:
            run += 1
        skip = hidden_loads(start, run, bm.window, bs)
        loads = [tiers(0, i) for i in range(start + skip, start + run)]
        taken = [NO_BLOCK] * (start + skip) if skip else hits
        return TierPrefix(start, run, taken, [loads])
    return _group_prefix(bm, hashes, hits, tiers)


def _group_prefix(bm, hashes: list[int], hits: list, tiers) -> TierPrefix:
    """A grouped pool's: the longest prefix each group's pool cache or tiers cover."""
    bs, start, limit = bm.block_size, len(hits), len(hashes)

    def entry(g: int, i: int):  # the pool's block of group g, else the tiers' array, or None
        block = bm.caches[g].get(hashes[i])
        return block if block is not None else tiers(g, i)

    full = [g for g, w in enumerate(bm.windows) if not w]
    sliding = [(g, w) for g, w in enumerate(bm.windows) if w]
    end = start  # (no full group: as far as the prompt's blocks go)
    while end < limit and all(entry(g, end) is not None for g in full):
        end += 1  # every full group's blocks so far are there
    while end > start and not all(
        entry(g, i) is not None
        for g, w in sliding
        for i in range(max(start, first_visible_block(end * bs, w, bs)), end)
    ):
        end -= 1
    tables = hits.tables if isinstance(hits, GroupHits) else [[] for _ in bm.windows]
    taken, rows = [], []
    for g, (table, w) in enumerate(zip(tables, bm.windows, strict=True)):
        first = first_visible_block(end * bs, w, bs)
        cut = min(first, start)
        taken.append([NO_BLOCK] * cut + table[cut:start])
        hidden = [NO_BLOCK] * max(0, first - start)
        rows.append(hidden + [entry(g, i) for i in range(max(first, start), end)])
    return TierPrefix(start, end - start, GroupHits(taken) if start else [], rows)
