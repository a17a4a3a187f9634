"""Requests in: a prompt (text or token ids) -> checked token ids, before anything is queued.

Bad input is a one-line ValueError for that request only; the engine keeps running the others.
"""

from __future__ import annotations

import numpy as np


def tokenize_prompt(prompt, tokenizer, vocab_size: int, max_model_len: int):
    """(prompt text or None, token ids), checked against the vocabulary and max_model_len."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        text, ids = prompt, tokenizer.encode(prompt)
    elif isinstance(prompt, list | tuple | np.ndarray):
        text, ids = None, [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside [0, {vocab_size})")
    else:
        raise ValueError(
            f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
        )
    if not ids:
        raise ValueError("prompt is empty (no tokens)")
    if len(ids) > max_model_len:
        raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len={max_model_len}")
    return text, ids
