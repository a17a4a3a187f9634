"""The model's generation_config.json as default sampling parameters (and how to ignore it)."""

from __future__ import annotations

import json

import pytest

from engine import LLM, SamplingParams
from engine.entrypoints.protocol import CompletionRequest
from engine.sampling_params import generation_defaults
from model_loader.load import read_generation_config
from model_loader.synthetic import make_tiny_model


def test_generation_defaults_follow_transformers():
    sampled = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "max_new_tokens": 7}
    assert generation_defaults(sampled) == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 7}
    assert generation_defaults({"do_sample": False, "temperature": 0.6}) == {"temperature": 0.0}
    assert generation_defaults({}) == {}
    with pytest.raises(ValueError, match="top_p"):
        generation_defaults({"top_p": 0.0})


@pytest.fixture(scope="module")
def sampled_model(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("gen") / "m")
    gen = {"eos_token_id": 0, "do_sample": True, "temperature": 0.7, "top_k": 5}
    gen["repetition_penalty"] = 1.3
    gen["max_new_tokens"] = 6
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path


def test_read_generation_config_keeps_only_sampling_keys(sampled_model):
    got = read_generation_config(sampled_model)
    assert got == {
        "do_sample": True,
        "temperature": 0.7,
        "top_k": 5,
        "repetition_penalty": 1.3,
        "max_new_tokens": 6,
    }


def test_llm_uses_the_models_defaults_unless_ignored(sampled_model):
    llm = LLM(model=str(sampled_model), backend="numpy", num_gpu_blocks=32, max_model_len=64)
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_k, p.repetition_penalty, p.max_tokens) == (0.7, 5, 1.3, 6)
    (out,) = llm.generate("hello there", use_tqdm=False)
    assert len(out.token_ids) <= 6
    plain = LLM(
        model=str(sampled_model),
        backend="numpy",
        num_gpu_blocks=32,
        max_model_len=64,
        generation_config="ignore",
    )
    assert plain.get_default_sampling_params() == SamplingParams()


def test_server_request_takes_defaults_only_for_unset_fields():
    defaults = {"temperature": 0.7, "top_k": 5, "repetition_penalty": 1.3}
    unset = CompletionRequest(model="m", prompt="hi")
    p = unset.sampling_params(16, None, defaults)
    assert (p.temperature, p.top_k, p.repetition_penalty) == (0.7, 5, 1.3)
    explicit = CompletionRequest(model="m", prompt="hi", temperature=0.0, top_k=0)
    p = explicit.sampling_params(16, None, defaults)
    assert (p.temperature, p.top_k, p.repetition_penalty) == (0.0, 0, 1.3)


def test_bad_generation_config_is_one_line(sampled_model, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(sampled_model, bad)
    (bad / "generation_config.json").write_text(json.dumps({"temperature": -1.0}))
    with pytest.raises(ValueError, match="generation_config.json: .*temperature"):
        LLM(model=str(bad), backend="numpy", num_gpu_blocks=32, max_model_len=64)
