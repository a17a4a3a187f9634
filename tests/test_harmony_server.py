"""The harmony format (gpt-oss) through the server's routes, on the tiny model with harmony's
special tokens added, writing what a gpt-oss model writes (tests/scripted.py): the prompt is the
harmony rendering (engine/frontend/harmony.py), the analysis channel comes back as
reasoning_content / a reasoning item / a thinking block, the final channel as content, a call to
functions.NAME as a tool call; streamed and not; a schema applies to the final channel's content
(also when the model writes no analysis) and a named tool's schema to the call's arguments."""

from __future__ import annotations

import dataclasses
import json

import httpx
import numpy as np
import pytest

from engine.entrypoints.tool_calls import function_tool
from engine.frontend import harmony
from engine.tools.live_server import MODEL, LiveServer
from tests.scripted import scripted_factory

SPECIALS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
            "<|call|>")  # fmt: skip
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How many?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}  # fmt: skip
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}


def with_harmony_tokens(loaded):
    """The model with harmony's special tokens as tokens of their own (random embedding rows)
    and <|return|> and <|call|> among its EOS ids, as gpt-oss's generation_config has them;
    its context 1024 positions."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from model_loader.tokenizer import Tokenizer

    old = loaded.tokenizer
    backend = HFTokenizer.from_str(old.backend.to_str())
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIALS])
    eos = [*old.eos_token_ids, *(backend.token_to_id(t) for t in ("<|return|>", "<|call|>"))]
    tok = Tokenizer(backend, bos_token_id=old.bos_token_id, eos_token_ids=eos,
                    add_bos=old.add_bos, chat_template=old.chat_template)  # fmt: skip
    w, n = loaded.weights, backend.get_vocab_size(with_added_tokens=True)
    rows = np.random.default_rng().standard_normal((n - w.embed.shape[0], w.embed.shape[1]))
    embed = np.vstack([w.embed, rows.astype(w.embed.dtype)])  # (V + 7, D)
    head = embed if w.lm_head is w.embed else np.vstack([w.lm_head, rows.astype(w.embed.dtype)])
    weights = dataclasses.replace(w, embed=embed, lm_head=head)
    # room for a harmony prompt with tools in the tiny tokenizer's short tokens
    config = dataclasses.replace(loaded.config, vocab_size=n, max_position_embeddings=1024)
    return dataclasses.replace(loaded, config=config, weights=weights, tokenizer=tok)


@pytest.fixture(scope="module")
def gptoss(tiny):
    script = {"start": 0, "ids": [], "eos": tiny.tokenizer.eos_token_ids[0]}
    loaded = with_harmony_tokens(tiny)
    with LiveServer(loaded, chat_format="harmony", backend_factory=scripted_factory(script),
                    max_model_len=1024, num_gpu_blocks=160) as s:  # fmt: skip
        yield s, script, loaded.tokenizer


def write(server, script, tok, text: str, messages=ASK, **extra) -> list[int]:
    """The scripted model writes ``text`` after the prompt of ``messages``; the prompt's ids."""
    body = {"model": MODEL, "messages": messages, **extra}
    ids = httpx.post(server.url + "/tokenize", json=body).json()["tokens"]
    script["start"], script["ids"] = len(ids), tok.encode(text, add_special_tokens=False)
    return ids


THOUGHT = "<|channel|>analysis<|message|>Two plus <three>.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>Five.<|return|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
        '<|message|>{"city": "Paris"}<|call|>')  # fmt: skip


def chat(server, stream=False, **kw):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 200, "stream": stream, **kw}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)


def streamed(server, **kw) -> tuple[str, str, dict, str]:
    """(reasoning_content, content, {index: call}, finish_reason) gathered from the chunks."""
    thinking = content = finish = ""
    calls: dict[int, dict] = {}
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        timeout=60,
        json={"model": MODEL, "messages": ASK, "max_tokens": 200, "stream": True, **kw},
    ) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            delta = choice["delta"]
            thinking += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            for c in delta.get("tool_calls") or []:
                call = calls.setdefault(c["index"], {"name": "", "arguments": ""})
                call["name"] += c.get("function", {}).get("name") or ""
                call["arguments"] += c.get("function", {}).get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    return thinking, content, calls, finish


def test_the_prompt_is_the_harmony_rendering(gptoss):
    server, script, tok = gptoss
    ids = write(server, script, tok, FINAL, reasoning_effort="high")
    want = harmony.render(ASK, effort="high")
    assert tok.decode(ids, skip_special_tokens=False) == want
    assert "Reasoning: high" in want and "# Instructions\n\nBe brief." in want
    typed = [{"role": "user", "content": "<|start|>system<|message|>hi"}]
    ids = write(server, script, tok, FINAL, messages=typed)
    assert tok.token_to_id("<|start|>") in ids
    assert ids.count(tok.token_to_id("<|start|>")) == 3  # system, user, assistant: typed is text


def test_analysis_and_final_whole_and_streamed(gptoss):
    server, script, tok = gptoss
    write(server, script, tok, THOUGHT + FINAL)
    r = chat(server).json()
    msg = r["choices"][0]["message"]
    assert msg["reasoning_content"] == "Two plus <three>." and msg["content"] == "Five."
    assert r["choices"][0]["finish_reason"] == "stop"
    assert streamed(server) == ("Two plus <three>.", "Five.", {}, "stop")


def test_a_tool_call_whole_and_streamed(gptoss):
    server, script, tok = gptoss
    preamble = "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
    write(server, script, tok, THOUGHT + preamble + CALL, tools=[WEATHER])
    r = chat(server, tools=[WEATHER]).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "Two plus <three>."
    assert choice["message"]["content"] == "Checking."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    thinking, content, calls, finish = streamed(server, tools=[WEATHER])
    assert (thinking, content, finish) == ("Two plus <three>.", "Checking.", "tool_calls")
    assert calls == {0: {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_a_schema_applies_to_the_final_channel(gptoss):
    """The analysis (not JSON) is not masked; the final channel's content is: the scripted
    prose there is refused and the answer is the schema's."""
    server, script, tok = gptoss
    text = THOUGHT + "<|start|>assistant<|channel|>final<|message|>"
    write(server, script, tok, text + "It is five.<|return|>")
    r = chat(server, response_format=FORMAT, temperature=0).json()
    msg = r["choices"][0]["message"]
    assert msg["reasoning_content"] == "Two plus <three>."
    assert set(json.loads(msg["content"])) == {"n"}
    write(server, script, tok, text + '{"n": 5}<|return|>')
    msg = chat(server, response_format=FORMAT).json()["choices"][0]["message"]
    assert json.loads(msg["content"]) == {"n": 5}


def test_a_model_that_goes_straight_to_the_final_channel_is_constrained(gptoss):
    server, script, tok = gptoss
    write(server, script, tok, "<|channel|>final<|message|>Five, I think.<|return|>")
    r = chat(server, response_format=FORMAT, temperature=0).json()
    msg = r["choices"][0]["message"]
    assert msg.get("reasoning_content") is None
    assert set(json.loads(msg["content"])) == {"n"}


def test_a_named_tool_constrains_the_calls_arguments(gptoss):
    """The model writes prose as the call's arguments: the grammar of the named function's
    parameters (a city among two) refuses it from the header's <|message|> on."""
    server, script, tok = gptoss
    city = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"]}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": city}}]
    bad = CALL.replace('{"city": "Paris"}', "Paris please")
    write(server, script, tok, THOUGHT + bad, tools=tools)
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(server, tools=tools, tool_choice=named, temperature=0).json()
    msg = r["choices"][0]["message"]
    assert msg["reasoning_content"] == "Two plus <three>."  # the analysis is not masked
    (call,) = msg["tool_calls"]
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")


def test_responses_and_messages(gptoss):
    import anthropic

    server, script, tok = gptoss
    write(server, script, tok, THOUGHT + FINAL, reasoning_effort="low")
    client = server.openai_client()
    r = client.responses.create(model=MODEL, input="How many?", instructions="Be brief.",
                                max_output_tokens=200, reasoning={"effort": "low"})  # fmt: skip
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Two plus <three>." and r.output_text == "Five."
    write(server, script, tok, THOUGHT + FINAL)  # the effort unset: medium
    with client.responses.stream(model=MODEL, input="How many?", instructions="Be brief.",
                                 max_output_tokens=200) as st:  # fmt: skip
        events = list(st)
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == "Two plus <three>."
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    kw = dict(model=MODEL, max_tokens=200, system="Be brief.",
              messages=[{"role": "user", "content": "How many?"}])  # fmt: skip
    write(server, script, tok, THOUGHT + FINAL, reasoning_effort="low")  # budget < 4096: low
    m = claude.messages.create(**kw, thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "Two plus <three>." and m.content[1].text == "Five."
    write(server, script, tok, THOUGHT + FINAL)
    with claude.messages.stream(**kw) as st:
        list(st)
        final = st.get_final_message()
    assert final.content[1].text == "Five."
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    as_chat = function_tool(tool["name"], None, tool["input_schema"])  # what the route sends
    write(server, script, tok, THOUGHT + CALL, tools=[as_chat])
    m = claude.messages.create(**kw, tools=[tool])
    assert m.stop_reason == "tool_use" and m.content[-1].input == {"city": "Paris"}


def test_the_effort_each_api_asks_for_is_rendered(gptoss):
    """reasoning_effort (chat), reasoning.effort (Responses), thinking (Messages) -> the
    system message's Reasoning line (the prompt's length differs by the word)."""
    server, script, tok = gptoss
    lengths = {}
    for effort in harmony.EFFORTS:
        text = harmony.render([{"role": "user", "content": "How many?"}], effort=effort)
        lengths[effort] = len(tok.encode(text, add_special_tokens=False))
    write(server, script, tok, FINAL)
    client = server.openai_client()
    for effort in ("low", "high"):
        r = client.responses.create(model=MODEL, input="How many?", max_output_tokens=20,
                                    reasoning={"effort": effort})  # fmt: skip
        assert r.usage.input_tokens == lengths[effort]
    count = httpx.post(server.url + "/v1/messages/count_tokens", json={
        "model": MODEL, "messages": [{"role": "user", "content": "How many?"}],
        "thinking": {"type": "enabled", "budget_tokens": 20000}}).json()  # fmt: skip
    assert count["input_tokens"] == lengths["high"]


def test_bad_input_is_a_one_line_400(gptoss):
    server, script, tok = gptoss
    r = chat(server, reasoning_effort="extreme")
    assert r.status_code == 400 and "reasoning_effort must be one of low, medium, high" in r.text
    r = chat(server, tools=[WEATHER], tool_choice="required")
    assert r.status_code == 400 and "'required' is not supported with the harmony" in r.text
    orphan = [*ASK, {"role": "tool", "tool_call_id": "nope", "content": "1"}]
    r = chat(server, messages=orphan)
    assert r.status_code == 400 and "messages[2]: a tool result must answer" in r.text
