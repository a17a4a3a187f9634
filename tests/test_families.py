"""Every supported family against Hugging Face transformers 5, on every path.

The checkpoints in tests/data/families/ are tiny random models of each family as transformers
5.24 (gemma2, gemma3: 5.25) saves them, with golden greedy tokens and logits from transformers
in float32 (scripts/make_family_golden.py). Prompts are token ids: 5, 40 and 70 tokens, shorter
and longer than the sliding windows (8, 12, 16, 24) and than llama3's original context (32).
"""

from __future__ import annotations

import base64
import json
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from engine import SamplingParams
from engine.frontend.llm import run_to_completion
from model_loader.families import FAMILIES as FAMILY_TABLE
from model_loader.load import load_model
from reference.generate import generate as reference_generate
from reference.model import forward
from tests.utils import make_engine

FAMILY_DIR = Path(__file__).parent / "data" / "families"
FAMILIES = sorted(p.name for p in FAMILY_DIR.iterdir() if (p / "golden.json").exists())
# mixtures of experts: the host backends run them, the CUDA backend refuses them
MOE = [n for n in FAMILIES if "_moe" in n or n in ("mixtral", "olmoe", "gpt_oss")]
DENSE = [n for n in FAMILIES if n not in MOE]
LOGITS_ATOL = 1e-3  # float32, transformers vs us (the golden tests' tolerance)
STEP_ATOL = 2e-3  # every step's logits, after several decode steps through the KV cache


@cache
def golden(name: str) -> dict:
    return json.loads((FAMILY_DIR / name / "golden.json").read_text())


@cache
def loaded(name: str):
    return load_model(str(FAMILY_DIR / name))


def step_logits(case: dict) -> np.ndarray:
    """(steps, V) float32: the logits that chose each golden token."""
    raw = np.frombuffer(base64.b64decode(case["step_logits"]), dtype="<f4")
    return raw.reshape(len(case["token_ids"]), -1)


def test_every_family_has_golden_data():
    want = {"llama", "llama3", "qwen2", "qwen2_swa", "qwen2_yarn", "qwen3", "mistral", "phi3"}
    want |= {"gemma", "gemma2", "gemma3", "qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "gpt_oss"}
    assert want <= set(FAMILIES)
    for name in FAMILIES:
        arch = golden(name)["meta"]["architecture"]
        assert arch in FAMILY_TABLE[loaded(name).config.family].architectures


@pytest.mark.parametrize("name", FAMILIES)
def test_reference_matches_transformers(name):
    m = loaded(name)
    for case in golden(name)["cases"]:
        ids, want = case["prompt_token_ids"], case["token_ids"]
        logits = forward(m.weights, m.config, ids)  # (V,)
        np.testing.assert_allclose(logits, step_logits(case)[0], atol=LOGITS_ATOL, rtol=0)
        for mode in ("recompute", "cached"):
            got = reference_generate(m.weights, m.config, ids, len(want), mode=mode).token_ids
            assert got == want, f"{name} {mode}, prompt of {len(ids)}"


def engine_outputs(name: str, backend: str, **engine_args):
    cases = golden(name)["cases"]
    n = len(cases[0]["token_ids"])
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    engine = make_engine(loaded(name), backend=backend, record_logits=True, **engine_args)
    outs = run_to_completion(engine, [c["prompt_token_ids"] for c in cases], params)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return cases, outs


def check_outputs(name, cases, outs):
    for case, out in zip(cases, outs, strict=True):
        where = f"{name}, prompt of {len(case['prompt_token_ids'])}"
        assert out.token_ids == case["token_ids"], where
        got = np.stack(out.outputs[0].step_logits)  # (steps, V)
        np.testing.assert_allclose(got, step_logits(case), atol=STEP_ATOL, rtol=0, err_msg=where)


@pytest.mark.parametrize("name", FAMILIES)
def test_numpy_backend_matches_transformers(name):
    check_outputs(name, *engine_outputs(name, "numpy"))


@pytest.mark.parametrize("name", FAMILIES)
def test_numpy_backend_chunked_prefill_small_blocks(name):
    """Prefill chunks of 16 tokens over 4-token blocks: windows cross chunks and blocks."""
    outs = engine_outputs(
        name,
        "numpy",
        block_size=4,
        num_gpu_blocks=128,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    check_outputs(name, *outs)


@pytest.mark.parametrize("name", FAMILIES)
def test_cuda_cpu_backend_matches_transformers(name):
    check_outputs(name, *engine_outputs(name, "cuda-cpu", block_size=4, num_gpu_blocks=128))


@pytest.mark.parametrize("name", ["mistral", "qwen2_swa", "qwen3", "gemma2", "gemma3"])
def test_cuda_cpu_backend_chunked_prefill_eager(name):
    outs = engine_outputs(
        name,
        "cuda-cpu",
        num_gpu_blocks=64,
        enable_chunked_prefill=True,
        max_num_batched_tokens=24,
        max_num_seqs=4,
        enforce_eager=True,
    )
    check_outputs(name, *outs)


@pytest.mark.parametrize("name", FAMILIES)
def test_cpu_backend_matches_transformers(name):
    """The native kernels (cpu_src/): chunked prefill over 4-token blocks, then decodes (a
    SiLU family's through decode_layers)."""
    outs = engine_outputs(
        name,
        "cpu",
        block_size=4,
        num_gpu_blocks=128,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    check_outputs(name, *outs)
