"""Prompt lookup: draft the tokens that followed an earlier occurrence of the latest n-gram.

For n from ``n_max`` down to ``n_min``, the last n tokens of the sequence (prompt + output) are
looked for earlier in it; the earliest match with at least one token after it gives the draft:
up to ``k`` tokens that followed it. No match, no draft (the sequence decodes as usual).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k draft tokens for the sequence ``token_ids`` (prompt + output), or []."""
    ids = np.asarray(token_ids, dtype=np.int64)  # (N,)
    n_tok = ids.shape[0]
    for n in range(min(n_max, n_tok - 1), n_min - 1, -1):
        windows = sliding_window_view(ids[:-1], n)  # (N-n, n): every earlier n-gram
        hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))  # starts, ascending
        if hits.size:
            start = int(hits[0]) + n  # the earliest match: the tokens right after it
            return ids[start : start + k].tolist()
    return []
