"""Each sampling feature against an independent (plain, per-token) computation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import SamplingParams
from engine.core.sampler import NO_TOKEN, Sampler, apply_penalties, draw, sampling_probs
from tests.utils import make_engine

V = 50


class FakeSeq:
    def __init__(self, params, prompt, output):
        self.params = params
        self.prompt_token_ids = list(prompt)
        self.output_token_ids = list(output)
        self.bad_words_ids, self.matcher = [], None  # what the sampler reads beyond params
        self.num_computed_tokens = self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_output_tokens(self):
        return len(self.output_token_ids)


def independent_probs(logits, p: SamplingParams) -> np.ndarray:
    """softmax(l / T), then min_p, top_k, top_p, one token at a time in float64."""
    x = logits.astype(np.float64) / p.temperature
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    keep = [t for t in range(V) if probs[t] >= p.min_p * probs.max()]
    keep.sort(key=lambda t: -probs[t])
    if p.top_k > 0:
        keep = keep[: p.top_k]
    if p.top_p < 1.0:
        total, kept, mass = sum(probs[t] for t in keep), [], 0.0
        for t in keep:
            if mass >= p.top_p * total:
                break
            kept.append(t)
            mass += probs[t]
        keep = kept
    out = np.zeros(V)
    out[keep] = probs[keep]
    return out / out.sum()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def test_penalties_match_formula(rng):
    logits = rng.standard_normal(V).astype(np.float32) * 3
    prompt, output = rng.integers(0, V, 8).tolist(), rng.integers(0, V, 12).tolist()
    p = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.7)
    got = logits.copy()
    apply_penalties(got, p, prompt, output)
    want = logits.astype(np.float64).copy()
    for t in range(V):
        if t in prompt or t in output:
            want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
        want[t] -= 0.4 * output.count(t) + 0.7 * (t in output)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=0.7),
        dict(temperature=1.3, top_k=5),
        dict(temperature=1.0, top_p=0.6),
        dict(temperature=0.9, min_p=0.2),
        dict(temperature=1.1, top_k=10, top_p=0.8, min_p=0.05),
    ],
)
def test_filtered_distribution_matches_independent(rng, kw):
    params = [SamplingParams(**kw) for _ in range(4)]
    logits = (rng.standard_normal((4, V)) * 2).astype(np.float32)
    got = sampling_probs(logits.copy(), params)
    for r in range(4):
        np.testing.assert_allclose(got[r], independent_probs(logits[r], params[r]), atol=1e-6)


def test_draw_frequencies_follow_the_distribution(rng):
    probs = independent_probs(rng.standard_normal(V) * 2, SamplingParams(top_k=8))
    gen = np.random.default_rng(5)
    n = 20000
    ids = np.concatenate([draw(probs[None].astype(np.float32), [gen]) for _ in range(n)])
    freq = np.bincount(ids, minlength=V) / n
    assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(probs))  # never outside the support
    np.testing.assert_allclose(freq, probs, atol=4 * np.sqrt(probs.max() / n))


def test_greedy_min_tokens_and_logprobs(rng):
    logits = (rng.standard_normal((3, V)) * 2).astype(np.float32)
    top = int(np.argmax(logits[1]))
    seqs = [
        FakeSeq(SamplingParams(temperature=0.0, logprobs=3), [1], []),
        FakeSeq(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[top]), [1], [4]),
        FakeSeq(SamplingParams(temperature=0.0), [1], [4]),
    ]
    gens = [np.random.default_rng(0)] * 3
    ids, lps = Sampler(eos_token_ids=[]).sample(logits, seqs, gens)
    assert ids[0] == int(np.argmax(logits[0]))
    assert ids[1] != top and ids[1] == int(np.argsort(logits[1])[-2])  # the best is banned
    assert lps[1] is None and lps[2] is None
    x = logits[0].astype(np.float64)
    lsm = x - x.max() - np.log(np.exp(x - x.max()).sum())
    want = {int(t): lsm[t] for t in np.argsort(-lsm)[:3]}
    assert list(lps[0]) == list(want)
    np.testing.assert_allclose(list(lps[0].values()), list(want.values()), atol=1e-5)


def test_seeded_request_is_the_same_alone_and_in_a_batch(tiny):
    engine = make_engine(tiny, swap_space=0)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=16, ignore_eos=True, seed=11)
    other = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)

    def run(requests):
        for rid, prompt, p in requests:
            engine.add_request(rid, prompt, p)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        return done

    alone = run([("s", "hello there", seeded)])["s"].token_ids
    batch = run(
        [
            ("x", "hi my name is", other),
            ("s", "hello there", seeded),
            ("y", "today is a beautiful summer day", other),
        ]
    )
    assert batch["s"].token_ids == alone
    reseeded = SamplingParams(**{**vars(seeded), "seed": 12})
    assert run([("s", "hello there", reseeded)])["s"].token_ids != alone


# ---- guards: values the checks refuse cannot make a NaN row pick token 0 ----


def unchecked(**kw) -> SamplingParams:
    """SamplingParams with fields set past its checks (what the sampler must survive anyway)."""
    p = SamplingParams()
    for name, value in kw.items():
        object.__setattr__(p, name, value)
    return p


def test_top_p_that_rounds_to_zero_keeps_the_top_token(rng):
    logits = (rng.standard_normal((2, V)) * 2).astype(np.float32)
    probs = sampling_probs(logits.copy(), [unchecked(top_p=1e-50)] * 2)  # float32(1e-50) == 0
    assert np.isfinite(probs).all()
    np.testing.assert_array_equal(np.argmax(probs, axis=1), np.argmax(logits, axis=1))
    assert (probs.max(axis=1) == 1.0).all()


@pytest.mark.parametrize("temperature", [float("inf"), 1e39])
def test_infinite_temperature_keeps_min_tokens_ban(rng, temperature):
    logits = (rng.standard_normal((4, V)) * 2).astype(np.float32)
    logits[:, 0] = 10.0  # token 0 is EOS, and the model's favourite
    seqs = [FakeSeq(unchecked(temperature=temperature, min_tokens=5), [1], []) for _ in range(4)]
    gens = [np.random.default_rng(i) for i in range(4)]
    ids, _ = Sampler(eos_token_ids=[0]).sample(logits, seqs, gens)
    assert all(0 < t < V for t in ids)  # never the banned EOS


def test_tiny_repetition_penalty_picks_a_token_not_nan(rng):
    logits = np.abs(rng.standard_normal((1, V))).astype(np.float32) + 0.1  # all positive
    seqs = [FakeSeq(unchecked(repetition_penalty=1e-45, temperature=1.0), [3, 7], [9])]
    ids, _ = Sampler().sample(logits, seqs, [np.random.default_rng(0)])
    assert ids[0] in (3, 7, 9)  # the seen tokens' logits overflow to the top


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_row_with_nothing_to_pick_gets_no_token(rng, temperature):
    logits = (rng.standard_normal((3, V)) * 2).astype(np.float32)
    logits[0] = np.nan  # the whole row
    logits[1, 7] = np.nan  # one entry
    p = SamplingParams(temperature=temperature, logprobs=2)
    seqs = [FakeSeq(p, [1], []) for _ in range(3)]
    ids, lps = Sampler().sample(logits, seqs, [np.random.default_rng(0)] * 3)
    assert ids[:2] == [NO_TOKEN, NO_TOKEN] and lps[:2] == [None, None]
    assert 0 <= ids[2] < V and lps[2] is not None
    banned = [FakeSeq(SamplingParams(temperature=temperature, min_tokens=1), [1], [])]
    every = list(range(V))  # every token is "EOS", banned before min_tokens: nothing is left
    ids, _ = Sampler(every).sample(logits[2:], banned, [np.random.default_rng(0)])
    assert ids == [NO_TOKEN]


def test_a_nan_row_aborts_its_sequence_with_an_error(tiny, monkeypatch):
    engine = make_engine(tiny, swap_space=0)
    params = SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True)
    engine.add_request("nan", "hello there", params)
    engine.add_request("ok", "hi my name is", params)
    forward = engine.runner.forward

    def nan_for_one(out, **kw):
        logits = forward(out, **kw)  # (B, V)
        for b, (seq, _) in enumerate(out.scheduled):
            if seq.request_id == "nan":
                logits[b] = np.nan
        return logits

    monkeypatch.setattr(engine.runner, "forward", nan_for_one)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_invariants()
    bad, ok = done["nan"].outputs[0], done["ok"].outputs[0]
    assert bad.finish_reason == "abort" and "sampling failed" in bad.error and bad.token_ids == []
    assert ok.finish_reason == "length" and len(ok.token_ids) == 8 and ok.error is None
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# ---- property: any accepted params, extremes included, give real tokens and free blocks ----

finite = dict(allow_nan=False, allow_infinity=False)
params_strategy = st.builds(
    SamplingParams,
    n=st.integers(1, 2),
    temperature=st.one_of(st.just(0.0), st.floats(0.0, 100.0, **finite)),
    top_p=st.floats(1e-6, 1.0, **finite),
    top_k=st.integers(-1, 400),
    min_p=st.floats(0.0, 1.0, **finite),
    presence_penalty=st.floats(-2.0, 2.0, **finite),
    frequency_penalty=st.floats(-2.0, 2.0, **finite),
    repetition_penalty=st.floats(0.01, 100.0, **finite),
    max_tokens=st.just(4),
    min_tokens=st.integers(0, 4),
    stop_token_ids=st.lists(st.integers(0, 400), max_size=3),
    seed=st.one_of(st.none(), st.integers(-(2**70), 2**70)),
    logprobs=st.one_of(st.none(), st.integers(0, 20)),
)


@pytest.fixture(scope="module")
def prop_engine(tiny):
    return make_engine(tiny, swap_space=0, num_gpu_blocks=16, max_model_len=64)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(params_strategy, min_size=1, max_size=3))
def test_any_accepted_params_sample_real_tokens(prop_engine, params):
    engine, vocab = prop_engine, prop_engine.model_config.vocab_size
    for i, p in enumerate(params):
        engine.add_request(f"p{i}", "hello there", p)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_invariants()
    for o in (c for r in done.values() for c in r.outputs):
        assert o.error is None and o.finish_reason in ("stop", "length")
        assert all(0 <= t < vocab for t in o.token_ids)
        assert all(np.isfinite(v) or v == -np.inf for lp in o.logprobs or [] for v in lp.values())
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
