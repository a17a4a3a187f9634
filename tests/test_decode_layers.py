"""The cpu backend's decode steps in one native call (cpu_src/decode_layers.cpp) against the
loop of kernel calls it replaces: the same logits bit for bit, on every family's tiny checkpoint
(biases, per-head norms, sliding windows, GQA; Gemma's GELU and the mixtures' routing within
float32 rounding: the C library's tanh and exp) and with bf16, int8, Q8_0 or Q4_1 weights and a
16-bit cache; the fused call must really run (counted), and only on steps whose sequences
bring at most SHORT_RUN tokens each (decodes, speculative verifies, short prompts)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.backends.cpu_backend import CpuBackend
from engine.frontend.llm import run_to_completion
from engine.sampling_params import SamplingParams
from model_loader.load import load_model
from tests.test_families import FAMILIES, FAMILY_DIR
from tests.utils import SEED_PROMPTS, make_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)


@pytest.fixture
def fused_steps(monkeypatch):
    """Counts the decode steps that went through decode_layers, with their token counts."""
    seen = []
    real = CpuBackend._decode_layers

    def counting(self, x, batch):
        seen.append(len(batch.token_ids))
        return real(self, x, batch)

    monkeypatch.setattr(CpuBackend, "_decode_layers", counting)
    return seen


def fused_and_loop(loaded, prompts, **engine_args):
    """Greedy outputs of two cpu engines, decode_layers on and off."""
    outs = []
    for fuse in (True, False):
        e = make_engine(loaded, backend="cpu", record_logits=True, **engine_args)
        e.backend.fuse_decode = fuse
        outs.append(run_to_completion(e, prompts, GREEDY))
    return outs


def assert_same_bits(a, b):
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        np.testing.assert_array_equal(
            np.stack(x.outputs[0].step_logits), np.stack(y.outputs[0].step_logits)
        )


@pytest.mark.parametrize(
    "setting",
    [
        {},
        {"dtype": "bfloat16"},
        {"quantization": "int8"},
        {"quantization": "q8_0"},
        {"quantization": "q4_1"},
        {"kv_cache_dtype": "float16"},
        {"kv_cache_dtype": "fp8_e4m3"},
    ],
    ids=["float32", "bf16", "int8", "q8_0", "q4_1", "f16-cache", "fp8-cache"],
)
def test_the_same_bits_as_the_loop(tiny, fused_steps, setting):
    fused, loop = fused_and_loop(tiny, SEED_PROMPTS, **setting)
    assert_same_bits(fused, loop)
    # the prompts are short runs (at most SHORT_RUN tokens each): their prefill is fused too,
    # then every step decodes all of them at once, until they finish
    assert fused_steps[0] > len(SEED_PROMPTS)
    assert fused_steps[1:] == [len(SEED_PROMPTS)] * (GREEDY.max_tokens - 1)


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family(name, fused_steps):
    m = load_model(str(FAMILY_DIR / name))
    rng = np.random.default_rng()
    prompts = [rng.integers(3, m.config.vocab_size, n).tolist() for n in (5, 21, 40)]
    fused, loop = fused_and_loop(m, prompts)
    c, moe = m.config, m.config.moe
    if moe is None and c.hidden_act != "gelu_tanh":
        assert_same_bits(fused, loop)
    else:  # the native routing's float32 sums and exp, the C library's tanh: the last bit
        for x, y in zip(fused, loop, strict=True):  # of values, carried through the layers
            assert x.outputs[0].token_ids == y.outputs[0].token_ids
            a, b = np.stack(x.outputs[0].step_logits), np.stack(y.outputs[0].step_logits)
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    routed = moe is None or not (moe.shared_intermediate_size or moe.biases or c.qk_norm_whole)
    # the mixtures with a shared expert, biases (gpt-oss) or OLMoE's norms keep the loop
    assert (len(fused_steps) > 0) == routed


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_a_mixture_routes_in_the_native_step(name, fused_steps):
    """Qwen3-MoE (dense and sparse layers) and Mixtral decode in the one call: transformers'
    golden tokens and logits, and each expert's row counts those of the loop."""
    from tests.test_families import check_outputs, engine_outputs

    cases, outs = engine_outputs(name, "cpu", block_size=4, num_gpu_blocks=128)
    check_outputs(name, cases, outs)
    assert len(fused_steps) >= len(cases[0]["token_ids"]) - 1  # every decode step
    m = load_model(str(FAMILY_DIR / name))
    prompts = [[5, 9, 40, 41, 77], [300, 12, 6]]
    counts = []
    for fuse in (True, False):
        e = make_engine(m, backend="cpu")
        e.backend.fuse_decode = fuse
        run_to_completion(e, prompts, GREEDY)
        counts.append(e.backend.expert_tokens())
    assert counts[0] == counts[1] and sum(counts[0][0][1:]) > 0


def test_a_step_with_a_prefill_keeps_the_loop(tiny, fused_steps):
    """Chunked prefill mixes a prompt's chunk with the others' decodes: those steps take the
    loop; the pure decode steps after it the fused call."""
    prompts = [list(range(5, 12)), list(range(20, 120))]
    fused, loop = fused_and_loop(
        tiny, prompts, enable_chunked_prefill=True, max_num_batched_tokens=32, max_num_seqs=4
    )
    assert_same_bits(fused, loop)
    # steps 1-4: the short prompt's prefill, then its decodes beside the long one's chunks
    # (25 + 31 + 31 + 13 tokens: the last a short run, fused); steps 5-12 decode, both until
    # the short one has its 9 tokens, then the long one alone
    assert fused_steps == [1 + 13] + [2] * 5 + [1] * 3  # the last chunk is a short run


def test_speculative_verifies_run_fused_with_the_loops_bits(tiny, fused_steps):
    """Prompt lookup on prompts that repeat a phrase: its verify steps (each sequence's last
    token and its drafts, 2-5 tokens) run through the fused call, each token attending as a
    decode over its own keys, with the loop's bits (the logprobs of every token, which the
    target's logits give; recording logits turns speculation off)."""
    rng = np.random.default_rng()
    prompts = [(rng.integers(3, 320, int(rng.integers(3, 7))).tolist()) * 4 for _ in range(6)]
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}'
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=3)
    outs = []
    for fuse in (True, False):
        e = make_engine(tiny, backend="cpu", speculative_config=spec)
        e.backend.fuse_decode = fuse
        outs.append(run_to_completion(e, prompts, params))
        assert e.spec_stats.num_accepted_tokens > 0
    for x, y in zip(*outs, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].logprobs == y.outputs[0].logprobs
    # the steps with drafts were fused: more tokens than sequences, none a long run
    assert any(n > len(prompts) for n in fused_steps[1:])


def test_short_runs_attend_as_decodes_against_the_numpy_backend(tiny):
    """Runs of 1 to SHORT_RUN tokens (prompts that short, then decodes) on the cpu backend
    against the numpy backend's prefill attention: the same greedy tokens, logits close."""
    from engine.backends.cpu_backend import SHORT_RUN

    rng = np.random.default_rng()
    prompts = [rng.integers(3, 320, n).tolist() for n in (1, 2, SHORT_RUN - 1, SHORT_RUN)]
    outs = []
    for backend in ("numpy", "cpu"):
        e = make_engine(tiny, backend=backend, record_logits=True)
        outs.append(run_to_completion(e, prompts, GREEDY))
    for a, b in zip(*outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        got, want = (np.stack(o.outputs[0].step_logits) for o in (b, a))
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("setting", [{}, {"dtype": "bfloat16"}], ids=["f32", "bf16"])
def test_lora_rows_run_fused_with_the_loops_bits(fused_steps, setting):
    """Decode steps whose rows run three adapters and the base model go through decode_layers
    (each product's lora_add) and give the loop's logits bit for bit; PEFT's tokens either way."""
    from tests.test_families import loaded
    from tests.test_lora import golden, lora, run

    family, cases = "llama", golden("llama")["cases"]
    prompts = [c["prompt_token_ids"] for c in cases]
    outs = []
    for fuse in (True, False):
        e = make_engine(
            loaded(family), backend="cpu", record_logits=True, enable_lora=True, max_loras=3,
            max_lora_rank=64, **setting,
        )  # fmt: skip
        e.backend.fuse_decode = fuse
        outs.append(run(e, prompts, [lora(family, c["adapter"]) for c in cases], 6))
    assert fused_steps and max(fused_steps) == len(cases)  # every row, adapters and base
    assert_same_bits(*outs)
    if not setting:
        assert [o.outputs[0].token_ids for o in outs[0]] == [c["token_ids"][:6] for c in cases]
