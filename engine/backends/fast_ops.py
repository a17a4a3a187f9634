"""``numpy_ops`` with faster attention and rotary: the NumPy backend's default ops.

Same functions, same arguments, same results (within float rounding) as ``numpy_ops``, which stays
the plain twin of the CUDA kernels. The differences are only how NumPy is driven:
- attention groups the query heads that share a K/V head (no ``np.repeat`` copies of K and V) and
  uses batched ``matmul`` instead of ``einsum``;
- long prefills process queries in chunks, so the score matrix stays bounded;
- rotary reuses its cos/sin tables across the layers of one forward (same ``positions`` array).
"""

from __future__ import annotations

import numpy as np

from reference.model import apply_rope, rope_cos_sin

from .numpy_ops import (  # noqa: F401  (re-exported: the backend calls them through this module)
    _f,
    copy_blocks,
    embedding,
    silu_and_mul,
)

QUERY_CHUNK = 512  # prefill query rows per score matrix: (H, 512, S) float32 at most


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    # x: (T, D), weight: (D,) -> (T, D) in x's dtype
    xf = _f(x)
    ms = np.add.reduce(xf * xf, axis=-1, keepdims=True) * np.float32(1.0 / x.shape[-1])  # (T, 1)
    return (xf * (1.0 / np.sqrt(ms + np.float32(eps))) * _f(weight)).astype(x.dtype, copy=False)


def fused_add_rms_norm(x, residual, weight, eps):
    """residual += x; return (rms_norm(residual), residual). x, residual: (T, D)."""
    residual = (_f(residual) + _f(x)).astype(residual.dtype, copy=False)
    return rms_norm(residual, weight, eps), residual


def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Write each token's K and V (T, Hkv, hd) into its slot of the (N, bs, Hkv, hd) caches."""
    if slot_mapping.min(initial=0) < 0:  # padding slots: drop them
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.reshape(-1, *k_cache.shape[2:])[slot_mapping] = k  # (N*bs, Hkv, hd) view
    v_cache.reshape(-1, *v_cache.shape[2:])[slot_mapping] = v


_rope_memo: list = [None, None, None]  # [positions array, key, (cos, sin)]


def _cos_sin(positions: np.ndarray, head_dim: int, theta: float, dtype):
    """cos/sin (T, hd) for ``positions``, computed once per forward (the array is shared)."""
    key = (head_dim, theta, np.dtype(dtype))
    if _rope_memo[0] is not positions or _rope_memo[1] != key:
        _rope_memo[:] = [positions, key, rope_cos_sin(positions, head_dim, theta, dtype)]
    return _rope_memo[2]


def rotary(q: np.ndarray, k: np.ndarray, positions: np.ndarray, theta: float):
    # q: (T, H, hd), k: (T, Hkv, hd), positions: (T,) -> rotated (q, k), rotate-half layout
    cos, sin = _cos_sin(positions, q.shape[-1], theta, _f(q).dtype)  # (T, hd)
    q_out = apply_rope(_f(q), cos, sin).astype(q.dtype, copy=False)
    k_out = apply_rope(_f(k), cos, sin).astype(k.dtype, copy=False)
    return q_out, k_out


def _gather(cache: np.ndarray, blocks: np.ndarray, length: int) -> np.ndarray:
    # cache: (N, bs, Hkv, hd), blocks: (nb,) -> (length, Hkv, hd) in compute dtype
    return _f(cache[blocks].reshape(-1, *cache.shape[2:])[:length])


def _softmax_(s: np.ndarray) -> np.ndarray:
    """In-place softmax over the last axis."""
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s


def _attend(q, k, v, q_start, scale):
    """q: (Tq, H, hd) at positions q_start..; k, v: (S, Hkv, hd) -> (Tq, H, hd), causal."""
    tq, n_heads, hd = q.shape
    n_kv = k.shape[1]
    group = n_heads // n_kv
    # (Hkv, group*Tq, hd): the query rows of every head that reads K/V head j, stacked
    qg = _f(q).reshape(tq, n_kv, group, hd).transpose(1, 2, 0, 3).reshape(n_kv, group * tq, hd)
    s = np.matmul(qg, k.transpose(1, 2, 0)) * np.float32(scale)  # (Hkv, group*Tq, S)
    if tq > 1:  # causal: query at q_start+t sees keys 0..q_start+t
        q_pos = q_start + np.tile(np.arange(tq), group)  # (group*Tq,)
        s[:, np.arange(k.shape[0])[None, :] > q_pos[:, None]] = -np.inf
    out = np.matmul(_softmax_(s), v.transpose(1, 0, 2))  # (Hkv, group*Tq, hd)
    return out.reshape(n_kv, group, tq, hd).transpose(2, 0, 1, 3).reshape(tq, n_heads, hd)


def paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    """One query row per sequence. q: (B, H, hd); block_tables: (B, M); context_lens: (B,).
    Query b sits at position context_lens[b]-1 and sees every cached token. -> (B, H, hd)"""
    out = np.empty(q.shape, dtype=q.dtype)
    bs = k_cache.shape[1]
    for b, n in enumerate(context_lens.tolist()):
        blocks = block_tables[b, : -(-n // bs)]
        k, v = _gather(k_cache, blocks, n), _gather(v_cache, blocks, n)  # (n, Hkv, hd)
        out[b] = _attend(q[b : b + 1], k, v, n - 1, scale)[0]
    return out


def paged_attention_prefill(
    q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale
):
    """Causal attention for variable-length query runs over paged K/V (already written).
    q: (T, H, hd); sequence b's queries are rows qsl[b]:qsl[b+1], the last q_len of its
    context_lens[b] tokens. -> (T, H, hd)"""
    out = np.empty(q.shape, dtype=q.dtype)
    bs = k_cache.shape[1]
    qsl = query_start_loc.tolist()
    for b, n in enumerate(context_lens.tolist()):
        lo, hi = qsl[b], qsl[b + 1]
        blocks = block_tables[b, : -(-n // bs)]
        k, v = _gather(k_cache, blocks, n), _gather(v_cache, blocks, n)  # (n, Hkv, hd)
        start = n - (hi - lo)  # position of row lo
        for c in range(lo, hi, QUERY_CHUNK):
            e = min(c + QUERY_CHUNK, hi)
            # keys past the chunk's last query are masked anyway: slice them off
            kv_len = start + (e - lo)
            out[c:e] = _attend(q[c:e], k[:kv_len], v[:kv_len], start + (c - lo), scale)
    return out
