"""The NumPy backend's operations over the paged KV-cache layout of
``engine.backends.forward_batch``.

Same functions, same arguments, same results (within float rounding) as the plain twins of the
CUDA kernels that the tests hold as oracles (``reference/kernel_ops.py``). The differences are only
how NumPy is driven:
- attention groups the query heads that share a K/V head (no ``np.repeat`` copies of K and V) and
  uses batched ``matmul`` instead of ``einsum``;
- long prefills process queries in chunks, so the score matrix stays bounded, and the causal mask
  is one cached triangle added to the trailing (Tq, Tq) square of the scores only;
- silu_and_mul works in one output buffer instead of five temporaries (same rounding);
- rotary reuses its cos/sin tables across the layers of one forward (same ``positions`` array).
"""

from __future__ import annotations

import numpy as np

from engine.backends.base import FP8_MAX, copy_host_blocks
from engine.utils import cdiv
from reference.model import ACTIVATIONS, apply_rope, rope_cos_sin

QUERY_CHUNK = 512  # prefill query rows per score matrix: (H, 512, S) float32 at most


def _f(x: np.ndarray) -> np.ndarray:
    """Compute dtype: float64 stays, everything else computes in float32."""
    return x if x.dtype == np.float64 else x.astype(np.float32, copy=False)


SMALL_M = 8  # products of 2..7 rows run as 8 (see matmul)


def matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x (M, K) @ w (K, N). NOTE: OpenBLAS's float32 gemm takes longer for 2 to 7 rows than
    for 8 on this project's machines (measured: lm_head's (576, 49152), 5 rows 12.0 ms, 8 rows
    7.1 ms, 1 row 2.8 ms), so such products are padded with zero rows to 8: a speculated row
    of 1 + 4 tokens, or a decode batch of 2 to 7."""
    m = x.shape[0]
    if not 1 < m < SMALL_M:
        return x @ w
    padded = np.zeros((SMALL_M, x.shape[1]), x.dtype)  # (8, K)
    padded[:m] = x
    return (padded @ w)[:m]


def embedding(token_ids: np.ndarray, table: np.ndarray, scale: float = 1.0) -> np.ndarray:
    # token_ids: (T,) int32, table: (V, D) float32 or 16-bit floats -> (T, D) float32 (float64
    # stays), times scale (Gemma: sqrt(D)); a 16-bit table's rows widen exactly
    rows = _f(table[token_ids])
    return rows if scale == 1.0 else rows * rows.dtype.type(scale)


def copy_blocks(src: np.ndarray, dst: np.ndarray, pairs) -> None:
    """dst[:, :, d] = src[:, :, s] for each (s, d): whole blocks, every layer, K and V."""
    copy_host_blocks(dst, src, pairs)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, offset: float = 0.0) -> np.ndarray:
    # x: (T, D), weight: (D,) -> (T, D) in x's dtype, scaled by (offset + weight)
    xf = _f(x)
    ms = np.add.reduce(xf * xf, axis=-1, keepdims=True) * np.float32(1.0 / x.shape[-1])  # (T, 1)
    out = xf * (1.0 / np.sqrt(ms + np.float32(eps)))  # (T, D)
    out *= _f(weight) + np.float32(offset) if offset else _f(weight)
    return out.astype(x.dtype, copy=False)


def fused_add_rms_norm(x, residual, weight, eps, offset: float = 0.0):
    """residual += x; return (rms_norm(residual), residual). x, residual: (T, D)."""
    residual = (_f(residual) + _f(x)).astype(residual.dtype, copy=False)
    return rms_norm(residual, weight, eps, offset), residual


def silu_and_mul(gate_up: np.ndarray) -> np.ndarray:
    # gate_up: (T, 2F), gate first then up -> (T, F); silu(g) = g / (1 + exp(-g)), in one buffer
    f = gate_up.shape[-1] // 2
    g = _f(gate_up)
    out = np.negative(g[:, :f])  # (T, F)
    np.exp(out, out=out)
    out += 1.0  # a Python float keeps out's dtype (NEP 50), as in reference.model.silu
    np.divide(g[:, :f], out, out=out)
    out *= g[:, f:]
    return out.astype(gate_up.dtype, copy=False)


def act_and_mul(gate_up: np.ndarray, activation: str = "silu") -> np.ndarray:
    # gate_up: (T, 2F) -> act(gate) * up, (T, F); silu in one buffer, the GELUs as the reference
    if activation == "silu":
        return silu_and_mul(gate_up)
    f = gate_up.shape[-1] // 2
    g = _f(gate_up)
    return (ACTIVATIONS[activation](g[:, :f]) * g[:, f:]).astype(gate_up.dtype, copy=False)


def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Write each token's K and V (T, Hkv, hd) into its slot of the (N, bs, Hkv, hd) caches,
    rounded to the cache's dtype (to nearest even; an 8-bit float saturates at its largest
    finite value, infinities too, as vLLM's fp8 cache does)."""
    if slot_mapping.min(initial=0) < 0:  # padding slots: drop them
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    top = FP8_MAX.get(k_cache.dtype.name)
    if top is not None:  # only the rows written
        k, v = (np.clip(_f(a), -top, top) for a in (k, v))
    k_cache.reshape(-1, *k_cache.shape[2:])[slot_mapping] = k  # (N*bs, Hkv, hd) view
    v_cache.reshape(-1, *v_cache.shape[2:])[slot_mapping] = v


_rope_memo: dict = {}  # (head_dim, rope, dtype) -> (positions array, (cos, sin))


def _cos_sin(positions: np.ndarray, head_dim: int, rope, dtype):
    """cos/sin (T, hd) for ``positions``, computed once per forward (the array is shared) for
    each RoPE the layers use (Gemma 3's sliding and full layers: two)."""
    key = (head_dim, rope, np.dtype(dtype))
    memo = _rope_memo.get(key)
    if memo is None or memo[0] is not positions:
        if len(_rope_memo) >= 4:
            _rope_memo.clear()
        _rope_memo[key] = memo = (positions, rope_cos_sin(positions, head_dim, rope, dtype))
    return memo[1]


def rotary(q: np.ndarray, k: np.ndarray, positions: np.ndarray, rope):
    # q: (T, H, hd), k: (T, Hkv, hd), positions: (T,) -> rotated (q, k), rotate-half layout;
    # rope: a model_loader.rope.RopeParams or a bare theta
    cos, sin = _cos_sin(positions, q.shape[-1], rope, _f(q).dtype)  # (T, hd)
    q_out = apply_rope(_f(q), cos, sin).astype(q.dtype, copy=False)
    k_out = apply_rope(_f(k), cos, sin).astype(k.dtype, copy=False)
    return q_out, k_out


def _gather(cache: np.ndarray, blocks: np.ndarray, length: int) -> np.ndarray:
    # cache: (N, bs, Hkv, hd), blocks: (nb,) -> (length, Hkv, hd) in compute dtype
    return _f(cache[blocks].reshape(-1, *cache.shape[2:])[:length])


def _softmax_(s: np.ndarray, sink: np.ndarray | None = None) -> np.ndarray:
    """In-place softmax over the last axis; ``sink`` (s.shape[:-1]) given, each row has one
    more logit (gpt-oss's attention sink) that takes its share and is left out."""
    m = s.max(axis=-1, keepdims=True)
    if sink is not None:
        m = np.maximum(m, sink[..., None])
    s -= m
    np.exp(s, out=s)
    total = s.sum(axis=-1, keepdims=True)
    if sink is not None:
        total += np.exp(sink[..., None] - m)
    s /= total
    return s


_bias_memo: list = [np.zeros((0, 0), np.float32)]


def _causal_bias(n: int) -> np.ndarray:
    """(n, n) float32: 0 on and below the diagonal, -inf above (a query sees no later key)."""
    if _bias_memo[0].shape[0] < n:
        _bias_memo[0] = np.triu(np.full((n, n), -np.inf, dtype=np.float32), k=1)
    return _bias_memo[0][:n, :n]


def _window_bias(tq: int, q_start: int, k_start: int, n_keys: int, window: int) -> np.ndarray:
    """(Tq, S) float32: 0 where query q_start+i sees key k_start+j (causal, inside the window)."""
    q_pos = q_start + np.arange(tq)[:, None]  # (Tq, 1)
    k_pos = k_start + np.arange(n_keys)[None, :]  # (1, S)
    visible = (k_pos <= q_pos) & (k_pos > q_pos - window)
    return np.where(visible, np.float32(0), np.float32(-np.inf))


def _softcap_(s: np.ndarray, cap: float) -> np.ndarray:
    """In place: tanh(s / cap) * cap (Gemma 2's attention soft-capping); cap 0: s as it is."""
    if cap:
        s /= np.float32(cap)
        np.tanh(s, out=s)
        s *= np.float32(cap)
    return s


def _attend_causal(q, k, v, q_start, scale, window=0, k_start=0, softcap=0.0, sinks=None):
    """q: (Tq, H, hd) at positions q_start..; k, v: (q_start+Tq-k_start, Hkv, hd), the keys
    from position k_start on -> (Tq, H, hd). window > 0: a query at p sees keys > p - window;
    softcap > 0: scores soft-capped at it before the mask; sinks (H,): each head's sink."""
    tq, n_heads, hd = q.shape
    n_kv = k.shape[1]
    group = n_heads // n_kv
    # (Hkv, group*Tq, hd): the query rows of every head that reads K/V head j, stacked
    qg = _f(q).reshape(tq, n_kv, group, hd).transpose(1, 2, 0, 3).reshape(n_kv, group * tq, hd)
    s = np.matmul(qg, k.transpose(1, 2, 0))  # (Hkv, group*Tq, S)
    s *= np.float32(scale)
    _softcap_(s, softcap)
    if window:
        s.reshape(n_kv, group, tq, -1)[...] += _window_bias(
            tq, q_start, k_start, k.shape[0], window
        )
    elif tq > 1:  # keys before q_start are all visible: only the trailing (Tq, Tq) square masked
        s.reshape(n_kv, group, tq, -1)[..., q_start:] += _causal_bias(tq)
    sink = None  # (Hkv, group*Tq): each row's head's sink
    if sinks is not None:
        sink = np.repeat(_f(sinks).reshape(n_kv, group), tq, axis=1)
    out = np.matmul(_softmax_(s, sink), v.transpose(1, 0, 2))  # (Hkv, group*Tq, hd)
    return out.reshape(n_kv, group, tq, hd).transpose(2, 0, 1, 3).reshape(tq, n_heads, hd)


def paged_attention_decode(
    q, k_cache, v_cache, block_tables, context_lens, scale, window=0, softcap=0.0, sinks=None
):
    """One query row per sequence. q: (B, H, hd); block_tables: (B, M); context_lens: (B,).
    Query b sits at position context_lens[b]-1 and sees every cached token, or with window > 0
    the last ``window`` of them; softcap > 0: scores soft-capped at it; sinks (H,): each head's
    sink logit in its softmax (gpt-oss). -> (B, H, hd)

    NOTE: a per-sequence loop with as few NumPy calls as possible. The gathers of K and V are
    most of its time (memory bound); gathering many sequences at once, or one padded batch
    with batched matmuls over (B, Hkv, group, S), was measured slower on SmolLM2 shapes (the
    gathered rows no longer stay in cache for the two products that read them)."""
    n_seqs, n_heads, hd = q.shape
    n_kv, bs = k_cache.shape[2], k_cache.shape[1]
    qg = _f(q).reshape(n_seqs, n_kv, n_heads // n_kv, hd)  # (B, Hkv, group, hd)
    out = np.empty(qg.shape, dtype=qg.dtype)  # (B, Hkv, group, hd)
    sink = None if sinks is None else _f(sinks).reshape(n_kv, -1)  # (Hkv, group)
    for b, n in enumerate(context_lens.tolist()):
        lo = max(0, n - window) // bs * bs if window else 0  # first key of the first block read
        blocks = block_tables[b, lo // bs : cdiv(n, bs)]  # (nb,)
        k, v = _gather(k_cache, blocks, n - lo), _gather(v_cache, blocks, n - lo)  # (n-lo, ..)
        if window and n - lo > window:
            k, v = k[n - lo - window :], v[n - lo - window :]  # (window, Hkv, hd)
        s = np.matmul(qg[b], k.transpose(1, 2, 0))  # (Hkv, group, S)
        s *= np.float32(scale)
        np.matmul(_softmax_(_softcap_(s, softcap), sink), v.transpose(1, 0, 2), out=out[b])
    return out.reshape(q.shape).astype(q.dtype, copy=False)


def paged_attention_prefill(
    q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, window=0, softcap=0.0,
    sinks=None,
):  # fmt: skip
    """Causal attention for variable-length query runs over paged K/V (already written).
    q: (T, H, hd); sequence b's queries are rows qsl[b]:qsl[b+1], the last q_len of its
    context_lens[b] tokens; window > 0: a query at p sees keys > p - window; softcap > 0:
    scores soft-capped at it; sinks (H,): each head's sink logit. -> (T, H, hd)"""
    out = np.empty(q.shape, dtype=q.dtype)
    bs = k_cache.shape[1]
    qsl = query_start_loc.tolist()
    for b, n in enumerate(context_lens.tolist()):
        lo, hi = qsl[b], qsl[b + 1]
        start = n - (hi - lo)  # position of row lo
        # the first block read: the one of row lo's first visible key (blocks before it may
        # be given back: their table entries are never read)
        first = max(0, start - window + 1) // bs * bs if window else 0
        blocks = block_tables[b, first // bs : cdiv(n, bs)]
        k, v = _gather(k_cache, blocks, n - first), _gather(v_cache, blocks, n - first)
        for c in range(lo, hi, QUERY_CHUNK):  # k, v: (n - first, Hkv, hd), keys first..n-1
            e = min(c + QUERY_CHUNK, hi)
            # keys past the chunk's last query are masked anyway: slice them off
            kv_len, q0 = start + (e - lo), start + (c - lo)
            k0 = max(0, q0 - window + 1) if window else 0  # keys below every row's window: off
            out[c:e] = _attend_causal(
                q[c:e],
                k[k0 - first : kv_len - first],
                v[k0 - first : kv_len - first],
                q0,
                scale,
                window,
                k0,
                softcap,
                sinks,
            )
    return out
