"""The model's own tool-call formats, read back from its text as it is generated (tool_choice
"auto"): ``--tool-call-parser NAME`` (vLLM's names), or the one the chat template writes.

    hermes       <tool_call>{"name": "f", "arguments": {...}}</tool_call>   (Qwen2.5, Hermes)
    qwen3_xml    <tool_call><function=f><parameter=x>1</parameter></function></tool_call>
                                                                           (Qwen3-Coder)
    llama3_json  {"name": "f", "parameters": {...}}, several joined by ";", the whole output,
                 after an optional <|python_tag|>                          (Llama 3.1 / 3.2)
    mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...], or
                 [TOOL_CALLS]f[ARGS]{...} (newer tokenizers)               (Mistral)
    pythonic     [f(x=1, y="a"), g()], the whole output                   (Llama 3.2 / 4 pythonic)

A parser is fed the text as it comes (``feed(text, final)``) and returns the content that is
final (text that may still begin a call is held back) and OpenAI's streaming deltas of the
calls: ``{"index", "id", "type", "function": {"name", "arguments": ""}}`` once a call's name is
known, then ``{"index", "function": {"arguments": piece}}`` as its arguments are generated (the
JSON formats: the model's own argument text, piece by piece; qwen3_xml: each parameter as it
closes, as JSON; pythonic: a whole call at its closing parenthesis). The pieces of a call
concatenate to its arguments, and ``parse`` (the whole text at once) gives the same calls. Text
that does not parse as a call is content; nothing here raises on a model's output.
"""

from __future__ import annotations

import ast
import json
import re
import uuid

PARSERS = ("hermes", "qwen3_xml", "llama3_json", "mistral", "pythonic")
# a chat template's marks -> the parser of its format (the first that the template writes)
TEMPLATE_MARKS = (
    ("<function=", "qwen3_xml"),
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"),
)
CALL_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)


def parser_for_template(template: str | None) -> str:
    """The tool-call format a chat template writes (hermes when it shows none)."""
    for mark, name in TEMPLATE_MARKS:
        if template and mark in template:
            return name
    return "hermes"


def make_parser(name: str, schemas: dict[str, dict] | None = None) -> ToolParser:
    """A fresh parser; ``schemas``: each tool's parameters schema (qwen3_xml types its
    parameters' text by them)."""
    kinds = {
        "hermes": HermesParser, "qwen3_xml": Qwen3XmlParser, "llama3_json": Llama3JsonParser,
        "mistral": MistralParser, "pythonic": PythonicParser,
    }  # fmt: skip
    if name not in kinds:
        raise ValueError(f"tool call parser must be one of {', '.join(PARSERS)}, got {name!r}")
    return kinds[name](schemas or {})


def json_value_end(text: str, start: int) -> int | None:
    """The end of the JSON value that starts at ``start`` (after whitespace), or None when the
    text stops inside it. Strings and escapes are followed; the value is not checked."""
    i = start
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    if i >= len(text):
        return None
    if text[i] not in '{["':  # a number, true, false, null: up to a delimiter
        m = re.compile(r"[^\s,}\]]+").match(text, i)
        end = m.end() if m else i
        return end if end < len(text) else None
    return _closed_end(text, i, '"', "{[", "}]")


def _closed_end(text: str, i: int, quotes: str, opens: str, closes: str) -> int | None:
    """The index after what starts at ``i`` closes: a quoted string (any of ``quotes``,
    escapes followed) or a bracket of ``opens``, brackets counted outside strings; None when
    the text stops first."""
    depth, quote, escaped = 0, None, False
    for j in range(i, len(text)):
        c = text[j]
        if quote:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == quote:
                quote = None
                if depth == 0:
                    return j + 1
        elif c in quotes:
            quote = c
        elif c in opens:
            depth += 1
        elif c in closes:
            depth -= 1
            if depth == 0:
                return j + 1
    return None


class ToolParser:
    """The shared bookkeeping: each call's index, id and the argument text sent so far."""

    def __init__(self, schemas: dict[str, dict]):
        self.schemas = schemas
        self.buf = ""  # text not yet turned into content or calls
        self.calls: list[dict] = []  # per call: {"id", "name", "sent"} (arguments sent)

    def parse(self, text: str) -> tuple[str, list[dict]]:
        """(content, calls) of a whole output: OpenAI's ``message.tool_calls``."""
        content, deltas = self.feed(text, final=True)
        calls: dict[int, dict] = {}
        for d in deltas:
            fn = d["function"]
            call = calls.setdefault(
                d["index"], {"id": d.get("id"), "type": "function",
                             "function": {"name": fn.get("name"), "arguments": ""}},
            )  # fmt: skip
            call["function"]["arguments"] += fn.get("arguments", "")
        out = [calls[i] for i in sorted(calls)]
        if not out:  # no call: the text as it is (a format's mark without calls included)
            return text, []
        for call in out:  # a call cut short or malformed: the whole output is text
            try:
                json.loads(call["function"]["arguments"])
            except ValueError:
                return text, []
        return content, out

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        raise NotImplementedError

    def _blocks(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """``feed`` for formats whose calls open with ``self.OPEN``: the text before a call is
        content; at the tag ``_opened()``, then ``_inside(final)`` -> (content, deltas, more)
        until it says more text is needed (or closes the call: ``in_call`` False again)."""
        self.buf += text
        content, deltas = [], []
        while True:
            if not self.in_call:
                text, self.in_call = self._text_until(self.OPEN, final)
                content.append(text)
                if not self.in_call:
                    break
                self._opened()
                continue
            text, out, more = self._inside(final)
            content.append(text)
            deltas += out
            if not more:
                break
        return "".join(content), deltas

    def _text_until(self, tag: str, final: bool) -> tuple[str, bool]:
        """The text before ``tag`` and True (both consumed); without the tag, the text that
        cannot begin it (a possible start held back unless ``final``) and False."""
        i = self.buf.find(tag)
        if i < 0:
            cut = len(self.buf) - (0 if final else tag_prefix(self.buf, tag))
            text, self.buf = self.buf[:cut], self.buf[cut:]
            return text, False
        text, self.buf = self.buf[:i], self.buf[i + len(tag) :]
        return text, True

    def _start(self, name: str) -> dict:
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        self.calls.append({"id": call_id, "name": name, "sent": ""})
        fn = {"name": name, "arguments": ""}
        return {"index": len(self.calls) - 1, "id": call_id, "type": "function", "function": fn}

    def _args(self, text: str) -> list[dict]:
        """The delta that brings the last call's sent arguments to ``text`` (a longer text)."""
        call = self.calls[-1]
        piece = text[len(call["sent"]) :]
        if not piece:
            return []
        call["sent"] = text
        return [{"index": len(self.calls) - 1, "function": {"arguments": piece}}]


class _JsonCalls(ToolParser):
    """Calls written as JSON objects {"name", "arguments" | "parameters"}: the name once the
    head is read, the arguments' text as it comes."""

    def __init__(self, schemas):
        super().__init__(schemas)
        self.key = None  # which object the state below is about (its place in the text)
        self.started = False  # that object's call was started (its name sent)

    def _object(self, body: str, final: bool, key) -> tuple[list[dict], int | None, bool]:
        """Deltas of the call object in ``body`` (its text so far; ``key``: where it starts,
        the same on every call for one object), the end of the object when complete, and
        whether it is a call at all (False: leave it as text)."""
        if key != self.key:
            self.key, self.started = key, False
        head = CALL_HEAD.match(body)
        if head is None:  # another key order, or not yet the whole head
            end = json_value_end(body, 0)
            if end is None or self.started:
                return [], end, True
            call = _json_call(body[:end])
            if call is None:
                return [], end, False
            self.started = True
            return [self._start(call[0])] + self._args(call[1]), end, True
        out = []
        if not self.started:
            out.append(self._start(json.loads(f'"{head.group(1)}"')))
            self.started = True
        args_end = json_value_end(body, head.end())
        if args_end is None:
            return out + self._args(body[head.end() :].lstrip()), None, True
        out += self._args(body[head.end() : args_end].lstrip())
        close = re.compile(r"\s*\}").match(body, args_end)
        if close is None:
            return out, None if not final else args_end, True
        return out, close.end(), True


def _json_call(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a call object's text, or None."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def tag_prefix(text: str, tag: str) -> int:
    """The length of the longest end of text that begins tag (text to hold back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class HermesParser(_JsonCalls):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, schemas):
        super().__init__(schemas)
        self.in_call = False
        self.blocks = 0  # <tool_call> blocks opened

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        return self._blocks(text, final)

    def _opened(self) -> None:
        self.blocks += 1

    def _inside(self, final: bool) -> tuple[str, list[dict], bool]:
        j = self.buf.find(self.CLOSE)
        body = self.buf if j < 0 else self.buf[:j]
        if j < 0 and not final:  # the block goes on: stream what is known of it
            hold = tag_prefix(body, self.CLOSE)
            out, _, _ = self._object(body[: len(body) - hold], False, self.blocks)
            return "", out, False
        self.buf = "" if j < 0 else self.buf[j + len(self.CLOSE) :]
        self.in_call = False
        out, end, is_call = self._object(body, True, self.blocks)
        ok = is_call and end is not None and not body[end:].strip()
        if ok or self.started:  # a call (one whose name was sent stays one)
            return "", out, j >= 0
        return self.OPEN + body + ("" if j < 0 else self.CLOSE), [], j >= 0


class Llama3JsonParser(_JsonCalls):
    """The whole output is calls when it starts (after whitespace and <|python_tag|>) with
    ``{``; they are joined by ``;``. Anything else is content."""

    TAG = "<|python_tag|>"

    def __init__(self, schemas):
        super().__init__(schemas)
        self.mode: str | None = None  # None: undecided; "calls" or "content"
        self.pos = 0  # where the next call object starts in buf

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        self.buf += text
        if self.mode is None:
            lead = self.buf.lstrip()
            if lead.startswith(self.TAG):
                lead = lead[len(self.TAG) :].lstrip()
            if lead.startswith("{"):
                self.mode, self.pos = "calls", len(self.buf) - len(lead)
            elif lead and not self.TAG.startswith(lead) or final:
                self.mode = "content"
            else:
                return "", []
        if self.mode == "content":
            out, self.buf = self.buf, ""
            return out, []
        deltas = []
        while True:
            self.pos = re.compile(r"[\s;]*").match(self.buf, self.pos).end()
            if self.pos >= len(self.buf):
                break
            out, end, is_call = self._object(self.buf[self.pos :], final, self.pos)
            deltas += out
            if end is None or not is_call:
                break
            self.pos += end
        if final and not self.calls:  # no call in it after all
            out, self.buf = self.buf, ""
            return out, []
        return "", deltas


class MistralParser(_JsonCalls):
    """Content up to ``[TOOL_CALLS]``, then a JSON array of call objects, or ``name[ARGS]{...}``
    calls one after another."""

    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def __init__(self, schemas):
        super().__init__(schemas)
        self.in_calls = False
        self.pos = 0  # where the next item starts in buf (after the tag)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        self.buf += text
        content = ""
        if not self.in_calls:
            content, self.in_calls = self._text_until(self.TAG, final)
            if not self.in_calls:
                return content, []
        deltas = []
        while True:
            rest = self.buf[self.pos :]
            lead = rest.lstrip(" \t\r\n,[")
            if not lead or lead.startswith("]"):
                break
            skip = len(rest) - len(lead)
            if lead.startswith("{"):  # an array item
                out, end, is_call = self._object(lead, final, self.pos + skip)
                deltas += out
                if end is None or not is_call:
                    break
                self.pos += skip + end
                continue
            k = lead.find(self.ARGS)  # name[ARGS]{...}
            if k < 0:
                break
            if self.key != self.pos + skip or not self.started:
                self.key, self.started = self.pos + skip, True
                deltas.append(self._start(lead[:k].strip()))
            start = k + len(self.ARGS)
            end = json_value_end(lead, start)
            deltas += self._args(lead[start : end or len(lead)].lstrip())
            if end is None:
                break
            self.pos += skip + end
        return content, deltas


class PythonicParser(ToolParser):
    """The whole output is ``[f(a=1), g(b="x")]`` (Python literals as the arguments); each call
    is sent whole when its closing parenthesis comes. Anything else is content."""

    def __init__(self, schemas):
        super().__init__(schemas)
        self.mode: str | None = None
        self.done = 0  # calls sent

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        self.buf += text
        lead = self.buf.lstrip()
        if self.mode is None:
            if re.match(r"\[\s*([A-Za-z_]|$)", lead) and not (final and len(lead) == 1):
                self.mode = "calls"
            elif lead and (len(lead) > 1 or final):
                self.mode = "content"
            else:
                return "", []
        if self.mode == "content":
            out, self.buf = self.buf, ""
            return out, []
        calls = _pythonic_calls(lead, final)
        if calls is None:  # not calls after all: the text, at the end
            if final:
                out, self.buf = self.buf, ""
                return out, []
            return "", []
        deltas = []
        for name, args in calls[self.done :]:
            deltas += [self._start(name)] + self._args(args)
        self.done = len(calls)
        return "", deltas


def _pythonic_calls(text: str, final: bool) -> list[tuple[str, str]] | None:
    """The complete calls at the start of ``[f(...), g(...)...``; None for text that is not a
    list of calls with literal keyword arguments."""
    calls, i, n = [], 1, len(text)
    while i < n:
        m = re.compile(r"\s*,?\s*").match(text, i)
        i = m.end()
        if i >= n or text[i] == "]":
            break
        call = re.compile(r"([A-Za-z_][\w.]*)\(").match(text, i)
        if call is None:  # a name still being written: wait for it
            partial = re.fullmatch(r"[A-Za-z_][\w.]*", text[i:]) is not None
            return calls if partial and not final else None
        end = _paren_end(text, call.end() - 1)
        if end is None:
            return None if final else calls
        try:
            node = ast.parse(text[i:end], mode="eval").body
            if not isinstance(node, ast.Call) or node.args:
                return None
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        except (SyntaxError, ValueError):
            return None
        calls.append((call.group(1), json.dumps(args, ensure_ascii=False)))
        i = end
    return calls


def _paren_end(text: str, i: int) -> int | None:
    """The index after the parenthesis that closes the one at ``i`` (quotes followed)."""
    return _closed_end(text, i, "\"'", "([{", ")]}")


class Qwen3XmlParser(ToolParser):
    """``<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>``:
    the name at ``<function=``, each parameter as JSON when it closes (its text typed by the
    tool's schema: a string parameter's text as it is, others parsed as JSON when they can be),
    ``}`` at ``</function>``."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    FUNCTION = re.compile(r"\s*<function=([^>\s]+)>")
    PARAMETER = re.compile(r"\s*<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.S)
    END = re.compile(r"\s*</function>\s*")

    def __init__(self, schemas):
        super().__init__(schemas)
        self.in_call = False
        self.pos = 0  # inside a call: where the next piece starts in buf
        self.args: dict | None = None  # the open call's parameters so far
        self.spill = ""  # a block that held no call: content

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        return self._blocks(text, final)

    def _opened(self) -> None:
        self.pos = 0

    def _inside(self, final: bool) -> tuple[str, list[dict], bool]:
        step = self._step(final)
        spill, self.spill = self.spill, ""
        return spill, step or [], step is not None

    def _step(self, final: bool) -> list[dict] | None:
        """The next piece of the open call, or None when more text is needed."""
        if self.args is None:
            m = self.FUNCTION.match(self.buf, self.pos)
            if m is None:
                return self._give_up(final)
            self.args, self.pos = {}, m.end()
            return [self._start(m.group(1))]
        m = self.PARAMETER.match(self.buf, self.pos)
        if m is not None:
            key, raw = m.group(1), m.group(2)
            self.args[key] = value = self._typed(key, raw)
            sep = "{" if len(self.args) == 1 else ", "
            self.pos = m.end()
            piece = f"{sep}{json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}"
            return self._args(self.calls[-1]["sent"] + piece)
        end = self.END.match(self.buf, self.pos)
        close = self.buf.find(self.CLOSE, self.pos)
        if (end is not None and close >= 0) or final:  # the call ends (at the latest, here)
            tail = self._args(self.calls[-1]["sent"] + ("}" if self.args else "{}"))
            after = close + len(self.CLOSE) if close >= 0 else len(self.buf)
            self.buf, self.in_call, self.args = self.buf[after:], False, None
            return tail
        return None

    def _give_up(self, final: bool) -> list[dict] | None:
        """No <function= after <tool_call>: at the end, the block is content."""
        if final:
            self.spill = self.OPEN + self.buf
            self.buf, self.in_call = "", False
        return None

    def _typed(self, key: str, raw: str):
        """A parameter's text as its schema types it."""
        schema = self.schemas.get(self.calls[-1]["name"], {}) if self.calls else {}
        kind = (schema.get("properties", {}).get(key) or {}).get("type")
        if kind == "string":
            return raw
        try:
            return json.loads(raw)
        except ValueError:
            return raw
