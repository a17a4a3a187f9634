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

from model_loader.config import ModelConfig
from model_loader.rope import rope_cos_sin
from model_loader.weights import LayerWeights, ModelWeights
from reference.moe import moe_mlp


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, offset: float = 0.0) -> np.ndarray:
    # x: (T, D), weight: (D,) -> (T, D); Gemma scales by (1 + w): offset 1
    variance = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(variance + eps) * (weight + x.dtype.type(offset) if offset else weight)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    # x: (T, nh, hd); cos, sin: (T, hd). Pairs element i with i + hd/2 ("rotate half").
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    """Gemma 2's soft-capping: tanh(x / cap) * cap (cap 0: x as it is)."""
    return np.tanh(x / x.dtype.type(cap)) * x.dtype.type(cap) if cap else x


def causal_attention(
    q, k, v, q_start: int, window: int = 0, scale: float | None = None, cap: float = 0.0,
    sinks: np.ndarray | None = None,
) -> np.ndarray:  # fmt: skip
    """Grouped-query causal attention.

    q: (T, H, hd) for positions q_start .. q_start+T-1; k, v: (S, Hkv, hd) for positions 0 .. S-1.
    Query at position p sees keys 0..p, or with a sliding window W > 0 keys p-W+1..p.
    Scores are q.k * scale (None: / sqrt(hd)), soft-capped at ``cap`` when > 0 before the mask.
    ``sinks`` (H,) (gpt-oss): head h's softmax has one more logit, sinks[h], that takes its
    share of the probability and brings no value. Returns (T, H, hd).
    """
    n_q, n_heads, hd = q.shape
    n_kv_heads = k.shape[1]
    group = n_heads // n_kv_heads
    k = np.repeat(k, group, axis=1)  # (S, H, hd): each K/V head serves `group` query heads
    v = np.repeat(v, group, axis=1)
    scores = np.einsum("thd,shd->hts", q, k)  # (H, T, S)
    if scale is None:
        scores = scores / np.sqrt(hd).astype(q.dtype)
    else:
        scores = scores * q.dtype.type(scale)
    scores = softcap(scores, cap)
    q_pos = q_start + np.arange(n_q)[:, None]  # (T, 1)
    k_pos = np.arange(k.shape[0])[None, :]  # (1, S)
    visible = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)  # (T, S)
    scores = np.where(visible, scores, -np.inf)
    if sinks is not None:  # (H, T, S+1): the sink's column last
        sink = np.broadcast_to(sinks.astype(q.dtype)[:, None, None], (*scores.shape[:2], 1))
        scores = np.concatenate([scores, sink], axis=-1)
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    probs = probs[..., : k.shape[0]]  # the sink's share goes nowhere
    return np.einsum("hts,shd->thd", probs, v)  # (T, H, hd)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    # PyTorch's gelu(approximate="tanh")
    c = x.dtype.type(np.sqrt(2.0 / np.pi))
    return 0.5 * x * (1.0 + np.tanh(c * (x + x.dtype.type(0.044715) * x * x * x)))


def gelu(x: np.ndarray) -> np.ndarray:
    # exact: 0.5 x (1 + erf(x / sqrt 2)), erf from math (NumPy has none)
    from math import erf

    return (0.5 * x * (1.0 + np.vectorize(erf, otypes=[x.dtype])(x / np.sqrt(2.0)))).astype(x.dtype)


ACTIVATIONS = {"silu": silu, "gelu_tanh": gelu_tanh, "gelu": gelu}


def mlp(x: np.ndarray, lw: LayerWeights, act: str = "silu") -> np.ndarray:
    # gated MLP: down(act(gate(x)) * up(x)); SwiGLU with silu, GeGLU with gelu; (T, D) -> (T, D)
    return (ACTIVATIONS[act](x @ lw.w_gate.T) * (x @ lw.w_up.T)) @ lw.w_down.T


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
    q, k, v = _project(x, lw.wq, lw.bq), _project(x, lw.wk, lw.bk), _project(x, lw.wv, lw.bv)
    if cfg.qk_norm_whole:  # OLMoE: each token's whole q (T, H*hd) and k (T, Hkv*hd) normalised
        q, k = rms_norm(q, lw.q_norm, cfg.rms_norm_eps), rms_norm(k, lw.k_norm, cfg.rms_norm_eps)
    if cfg.clip_qkv is not None:  # OLMoE: after the norms
        q, k, v = (np.clip(a, -cfg.clip_qkv, cfg.clip_qkv) for a in (q, k, v))
    q = q.reshape(n, cfg.num_attention_heads, cfg.head_dim)  # (T, H, hd)
    k = k.reshape(n, cfg.num_key_value_heads, cfg.head_dim)  # (T, Hkv, hd)
    v = v.reshape(n, cfg.num_key_value_heads, cfg.head_dim)  # (T, Hkv, hd)
    if lw.q_norm is not None and not cfg.qk_norm_whole:  # Qwen3, Gemma 3: each head before RoPE
        q = rms_norm(q, lw.q_norm, cfg.rms_norm_eps, cfg.norm_offset)
        k = rms_norm(k, lw.k_norm, cfg.rms_norm_eps, cfg.norm_offset)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if cache is not None:  # past K and V never change: read them, append the new rows
        if layer < len(cache.k):
            k = np.concatenate([cache.k[layer], k])  # (P+T, Hkv, hd)
            v = np.concatenate([cache.v[layer], v])
            cache.k[layer], cache.v[layer] = k, v
        else:
            cache.k.append(k)
            cache.v.append(v)
    scale = cfg.attn_scale if cfg.query_pre_attn_scalar else None
    window = cfg.window(layer)
    out = causal_attention(q, k, v, start, window, scale, cfg.attn_softcap, lw.sinks)  # (T, H, hd)
    return _project(out.reshape(n, cfg.q_dim), lw.wo, lw.bo)


def _project(x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    # x: (T, D), w: (out, D), b: (out,) or None -> (T, out)
    return x @ w.T if b is None else x @ w.T + b


def forward(
    w: ModelWeights, cfg: ModelConfig, token_ids, cache: KVCache | None = None
) -> np.ndarray:
    """Run ``token_ids`` (T,) after the ``cache.length`` tokens already cached (none without a
    cache) and return the logits of the last position, (V,)."""
    start = cache.length if cache is not None else 0
    positions = np.arange(start, start + len(token_ids))
    x = w.embed[np.asarray(token_ids)]  # (T, D)
    if cfg.embed_scale != 1.0:  # Gemma: sqrt(D), rounded to the activations' dtype first
        x = x * x.dtype.type(cfg.embed_scale)
    eps, off = cfg.rms_norm_eps, cfg.norm_offset
    for layer, lw in enumerate(w.layers):
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.layer_rope(layer), x.dtype)  # (T, hd)
        h = attention_block(
            rms_norm(x, lw.attn_norm, eps, off), lw, cfg, cos, sin, layer, cache, start
        )
        x = x + _post_norm(h, lw.post_attn_norm, eps, off)
        h = rms_norm(x, lw.mlp_norm, eps, off)
        h = (moe_mlp(h, lw, cfg.moe, ACTIVATIONS[cfg.hidden_act]) if lw.router is not None
             else mlp(h, lw, cfg.hidden_act))  # fmt: skip
        x = x + _post_norm(h, lw.post_mlp_norm, eps, off)
    last = rms_norm(x[-1:], w.final_norm, eps, off)  # (1, D): only the last row matters
    return softcap((last @ w.lm_head.T)[0], cfg.final_softcap)  # (V,)


def _post_norm(h: np.ndarray, weight: np.ndarray | None, eps: float, off: float) -> np.ndarray:
    """Gemma 2 and 3's sandwich: a branch's output normalised before the residual add."""
    return h if weight is None else rms_norm(h, weight, eps, off)
