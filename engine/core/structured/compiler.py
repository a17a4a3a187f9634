"""Constraints -> grammars -> matchers, over one ``llguidance.LLTokenizer`` built per engine.

``StructuredOutputCompiler`` turns the model's tokenizer into an ``LLTokenizer`` once (about half
a second for a 49k vocabulary). Per constraint it writes llguidance's grammar text (choice -> a
Lark alternation of string literals; json_object -> the schema ``{"type": "object"}``), checks it
by building an ``LLMatcher`` (a bad schema, regex or grammar is a one-line ValueError naming the
kind) and keeps that matcher, still at the grammar's start, in an LRU cache under
``params.key()``. A request's ``Matcher`` is a deep copy of it: microseconds, where building one
takes milliseconds. ``fill_bitmasks`` fills a batch's masks on llguidance's own threads.

The vocabulary is the model's (``vocab_size``: its lm_head may have padding rows past the
tokenizer); those extra ids exist for llguidance but no grammar ever allows them.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import llguidance
import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from engine.core.structured.bitmask import bitmask_width
from engine.core.structured.json_bounds import bound_numbers
from engine.core.structured.matcher import AfterReasoning, Matcher
from engine.structured_params import JSON_WHITESPACE, StructuredOutputsParams
from model_loader.tokenizer import Tokenizer

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept (each holds its lexer: ~KBs to a few MBs)


@dataclass(frozen=True)
class CompiledGrammar:
    """A checked grammar; ``template`` stays at the start and is only ever deep-copied."""

    kind: str  # which StructuredOutputsParams field it came from
    key: tuple  # params.key()
    grammar: str  # llguidance's grammar text (JSON)
    warnings: tuple[str, ...]  # what llguidance ignored or approximated, if anything
    template: llguidance.LLMatcher = field(compare=False, repr=False)


class StructuredOutputCompiler:
    """Compiles ``StructuredOutputsParams`` for one tokenizer; one per engine.

    Args:
        tokenizer: the model's ``model_loader.tokenizer.Tokenizer``.
        vocab_size: the model's vocabulary (logits width); at least the tokenizer's.
        eos_token_ids: the ids that end a request (default: the tokenizer's); a grammar allows
            them exactly when it can end.
        cache_size: compiled grammars kept, least recently used dropped first.
        num_threads: llguidance's threads for ``fill_bitmasks`` (None: its default, 80% of
            the CPUs up to 32).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
        cache_size: int = DEFAULT_CACHE_SIZE,
        num_threads: int | None = None,
    ):
        eos = list(tokenizer.eos_token_ids if eos_token_ids is None else eos_token_ids)
        if not eos:
            raise ValueError("structured output: the tokenizer has no EOS token id to end on")
        self.tokenizer_vocab_size = tokenizer.vocab_size  # ids from here on are never allowed
        self.vocab_size = max(vocab_size or 0, tokenizer.vocab_size)
        self.eos_token_ids = tuple(int(t) for t in eos)
        self.cache_size = cache_size
        self.ll_tokenizer = llguidance.LLTokenizer(
            _plain_json(tokenizer.backend), n_vocab=self.vocab_size, eos_token=list(eos)
        )
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()  # guards _cache: compile may run on worker threads
        self._num_threads = num_threads
        self._executor: llguidance.LLExecutor | None = None
        self._rows: dict[tuple, np.ndarray] = {}  # opening_row's and newline_row's
        self._texts: list[str] | None = None  # each token's text, for them

    # --- compile ----------------------------------------------------------------------------

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The checked grammar of params, from the cache when an equal constraint was seen."""
        key = params.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._build(params, key)  # outside the lock: llguidance drops the GIL here
        with self._lock:
            compiled = self._cache.setdefault(key, compiled)  # a racing thread's copy wins
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, params: StructuredOutputsParams) -> Matcher | AfterReasoning:
        """A fresh matcher for one request, at the start of params' grammar; with
        ``reasoning_end`` set, one that keeps the grammar for the answer after a reasoning
        model's thinking (``AfterReasoning``; with ``reasoning_start``, the output's first
        tokens decide whether there is any)."""
        template = self.compile(params).template
        inner = Matcher(template.deep_copy(), self.vocab_size, self.eos_token_ids)
        if params.reasoning_end is None:
            return inner
        start = params.reasoning_start
        opening = None if start is None else self.opening_row(start)
        end = params.reasoning_end
        if params.reasoning_end_regex:  # harmony: no newlines to skip after the header
            return AfterReasoning(inner, None, end, self.token_text, end_regex=True)
        return AfterReasoning(inner, start, end, self.token_text, opening, self.newline_row())

    def token_text(self, token: int) -> str:
        """One token's text as the output shows it."""
        return self.ll_tokenizer.decode_str([int(token)])

    def opening_row(self, tag: str) -> np.ndarray:
        """(W,) int32 packed mask of the tokens whose text (after leading whitespace) starts
        with the whole of ``tag``: what may open a reasoning model's thinking under a grammar.
        Reasoning models have their tag as one token (Qwen3's and DeepSeek-R1's ``<think>``); a
        tag spelled in pieces is not offered: a model that never thinks would be lured into it
        by a first piece such as ``<`` (SmolLM2 begins its tool calls with one)."""
        return self._row(("opening", tag), lambda text: text.lstrip().startswith(tag))

    def newline_row(self) -> np.ndarray:
        """(W,) int32 packed mask of the tokens that are newlines only."""
        return self._row(("newlines",), lambda text: text != "" and text.strip("\n") == "")

    def _row(self, key: tuple, keep) -> np.ndarray:
        """A packed mask of the tokens whose text ``keep`` takes, cached under ``key``."""
        row = self._rows.get(key)
        if row is None:
            if self._texts is None:  # every token's text, read once (tens of ms for 49k)
                self._texts = [self.token_text(t) for t in range(self.tokenizer_vocab_size)]
            allowed = np.zeros(bitmask_width(self.vocab_size) * 32, dtype=bool)  # (32W,)
            allowed[: len(self._texts)] = [keep(text) for text in self._texts]
            row = np.packbits(allowed, bitorder="little").view("<i4").astype(np.int32)
            self._rows[key] = row
        return row

    def _build(self, params: StructuredOutputsParams, key: tuple) -> CompiledGrammar:
        kind = params.kind
        try:
            text = grammar_text(params)
        except ValueError as e:
            raise ValueError(f"structured output {kind}: {one_line(str(e))}") from None
        template = llguidance.LLMatcher(self.ll_tokenizer, text, log_level=0)
        if template.is_error():
            raise ValueError(f"structured output {kind}: {one_line(template.get_error())}")
        warnings = tuple(template.get_grammar_warnings())
        return CompiledGrammar(kind, key, text, warnings, template)

    # --- batched masks ----------------------------------------------------------------------

    def fill_bitmasks(self, matchers: Sequence[Matcher | None], bitmask: np.ndarray) -> None:
        """Row i of bitmask (B, W) int32 <- matchers[i]'s next-token mask, in parallel; rows
        whose matcher is None (or past len(matchers)) are left as they are."""
        width = bitmask_width(self.vocab_size)
        ok = bitmask.ndim == 2 and bitmask.shape[1] == width and bitmask.dtype == np.int32
        if not ok or not bitmask.flags.c_contiguous or bitmask.shape[0] < len(matchers):
            raise ValueError(
                f"fill_bitmasks: bitmask must be a contiguous (>= {len(matchers)}, {width}) "
                f"int32, got {bitmask.shape} {bitmask.dtype}"
            )
        pairs = [(m._ll, i) for i, m in enumerate(matchers) if m is not None]
        if pairs:
            self.executor.unsafe_compute_mask_ptr(
                pairs, bitmask.ctypes.data, width * 4, bitmask.shape[0]
            )
        for i, m in enumerate(matchers):  # a reasoning model's answer may open its thinking
            if isinstance(m, AfterReasoning):
                m.adjust(bitmask[i])

    @property
    def executor(self) -> llguidance.LLExecutor:
        """llguidance's thread pool, started on first use."""
        if self._executor is None:
            self._executor = llguidance.LLExecutor(self._num_threads)
        return self._executor


def grammar_text(params: StructuredOutputsParams) -> str:
    """llguidance's grammar text for params (not yet checked); a ValueError for bad input."""
    kind = params.kind
    options = {"whitespace_flexible": False}  # disable_any_whitespace: none between tokens
    if not params.disable_any_whitespace:
        options = {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE}
    if kind in ("json", "json_object"):  # the values the schema leaves open bounded
        schema = params.schema() if kind == "json" else {"type": "object"}
        return llguidance.LLMatcher.grammar_from_json_schema(
            bound_numbers(schema), defaults=options
        )
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(choice_lark(params.choice))
    return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted to Lark


def choice_lark(choices: Sequence[str]) -> str:
    """A Lark grammar matching exactly one of choices: ``start: "a" | "b\\"c"``.

    Lark string literals take JSON's escapes; non-ASCII characters are written as themselves.
    """
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def one_line(message: str) -> str:
    """llguidance's error on one line: no parser-state dump, no caret-only lines."""
    message = message.split("<state>")[0]
    lines = (line.strip() for line in message.splitlines())
    return " ".join(line for line in lines if line and set(line) != {"^"})


def _plain_json(backend: HFTokenizer) -> str:
    """tokenizer.json text without padding or truncation (they would change what ids spell)."""
    copy = HFTokenizer.from_str(backend.to_str())
    copy.no_padding()
    copy.no_truncation()
    return copy.to_str()
