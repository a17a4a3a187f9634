"""The formats whose calls are JSON objects ``{"name", "arguments" | "parameters"}``: hermes,
llama3_json and mistral. The name is sent once the object's head is read, the arguments' text as
the model writes it."""

from __future__ import annotations

import json
import re

from engine.entrypoints.tool_parsers.base import ToolParser, json_value_end, tag_prefix

CALL_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)


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
