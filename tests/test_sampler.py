"""Each sampling feature against an independent (plain, per-token) computation."""

from __future__ import annotations

import numpy as np
import pytest

from engine import SamplingParams
from engine.sampler import Sampler, apply_penalties, draw, sampling_probs
from tests.utils import make_engine

V = 50


class FakeSeq:
    def __init__(self, params, prompt, output):
        self.params = params
        self.prompt_token_ids = list(prompt)
        self.output_token_ids = list(output)

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
