"""The engine's operations in NumPy, over the paged KV-cache layout of
``engine.backends.forward_batch``.

Each function here has a CUDA kernel twin in ``cuda_src/`` with the same arguments; the kernel tests
compare the two. The math is the reference's (``reference.model``); only the cache is paged.
Arrays compute in their own dtype (float32 or float64); 16-bit inputs are upcast to float32.
"""

from __future__ import annotations

import math

import numpy as np

from reference.model import apply_rope, rope_cos_sin, silu


def _f(x: np.ndarray) -> np.ndarray:
    """Compute dtype: float64 stays, everything else computes in float32."""
    return x if x.dtype == np.float64 else x.astype(np.float32, copy=False)


def embedding(token_ids: np.ndarray, table: np.ndarray, scale: float = 1.0) -> np.ndarray:
    # token_ids: (T,) int32, table: (V, D) -> (T, D) = table rows * scale (Gemma: sqrt(D))
    rows = table[token_ids]
    if scale == 1.0:
        return rows
    rows = _f(rows)
    return (rows * rows.dtype.type(scale)).astype(table.dtype)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, offset: float = 0.0) -> np.ndarray:
    # x: (T, D), weight: (D,) -> (T, D) in x's dtype, scaled by (offset + weight)
    xf = _f(x)
    w = _f(weight) + offset if offset else _f(weight)  # Gemma: offset 1, (1 + w)
    out = xf / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + eps) * w
    return out.astype(x.dtype, copy=False)


def fused_add_rms_norm(x, residual, weight, eps, offset: float = 0.0):
    """residual += x; return (rms_norm(residual), residual). x, residual: (T, D)."""
    residual = (_f(residual) + _f(x)).astype(residual.dtype, copy=False)
    return rms_norm(residual, weight, eps, offset), residual


def rotary(q: np.ndarray, k: np.ndarray, positions: np.ndarray, theta: float):
    # q: (T, H, hd), k: (T, Hkv, hd), positions: (T,) -> rotated (q, k), rotate-half layout
    cos, sin = rope_cos_sin(positions, q.shape[-1], theta, _f(q).dtype)
    q_out = apply_rope(_f(q), cos, sin).astype(q.dtype, copy=False)
    k_out = apply_rope(_f(k), cos, sin).astype(k.dtype, copy=False)
    return q_out, k_out


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    # PyTorch's gelu(approximate="tanh"), in x's (float) dtype
    c = np.sqrt(2.0 / np.pi).astype(x.dtype)
    return 0.5 * x * (1.0 + np.tanh(c * (x + x.dtype.type(0.044715) * x * x * x)))


def gelu(x: np.ndarray) -> np.ndarray:
    # exact: 0.5 x (1 + erf(x / sqrt 2)), erf in float64 from math (NumPy has none)
    erf = np.frompyfunc(math.erf, 1, 1)(x.astype(np.float64) / math.sqrt(2.0)).astype(np.float64)
    return (0.5 * x.astype(np.float64) * (1.0 + erf)).astype(x.dtype)


ACTIVATIONS = {"silu": silu, "gelu_tanh": gelu_tanh, "gelu": gelu}


def act_and_mul(gate_up: np.ndarray, activation: str = "silu") -> np.ndarray:
    # gate_up: (T, 2F), gate first then up -> (T, F) = act(gate) * up
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    f = gate_up.shape[-1] // 2
    g = _f(gate_up)
    return (ACTIVATIONS[activation](g[:, :f]) * g[:, f:]).astype(gate_up.dtype, copy=False)


def silu_and_mul(gate_up: np.ndarray) -> np.ndarray:
    # gate_up: (T, 2F), gate first then up -> (T, F)
    return act_and_mul(gate_up, "silu")


def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Write each token's K and V (T, Hkv, hd) into its slot of the (N, bs, Hkv, hd) caches,
    rounded to the cache's dtype; an 8-bit float cache saturates at its largest finite value."""
    top = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}.get(k_cache.dtype.name)
    if top is not None:
        k, v = np.clip(k, -top, top), np.clip(v, -top, top)
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache[slots // block_size, slots % block_size] = k[keep]
    v_cache[slots // block_size, slots % block_size] = v[keep]


def head_rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    # x: (T, heads, hd), weight: (hd,) -> each head x / sqrt(mean(x^2) + eps) * weight
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * _f(weight)


def rotary_cache(
    qkv,
    positions,
    theta,
    k_cache,
    v_cache,
    slot_mapping,
    num_heads: int,
    bias=None,
    q_norm=None,
    k_norm=None,
    eps: float = 1e-6,
):
    """qkv (T, (H + 2 Hkv) hd) rows q | k | v: + bias ((H + 2 Hkv) hd,) if given, each q and k
    head RMS-normed with q_norm and k_norm (hd,) if given, then q and k rotated; k and v written
    into their slots of the (N, bs, Hkv, hd) caches (slot < 0 skipped) -> q (T, H, hd). Float
    math, one rounding to the dtype at the end."""
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm go together")
    T, (Hkv, hd) = qkv.shape[0], k_cache.shape[2:]
    q_dim, kv_dim = num_heads * hd, Hkv * hd
    row = _f(qkv) if bias is None else _f(qkv) + _f(bias)  # (T, (H + 2 Hkv) hd)
    q = row[:, :q_dim].reshape(T, num_heads, hd)
    k = row[:, q_dim : q_dim + kv_dim].reshape(T, Hkv, hd)
    v = row[:, q_dim + kv_dim :].reshape(T, Hkv, hd)
    if q_norm is not None:
        q, k = head_rms_norm(q, q_norm, eps), head_rms_norm(k, k_norm, eps)
    q, k = rotary(q, k, positions, theta)
    reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)  # rounded (saturated) there
    return q.astype(qkv.dtype)


def gather_kv(cache: np.ndarray, block_table: np.ndarray, length: int) -> np.ndarray:
    """One sequence's first ``length`` rows, read through its page table -> (length, Hkv, hd)."""
    block_size = cache.shape[1]
    n_blocks = -(-length // block_size)
    rows = cache[block_table[:n_blocks]]  # (n_blocks, bs, Hkv, hd)
    return rows.reshape(-1, *cache.shape[2:])[:length]


def _attend(q, k, v, q_start, scale, window=0, softcap=0.0, sinks=None):
    # q: (Tq, H, hd) at positions q_start.., k, v: (S, Hkv, hd) -> (Tq, H, hd), float math;
    # a query at position p sees keys 0..p, or with a window W > 0 keys k with p - W < k <= p;
    # softcap > 0: scores tanh(s / softcap) * softcap before the mask; sinks (H,): each head's
    # softmax has one more logit, its sink, whose share is dropped
    group = q.shape[1] // k.shape[1]
    k = np.repeat(_f(k), group, axis=1)
    v = np.repeat(_f(v), group, axis=1)
    scores = np.einsum("thd,shd->hts", _f(q), k) * scale  # (H, Tq, S)
    if softcap:
        scores = np.tanh(scores / softcap) * softcap
    q_pos = q_start + np.arange(q.shape[0])[:, None]  # (Tq, 1)
    k_pos = np.arange(k.shape[0])[None, :]  # (1, S)
    visible = (k_pos <= q_pos) & (k_pos > q_pos - window if window > 0 else True)  # (Tq, S)
    scores = np.where(visible, scores, -np.inf)
    if sinks is not None:  # (H, Tq, S+1): the sinks' column last
        col = np.broadcast_to(_f(sinks)[:, None, None], (*scores.shape[:2], 1))
        scores = np.concatenate([scores, col], axis=-1)
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("hts,shd->thd", probs[..., : k.shape[0]], v)


def paged_attention_decode(
    q, k_cache, v_cache, block_tables, context_lens, scale, window=0, softcap=0.0, sinks=None
):
    """One query row per sequence. q: (B, H, hd); block_tables: (B, M); context_lens: (B,).
    Query b sits at position context_lens[b]-1 and sees every cached token, or with a sliding
    window W > 0 the last W of them; sinks (H,): each head's sink logit. -> (B, H, hd)"""
    out = np.empty(q.shape, dtype=q.dtype)
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        k = gather_kv(k_cache, block_tables[b], n)
        v = gather_kv(v_cache, block_tables[b], n)
        out[b] = _attend(q[b : b + 1], k, v, n - 1, scale, window, softcap, sinks)[0]
    return out


def paged_attention_prefill(
    q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, window=0, softcap=0.0,
    sinks=None,
):  # fmt: skip
    """Causal attention for variable-length query runs over paged K/V (already written).
    q: (T, H, hd); sequence b's queries are rows qsl[b]:qsl[b+1], the last q_len of its
    context_lens[b] tokens, so earlier tokens may come from the cache (chunked prefill,
    prefix caching). A row at position p sees keys 0..p, or with a sliding window W > 0 keys
    p - W + 1..p; softcap > 0 soft-caps the scores. -> (T, H, hd)"""
    out = np.empty(q.shape, dtype=q.dtype)
    for b in range(len(context_lens)):
        lo, hi, n = int(query_start_loc[b]), int(query_start_loc[b + 1]), int(context_lens[b])
        k = gather_kv(k_cache, block_tables[b], n)
        v = gather_kv(v_cache, block_tables[b], n)
        out[lo:hi] = _attend(q[lo:hi], k, v, n - (hi - lo), scale, window, softcap, sinks)
    return out


def copy_blocks(src: np.ndarray, dst: np.ndarray, pairs) -> None:
    """dst[:, :, d] = src[:, :, s] for each (s, d): whole blocks, every layer, K and V.
    src, dst: (L, 2, N, bs, Hkv, hd) pools (the same pool for copy-on-write)."""
    for s, d in pairs:
        dst[:, :, d] = src[:, :, s]


def quantize_rows_q8_0(x: np.ndarray) -> np.ndarray:
    """x (M, K) float32 -> (M, K) float64, x as cpu_src/matmul_q8_0.cpp quantizes it: per row,
    blocks of 32, d = absmax / 127 (float32), q = x * (1 / d) rounded half to even."""
    m, k = x.shape
    blocks = x.astype(np.float32).reshape(m, k // 32, 32)
    d = np.abs(blocks).max(axis=2) / np.float32(127)  # (M, K/32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    q = np.rint(blocks * inv[:, :, None])  # (M, K/32, 32), |q| <= 127
    return (q.astype(np.float64) * d[:, :, None]).reshape(m, k)


def matmul_q8_0(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x (M, K) quantized to Q8_0 @ w (K, N): the product the Q8_0 kernel computes, in float64,
    w being the Q8_0 weight's dequantized values."""
    return quantize_rows_q8_0(x) @ w.astype(np.float64)
