"""Anthropic's Messages API through the official ``anthropic`` client against a live server on
SmolLM2-135M:
text with a system prompt, a tool_use -> tool_result round trip, streaming with
input_json_delta, stop sequences, output_config's JSON schema, count_tokens, x-api-key, and the
error types on bad input.

Oracle: the same conversation through /v1/chat/completions (greedy, the same server): a Messages
answer must be that completion's tokens, its tool calls and usage, in Anthropic's shape.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from engine.tools.live_server import MODEL, LiveServer

KEY = "test-key"
GREEDY = {"temperature": 0.0}  # older clients' field; the current SDK sends it in extra_body
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    },
}
CHAT_WEATHER = {
    "type": "function",
    "function": {k: WEATHER[k] for k in ("name", "description")}
    | {"parameters": WEATHER["input_schema"]},
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm2):
    with LiveServer(smollm2, api_key=KEY, max_model_len=512, num_gpu_blocks=128) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def chat(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def test_text_with_a_system_prompt_is_the_chat_completion(client, chat):
    system = "You answer in one word."
    r = client.messages.create(
        model=MODEL, max_tokens=12, system=system, messages=ASK, extra_body=GREEDY
    )
    want = chat.chat.completions.create(
        model=MODEL, max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": system}, *ASK],
    )  # fmt: skip
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"]
    assert r.content[0].text == want.choices[0].message.content
    assert r.stop_reason == "max_tokens" and r.stop_sequence is None
    assert (r.usage.input_tokens, r.usage.output_tokens) == (want.usage.prompt_tokens, 12)
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=ASK)
    assert counted.input_tokens == want.usage.prompt_tokens


def test_a_stop_sequence_ends_the_message_and_is_named(client):
    full = client.messages.create(model=MODEL, max_tokens=16, messages=ASK, extra_body=GREEDY)
    text = full.content[0].text
    k = next(k for k in range(len(text) // 2, len(text) - 1)  # a first occurrence, past 0
             if text[k : k + 2].strip() and text.index(text[k : k + 2]) == k)  # fmt: skip
    stop = text[k : k + 2]
    r = client.messages.create(
        model=MODEL, max_tokens=16, messages=ASK, stop_sequences=[stop], extra_body=GREEDY
    )
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == text[: text.index(stop)]


def test_a_tool_use_and_its_result_round_trip(client, chat):
    """A forced tool_use (its input the schema's), then the tool_result in the next user turn:
    the prompt holds the call and the result as the chat template renders tool turns."""
    r = client.messages.create(
        model=MODEL, max_tokens=40, messages=ASK, tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY,
    )  # fmt: skip
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"]
    use = r.content[0]
    assert use.name == "get_weather" and use.id.startswith("toolu_") and set(use.input) == {"city"}
    turns = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump() for b in r.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}]},
    ]  # fmt: skip
    again = client.messages.create(
        model=MODEL, max_tokens=8, messages=turns, tools=[WEATHER], extra_body=GREEDY
    )
    calls = [{"id": use.id, "type": "function",
              "function": {"name": use.name, "arguments": json.dumps(use.input)}}]  # fmt: skip
    want = chat.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0, tools=[CHAT_WEATHER],
        messages=[*ASK, {"role": "assistant", "content": "", "tool_calls": calls},
                  {"role": "tool", "tool_call_id": use.id, "content": "Sunny, 21 C"}],
    )  # fmt: skip
    assert again.usage.input_tokens == want.usage.prompt_tokens
    assert "".join(b.text for b in again.content if b.type == "text") == (
        want.choices[0].message.content or ""
    )


def test_streamed_tool_use_sends_input_json_deltas_in_order(client):
    kw = dict(model=MODEL, max_tokens=40, messages=ASK, tools=[WEATHER], extra_body=GREEDY)
    kw["tool_choice"] = {"type": "any", "disable_parallel_tool_use": True}  # one call
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type != "input_json"]  # the SDK's own, derived
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert json.loads(partial) == final.content[0].input == whole.content[0].input
    assert final.stop_reason == "tool_use" == whole.stop_reason


def test_streamed_text_is_the_whole_message(client):
    kw = dict(model=MODEL, max_tokens=10, messages=ASK, extra_body=GREEDY)
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.usage.output_tokens == 10 and final.stop_reason == "max_tokens"
    # the message_delta's usage carries the input tokens too, as Anthropic's stream does
    # (langchain-anthropic's streamed usage_metadata reads them there)
    with client.messages.stream(**kw) as stream:
        delta = [e for e in stream if e.type == "message_delta"][-1]
    assert delta.usage.input_tokens == whole.usage.input_tokens > 0
    assert delta.usage.output_tokens == 10


def test_output_config_format_constrains_the_text_to_the_schema(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    r = client.messages.create(
        model=MODEL, max_tokens=30, messages=ASK, extra_body=GREEDY,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )  # fmt: skip
    assert r.stop_reason == "end_turn"
    value = json.loads(r.content[0].text)
    assert set(value) == {"n"} and isinstance(value["n"], int)


@pytest.mark.parametrize(
    "kw, error, words",
    [
        ({"model": "nope"}, anthropic.NotFoundError, "The model `nope` does not exist"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         anthropic.BadRequestError, "content block type 'image' is not supported"),
        ({"thinking": {"type": "enabled", "budget_tokens": 64}}, anthropic.BadRequestError,
         "thinking: extended thinking is not implemented"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
         anthropic.BadRequestError, "server tool 'web_search_20250305' is not implemented"),
        ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]},
         anthropic.BadRequestError, "tool_choice names function 'nope'"),
        ({"max_tokens": 5000}, anthropic.BadRequestError, "max_tokens"),
    ],
)  # fmt: skip
def test_bad_requests_are_anthropic_errors(client, kw, error, words):
    args = {"model": MODEL, "max_tokens": 4, "messages": ASK, **kw}
    with pytest.raises(error) as e:
        client.messages.create(**args)
    body = e.value.body
    assert body["type"] == "error" and words in body["error"]["message"]
    kind = {anthropic.NotFoundError: "not_found_error"}.get(error, "invalid_request_error")
    assert body["error"]["type"] == kind


def test_the_key_comes_as_x_api_key_and_a_wrong_one_is_401(server, client):
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=MODEL, max_tokens=4, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(server.url + "/v1/messages", json={"model": MODEL, "messages": ASK},
                   headers={"x-api-key": KEY})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("max_tokens")
    assert r.json()["type"] == "error"
