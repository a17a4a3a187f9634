"""Scheduler: decode priority, FCFS admission, limits, preemption in both modes, rejection.

Every test asserts exact block ids, in the style of vLLM's tests/v1/core.
"""

import logging

import pytest

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.scheduler import Scheduler
from engine.core.sequence import SequenceStatus
from tests.utils import make_scheduler, make_seq, scheduled_ids, step


def test_prefill_then_decodes_with_exact_blocks():
    sched = make_scheduler()
    a, b = make_seq(9), make_seq(6)
    sched.add(a)
    sched.add(b)
    out = step(sched)
    assert scheduled_ids(out) == [(a.seq_id, 9), (b.seq_id, 6)] and out.num_decodes == 0
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4]
    assert a.num_output_tokens == 1 and b.num_output_tokens == 1
    for _ in range(2):  # a: positions 9, 10 (block 2); b: positions 6, 7 (block 4)
        out = step(sched)
        assert scheduled_ids(out) == [(a.seq_id, 1), (b.seq_id, 1)] and out.num_decodes == 2
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4]
    step(sched)  # a: position 11; b: position 8 crosses into a new block from the head
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4, 5]
    step(sched)  # a: position 12 crosses
    assert a.block_table == [0, 1, 2, 6]
    assert a.num_computed_tokens == 13 and a.num_tokens == 14


def test_decodes_come_before_new_prefills():
    sched = make_scheduler()
    a = make_seq(5)
    sched.add(a)
    step(sched)
    c = make_seq(7)
    sched.add(c)
    out = step(sched)
    assert scheduled_ids(out) == [(a.seq_id, 1), (c.seq_id, 7)] and out.num_decodes == 1
    assert c.block_table == [2, 3]


def test_admission_is_first_come_first_served():
    sched = make_scheduler(num_blocks=6)
    a = make_seq(13)  # 4 blocks
    sched.add(a)
    step(sched)
    big, small = make_seq(12), make_seq(3)  # 3 blocks (2 free) and 1 block
    sched.add(big)
    sched.add(small)
    out = step(sched)
    assert scheduled_ids(out) == [(a.seq_id, 1)]  # small would fit, but big is ahead of it
    assert list(sched.waiting) == [big, small]
    sched.finish(a, "stop")
    out = step(sched)
    assert scheduled_ids(out) == [(big.seq_id, 12), (small.seq_id, 3)]
    assert big.block_table == [0, 1, 2] and small.block_table == [3]  # a's, freed last


def test_max_num_seqs_limits_the_batch():
    sched = make_scheduler(max_num_seqs=2)
    a, b, c = make_seq(4), make_seq(4), make_seq(4)
    for seq in (a, b, c):
        sched.add(seq)
    out = step(sched)
    assert scheduled_ids(out) == [(a.seq_id, 4), (b.seq_id, 4)] and list(sched.waiting) == [c]
    out = step(sched)
    assert scheduled_ids(out) == [(a.seq_id, 1), (b.seq_id, 1)]
    sched.finish(a, "stop")
    out = step(sched)  # c joins the very next step
    assert scheduled_ids(out) == [(b.seq_id, 1), (c.seq_id, 4)]
    assert c.block_table == [0]  # the head: a's blocks [0, 2] went back there, 0 first


def test_token_budget_limits_prefills():
    sched = make_scheduler(max_model_len=16, max_num_batched_tokens=16)
    a, b = make_seq(10), make_seq(10)
    sched.add(a)
    sched.add(b)
    out = step(sched)
    assert scheduled_ids(out) == [(a.seq_id, 10)]  # 10 + 10 > 16
    out = step(sched)
    assert scheduled_ids(out) == [(a.seq_id, 1), (b.seq_id, 10)]
    assert out.num_batched_tokens == 11


def test_finished_seq_frees_blocks_and_waiting_joins_next_step():
    sched = make_scheduler()
    a, b, c = make_seq(17), make_seq(17), make_seq(8)  # 5 + 5 blocks fill the pool
    for seq in (a, b, c):
        sched.add(seq)
    out = step(sched)
    assert scheduled_ids(out) == [(a.seq_id, 17), (b.seq_id, 17)]
    assert a.block_table == [0, 1, 2, 3, 4] and b.block_table == [5, 6, 7, 8, 9]
    step(sched)
    assert c.status == SequenceStatus.WAITING
    sched.finish(a, "stop")
    assert a.block_table == [] and list(sched.block_manager.free_blocks) == [0, 1, 2, 3, 4]
    out = step(sched)
    assert scheduled_ids(out) == [(b.seq_id, 1), (c.seq_id, 8)]
    assert c.block_table == [0, 1]


def _fill_pool(sched):
    """a (16 tokens), b (16), c (8): all 10 blocks used, each seq sampled one token."""
    a, b, c = make_seq(16), make_seq(16), make_seq(8)
    for seq in (a, b, c):
        sched.add(seq)
    step(sched)
    assert a.block_table == [0, 1, 2, 3] and b.block_table == [4, 5, 6, 7]
    assert c.block_table == [8, 9] and sched.block_manager.num_free_blocks == 0
    return a, b, c


def test_recompute_preempts_the_latest_arrival(caplog):
    sched = make_scheduler()
    a, b, c = _fill_pool(sched)
    d = make_seq(30)
    sched.add(d)
    with caplog.at_level(logging.WARNING, logger="engine.scheduler"):
        out = step(sched)  # a and b cross a block boundary; c arrived last
    assert out.preempted == [c] and scheduled_ids(out) == [(a.seq_id, 1), (b.seq_id, 1)]
    assert a.block_table == [0, 1, 2, 3, 8] and b.block_table == [4, 5, 6, 7, 9]
    assert c.status == SequenceStatus.WAITING and c.num_computed_tokens == 0
    assert c.block_table == [] and list(sched.waiting) == [c, d]
    assert any("preempted by recompute" in r.getMessage() for r in caplog.records)
    assert sched.num_preemptions == 1
    sched.finish(a, "stop")  # free queue: 0 1 2 3 8
    out = step(sched)
    # c re-prefills its prompt and the token it had generated; d (8 blocks) still waits
    assert scheduled_ids(out) == [(b.seq_id, 1), (c.seq_id, 9)]
    assert c.block_table == [0, 1, 2] and c.num_output_tokens == 2
    assert list(sched.waiting) == [d]


def test_a_seq_preempts_itself_when_it_is_the_latest():
    sched = make_scheduler()
    a, b = make_seq(16), make_seq(19)
    sched.add(a)
    sched.add(b)
    step(sched)  # a: [0..3], b: [4..8], free: [9]
    out = step(sched)  # a crosses into 9; b writes position 19 into block 8
    assert scheduled_ids(out) == [(a.seq_id, 1), (b.seq_id, 1)] and a.block_table[-1] == 9
    out = step(sched)  # b crosses, nothing free: b is the latest, so b yields
    assert out.preempted == [b] and scheduled_ids(out) == [(a.seq_id, 1)]
    assert b.status == SequenceStatus.WAITING
    assert list(sched.block_manager.free_blocks) == [4, 5, 6, 7, 8]


def test_swap_preemption_pairs_and_swap_in_before_prefills(caplog):
    sched = make_scheduler(num_cpu_blocks=4, preemption_mode="swap")
    a, b, c = _fill_pool(sched)
    with caplog.at_level(logging.WARNING, logger="engine.scheduler"):
        out = step(sched)
    assert out.preempted == [c] and out.blocks_to_swap_out == [(8, 0), (9, 1)]
    assert c.status == SequenceStatus.SWAPPED and c.cpu_block_table == [0, 1]
    assert c.num_computed_tokens == 8  # kept: its K/V live in the CPU blocks
    assert a.block_table[-1] == 8 and b.block_table[-1] == 9
    assert any("preempted by swap" in r.getMessage() for r in caplog.records)
    d = make_seq(4)
    sched.add(d)
    out = step(sched)  # nothing freed: c stays out, and d may not jump ahead of it
    assert scheduled_ids(out) == [(a.seq_id, 1), (b.seq_id, 1)] and not out.blocks_to_swap_in
    sched.finish(a, "stop")  # free queue: 0 1 2 3 8
    out = step(sched)
    assert out.blocks_to_swap_in == [(0, 0), (1, 1)]
    assert (
        scheduled_ids(out) == [(b.seq_id, 1), (c.seq_id, 1), (d.seq_id, 4)] and out.num_decodes == 2
    )
    assert c.block_table == [0, 1, 2]  # position 8 needs a third block
    assert d.block_table == [3]
    assert list(sched.block_manager.free_cpu_blocks) == [2, 3, 0, 1]


def test_swapped_seq_comes_back_before_a_new_prefill_that_would_fit():
    sched = make_scheduler(num_blocks=11, num_cpu_blocks=4, preemption_mode="swap")
    a, b, e, c = make_seq(16), make_seq(16), make_seq(3), make_seq(8)
    for seq in (a, b, e, c):
        sched.add(seq)
    step(sched)  # a [0..3], b [4..7], e [8], c [9, 10]
    out = step(sched)
    assert out.preempted == [c] and out.blocks_to_swap_out == [(9, 0), (10, 1)]
    sched.finish(e, "stop")  # one free block: enough for d, not for c (3 blocks)
    d = make_seq(4)
    sched.add(d)
    out = step(sched)
    assert scheduled_ids(out) == [(a.seq_id, 1), (b.seq_id, 1)] and list(sched.waiting) == [d]
    assert list(sched.block_manager.free_blocks) == [8]


def test_swap_without_cpu_room_falls_back_to_recompute(caplog):
    sched = make_scheduler(num_cpu_blocks=1, preemption_mode="swap")
    a, b, c = _fill_pool(sched)  # c holds 2 blocks, the CPU pool has 1
    with caplog.at_level(logging.WARNING, logger="engine.scheduler"):
        out = step(sched)
    assert out.preempted == [c] and not out.blocks_to_swap_out
    assert c.status == SequenceStatus.WAITING and c.num_computed_tokens == 0
    assert any("recompute (no free CPU blocks" in r.getMessage() for r in caplog.records)


def test_prompt_that_never_fits_is_rejected_and_others_run():
    sched = make_scheduler()
    huge, long, ok = make_seq(41), make_seq(65), make_seq(5)  # 11 blocks > 10; 65 > 64 tokens
    for seq in (huge, long, ok):
        sched.add(seq)
    out = step(sched)
    assert scheduled_ids(out) == [(ok.seq_id, 5)] and ok.block_table == [0, 1]
    rejected = sched.take_rejected()
    assert [s for s, _ in rejected] == [huge, long]
    assert "need 11 KV blocks" in rejected[0][1] and "max_model_len=64" in rejected[1][1]
    assert all("\n" not in reason for _, reason in rejected)
    assert huge.is_finished and huge.finish_reason == "abort" and huge.block_table == []
    assert sched.take_rejected() == []


def test_seq_that_outgrows_the_pool_is_rejected_not_hung():
    sched = make_scheduler(num_blocks=3)
    a = make_seq(11)
    sched.add(a)
    for _ in range(2):  # the prefill, then position 11: the last of 12 slots
        step(sched)
    assert a.num_tokens == 13 and a.block_table == [0, 1, 2]
    out = step(sched)
    assert out.scheduled == [] and out.is_empty and a.is_finished
    assert "need 4 KV blocks" in sched.take_rejected()[0][1]
    assert sched.block_manager.num_free_blocks == 3 and not sched.has_unfinished()


def test_abort_from_every_queue():
    sched = make_scheduler(num_cpu_blocks=4, preemption_mode="swap")
    a, b, c = _fill_pool(sched)
    step(sched)  # c swapped out
    d = make_seq(4, request_id="waiting-one")
    sched.add(d)
    assert sched.abort(c.request_id) and sched.abort(a.request_id) and sched.abort("waiting-one")
    assert not sched.abort("no-such-request")
    for seq in (a, c, d):
        assert seq.is_finished and seq.finish_reason == "abort"
    assert list(sched.block_manager.free_cpu_blocks) == [2, 3, 0, 1]
    assert list(sched.block_manager.free_blocks) == [0, 1, 2, 3, 8]
    sched.check_invariants()
    assert sched.running == [b] and not sched.swapped and not sched.waiting


def test_update_skips_a_seq_aborted_after_schedule():
    sched = make_scheduler()
    a, b = make_seq(5), make_seq(6)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.abort(a.request_id)
    grown = sched.update(out, {a.seq_id: 7, b.seq_id: 8})
    assert grown == [b] and b.output_token_ids == [8] and a.output_token_ids == []
    sched.check_invariants()


def test_chunked_prefill_splits_to_the_budget_and_keeps_decode_priority():
    sched = make_scheduler(enable_chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=4)
    a = make_seq(3)
    sched.add(a)
    step(sched)  # a: [0], decoding from now on
    b = make_seq(20)
    sched.add(b)
    out = step(sched)
    assert scheduled_ids(out) == [(a.seq_id, 1), (b.seq_id, 7)] and b.block_table == [1, 2]
    assert b.num_output_tokens == 0  # a chunk samples nothing
    out = step(sched)  # a crosses into block 3 first, then b's chunk takes 4 and 5
    assert scheduled_ids(out) == [(a.seq_id, 1), (b.seq_id, 7)]
    assert a.block_table == [0, 3] and b.block_table == [1, 2, 4, 5]
    out = step(sched)
    assert scheduled_ids(out) == [(a.seq_id, 1), (b.seq_id, 6)] and b.block_table == [1, 2, 4, 5, 6]
    assert b.num_output_tokens == 1 and b.num_computed_tokens == 20
    out = step(sched)
    assert scheduled_ids(out) == [(a.seq_id, 1), (b.seq_id, 1)] and out.num_decodes == 2


def test_scheduler_needs_a_resolved_config():
    with pytest.raises(ValueError, match="resolve"):
        Scheduler(EngineConfig(), BlockManager(4, 4))
