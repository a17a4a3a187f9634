"""The reference against golden data from Hugging Face transformers (scripts/make_golden.py).

Prompt token ids and 32 greedy tokens must be identical; the float32 logits at the prompt's last
position within 1e-3 absolute. SmolLM2 is the real model; the tiny random model checks the HF
directory path (safetensors + tokenizer.json) the same way.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine.golden import LOGITS_ATOL, golden_logits, read_golden
from reference.generate import generate

SMOL = read_golden("smollm2")
TINY = read_golden("tiny")


def as_float32(m):
    return dataclasses.replace(m, weights=m.weights.astype(np.float32))


@pytest.fixture(scope="module")
def smollm2_f32(smollm2):
    return as_float32(smollm2)


@pytest.fixture(scope="module")
def tiny_f32(tiny):
    return as_float32(tiny)


def encode_like_golden(tokenizer, case: dict) -> list[int]:
    """Plain prompts: encode(text); chat prompts: render the template, then encode without BOS."""
    if "messages" in case:
        text = tokenizer.apply_chat_template(case["messages"], add_generation_prompt=True)
        assert text == case["prompt"], "chat template renders differently from transformers"
    else:
        text = case["prompt"]
    return tokenizer.encode(text, add_special_tokens=case["add_special_tokens"])


def check_case(model, case: dict) -> None:
    assert encode_like_golden(model.tokenizer, case) == case["prompt_token_ids"]
    res = generate(model.weights, model.config, case["prompt_token_ids"], len(case["token_ids"]))
    want = golden_logits(case)
    assert res.logits[0].dtype == np.float32
    assert res.logits[0].shape == want.shape
    err = np.max(np.abs(res.logits[0] - want))
    assert err <= LOGITS_ATOL, f"last-position logits differ by {err:.2e}"
    assert res.token_ids == case["token_ids"]
    assert model.tokenizer.decode(res.token_ids) == case["text"]


def test_golden_files_are_complete():
    assert [c["prompt"] for c in SMOL["cases"][:3]] == [
        "hi my name is",
        "today is a beautiful summer day",
        "hello there",
    ]
    assert SMOL["cases"][3]["messages"][0]["content"] == "What is the capital of France?"
    for case in SMOL["cases"] + TINY["cases"]:
        assert len(case["token_ids"]) == 32


@pytest.mark.parametrize("case", SMOL["cases"], ids=lambda c: c["prompt"][:24])
def test_smollm2_matches_transformers(smollm2_f32, case):
    check_case(smollm2_f32, case)


@pytest.mark.parametrize("case", SMOL["tokenizer_cases"], ids=lambda c: c["text"][:16])
def test_smollm2_tokenizer_matches_transformers(smollm2, case):
    ids = smollm2.tokenizer.encode(case["text"], add_special_tokens=case["add_special_tokens"])
    assert ids == case["ids"]


@pytest.mark.parametrize("case", TINY["cases"], ids=lambda c: c["prompt"])
def test_tiny_matches_transformers(tiny_f32, case):
    check_case(tiny_f32, case)


@pytest.mark.parametrize("case", TINY["tokenizer_cases"], ids=lambda c: c["text"][:16])
def test_tiny_tokenizer_matches_transformers(tiny_f32, case):
    ids = tiny_f32.tokenizer.encode(case["text"], add_special_tokens=case["add_special_tokens"])
    assert ids == case["ids"]
