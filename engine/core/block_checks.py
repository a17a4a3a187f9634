"""The block pool's invariants (``BlockManager.check_invariants``), checked by the tests after
every step: every block free or held, reference counts equal to holders, each group's page
tables in shape for their sequence's tokens and window, and the prefix cache's hashes right.

Raises AssertionError (kept under ``python -O``) naming the first broken rule.
"""

from __future__ import annotations

from collections import Counter, deque

from engine.core.block_hash import hash_block
from engine.core.sequence import Sequence, SequenceStatus
from engine.core.window_blocks import NO_BLOCK, first_visible_block


def check_pool(bm, seqs: list[Sequence], scheduled: dict[int, int], releasing) -> None:
    """BlockManager.check_invariants' body (see there)."""
    holders = list(seqs) + list(releasing)
    gpu_tables = [[b for b in t if b != NO_BLOCK] for s in holders for t in bm.tables(s)]
    cpu_tables = [[b for b in t if b != NO_BLOCK] for s in holders for t in bm.cpu_tables(s)]
    if not bm.enable_caching:
        _check_ids("GPU", bm.num_blocks, bm.free_blocks, gpu_tables)
    _check_ids("CPU", bm.num_cpu_blocks, bm.free_cpu_blocks, cpu_tables)
    _check_one_group(bm, holders)
    for seq in seqs:
        _check_seq(bm, seq)
    _check_refs(bm, gpu_tables)
    _check_cache(bm, holders, scheduled)


def require(cond: bool, message: str) -> None:
    if not cond:
        raise AssertionError(message)


def _check_ids(name: str, total: int, free: deque[int], tables: list[list[int]]) -> None:
    """Free blocks and owned blocks partition range(total), with no block listed twice."""
    owned = [b for table in tables for b in table]
    everything = list(free) + owned
    require(len(set(free)) == len(free), f"{name}: a block is twice in the free queue")
    require(len(set(owned)) == len(owned), f"{name}: a block is owned twice")
    require(
        len(everything) == total and set(everything) == set(range(total)),
        f"{name}: free ({len(free)}) + used ({len(owned)}) != total ({total}), or a block leaked",
    )


def _check_one_group(bm, seqs: list[Sequence]) -> None:
    """A block id belongs to one group at a time (in every table that holds it)."""
    group_of: dict[int, int] = {}
    for seq in seqs:
        for g, table in enumerate(bm.tables(seq)):
            for b in table:
                if b != NO_BLOCK:
                    require(group_of.setdefault(b, g) == g, f"block {b} is in two groups")


def _check_refs(bm, tables: list[list[int]]) -> None:
    """ref == number of tables holding the block; the free ones (ref 0) and the held ones
    partition the pool."""
    held = Counter(b for table in tables for b in table)
    free = set(bm.free_blocks)
    require(all(len(set(t)) == len(t) for t in tables), "GPU: a table holds a block twice")
    require(not free & held.keys(), "GPU: a block is free and held at once")
    require(
        len(free) + len(held) == bm.num_blocks and free | held.keys() == set(range(bm.num_blocks)),
        f"GPU: free ({len(free)}) + used ({len(held)}) != total ({bm.num_blocks}), "
        "or a block leaked",
    )
    for block, ref in enumerate(bm.ref_counts):
        require(ref == held[block], f"GPU: block {block}: ref {ref}, {held[block]} holders")


def _check_cache(bm, seqs: list[Sequence], scheduled: dict[int, int]) -> None:
    """Each group's hash map and each block's hash agree, and match the tokens that made them."""
    require(
        len(bm.block_hash) == sum(len(c) for c in bm.caches), "cache: map and block hashes differ"
    )
    for cache in bm.caches:
        for h, block in cache.items():
            require(bm.block_hash.get(block) == h, f"cache: block {block} is not under its hash")
            require(hash_block(*bm.block_keys[block]) == h, f"cache: block {block}'s key")
    bs = bm.block_size
    for seq in seqs:
        chain, parent, ids = [], seq.hash_root, seq.token_ids
        for i in range(seq.num_tokens // bs):
            parent = hash_block(parent, ids[i * bs : (i + 1) * bs])
            chain.append(parent)
        require(seq.block_hashes == chain[: len(seq.block_hashes)], f"{seq}: wrong hashes")
        computed = seq.num_computed_tokens + scheduled.get(seq.seq_id, 0)  # after the step
        require(
            seq.num_cached_blocks <= computed // bs,
            f"{seq}: registered blocks that are not computed",
        )
        for table in bm.tables(seq):
            _check_written(bm, seq, table, chain)


def _check_written(bm, seq: Sequence, table: list[int], chain: list[int]) -> None:
    for i, block in enumerate(table):
        if block == NO_BLOCK:
            continue
        if i < seq.num_cached_blocks and block in bm.block_hash:
            require(bm.block_hash[block] == chain[i], f"{seq}: block {block} hash")
        else:  # this seq still writes the block: nobody else may hold it
            require(block not in bm.block_hash, f"{seq} writes cached block {block}")
            require(bm.ref_counts[block] == 1, f"{seq} writes shared block {block}")


def _check_seq(bm, seq: Sequence) -> None:
    gpu, cpu = bm.tables(seq), bm.cpu_tables(seq)
    held = len(seq.block_table) + len(seq.cpu_block_table)
    if seq.is_finished:
        require(all(not t for t in gpu + cpu), f"{seq} is finished but holds blocks")
        return
    tables = gpu if seq.block_table else cpu
    require(len({len(t) for t in tables}) == 1, f"{seq}: its groups' tables differ in length")
    for table, window in zip(tables, bm.windows, strict=True):
        gone = table.count(NO_BLOCK)
        require(table[:gone] == [NO_BLOCK] * gone, f"{seq}: a NO_BLOCK entry after a held block")
        first = first_visible_block(seq.num_computed_tokens, window, bm.block_size)
        require(
            gone <= first,
            f"{seq}: gave back a block that a query from token {seq.num_computed_tokens} sees",
        )
    require(not (seq.block_table and seq.cpu_block_table), f"{seq} holds GPU and CPU blocks")
    require(held <= bm.blocks_for_tokens(seq.num_tokens), f"{seq} holds too many blocks")
    require(
        held >= bm.blocks_for_tokens(seq.num_computed_tokens),
        f"{seq} has fewer blocks than its {seq.num_computed_tokens} computed tokens need",
    )
    if seq.status == SequenceStatus.WAITING:
        require(held == 0 and seq.num_computed_tokens == 0, f"{seq} waits with cache state")
    if seq.status == SequenceStatus.SWAPPED:
        require(not seq.block_table, f"{seq} is swapped but holds GPU blocks")
    if seq.status == SequenceStatus.RUNNING:
        require(not seq.cpu_block_table, f"{seq} is running but holds CPU blocks")
