"""Structured output (constrained decoding): the tokens a grammar allows next, as a logits mask.

``StructuredOutputsParams`` (vLLM's names: json, regex, choice, grammar, json_object; exactly
one is set; ``key()`` for caching) is engine/structured_params.py, beside ``SamplingParams``.

compiler.py  ``StructuredOutputCompiler``: one per engine over the model's tokenizer; constraint ->
             checked llguidance grammar (LRU-cached) -> a fresh ``Matcher`` per request
matcher.py   ``Matcher``: next-token mask, accept, rollback, draft validation; EOS exactly when
             the grammar can end
bitmask.py   (B, W) int32 bitmasks, 32 ids a word; ``apply_bitmask``: disallowed logits -> -inf

Data flow: request params -> compiler.matcher() -> each step: fill a bitmask row -> apply it to
the logits -> sample -> matcher.accept(token).
"""

from engine.core.structured.bitmask import (
    allocate_bitmask,
    apply_bitmask,
    bitmask_width,
    unpack_bitmask,
)
from engine.core.structured.compiler import CompiledGrammar, StructuredOutputCompiler
from engine.core.structured.matcher import Matcher
from engine.structured_params import StructuredOutputsParams


def model_compiler(loaded, eos_token_ids: list[int]) -> StructuredOutputCompiler:
    """A compiler over a LoadedModel's tokenizer (about half a second to build for a 49k
    vocabulary)."""
    return StructuredOutputCompiler(
        loaded.tokenizer, vocab_size=loaded.config.vocab_size, eos_token_ids=eos_token_ids
    )


__all__ = [
    "CompiledGrammar",
    "Matcher",
    "StructuredOutputCompiler",
    "StructuredOutputsParams",
    "allocate_bitmask",
    "apply_bitmask",
    "bitmask_width",
    "model_compiler",
    "unpack_bitmask",
]
