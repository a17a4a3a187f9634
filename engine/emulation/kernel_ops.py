"""The engine's operations run by the CUDA kernels of ``cuda_src/`` on the CPU.

Same names, arguments and results as ``reference.kernel_ops`` (its twin): each call
launches the kernel through ``engine.kernels`` on the CUDA emulator. Inputs may be float32,
float16 or bfloat16 (ml_dtypes); metadata arrays are converted to int32. Operations that the
kernels do in place (fused_add_rms_norm) work on copies, as the NumPy twins return new
arrays. ``sample_greedy`` launches the argmax kernel (the engine's sampling is the host's,
engine/core/sampler.py).
"""

from __future__ import annotations

import numpy as np

from engine.emulation.kernels import cpu_kernels
from model_loader.rope import rope_table


def _i32(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int32)


def _c(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a)


def embedding(token_ids: np.ndarray, table: np.ndarray, scale: float = 1.0) -> np.ndarray:
    # token_ids: (T,), table: (V, D) -> (T, D) = table rows * scale
    ids = _i32(token_ids)
    if ids.size and (ids.min() < 0 or ids.max() >= table.shape[0]):
        raise ValueError(
            f"token_ids must lie in [0, {table.shape[0]}), got {ids.min()}..{ids.max()}"
        )
    out = np.empty((ids.shape[0], table.shape[1]), table.dtype)  # (T, D)
    cpu_kernels().embedding(out, ids, _c(table), scale)
    return out


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, offset: float = 0.0) -> np.ndarray:
    # x: (T, D), weight: (D,) -> (T, D), scaled by (offset + weight)
    x = _c(x)
    out = np.empty_like(x)  # (T, D)
    cpu_kernels().rms_norm(out, x, _c(weight.astype(x.dtype, copy=False)), eps, offset)
    return out


def fused_add_rms_norm(x, residual, weight, eps, offset: float = 0.0):
    """residual + x, then its rms_norm: returns (normed, new residual), both (T, D)."""
    x = _c(x)
    new_residual = np.array(residual, dtype=x.dtype, order="C")  # (T, D), updated in place
    out = np.empty_like(x)  # (T, D)
    cpu_kernels().fused_add_rms_norm(
        out, new_residual, x, _c(weight.astype(x.dtype, copy=False)), eps, offset
    )
    return out, new_residual


def _table_rows(max_position: int) -> int:
    """Table sizes grow in powers of two, so the cache holds a handful of tables."""
    return max(1024, 1 << int(max_position).bit_length())


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
    """qkv (T, (H + 2 Hkv) hd) rows q | k | v: + bias if given, q and k heads RMS-normed with
    q_norm and k_norm if given, then rotated; k and v written into their slots of the
    (N, bs, Hkv, hd) caches (slot < 0 skipped) -> rotated q (T, H, hd)."""
    pos = _i32(positions)
    if pos.size and pos.min() < 0:
        raise ValueError(f"positions must be >= 0, got {pos.min()}")
    hd = k_cache.shape[-1]
    table = rope_table(_table_rows(pos.max() if pos.size else 0), hd, float(theta))
    q = np.empty((qkv.shape[0], num_heads, hd), k_cache.dtype)  # (T, H, hd)
    args = (_as(qkv, k_cache.dtype), pos, _i32(slot_mapping), table)
    weights = [None if w is None else _as(w, k_cache.dtype) for w in (bias, q_norm, k_norm)]
    cpu_kernels().rotary_cache(q, k_cache, v_cache, *args, *weights, eps)
    return q


def act_and_mul(gate_up: np.ndarray, activation: str = "silu") -> np.ndarray:
    # gate_up: (T, 2F), gate first then up -> (T, F) = act(gate) * up
    gate_up = _c(gate_up)
    out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), gate_up.dtype)  # (T, F)
    cpu_kernels().act_and_mul(out, gate_up, activation)
    return out


def silu_and_mul(gate_up: np.ndarray) -> np.ndarray:
    # gate_up: (T, 2F), gate first then up -> (T, F)
    return act_and_mul(gate_up, "silu")


def _as(a: np.ndarray, dtype) -> np.ndarray:
    """Contiguous in ``dtype`` (float32 activations meet a 16-bit cache: rounded, as NumPy's
    assignment into the cache rounds)."""
    return np.ascontiguousarray(a, dtype=dtype)


def paged_attention_decode(
    q, k_cache, v_cache, block_tables, context_lens, scale, window=0, softcap=0.0, sinks=None
):
    """One query row per sequence, q: (B, H, hd), over its paged context (the last ``window``
    tokens of it with a window > 0; scores soft-capped with softcap > 0) -> (B, H, hd). A q
    of another dtype than the cache is rounded to the cache's (the kernels take one dtype)."""
    q_dtype, q, lens = q.dtype, _as(q, k_cache.dtype), _i32(context_lens)
    out = np.empty_like(q)  # (B, H, hd)
    max_len = int(lens.max()) if lens.size else 0
    cpu_kernels().paged_attention_decode(
        out,
        q,
        k_cache,
        v_cache,
        _i32(block_tables),
        lens,
        scale,
        max_len,
        window=window,
        softcap=softcap,
        sinks=None if sinks is None else np.ascontiguousarray(sinks, dtype=np.float32),
    )
    return out.astype(q_dtype, copy=False)


def paged_attention_prefill(
    q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, window=0, softcap=0.0,
    sinks=None,
):  # fmt: skip
    """Causal attention for variable-length query runs over paged K/V (a sliding window with
    window > 0, scores soft-capped with softcap > 0) -> (T, H, hd)."""
    q_dtype, q = q.dtype, _as(q, k_cache.dtype)
    out = np.empty_like(q)  # (T, H, hd)
    cpu_kernels().paged_attention_prefill(
        out,
        q,
        k_cache,
        v_cache,
        _i32(block_tables),
        _i32(query_start_loc),
        _i32(context_lens),
        scale,
        window,
        softcap,
        None if sinks is None else np.ascontiguousarray(sinks, dtype=np.float32),
    )
    return out.astype(q_dtype, copy=False)


def copy_blocks(src: np.ndarray, dst: np.ndarray, pairs) -> None:
    """dst[:, :, d] = src[:, :, s] for each (s, d): whole blocks, every layer, K and V."""
    pairs = _i32(np.asarray(pairs).reshape(-1, 2))  # (P, 2)
    if src is dst and np.intersect1d(pairs[:, 0], pairs[:, 1]).size:
        raise ValueError("copy_blocks: a block is both a source and a destination in one pool")
    cpu_kernels().copy_blocks(src, dst, pairs)


# ---- sampling -------------------------------------------------------------------------------


def sample_greedy(logits: np.ndarray) -> np.ndarray:
    # logits: (B, V) -> (B,) int32 argmax (lowest index on ties)
    logits = _c(logits)
    out = np.empty(logits.shape[0], np.int32)  # (B,)
    cpu_kernels().sample_greedy(out, logits)
    return out
