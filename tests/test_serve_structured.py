"""Structured output, tools, echo and the sampling extras through the official ``openai`` client
against a live server: ``chat.completions.parse`` into a pydantic model (SmolLM2), regex,
choice and grammars, constraints that cannot compile, tool calls (named, required, auto;
streamed and not), echo with logprobs against the engine's own prompt log-probabilities and the
reference forward, logit_bias, and every refused field.

Oracles: pydantic's own validation of the parsed model, Python's ``re`` and ``json``, the
reference forward (tiny model), and the engine run without the server.
"""

from __future__ import annotations

import enum
import json
import re

import httpx
import numpy as np
import openai
import pytest
from pydantic import BaseModel, Field

from engine import SamplingParams
from engine.core.sampler import log_softmax
from engine.entrypoints.tool_calls import Tool as ToolModel
from engine.entrypoints.tool_calls import ToolMode, ToolStream, required_schema
from engine.entrypoints.tool_parsers import make_parser
from engine.frontend.llm import run_to_completion
from engine.tools.live_server import MODEL, LiveServer
from reference.model import forward
from tests.test_sampling_rules import greedy_tokens
from tests.utils import make_engine

NO_EOS = {"ignore_eos": True}
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tiny_server(tiny):
    with LiveServer(tiny, max_model_len=512, num_gpu_blocks=128) as s:
        yield s


@pytest.fixture(scope="module")
def tiny_client(tiny_server):
    return tiny_server.openai_client()


@pytest.fixture(scope="module", params=[None, "qwen3", "deepseek_r1"])
def smol_client(smollm2, request):
    """SmolLM2, a model that never thinks, with each reasoning parser and none: a parser waits
    for thinking only where the prompt or the output opens it, so every check below gives
    the same verdict with one on (the grammar applies from the first token)."""
    parser = {} if request.param is None else {"reasoning_parser": request.param}
    with LiveServer(smollm2, max_model_len=512, num_gpu_blocks=128, **parser) as s:
        yield s.openai_client()


# ---- response_format with a pydantic model (SmolLM2) ----


class Role(enum.StrEnum):
    admin = "admin"
    guest = "guest"


class Home(BaseModel):
    city: str = Field(max_length=10)
    zip: int = Field(ge=0, le=99999)


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)
    score: float
    role: Role
    tags: list[str] = Field(max_length=2)
    home: Home


ASK = [{"role": "user", "content": "Ann is 31, an admin living in Paris. Give her record as JSON."}]


def test_parse_into_a_pydantic_model(smol_client):
    """parse() sends the model's strict schema; every answer validates as the model, greedy
    and whole, sampled with n=2 and streamed, each ending with 'stop' when its grammar
    completes."""
    kw = dict(model=MODEL, messages=ASK, response_format=Person, max_tokens=110)
    r = smol_client.chat.completions.parse(**kw, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and isinstance(person.home, Home)
    assert Person.model_validate_json(r.choices[0].message.content) == person
    with smol_client.chat.completions.stream(**kw, temperature=0.5, n=2, seed=3) as stream:
        texts = {0: "", 1: ""}
        for chunk in (e.chunk for e in stream if e.type == "chunk"):
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
        final = stream.get_final_completion()
    assert [c.finish_reason for c in final.choices] == ["stop", "stop"]
    for c in final.choices:
        assert isinstance(c.message.parsed, Person)
        assert Person.model_validate_json(texts[c.index]) == c.message.parsed


def test_json_object(smol_client):
    r = smol_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": 'Write {"a": 1} as JSON.'}],
        response_format={"type": "json_object"},
        max_tokens=40,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


# ---- regex, choice, grammars (tiny model: only the constraint shapes the text) ----

GRAMMARS = [
    ({"structured_outputs": {"regex": r"(ab|cd){2,4}"}}, r"(ab|cd){2,4}"),
    ({"guided_regex": r"[0-9]{3}-[0-9]{2}"}, r"[0-9]{3}-[0-9]{2}"),
    ({"structured_outputs": {"choice": ["yes", "no", "maybe"]}}, r"yes|no|maybe"),
    ({"guided_choice": ["red", "green"], "guided_decoding_backend": "guidance"}, r"red|green"),
    ({"structured_outputs": {"grammar": 'start: "x" D D?\nD: /[0-9]/'}}, r"x[0-9]{1,2}"),
    ({"guided_grammar": 'root ::= "n=" [0-9] [0-9]?'}, r"n=[0-9]{1,2}"),  # GBNF
]


@pytest.mark.parametrize("body, pattern", GRAMMARS)
def test_regex_choice_and_grammars(tiny_client, body, pattern):
    chat = tiny_client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=20, temperature=1.0, seed=1, extra_body=body
    )
    assert re.fullmatch(pattern, chat.choices[0].message.content)
    assert chat.choices[0].finish_reason == "stop"
    done = tiny_client.completions.create(
        model=MODEL, prompt="hi", max_tokens=20, temperature=0, n=2, extra_body=body
    )
    assert all(re.fullmatch(pattern, c.text) for c in done.choices)


BAD_CONSTRAINTS = [
    ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs"),
    ({"guided_json": {"type": "objectx"}}, "guided_json"),
    ({"guided_grammar": "start: nothing_defined"}, "guided_grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}}, "json"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex and guided_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema is required"),
    ({"response_format": {"type": "grammar"}}, "response_format.type"),
]


@pytest.mark.parametrize("body, words", BAD_CONSTRAINTS)
def test_a_constraint_that_cannot_compile_is_400(tiny_server, body, words):
    url = tiny_server.url
    req = {"model": MODEL, "messages": USER, "max_tokens": 4, **body}
    r = httpx.post(url + "/v1/chat/completions", json=req)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"] and "\n" not in r.json()["error"]["message"]
    assert httpx.get(url + "/health").status_code == 200
    ok = {"model": MODEL, "messages": USER, "max_tokens": 2}
    assert httpx.post(url + "/v1/chat/completions", json=ok).status_code == 200


# ---- tools ----

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _streamed_calls(chunks) -> tuple[dict[int, dict], str | None, str]:
    """Tool calls put together from streamed deltas (by index), the last finish_reason, and
    the content."""
    calls, finish, content = {}, None, ""
    for chunk in chunks:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": d.id, "name": None, "arguments": ""})
                call["name"] = d.function.name or call["name"]
                call["arguments"] += d.function.arguments or ""
    return calls, finish, content


@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_tool_calls(smol_client, choice):
    """A named tool_choice returns that function's call and a required one an array of calls,
    arguments matching the schema; streamed, the deltas add up to the same calls."""
    tool_choice = {"type": "function", "function": {"name": "get_weather"}}
    tool_choice = tool_choice if choice == "named" else "required"
    kw = dict(model=MODEL, messages=WEATHER_ASK, tools=TOOLS, tool_choice=tool_choice)
    r = smol_client.chat.completions.create(**kw, max_tokens=60, temperature=0)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert msg.tool_calls and all(c.type == "function" and c.id for c in msg.tool_calls)
    first = msg.tool_calls[0].function
    if choice == "named":
        assert len(msg.tool_calls) == 1 and first.name == "get_weather"
    for call in msg.tool_calls:
        args = json.loads(call.function.arguments)
        assert set(args) == {"city"} if call.function.name == "get_weather" else {"zone"}
    chunks = list(
        smol_client.chat.completions.create(**kw, max_tokens=60, temperature=0, stream=True)
    )
    calls, finish, content = _streamed_calls(chunks)
    assert finish == "tool_calls" and content == ""
    got = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    want = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls]
    assert got == want


# The cases a 135M model did not finish before: a schema with a nested list, a named call whose
# schema leaves additionalProperties unsaid (SmolLM2 filled it with the schema's own keys until
# max_tokens), and "required" calls cut by max_tokens (no calls came back).
class Person2(BaseModel):
    name: str
    age: int
    hobbies: list[str]


class People(BaseModel):
    people: list[Person2]


OPEN_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "the city"},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city"],
        },
    },
}


def test_a_schema_with_a_nested_list_finishes(smol_client):
    ask = [{"role": "user", "content": "Describe two people: their names, ages and hobbies."}]
    r = smol_client.chat.completions.parse(
        model=MODEL, messages=ask, response_format=People, max_tokens=200, temperature=0
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(r.choices[0].message.parsed, People)


def test_a_named_call_holds_its_parameters_only_and_closes_in_budget(smol_client):
    r = smol_client.chat.completions.create(
        model=MODEL, messages=WEATHER_ASK, tools=[OPEN_WEATHER], max_tokens=80, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    assert r.choices[0].finish_reason == "tool_calls" and r.usage.completion_tokens < 80
    args = json.loads(r.choices[0].message.tool_calls[0].function.arguments)
    assert "city" in args and set(args) <= {"city", "unit"}


def test_required_calls_cut_by_max_tokens_come_back_whole(smol_client):
    """The array of calls cut by max_tokens: its complete calls are the answer (finish
    'length'), streamed and not; open objects in them closed as well."""
    kw = dict(model=MODEL, messages=WEATHER_ASK, tools=[OPEN_WEATHER], tool_choice="required")
    r = smol_client.chat.completions.create(**kw, max_tokens=50, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name == "get_weather" and call.id
        assert set(json.loads(call.function.arguments)) <= {"city", "unit"}
    calls, finish, _ = _streamed_calls(
        smol_client.chat.completions.create(**kw, max_tokens=50, temperature=0, stream=True)
    )
    assert finish == "length"
    got = [json.loads(c["arguments"]) for _, c in sorted(calls.items())]
    assert got == [json.loads(c.function.arguments) for c in choice.message.tool_calls]


F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALL = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'


def test_auto_tool_calls_are_parsed_from_the_text(tiny_client):
    """tool_choice auto (the default with tools): hermes-style blocks in the text become
    tool_calls, the rest content. The tiny model is made to write them by a choice constraint."""
    text = f"ok\n{CALL}\n{CALL.replace('1', '2')}"
    kw = dict(model=MODEL, messages=USER, tools=[F], max_tokens=200, temperature=0)
    body = {"guided_choice": [text]}
    r = tiny_client.chat.completions.create(**kw, extra_body=body)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "ok"
    args = [json.loads(c.function.arguments) for c in msg.tool_calls]
    assert args == [{"x": 1}, {"x": 2}] and {c.function.name for c in msg.tool_calls} == {"f"}
    chunks = list(tiny_client.chat.completions.create(**kw, extra_body=body, stream=True))
    calls, finish, content = _streamed_calls(chunks)
    assert finish == "tool_calls" and content.strip() == "ok"
    assert [json.loads(c["arguments"]) for _, c in sorted(calls.items())] == args
    one = tiny_client.chat.completions.create(**kw, extra_body=body, parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1
    plain = tiny_client.chat.completions.create(**kw, extra_body={"guided_choice": ["no call"]})
    assert plain.choices[0].message.content == "no call"
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "stop"


def test_a_conversation_with_tool_turns_renders(tiny_server, tiny_client):
    """An assistant turn with tool_calls (content null) and the tool's answer go to the
    template: the prompt holds the call and the result."""
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    conv = [
        *WEATHER_ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
    ]
    r = tiny_client.chat.completions.create(
        model=MODEL, messages=conv, tools=[WEATHER], max_tokens=1, extra_body=NO_EOS
    )
    assert r.usage.completion_tokens == 1
    ids = httpx.post(tiny_server.url + "/tokenize", json={"messages": conv, "tools": [WEATHER]})
    text = httpx.post(tiny_server.url + "/detokenize", json={"tokens": ids.json()["tokens"]})
    prompt = text.json()["prompt"]
    assert '"city": "Paris"' in prompt and "sunny, 24 C" in prompt
    assert "The weather in a city" in prompt  # the tool, as text (ChatML reads no tools)


def test_hermes_parser_pieces():
    """Tags split across chunks, text that may begin a tag held back, a bad block left as
    text, a last block left open."""
    p = make_parser("hermes")
    pieces = ["Hi <tool", '_call>{"name": "f", "argu', 'ments": {"x": 1}}</tool_', "call> ok <"]
    out = [p.feed(t) for t in pieces]
    assert "".join(c for c, _ in out) == "Hi " + " ok "
    deltas = [d for _, ds in out for d in ds]
    assert deltas[0]["function"] == {"name": "f", "arguments": ""}
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"x": 1}'
    assert p.feed("", final=True) == ("<", [])
    content, calls = make_parser("hermes").parse("<tool_call>not json</tool_call>")
    assert content == "<tool_call>not json</tool_call>" and calls == []
    content, calls = make_parser("hermes").parse('a <tool_call>{"name": "g"}')
    assert content == "a " and calls[0]["function"] == {"name": "g", "arguments": "{}"}
    mode = ToolMode("auto", parallel=True)
    stream = ToolStream(mode)
    deltas = [stream.delta(t, final=False) for t in ["\n", CALL, "\n "]] + [stream.delta("", True)]
    assert all(content is None for content, _ in deltas)  # whitespace between calls: no content
    calls = [d for _, ds in deltas for d in ds]
    assert {d["index"] for d in calls} == {0} and calls[0]["function"]["name"] == "f"
    assert "".join(d["function"]["arguments"] for d in calls) == '{"x": 1}'


def test_required_schema_moves_defs_to_the_root():
    class Unit(enum.StrEnum):
        c = "C"
        f = "F"

    class Place(BaseModel):
        unit: Unit
        n: int

    tool = openai.pydantic_function_tool(Place, name="where")
    schema = required_schema([ToolModel.model_validate(tool)], parallel=False)
    text = json.dumps(schema)
    assert schema["maxItems"] == 1 and "tool0_Unit" in schema["$defs"]
    assert '"#/$defs/Unit"' not in text and '"#/$defs/tool0_Unit"' in text


# ---- echo and logprobs (lm-evaluation-harness's loglikelihood request) ----


def test_echo_logprobs_equal_the_engines_prompt_logprobs(tiny, tiny_client):
    """echo + logprobs=1 with max_tokens 0 and 1 (token id prompts, a batch, as lm-eval sends
    them): the prompt's text first, token_logprobs null then one per prompt token, equal to the
    engine's prompt_logprobs and within 1e-4 of the reference forward; then the generated one."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 320, int(n)).tolist() for n in (9, 14)]
    engine = make_engine(tiny)
    want = run_to_completion(engine, prompts, SamplingParams(max_tokens=1, prompt_logprobs=1))
    for max_tokens in (0, 1):
        r = tiny_client.completions.create(
            model=MODEL, prompt=prompts, max_tokens=max_tokens, echo=True, logprobs=1, temperature=0
        )
        assert r.usage.completion_tokens == max_tokens * 2
        for prompt, w, c in zip(
            prompts, want, sorted(r.choices, key=lambda c: c.index), strict=True
        ):
            lp = c.logprobs
            n = len(prompt) + max_tokens
            assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
            text = tiny.tokenizer.decode(prompt, skip_special_tokens=False)
            assert c.text.startswith(text) and (max_tokens or c.text == text)
            assert c.finish_reason == "length"
            for j in range(1, len(prompt)):
                assert lp.token_logprobs[j] == pytest.approx(
                    w.prompt_logprobs[j][prompt[j]], abs=1e-6
                )
                ref = log_softmax(forward(tiny.weights, tiny.config, prompt[:j]).astype(np.float32))
                assert abs(lp.token_logprobs[j] - ref[prompt[j]]) < 1e-4
                assert max(lp.top_logprobs[j].values()) == pytest.approx(ref.max(), abs=1e-4)
            if max_tokens:
                assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())  # greedy


def test_echo_text_prompt_streamed_and_not(tiny_client):
    kw = dict(model=MODEL, prompt="hello there", max_tokens=3, temperature=0, extra_body=NO_EOS)
    plain = tiny_client.completions.create(**kw)
    echo = tiny_client.completions.create(**kw, echo=True)
    assert echo.choices[0].text == "hello there" + plain.choices[0].text
    chunks = list(tiny_client.completions.create(**kw, echo=True, logprobs=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == echo.choices[0].text
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None
    only = tiny_client.completions.create(**{**kw, "max_tokens": 0}, echo=True)
    assert only.choices[0].text == "hello there" and only.usage.completion_tokens == 0


def test_prompt_logprobs_field(tiny_client):
    r = tiny_client.completions.create(
        model=MODEL, prompt="hello there", max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and all(2 <= len(e) <= 3 for e in plp[1:])
    assert all({"logprob", "decoded_token"} == set(v) for e in plp[1:] for v in e.values())
    c = tiny_client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    assert c.model_extra["prompt_logprobs"][0] is None


# ---- logit_bias and the other vLLM sampling extras ----


def test_logit_bias_bans_and_forces(tiny, tiny_client):
    """+100 makes a token every token; -100 on the greedy first token gives the reference's
    greedy run with that logit lowered by 100."""
    prompt = tiny.tokenizer.encode("hi my name is", add_special_tokens=False)
    kw = dict(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)

    def text(**extra):
        r = tiny_client.completions.create(**kw, extra_body={**NO_EOS, **extra})
        return r.choices[0].text

    forced = tiny.tokenizer.encode(" sunset", add_special_tokens=False)[0]
    assert text(logit_bias={str(forced): 100}) == tiny.tokenizer.decode([forced] * 5)
    assert text(allowed_token_ids=[forced]) == tiny.tokenizer.decode([forced] * 5)
    first = greedy_tokens(tiny, prompt, 1)[0]

    def ban(logits, _out):
        logits[first] -= 100.0
        return logits

    want = greedy_tokens(tiny, prompt, 5, ban)
    assert want[0] != first and text(logit_bias={str(first): -100}) == tiny.tokenizer.decode(want)
    r = tiny_client.completions.create(
        model=MODEL, prompt="hi", max_tokens=4, extra_body={"min_tokens": 4, "bad_words": ["ab"]}
    )
    assert r.usage.completion_tokens == 4


def test_continuous_usage_and_tokenizer_info(tiny_server, tiny_client):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        tiny_client.chat.completions.create(
            model=MODEL,
            messages=USER,
            max_tokens=4,
            stream=True,
            stream_options=opts,
            extra_body=NO_EOS,
        )
    )
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.usage]
    assert counts == sorted(counts) and counts[-1] == 4 and chunks[-1].usage.completion_tokens == 4
    info = httpx.get(tiny_server.url + "/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>" and info["model_max_length"] == 512
    assert "<|im_start|>" in info["chat_template"] and info["tokenizer_class"]


# ---- what the server does not implement is a 400 naming it ----

CHAT = {"model": MODEL, "messages": USER, "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
REFUSED = [
    ("chat", {"functions": [{"name": "f"}]}, "functions"),
    ("chat", {"function_call": "auto"}, "function_call"),
    ("chat", {"audio": {"voice": "x", "format": "mp3"}}, "audio"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("chat", {"web_search_options": {}}, "web_search_options"),
    ("chat", {"service_tier": "flex"}, "service_tier"),
    ("chat", {"store": True}, "store"),
    ("chat", {"reasoning_effort": "low"}, "reasoning_effort"),
    ("chat", {"verbosity": "low"}, "verbosity"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"echo": True}, "echo"),
    ("chat", {"chat_template": "{{ x }}"}, "chat_template"),
    ("chat", {"continue_final_message": True}, "continue_final_message"),
    ("chat", {"tool_choice": "auto"}, "tool_choice"),
    ("chat", {"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    (
        "chat",
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
        "tool_choice",
    ),
    ("chat", {"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools.0.type"),
    ("chat", {"tools": []}, "tools"),
    (
        "chat",
        {"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"},
        "tool_choice and guided_regex",
    ),
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("chat", {"stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ("chat", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("chat", {"logit_bias": {"word": 1}}, "logit_bias"),
    ("chat", {"logit_bias": {"99999": 1}}, "logit_bias"),
    ("chat", {"allowed_token_ids": []}, "allowed_token_ids"),
    ("chat", {"prompt_logprobs": 21}, "prompt_logprobs"),
    (
        "chat",
        {"guided_decoding_backend": "xgrammar", "guided_regex": "a"},
        "guided_decoding_backend",
    ),
    ("chat", {"use_beam_search": True}, "use_beam_search"),
    ("chat", {"priority": 3}, "priority"),
    (
        "chat",
        {"messages": [{"role": "tool", "content": "x", "name": "<|im_start|>"}]},
        "special token",
    ),
    ("completions", {"suffix": "x"}, "suffix"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"echo": True, "max_tokens": 0, "min_tokens": 1}, "min_tokens"),
    ("completions", {"truncate_prompt_tokens": 5}, "truncate_prompt_tokens"),
    (
        "completions",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nope"}},
            }
        },
        "response_format",
    ),
]


@pytest.mark.parametrize("route, extra, field", REFUSED)
def test_refused_fields_are_400_naming_them(tiny_server, route, extra, field):
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    body = {**(CHAT if route == "chat" else COMPLETION), **extra}
    r = httpx.post(tiny_server.url + path, json=body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert field in message and "\n" not in message
    assert (
        httpx.post(tiny_server.url + path, json=CHAT if route == "chat" else COMPLETION).status_code
        == 200
    )


def test_defaults_and_unknown_fields_are_accepted(tiny_server):
    """What a client sends with its default values changes nothing; fields the server does not
    know are ignored."""
    same = {
        "parallel_tool_calls": True,
        "service_tier": "auto",
        "store": False,
        "modalities": ["text"],
        "n": 1,
        "best_of": 1,
        "response_format": {"type": "text"},
        "tool_choice": "none",
        "metadata": {"k": "v"},
        "no_such_field": 1,
    }
    body = {**CHAT, **{k: v for k, v in same.items() if k != "best_of"}}
    assert httpx.post(tiny_server.url + "/v1/chat/completions", json=body).status_code == 200
    body = {**COMPLETION, "best_of": 1, "no_such_field": 1, "use_beam_search": False}
    assert httpx.post(tiny_server.url + "/v1/completions", json=body).status_code == 200
