"""Block manager: exact block ids from the free queue (LIFO without prefix caching), swaps, and the
invariant check."""

import pytest

from engine.core.block_manager import BlockManager
from engine.core.sequence import Sequence, SequenceStatus
from tests.utils import make_seq, random_tokens


def prefill(bm: BlockManager, seq: Sequence) -> list[int]:
    """Allocate a whole prompt and mark it computed, as one finished prefill step would."""
    bm.allocate(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    seq.status = SequenceStatus.RUNNING
    return seq.block_table


def decode(bm: BlockManager, seq: Sequence) -> list[int]:
    """Append one token and allocate for it, as one decode step would; returns new blocks."""
    seq.append_token(random_tokens(1)[0])
    new = bm.allocate(seq, 1)
    seq.num_computed_tokens += 1
    return new


def test_prefill_rounds_up_to_block_size_and_takes_the_head():
    bm = BlockManager(num_blocks=10, block_size=4)
    a, b = make_seq(9), make_seq(5)
    assert bm.blocks_needed(a, 9) == 3
    assert prefill(bm, a) == [0, 1, 2]
    assert prefill(bm, b) == [3, 4]
    assert list(bm.free_blocks) == [5, 6, 7, 8, 9]
    bm.check_invariants([a, b])


def test_decode_takes_a_block_only_when_crossing_a_boundary():
    bm = BlockManager(num_blocks=10, block_size=4)
    a, b = make_seq(6), make_seq(3)
    prefill(bm, a)  # positions 0..5 -> [0, 1]
    prefill(bm, b)  # positions 0..2 -> [2]
    assert decode(bm, a) == []  # position 6: block 1 has room
    assert decode(bm, a) == []  # position 7: still block 1
    assert decode(bm, b) == []  # position 3: block 2
    assert decode(bm, a) == [3]  # position 8: new block from the head
    assert decode(bm, b) == [4]  # position 4
    assert a.block_table == [0, 1, 3] and b.block_table == [2, 4]
    bm.check_invariants([a, b])


def test_free_puts_blocks_back_at_the_head_in_table_order():
    bm = BlockManager(num_blocks=10, block_size=4)
    a, b = make_seq(9), make_seq(5)
    prefill(bm, a)
    prefill(bm, b)
    bm.free(a)
    assert a.block_table == []
    assert list(bm.free_blocks) == [0, 1, 2, 5, 6, 7, 8, 9]
    c = make_seq(26)  # 7 blocks: a's first (most recently freed), in a's order, then new ones
    assert prefill(bm, c) == [0, 1, 2, 5, 6, 7, 8]
    bm.free(b)
    assert list(bm.free_blocks) == [3, 4, 9]
    d = make_seq(4)
    assert prefill(bm, d) == [3]  # b's first block, freed last
    bm.check_invariants([c, d])


def test_a_steady_workload_touches_a_bounded_set_of_blocks():
    """The same batch again and again reuses the blocks of the last one: the pool's other
    blocks (their memory pages) are never touched."""
    bm = BlockManager(num_blocks=100, block_size=4)
    touched = set()
    for _ in range(30):
        batch = [make_seq(n) for n in (9, 5, 14)]
        for seq in batch:
            prefill(bm, seq)
            for _ in range(6):
                decode(bm, seq)
            touched.update(seq.block_table)
        for seq in batch:
            bm.free(seq)
    assert touched == set(range(12))  # 4 + 3 + 5 blocks: one batch's worth, of 100
    assert bm.num_free_blocks == 100


def test_can_allocate_counts_free_blocks():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq(13)
    assert bm.can_allocate(a, 13) and not bm.can_allocate(a, 17)
    prefill(bm, a)  # 4 blocks, positions 0..12
    assert bm.num_free_blocks == 0
    b = make_seq(1)
    assert not bm.can_allocate(b, 1)
    for _ in range(3):  # positions 13..15 fit in the last block
        assert bm.blocks_needed(a, 1) == 0
        decode(bm, a)
    assert bm.blocks_needed(a, 1) == 1 and not bm.can_allocate(a, 1)


def test_chunked_allocation_grows_the_table_chunk_by_chunk():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_seq(11)
    a.status = SequenceStatus.RUNNING
    assert bm.allocate(a, 5) == [0, 1]
    a.num_computed_tokens = 5
    assert bm.allocate(a, 3) == []  # positions 5..7 fit in block 1
    a.num_computed_tokens = 8
    assert bm.allocate(a, 3) == [2]
    bm.check_invariants([a])


def test_swap_out_and_in_return_exact_pairs():
    bm = BlockManager(num_blocks=10, block_size=4, num_cpu_blocks=4)
    a, b = make_seq(9), make_seq(5)
    prefill(bm, a)  # [0, 1, 2]
    assert bm.can_swap_out(a)
    assert bm.swap_out(a) == [(0, 0), (1, 1), (2, 2)]
    a.status = SequenceStatus.SWAPPED
    assert a.block_table == [] and a.cpu_block_table == [0, 1, 2]
    assert list(bm.free_blocks) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert prefill(bm, b) == [0, 1]
    bm.check_invariants([a, b])
    assert bm.can_swap_in(a) and bm.can_swap_in(a, num_new_tokens=1)
    assert bm.swap_in(a) == [(0, 2), (1, 3), (2, 4)]
    a.status = SequenceStatus.RUNNING
    assert a.block_table == [2, 3, 4] and a.cpu_block_table == []
    assert list(bm.free_cpu_blocks) == [3, 0, 1, 2]
    bm.check_invariants([a, b])


def test_swap_checks_both_pools():
    bm = BlockManager(num_blocks=6, block_size=4, num_cpu_blocks=2)
    a = make_seq(12)
    prefill(bm, a)  # 3 blocks, more than the CPU pool
    assert not bm.can_swap_out(a)
    b = make_seq(8)
    prefill(bm, b)
    assert bm.can_swap_out(b)
    bm.swap_out(b)
    b.status = SequenceStatus.SWAPPED
    c = make_seq(12)
    assert prefill(bm, c) == [3, 4, 5]  # b's blocks first, then the never-used one: none left
    assert not bm.can_swap_in(b)
    bm.check_invariants([a, b, c])


def test_invariants_catch_a_leak():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = make_seq(5)
    prefill(bm, a)
    bm.free_blocks.popleft()  # block 2 is neither free nor owned
    with pytest.raises(AssertionError, match="leaked"):
        bm.check_invariants([a])


def test_invariants_catch_a_block_owned_twice():
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b = make_seq(5), make_seq(3)
    prefill(bm, a)
    prefill(bm, b)
    b.block_table[0] = a.block_table[0]
    bm.free_blocks.push(2)
    with pytest.raises(AssertionError, match="owned twice"):
        bm.check_invariants([a, b])


def test_invariants_catch_a_table_too_short_for_the_computed_tokens():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = make_seq(5)
    prefill(bm, a)
    a.num_computed_tokens = 5
    bm.free_blocks.push(a.block_table.pop())
    with pytest.raises(AssertionError, match="fewer blocks"):
        bm.check_invariants([a])


def test_invariants_catch_a_finished_seq_holding_blocks():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = make_seq(5)
    prefill(bm, a)
    a.status = SequenceStatus.FINISHED
    with pytest.raises(AssertionError, match="finished"):
        bm.check_invariants([a])


@pytest.mark.parametrize("args", [(0, 4, 0), (4, 0, 0), (4, 4, -1)])
def test_bad_pool_sizes(args):
    with pytest.raises(ValueError, match="BlockManager"):
        BlockManager(*args)
