"""The LLaMA forward pass in NumPy, one function per step.

Shapes: T tokens in this call, P tokens already in the KV cache, D = hidden_size,
H query heads, Hkv key/value heads, hd = head_dim, V = vocab_size.
Every function computes in the dtype of its inputs (float32 or float64).

Two ways to decode (see ``reference.generate``):
  full recompute  ``forward(w, cfg, all_ids)``            every step re-runs the whole sequence
  KV-cached       ``forward(w, cfg, new_ids, cache)``     past K and V are read from ``cache``
Both keep only the last row of the output: it is the only one that predicts the next token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .config import ModelConfig
from .weights import LayerWeights, ModelWeights


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    # x: (T, D), weight: (D,) -> (T, D)
    variance = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(variance + eps) * weight


def rope_cos_sin(positions: np.ndarray, head_dim: int, theta: float, dtype) -> tuple:
    """cos and sin tables, (T, hd), in Hugging Face's rotate-half layout (frequencies repeated)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))  # (hd/2,)
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]  # (T, hd/2)
    angles = np.concatenate([angles, angles], axis=-1)  # (T, hd)
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    # x: (T, nh, hd); cos, sin: (T, hd). Pairs element i with i + hd/2 ("rotate half").
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_start: int) -> np.ndarray:
    """Grouped-query causal attention.

    q: (T, H, hd) for positions q_start .. q_start+T-1; k, v: (S, Hkv, hd) for positions 0 .. S-1.
    Query at position p sees keys 0..p. Returns (T, H, hd).
    """
    n_q, n_heads, hd = q.shape
    n_kv_heads = k.shape[1]
    group = n_heads // n_kv_heads
    k = np.repeat(k, group, axis=1)  # (S, H, hd): each K/V head serves `group` query heads
    v = np.repeat(v, group, axis=1)
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd).astype(q.dtype)  # (H, T, S)
    q_pos = q_start + np.arange(n_q)[:, None]  # (T, 1)
    k_pos = np.arange(k.shape[0])[None, :]  # (1, S)
    scores = np.where(k_pos <= q_pos, scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("hts,shd->thd", probs, v)  # (T, H, hd)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def mlp(x: np.ndarray, lw: LayerWeights) -> np.ndarray:
    # SwiGLU: down(silu(gate(x)) * up(x)); x: (T, D) -> (T, D)
    return (silu(x @ lw.w_gate.T) * (x @ lw.w_up.T)) @ lw.w_down.T


@dataclass
class KVCache:
    """Per layer, the keys and values of every token seen so far: k[l], v[l] are (P, Hkv, hd)."""

    k: list = field(default_factory=list)
    v: list = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.k[0].shape[0] if self.k else 0


def attention_block(x, lw, cfg, cos, sin, layer, cache, start):
    # x: (T, D) already normalized -> (T, D)
    n = x.shape[0]
    q = (x @ lw.wq.T).reshape(n, cfg.num_attention_heads, cfg.head_dim)  # (T, H, hd)
    k = (x @ lw.wk.T).reshape(n, cfg.num_key_value_heads, cfg.head_dim)  # (T, Hkv, hd)
    v = (x @ lw.wv.T).reshape(n, cfg.num_key_value_heads, cfg.head_dim)  # (T, Hkv, hd)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if cache is not None:  # past K and V never change: read them, append the new rows
        if layer < len(cache.k):
            k = np.concatenate([cache.k[layer], k])  # (P+T, Hkv, hd)
            v = np.concatenate([cache.v[layer], v])
            cache.k[layer], cache.v[layer] = k, v
        else:
            cache.k.append(k)
            cache.v.append(v)
    out = causal_attention(q, k, v, q_start=start)  # (T, H, hd)
    return out.reshape(n, cfg.q_dim) @ lw.wo.T


def forward(
    w: ModelWeights, cfg: ModelConfig, token_ids, cache: KVCache | None = None
) -> np.ndarray:
    """Run ``token_ids`` (T,) after the ``cache.length`` tokens already cached (none without a
    cache) and return the logits of the last position, (V,)."""
    start = cache.length if cache is not None else 0
    positions = np.arange(start, start + len(token_ids))
    x = w.embed[np.asarray(token_ids)]  # (T, D)
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, x.dtype)  # (T, hd)
    for layer, lw in enumerate(w.layers):
        h = rms_norm(x, lw.attn_norm, cfg.rms_norm_eps)
        x = x + attention_block(h, lw, cfg, cos, sin, layer, cache, start)
        x = x + mlp(rms_norm(x, lw.mlp_norm, cfg.rms_norm_eps), lw)
    last = rms_norm(x[-1:], w.final_norm, cfg.rms_norm_eps)  # (1, D): only the last row matters
    return (last @ w.lm_head.T)[0]  # (V,)
