"""OpenAI's harmony format (gpt-oss's chat format): a chat conversation rendered as the prompt,
in place of a Jinja chat template, for models whose family is ``gpt_oss`` (``uses_harmony``).

A harmony prompt is a run of messages ``<|start|>{author}<|channel|>{channel}<|message|>
{content}<|end|>`` ending in ``<|start|>assistant`` (the model writes the rest; its output is
read by engine/entrypoints/harmony_parser.py). The OpenAI-style messages map onto it as vLLM
maps them for gpt-oss:

    system message   always: the model identity, knowledge cutoff, current date,
                     ``Reasoning: low|medium|high`` (``reasoning_effort``, medium unset), the
                     valid channels, and with tools the line that sends calls to commentary
    developer        the request's system and developer messages as ``# Instructions``, the
                     tools as a TypeScript-like ``namespace functions`` (only when there are
                     either)
    user             ``<|start|>user<|message|>...<|end|>``
    assistant        ``reasoning_content`` on the analysis channel, content on final, each
                     tool call ``<|start|>assistant to=functions.NAME<|channel|>commentary
                     json<|message|>{arguments}<|call|>``; analysis before the first final
                     message is dropped when the last assistant message is a final one
    tool             ``<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>
                     ...<|end|>``, NAME from the call its ``tool_call_id`` answers (or ``name``)

``render`` gives the text (as ``openai-harmony`` renders it: tests/data/harmony/render.json is
that library's output); ``prompt_ids`` its token ids, the harmony tokens as control tokens and
every text from the request (content, names, tool schemas) as plain text, so a special token
typed in a message stays text.
"""

from __future__ import annotations

import datetime
import json

from engine.frontend.chat import check_messages

EFFORTS = ("low", "medium", "high")
REASONING_PARSER = "openai_gptoss"  # the output's reader (engine/entrypoints/harmony_parser.py)
STOP_TOKENS = ("<|return|>", "<|call|>")  # they end the generation
IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
CUTOFF = "2024-06"
CHANNELS = (
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
)
TOOLS_LINE = "Calls to these tools must go to the commentary channel: 'functions'."
START, CHANNEL, MESSAGE, END, CALL = (
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|call|>",
)


def uses_harmony(model_config) -> bool:
    """Whether the model speaks harmony: its family is gpt_oss (or, before that family is
    known to the loader, its Hugging Face ``model_type`` is)."""
    family = getattr(model_config, "family", None)
    return family == "gpt_oss" or getattr(model_config, "model_type", None) == "gpt_oss"


def check_effort(effort) -> str:
    """``reasoning_effort`` as harmony writes it (None: medium); ValueError for another."""
    if effort is None:
        return "medium"
    if effort not in EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {', '.join(EFFORTS)}, got {effort!r}")
    return effort


def today() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")


# a rendering is a list of pieces: str (text from the request or the format's words) or
# Special (a harmony token)
class Special(str):
    pass


def render(messages, tools=None, effort=None, date: str | None = None) -> str:
    """The conversation (and tools) as harmony prompt text, ready for the assistant's turn."""
    return "".join(pieces(messages, tools, effort, date))


def prompt_ids(tokenizer, messages, tools=None, effort=None, max_chars=None, date=None,
               max_chars_why="that max_model_len tokens can hold") -> list[int]:  # fmt: skip
    """The prompt token ids of the conversation (``tokenizer``: the engine's Tokenizer); a
    rendered text longer than ``max_chars`` is a ValueError before it is tokenized."""
    parts = pieces(messages, tools, effort, date)
    length = sum(len(p) for p in parts)
    if max_chars is not None and length > max_chars:
        raise ValueError(
            f"the rendered conversation has {length} characters, more than the "
            f"{max_chars} {max_chars_why}"
        )
    ids, text = [], ""
    for p in [*parts, Special("")]:
        if not isinstance(p, Special):
            text += p
            continue
        if text:
            ids += tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
            text = ""
        if p:
            token = tokenizer.token_to_id(p)
            if token is None:
                raise ValueError(f"harmony: the tokenizer has no {p} token")
            ids.append(token)
    return ids


def pieces(messages, tools=None, effort=None, date=None) -> list[str]:
    checked = check_messages(messages)
    for m, raw in zip(checked, messages, strict=True):
        if raw.get("reasoning_content") is not None:
            m["reasoning_content"] = raw["reasoning_content"]
    if tools is not None and not (isinstance(tools, list) and tools):
        raise ValueError("tools must be a non-empty list of tool definitions (dicts)")
    functions = [_function(t, i) for i, t in enumerate(tools or [])]
    out = _message("system", _system(check_effort(effort), date or today(), bool(functions)))
    instructions = [m["content"] for m in checked if m["role"] in ("system", "developer")]
    if instructions or functions:
        out += _message("developer", _developer("\n\n".join(instructions), functions))
    turns = _turns(
        [(i, m) for i, m in enumerate(checked) if m["role"] not in ("system", "developer")]
    )
    for author, header, content, end in _drop_analysis(turns):
        out += [Special(START), author, *header, Special(MESSAGE), content, Special(end)]
    return [*out, Special(START), "assistant"]


def _message(role: str, content: str) -> list[str]:
    return [Special(START), role, Special(MESSAGE), content, Special(END)]


def _system(effort: str, date: str, has_tools: bool) -> str:
    channels = f"{CHANNELS}\n{TOOLS_LINE}" if has_tools else CHANNELS
    top = f"{IDENTITY}\nKnowledge cutoff: {CUTOFF}\nCurrent date: {date}"
    return f"{top}\n\nReasoning: {effort}\n\n{channels}"


def _developer(instructions: str, functions: list[dict]) -> str:
    sections = ["# Instructions", instructions] if instructions else []
    if functions:
        lines = ["## functions\n", "namespace functions {\n"]
        for fn in functions:
            lines += [f"// {line}" for line in (fn.get("description") or "").splitlines()]
            params = fn.get("parameters")
            args = "" if params is None else f"_: {typescript(params, '')}"
            lines.append(f"type {fn['name']} = ({args}) => any;\n")
        lines.append("} // namespace functions")
        sections += ["# Tools", "\n".join(lines)]
    return "\n\n".join(sections)


def _function(tool, i: int) -> dict:
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"tools[{i}]: a function with a name is required")
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
        raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
    return fn


def _turns(messages: list[tuple[int, dict]]) -> list[tuple]:
    """(author, header pieces, content, end token) of each harmony message, from the
    (index, message) pairs of the conversation's other messages than system and developer."""
    names, out = {}, []
    for i, m in messages:
        role, content = m["role"], m["content"]
        if role == "user":
            out.append(("user", [], content, END))
        elif role == "assistant":
            if m.get("reasoning_content"):
                out.append(("assistant", _channel("analysis"), m["reasoning_content"], END))
            if content:
                out.append(("assistant", _channel("final"), content, END))
            for call in m.get("tool_calls") or []:
                name, args = _call(call)
                names[call.get("id")] = name
                header = [f" to=functions.{name}", *_channel("commentary"), " json"]
                out.append(("assistant", header, args, CALL))
        else:  # tool
            name = names.get(m.get("tool_call_id")) or m.get("name")
            if name is None:
                raise ValueError(
                    f"messages[{i}]: a tool result must answer a tool call of an earlier "
                    "assistant message (tool_call_id) or carry the function's name"
                )
            header = [" to=assistant", *_channel("commentary")]
            out.append((f"functions.{name}", header, content, END))
    return out


def _channel(name: str) -> list[str]:
    return [Special(CHANNEL), name]


def _call(call: dict) -> tuple[str, str]:
    fn = call.get("function", call)
    args = fn.get("arguments", "{}")
    return fn.get("name") or "", args if isinstance(args, str) else json.dumps(
        args, ensure_ascii=False
    )


def _drop_analysis(turns: list[tuple]) -> list[tuple]:
    """Without the analysis before the first final message, when the last assistant message
    is a final one (the thinking of answered turns is not shown again)."""
    channels = [_channel_of(t) for t in turns]
    last = next((c for t, c in zip(reversed(turns), reversed(channels), strict=True)
                 if t[0] == "assistant"), None)  # fmt: skip
    if last != "final":
        return turns
    first = channels.index("final")
    return [t for i, t in enumerate(turns) if not (i < first and channels[i] == "analysis")]


def _channel_of(turn: tuple) -> str | None:
    header = turn[1]
    return next((header[i + 1] for i, p in enumerate(header) if p == CHANNEL), None)


# ---- JSON schema -> the TypeScript-like types harmony shows the model ----


def typescript(schema, indent: str) -> str:
    """A JSON schema as harmony writes a tool's parameter type."""
    if not isinstance(schema, dict):
        return "any"
    if isinstance(schema.get("oneOf"), list):
        return "".join(f"\n{indent} | " + _variant(v, indent + "   ") for v in schema["oneOf"])
    kind = schema.get("type")
    if isinstance(kind, list):
        names = ["number" if t == "integer" else t for t in kind if isinstance(t, str)]
        if names:
            return " | ".join(names)
    if kind == "object":
        return _object(schema, indent)
    if kind == "string":
        enum = [f'"{v}"' for v in schema.get("enum") or [] if isinstance(v, str)]
        return " | ".join(enum) if enum else "string"
    if kind in ("number", "integer"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "array":
        items = schema.get("items")
        return f"{typescript(items, indent)}[]" if items is not None else "Array<any>"
    return "any"


def _variant(v, indent: str) -> str:
    text = typescript(v, indent)
    if isinstance(v, dict):
        if v.get("nullable") is True and "null" not in text:
            text += " | null"
        notes = [v["description"]] if isinstance(v.get("description"), str) else []
        notes += [_default(v)] if "default" in v else []
        if notes:
            text += " // " + " ".join(notes)
    return text


def _default(schema: dict) -> str:
    value = schema["default"]
    if isinstance(value, str):
        return f'default: "{value}"' if not schema.get("enum") else f"default: {value}"
    return f"default: {_json(value)}"


def _json(value) -> str:
    """A JSON value written as serde_json writes it (compact)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _object(schema: dict, indent: str) -> str:
    out = (
        f"{indent}// {schema['description']}\n"
        if isinstance(schema.get("description"), str)
        else ""
    )
    out += "{\n"
    props = schema.get("properties")
    required = {r for r in schema.get("required") or [] if isinstance(r, str)}
    for key, val in (props if isinstance(props, dict) else {}).items():
        val = val if isinstance(val, dict) else {}
        out += _comments(val, indent)
        mark = "" if key in required else "?"
        if isinstance(val.get("oneOf"), list):
            out += _one_of_property(key, mark, val, indent)
            continue
        text = typescript(val, indent + "    ")
        if val.get("nullable") is True and "null" not in text:
            text += " | null"
        out += f"{indent}{key}{mark}: {text},"
        out += f" // {_default(val)}" if "default" in val else ""
        out += "\n"
    return out + f"{indent}}}"


def _comments(val: dict, indent: str) -> str:
    out = ""
    if isinstance(val.get("title"), str):
        out += f"{indent}// {val['title']}\n{indent}//\n"
    if "oneOf" not in val and isinstance(val.get("description"), str):
        out += f"{indent}// {val['description']}\n"
    examples = [e for e in val.get("examples") or [] if isinstance(e, str)]
    if isinstance(val.get("examples"), list) and val["examples"]:
        out += f"{indent}// Examples:\n" + "".join(f'{indent}// - "{e}"\n' for e in examples)
    return out


def _one_of_property(key: str, mark: str, val: dict, indent: str) -> str:
    variants, desc = val["oneOf"], val.get("description")
    desc = desc if isinstance(desc, str) else None
    first = variants[0] if variants and isinstance(variants[0], dict) else {}
    above = desc is not None and first.get("description") != desc
    out = f"{indent}// {desc}\n" if above else ""
    if "default" in val:
        out += f"{indent}// {_default(val)}\n"
    out += f"{indent}{key}{mark}:\n"
    for i, v in enumerate(variants):
        v = v if isinstance(v, dict) else {}
        text = typescript(v, indent + "   ")
        if v.get("nullable") is True and "null" not in text:
            text += " | null"
        notes = []
        vdesc = v.get("description")
        if not (i == 0 and above) and isinstance(vdesc, str) and vdesc != desc:
            notes.append(vdesc)
        if "default" in v:
            notes.append(_default(v))
        out += f"{indent} | {text}" + (f" // {' '.join(notes)}" if notes else "") + "\n"
    return out + f"{indent},\n"
