"""The cpu backend's decode steps in one native call (cpu_src/decode_layers.cpp) against the
loop of kernel calls it replaces: the same logits bit for bit, on every family's tiny checkpoint
(biases, per-head norms, sliding windows, GQA) and with bf16, int8, Q8_0 or Q4_1 weights and a
16-bit cache; the fused call must really run (counted), and only on single-token decode steps."""

from __future__ import annotations

import numpy as np
import pytest

from engine.backends.cpu_backend import CpuBackend
from engine.llm import run_to_completion
from engine.sampling_params import SamplingParams
from reference.loader import load_model
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
    # every step after the prefill decodes all the prompts at once, until they finish
    assert len(fused_steps) == GREEDY.max_tokens - 1
    assert fused_steps[0] == len(SEED_PROMPTS)


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family(name, fused_steps):
    m = load_model(str(FAMILY_DIR / name))
    rng = np.random.default_rng()
    prompts = [rng.integers(3, m.config.vocab_size, n).tolist() for n in (5, 21, 40)]
    fused, loop = fused_and_loop(m, prompts)
    assert_same_bits(fused, loop)
    silu = m.config.hidden_act == "silu"
    assert (len(fused_steps) > 0) == silu  # GELU models keep the loop


def test_a_step_with_a_prefill_keeps_the_loop(tiny, fused_steps):
    """Chunked prefill mixes a prompt's chunk with the others' decodes: those steps take the
    loop; the pure decode steps after it the fused call."""
    prompts = [list(range(5, 12)), list(range(20, 120))]
    fused, loop = fused_and_loop(
        tiny, prompts, enable_chunked_prefill=True, max_num_batched_tokens=32, max_num_seqs=4
    )
    assert_same_bits(fused, loop)
    # steps 1-4: the short prompt's prefill, then its decodes beside the long one's chunks
    # (25 + 31 + 31 + 13 tokens); steps 5-12 decode, both until the short one has its 9
    # tokens, then the long one alone
    assert fused_steps == [2] * 5 + [1] * 3
