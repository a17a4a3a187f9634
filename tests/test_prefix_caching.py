"""Prefix caching: exact block ids of hits, revivals and evictions; the engine's tokens with the
cache on equal those with it off (tiny model and SmolLM2), also under recompute preemption."""

from __future__ import annotations

import logging
import os

import pytest

from engine import LLMEngine, SamplingParams
from engine.config import EngineConfig
from engine.core.block_manager import BlockManager, FreeBlockQueue, hash_block
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.core.sequence import Sequence
from engine.entrypoints.generate import main as generate_main
from reference.generate import generate as reference_generate
from tests.test_scheduler_random import FakePagedModel
from tests.utils import make_engine, make_scheduler, make_seq, random_tokens, scheduled_ids, step

BS = 16
CACHING = dict(block_size=BS, max_model_len=128, enable_prefix_caching=True)


def admit(sched: Scheduler, prompt: list[int]) -> tuple[Sequence, SchedulerOutput]:
    seq = make_seq(prompt)
    sched.add(seq)
    return seq, step(sched)


# ---- exact block ids ----


def test_shared_40_tokens_reuse_two_blocks_and_get_a_new_third():
    sched = make_scheduler(**CACHING)
    bm = sched.block_manager
    a, _ = admit(sched, random_tokens(50))
    assert a.block_table == [0, 1, 2, 3] and a.num_cached_tokens == 0
    assert sorted(bm.cached.values()) == [0, 1, 2]  # the three full blocks; 3 is partial
    b, out = admit(sched, a.prompt_token_ids[:40] + random_tokens(5))
    assert out.prefix_hits == [(b, [0, 1])]
    assert b.block_table == [0, 1, 4] and b.num_cached_tokens == 32
    assert scheduled_ids(out) == [(a.seq_id, 1), (b.seq_id, 45 - 32)]  # only the uncached tokens
    assert bm.ref_counts[:5] == [2, 2, 1, 1, 1]
    assert (sched.prefix_cache_hits, sched.prefix_cache_queries) == (32, 95)


def test_equal_prompt_still_computes_its_last_token():
    sched = make_scheduler(**CACHING)
    a, _ = admit(sched, random_tokens(32))  # blocks [0, 1], both full and cached
    b, out = admit(sched, list(a.prompt_token_ids))
    assert out.prefix_hits == [(b, [0])]  # capped: block 1 holds the last token
    assert b.block_table == [0, 3] and scheduled_ids(out)[-1] == (b.seq_id, 16)
    assert b.num_output_tokens == 1  # the last token ran, so b sampled
    assert sched.block_manager.cached[b.block_hashes[1]] == 1  # a's copy stays the cached one
    c, out = admit(sched, a.prompt_token_ids + random_tokens(1))  # 33 tokens: both blocks hit
    assert out.prefix_hits == [(c, [0, 1])] and scheduled_ids(out)[-1] == (c.seq_id, 1)


def test_finished_blocks_stay_cached_and_are_revived():
    sched = make_scheduler(**CACHING)
    bm = sched.block_manager
    a, _ = admit(sched, random_tokens(40))  # [0, 1, 2]: 0 and 1 full
    sched.finish(a, "stop")
    assert list(bm.free_blocks) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]  # reverse order, at the tail
    assert sorted(bm.cached.values()) == [0, 1]  # free AND cached
    c, out = admit(sched, a.prompt_token_ids[:32] + random_tokens(10))
    assert out.prefix_hits == [(c, [0, 1])] and c.block_table == [0, 1, 3]
    assert list(bm.free_blocks) == [4, 5, 6, 7, 8, 9, 2]  # revived from the middle
    assert bm.ref_counts[:4] == [1, 1, 0, 1]


def test_eviction_takes_the_least_recently_freed_block():
    sched = make_scheduler(num_blocks=5, **CACHING)
    bm = sched.block_manager
    a, b = make_seq(random_tokens(32)), make_seq(random_tokens(32))
    sched.add(a)
    sched.add(b)
    step(sched)  # a [0, 1], b [2, 3]: all four full and cached
    sched.finish(a, "stop")
    sched.finish(b, "stop")
    assert list(bm.free_blocks) == [4, 1, 0, 3, 2]
    c, _ = admit(sched, random_tokens(20))  # two blocks: the never-used 4, then a's tail block 1
    assert c.block_table == [4, 1]
    assert a.block_hashes[1] not in bm.cached and sorted(bm.cached.values()) == [0, 2, 3, 4]
    a2, out = admit(sched, list(a.prompt_token_ids))  # only a's first block is left
    assert out.prefix_hits == [(a2, [0])] and a2.block_table == [0, 3]  # 3: b's tail, next
    assert b.block_hashes[1] not in bm.cached
    assert bm.cached_prefix(make_seq(list(b.prompt_token_ids))) == [2]  # b's head survives


def test_same_tokens_after_a_different_prefix_are_not_a_hit():
    sched = make_scheduler(**CACHING)
    x, y = random_tokens(BS), random_tokens(BS)
    a, _ = admit(sched, x + y + random_tokens(3))  # block 1 holds y after x
    b, out = admit(sched, y + random_tokens(20))  # y as the first block: another chain
    assert out.prefix_hits == [] and b.block_table == [3, 4, 5] and b.num_cached_tokens == 0
    assert hash_block(None, y) != a.block_hashes[1] == hash_block(hash_block(None, x), y)


def test_recompute_preemption_releases_refs_and_the_reprefill_hits():
    sched = make_scheduler(num_blocks=5, **CACHING)
    a, _ = admit(sched, random_tokens(47))  # [0, 1, 2]
    b, out = admit(sched, a.prompt_token_ids[:32] + random_tokens(15))  # [0, 1] shared, then [3]
    assert b.block_table == [0, 1, 3]
    step(sched)  # a crosses into block 4; b fills block 3 (registered: its prompt + 1 token)
    assert a.block_table == [0, 1, 2, 4]
    out = step(sched)  # b crosses, nothing is free: b is the latest, so b yields
    assert out.preempted == [b] and sched.block_manager.ref_counts == [1, 1, 1, 0, 1]
    sched.finish(a, "stop")
    out = step(sched)  # b re-prefills prompt + 2 tokens; its blocks 0, 1, 3 are still cached
    assert out.prefix_hits == [(b, [0, 1, 3])] and scheduled_ids(out) == [(b.seq_id, 1)]
    assert b.num_computed_tokens == 49 and b.num_cached_tokens == 32  # first admission's


# ---- same step: a prompt shares the blocks an earlier one computes in that step ----


def test_a_batch_shares_the_full_blocks_the_first_prompt_computes():
    sched = make_scheduler(**CACHING)
    bm = sched.block_manager
    a = make_seq(random_tokens(40))  # [0, 1, 2]: 0 and 1 full, registered as they are allocated
    b = make_seq(a.prompt_token_ids[:32] + random_tokens(5))
    c = make_seq(a.prompt_token_ids + random_tokens(10))  # a's block 2 is partial: not shared
    for seq in (a, b, c):
        sched.add(seq)
    out = sched.schedule()
    assert out.prefix_hits == [(b, [0, 1]), (c, [0, 1])]
    assert scheduled_ids(out) == [(a.seq_id, 40), (b.seq_id, 5), (c.seq_id, 18)]
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1, 2], [0, 1, 3], [0, 1, 4, 5])
    assert bm.ref_counts[:6] == [3, 3, 1, 1, 1, 1] and sorted(bm.cached.values()) == [0, 1, 4]
    sched.check_invariants()
    model = FakePagedModel(bm.num_blocks, 0, BS)  # writes the whole step, then reads
    sched.update(out, model.execute(out))  # b and c read blocks 0 and 1 as a wrote them
    sched.check_invariants()
    assert [s.num_cached_tokens for s in (a, b, c)] == [0, 32, 32]
    assert (sched.prefix_cache_hits, sched.prefix_cache_queries) == (64, 127)


def test_a_chunk_ending_inside_a_block_leaves_it_unregistered_until_the_step_filling_it():
    sched = make_scheduler(enable_chunked_prefill=True, max_num_batched_tokens=44, **CACHING)
    bm = sched.block_manager
    model = FakePagedModel(bm.num_blocks, 0, BS)
    a = make_seq(random_tokens(50))
    b = make_seq(a.prompt_token_ids[:48] + random_tokens(4))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()  # a's first chunk: 44 tokens, block 2 holds 12 of them
    assert scheduled_ids(out) == [(a.seq_id, 44)] and a.block_table == [0, 1, 2]
    assert sorted(bm.cached.values()) == [0, 1]  # not block 2: partly computed
    sched.update(out, model.execute(out))
    out = sched.schedule()  # a's last 6 tokens fill block 2; b shares it in this very step
    assert out.prefix_hits == [(b, [0, 1, 2])]
    assert scheduled_ids(out) == [(a.seq_id, 6), (b.seq_id, 4)]
    assert (a.block_table, b.block_table) == ([0, 1, 2, 3], [0, 1, 2, 4])
    assert sorted(bm.cached.values()) == [0, 1, 2] and bm.ref_counts[:5] == [2, 2, 2, 1, 1]
    sched.check_invariants()
    sched.update(out, model.execute(out))
    sched.check_invariants()
    assert b.num_cached_tokens == 48 and b.num_output_tokens == 1


def test_an_owner_aborted_in_flight_keeps_its_blocks_until_the_step_has_run():
    sched = make_scheduler(**CACHING)
    bm = sched.block_manager
    a = make_seq(random_tokens(40))
    b = make_seq(a.prompt_token_ids[:32] + random_tokens(5))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert out.prefix_hits == [(b, [0, 1])]
    assert sched.abort(a.request_id) and a.is_finished
    assert a.block_table == [0, 1, 2] and bm.ref_counts[:4] == [2, 2, 1, 1]  # still held
    sched.check_invariants()
    model = FakePagedModel(bm.num_blocks, 0, BS)
    sched.update(out, model.execute(out))  # a's rows still run: blocks 0 and 1 get written
    assert a.block_table == [] and bm.ref_counts[:4] == [1, 1, 0, 1]
    assert b.num_output_tokens == 1 and sorted(bm.cached.values()) == [0, 1]
    sched.check_invariants()
    assert list(bm.free_blocks)[-1] == 2  # a's partial block back at the tail


def test_an_owner_preempted_next_step_leaves_its_computed_blocks_to_the_sharer():
    sched = make_scheduler(num_blocks=5, **CACHING)
    bm = sched.block_manager
    model = FakePagedModel(bm.num_blocks, 0, BS)
    shared = random_tokens(32)
    b = make_seq(shared + random_tokens(15))  # arrives first ...
    a = make_seq(shared + random_tokens(15))  # ... but a is queued first: a computes 0 and 1
    sched.add(a)
    sched.add(b)

    def run() -> SchedulerOutput:
        out = sched.schedule()
        sched.check_invariants()
        sched.update(out, model.execute(out))
        sched.check_invariants()
        return out

    out = run()
    assert out.prefix_hits == [(b, [0, 1])] and (a.block_table, b.block_table) == (
        [0, 1, 2],
        [0, 1, 3],
    )
    run()  # both fill their third block: registered
    out = run()  # b takes block 4; a, the latest arrival, finds none and yields
    assert out.preempted == [a] and scheduled_ids(out) == [(b.seq_id, 1)]
    assert bm.ref_counts == [1, 1, 0, 1, 1] and b.block_table == [0, 1, 3, 4]
    out = run()  # b still reads blocks 0 and 1 as a wrote them; a waits for room
    assert scheduled_ids(out) == [(b.seq_id, 1)] and a.block_table == []
    sched.finish(b, "stop")
    out = run()  # a re-prefills: its three full blocks are still cached
    assert out.prefix_hits == [(a, [0, 1, 2])] and a.block_table == [0, 1, 2, 4]
    assert scheduled_ids(out) == [(a.seq_id, 1)]


def test_free_queue_removes_from_the_middle_in_order():
    q = FreeBlockQueue(range(6))
    q.remove(3)
    q.push(3)
    q.remove(1)
    assert [q.popleft(), q.popleft()] == [0, 2] and list(q) == [4, 5, 3] and 5 in q


# ---- the invariant check catches broken bookkeeping ----


def _two_sharing() -> tuple[BlockManager, list[Sequence]]:
    sched = make_scheduler(**CACHING)
    a, _ = admit(sched, random_tokens(40))
    b, _ = admit(sched, a.prompt_token_ids[:32] + random_tokens(4))
    return sched.block_manager, [a, b]


def test_invariants_catch_a_wrong_ref_count():
    bm, seqs = _two_sharing()
    bm.ref_counts[0] = 1
    with pytest.raises(AssertionError, match="block 0: ref 1, 2 holders"):
        bm.check_invariants(seqs)


def test_invariants_catch_a_hash_pointing_at_other_tokens():
    bm, seqs = _two_sharing()
    h = bm.block_hash[1]
    parent, toks = bm.block_keys[1]
    bm.block_keys[1] = (parent, (toks[0] + 1,) + toks[1:])
    with pytest.raises(AssertionError, match="block 1's key"):
        bm.check_invariants(seqs)
    bm.block_keys[1] = (parent, toks)
    bm.cached[h] = 0
    with pytest.raises(AssertionError, match="not under its hash"):
        bm.check_invariants(seqs)


def test_invariants_catch_a_seq_writing_a_shared_block():
    bm, (a, b) = _two_sharing()
    b.num_cached_blocks = 0  # as if b still had to write blocks 0 and 1
    with pytest.raises(AssertionError, match="writes cached block 0"):
        bm.check_invariants([a, b])


def test_swap_with_prefix_caching_is_refused():
    with pytest.raises(ValueError, match="preemption_mode='swap'.*enable_prefix_caching=True"):
        EngineConfig(preemption_mode="swap", enable_prefix_caching=True)
    with pytest.raises(ValueError, match="enable_prefix_caching must be True or False"):
        EngineConfig(enable_prefix_caching="yes")


# ---- the engine: same greedy tokens with the cache on ----

SYSTEM = (
    "You are a small language model. Once upon a time in a land far away there lived a quick "
    "brown fox; it jumps over the lazy dog. Answer briefly, and be kind to everyone."
)
QUESTIONS = ["hi my name is", "hello there", "today is a beautiful summer day", "the quick"]


def chat_prompts(tokenizer, system: str = SYSTEM, questions: list[str] = QUESTIONS) -> list[str]:
    """One shared system prompt, different user turns: long shared prefixes."""
    msgs = [
        [{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions
    ]
    return [tokenizer.apply_chat_template(m, add_generation_prompt=True) for m in msgs]


def run_staggered(engine: LLMEngine, prompts: list, params: SamplingParams) -> list:
    """One new request per step (so later ones find the earlier prefixes cached), then step
    to the end; invariants after every step; outputs in input order."""
    done = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
        done.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_invariants()
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_invariants()
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return [done[str(i)] for i in range(len(prompts))]


def expected_hits(outs: list, block_size: int) -> list[int]:
    """Cached tokens each request should find: its longest common prefix with an earlier
    prompt, in whole blocks, leaving at least its last token to compute."""
    prompts = [o.prompt_token_ids for o in outs]
    hits = [0]
    for i, p in enumerate(prompts[1:], start=1):
        common = max(len(os.path.commonprefix([p, q])) for q in prompts[:i])
        hits.append(min(common, len(p) - 1) // block_size * block_size)
    return hits


def test_tiny_tokens_equal_without_the_cache_and_the_reference(tiny):
    prompts = chat_prompts(tiny.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = run_staggered(make_engine(tiny), prompts, params)
    engine = make_engine(tiny, enable_prefix_caching=True)
    cached = run_staggered(engine, prompts, params)
    assert [o.token_ids for o in cached] == [o.token_ids for o in plain]
    ids = tiny.tokenizer.encode(prompts[-1])
    assert cached[-1].token_ids == reference_generate(tiny.weights, tiny.config, ids, 12).token_ids
    assert [o.num_cached_tokens for o in cached] == expected_hits(cached, BS)
    assert cached[1].num_cached_tokens >= 96 and plain[1].num_cached_tokens is None
    assert engine.scheduler.prefix_cache_hits == sum(o.num_cached_tokens for o in cached) > 0


def test_cuda_cpu_kernels_over_cached_prefixes_give_the_same_tokens(tiny):
    """The CUDA kernels (CPU emulation) read a prefill's first tokens from cached blocks."""
    prompts = chat_prompts(tiny.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    plain = run_staggered(make_engine(tiny), prompts, params)
    engine = make_engine(tiny, enable_prefix_caching=True, backend="cuda-cpu")
    cached = run_staggered(engine, prompts, params)
    assert [o.token_ids for o in cached] == [o.token_ids for o in plain]
    assert [o.num_cached_tokens for o in cached] == expected_hits(cached, BS)
    assert sum(o.num_cached_tokens for o in cached) > 0


@pytest.mark.parametrize("chunked", [False, True])
def test_tiny_small_pool_recompute_preemption_same_tokens(tiny, chunked):
    prompts = chat_prompts(tiny.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = run_staggered(make_engine(tiny), prompts, params)
    chunks = dict(enable_chunked_prefill=True, max_num_batched_tokens=48, max_num_seqs=8)
    kw = chunks if chunked else {}
    small = make_engine(
        tiny, num_gpu_blocks=26, max_model_len=192, block_size=8, enable_prefix_caching=True, **kw
    )
    outs = run_staggered(small, prompts, params)
    assert small.scheduler.num_preemptions > 0 and small.scheduler.prefix_cache_hits > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


def test_smollm2_tokens_equal_without_the_cache(smollm2):
    prompts = chat_prompts(smollm2.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain = run_staggered(make_engine(smollm2, max_model_len=512), prompts, params)
    engine = make_engine(smollm2, max_model_len=512, enable_prefix_caching=True)
    cached = run_staggered(engine, prompts, params)
    assert [o.token_ids for o in cached] == [o.token_ids for o in plain]
    hits = [o.num_cached_tokens for o in cached]
    assert hits == expected_hits(cached, BS) and min(hits[1:]) >= 32


# ---- the engine: a batch in one step shares its system prompt ----

LONG_SYSTEM = (
    "You are a small language model that helps people in a friendly village. Once upon a time in "
    "a land far away there lived a quick brown fox; it jumps over the lazy dog every morning, "
    "then runs to the river to drink and to watch the fish. Answer every question briefly and "
    "clearly, in plain words, and be kind to everyone who asks. If you do not know an answer, "
    "say so and suggest where the person could look for it instead. Keep answers short."
)  # 96 SmolLM2 tokens
BATCH_QUESTIONS = QUESTIONS + [
    "what is the capital of France?",
    "how do bees make honey?",
    "tell me a joke",
    "why is the sky blue?",
]


def run_batch(engine: LLMEngine, prompts: list, params: SamplingParams) -> list:
    """Every request added before the first step (one generate call); invariants after every
    step; outputs in input order."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_invariants()
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return [done[str(i)] for i in range(len(prompts))]


def record_steps(engine: LLMEngine) -> list[SchedulerOutput]:
    """Every SchedulerOutput the engine's scheduler hands out from now on, in order."""
    steps, schedule = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda drafts=None: steps.append(schedule(drafts)) or steps[-1]
    return steps


def test_smollm2_batch_shares_the_system_prompt_in_its_first_step(smollm2):
    prompts = chat_prompts(smollm2.tokenizer, LONG_SYSTEM, BATCH_QUESTIONS)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    kw = dict(num_gpu_blocks=512, max_model_len=1024)
    plain = run_batch(make_engine(smollm2, **kw), prompts, params)
    engine = make_engine(smollm2, enable_prefix_caching=True, **kw)
    steps = record_steps(engine)
    cached = run_batch(engine, prompts, params)
    first = steps[0]  # all eight in one step: seven share the blocks the first one computes
    suffixes = [n - 96 for n in (112, 116, 112, 117, 116, 114, 116)]  # requests 2-8
    assert [n for _, n in first.scheduled] == [114] + suffixes
    assert [hits for _, hits in first.prefix_hits] == [list(range(6))] * 7
    assert [o.token_ids for o in cached] == [o.token_ids for o in plain]
    assert [len(o.prompt_token_ids) for o in cached] == [114, 112, 116, 112, 117, 116, 114, 116]
    # 104 tokens in common (system prompt and template): six full blocks for requests 2-8
    assert [o.num_cached_tokens for o in cached] == [0] + [96] * 7 == expected_hits(cached, BS)
    sched = engine.scheduler
    assert (sched.prefix_cache_hits, sched.prefix_cache_queries) == (672, 917)


@pytest.mark.parametrize("chunked", [False, True])
def test_tiny_batch_under_preemption_same_tokens(tiny, chunked):
    """A batch in one step with a small pool: same-step sharing, then recompute preemption (and
    chunks ending inside the shared prefix) give the tokens of the run without the cache."""
    prompts = chat_prompts(tiny.tokenizer, SYSTEM, BATCH_QUESTIONS)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = run_batch(make_engine(tiny, max_model_len=192), prompts, params)
    chunks = dict(enable_chunked_prefill=True, max_num_batched_tokens=60, max_num_seqs=8)
    small = make_engine(
        tiny,
        num_gpu_blocks=40,
        max_model_len=192,
        block_size=8,
        enable_prefix_caching=True,
        **(chunks if chunked else {}),
    )
    outs = run_batch(small, prompts, params)
    assert small.scheduler.num_preemptions > 0
    assert min(o.num_cached_tokens for o in outs[1:]) > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


def test_cuda_cpu_kernels_read_blocks_written_in_the_same_step(tiny):
    """rotary_cache writes the cache before both attention kernels: a same-step hit reads the K/V
    the step's first request writes."""
    prompts = chat_prompts(tiny.tokenizer, SYSTEM, BATCH_QUESTIONS)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    plain = run_batch(make_engine(tiny), prompts, params)
    engine = make_engine(tiny, enable_prefix_caching=True, backend="cuda-cpu")
    steps = record_steps(engine)
    cached = run_batch(engine, prompts, params)
    assert len(steps[0].scheduled) == 8 and len(steps[0].prefix_hits) == 7
    assert [o.token_ids for o in cached] == [o.token_ids for o in plain]
    assert [o.num_cached_tokens for o in cached] == expected_hits(cached, BS)
    assert min(o.num_cached_tokens for o in cached[1:]) > 0


def test_cli_traces_hits_and_prints_the_hit_rate(tiny_model_dir, capsys, caplog):
    prefix = "once upon a time in a land far away there lived a small language model"
    flags = """--block-size 4 --max-num-seqs 1 --max-tokens 4 --trace --enable-prefix-caching
    --num-gpu-blocks 64 --max-model-len 128 --swap-space 0 --no-tqdm"""
    argv = ["--model", str(tiny_model_dir), "--prompt", prefix, "--prompt", prefix + " too"]
    argv += flags.split()
    with caplog.at_level(logging.INFO, logger="engine.trace"):
        assert generate_main(argv) == 0
    hits = [r.getMessage() for r in caplog.records if "prefix cache hit:" in r.getMessage()]
    assert len(hits) == 1 and "1: prefix cache hit: " in hits[0] and "(blocks [" in hits[0]
    assert "prefix cache hit rate" in capsys.readouterr().out
    assert generate_main(["--preemption-mode", "swap", "--enable-prefix-caching"]) == 2
