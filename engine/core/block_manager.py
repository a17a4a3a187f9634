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
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Iterator

from engine.core.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from engine.core.window_blocks import (
    NO_BLOCK,
    first_visible_block,
    hidden_loads,
    peak_blocks,
    window_prefix,
)
from engine.utils import cdiv

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


class BlockManager:
    """``connector``: the KV tiers under the prefix cache (engine/kv_offload), or None: an
    evicted cached block some tier lacks is then kept for the step's forward to store.
    ``window``: the sliding window every layer has (0: none, or not every layer slides the
    same), whose hidden blocks ``slide`` gives back."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_cpu_blocks: int = 0,
        enable_caching=False,
        connector=None,
        window: int = 0,
    ):
        if num_blocks < 1 or block_size < 1 or num_cpu_blocks < 0 or window < 0:
            raise ValueError(
                f"BlockManager: need num_blocks >= 1, block_size >= 1, num_cpu_blocks >= 0, "
                f"window >= 0, got {num_blocks}, {block_size}, {num_cpu_blocks}, {window}"
            )
        if enable_caching and num_cpu_blocks:
            raise ValueError("BlockManager: prefix caching does not support swap (CPU) blocks")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_caching = enable_caching
        self.window = window
        self.free_blocks = FreeBlockQueue(range(num_blocks), lifo=not enable_caching)
        self.free_cpu_blocks: deque[int] = deque(range(num_cpu_blocks))
        self.ref_counts = [0] * num_blocks  # live sequences whose table holds the block
        self.cached: dict[int, int] = {}  # block hash -> block id (in use, or free and cached)
        self.block_hash: dict[int, int] = {}  # cached block id -> its hash
        self.block_keys: dict[int, BlockKey] = {}  # cached block id -> what its hash hashed
        # KV tiers under the cache (engine/kv_offload): evicted blocks some tier lacks wait in
        # ``evicted`` for the step's forward to store their bytes first
        self.connector = connector
        self.evicted: list[tuple[int, int, BlockKey]] = []  # (block id, hash, key)

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
        """New blocks to cover positions < num_computed_tokens + num_new_tokens."""
        total = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int] = ()) -> bool:
        """Room for num_new_tokens more tokens of seq, after it takes the cached blocks ``hits``
        (a hit block that waits in the free queue counts against the free blocks too)."""
        if not hits:
            return self.blocks_needed(seq, num_new_tokens) <= len(self.free_blocks)
        assert not seq.block_table, "cache hits only for a sequence that holds no blocks"
        total = self.blocks_for_tokens(len(hits) * self.block_size + num_new_tokens)
        revived = sum(b != NO_BLOCK and self.ref_counts[b] == 0 for b in hits)
        return total - len(hits) + revived <= len(self.free_blocks)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Grow seq.block_table to hold num_new_tokens more tokens; returns the new block ids."""
        n = self.blocks_needed(seq, num_new_tokens)
        assert n <= len(self.free_blocks), f"allocate: need {n} blocks, {self.num_free_blocks} free"
        new = [self._take_free() for _ in range(n)]
        seq.block_table.extend(new)
        return new

    def free(self, seq: Sequence) -> None:
        """Every block of seq (GPU and CPU) back to its free queue once no other sequence holds
        it, in reverse table order: reused in table order (LIFO), or evicted tail first (LRU)."""
        for block in reversed(seq.block_table):
            if block != NO_BLOCK:
                self._release(block)
        self.free_cpu_blocks.extend(b for b in seq.cpu_block_table if b != NO_BLOCK)
        seq.block_table = []
        seq.cpu_block_table = []
        seq.num_cached_blocks = 0

    def trim(self, seq: Sequence) -> None:
        """Speculative decoding: blocks past seq's tokens (taken for drafts that were rejected)
        back to the free queue; they hold no cached or shared block."""
        keep = self.blocks_for_tokens(seq.num_tokens)
        if len(seq.block_table) <= keep:
            return
        extra = seq.block_table[keep:]
        # a new list: page-table copies keyed on the list (ModelRunner's) see it was replaced
        seq.block_table = seq.block_table[:keep]
        for block in reversed(extra):
            assert block not in self.block_hash, f"lookahead block {block} is cached"
            self._release(block)

    # -- sliding window -------------------------------------------------------------------------

    def first_visible_block(self, pos: int) -> int:
        return first_visible_block(pos, self.window, self.block_size)

    def peak_blocks(self, num_tokens: int, step_tokens: int) -> int:
        return peak_blocks(num_tokens, step_tokens, self.window, self.block_size)

    def skip_hidden_loads(self, hits: list[int], num_loads: int) -> tuple[list[int], int]:
        """Sliding window: (the prefix hits as taken, how many of the KV tiers' ``num_loads``
        blocks after them lead before the window of the first token after them). Those are
        not loaded; when there are any, no hit block is taken either (all NO_BLOCK)."""
        skip = hidden_loads(len(hits), num_loads, self.window, self.block_size)
        return ([NO_BLOCK] * (len(hits) + skip) if skip else hits), skip

    def held_blocks(self, seq: Sequence) -> int:
        """The pool blocks seq's page table holds (NO_BLOCK entries are not)."""
        return sum(b != NO_BLOCK for b in seq.block_table)

    def slide(self, seq: Sequence) -> None:
        """Sliding window: seq's blocks that no query from its ``num_computed_tokens`` on can
        see back to the free queue (tail first, as ``free``); their entries become NO_BLOCK in
        a new table list (ModelRunner's page-table copies see it was replaced)."""
        table = seq.block_table
        n = min(self.first_visible_block(seq.num_computed_tokens), len(table))
        if n == 0 or table[n - 1] == NO_BLOCK:
            return
        table = list(table)
        for i in range(n - 1, -1, -1):
            if table[i] == NO_BLOCK:
                break
            self._release(table[i])
            table[i] = NO_BLOCK
        seq.block_table = table

    def _take_free(self) -> int:
        """The head of the free queue, its cache entry (if any) evicted; ref 1."""
        block = self.free_blocks.popleft()
        h = self.block_hash.pop(block, None)
        if h is not None:  # evict: the least recently freed cached block goes first
            del self.cached[h]
            key = self.block_keys.pop(block)
            if self.connector is not None and self.connector.missing(h):
                self.evicted.append((block, h, key))
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
        that at least its last token is still computed (its logits are needed); [] when off."""
        if not self.enable_caching or seq.block_table:
            return []
        limit = (seq.num_tokens - 1) // self.block_size
        if self.window:
            blocks = [self.cached.get(h) for h in self.block_hashes(seq)[:limit]]
            return window_prefix(blocks, self.window, self.block_size)
        hits = []
        for h in self.block_hashes(seq)[:limit]:
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def tier_prefix(self, seq: Sequence, start: int) -> list:
        """The blocks of seq's prompt after its first ``start`` full blocks (those the pool
        holds) that the KV tiers hold, a leading run, as arrays to load; capped like
        ``cached_prefix``."""
        if self.connector is None:
            return []
        limit = (seq.num_tokens - 1) // self.block_size
        hashes = self.block_hashes(seq)[start:limit]
        keys = [self.block_key(seq, i) for i in range(start, start + len(hashes))]
        return self.connector.fetch(hashes, keys)

    def take_evicted(self) -> list[tuple[int, int, BlockKey]]:
        """The evicted blocks whose bytes the tiers still need, since the last call."""
        evicted, self.evicted = self.evicted, []
        return evicted

    def take_cached(self, seq: Sequence, hits: list[int]) -> None:
        """Start seq's table with the cached blocks ``hits`` (ref += 1; revived if free)."""
        assert not seq.block_table, f"{seq} already holds blocks"
        for block in hits:
            if block == NO_BLOCK:  # before the window of the first new token: not taken
                continue
            if self.ref_counts[block] == 0:
                self.free_blocks.remove(block)
            self.ref_counts[block] += 1
        seq.block_table = list(hits)
        seq.num_cached_blocks = len(hits)

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register seq's blocks that are full within its first num_tokens tokens: those computed
        once the step being scheduled has run. A block only partly computed by then is not
        registered. A hash already cached keeps its first block; this copy stays unshared and
        uncached."""
        if not self.enable_caching:
            return
        full = num_tokens // self.block_size
        if full <= seq.num_cached_blocks:
            return
        hashes = self.block_hashes(seq)
        full = min(full, len(hashes))  # a block that ends in a pending token waits for its id
        for i in range(seq.num_cached_blocks, full):
            block, h = seq.block_table[i], hashes[i]
            if block != NO_BLOCK and h not in self.cached and block not in self.block_hash:
                self._register(block, h, self.block_key(seq, i))
        seq.num_cached_blocks = full

    def _register(self, block: int, h: int, key: BlockKey) -> None:
        self.cached[h] = block
        self.block_hash[block] = h
        self.block_keys[block] = key

    # -- swapping -------------------------------------------------------------------------------

    def can_swap_out(self, seq: Sequence) -> bool:
        return self.held_blocks(seq) <= len(self.free_cpu_blocks)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move seq's blocks to CPU blocks (a NO_BLOCK entry stays one); returns
        (gpu_block, cpu_block) copy pairs."""
        assert self.can_swap_out(seq), "swap_out: not enough free CPU blocks"
        table = seq.block_table
        cpu = [NO_BLOCK if b == NO_BLOCK else self.free_cpu_blocks.popleft() for b in table]
        for gpu in reversed(table):
            if gpu != NO_BLOCK:
                self._release(gpu)
        seq.cpu_block_table = cpu
        seq.block_table = []
        return [(g, c) for g, c in zip(table, cpu, strict=True) if g != NO_BLOCK]

    def can_swap_in(self, seq: Sequence, num_new_tokens: int = 0) -> bool:
        """Room for seq's swapped blocks plus any new ones its next num_new_tokens need."""
        cpu = seq.cpu_block_table
        total = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        held = sum(b != NO_BLOCK for b in cpu)
        return held + max(0, total - len(cpu)) <= len(self.free_blocks)

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move seq's blocks back to GPU blocks; returns (cpu_block, gpu_block) copy pairs."""
        cpu = seq.cpu_block_table
        held = [b for b in cpu if b != NO_BLOCK]
        assert len(held) <= len(self.free_blocks), "swap_in: not enough free blocks"
        gpu = [NO_BLOCK if b == NO_BLOCK else self._take_free() for b in cpu]
        self.free_cpu_blocks.extend(held)
        seq.block_table = gpu
        seq.cpu_block_table = []
        return [(c, g) for c, g in zip(cpu, gpu, strict=True) if c != NO_BLOCK]

    # -- invariants -----------------------------------------------------------------------------

    def check_invariants(
        self,
        seqs: list[Sequence],
        scheduled: dict[int, int] | None = None,
        releasing: list[Sequence] = (),
    ) -> None:
        """Every block free (ref 0) or held by live sequences (ref = how many hold it; exactly
        one without prefix caching); free + used = total; tables sized to their tokens; every
        cached hash names a block whose tokens hash to it, and no sequence writes into one.

        Between schedule and update, ``scheduled`` maps seq_id -> tokens the step computes (a
        registered block must be computed once the step has run), and ``releasing`` holds the
        sequences finished meanwhile, whose blocks go back only after the step.

        Raises AssertionError (kept under ``python -O``) naming the first broken rule.
        """
        holders = list(seqs) + list(releasing)
        gpu_tables = [[b for b in s.block_table if b != NO_BLOCK] for s in holders]
        cpu_tables = [[b for b in s.cpu_block_table if b != NO_BLOCK] for s in holders]
        if not self.enable_caching:
            _check_pool("GPU", self.num_blocks, self.free_blocks, gpu_tables)
        _check_pool("CPU", self.num_cpu_blocks, self.free_cpu_blocks, cpu_tables)
        for seq in seqs:
            self._check_seq(seq)
        self._check_refs(gpu_tables)
        self._check_cache(holders, scheduled or {})

    def _check_refs(self, tables: list[list[int]]) -> None:
        """ref == number of tables holding the block; the free ones (ref 0) and the held ones
        partition the pool."""
        held = Counter(b for table in tables for b in table)
        free = set(self.free_blocks)
        _require(all(len(set(t)) == len(t) for t in tables), "GPU: a table holds a block twice")
        _require(not free & held.keys(), "GPU: a block is free and held at once")
        _require(
            len(free) + len(held) == self.num_blocks
            and free | held.keys() == set(range(self.num_blocks)),
            f"GPU: free ({len(free)}) + used ({len(held)}) != total ({self.num_blocks}), "
            "or a block leaked",
        )
        for block, ref in enumerate(self.ref_counts):
            _require(ref == held[block], f"GPU: block {block}: ref {ref}, {held[block]} holders")

    def _check_cache(self, seqs: list[Sequence], scheduled: dict[int, int]) -> None:
        """The hash map and each block's hash agree, and match the tokens that made them."""
        _require(len(self.block_hash) == len(self.cached), "cache: map and block hashes differ")
        for h, block in self.cached.items():
            _require(self.block_hash.get(block) == h, f"cache: block {block} is not under its hash")
            _require(hash_block(*self.block_keys[block]) == h, f"cache: block {block}'s key")
        bs = self.block_size
        for seq in seqs:
            chain, parent, ids = [], seq.hash_root, seq.token_ids
            for i in range(seq.num_tokens // bs):
                parent = hash_block(parent, ids[i * bs : (i + 1) * bs])
                chain.append(parent)
            _require(seq.block_hashes == chain[: len(seq.block_hashes)], f"{seq}: wrong hashes")
            computed = seq.num_computed_tokens + scheduled.get(seq.seq_id, 0)  # after the step
            _require(
                seq.num_cached_blocks <= computed // bs,
                f"{seq}: registered blocks that are not computed",
            )
            for i, block in enumerate(seq.block_table):
                if block == NO_BLOCK:
                    continue
                if i < seq.num_cached_blocks and block in self.block_hash:
                    _require(self.block_hash[block] == chain[i], f"{seq}: block {block} hash")
                else:  # this seq still writes the block: nobody else may hold it
                    _require(block not in self.block_hash, f"{seq} writes cached block {block}")
                    _require(self.ref_counts[block] == 1, f"{seq} writes shared block {block}")

    def _check_seq(self, seq: Sequence) -> None:
        held = len(seq.block_table) + len(seq.cpu_block_table)
        if seq.is_finished:
            _require(held == 0, f"{seq} is finished but holds blocks")
            return
        table = seq.block_table or seq.cpu_block_table
        gone = table.count(NO_BLOCK)
        _require(
            table[:gone] == [NO_BLOCK] * gone,
            f"{seq}: a NO_BLOCK entry after a held block",
        )
        _require(
            gone <= self.first_visible_block(seq.num_computed_tokens),
            f"{seq}: gave back a block that a query from token {seq.num_computed_tokens} sees",
        )
        _require(not (seq.block_table and seq.cpu_block_table), f"{seq} holds GPU and CPU blocks")
        _require(held <= self.blocks_for_tokens(seq.num_tokens), f"{seq} holds too many blocks")
        _require(
            held >= self.blocks_for_tokens(seq.num_computed_tokens),
            f"{seq} has fewer blocks than its {seq.num_computed_tokens} computed tokens need",
        )
        if seq.status == SequenceStatus.WAITING:
            _require(held == 0 and seq.num_computed_tokens == 0, f"{seq} waits with cache state")
        if seq.status == SequenceStatus.SWAPPED:
            _require(not seq.block_table, f"{seq} is swapped but holds GPU blocks")
        if seq.status == SequenceStatus.RUNNING:
            _require(not seq.cpu_block_table, f"{seq} is running but holds CPU blocks")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise AssertionError(message)


def _check_pool(name: str, total: int, free: deque[int], tables: list[list[int]]) -> None:
    """Free blocks and owned blocks partition range(total), with no block listed twice."""
    owned = [b for table in tables for b in table]
    everything = list(free) + owned
    _require(len(set(free)) == len(free), f"{name}: a block is twice in the free queue")
    _require(len(set(owned)) == len(owned), f"{name}: a block is owned twice")
    _require(
        len(everything) == total and set(everything) == set(range(total)),
        f"{name}: free ({len(free)}) + used ({len(owned)}) != total ({total}), or a block leaked",
    )
