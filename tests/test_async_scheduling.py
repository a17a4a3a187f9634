"""Async scheduling (``async_scheduling=True``): the next decode step is scheduled and launched
before the last one's ids are read. Every request's tokens, text and finish reason must be those
of the same workload run without it, and no block may leak. Steps must really overlap: the tests
count the launches that take their tokens from the step before. On the GPU backend (graphs and
eager) the same is tests/test_gpu.py's, which CI runs on the emulated device through
scripts/gpu_check.sh --emulate."""

import random

import numpy as np
import pytest

from engine.backends.stub import StubBackend
from engine.core.sequence import PENDING_TOKEN
from engine.sampling_params import SamplingParams
from engine.tools.host_overhead import measure
from tests.utils import make_engine


def workload(seed: int, n: int, stops: dict | None = None, sampled: float = 0.2):
    """n (prompt, params): prompts sharing prefixes, greedy or (a ``sampled`` share) seeded
    sampling, varied max_tokens; ``stops``: request index -> (stop strings, stop token ids)."""
    rng = random.Random(seed)
    base = [rng.randrange(1, 300) for _ in range(24)]
    reqs = []
    for i in range(n):
        prompt = base[: rng.randint(0, 24)] + [
            rng.randrange(1, 300) for _ in range(rng.randint(1, 9))
        ]
        kw = dict(max_tokens=rng.randint(3, 28), temperature=0.0, ignore_eos=rng.random() < 0.5)
        if rng.random() < sampled:
            kw.update(temperature=0.8, seed=i)
        if rng.random() < 0.15:
            kw.update(min_tokens=min(3, kw["max_tokens"]))
        if stops and i in stops:
            kw.update(stop=stops[i][0], stop_token_ids=stops[i][1])
        reqs.append((prompt, SamplingParams(**kw)))
    return reqs


def count_overlaps(engine) -> list[int]:
    """[launches that took tokens from the step before], kept up to date."""
    counter = [0]
    launch = engine.backend.launch_greedy

    def counted(batch, prev=None):
        counter[0] += batch.prev_rows is not None
        return launch(batch, prev)

    engine.backend.launch_greedy = counted
    return counter


def run(engine, reqs, aborts=(), late: int = 0):
    """Drive the engine to the end, checking invariants every step; ``aborts``: (step, request
    index) pairs; the ``late`` last requests arrive at step 4. -> {request id: (token ids, text,
    finish reason)} of the requests not aborted."""
    for i, (prompt, params) in enumerate(reqs[: len(reqs) - late]):
        engine.add_request(str(i), prompt, params)
    done, steps, aborted = {}, 0, set()
    while engine.has_unfinished_requests() or steps <= 4:
        if steps == 4:
            for i in range(len(reqs) - late, len(reqs)):
                engine.add_request(str(i), *reqs[i])
        for at, i in aborts:
            if at == steps and engine.abort(str(i)):
                aborted.add(str(i))
        for o in engine.step():
            c = o.outputs[0]
            assert PENDING_TOKEN not in c.token_ids, f"request {o.request_id}: a pending token"
            if o.finished:
                done[o.request_id] = (c.token_ids, c.text, c.finish_reason)
        engine.check_invariants()
        steps += 1
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    assert not aborted & done.keys()
    return done


def both(tiny, reqs, aborts=(), late: int = 0, **engine_args):
    """(outputs without, outputs with async scheduling, overlapped launches with it)."""
    off = run(make_engine(tiny, **engine_args), reqs, aborts, late)
    engine = make_engine(tiny, async_scheduling=True, **engine_args)
    overlaps = count_overlaps(engine)
    on = run(engine, reqs, aborts, late)
    return off, on, overlaps[0]


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(),
        dict(num_gpu_blocks=14, block_size=4, max_model_len=56),  # preemption by recompute
        dict(
            num_gpu_blocks=14,
            block_size=4,
            max_model_len=56,
            preemption_mode="swap",
            swap_space=0.05,
        ),
        dict(enable_prefix_caching=True, block_size=4, num_gpu_blocks=40, max_model_len=64),
        dict(enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=6),
    ],
    ids=["plain", "recompute", "swap", "prefix-caching", "chunked-prefill"],
)
def test_async_outputs_equal_sync_outputs(tiny, engine_args):
    reqs = workload(seed=len(str(engine_args)), n=14)
    off, on, overlaps = both(tiny, reqs, **engine_args)
    assert len(off) == len(reqs)
    assert on == off
    assert overlaps >= 10, f"only {overlaps} steps overlapped"


def test_stops_and_aborts_match_sync(tiny):
    """Stop strings and stop token ids taken from a first run's outputs end requests mid-run;
    requests aborted mid-run give no output and free their blocks."""
    probe = run(make_engine(tiny), workload(seed=7, n=12, sampled=0.0))
    rng = np.random.default_rng(7)
    stops = {}
    for i in range(0, 12, 2):
        ids, text, _ = probe[str(i)]
        if len(ids) > 4:
            at = int(rng.integers(1, len(text) - 2)) if len(text) > 3 else 0
            stop = text[at : at + 2]
            stops[i] = ([stop] if i % 4 == 0 and stop.strip() else [], [ids[3]])
    reqs = workload(seed=7, n=12, stops=stops, sampled=0.0)
    off, on, overlaps = both(tiny, reqs, aborts=[(6, 1), (9, 5), (12, 11)])
    assert len(off) == 9 and on == off
    assert sum(r == "stop" for _, _, r in off.values()) >= 3
    assert overlaps >= 5


def test_stub_device_step_overlaps_the_host(tiny):
    """With a modelled 20 ms device step, an async step costs about the device step, a
    synchronous one the device step plus the host's work; both produce the stub's tokens.
    Other work on the machine (the suite's other worker) only adds time to a step, so each
    run's fastest step is compared: the host's work is always in the synchronous one."""
    sync = measure(tiny, 32, steps=10, warmup=2, device_step_s=0.02)
    overlapped = measure(tiny, 32, steps=10, warmup=2, device_step_s=0.02, async_scheduling=True)
    assert min(sync.step_ms) >= 20.0
    host = min(sync.cpu_ms)  # the synchronous step's own host work, 1.5-2.5 ms here
    assert min(overlapped.step_ms) < min(sync.step_ms) - host / 2


@pytest.mark.parametrize(
    "seed, engine_args",
    [
        (11, dict(enable_prefix_caching=True)),
        (12, dict(enable_chunked_prefill=True, max_num_batched_tokens=24, max_num_seqs=10)),
        (13, dict(preemption_mode="swap", swap_space=0.05)),
    ],
    ids=["prefix-caching", "chunked-prefill", "swap"],
)
def test_many_requests_small_pool(tiny, seed, engine_args):
    """Thirty requests (a tenth sampled) in a pool that preempts, arriving in two waves, some
    aborted mid-run: the same outputs with async scheduling on and off, no block leaked."""
    rng = random.Random(seed)
    reqs = workload(seed=seed, n=30, sampled=0.1)
    aborts = [(rng.randint(2, 30), rng.randrange(30)) for _ in range(4)]
    kw = dict(num_gpu_blocks=20, block_size=4, max_model_len=64, **engine_args)
    off, on, overlaps = both(tiny, reqs, aborts=aborts, late=10, **kw)
    assert len(off) >= 26 and on == off
    assert overlaps >= 10


class FailingStub(StubBackend):
    """The stub, but a row at position 20 has no token to pick (-1, as a row of NaN logits)."""

    def _ids(self, batch):
        ids = super()._ids(batch)  # (B,)
        ids[batch.positions[batch.logits_indices] == 20] = -1
        return ids


def test_a_failed_row_ends_its_request_as_without_async(tiny):
    """A step whose row has no token: that request ends with an error, and the token the next
    step (already launched) computed for it is dropped; the others run on."""
    reqs = [
        ([7 + i] * n, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        for i, n in enumerate([12, 15, 18, 24])
    ]
    factory = lambda mc, weights, cfg: FailingStub(mc, cfg)  # noqa: E731
    off, on, overlaps = both(tiny, reqs, backend_factory=factory)
    assert on == off and overlaps >= 8
    assert [off[str(i)][2] for i in range(4)] == ["abort", "abort", "abort", "length"]
