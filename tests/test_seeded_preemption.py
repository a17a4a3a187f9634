"""Seeded sampling under preemption, and what a row's result may owe to its batch.

The promise (docs/architecture.md, "What a row's result depends on"): each sample draws one
uniform per token from its own generator, which survives preemption by swap and by recompute,
so every token is what that sample's own logits and the seed's next uniform give; the logits
themselves depend on the batch around the row only at the rounding of its products (BLAS
kernels pick their blocking, register tiles and tails by batch size: OpenBLAS's Haswell kernel,
the one Zen 3 runs, even by the row's position in the batch), so a seeded request in a crowd
draws the tokens it draws alone unless a rounding moves a uniform across a boundary of the
distribution, where it takes the neighbouring id and the two sequences part.

Each test checks the exact half exactly (each token replayed from its recorded logits and the
seed's uniforms) and the rounding half by its size, so a lost draw, a generator reset or K/V
that come back wrong fail on every draw, not on some.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from engine import SamplingParams
from engine.core.sampler import draw, sampling_probs
from engine.frontend.llm import run_to_completion
from tests.utils import make_engine

ROUNDING = 1e-4  # |logit difference| a batch may cause (measured at most 6.4e-6 on the tiny model)


def _replays(output, params: SamplingParams) -> None:
    """Sample i's t-th token is what its t-th recorded logits row and the t-th uniform of the
    generator (seed, i) draw: one draw per token, none lost or repeated across preemption."""
    for i, c in enumerate(output.outputs):
        gen = np.random.default_rng([params.seed % 2**64, i])
        for t, (tok, row) in enumerate(zip(c.token_ids, c.step_logits, strict=True)):
            got = int(draw(sampling_probs(row[None].astype(np.float32), [params]), [gen])[0])
            assert got == tok, f"sample {i}, token {t}: drew {got}, sent {tok}"


def _agree(got, want) -> None:
    """Two runs of one seeded request: each sample's logits within rounding up to the first
    token where they part, and a parting only between neighbouring ids (a uniform on a
    boundary of the distribution that rounding moved)."""
    for g, w in zip(got.outputs, want.outputs, strict=True):
        pairs = list(zip(g.token_ids, w.token_ids, strict=True))
        part = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs) - 1)
        diff = np.abs(np.stack(g.step_logits[: part + 1]) - np.stack(w.step_logits[: part + 1]))
        assert diff.max() < ROUNDING, f"logits differ by {diff.max():.2e} before token {part}"
        a, b = pairs[part]
        assert a == b or abs(a - b) == 1, (part, g.token_ids, w.token_ids)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_seeded_request_preempted_draws_what_it_draws_alone(tiny, mode):
    rng = np.random.default_rng()
    prompt = rng.integers(3, 320, 12).tolist()
    seed = int(rng.integers(1 << 30))
    seeded = SamplingParams(n=4, temperature=0.8, max_tokens=40, seed=seed, ignore_eos=True)
    alone = make_engine(tiny, backend="numpy", block_size=4, record_logits=True)
    (want,) = run_to_completion(alone, [prompt], seeded)
    crowd = [rng.integers(3, 320, 20).tolist() for _ in range(6)]
    others = SamplingParams(temperature=0.7, max_tokens=40, ignore_eos=True)
    args = dict(backend="numpy", block_size=4, num_gpu_blocks=40, max_model_len=64)
    engine = make_engine(tiny, preemption_mode=mode, swap_space=0.01, record_logits=True, **args)
    schedule, preempted = engine.scheduler.schedule, []

    def spy(drafts=None):
        out = schedule(drafts)
        preempted.extend(s.request_id for s in out.preempted)
        return out

    engine.scheduler.schedule = spy
    got = run_to_completion(engine, crowd + [prompt], [others] * 6 + [seeded])[-1]
    assert "6" in preempted, "the seeded request was meant to be preempted"
    _replays(want, seeded)
    _replays(got, seeded)
    _agree(got, want)


# Crowds whose decode batches (crowd + 1 rows) and prefill steps cross the BLAS kernels' row
# blockings: 1 row (sgemv), 2-7 (padded to 8), 13 and 30 (register tiles of 4, 6, 8, 12 with
# tails) and the prompts' rows beside them.
CROWDS = (1, 7, 12, 29)


def batch_rows_check(backend: str, model_dir: str) -> None:
    """A greedy request with prompt logprobs alone and in each crowd of ``CROWDS``: the same
    tokens, and every logits row (prompt and decode) within rounding of its row alone."""
    from model_loader.load import load_model

    loaded = load_model(model_dir)
    rng = np.random.default_rng()
    prompt = rng.integers(3, 320, 12).tolist()
    mine = SamplingParams(temperature=0, max_tokens=24, prompt_logprobs=0, ignore_eos=True)
    others = SamplingParams(temperature=0.7, max_tokens=24, ignore_eos=True)
    runs = []
    for size in (0, *CROWDS):
        crowd = [rng.integers(3, 320, int(rng.integers(4, 30))).tolist() for _ in range(size)]
        engine = make_engine(loaded, backend=backend, block_size=4, num_gpu_blocks=400,
                             max_model_len=64, record_logits=True)  # fmt: skip
        runs.append(run_to_completion(engine, [*crowd, prompt], [others] * size + [mine])[-1])
    alone = runs[0]
    for size, run in zip(CROWDS, runs[1:], strict=True):
        got, want = run.outputs[0], alone.outputs[0]
        assert got.token_ids == want.token_ids, f"crowd of {size}: other greedy tokens"
        diff = np.abs(np.stack(got.step_logits) - np.stack(want.step_logits)).max()
        assert diff < ROUNDING, f"crowd of {size}: decode logits {diff:.2e} apart"
        for p, (a, b) in enumerate(
            zip(run.prompt_logprobs[1:], alone.prompt_logprobs[1:], strict=True)
        ):
            (ta, la), (tb, lb) = next(iter(a.items())), next(iter(b.items()))
            assert ta == tb and abs(la - lb) < ROUNDING, f"crowd of {size}: prompt row {p}"


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_a_rows_logits_owe_its_batch_only_rounding(backend, tiny_model_dir):
    batch_rows_check(backend, str(tiny_model_dir))


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_the_same_on_an_avx2_machines_kernels(backend, tiny_model_dir):
    """As above with the kernels an AVX2-only CPU (Zen 3) runs: OpenBLAS's Haswell kernels,
    whose float32 product rounds a row differently at each of its positions in a batch, and
    the cpu backend's x86-64-v3 build."""
    if not _haswell_ok():
        pytest.skip("this CPU lacks AVX2 and FMA: OpenBLAS's Haswell kernels cannot run here")
    env = dict(os.environ, OPENBLAS_CORETYPE="Haswell", PAGEDLLM_CPU_ISA="x86-64-v3")
    args = f"{backend!r}, {str(tiny_model_dir)!r}"
    code = f"import tests.test_seeded_preemption as t; t.batch_rows_check({args})"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def _haswell_ok() -> bool:
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    return " avx2 " in flags and " fma " in flags
