"""A mixture of experts through the engine's other features: preemption (recompute and swap),
prefix caching with the host KV tier, n-gram speculation and structured output, each on the
tiny Qwen3-MoE checkpoint (tests/data/families/qwen3_moe; the host tier, speculation and
structured output on the tiny gpt-oss too) against transformers' golden greedy tokens, on the
numpy, cpu and cuda-cpu backends."""

from __future__ import annotations

import json

import pytest

from engine import SamplingParams
from engine.frontend.llm import run_to_completion
from engine.structured_params import StructuredOutputsParams
from tests.test_families import check_outputs, golden, loaded
from tests.utils import make_engine

NAME = "qwen3_moe"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


def run(backend: str, record_logits: bool = True, name: str = NAME, **engine_args):
    """The golden prompts through one engine: (engine, cases, outputs); the pool full after."""
    cases = golden(name)["cases"]
    params = SamplingParams(temperature=0.0, max_tokens=len(cases[0]["token_ids"]), ignore_eos=True)
    engine = make_engine(loaded(name), backend=backend, record_logits=record_logits, **engine_args)
    outs = run_to_completion(engine, [c["prompt_token_ids"] for c in cases], params)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return engine, cases, outs


@pytest.mark.parametrize("backend", ["numpy", "cpu", "cuda-cpu"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_sequences_keep_their_tokens(backend, mode):
    # 32 blocks of 4 tokens: the three prompts (2 + 10 + 18 blocks) fit, their 12 tokens each do not
    swap = dict(swap_space=0.01) if mode == "swap" else {}
    engine, cases, outs = run(
        backend, block_size=4, num_gpu_blocks=32, max_model_len=96, preemption_mode=mode, **swap
    )
    assert engine.scheduler.num_preemptions > 0
    check_outputs(NAME, cases, outs)


@pytest.mark.parametrize("name", [NAME, "gpt_oss"])
@pytest.mark.parametrize("backend", ["numpy", "cpu", "cuda-cpu"])
def test_prefix_hits_and_host_tier_keep_the_tokens(backend, name):
    kw = dict(block_size=4, num_gpu_blocks=40, max_model_len=96, enable_prefix_caching=True)
    kw |= dict(kv_offload_bytes=1 << 22)
    engine, cases, first = run(backend, name=name, **kw)
    cases = golden(name)["cases"]
    params = SamplingParams(temperature=0.0, max_tokens=len(cases[0]["token_ids"]), ignore_eos=True)
    again = run_to_completion(engine, [c["prompt_token_ids"] for c in cases], params)
    assert engine.scheduler.prefix_cache_hits + engine.scheduler.tier_hits > 0
    assert any(o.num_cached_tokens for o in again)
    check_outputs(name, cases, first)
    check_outputs(name, cases, again)
    engine.shutdown()


@pytest.mark.parametrize("name", [NAME, "gpt_oss"])
@pytest.mark.parametrize("backend", ["numpy", "cpu", "cuda-cpu"])
def test_ngram_speculation_keeps_the_greedy_tokens(backend, name):
    spec = json.dumps(NGRAM)
    engine, cases, outs = run(backend, record_logits=False, name=name, speculative_config=spec)
    drafts = engine.core_stats().spec_decode[0]
    assert drafts > 0
    for case, out in zip(cases, outs, strict=True):
        assert out.outputs[0].token_ids == case["token_ids"]


@pytest.mark.parametrize("name", [NAME, "gpt_oss"])
def test_structured_output_on_experts(name):
    """A choice grammar: the answer is one of the choices, whatever the random model prefers."""
    choices = ["alpha", "beta", "gamma"]
    engine = make_engine(loaded(name), backend="cpu")
    params = SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=choices)
    )
    outs = run_to_completion(engine, [[5, 9, 13, 40, 41]], params)
    assert outs[0].outputs[0].text in choices
