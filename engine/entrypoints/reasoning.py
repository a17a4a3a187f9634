"""Reasoning models' thinking, split from their answer: ``--reasoning-parser qwen3|deepseek_r1``
(vLLM's names). The thinking goes to ``reasoning_content`` (chat completions), a ``reasoning``
item (Responses) or a ``thinking`` block (Messages); the answer is the content, where tool calls
are read.

    qwen3        <think>...</think> at the start of the output, then the answer; an output with
                 no </think> is all answer (thinking switched off: the template already closed
                 an empty <think></think> in the prompt, chat_template_kwargs enable_thinking
                 false)
    deepseek_r1  the output starts inside the thinking (the template's generation prompt opened
                 <think>), a <think> the model writes anyway is dropped; the thinking ends at
                 </think>; an output with no </think> is all thinking

``ReasoningSplit.feed(text, final)`` takes the text as it comes and returns (thinking, answer)
pieces that are final: text that may still be the start of </think> is held back, so a tag split
across tokens is found. ``split`` is the whole text at once. The structured-output grammar of a
request (a schema, a forced tool call) applies to the answer only: ``REASONING_END`` is where it
starts (engine/core/structured/matcher.py ``AfterReasoning``).
"""

from __future__ import annotations

from engine.entrypoints.tool_parsers import tag_prefix

PARSERS = ("qwen3", "deepseek_r1")
START, END = "<think>", "</think>"
REASONING_END = END


def check_parser(name: str) -> str:
    if name not in PARSERS:
        raise ValueError(f"reasoning parser must be one of {', '.join(PARSERS)}, got {name!r}")
    return name


def prompt_state(prompt_text: str) -> tuple[bool, bool]:
    """(opened, closed) of a rendered prompt's end: its last <think> not closed (the template
    opened the thinking: the output starts in it), or a </think> after its last <think> (the
    template closed it, chat_template_kwargs enable_thinking false: no thinking to come)."""
    start, end = prompt_text.rfind(START), prompt_text.rfind(END)
    return start > end, end > start


class ReasoningSplit:
    """One output's thinking and answer, as its text comes."""

    def __init__(self, parser: str, opened: bool = False):
        """``opened``: the prompt ends inside an open <think> (its template opened it), so the
        output starts thinking, whatever the parser."""
        check_parser(parser)
        self.buf = ""
        # qwen3 decides at its first text (<think> or not); deepseek_r1 is thinking already,
        # a <think> it writes itself dropped
        thinking = parser == "deepseek_r1" or opened
        self.state = "think_start" if thinking else "start"
        self.thought = thinking  # whether the output has a thinking part

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(thinking, answer) of a whole output; None for a part that is not there."""
        thinking, answer = self.feed(text, final=True)
        return (thinking if self.thought else None), answer or None

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(thinking piece, answer piece) now final."""
        self.buf += text
        thinking = answer = ""
        while self.buf or final:
            lead = self.buf.lstrip()
            if self.state in ("start", "think_start"):
                if lead.startswith(START):
                    self.buf, self.state, self.thought = lead[len(START) :], "thinking", True
                    continue
                if not final and (not lead or START.startswith(lead)):
                    break  # maybe the start of <think>
                self.state = "answer" if self.state == "start" else "thinking"
                continue
            if self.state == "thinking":
                i = self.buf.find(END)
                if i < 0:
                    keep = 0 if final else tag_prefix(self.buf, END)
                    thinking += self.buf[: len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep :]
                    break
                thinking += self.buf[:i]
                self.buf, self.state = self.buf[i + len(END) :], "answer_start"
                continue
            if self.state == "answer_start":  # the newlines after </think> are not the answer
                self.buf = self.buf.lstrip("\n")
                if not self.buf:
                    break
                self.state = "answer"
            answer += self.buf
            self.buf = ""
            break
        return thinking, answer
