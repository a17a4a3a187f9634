"""Tools in chat: what ``tools`` and ``tool_choice`` ask for, the JSON schema that enforces it,
and the model's text back into OpenAI's ``tool_calls``.

tool_choice  how the output is made                 how it is read back
"none"       free text                              content only
"auto"       free text                              the model's own format (``tool_parsers``:
                                                    hermes, qwen3_xml, llama3_json, mistral,
                                                    pythonic); the rest is content
"required"   a JSON array of one or more            one call per item
             {"name", "parameters"} (vLLM's shape,
             ``required_schema``)
named        the function's parameters schema       one call, the text its arguments

``ToolMode`` holds the choice; the server turns its ``schema`` into a structured-output
constraint and hands each choice's text to ``ToolMode.parse`` (or, streamed, a ``ToolStream``).
"""

from __future__ import annotations

import copy
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.entrypoints.tool_parsers import make_parser, whole_json

NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
CHOICES = "'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None  # the schema is enforced either way when the call is forced


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    arguments: str | dict[str, Any] = "{}"  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """A call in an assistant turn of the conversation a client sends back."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction

    def for_template(self) -> dict:
        """As transformers' templates read it: arguments as an object when they are JSON."""
        args = self.function.arguments
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass  # not JSON: the template gets the text
        fn = {"name": self.function.name, "arguments": args}
        return {"id": self.id, "type": "function", "function": fn}


@dataclass
class ToolMode:
    """The request's tool_choice, resolved: ``kind`` is none, auto, named or required."""

    kind: str
    name: str | None = None  # the named function
    schema: dict | None = None  # the output's JSON schema (named, required)
    parallel: bool = True  # auto: more than one call may be returned
    names: list[str] = field(default_factory=list)  # every tool's name
    parser: str = "hermes"  # auto: the model's tool-call format (tool_parsers.PARSERS)
    schemas: dict = field(default_factory=dict)  # each tool's parameters schema, by name

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of one choice's whole text: what a ``ToolStream`` sends for
        it in one piece, gathered (no calls: the text as content)."""
        content, deltas = ToolStream(self).delta(text, final=True)
        calls: dict[int, dict] = {}
        for d in deltas:
            if d["index"] not in calls:
                calls[d["index"]] = {k: v for k, v in d.items() if k != "index"}
                calls[d["index"]]["function"] = dict(d["function"])
            else:
                calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
        if not calls:
            return text, []
        return (content or "").strip() or None, [calls[i] for i in sorted(calls)]


def tool_mode(
    tools: list[Tool] | None, choice, parallel: bool = True, parser: str = "hermes"
) -> ToolMode:
    """The ToolMode of tools and tool_choice (unset: auto with tools, none without); a
    ValueError naming the field for a choice that is not one of CHOICES or names no tool.
    ``parser``: the format auto reads calls in."""
    if tools is not None and not tools:
        raise ValueError("tools must not be empty (leave it out for no tools)")
    names = [t.function.name for t in tools or []]
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ValueError(f"tool_choice must be {CHOICES}, got {json.dumps(choice)[:80]}")
        if name not in names:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
        tool = tools[names.index(name)]
        schema = tool.function.parameters or NO_PARAMETERS
        return ToolMode("named", name, schema, names=names)
    if choice not in ("none", "auto", "required"):
        raise ValueError(f"tool_choice must be {CHOICES}, got {choice!r}")
    if choice != "none" and not tools:
        raise ValueError(f"tool_choice {choice!r} needs tools")
    if choice == "required":
        return ToolMode("required", schema=required_schema(tools, parallel), names=names)
    schemas = {t.function.name: t.function.parameters or {} for t in tools or []}
    return ToolMode(choice, parallel=parallel, names=names, parser=parser, schemas=schemas)


def function_tool(name: str, description: str | None, parameters: dict | None) -> dict:
    """A chat request's function tool, from another API's tool (Responses, Messages)."""
    fn = {"name": name, "description": description, "parameters": parameters}
    return {"type": "function", "function": fn}


def new_call(name: str, arguments: str) -> dict:
    """One entry of OpenAI's ``message.tool_calls``."""
    call_id = f"call_{uuid.uuid4().hex[:24]}"
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# ---- tool_choice "required": an array of calls ----


def required_schema(tools: list[Tool], parallel: bool = True) -> dict:
    """A JSON array of one or more {"name": a tool's name, "parameters": its arguments}; one
    at most without parallel calls. Each tool's ``$defs`` / ``definitions`` move to the root
    under ``tool<i>_<name>`` (their ``$ref``s rewritten), where the array's refs can reach
    them."""
    defs, variants = {}, []
    for i, tool in enumerate(tools):
        params, own = _hoist_defs(tool.function.parameters or NO_PARAMETERS, f"tool{i}_")
        defs.update(own)
        variants.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": params,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _hoist_defs(schema: dict, prefix: str) -> tuple[dict, dict]:
    """(schema without its definitions, {prefix + name: definition}), every local $ref in
    both pointing at the new names ("#" itself: at the schema, kept as a definition)."""
    schema = copy.deepcopy(schema)
    own = {}
    for key in ("$defs", "definitions"):
        for name, sub in (schema.pop(key, None) or {}).items():
            own[prefix + name] = sub
    root = prefix + "root"

    def fix(node):
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str):
                node["$ref"] = _moved_ref(ref, prefix, root)
            for v in node.values():
                fix(v)
        elif isinstance(node, list):
            for v in node:
                fix(v)

    fix(schema)
    fix(own)
    if _refers_to_root(schema, root) or _refers_to_root(own, root):
        own[root] = schema
        schema = {"$ref": f"#/$defs/{root}"}
    return schema, own


def _moved_ref(ref: str, prefix: str, root: str) -> str:
    for old in ("#/$defs/", "#/definitions/"):
        if ref.startswith(old):
            return "#/$defs/" + prefix + ref[len(old) :]
    if ref == "#" or ref.startswith("#/"):
        return f"#/$defs/{root}" + ref[1:]
    return ref


def _refers_to_root(node, root: str) -> bool:
    return f'"#/$defs/{root}' in json.dumps(node)


def parse_required(text: str) -> list[dict] | None:
    """The calls of a "required" output: every complete item of its array, also when the output
    was cut before the array closed (max_tokens); None when not even one item is complete."""
    items = complete_items(text)
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = json.dumps(item.get("parameters", {}), ensure_ascii=False)
        calls.append(new_call(item["name"], args))
    return calls or None


def complete_items(text: str) -> list:
    """The items of a JSON array that are whole in ``text``, which may stop anywhere after
    them: ``[1, {"a": 2}, {"b"`` -> [1, {"a": 2}]; [] for text that is no array."""
    decoder, items = json.JSONDecoder(), []
    i = _skip_space(text, 0)
    if not text.startswith("[", i):
        return items
    i = _skip_space(text, i + 1)
    while i < len(text) and text[i] != "]":
        try:
            item, i = decoder.raw_decode(text, i)
        except ValueError:  # cut inside this item
            break
        items.append(item)
        i = _skip_space(text, i)
        if text.startswith(",", i):
            i = _skip_space(text, i + 1)
    return items


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


class ToolStream:
    """One streamed choice's text turned into deltas: content as it becomes final; a call once
    its arguments are whole JSON (auto: each call in the model's format, read by tool_parsers;
    named: the whole output; required: the array's complete items once it ends), in one delta
    with its id and name, and whatever the model adds to those arguments afterwards (spaces).

    A call is held back until its arguments close because a sent delta cannot be taken back: a
    call cut by max_tokens is never sent, streamed or not. A cut call after whole ones is
    dropped; a cut call with none before it leaves the whole answer as content, as ``ToolMode
    .parse`` returns it (that is this class run over the whole text)."""

    def __init__(self, mode: ToolMode):
        self.mode = mode
        self.parser = make_parser(mode.parser, mode.schemas)
        self.text = ""  # the answer so far
        self.sent = ""  # the content sent so far
        self.pending = ""  # auto: whitespace-only content held until more comes
        self.calls = 0  # calls sent so far
        self.held: dict[int, dict] = {}  # auto: the parser's call index -> the call not yet sent
        self.index: dict[int, int] = {}  # auto: the parser's call index -> the index sent
        self.call_id = new_call("", "")["id"]  # named: the one call's id

    def delta(self, text: str, final: bool) -> tuple[str | None, list[dict]]:
        """(content delta or None, tool call deltas) for the text new in this chunk."""
        self.text += text
        kind = self.mode.kind
        if kind == "named":
            return self._named(text, final)
        if kind == "required":
            if not final:
                return None, []
            calls = parse_required(self.text)
            return (self.text, []) if calls is None else (None, self._indexed(calls))
        if kind == "auto":
            content, deltas = self.parser.feed(text, final)
            out = [d for d in (self._release(d) for d in deltas) if d is not None]
            if final and not self.calls:  # no whole call: the answer is content, all of it
                return self._rest(), out
            return self._content(content, final), out
        return self._sending(text), []

    def _named(self, text: str, final: bool) -> tuple[str | None, list[dict]]:
        if self.calls:
            return None, [{"index": 0, "function": {"arguments": text}}] if text else []
        if whole_json(self.text):
            self.calls = 1
            fn = {"name": self.mode.name, "arguments": self.text}
            return None, [{"index": 0, "id": self.call_id, "type": "function", "function": fn}]
        return (self._rest() if final else None), []

    def _release(self, d: dict) -> dict | None:
        """The delta to send for the parser's delta ``d``: a sent call's arguments as they come;
        a new call's deltas gathered until its arguments are whole JSON, then sent as one."""
        i = d["index"]
        if i in self.index:
            return {**d, "index": self.index[i]}
        for j in [j for j in self.held if j < i]:  # the parser left it unfinished: dropped
            del self.held[j]
        if i in self.held:
            self.held[i]["function"]["arguments"] += d["function"].get("arguments", "")
        else:
            self.held[i] = {**d, "function": dict(d["function"])}
        call = self.held[i]
        if not whole_json(call["function"]["arguments"]):
            return None
        if self.calls and not self.mode.parallel:
            del self.held[i]
            return None
        del self.held[i]
        self.index[i] = self.calls
        self.calls += 1
        return {**call, "index": self.index[i]}

    def _indexed(self, calls: list[dict]) -> list[dict]:
        out = []
        for call in calls:
            out.append({"index": self.calls, **call})
            self.calls += 1
        return out

    def _content(self, content: str, final: bool) -> str | None:
        """Content to send now: whitespace alone waits (it may only sit between calls)."""
        content = self.pending + content
        if content.strip():
            self.pending = ""
            return self._sending(content)
        self.pending = "" if final else content
        return None

    def _rest(self) -> str | None:
        """The answer not yet sent as content (it began with what was sent)."""
        rest = self.text[len(self.sent) :] if self.text.startswith(self.sent) else ""
        self.pending = ""
        return self._sending(rest) if rest or not self.sent else None

    def _sending(self, content: str) -> str:
        self.sent += content
        return content
