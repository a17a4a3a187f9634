"""Each feature keeps its per-sequence state itself, by seq id, and drops it when the sequence
ends (finished, aborted, stopped by a string, rejected): speculation's drafts and back-off in
the ``Speculator``, a waiting prompt's tier lookup in the ``Scheduler``, a pooled prompt's
partial pooling in the ``ModelRunner``. Each check first sees the state held mid-run, then
nothing left once every request is gone."""

import json
import random

from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from tests.utils import make_engine

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 2}  # fmt: skip


def repeating_prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Prompts made of a short random motif repeated (prompt lookup finds drafts in them)."""
    prompts = []
    for _ in range(n):
        motif = [rng.randrange(3, 250) for _ in range(rng.randint(2, 5))]
        prompts.append((motif * 8)[: rng.randint(8, 30)])
    return prompts


def drive(engine, keys, most: int, watch) -> tuple[list, list]:
    """Step until idle; before a step, while fewer than ``most`` were aborted, abort the request
    of a sequence among ``keys(engine)`` (a feature's state, by seq id); ``watch(engine)``
    after each step. (The finished outputs, the aborted ids.)"""
    done, aborted = [], []
    while engine.has_unfinished_requests():
        held = keys(engine) if len(aborted) < most else ()
        rid = next((r for r, seqs in engine.core.requests.items()
                    if any(s.seq_id in held for s in seqs)), None)  # fmt: skip
        if rid is not None:
            assert engine.abort(rid)
            aborted.append(rid)
        done += [o for o in engine.step() if o.finished]
        engine.check_invariants()
        watch(engine)
    return done, aborted


def test_speculation_state_lives_in_the_speculator_and_goes_with_each_sequence(tiny):
    rng = random.Random(11)
    engine = make_engine(
        tiny, speculative_config=json.dumps(NGRAM), num_gpu_blocks=20, block_size=4,
        max_model_len=64, backend="numpy",
    )  # fmt: skip
    prompts = repeating_prompts(rng, 8)
    for i, p in enumerate(prompts):
        temp = rng.choice([0.0, 0.8])
        stop = ["e"] if i == 5 else None  # a stop string ends one in the frontend
        params = SamplingParams(temperature=temp, seed=i, max_tokens=rng.randint(8, 24), stop=stop)
        engine.add_request(str(i), p, params)
    seen = {"drafts": 0, "backoffs": 0}
    spec, propose = engine.core.spec, engine.core.spec.propose

    def spy(running):  # the drafts as the scheduler gets them (it takes those it runs)
        propose(running)
        seen["drafts"] = max(seen["drafts"], len(spec.drafts))

    spec.propose = spy

    def watch(e):
        seen["backoffs"] = max(seen["backoffs"], len(spec.backoffs))
        live = {s.seq_id for seqs in e.core.requests.values() for s in seqs if not s.is_finished}
        assert set(spec.backoffs) <= live and set(spec.drafts) <= live

    def held(e):  # a sequence holding a back-off (or stale drafts) ends by abort
        return set(spec.backoffs) | set(spec.drafts)

    done, aborted = drive(engine, held, 2, watch)
    assert len(aborted) == 2 and len(done) == 6 and engine.scheduler.num_preemptions > 0
    assert seen["drafts"] > 0 and seen["backoffs"] > 0  # held while the sequences ran
    assert engine.core.spec.drafts == {} and engine.core.spec.backoffs == {}
    assert engine.spec_stats.num_drafts > 0


def test_a_waiting_prompts_tier_lookup_lives_in_the_scheduler_until_it_is_admitted(tiny):
    rng = random.Random(5)
    engine = make_engine(
        tiny, enable_prefix_caching=True, kv_offload_bytes=1 << 22, num_gpu_blocks=12,
        block_size=4, max_model_len=40, max_num_seqs=2, backend="numpy",
    )  # fmt: skip
    shared = [rng.randrange(3, 250) for _ in range(24)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = [shared + [rng.randrange(3, 250)] for _ in range(3)]
    for i, p in enumerate(first):  # their blocks, evicted by the next ones, go to the host tier
        engine.add_request(f"a{i}", p, params)
    drive(engine, lambda e: (), 0, lambda e: None)
    for i in range(6):
        engine.add_request(f"b{i}", [rng.randrange(3, 250) for _ in range(30)], params)
    for i in range(4):  # these find the shared prefix in the tier, and wait for room
        engine.add_request(f"c{i}", shared + [rng.randrange(3, 250)], params)
    seen = []

    def watch(e):
        seen.append(len(e.scheduler._tier_fetch))

    # the waiting prompt whose tier lookup is kept ends by abort
    done, aborted = drive(engine, lambda e: set(e.scheduler._tier_fetch), 1, watch)
    assert max(seen) > 0 and engine.scheduler._tier_fetch == {}
    assert len(aborted) == 1 and len(done) == 9 and engine.scheduler.tier_hits > 0


def test_a_pooled_prompts_partial_pooling_lives_in_the_runner_and_goes_on_abort(tiny):
    rng = random.Random(3)
    engine = make_engine(
        tiny, runner="pooling", enable_chunked_prefill=True, max_num_batched_tokens=8,
        max_num_seqs=2, backend="numpy",
    )  # fmt: skip
    params = SamplingParams(
        max_tokens=1, temperature=0.0, pooling=PoolingParams("mean", True, None)
    )
    for i in range(4):
        engine.add_request(str(i), [rng.randrange(3, 250) for _ in range(30)], params)
    seen = []

    def watch(e):
        seen.append(len(e.runner.poolers))

    # a prompt pooled part of the way ends by abort
    done, aborted = drive(engine, lambda e: set(e.runner.poolers), 2, watch)
    assert max(seen) > 0 and engine.runner.poolers == {} and len(aborted) == 2
    assert len(done) == 2 and all(o.embedding is not None for o in done)  # 4, 2 aborted
