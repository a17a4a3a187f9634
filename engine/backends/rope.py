"""The rotary table the kernels read: one row of cos and sin per position."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from model_loader.rope import rope_cos_sin


@lru_cache(maxsize=8)
def rope_table(max_positions: int, head_dim: int, rope) -> np.ndarray:
    """(max_positions, hd) float32: cos(p * f_j) for j < hd/2, then sin(p * f_j), both times
    the attention factor (YaRN's; 1 otherwise). The angles are the reference's
    (``rope_cos_sin``, float64, any scaling in f_j); the kernels need one of its two halves.
    ``rope``: a model_loader.rope.RopeParams or a bare theta."""
    half = head_dim // 2
    cos, sin = rope_cos_sin(np.arange(max_positions), head_dim, rope, np.float32)  # (P, hd)
    table = np.concatenate([cos[:, :half], sin[:, :half]], axis=-1)  # (P, hd)
    table.setflags(write=False)
    return table
