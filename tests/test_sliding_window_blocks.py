"""A model whose every layer slides with one window gives back the KV blocks no later query sees.

The tiny Mistral of tests/data/families/mistral (window 8 on every layer) over 4-token blocks:
after every step each running sequence's page table must hold exactly the blocks from the one
of its first visible key (as of the step's start) on, and NO_BLOCK before it; tokens and logits
must match transformers' golden data and the same run that keeps every block; the pool must be
full again at the end. Blocks given back are filled with NaN after every step, so a kernel that
read one would spoil the logits.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from engine import SamplingParams
from engine.backends import fast_ops
from engine.core.block_manager import NO_BLOCK, BlockManager
from engine.utils import cdiv
from tests.test_families import check_outputs, golden, loaded
from tests.utils import make_engine, make_seq

WINDOW, BS = 8, 4
CHUNKED = dict(enable_chunked_prefill=True, max_num_batched_tokens=12, max_num_seqs=3)


def cases_and_params():
    cases = golden("mistral")["cases"]
    n = len(cases[0]["token_ids"])
    return cases, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def first_visible(pos: int) -> int:
    """The first block a query at pos sees (window 8, 4-token blocks), written out."""
    return max(0, pos - WINDOW + 1) // BS


def check_table(seq, before: int | None, spec: bool) -> int:
    """seq's table after a step that began with ``before`` computed tokens (None: admitted in
    it): NO_BLOCK exactly before the block of the first key visible from ``before``, held
    blocks after, as many entries as its computed tokens fill; returns the blocks held."""
    table, c = seq.block_table, seq.num_computed_tokens
    gone = table.count(NO_BLOCK)
    assert table[:gone] == [NO_BLOCK] * gone and NO_BLOCK not in table[gone:], table
    if before is not None:
        assert gone == first_visible(before), (seq, before, table)
    else:
        assert gone <= first_visible(c), (seq, table)
    lengths = {cdiv(c, BS), cdiv(seq.num_tokens, BS)} if spec else {cdiv(c, BS)}
    assert len(table) in lengths, (seq, table)
    return len(table) - gone


def drive(
    backend: str, prompts, params, keep_all=False, poison=True, spec=False, staggered=False, **args
):
    """Run prompts to the end (``staggered``: each once the one before has finished), checking
    every table after every step; -> (outputs, engine, the most blocks one sequence held)."""
    args = {"record_logits": True, **args}  # (recording logits turns speculation off)
    engine = make_engine(loaded("mistral"), backend=backend, block_size=BS, **args)
    bm, sched = engine.block_manager, engine.scheduler
    assert bm.window == WINDOW
    if keep_all:  # the same engine, every block kept
        bm.window = 0
    waiting = list(enumerate(prompts))
    done, peak = {}, 0
    while waiting or engine.has_unfinished_requests():
        while waiting and not (staggered and engine.has_unfinished_requests()):
            i, p = waiting.pop(0)
            engine.add_request(str(i), p, params)
        before = {s.seq_id: s.num_computed_tokens for s in sched.running}
        done.update({o.request_id: o for o in engine.step(stream=False)})
        engine.check_invariants()
        for seq in sched.running:
            b = before.get(seq.seq_id)
            held = check_table(seq, None if keep_all and b is not None else b, spec)
            if keep_all:
                assert seq.block_table.count(NO_BLOCK) == 0
            peak = max(peak, held)
        if poison:  # every block nobody holds (and no prefix cache keeps): NaN
            free = sorted(b for b in bm.free_blocks if b not in bm.block_hash)  # not cached
            if not free:
                continue
            data = np.ascontiguousarray(engine.backend.read_blocks(free))  # (L, 2, n, bs, ..)
            data.view(np.uint8)[...] = 0xFF  # every bit set: NaN in any float format
            engine.backend.write_blocks(free, data)
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    return [done[str(i)] for i in range(len(prompts))], engine, peak


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_chunked_prefill_and_preemption_hold_only_the_window(mode):
    """Chunks of 12 tokens straddle the window and the blocks; a pool of 9 blocks cannot hold
    three such sequences at once, so one is preempted; each holds at most
    cdiv(8 - 1 + 12, 4) + 1 = 6 blocks where its 70 + 12 tokens would need 21."""
    cases, params = cases_and_params()
    prompts = [c["prompt_token_ids"] for c in cases]
    outs, engine, peak = drive(
        "numpy", prompts, params, num_gpu_blocks=9, preemption_mode=mode, **CHUNKED
    )
    check_outputs("mistral", cases, outs)
    assert engine.scheduler.num_preemptions > 0
    assert peak == 6


@pytest.mark.parametrize("backend", ["numpy", "cpu", "cuda-cpu"])
def test_freed_blocks_are_never_read(backend, monkeypatch):
    """Blocks given back are reused by other sequences and NaN between steps: the logits stay
    transformers' (and the run that keeps every block). NumPy's attention, which slices what
    it gathers, must not even gather a NO_BLOCK entry."""
    gather = fast_ops._gather

    def checked_gather(cache, blocks, length):
        assert (blocks >= 0).all(), f"gathered a NO_BLOCK entry: {blocks}"
        return gather(cache, blocks, length)

    monkeypatch.setattr(fast_ops, "_gather", checked_gather)
    cases, params = cases_and_params()
    prompts = [c["prompt_token_ids"] for c in cases] * 2
    args = dict(num_gpu_blocks=16, **CHUNKED)
    if backend == "cuda-cpu":
        args["enforce_eager"] = True
    outs, _, _ = drive(backend, prompts, params, **args)
    check_outputs("mistral", cases * 2, outs)
    args["num_gpu_blocks"] = 64  # every block kept: a 70-token prompt needs 21
    kept, _, peak = drive(backend, prompts, params, keep_all=True, poison=False, **args)
    assert peak > 6  # every block kept: a 70-token prompt holds more
    for a, b in zip(outs, kept, strict=True):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(
            np.stack(a.outputs[0].step_logits), np.stack(b.outputs[0].step_logits), atol=1e-5
        )


def test_prefix_caching_takes_only_the_window_of_a_hit():
    """The same 70-token prompt again: its hit starts with NO_BLOCK for the blocks before the
    window of its first new token; tokens stay transformers'."""
    cases, params = cases_and_params()
    long = cases[2]["prompt_token_ids"]
    args = dict(num_gpu_blocks=24, enable_prefix_caching=True, **CHUNKED)
    outs, engine, _ = drive("numpy", [long], params, **args)
    check_outputs("mistral", [cases[2]], outs)
    hits_before = engine.scheduler.prefix_cache_hits
    engine.add_request("again", long, params)
    engine.step(stream=False)  # admitted with its hit
    (seq,) = engine.scheduler.running
    first = first_visible(seq.num_cached_tokens)
    assert seq.num_cached_tokens == 68 and first == 15  # 17 cached blocks; keys 61.. visible
    assert seq.block_table[:first] == [NO_BLOCK] * first and NO_BLOCK not in seq.block_table[first:]
    done = []
    while engine.has_unfinished_requests():
        done += engine.step(stream=False)
        engine.check_invariants()
    check_outputs("mistral", [cases[2]], done)
    assert engine.scheduler.prefix_cache_hits > hits_before
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_window_prefix_needs_every_block_the_first_new_token_sees():
    """45 tokens (at most 11 blocks a hit: the last token is computed). Cached blocks 0-2, a
    gap at 3, then 4-10: the longest valid hit ends after block 10 (its first new token, at 44,
    sees keys 37.. in blocks 9 and 10); blocks before 9 are not taken."""
    bm = BlockManager(num_blocks=32, block_size=BS, enable_caching=True, window=WINDOW)
    seq = make_seq(list(np.random.default_rng().integers(1, 300, 45)))
    hashes = bm.block_hashes(seq)
    blocks = list(range(20, 31))
    for i in (0, 1, 2, 4, 5, 6, 7, 8, 9, 10):
        bm._register(blocks[i], hashes[i], bm.block_key(seq, i))
    hits = bm.cached_prefix(seq)
    assert hits == [NO_BLOCK] * 9 + blocks[9:11]
    assert bm.can_allocate(seq, 1, hits)
    bm.take_cached(seq, hits)
    assert [bm.ref_counts[b] for b in blocks[9:11]] == [1, 1]
    assert bm.num_free_blocks == 32 - 2
    # blocks 9 and 10 missing: a start after block 9 or 10 lacks block 9, one after block 8
    # (at 36: keys 29.. in blocks 7 and 8) has both: the hit ends after block 8
    bm2 = BlockManager(num_blocks=32, block_size=BS, enable_caching=True, window=WINDOW)
    seq2 = make_seq(seq.token_ids)
    for i in (0, 1, 2, 4, 5, 6, 7, 8):
        bm2._register(blocks[i], bm2.block_hashes(seq2)[i], bm2.block_key(seq2, i))
    assert bm2.cached_prefix(seq2) == [NO_BLOCK] * 7 + blocks[7:9]


def test_slide_gives_back_exactly_the_hidden_blocks():
    bm = BlockManager(num_blocks=12, block_size=BS, window=WINDOW)
    seq = make_seq(30)
    bm.allocate(seq, 30)
    table = list(seq.block_table)
    for computed, gone in ((7, 0), (11, 1), (15, 2), (27, 5), (30, 5)):
        seq.num_computed_tokens = computed
        bm.slide(seq)
        assert seq.block_table == [NO_BLOCK] * gone + table[gone:]
        assert bm.num_free_blocks == 12 - len(table) + gone
    bm.free(seq)
    assert bm.num_free_blocks == 12


def test_ngram_speculation_gives_back_blocks_and_keeps_tokens():
    """ngram drafts (one token matched: a prompt of 200 distinct tokens of the 320 holds most
    generated ones): verify rows start at the last token, so the table slides from there;
    tokens equal the run without speculation."""
    rng = np.random.default_rng()
    prompts = [[int(t) for t in rng.permutation(np.arange(1, 320))[:200]] for _ in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    spec = json.dumps({**spec, "prompt_lookup_max": 3})
    args = dict(num_gpu_blocks=24, record_logits=False, **CHUNKED)
    outs, engine, _ = drive("numpy", prompts, params, spec=True, speculative_config=spec, **args)
    assert engine.spec_stats.num_draft_tokens > 0
    plain, _, _ = drive("numpy", prompts, params, **args)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


def test_memory_plan_counts_the_window(caplog):
    with caplog.at_level(logging.INFO, logger="engine"):
        make_engine(loaded("mistral"), backend="numpy", block_size=BS, **CHUNKED)
    line = [r.getMessage() for r in caplog.records if "sliding window 8" in r.getMessage()]
    assert line and "at most 6 blocks at once" in line[0], line
    assert loaded("gemma2").config.uniform_window == 0  # some layers full: every block kept
    assert loaded("llama").config.uniform_window == 0


def test_kv_tiers_under_a_sliding_window():
    """Two 70-token prompts, then each again with more tokens, one after the other, in a pool of
    12 blocks with a host tier: a prompt comes back after its blocks were evicted (stored) or
    slid; its hit (the pool's window blocks, or the tiers' blocks, of which those before the
    window are not loaded) gives the tokens of full computation."""
    rng = np.random.default_rng()
    a, b = ([int(t) for t in rng.integers(1, 320, 70)] for _ in range(2))
    prompts = [a, b, a + [5, 6, 7, 8, 9, 10], b + [11, 12, 13, 14, 15, 16, 17, 18, 19]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    cache = dict(enable_prefix_caching=True, num_gpu_blocks=12, kv_offload_bytes=1 << 22)
    outs, engine, _ = drive("numpy", prompts, params, staggered=True, **cache, **CHUNKED)
    sched = engine.scheduler
    assert sched.prefix_cache_hits > 0 and sched.tier_hits > 0
    plain, _, _ = drive("numpy", prompts, params, num_gpu_blocks=64, keep_all=True, **CHUNKED)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
