"""One request's place in its grammar: which tokens may come next, given the tokens taken so far.

A thin layer over ``llguidance.LLMatcher`` with three guarantees the engine relies on:
  * a refused token changes nothing (``accept`` checks before it consumes; llguidance alone
    would enter an error state it never leaves);
  * EOS is allowed exactly when the grammar can end here (``is_accepting``), and once nothing
    else can follow (``is_stopped``) the mask allows only the EOS ids;
  * ``rollback(n)`` undoes the last n accepted tokens, counting an EOS taken after the grammar
    stopped (llguidance does not record that one, so it is not passed on).
Ids past the tokenizer's own vocabulary (padding rows of a larger lm_head) are never allowed.
"""

from __future__ import annotations

import re

import llguidance
import numpy as np

from engine.core.structured.bitmask import bitmask_width, unpack_bitmask


class Matcher:
    """A fresh grammar state per request; built by ``StructuredOutputCompiler.matcher``."""

    active = True  # its mask applies (AfterReasoning's waits for the thinking's end)

    def __init__(self, ll: llguidance.LLMatcher, vocab_size: int, eos_token_ids):
        self._ll = ll
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self._counted: list[bool] = []  # per accepted token: whether llguidance recorded it

    @property
    def num_tokens(self) -> int:
        """Tokens accepted so far (and not rolled back)."""
        return len(self._counted)

    @property
    def error(self) -> str | None:
        """llguidance's error (a resource limit hit while matching), else None. Final: the
        matcher then allows only EOS and accepts nothing; abort the request."""
        return self._ll.get_error() if self._ll.is_error() else None

    def is_accepting(self) -> bool:
        """Whether the output so far is complete: the grammar may end here (EOS is allowed)."""
        return self._ll.is_accepting()

    def is_stopped(self) -> bool:
        """Whether nothing but EOS can follow (the grammar has ended, or an EOS was taken)."""
        return self._ll.is_stopped()

    # --- masks ------------------------------------------------------------------------------

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into row, a contiguous (W,) int32, W = ceil(V / 32)."""
        width = bitmask_width(self.vocab_size)
        if row.shape != (width,) or row.dtype != np.int32 or not row.flags.c_contiguous:
            raise ValueError(
                f"Matcher.fill_bitmask: row must be a contiguous ({width},) int32, "
                f"got {row.shape} {row.dtype}"
            )
        self._ll.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def allowed_mask(self) -> np.ndarray:
        """(V,) bool: True for each token the grammar allows next."""
        row = np.empty(bitmask_width(self.vocab_size), dtype=np.int32)  # (W,)
        self.fill_bitmask(row)
        return unpack_bitmask(row, self.vocab_size)

    # --- tokens -----------------------------------------------------------------------------

    def accept(self, token: int) -> bool:
        """Take token if the grammar allows it next; a refused token leaves the state unchanged."""
        token = int(token)
        stopped = self._ll.is_stopped()
        if self._ll.is_error() or (stopped and token not in self.eos_token_ids):
            return False
        if not stopped and (not self._in_vocab(token) or self._ll.validate_tokens([token]) != 1):
            return False
        ok = self._ll.consume_token(token)
        assert ok, f"llguidance refused a validated token {token}: {self._ll.get_error()}"
        self._counted.append(not stopped)  # an EOS after the stop is not recorded by llguidance
        return True

    def validate_tokens(self, tokens) -> int:
        """How many of tokens (a draft) ``accept`` would take one after another, up to the first
        EOS (the request ends there); the state does not change."""
        tokens = [int(t) for t in tokens]
        eos = next((i for i, t in enumerate(tokens) if t in self.eos_token_ids), None)
        tokens = tokens if eos is None else tokens[: eos + 1]
        inside = next((i for i, t in enumerate(tokens) if not self._in_vocab(t)), len(tokens))
        n = self._ll.validate_tokens(tokens[:inside]) if inside else 0
        # llguidance counts no EOS when the state is already stopped; accept takes it
        if n < len(tokens) and tokens[n] in self.eos_token_ids and self._stops_after(tokens[:n]):
            n += 1
        return n

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (rejected speculative tokens)."""
        if not 0 <= num_tokens <= len(self._counted):
            raise ValueError(
                f"Matcher.rollback: num_tokens must be in [0, {len(self._counted)}], "
                f"got {num_tokens}"
            )
        undone = self._counted[len(self._counted) - num_tokens :]
        del self._counted[len(self._counted) - num_tokens :]
        recorded = sum(undone)
        if recorded:
            ok = self._ll.rollback(recorded)
            assert ok, f"llguidance rollback({recorded}) failed: {self._ll.get_error()}"

    def reset(self) -> None:
        """Back to the start of the grammar, as if no token had been accepted."""
        self.rollback(len(self._counted))

    def _in_vocab(self, token: int) -> bool:
        return 0 <= token < self.vocab_size

    def _stops_after(self, prefix: list[int]) -> bool:
        """Whether the matcher is stopped after prefix (valid tokens): consumed, then undone."""
        if not prefix:
            return self._ll.is_stopped()
        assert self._ll.consume_tokens(prefix), self._ll.get_error()
        stopped = self._ll.is_stopped()
        assert self._ll.rollback(len(prefix)), self._ll.get_error()
        return stopped


class AfterReasoning:
    """A grammar for the answer of a reasoning model, which may first think between ``start``
    and ``end`` (``<think>``, ``</think>``). Where the thinking is depends on one state, the same
    the answer/thinking splitter keeps (engine/entrypoints/reasoning.py):

    * ``start`` None (the prompt left the thinking open): every token is taken unmasked until
      the output holds ``end``; the grammar decides from the next token on.
    * otherwise the first token decides. The grammar's mask applies from the first token, with
      the tokens that open the thinking added while the output is still only whitespace
      (``opening``: a packed (W,) row of the tokens that hold the whole ``start``). A token the
      grammar takes makes the output the answer, constrained from its first token on (a model
      that never thinks); an opening token makes the thinking run to ``end`` as above
      (whitespace the grammar took before it is taken back). Right after ``end`` the answer may
      skip up to NEWLINES newline tokens the grammar refuses, as the splitter drops them.

    With ``end_regex`` the end is a regular expression (harmony's header of the final channel,
    or of a named call, up to its ``<|message|>``): the output starts in the thinking and the
    grammar applies from the token after the first match on; no newline is skipped.

    An output that opens its thinking and never ends it stays unconstrained (the model never
    wrote the answer the grammar is for). ``piece(token)``: a token's text."""

    NEWLINES = 2  # newlines after the end that the answer may skip (Qwen3 writes two)
    WINDOW = 1024  # the thinking's tail an end pattern is looked for in (a harmony header)

    def __init__(
        self, matcher, start: str | None, end: str, piece, opening=None, newlines=None,
        end_regex: bool = False,
    ):  # fmt: skip
        self.inner, self.start, self.end, self.piece = matcher, start, end, piece
        self.pattern = re.compile(end) if end_regex else None
        self.opening, self.newlines = opening, newlines  # packed (W,) rows, or None
        # newline tokens skipped after the end (none may be before it: the count starts full)
        self.skipped = self.NEWLINES
        self.state = "thinking" if start is None else "start"
        self.text = ""  # the output's whitespace before it decides; the thinking's tail
        self.fed = 0  # whitespace tokens fed to the grammar before the output decided

    active = property(lambda self: self.state != "thinking")  # the mask applies
    error = property(lambda self: self.inner.error)
    num_tokens = property(lambda self: self.inner.num_tokens)
    _ll = property(lambda self: self.inner._ll)  # fill_bitmasks reads the inner grammar's

    def accept(self, token: int) -> bool:
        if self.state == "answer":
            if self.inner.accept(token):
                self.skipped = self.NEWLINES  # the answer has begun
                return True
            return self._skip(self.piece(token))
        piece = self.piece(token)
        if self.state == "thinking":
            self._think(piece)
            return True
        if self.inner.accept(token):  # the grammar's path
            self.fed += 1
            self.text += piece
            if self.text.strip():
                self.state = "answer"
            return True
        lead = piece.lstrip()
        if lead.startswith(self.start):  # the thinking opens: the grammar waits for its end
            self.inner.rollback(self.fed)
            self.state, self.text = "thinking", ""
            self._think(lead[len(self.start) :])
            return True
        return False

    def _skip(self, piece: str) -> bool:
        """A newline after the thinking's end that the grammar refused: the answer skips it,
        as the splitter does (``newlines``), up to NEWLINES of them."""
        ok = self.skipped < self.NEWLINES and piece != "" and piece.strip("\n") == ""
        self.skipped += ok
        return ok

    def _think(self, piece: str) -> None:
        if self.pattern is not None:
            self.text = (self.text + piece)[-self.WINDOW :]
            if self.pattern.search(self.text):
                self.state = "answer"  # self.skipped stays full: no newline to skip
            return
        self.text = (self.text + piece)[-2 * len(self.end) :]
        if self.end in self.text:
            self.state, self.skipped = "answer", 0  # the newlines after the end may be skipped

    def adjust(self, row: np.ndarray) -> None:
        """After the grammar filled ``row``: before the output's first word, add the tokens
        that open the thinking; right after the thinking's end, the newline tokens."""
        if self.opening is not None and self.state == "start":
            np.bitwise_or(row, self.opening, out=row)
        elif self.state == "answer" and self.newlines is not None and self.skipped < self.NEWLINES:
            np.bitwise_or(row, self.newlines, out=row)

    def is_accepting(self) -> bool:
        return self.state == "answer" and self.inner.is_accepting()

    def is_stopped(self) -> bool:
        return self.state == "answer" and self.inner.is_stopped()

    def fill_bitmask(self, row: np.ndarray) -> None:
        self.inner.fill_bitmask(row)
        self.adjust(row)
