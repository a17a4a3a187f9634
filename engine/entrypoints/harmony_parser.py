"""A harmony model's output (gpt-oss) read back as it is generated: its messages, its thinking
(``--reasoning-parser openai_gptoss``) and the grammar bounds of a constrained request.

The output continues a prompt that ends ``<|start|>assistant`` (engine/frontend/harmony.py), so
it starts inside the first message's header. Each message is
``{header}<|message|>{content}`` ended by ``<|end|>``, ``<|call|>`` or ``<|return|>`` (the last
two end the generation: the model's EOS ids), the next one opened by ``<|start|>assistant``.
A header holds ``<|channel|>NAME``, maybe ``to=RECIPIENT`` (before or after the channel) and a
content type (``json``, ``<|constrain|>json``), read as openai-harmony reads them.

``HarmonyReader`` turns text, fed in pieces, into events: text outside any message, a header,
content pieces, a message's end; text that may still begin a harmony token is held back.
``HarmonySplit`` (the reasoning parser) sends the analysis channel's content as the thinking and
everything else as the answer: final and commentary content as plain text, a message to a
recipient (a tool call) as the harmony message it is, which the ``openai`` tool-call parser
(engine/entrypoints/tool_parsers/harmony.py) turns into OpenAI tool calls. The special tokens
must be in the decoded text: the server decodes a harmony model's output keeping them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
STOPS = (END, CALL, RETURN)
ROLES = ("system", "developer", "user", "assistant", "tool")
PARSER = "openai_gptoss"  # the reasoning parser's name (vLLM's)
# where a constrained answer starts: the final channel's content, or a named call's arguments
FINAL_START = r"<\|channel\|>final(?:\s[^<]*)?(?:<\|constrain\|>[^<]*)?<\|message\|>"
_NOT_END = r"(?:(?!<\|message\|>|<\|end\|>|<\|start\|>)[\s\S])*"


def call_start(name: str) -> str:
    """The pattern of a header that calls function ``name``, to its ``<|message|>``."""
    return rf"to=functions\.{re.escape(name)}(?=[\s<]){_NOT_END}<\|message\|>"


def grammar_end(tool_name: str | None) -> str:
    """The pattern whose first match in the output starts the constrained part: a forced
    call's arguments (``tool_name``), else the final channel's content."""
    return FINAL_START if tool_name is None else call_start(tool_name)


@dataclass
class Header:
    role: str
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None

    def text(self) -> str:
        """The header as harmony writes it after ``<|start|>``."""
        out = self.role + (f"{CHANNEL}{self.channel}" if self.channel else "")
        out += f" to={self.recipient}" if self.recipient else ""
        return out + (f" {self.content_type}" if self.content_type else "")


def parse_header(text: str, role: str | None) -> Header:
    """A header's text (between ``<|start|>`` and ``<|message|>``) as openai-harmony reads it;
    ``role``: known beforehand (the prompt wrote it), else the header's first word."""
    channel = None
    i = text.find(CHANNEL)
    if i >= 0:
        after = text[i + len(CHANNEL) :]
        value = re.match(r"[^\s<]*", after).group()
        channel = value or None
        text = text[:i] + after[len(value) :]
    text = text.strip().replace(CONSTRAIN, " " + CONSTRAIN).strip()
    parts = text.split()
    if role is None:
        role = parts.pop(0) if parts and parts[0] in ROLES else "assistant"
    elif parts and parts[0] == role:
        parts.pop(0)
    recipient = content_type = None
    if parts:
        last = parts.pop()
        if last.startswith("to="):
            recipient = last[3:]
        elif not parts:
            recipient = last
        else:
            content_type, other = last, parts.pop()
            recipient = other[3:] if other.startswith("to=") else other
    return Header(role, channel, recipient, content_type)


def _held(text: str, tags) -> int:
    """How much of text's end may begin one of tags (held back until more text comes); every
    harmony token begins with ``<``, so only an end from a ``<`` on can."""
    first = max(len(text) - max(len(t) for t in tags) + 1, 0)
    i = text.rfind("<", first)
    while i >= 0:
        if any(t.startswith(text[i:]) for t in tags):
            return len(text) - i
        i = text.rfind("<", first, i)
    return 0


class HarmonyReader:
    """Harmony messages in a text fed in pieces. ``in_header``: the text starts inside the
    first message's header (a model's output after ``<|start|>assistant``), whose role is the
    assistant; else it starts outside any message."""

    def __init__(self, in_header: bool):
        self.state = "header" if in_header else "outside"
        self.role = "assistant" if in_header else None  # the next header's known role
        self.buf = ""
        self.looked = 0  # in a header: where <|message|> may start (a long header: no rescan)

    def feed(self, text: str, final: bool = False) -> list[tuple[str, object]]:
        """Events: ("text", str) outside messages, ("header", Header), ("content", str),
        ("end", the token that ended it, or None at the end of the text)."""
        self.buf += text
        out: list[tuple[str, object]] = []
        while self.buf or (final and self.state == "content"):
            if self.state == "outside":
                if not self._outside(out, final):
                    break
            elif self.state == "header":
                i = self.buf.find(MESSAGE, self.looked)
                if i < 0:
                    self.looked = max(len(self.buf) - len(MESSAGE) + 1, 0)  # not before here
                    if final:  # a header cut short: no message
                        self.buf = ""
                    break
                out.append(("header", parse_header(self.buf[:i], self.role)))
                self.buf, self.state, self.role = self.buf[i + len(MESSAGE) :], "content", None
                self.looked = 0
            elif not self._content(out, final):
                break
        return out

    def _outside(self, out: list, final: bool) -> bool:
        i = self.buf.find(START)
        if i < 0:
            keep = 0 if final else _held(self.buf, (START,))
            _add(out, "text", self.buf[: len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep :]
            return False
        _add(out, "text", self.buf[:i])
        self.buf, self.state = self.buf[i + len(START) :], "header"
        return True

    def _content(self, out: list, final: bool) -> bool:
        found = [(i, stop) for stop in STOPS if (i := self.buf.find(stop)) >= 0]
        if not found:
            keep = 0 if final else _held(self.buf, STOPS)
            _add(out, "content", self.buf[: len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep :]
            if final:
                out.append(("end", None))
                self.state = "outside"
            return False
        i, stop = min(found)
        _add(out, "content", self.buf[:i])
        out.append(("end", stop))
        self.buf, self.state = self.buf[i + len(stop) :], "outside"
        return True


def _add(out: list, kind: str, text: str) -> None:
    if text:
        out.append((kind, text))


def parse_messages(text: str) -> list[dict]:
    """A whole output's messages: {role, channel, recipient, content_type, content}."""
    messages: list[dict] = []
    for kind, value in HarmonyReader(in_header=True).feed(text, final=True):
        if kind == "header":
            messages.append({**value.__dict__, "content": ""})
        elif kind == "content":
            messages[-1]["content"] += value
    return messages


class HarmonySplit:
    """One output's thinking (its analysis messages' content) and answer (the rest: final and
    commentary content as text, each message to a recipient as a harmony message ending in
    ``<|call|>``), as its text comes. The ``ReasoningSplit`` face: ``feed``, ``split``,
    ``thought``."""

    def __init__(self, parser: str = PARSER, opened: bool = False):
        self.reader = HarmonyReader(in_header=True)
        self.kind: str | None = None  # the open message's: analysis, call or content
        self.thought = False  # whether the output has an analysis message

    def split(self, text: str) -> tuple[str | None, str | None]:
        thinking, answer = self.feed(text, final=True)
        return (thinking if self.thought else None), answer or None

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(thinking piece, answer piece) now final."""
        thinking, answer = [], []
        for kind, value in self.reader.feed(text, final):
            if kind == "header":
                self.kind = self._open(value, answer)
            elif kind == "content":
                (thinking if self.kind == "analysis" else answer).append(value)
            elif kind == "end":
                if self.kind == "call":
                    answer.append(CALL)
                self.kind = None
            else:  # text outside any message (a model that broke the format): the answer's
                answer.append(value)
        return "".join(thinking), "".join(answer)

    def _open(self, header: Header, answer: list) -> str:
        if header.channel == "analysis" and header.recipient is None:
            self.thought = True
            return "analysis"
        if header.recipient is not None and header.recipient != "assistant":
            answer.append(f"{START}{header.text()}{MESSAGE}")
            return "call"
        return "content"
