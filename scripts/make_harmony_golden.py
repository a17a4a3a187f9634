"""Golden data for the harmony format (gpt-oss's chat format) from OpenAI's own library.

Renders OpenAI-style conversations to prompt text and parses model completions with
``openai-harmony`` (the oracle), writing tests/data/harmony/{render,parse}.json; the tests
(tests/test_harmony*.py) check engine/frontend/harmony.py and engine/entrypoints/harmony_parser.py
against them without the library. The conversations are mapped onto harmony's messages the
way vLLM maps chat completions for gpt-oss: the system prompt (and developer messages) become
the developer message's instructions, the tools its ``functions`` namespace, an assistant turn's
``reasoning_content`` an analysis message, its content a final message, each tool call a
commentary message to ``functions.NAME`` (content type json), a tool result a message from
``functions.NAME`` (named by the call it answers) on the commentary channel.

How to run (development only; the library is not a dependency of the project):

    python3 -m venv /tmp/harmony-venv
    /tmp/harmony-venv/bin/pip install openai-harmony==0.0.8
    # the o200k_base vocabulary, which the library would download (blocked here), rebuilt
    # from the npm package js-tiktoken: its dist/ranks/o200k_base.js holds lines
    # "! <rank> <tok> <tok>..." (base64 tokens, ranks counting up from <rank>), written here
    # in the .tiktoken format ("<base64 token> <rank>" per line; the library checks its
    # sha256, 446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d)
    (cd /tmp && npm pack js-tiktoken && tar xzf js-tiktoken-*.tgz)
    /tmp/harmony-venv/bin/python scripts/make_harmony_golden.py \
        --vocab-from /tmp/package/dist/ranks/o200k_base.js /tmp/harm/vocab
    TIKTOKEN_ENCODINGS_BASE=/tmp/harm/vocab /tmp/harmony-venv/bin/python \
        scripts/make_harmony_golden.py
"""

from __future__ import annotations

import json
import pathlib
import sys

from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    HarmonyEncodingName,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
    load_harmony_encoding,
)

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "harmony"
DATE = "2026-12-07"
EFFORTS = {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM,
           "high": ReasoningEffort.HIGH}  # fmt: skip

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Gets the current weather in the provided location.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "The city and state, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"],
                         "default": "celsius"},
                "days": {"type": "integer", "description": "How many days"},
            },
            "required": ["location"],
        },
    },
}  # fmt: skip
SEARCH = {
    "type": "function",
    "function": {
        "name": "search_docs",
        "description": "Search the documentation.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "tags": {"type": "array", "items": {"type": "string"},
                         "description": "Tags to filter by"},
                "limit": {"type": "number"},
                "exact": {"type": "boolean", "default": False},
                "filter": {"type": "object", "properties": {"lang": {"type": "string"}}},
                "mode": {"type": ["string", "null"]},
                "kind": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
            },
            "required": ["query", "limit"],
        },
    },
}  # fmt: skip
RICH = {
    "type": "function",
    "function": {
        "name": "book",
        "description": "Book a table.\nTwo lines of description.",
        "parameters": {
            "type": "object",
            "description": "The booking.",
            "properties": {
                "when": {"type": "string", "title": "Time", "examples": ["18:00", "19:30"]},
                "people": {"type": "integer", "default": 2, "nullable": True},
                "seat": {"description": "Where to sit", "default": "inside",
                         "oneOf": [{"type": "string", "enum": ["inside", "terrace"],
                                    "description": "A place"},
                                   {"type": "null", "description": "No preference"}]},
                "notes": {"type": "array", "items": {"type": "object",
                          "properties": {"text": {"type": "string"}}}},
                "extra": {},
            },
            "required": ["when"],
        },
    },
}  # fmt: skip
NOW = {"type": "function", "function": {"name": "get_time", "description": "The time now."}}
NO_DESC = {
    "type": "function",
    "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}},
}

CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'}}  # fmt: skip

CONVERSATIONS = [
    {"name": "plain", "messages": [{"role": "user", "content": "What is 2 + 2?"}]},
    {"name": "system", "messages": [
        {"role": "system", "content": "You are a terse assistant.\nAnswer in French."},
        {"role": "user", "content": "Hello!"}]},
    {"name": "low", "reasoning_effort": "low",
     "messages": [{"role": "user", "content": "Hi"}]},
    {"name": "high", "reasoning_effort": "high",
     "messages": [{"role": "user", "content": "Prove it."}]},
    {"name": "tools", "tools": [WEATHER, SEARCH, RICH, NOW, NO_DESC],
     "messages": [{"role": "user", "content": "Weather in Paris?"}]},
    {"name": "system_tools", "tools": [WEATHER], "reasoning_effort": "low", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"}]},
    {"name": "tool_result", "tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "I should call the tool.",
         "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]},
    {"name": "drop_analysis", "messages": [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Simple sum."},
        {"role": "user", "content": "And 3 + 3?"}]},
    {"name": "developer", "messages": [
        {"role": "developer", "content": "Use metric units."},
        {"role": "user", "content": "How far is it?"},
        {"role": "assistant", "content": "About 5 km."},
        {"role": "user", "content": "Thanks"}]},
]  # fmt: skip

COMPLETIONS = [
    ("analysis_final", "<|channel|>analysis<|message|>The user asks 2+2. Easy.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>"),
    ("analysis_call", "<|channel|>analysis<|message|>Need the weather tool.<|end|>"
     "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
     '<|message|>{"location": "Paris", "unit": "celsius"}<|call|>'),
    ("recipient_first", ' to=functions.get_weather<|channel|>commentary json<|message|>'
     '{"location":"Tokyo"}<|call|>'),
    ("final_only", "<|channel|>final<|message|>Bonjour ! Comment puis-je aider ?<|return|>"),
    ("preamble_call", "<|channel|>analysis<|message|>Check docs.<|end|>"
     "<|start|>assistant<|channel|>commentary<|message|>Let me look that up.<|end|>"
     "<|start|>assistant<|channel|>commentary to=functions.search_docs <|constrain|>json"
     '<|message|>{"query": "paged attention", "limit": 3}<|call|>'),
]  # fmt: skip


def harmony_messages(messages: list[dict]) -> list[Message]:
    """The chat messages as harmony's (after the system and developer messages)."""
    names, out = {}, []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "user":
            out.append(Message.from_role_and_content(Role.USER, content))
        elif role == "assistant":
            if m.get("reasoning_content"):
                msg = Message.from_role_and_content(Role.ASSISTANT, m["reasoning_content"])
                out.append(msg.with_channel("analysis"))
            if content:
                out.append(Message.from_role_and_content(Role.ASSISTANT, content)
                           .with_channel("final"))  # fmt: skip
            for call in m.get("tool_calls") or []:
                fn = call["function"]
                names[call["id"]] = fn["name"]
                msg = Message.from_role_and_content(Role.ASSISTANT, fn["arguments"])
                out.append(msg.with_channel("commentary")
                           .with_recipient(f"functions.{fn['name']}")
                           .with_content_type("json"))  # fmt: skip
        elif role == "tool":
            author = Author.new(Role.TOOL, f"functions.{names[m['tool_call_id']]}")
            msg = Message.from_author_and_content(author, content)
            out.append(msg.with_recipient("assistant").with_channel("commentary"))
    return out


def render(enc, conv: dict) -> str:
    effort = EFFORTS[conv.get("reasoning_effort", "medium")]
    system = SystemContent.new().with_reasoning_effort(effort)
    system = system.with_conversation_start_date(DATE)
    msgs = [Message.from_role_and_content(Role.SYSTEM, system)]
    instructions = "\n\n".join(
        m["content"] for m in conv["messages"] if m["role"] in ("system", "developer")
    )
    tools = conv.get("tools")
    if instructions or tools:
        dev = DeveloperContent.new()
        if instructions:
            dev = dev.with_instructions(instructions)
        if tools:
            dev = dev.with_function_tools([
                ToolDescription.new(t["function"]["name"], t["function"].get("description", ""),
                                    parameters=t["function"].get("parameters"))
                for t in tools
            ])  # fmt: skip
        msgs.append(Message.from_role_and_content(Role.DEVELOPER, dev))
    rest = [m for m in conv["messages"] if m["role"] not in ("system", "developer")]
    msgs += harmony_messages(rest)
    ids = enc.render_conversation_for_completion(Conversation.from_messages(msgs), Role.ASSISTANT)
    return enc.decode(ids)


def parsed(enc, text: str) -> list[dict]:
    ids = enc.encode(text, allowed_special="all")
    out = []
    for m in enc.parse_messages_from_completion_tokens(ids, Role.ASSISTANT):
        out.append({
            "role": m.author.role.value, "channel": m.channel, "recipient": m.recipient,
            "content_type": m.content_type, "content": "".join(c.text for c in m.content),
        })  # fmt: skip
    return out


def write_vocab(js_path: str, out_dir: str) -> None:
    """js-tiktoken's o200k_base ranks as ``out_dir``/o200k_base.tiktoken."""
    text = pathlib.Path(js_path).read_text()
    ranks = json.loads(text[text.index("{") : text.rindex("}") + 1])["bpe_ranks"]
    lines = []
    for row in filter(None, ranks.split("\n")):
        _, first, *tokens = row.split(" ")
        lines += [f"{tok} {int(first) + i}" for i, tok in enumerate(tokens)]
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "o200k_base.tiktoken").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'o200k_base.tiktoken'} ({len(lines)} tokens)")


def main() -> None:
    if sys.argv[1:2] == ["--vocab-from"]:
        write_vocab(sys.argv[2], sys.argv[3])
        return
    enc = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    OUT.mkdir(parents=True, exist_ok=True)
    renders = [{**c, "date": DATE, "text": render(enc, c)} for c in CONVERSATIONS]
    parses = [{"name": n, "text": t, "messages": parsed(enc, t)} for n, t in COMPLETIONS]
    stops = {
        "stop_tokens": sorted(enc.decode([t]) for t in enc.stop_tokens_for_assistant_actions())
    }
    for name, data in (("render", renders), ("parse", parses), ("stops", stops)):
        path = OUT / f"{name}.json"
        path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
