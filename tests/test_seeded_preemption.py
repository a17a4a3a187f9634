"""Seeded sampling under preemption: a seeded request preempted many times (by recompute and by
swap) draws the tokens it draws alone, because each sample's generator survives preemption and
draws one uniform per sampled token (docs/server.md, "Limits and security"). Under recompute,
float rounding may move one draw across a boundary of the distribution (below)."""

from __future__ import annotations

import numpy as np
import pytest

from engine import SamplingParams
from engine.frontend.llm import run_to_completion
from tests.utils import make_engine


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_seeded_request_preempted_draws_what_it_draws_alone(tiny, mode):
    rng = np.random.default_rng()
    prompt = rng.integers(3, 320, 12).tolist()
    seed = int(rng.integers(1 << 30))
    seeded = SamplingParams(n=4, temperature=0.8, max_tokens=40, seed=seed, ignore_eos=True)
    alone = make_engine(tiny, backend="numpy", block_size=4)
    (want,) = run_to_completion(alone, [prompt], seeded)
    crowd = [rng.integers(3, 320, 20).tolist() for _ in range(6)]
    others = SamplingParams(temperature=0.7, max_tokens=40, ignore_eos=True)
    args = dict(backend="numpy", block_size=4, num_gpu_blocks=40, max_model_len=64)
    engine = make_engine(tiny, preemption_mode=mode, swap_space=0.01, **args)
    schedule, preempted = engine.scheduler.schedule, []

    def spy():
        out = schedule()
        preempted.extend(s.request_id for s in out.preempted)
        return out

    engine.scheduler.schedule = spy
    got = run_to_completion(engine, crowd + [prompt], [others] * 6 + [seeded])[-1]
    assert "6" in preempted, "the seeded request was meant to be preempted"
    if mode == "swap":  # the K/V come back as they were: the same logits, the same draws
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
        return
    for g, w in zip(got.outputs, want.outputs, strict=True):
        # A recompute's prefill rounds differently from the decode steps it replaces (logits
        # measured 2e-6 to 5e-6 apart): a uniform that close to a boundary of the sampler's
        # cumulative distribution draws the neighbouring token id there, and the two
        # sequences part from that token on (measured in about 1 test of 200 to 600). A lost
        # or repeated draw parts them at ids no closer than any other two.
        part = next(
            (i for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids, strict=True)) if a != b),
            None,
        )
        assert part is None or abs(g.token_ids[part] - w.token_ids[part]) == 1, (part, g, w)
