"""The ``openai`` format (vLLM's name): harmony tool calls, as ``HarmonySplit`` leaves them in
a gpt-oss output's answer (engine/entrypoints/harmony_parser.py): text is content, and each
message ``<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>
{arguments}<|call|>`` is a call of NAME (a recipient without ``functions.``: that name), its
content the arguments' text as it comes (after whole JSON arguments, only spaces)."""

from __future__ import annotations

from engine.entrypoints.harmony_parser import HarmonyReader
from engine.entrypoints.tool_parsers.base import ToolParser, json_value_end


class HarmonyToolParser(ToolParser):
    def __init__(self, schemas):
        super().__init__(schemas)
        self.reader = HarmonyReader(in_header=False)
        self.args: str | None = None  # the open call's content so far (None: no call open)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        content, deltas = [], []
        for kind, value in self.reader.feed(text, final):
            if kind == "header":
                if value.recipient:
                    name = value.recipient.removeprefix("functions.")
                    deltas.append(self._start(name))
                    self.args = ""
            elif kind == "content" and self.args is not None:
                self.args += value
                deltas += self._args(_value(self.args))
            elif kind == "end":
                self.args = None
            elif kind in ("text", "content"):
                content.append(value)
        return "".join(content), deltas


def _value(text: str) -> str:
    """The arguments in a call's content: its first JSON value and the spaces after it (text
    after those, a cut ``<|call|>`` say, is not part of them); all of it while the value is
    not closed."""
    end = json_value_end(text, 0)
    if end is None:
        return text
    rest = text[end:]
    return text[:end] + rest[: len(rest) - len(rest.lstrip())]
