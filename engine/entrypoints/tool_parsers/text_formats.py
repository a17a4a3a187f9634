"""The formats whose calls are not JSON: pythonic (``[f(x=1), g()]``, Python literals) and
qwen3_xml (``<function=f><parameter=x>...``); each call's arguments are sent as the JSON of the
values the model wrote."""

from __future__ import annotations

import ast
import json
import re

from engine.entrypoints.tool_parsers.base import ToolParser, closed_end


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
            return calls if partial and (calls or not final) else None
        end = _paren_end(text, call.end() - 1)
        if end is None:  # cut: the whole calls before it (none: the text is content)
            return (calls or None) if final else calls
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
    return closed_end(text, i, "\"'", "([{", ")]}")


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
        if final and end is None:  # cut before </function>: its arguments stay open
            self.buf, self.in_call, self.args = "", False, None
            return []
        if end is not None and (close >= 0 or final):  # the call ends
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
