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
    openai       <|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json
                 <|message|>{...}<|call|>, in the answer that the harmony reasoning parser
                 (openai_gptoss) leaves                                    (gpt-oss)

A parser is fed the text as it comes (``feed(text, final)``) and returns the content that is
final (text that may still begin a call is held back) and OpenAI's streaming deltas of the
calls: ``{"index", "id", "type", "function": {"name", "arguments": ""}}`` once a call's name is
known, then ``{"index", "function": {"arguments": piece}}`` as its arguments are generated (the
JSON formats: the model's own argument text, piece by piece; qwen3_xml: each parameter as it
closes, as JSON; pythonic: a whole call at its closing parenthesis). The pieces of a call
concatenate to its arguments, and ``parse`` (the whole text at once) gives the same calls. Text
that does not parse as a call is content; a call whose arguments never close (cut by max_tokens)
is dropped, and the text is content when no call is whole; nothing here raises on a model's
output. What the client sees is ``tool_calls.ToolStream``'s: each call once its arguments are
whole.

The shared bookkeeping is in ``base``, the JSON formats in ``json_formats``, pythonic and
qwen3_xml in ``text_formats``.
"""

from __future__ import annotations

from engine.entrypoints.tool_parsers.base import ToolParser, json_value_end, tag_prefix, whole_json
from engine.entrypoints.tool_parsers.harmony import HarmonyToolParser
from engine.entrypoints.tool_parsers.json_formats import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
)
from engine.entrypoints.tool_parsers.text_formats import PythonicParser, Qwen3XmlParser

__all__ = ["PARSERS", "ToolParser", "json_value_end", "make_parser", "parser_for_template",
           "tag_prefix", "whole_json"]  # fmt: skip

PARSERS = ("hermes", "qwen3_xml", "llama3_json", "mistral", "pythonic", "openai")
# a chat template's marks -> the parser of its format (the first that the template writes)
TEMPLATE_MARKS = (
    ("<function=", "qwen3_xml"),
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"),
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
        "mistral": MistralParser, "pythonic": PythonicParser, "openai": HarmonyToolParser,
    }  # fmt: skip
    if name not in kinds:
        raise ValueError(f"tool call parser must be one of {', '.join(PARSERS)}, got {name!r}")
    return kinds[name](schemas or {})
