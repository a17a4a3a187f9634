"""What every tool-call format shares: ``ToolParser``'s bookkeeping of each call's index, id
and the argument text sent so far, and the scanning helpers (where a JSON value or a bracket
closes, whether text is whole JSON, how much of a text's end may begin a tag)."""

from __future__ import annotations

import json
import re
import uuid


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
    return closed_end(text, i, '"', "{[", "}]")


def closed_end(text: str, i: int, quotes: str, opens: str, closes: str) -> int | None:
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
        out = [calls[i] for i in sorted(calls) if whole_json(calls[i]["function"]["arguments"])]
        if not out:  # no whole call: the text as it is (a format's mark, a cut call included)
            return text, []
        return content, out  # a call cut short or malformed after whole ones: dropped

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


def whole_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def tag_prefix(text: str, tag: str) -> int:
    """The length of the longest end of text that begins tag (text to hold back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
