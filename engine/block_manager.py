"""The KV block pool's bookkeeping: a FIFO free block queue and one page table per sequence.

Allocation pops block ids from the head of the free queue; freed blocks go back to the tail in
page-table order, so a block freed long ago is reused first. The page tables themselves live on
the sequences (``Sequence.block_table``, and ``Sequence.cpu_block_table`` while swapped out). This
module moves no data: swaps return (src, dst) block pairs for the backend to copy.
"""

from __future__ import annotations

from collections import deque

from engine.sequence import Sequence, SequenceStatus


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0):
        if num_blocks < 1 or block_size < 1 or num_cpu_blocks < 0:
            raise ValueError(
                f"BlockManager: need num_blocks >= 1, block_size >= 1, num_cpu_blocks >= 0, got "
                f"{num_blocks}, {block_size}, {num_cpu_blocks}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_cpu_blocks = num_cpu_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.free_cpu_blocks: deque[int] = deque(range(num_cpu_blocks))

    # -- GPU pool -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self.free_cpu_blocks)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return _cdiv(num_tokens, self.block_size)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """New blocks to cover positions < num_computed_tokens + num_new_tokens."""
        total = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self.free_blocks)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Grow seq.block_table to hold num_new_tokens more tokens; returns the new block ids."""
        n = self.blocks_needed(seq, num_new_tokens)
        assert n <= len(self.free_blocks), f"allocate: need {n} blocks, {self.num_free_blocks} free"
        new = [self.free_blocks.popleft() for _ in range(n)]
        seq.block_table.extend(new)
        return new

    def free(self, seq: Sequence) -> None:
        """Every block of seq (GPU and CPU) back to the tail of its free queue, in table order."""
        self.free_blocks.extend(seq.block_table)
        self.free_cpu_blocks.extend(seq.cpu_block_table)
        seq.block_table = []
        seq.cpu_block_table = []

    # -- swapping -------------------------------------------------------------------------------

    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= len(self.free_cpu_blocks)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move seq's blocks to CPU blocks; returns (gpu_block, cpu_block) copy pairs."""
        assert self.can_swap_out(seq), "swap_out: not enough free CPU blocks"
        pairs = [(gpu, self.free_cpu_blocks.popleft()) for gpu in seq.block_table]
        self.free_blocks.extend(seq.block_table)
        seq.cpu_block_table = [cpu for _, cpu in pairs]
        seq.block_table = []
        return pairs

    def can_swap_in(self, seq: Sequence, num_new_tokens: int = 0) -> bool:
        """Room for seq's swapped blocks plus any new ones its next num_new_tokens need."""
        total = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        return max(total, len(seq.cpu_block_table)) <= len(self.free_blocks)

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move seq's blocks back to GPU blocks; returns (cpu_block, gpu_block) copy pairs."""
        assert len(seq.cpu_block_table) <= len(self.free_blocks), "swap_in: not enough free blocks"
        pairs = [(cpu, self.free_blocks.popleft()) for cpu in seq.cpu_block_table]
        self.free_cpu_blocks.extend(seq.cpu_block_table)
        seq.block_table = [gpu for _, gpu in pairs]
        seq.cpu_block_table = []
        return pairs

    # -- invariants -----------------------------------------------------------------------------

    def check_invariants(self, seqs: list[Sequence]) -> None:
        """Every block free or owned by exactly one live sequence; tables sized to their tokens.

        Raises AssertionError (kept under ``python -O``) naming the first broken rule.
        """
        gpu_tables = [s.block_table for s in seqs]
        cpu_tables = [s.cpu_block_table for s in seqs]
        _check_pool("GPU", self.num_blocks, self.free_blocks, gpu_tables)
        _check_pool("CPU", self.num_cpu_blocks, self.free_cpu_blocks, cpu_tables)
        for seq in seqs:
            self._check_seq(seq)

    def _check_seq(self, seq: Sequence) -> None:
        held = len(seq.block_table) + len(seq.cpu_block_table)
        if seq.is_finished:
            _require(held == 0, f"{seq} is finished but holds blocks")
            return
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
