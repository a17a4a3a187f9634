"""Reasoning models' thinking, split from their answer: ``--reasoning-parser qwen3|deepseek_r1``
(vLLM's names; both read ``<think>...</think>``), or ``openai_gptoss`` (harmony's analysis
channel: engine/entrypoints/harmony_parser.py; ``make_split`` picks the splitter). The
thinking goes to ``reasoning_content`` (chat completions), a ``reasoning`` item (Responses) or a
``thinking`` block (Messages); the answer is the content, where tool calls are read.

A thinking section exists only where the prompt or the output opens one:
    - the rendered prompt ends inside an open <think> (the template opened it, as DeepSeek-R1's
      and thinking Qwen3 templates do): the output starts in the thinking, a <think> the model
      writes anyway is dropped, and it ends at </think> (an output with none is all thinking);
    - else the output's first text decides: <think> opens the thinking, anything else makes
      the whole output the answer (a model that never thinks, or a template that closed an
      empty <think></think> in the prompt: chat_template_kwargs enable_thinking false).

``ReasoningSplit.feed(text, final)`` takes the text as it comes and returns (thinking, answer)
pieces that are final: text that may still be the start of <think> or </think> is held back, so
a tag split across tokens is found. ``split`` is the whole text at once. The structured-output
grammar of a request (a schema, a forced tool call) applies to the answer only, and decides
where it starts from the same state (``grammar_bounds``; engine/core/structured/matcher.py
``AfterReasoning``): from the first token when nothing opens a thinking section.
"""

from __future__ import annotations

from engine.entrypoints.harmony_parser import PARSER as HARMONY
from engine.entrypoints.harmony_parser import HarmonySplit
from engine.entrypoints.tool_parsers import tag_prefix

PARSERS = ("qwen3", "deepseek_r1", HARMONY)
START, END = "<think>", "</think>"


def grammar_bounds(opened: bool, closed: bool) -> tuple[str | None, str] | None:
    """(reasoning_start, reasoning_end) for a constrained request's grammar
    (StructuredOutputsParams) after a prompt whose end is ``prompt_state``'s (opened, closed):
    None when the prompt closed the thinking (the grammar starts at token 0), (None, </think>)
    when it left it open (the grammar starts after </think>), else (<think>, </think>): the
    output's first tokens decide, as ``ReasoningSplit`` does."""
    if closed:
        return None
    return (None, END) if opened else (START, END)


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


def make_split(parser: str, opened: bool = False):
    """A fresh splitter of one output: ``HarmonySplit`` for openai_gptoss, else
    ``ReasoningSplit``."""
    return HarmonySplit() if parser == HARMONY else ReasoningSplit(parser, opened)


class ReasoningSplit:
    """One output's thinking and answer, as its text comes."""

    def __init__(self, parser: str, opened: bool = False):
        """``opened``: the prompt ends inside an open <think> (its template opened it), so the
        output starts thinking, whatever the parser."""
        check_parser(parser)
        self.buf = ""
        # an output the prompt left thinking drops a <think> it writes itself; any other decides
        # at its first text (<think> or not)
        self.state = "think_start" if opened else "start"
        self.thought = opened  # whether the output has a thinking part

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
