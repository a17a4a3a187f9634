"""The tool-call parsers (engine/entrypoints/tool_parsers/) on hand-written outputs of each
format: the calls and the content of the whole text; the same, streamed in random pieces, with
each call's id and name in its first delta and arguments that concatenate to the whole text's
(the JSON formats' arguments before their call ends); malformed and cut outputs as content,
never an exception; and the format a chat template writes. What a client receives
(``ToolStream``): every prefix of an output, as max_tokens could cut it, streamed and whole,
the same content and calls, each call sent whole. Through the server: the format chosen by
--tool-call-parser read back from a constrained generation, streamed and not, and cut."""

from __future__ import annotations

import json
import random

import pytest

from engine.entrypoints.tool_calls import Tool, ToolMode, ToolStream, tool_mode
from engine.entrypoints.tool_parsers import PARSERS, make_parser, parser_for_template, whole_json
from engine.tools.live_server import MODEL, LiveServer

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "days": {"type": "integer"}}}  # fmt: skip
SCHEMAS = {"get_weather": WEATHER}
ARGS = {"city": "Paris, FR", "days": 3}
NESTED = {"q": 'a "quoted" } ] string', "n": [1, {"b": None}], "t": True}
A, N = json.dumps(ARGS), json.dumps(NESTED)
# parser: (text, content, [(name, arguments)])
CASES = {
    "hermes": (
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": ' + A + "}\n</tool_call>\n"
        '<tool_call>{"arguments": ' + N + ', "name": "f"}</tool_call> done',
        "Sure.\n\n done", [("get_weather", ARGS), ("f", NESTED)],
    ),
    "qwen3_xml": (
        "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis, FR\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=f>\n</function>\n</tool_call>",
        "Let me check.\n\n", [("get_weather", ARGS), ("f", {})],
    ),
    "llama3_json": (
        '<|python_tag|>{"name": "get_weather", "parameters": ' + A + '}; {"name": "f", '
        '"parameters": ' + N + "}",
        "", [("get_weather", ARGS), ("f", NESTED)],
    ),
    "mistral": (
        'Ok [TOOL_CALLS][{"name": "get_weather", "arguments": ' + A + '}, {"name": "f", '
        '"arguments": ' + N + "}]",
        "Ok ", [("get_weather", ARGS), ("f", NESTED)],
    ),
    "pythonic": (
        '[get_weather(city="Paris, FR", days=3), f(q=\'a "quoted" } ] string\', '
        "n=[1, {'b': None}], t=True)]",
        "", [("get_weather", ARGS), ("f", NESTED)],
    ),
    "openai": (  # harmony, as the openai_gptoss reasoning parser leaves it in the answer
        "Checking.<|start|>assistant<|channel|>commentary to=functions.get_weather "
        "<|constrain|>json<|message|>" + A + "<|call|><|start|>assistant<|channel|>commentary "
        "to=functions.f json<|message|>" + N + "<|call|>",
        "Checking.", [("get_weather", ARGS), ("f", NESTED)],
    ),
}  # fmt: skip
MISTRAL_ARGS = ("Ok [TOOL_CALLS]get_weather[ARGS]" + A + " f[ARGS]{}", "Ok ",
                [("get_weather", ARGS), ("f", {})])  # fmt: skip


def streamed(name: str, text: str, rng: random.Random):
    """(content, calls as [(id, name, arguments)], deltas) of text fed in random pieces."""
    p = make_parser(name, SCHEMAS)
    content, deltas, i = "", [], 0
    while i < len(text):
        j = min(len(text), i + rng.randint(1, 7))
        c, d = p.feed(text[i:j], final=j == len(text))
        content, deltas, i = content + c, deltas + d, j
    calls: dict[int, list] = {}
    for d in deltas:
        fn = d["function"]
        if d["index"] not in calls:
            assert d.get("id", "").startswith("call_") and fn["name"], d  # the first delta
            calls[d["index"]] = [d["id"], fn["name"], ""]
        else:
            assert "id" not in d and "name" not in fn, d  # only arguments later
        calls[d["index"]][2] += fn.get("arguments", "")
    return content, [tuple(calls[i]) for i in sorted(calls)], deltas


@pytest.mark.parametrize("name", [*CASES, "mistral_args"])
def test_each_format_whole_and_streamed(name):
    parser = "mistral" if name == "mistral_args" else name
    text, want_content, want = MISTRAL_ARGS if name == "mistral_args" else CASES[name]
    content, calls = make_parser(parser, SCHEMAS).parse(text)
    assert content == want_content
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    assert got == want
    rng = random.Random()
    for _ in range(5):
        s_content, s_calls, deltas = streamed(parser, text, rng)
        assert s_content == want_content
        assert [(n, json.loads(a)) for _, n, a in s_calls] == want
        assert len({i for i, _, _ in s_calls}) == len(s_calls)  # an id per call
        if parser not in ("pythonic", "qwen3_xml"):  # JSON arguments come as they are written
            pieces = [d for d in deltas if d["index"] == 0 and d["function"].get("arguments")]
            assert len(pieces) > 1, pieces


@pytest.mark.parametrize("name", PARSERS)
def test_cut_and_malformed_outputs_are_content_never_errors(name):
    """Every prefix of a good output, and garbage: parse never raises; what is not whole calls
    comes back as the text."""
    text = CASES[name][0]
    rng = random.Random()
    for n in range(0, len(text), 3):
        content, calls = make_parser(name, SCHEMAS).parse(text[:n])
        for c in calls:
            json.loads(c["function"]["arguments"])  # a call returned is a whole call
        if not calls:
            assert content == text[:n]
        streamed(name, text[:n], rng)  # nor does streaming raise
    for junk in ["<tool_call>{]</tool_call>", "[f(", "[TOOL_CALLS][{", "{}", "[1, 2]", "]["]:
        content, calls = make_parser(name, SCHEMAS).parse(junk)
        assert (content, calls) == (junk, [])


def test_the_template_names_its_format():
    assert parser_for_template("{{ '<tool_call>' }}{{ tool_call | tojson }}") == "hermes"
    assert parser_for_template("<tool_call>\n<function={{ name }}>") == "qwen3_xml"
    assert parser_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_for_template("{{- '<|python_tag|>' }}") == "llama3_json"
    assert parser_for_template(None) == parser_for_template("{{ messages }}") == "hermes"
    with pytest.raises(ValueError, match="tool call parser must be one of hermes"):
        make_parser("nope")


F = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
SHORT = {  # one call each, short enough for the tiny model's 512 positions beside the tools
    "pythonic": '[get_weather(city="Paris")]',
    "qwen3_xml": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "</function>\n</tool_call>",
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "openai": "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>"
    'json<|message|>{"city": "Paris"}<|call|>',
}


@pytest.mark.parametrize("name", PARSERS)
def test_the_server_reads_the_chosen_format(tiny, name):
    """--tool-call-parser: the tiny model made to write the format's calls (a choice
    constraint) returns them as tool_calls, streamed and not, the same; cut by max_tokens
    inside the call, no call in either mode, the text as content."""
    text = SHORT[name]
    with LiveServer(tiny, max_model_len=512, num_gpu_blocks=64, tool_parser=name) as s:
        client = s.openai_client()
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=[F],
                  max_tokens=150, temperature=0, extra_body={"guided_choice": [text]})  # fmt: skip
        r = client.chat.completions.create(**kw)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls"
        got = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls]
        assert got == [("get_weather", {"city": "Paris"})] and msg.content is None
        calls: dict[int, list] = {}
        for chunk in client.chat.completions.create(**kw, stream=True):
            for d in chunk.choices[0].delta.tool_calls or []:
                call = calls.setdefault(d.index, [d.function.name, ""])
                call[1] += d.function.arguments or ""
        assert [(n, json.loads(a)) for n, a in calls.values()] == got
        cut = {**kw, "max_tokens": r.usage.completion_tokens // 2}
        r = client.chat.completions.create(**cut)
        assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls
        content, calls, ending = "", [], None
        for chunk in client.chat.completions.create(**cut, stream=True):
            content += chunk.choices[0].delta.content or ""
            calls += chunk.choices[0].delta.tool_calls or []
            ending = chunk.choices[0].finish_reason or ending
        assert (content, calls, ending) == (r.choices[0].message.content, [], "length")
        assert text.startswith(content) and len(content) < len(text)


def _mode(kind: str, parser: str = "hermes") -> ToolMode:
    tools = [Tool.model_validate(F), Tool.model_validate(G)]
    choice = {"named": {"type": "function", "function": {"name": "f"}}}.get(kind, kind)
    return tool_mode(tools, choice, parser=parser)


def _stream(mode: ToolMode, text: str, rng: random.Random) -> tuple[str | None, list]:
    """What a client gathers from ``ToolStream`` fed ``text`` in random pieces: the content
    (None when none was sent) and [(id, name, arguments)], checking each call's first delta
    is whole JSON (a call is sent only once its arguments close)."""
    stream, content, calls, i, j = ToolStream(mode), None, {}, 0, -1
    while j < len(text):
        j = min(len(text), i + rng.randint(1, 7))
        c, deltas = stream.delta(text[i:j], final=j == len(text))
        if c is not None:
            content = (content or "") + c
        for d in deltas:
            fn = d["function"]
            if d["index"] not in calls:
                assert d["id"].startswith("call_") and whole_json(fn["arguments"]), d
                calls[d["index"]] = [d["id"], fn["name"], ""]
            calls[d["index"]][2] += fn["arguments"]
        i = j
    return content, [tuple(calls[k]) for k in sorted(calls)]


G = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
REQUIRED = (
    '[{"name": "get_weather", "parameters": ' + A + '}, {"name": "f", "parameters": ' + N + "}]"
)


@pytest.mark.parametrize("kind", [*PARSERS, "named", "required"])
def test_a_cut_call_is_never_sent_and_streaming_agrees(kind):
    """Every prefix of an output with two calls (what max_tokens leaves), streamed in random
    pieces and whole: the same content and calls; a call is sent only whole; a cut call after
    whole ones is dropped; with none before it the whole answer is content."""
    mode = _mode("auto", kind) if kind in PARSERS else _mode(kind)
    text = {"named": N, "required": REQUIRED}.get(kind) or CASES[kind][0]
    rng = random.Random()
    for n in range(len(text) + 1):
        content, calls = mode.parse(text[:n])
        s_content, s_calls = _stream(mode, text[:n], rng)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            (name, args) for _, name, args in s_calls
        ], text[:n]
        if not calls:
            assert content == s_content == text[:n], text[:n]
        else:
            assert (content or "").strip() == (s_content or "").strip()
            assert all(whole_json(a) for _, _, a in s_calls)
    whole_calls = mode.parse(text)[1]
    assert len(whole_calls) == (1 if kind == "named" else 2)
