"""Tensor parallel on the GPU backend, run on the emulated device (``cuda-cpu``): each rank a worker
process with its own emulated GPU, the collectives the emulated NCCL's (captured in the decode
graphs), against the single cuda-cpu process: the same greedy and seeded tokens, logits within
float32 rounding, through preemption and prefix caching; a dead worker is named within seconds."""

from __future__ import annotations

import numpy as np
import pytest

from engine.frontend.llm import run_to_completion
from engine.sampling_params import SamplingParams
from tests.utils import assert_same_greedy, kill_rank_mid_run, make_engine

PROMPTS = ["hi my name is", "today is a beautiful summer day", "hello there"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
CUDA_CPU = dict(backend="cuda-cpu")


def _tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.mark.parametrize("tp", [2, 4])  # 4 ranks: each of the 2 K/V heads on two ranks
def test_ranks_on_the_emulated_device_equal_one_process(tiny, tp):
    one = run_to_completion(make_engine(tiny, **CUDA_CPU, record_logits=True), PROMPTS, GREEDY)
    engine = make_engine(tiny, **CUDA_CPU, tensor_parallel_size=tp, record_logits=True)
    assert engine.backend.name == "cuda-cpu-mp" and engine.backend.nccl_version == "2.30.1"
    many = run_to_completion(engine, PROMPTS, GREEDY)
    assert_same_greedy(one, many)
    seeded = SamplingParams(temperature=0.8, max_tokens=16, seed=11, n=2, ignore_eos=True)
    want = _tokens(run_to_completion(make_engine(tiny, **CUDA_CPU), PROMPTS, seeded))
    assert _tokens(run_to_completion(engine, PROMPTS, seeded)) == want
    calls = [c for c, _ in engine.backend.comm_stats()]
    # every step: the embedding's all-reduce, two per layer, the LM head's all-gather
    assert len(set(calls)) == 1 and calls[0] > 0 and calls[0] % (2 * 2 + 2) == 0
    engine.backend.shutdown()


def test_float16_ranks_stay_within_float16_rounding(tiny):
    """16-bit activations are all-reduced in float16: the partial sums round where one
    process's single product does not, so the logits agree to float16's precision."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    half = dict(CUDA_CPU, dtype="float16", record_logits=True)
    one = run_to_completion(make_engine(tiny, **half), PROMPTS, params)
    engine = make_engine(tiny, **half, tensor_parallel_size=2)
    many = run_to_completion(engine, PROMPTS, params)
    for a, b in zip(one, many, strict=True):
        got, want = np.stack(b.outputs[0].step_logits), np.stack(a.outputs[0].step_logits)
        np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)
        assert np.abs(got - want).max() > 0  # the rounding differs: the ranks really summed
    engine.backend.shutdown()


def test_preemption_and_prefix_caching_on_the_ranks(tiny):
    shared = "once upon a time in a land far away there lived a fox who "
    prompts = PROMPTS + ["the quick brown fox", shared + "ran", shared + "slept"]
    params = SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True)
    for extra in (
        dict(num_gpu_blocks=6, max_model_len=64, preemption_mode="recompute"),
        dict(enable_prefix_caching=True),
    ):
        one = run_to_completion(make_engine(tiny, **CUDA_CPU, **extra), prompts, params)
        engine = make_engine(tiny, **CUDA_CPU, **extra, tensor_parallel_size=2)
        many = run_to_completion(engine, prompts, params, check_invariants=True)
        assert [o.outputs[0].token_ids for o in one] == [o.outputs[0].token_ids for o in many]
        if "preemption_mode" in extra:
            assert engine.scheduler.num_preemptions > 0
        else:
            assert engine.scheduler.prefix_cache_hits > 0
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        engine.backend.shutdown()


def test_a_killed_rank_is_an_error_naming_it(tiny):
    engine = make_engine(tiny, **CUDA_CPU, tensor_parallel_size=2)
    died = r"worker rank 1 \(stage 0, tensor-parallel rank 1\): it died"
    kill_rank_mid_run(engine, 1, PROMPTS[0], died)
    assert not any(p.is_alive() for p in engine.backend.procs)


def test_smollm2_on_three_ranks_of_the_emulated_device(smollm2):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    # eager: the graphs' collectives are the tiny model's tests'; SmolLM2 checks the real shapes
    small = dict(CUDA_CPU, num_gpu_blocks=32, max_model_len=128, max_num_seqs=2, enforce_eager=True)
    one = run_to_completion(make_engine(smollm2, **small), prompts, params)
    engine = make_engine(smollm2, **small, tensor_parallel_size=3)
    many = run_to_completion(engine, prompts, params)
    assert [o.outputs[0].token_ids for o in one] == [o.outputs[0].token_ids for o in many]
    engine.backend.shutdown()
