"""The model's generation_config.json as default sampling parameters (and how to ignore it)."""

from __future__ import annotations

import json

import pytest

from engine import LLM, SamplingParams
from engine.entrypoints.protocol import CompletionRequest
from engine.sampling_params import generation_defaults
from engine.tools.live_server import MODEL, LiveServer
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


def test_override_lays_keys_over_the_chosen_source(sampled_model, tmp_path):
    """--override-generation-config over the model's file, over none ('vllm'), over another
    directory's file; an asked temperature beats the file's do_sample false; bad input is one
    line naming it."""
    kw = dict(backend="numpy", num_gpu_blocks=32, max_model_len=64)
    over = LLM(model=str(sampled_model), override_generation_config='{"temperature": 0.1, '
               '"max_new_tokens": 3}', **kw).get_default_sampling_params()  # fmt: skip
    assert (over.temperature, over.top_k, over.repetition_penalty, over.max_tokens) == (
        0.1, 5, 1.3, 3,
    )  # fmt: skip
    only = LLM(model=str(sampled_model), generation_config="vllm",
               override_generation_config={"top_p": 0.5}, **kw)  # fmt: skip
    assert only.get_default_sampling_params() == SamplingParams(top_p=0.5)
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"do_sample": False, "top_k": 9}))
    greedy = LLM(model=str(sampled_model), generation_config=str(other), **kw)
    assert greedy.get_default_sampling_params() == SamplingParams(temperature=0.0)
    warm = LLM(model=str(sampled_model), generation_config=str(other),
               override_generation_config='{"temperature": 0.3}', **kw)  # fmt: skip
    assert (
        warm.get_default_sampling_params().temperature,
        warm.get_default_sampling_params().top_k,
    ) == (0.3, 9)
    over = "override_generation_config"
    bad = [
        ({over: '{"temprature": 1}'}, "unknown key 'temprature'"),
        ({over: "[1]"}, "must be a JSON object"),
        ({over: "{"}, "not JSON"),
        ({over: '{"top_p": 2}'}, "override_generation_config: .*top_p"),
        ({"generation_config": str(tmp_path / "no")}, "generation_config must be auto"),
    ]
    for extra, words in bad:
        with pytest.raises(ValueError, match=words):
            LLM(model=str(sampled_model), **kw, **extra)


def _answers(s, temperature=None) -> list[str]:
    """One short answer from each route that samples: completions, chat, Responses, Messages."""
    import anthropic

    t = {} if temperature is None else {"temperature": temperature}
    client, msgs = s.openai_client(), [{"role": "user", "content": "hello there"}]
    out = [client.completions.create(model=MODEL, prompt="hello", max_tokens=12, **t)
           .choices[0].text]  # fmt: skip
    out.append(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, **t)
               .choices[0].message.content)  # fmt: skip
    out.append(client.responses.create(model=MODEL, input="hello there", max_output_tokens=12,
                                       **t).output_text)  # fmt: skip
    ac = anthropic.Anthropic(base_url=s.url, api_key="unused", max_retries=0)
    extra = {} if temperature is None else {"extra_body": t}
    message = ac.messages.create(model=MODEL, max_tokens=12, messages=msgs, **extra)
    out.append(message.content[0].text if message.content else "")
    return out


def test_every_route_takes_the_servers_defaults(tiny):
    """A server whose default is greedy answers a request that leaves temperature out, on each
    route, as it answers temperature 0; without the override the same request samples at 1.0
    (two answers of the tiny model's random weights differ)."""
    with LiveServer(tiny, override_generation_config='{"temperature": 0}') as s:
        greedy = _answers(s, temperature=0)
        assert _answers(s) == greedy
    with LiveServer(tiny) as s:
        first, second = _answers(s), _answers(s)
        assert all(a != b for a, b in zip(first, second, strict=True)), (first, second)
