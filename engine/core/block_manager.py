"""The KV block pool's bookkeeping: a free block queue and one page table per sequence.

Allocation pops block ids from the head of the free queue. Without prefix caching a freed block
goes back to the head (LIFO): the most recently freed block is reused first, so a steady workload
keeps touching the same few blocks (the same memory pages). A sequence frees its blocks in
reverse table order, so the next allocation gets them back in table order. The page tables
themselves live on the sequences (``Sequence.block_table``, and ``Sequence.cpu_block_table``
while swapped out). This module moves no data: swaps return (src, dst) block pairs for the
backend to copy.

With prefix caching (``enable_caching``) every full block gets a hash that chains its parent's,
and a map hash -> block id lets a later prompt with the same prefix reuse the block (reference
counted). A block is registered when it is allocated for tokens that the current step computes
(``cache_full_blocks``), so a prompt admitted later in the same step already finds it: every
backend writes a step's new K/V into the cache before attention reads it, in every layer. A
freed block then goes to the tail instead (LRU): it keeps its hash while it waits in the free
queue, so it can be revived until allocation takes it from the head, the least recently freed
first, a sequence's tail blocks before its head.

Sliding window (``window`` > 0: every layer of the model slides with that window): a query at
position p sees keys p - window + 1 .. p only, and every later query of a sequence starts at or
after its ``num_computed_tokens`` (a chunk from its first token, a speculative run from its first
row), so ``slide`` gives back each block whose last token lies before the window of that
position. Its page-table entry becomes NO_BLOCK (the padding of the backends' tables, which no
attention kernel reads); the table keeps its length, so block i still holds tokens i*bs.. and a
table is a run of NO_BLOCK followed by held blocks. A slid block goes back like a finished
sequence's: with prefix caching it keeps its hash in the free queue. A prefix hit is then valid
only where every block its first new token can see is cached (``cached_prefix``); the blocks
before that window are not taken at all.

KV groups (``windows``: one window per group, engine/backends/kv_groups.py): a model whose layers
attend differently keeps one page table per group for each sequence (``Sequence.block_table``
is group 0's, ``Sequence.group_tables`` the others'), all of one length, drawn from one pool: a
block id belongs to one group at a time. Each sliding group slides with its own window; the
full-attention groups keep every block. A prefix hit is then the longest prefix whose blocks
each group's first new token can see are all cached (``cached_prefix``), every group's own.
With the KV tiers each group's evicted block goes to them under (group, hash), and the tiers'
part of a prefix (engine/core/tier_prefix.py) extends each group's table (``extend_tables``).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator

from engine.core.block_checks import check_pool
from engine.core.block_hash import NO_PARENT, BlockKey, hash_block
from engine.core.sequence import PENDING_TOKEN, Sequence
from engine.core.window_blocks import (
    NO_BLOCK,
    first_visible_block,
    peak_blocks,
    prefix_ok,
    window_prefix,
)
from engine.utils import cdiv

__all__ = ["NO_BLOCK", "NO_PARENT", "BlockKey", "BlockManager", "FreeBlockQueue", "hash_block"]


class FreeBlockQueue:
    """Free block ids in allocation order (head = next to allocate), with O(1) removal from the
    middle for a revived cached block; an OrderedDict (a doubly linked list underneath).

    ``lifo``: a pushed block goes to the head (reused first); otherwise to the tail (LRU).
    """

    def __init__(self, blocks: Iterable[int] = (), lifo: bool = False):
        self._blocks: OrderedDict[int, None] = OrderedDict.fromkeys(blocks)
        self.lifo = lifo

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self) -> Iterator[int]:
        return iter(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def popleft(self) -> int:
        return self._blocks.popitem(last=False)[0]

    def push(self, block: int) -> None:
        """A freed block: to the head (LIFO) or the tail (LRU)."""
        assert block not in self._blocks, f"block {block} is already free"
        self._blocks[block] = None
        if self.lifo:
            self._blocks.move_to_end(block, last=False)

    def remove(self, block: int) -> None:
        del self._blocks[block]


def _is_load(entry) -> bool:
    """A tier prefix's entry that is an array to load (not a block id)."""
    return hasattr(entry, "shape")


class GroupHits(list):
    """A grouped pool's prefix hits: group 0's blocks (a list, as a one-group pool's hits are),
    every group's in ``tables``."""

    def __init__(self, tables: list[list[int]]):
        super().__init__(tables[0])
        self.tables = tables


class BlockManager:
    """``connector``: the KV tiers under the prefix cache (engine/kv_offload), or None: an
    evicted cached block some tier lacks is then kept for the step's forward to store.
    ``window``: the sliding window every layer has (0: none, or not every layer slides the
    same), whose hidden blocks ``slide`` gives back. ``windows``: a grouped model's window of
    each KV group (0: full attention), instead of ``window``."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_cpu_blocks: int = 0,
        enable_caching=False,
        connector=None,
        window: int = 0,
        windows: tuple[int, ...] = (),
    ):
        windows = tuple(windows) or (window,)
        if num_blocks < 1 or block_size < 1 or num_cpu_blocks < 0 or min(windows) < 0:
            raise ValueError(
                f"BlockManager: need num_blocks >= 1, block_size >= 1, num_cpu_blocks >= 0, "
                f"windows >= 0, got {num_blocks}, {block_size}, {num_cpu_blocks}, {windows}"
            )
        if enable_caching and num_cpu_blocks:
            raise ValueError("BlockManager: prefix caching does not support swap (CPU) blocks")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_caching = enable_caching
        self._windows = windows  # per KV group: its sliding window (0: full attention)
        self.num_groups = len(windows)
        self.window = windows[0] if len(windows) == 1 else 0  # one group's window
        self.free_blocks = FreeBlockQueue(range(num_blocks), lifo=not enable_caching)
        self.free_cpu_blocks: deque[int] = deque(range(num_cpu_blocks))
        self.ref_counts = [0] * num_blocks  # live sequences' tables that hold the block
        self.caches: list[dict[int, int]] = [{} for _ in windows]  # per group: hash -> block id
        self.cached = self.caches[0]  # group 0's (the only one of a one-group pool)
        self.block_hash: dict[int, int] = {}  # cached block id -> its hash
        self.block_keys: dict[int, BlockKey] = {}  # cached block id -> what its hash hashed
        self.block_group: dict[int, int] = {}  # cached block id of a group > 0 -> its group
        # KV tiers under the cache (engine/kv_offload): evicted blocks some tier lacks wait in
        # ``evicted`` for the step's forward to store their bytes first
        self.connector = connector
        self.evicted: list[tuple[int, int, BlockKey, int]] = []  # (block id, hash, key, group)

    @property
    def windows(self) -> tuple[int, ...]:
        """Each KV group's sliding window (0: full attention); one group's is ``window``."""
        return (self.window,) if self.num_groups == 1 else self._windows

    @property
    def slides(self) -> bool:
        """Whether some group gives back blocks as its sequences advance (``slide``)."""
        return any(self.windows)

    # -- page tables ----------------------------------------------------------------------------

    def tables(self, seq: Sequence) -> list[list[int]]:
        """seq's page table of each group (group 0's is seq.block_table)."""
        rest = seq.group_tables
        if len(rest) + 1 != self.num_groups:
            rest = [[] for _ in range(self.num_groups - 1)]
        return [seq.block_table, *rest]

    def cpu_tables(self, seq: Sequence) -> list[list[int]]:
        rest = seq.cpu_group_tables
        if len(rest) + 1 != self.num_groups:
            rest = [[] for _ in range(self.num_groups - 1)]
        return [seq.cpu_block_table, *rest]

    def _set_tables(self, seq: Sequence, tables: list[list[int]]) -> None:
        seq.block_table, seq.group_tables = tables[0], tables[1:]

    # -- GPU pool -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self.free_cpu_blocks)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """New blocks (every group's) to cover positions < num_computed_tokens + num_new_tokens."""
        total = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        return max(0, total - len(seq.block_table)) * self.num_groups

    def can_allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int] = ()) -> bool:
        """Room for num_new_tokens more tokens of seq, after it takes the cached blocks ``hits``
        (a hit block that waits in the free queue counts against the free blocks too)."""
        if not hits:
            return self.blocks_needed(seq, num_new_tokens) <= len(self.free_blocks)
        assert not seq.block_table, "cache hits only for a sequence that holds no blocks"
        total = self.blocks_for_tokens(len(hits) * self.block_size + num_new_tokens)
        groups = hits.tables if isinstance(hits, GroupHits) else [hits]
        revived = sum(b != NO_BLOCK and self.ref_counts[b] == 0 for t in groups for b in t)
        return (total - len(hits)) * self.num_groups + revived <= len(self.free_blocks)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Grow every group's table of seq to hold num_new_tokens more tokens; returns the new
        block ids (group after group)."""
        n = self.blocks_needed(seq, num_new_tokens)
        assert n <= len(self.free_blocks), f"allocate: need {n} blocks, {self.num_free_blocks} free"
        if self.num_groups == 1:
            new = [self._take_free() for _ in range(n)]
            seq.block_table.extend(new)
            return new
        tables, new = self.tables(seq), []
        for table in tables:
            grown = [self._take_free() for _ in range(n // self.num_groups)]
            table.extend(grown)
            new += grown
        self._set_tables(seq, tables)
        return new

    def free(self, seq: Sequence) -> None:
        """Every block of seq (GPU and CPU, every group) back to its free queue once no other
        sequence holds it, in reverse table order: reused in table order (LIFO), or evicted tail
        first (LRU)."""
        for table in reversed(self.tables(seq)):
            for block in reversed(table):
                if block != NO_BLOCK:
                    self._release(block)
        for table in self.cpu_tables(seq):
            self.free_cpu_blocks.extend(b for b in table if b != NO_BLOCK)
        seq.block_table, seq.group_tables = [], []
        seq.cpu_block_table, seq.cpu_group_tables = [], []
        seq.num_cached_blocks = 0

    def trim(self, seq: Sequence) -> None:
        """Speculative decoding: blocks past seq's tokens (taken for drafts that were rejected)
        back to the free queue; they hold no cached or shared block."""
        keep = self.blocks_for_tokens(seq.num_tokens)
        if len(seq.block_table) <= keep:
            return
        tables = self.tables(seq)
        # new lists: page-table copies keyed on the list (ModelRunner's) see it was replaced
        self._set_tables(seq, [t[:keep] for t in tables])
        for table in tables:
            for block in reversed(table[keep:]):
                assert block not in self.block_hash, f"lookahead block {block} is cached"
                self._release(block)

    # -- sliding window -------------------------------------------------------------------------

    def first_visible_block(self, pos: int) -> int:
        return first_visible_block(pos, self.window, self.block_size)

    def peak_blocks(self, num_tokens: int, step_tokens: int) -> int:
        """The most blocks (every group's) a sequence holds at once (``peak_blocks``)."""
        bs = self.block_size
        return sum(peak_blocks(num_tokens, step_tokens, w, bs) for w in self.windows)

    def held_blocks(self, seq: Sequence) -> int:
        """The pool blocks seq's page tables hold (NO_BLOCK entries are not)."""
        return sum(b != NO_BLOCK for t in self.tables(seq) for b in t)

    def slide(self, seq: Sequence) -> None:
        """Sliding window: seq's blocks that no query from its ``num_computed_tokens`` on can
        see, in each sliding group, back to the free queue (tail first, as ``free``); their
        entries become NO_BLOCK in a new table list (ModelRunner's page-table copies see it was
        replaced)."""
        if self.num_groups == 1:
            seq.block_table = self._slide(seq.block_table, seq.num_computed_tokens, self.window)
            return
        tables = self.tables(seq)
        pos = seq.num_computed_tokens
        self._set_tables(
            seq, [self._slide(t, pos, w) for t, w in zip(tables, self.windows, strict=True)]
        )

    def _slide(self, table: list[int], pos: int, window: int) -> list[int]:
        n = min(first_visible_block(pos, window, self.block_size), len(table))
        if n == 0 or table[n - 1] == NO_BLOCK:
            return table
        table = list(table)
        for i in range(n - 1, -1, -1):
            if table[i] == NO_BLOCK:
                break
            self._release(table[i])
            table[i] = NO_BLOCK
        return table

    def _take_free(self) -> int:
        """The head of the free queue, its cache entry (if any) evicted; ref 1."""
        block = self.free_blocks.popleft()
        h = self.block_hash.pop(block, None)
        if h is not None:  # evict: the least recently freed cached block goes first
            group = self.block_group.pop(block, 0)
            del self.caches[group][h]
            key = self.block_keys.pop(block)
            if self.connector is not None and self.connector.missing(h, group):
                self.evicted.append((block, h, key, group))
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        assert self.ref_counts[block] >= 0, f"block {block} released more often than taken"
        if self.ref_counts[block] == 0:
            self.free_blocks.push(block)

    # -- prefix caching -------------------------------------------------------------------------

    def block_hashes(self, seq: Sequence) -> list[int]:
        """The chained hashes of seq's full blocks of tokens (extends seq.block_hashes); a block
        that ends in a pending token (async scheduling) is hashed once its id is known."""
        hashes = seq.block_hashes
        full = (seq.num_tokens - (seq.last_token_id == PENDING_TOKEN)) // self.block_size
        for i in range(len(hashes), full):
            hashes.append(hash_block(*self.block_key(seq, i)))
        return hashes

    def block_key(self, seq: Sequence, i: int) -> BlockKey:
        """What seq's block i is hashed from: its parent's hash (the chain's root for the
        first block) and its token ids; seq.block_hashes holds the blocks before it."""
        bs = self.block_size
        parent = seq.block_hashes[i - 1] if i else seq.hash_root
        return parent, tuple(seq.token_ids[i * bs : (i + 1) * bs])

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest run of cached full blocks that starts seq's tokens, capped so
        that at least its last token is still computed (its logits are needed); [] when off.
        A grouped pool's: a GroupHits, the longest prefix every group can start from."""
        if not self.enable_caching or seq.block_table:
            return []
        limit = (seq.num_tokens - 1) // self.block_size
        hashes = self.block_hashes(seq)[:limit]
        if self.num_groups > 1:
            return self._group_prefix(hashes)
        if self.window:
            blocks = [self.cached.get(h) for h in hashes]
            return window_prefix(blocks, self.window, self.block_size)
        hits = []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def _group_prefix(self, hashes: list[int]) -> GroupHits | list:
        """The longest prefix whose blocks each group's first new token sees are cached in that
        group (a full group: all of them); NO_BLOCK before a sliding group's window."""
        bs = self.block_size
        groups = [[cache.get(h) for h in hashes] for cache in self.caches]
        ok = [prefix_ok(blocks, w, bs) for blocks, w in zip(groups, self.windows, strict=True)]
        best = max(k for k in range(len(hashes) + 1) if all(o[k] for o in ok))
        if best == 0:
            return []
        tables = []
        for blocks, w in zip(groups, self.windows, strict=True):
            first = first_visible_block(best * bs, w, bs)
            tables.append([NO_BLOCK] * first + blocks[first:best])
        return GroupHits(tables)

    def take_evicted(self) -> list[tuple[int, int, BlockKey, int]]:
        """The evicted blocks whose bytes the tiers still need, since the last call."""
        evicted, self.evicted = self.evicted, []
        return evicted

    def take_cached(self, seq: Sequence, hits: list[int]) -> None:
        """Start seq's tables with the cached blocks ``hits`` (ref += 1; revived if free)."""
        assert not seq.block_table, f"{seq} already holds blocks"
        tables = hits.tables if isinstance(hits, GroupHits) else [hits]
        for block in (b for t in tables for b in t):
            if block == NO_BLOCK:  # before the window of the first new token: not taken
                continue
            if self.ref_counts[block] == 0:
                self.free_blocks.remove(block)
            self.ref_counts[block] += 1
        self._set_tables(seq, [list(t) for t in tables])
        seq.num_cached_blocks = len(hits)

    def extend_tables(self, seq: Sequence, rows: list[list]) -> list[tuple[list[int], list, int]]:
        """The KV tiers' part of seq's prefix (engine/core/tier_prefix.py) after the blocks it
        took: each group's ``rows`` entries (NO_BLOCK, a cached pool block, taken first, or an
        array to load into a fresh block), their blocks registered and counted computed;
        returns (fresh block ids, their arrays, group) of each group that loads some."""
        for block in (r for t in rows for r in t if not _is_load(r) and r != NO_BLOCK):
            if self.ref_counts[block] == 0:
                self.free_blocks.remove(block)
            self.ref_counts[block] += 1
        tables, loads = self.tables(seq), []
        for g, entries in enumerate(rows):
            ids = [self._take_free() if _is_load(r) else r for r in entries]
            tables[g] = tables[g] + ids
            fresh = [(b, r) for b, r in zip(ids, entries, strict=True) if _is_load(r)]
            if fresh:
                loads.append(([b for b, _ in fresh], [r for _, r in fresh], g))
        self._set_tables(seq, tables)
        seq.num_computed_tokens = len(tables[0]) * self.block_size
        self.cache_full_blocks(seq, seq.num_computed_tokens)
        return loads

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register seq's blocks (every group's) that are full within its first num_tokens
        tokens: those computed once the step being scheduled has run. A block only partly
        computed by then is not registered. A hash already cached keeps its first block; this
        copy stays unshared and uncached."""
        if not self.enable_caching:
            return
        full = num_tokens // self.block_size
        if full <= seq.num_cached_blocks:
            return
        hashes = self.block_hashes(seq)
        full = min(full, len(hashes))  # a block that ends in a pending token waits for its id
        tables = self.tables(seq) if self.num_groups > 1 else [seq.block_table]
        for g, (table, cache) in enumerate(zip(tables, self.caches, strict=True)):
            for i in range(seq.num_cached_blocks, full):
                block, h = table[i], hashes[i]
                if block != NO_BLOCK and h not in cache and block not in self.block_hash:
                    self._register(block, h, self.block_key(seq, i), g)
        seq.num_cached_blocks = full

    def _register(self, block: int, h: int, key: BlockKey, group: int = 0) -> None:
        self.caches[group][h] = block
        self.block_hash[block] = h
        self.block_keys[block] = key
        if group:
            self.block_group[block] = group

    # -- swapping -------------------------------------------------------------------------------

    def can_swap_out(self, seq: Sequence) -> bool:
        return self.held_blocks(seq) <= len(self.free_cpu_blocks)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move seq's blocks (every group's) to CPU blocks (a NO_BLOCK entry stays one); returns
        (gpu_block, cpu_block) copy pairs."""
        assert self.can_swap_out(seq), "swap_out: not enough free CPU blocks"
        pairs, cpu_tables = [], []
        for table in self.tables(seq):
            cpu = [NO_BLOCK if b == NO_BLOCK else self.free_cpu_blocks.popleft() for b in table]
            for gpu in reversed(table):
                if gpu != NO_BLOCK:
                    self._release(gpu)
            pairs += [(g, c) for g, c in zip(table, cpu, strict=True) if g != NO_BLOCK]
            cpu_tables.append(cpu)
        seq.cpu_block_table, seq.cpu_group_tables = cpu_tables[0], cpu_tables[1:]
        seq.block_table, seq.group_tables = [], []
        return pairs

    def can_swap_in(self, seq: Sequence, num_new_tokens: int = 0) -> bool:
        """Room for seq's swapped blocks plus any new ones its next num_new_tokens need."""
        cpu = seq.cpu_block_table
        total = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        held = sum(b != NO_BLOCK for t in self.cpu_tables(seq) for b in t)
        return held + max(0, total - len(cpu)) * self.num_groups <= len(self.free_blocks)

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move seq's blocks back to GPU blocks; returns (cpu_block, gpu_block) copy pairs."""
        cpu_tables = self.cpu_tables(seq)
        held = [b for t in cpu_tables for b in t if b != NO_BLOCK]
        assert len(held) <= len(self.free_blocks), "swap_in: not enough free blocks"
        pairs, tables = [], []
        for cpu in cpu_tables:
            gpu = [NO_BLOCK if b == NO_BLOCK else self._take_free() for b in cpu]
            pairs += [(c, g) for c, g in zip(cpu, gpu, strict=True) if c != NO_BLOCK]
            tables.append(gpu)
        self.free_cpu_blocks.extend(held)
        self._set_tables(seq, tables)
        seq.cpu_block_table, seq.cpu_group_tables = [], []
        return pairs

    # -- invariants -----------------------------------------------------------------------------

    def check_invariants(
        self,
        seqs: list[Sequence],
        scheduled: dict[int, int] | None = None,
        releasing: list[Sequence] = (),
    ) -> None:
        """Every block free (ref 0) or held by live sequences (ref = how many hold it; exactly
        one without prefix caching); free + used = total; each group's tables sized to their
        tokens and a block in one group at a time; every cached hash names a block whose tokens
        hash to it, and no sequence writes into one.

        Between schedule and update, ``scheduled`` maps seq_id -> tokens the step computes (a
        registered block must be computed once the step has run), and ``releasing`` holds the
        sequences finished meanwhile, whose blocks go back only after the step.

        Raises AssertionError (kept under ``python -O``) naming the first broken rule.
        """
        check_pool(self, seqs, scheduled or {}, releasing)
