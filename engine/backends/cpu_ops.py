"""The native CPU backend's operations: the functions of ``fast_ops`` (same arguments, same
results within float rounding), the heavy ones run by the kernels of ``cpu_src/``
(``cpu_native``); the rest (embedding, block copies, the GELU activations) are fast_ops' own.

Activations are float32; weights float32, or bf16, int8 or GGUF blocks (``quant.QuantWeight``, for
``matmul``); the KV cache is float32, float16, bfloat16 or an 8-bit float (e4m3, e5m2).
``rotary_cache`` does what ``rotary`` and ``reshape_and_cache`` do in one pass, reading the
cos/sin table that ``fast_ops`` computes once per forward. ``fused_add_rms_norm`` adds into
``residual`` in place (and returns it): the backend's residual is its own array.
"""

from __future__ import annotations

from ctypes import Structure, addressof, c_char, c_int32, c_void_p

import numpy as np

from engine.backends import fast_ops
from engine.backends.base import numpy_dtype
from engine.backends.cpu_native import library, threads
from engine.backends.fast_ops import copy_blocks, embedding  # noqa: F401  (the ops module's whole interface)
from engine.backends.quant import (
    BLOCK_FORMATS,
    IQ4_FORMATS,
    KEPT_BLOCKS,
    KQUANT_FORMATS,
    RAW_FORMATS,
    QuantWeight,
)

F32 = np.dtype(np.float32)
F16 = np.dtype(np.float16)
BF16 = numpy_dtype("bfloat16")
# the cache dtypes' codes in cpu_src/common.h (a dict of dtypes: dtype.name is 5 us)
CACHE_DTYPES = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, BF16: 2}
CACHE_DTYPES |= {numpy_dtype("fp8_e4m3"): 3, numpy_dtype("fp8_e5m2"): 4}


def _p(a: np.ndarray | None) -> int | None:
    """The address of a contiguous array's data. Through ctypes' buffer view (about 1 us);
    ``a.ctypes.data`` (3 us) for what that refuses (read-only or empty arrays): a decode step
    takes the address of about 1,300 arrays at batch 1."""
    if a is None:
        return None
    try:
        return addressof(c_char.from_buffer(a))
    except (TypeError, ValueError):
        return a.ctypes.data


class Matrix(Structure):  # cpu_src/decode_layers.cpp: Matrix, a weight as the step sees it
    _fields_ = [("kind", c_int32), ("pad", c_int32), ("data", c_void_p), ("scales", c_void_p)]


# QuantWeight kind -> decode_layers.cpp's: W_BF16, W_INT8, W_BLOCKS + the block format,
# W_PANELS, W_BF16_PANELS, W_INT8_PANELS (a plain float32 array: W_F32, 0)
KINDS = {"bf16": 1, "int8": 2} | {f: 3 + i for i, f in enumerate(BLOCK_FORMATS)}
KINDS |= {"panels": 6, "bf16_panels": 7, "int8_panels": 8}
KINDS |= {f: 9 + i for i, f in enumerate(RAW_FORMATS[:5])} | {"parts": 14}  # W_RAW.., W_PARTS
KINDS |= {"q4_z": 15, "fp8": 16, "mxfp4": 17}  # W_Q4Z, W_FP8, W_MXFP4
KINDS |= {"iq4_nl": 18, "iq4_xs": 19}  # W_IQ4_NL, W_IQ4_XS
KINDS |= {"q2_k": 20, "q3_k": 21}  # W_Q2_K, W_Q3_K


def matrix(w: np.ndarray | QuantWeight) -> Matrix:
    """A weight's kind and pointers for the native step (the arrays must outlive it; a
    "parts" weight keeps its parts' Matrix array and widths on itself)."""
    if not isinstance(w, QuantWeight):
        return Matrix(0, 0, _p(w), None)
    if w.kind == "parts":
        if getattr(w, "_native", None) is None:
            parts = (Matrix * len(w.parts))(*(matrix(p) for p in w.parts))
            widths = np.array([p.shape[1] for p in w.parts], np.int64)  # (parts,)
            w._native = (parts, widths)
        parts, widths = w._native
        return Matrix(KINDS["parts"], len(w.parts), addressof(parts), _p(widths))
    pad = w.scales.shape[1] if w.kind == "fp8" else 0  # FP8: its scales a row
    return Matrix(KINDS[w.kind], pad, _p(w.data), _p(w.scales))


def _c32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=F32)


def _i32(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int32)


def _cache_code(cache: np.ndarray) -> int:
    code = CACHE_DTYPES.get(cache.dtype)
    if code is None or not cache.flags.c_contiguous:
        raise ValueError(
            f"a KV cache must be contiguous float32/float16/bfloat16/float8, got {cache.dtype}"
        )
    return code


def _pool(k_cache: np.ndarray, v_cache: np.ndarray) -> tuple[int, int, int]:
    """(dtype code, block size, KV heads) of a layer's (N, bs, Hkv, hd) K and V caches, both
    checked."""
    _cache_code(v_cache)
    return _cache_code(k_cache), k_cache.shape[1], k_cache.shape[2]


def _check(status: int, name: str, shape) -> None:
    if status:
        raise ValueError(f"{name}: shape {shape} is beyond the native kernel's limits")


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, offset: float = 0.0) -> np.ndarray:
    # x: (T, D), weight: (D,) -> (T, D) float32, scaled by (offset + weight)
    x, w = _c32(x), _c32(weight + np.float32(offset) if offset else weight)
    out = np.empty_like(x)  # (T, D)
    library().fused_add_rms_norm(
        _p(out), _p(x), None, _p(w), eps, x.shape[0], x.shape[1], threads()
    )
    return out


def fused_add_rms_norm(x, residual, weight, eps, offset: float = 0.0):
    """residual += x (in place when it is a contiguous float32 array); -> (rms_norm(residual),
    residual). x, residual: (T, D)."""
    x, w = _c32(x), _c32(weight + np.float32(offset) if offset else weight)
    residual = _c32(residual)
    out = np.empty_like(x)  # (T, D)
    n, d = x.shape
    library().fused_add_rms_norm(_p(out), _p(x), _p(residual), _p(w), eps, n, d, threads())
    return out, residual


def argmax_rows(logits: np.ndarray) -> np.ndarray:
    """(B, V) -> (B,) int32 first argmax of each row, NaN ignored; -1 where no value is above
    -inf (base.greedy_ids in one pass over the logits and no temporaries)."""
    logits = _c32(logits)
    ids = np.empty(logits.shape[0], np.int32)  # (B,)
    library().argmax_rows(_p(ids), _p(logits), logits.shape[0], logits.shape[1], threads())
    return ids


def silu_and_mul(gate_up: np.ndarray) -> np.ndarray:
    # gate_up: (T, 2F), gate first then up -> (T, F) float32
    gate_up = _c32(gate_up)
    n, f = gate_up.shape[0], gate_up.shape[1] // 2
    out = np.empty((n, f), F32)  # (T, F)
    library().silu_and_mul(_p(out), _p(gate_up), n, f, threads())
    return out


def act_and_mul(gate_up: np.ndarray, activation: str = "silu") -> np.ndarray:
    # gate_up: (T, 2F) -> act(gate) * up, (T, F); the GELUs are fast_ops'
    if activation == "silu":
        return silu_and_mul(gate_up)
    return fast_ops.act_and_mul(gate_up, activation)


def rotary(q: np.ndarray, k: np.ndarray, positions: np.ndarray, rope):
    return fast_ops.rotary(q, k, positions, rope)


def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    fast_ops.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)


def rotary_cache(
    qkv,
    positions,
    rope,
    k_cache,
    v_cache,
    slot_mapping,
    num_heads: int,
    bias=None,
    q_norm=None,
    k_norm=None,
    eps: float = 1e-6,
) -> np.ndarray:
    """qkv (T, (H + 2 Hkv) hd) rows q | k | v: + bias if given, q and k heads RMS-normed with
    q_norm and k_norm (hd,) if given, then rotated; k and v written into their slots of the
    (N, bs, Hkv, hd) caches (slot < 0 skipped) -> rotated q (T, H, hd) float32.
    rope: a model_loader.rope.RopeParams or a bare theta."""
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm go together")
    qkv = _c32(qkv)
    n, (hkv, hd) = qkv.shape[0], k_cache.shape[2:]
    cos, sin = fast_ops._cos_sin(positions, hd, rope, F32)  # (T, hd) each
    cos, sin = _c32(cos), _c32(sin)
    q = np.empty((n, num_heads, hd), F32)  # (T, H, hd)
    code = _pool(k_cache, v_cache)[0]
    bias, q_norm, k_norm = (None if a is None else _c32(a) for a in (bias, q_norm, k_norm))
    slots = _i32(slot_mapping)
    status = library().rotary_cache(
        _p(q), _p(k_cache), _p(v_cache), code, _p(qkv), _p(bias), _p(cos), _p(sin), _p(slots),
        _p(q_norm), _p(k_norm), eps, n, num_heads, hkv, hd, threads(),
    )  # fmt: skip
    _check(status, "rotary_cache", qkv.shape)
    return q


def paged_attention_decode(
    q, k_cache, v_cache, block_tables, context_lens, scale, window=0, softcap=0.0, sinks=None
):
    """One query row per sequence. q: (B, H, hd); block_tables: (B, M); context_lens: (B,).
    Query b sits at position context_lens[b]-1 and sees every cached token, or with window > 0
    the last ``window`` of them; softcap > 0 soft-caps the scores; sinks (H,) float32: each
    head's sink logit (gpt-oss). -> (B, H, hd) float32"""
    q, tables, lens = _c32(q), _i32(block_tables), _i32(context_lens)
    b, h, hd = q.shape
    out = np.empty_like(q)  # (B, H, hd)
    if b == 0:
        return out
    code, bs, hkv = _pool(k_cache, v_cache)
    status = library().paged_attention_decode(
        _p(out), _p(q), _p(k_cache), _p(v_cache), code, _p(tables), _p(lens), b,
        tables.shape[1], h, hkv, hd, bs, scale, window, softcap, _sinks(sinks, h), threads(),
    )  # fmt: skip
    _check(status, "paged_attention_decode", q.shape)
    return out


def paged_attention_prefill(
    q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, window=0, softcap=0.0,
    sinks=None,
):  # fmt: skip
    """Causal attention for variable-length query runs over paged K/V (already written).
    q: (T, H, hd); sequence b's queries are rows qsl[b]:qsl[b+1], the last q_len of its
    context_lens[b] tokens; window > 0: a query at p sees keys > p - window; softcap > 0
    soft-caps the scores; sinks (H,): each head's sink logit. -> (T, H, hd)"""
    q, tables, lens = _c32(q), _i32(block_tables), _i32(context_lens)
    qsl = _i32(query_start_loc)
    t, h, hd = q.shape
    out = np.empty_like(q)  # (T, H, hd)
    if t == 0:
        return out
    code, bs, hkv = _pool(k_cache, v_cache)
    status = library().paged_attention_prefill(
        _p(out), _p(q), _p(k_cache), _p(v_cache), code, _p(tables), _p(qsl), _p(lens),
        len(lens), tables.shape[1], h, hkv, hd, bs, scale, window, softcap, _sinks(sinks, h),
        threads(),
    )  # fmt: skip
    _check(status, "paged_attention_prefill", q.shape)
    return out


def _sinks(sinks: np.ndarray | None, heads: int):
    """The kernels' sinks pointer: a (H,) float32 array's, or None (no sinks)."""
    if sinks is None:
        return None
    if sinks.shape != (heads,) or sinks.dtype != np.float32 or not sinks.flags.c_contiguous:
        raise ValueError(f"attention sinks must be ({heads},) contiguous float32, got "
                         f"{sinks.shape} {sinks.dtype}")  # fmt: skip
    return _p(sinks)


def matmul(x: np.ndarray, w: np.ndarray | QuantWeight) -> np.ndarray:
    """x (M, K) @ w (K, N) -> (M, N) float32, on the kernels' threads. w: float32, or a
    QuantWeight (float32 in panels, bf16, int8 with per-column scales, a GGUF block format)
    multiplied as its dequantized values; bf16 in panels multiplies bf16(x)."""
    x = _c32(x)
    m, k = x.shape
    if len(w.shape) != 2 or w.shape[0] != k:
        raise ValueError(f"matmul: x is {x.shape}, the weight {w.shape}; expected (M, K) @ (K, N)")
    n, lib = w.shape[1], library()
    out = np.empty((m, n), F32)  # (M, N)
    if not isinstance(w, QuantWeight):
        lib.matmul_f32(_p(out), _p(x), _p(_c32(w)), m, k, n, threads())
    elif w.kind == "panels":
        lib.matmul_panels_f32(_p(out), _p(x), _p(_contiguous(w.data, F32)), m, k, n, threads())
    elif w.kind == "int8_panels":
        data, scales = _contiguous(w.data, np.dtype(np.int8)), _contiguous(w.scales, F32)
        lib.matmul_panels_int8(_p(out), _p(x), _p(data), _p(scales), m, k, n, threads())
    elif w.kind == "bf16_panels":
        data = _contiguous(w.data, BF16)
        lib.matmul_panels_bf16(_p(out), _p(x), _p(data), m, k, n, threads())
    elif w.kind == "bf16":
        lib.matmul_bf16(_p(out), _p(x), _p(_contiguous(w.data, BF16)), m, k, n, threads())
    elif w.kind == "int8":
        data, scales = _contiguous(w.data, np.dtype(np.int8)), _contiguous(w.scales, F32)
        assert scales.shape == (n,), "an int8 weight has one scale per column"
        lib.matmul_int8(_p(out), _p(x), _p(data), _p(scales), m, k, n, threads())
    elif w.kind in KEPT_BLOCKS:
        data = _contiguous(w.data, np.dtype(np.int8 if w.kind == "q8_0" else np.uint8))
        scales = _contiguous(w.scales, F16)
        fmt = KEPT_BLOCKS.index(w.kind)
        _check(lib.matmul_blocks(_p(out), _p(x), _p(data), _p(scales), fmt, m, k, n, threads()),
               f"matmul ({w.kind})", (m, k, n))  # fmt: skip
    elif w.kind == "mxfp4":
        data = _contiguous(w.data, np.dtype(np.uint8))
        _check(lib.matmul_mxfp4(_p(out), _p(x), _p(data), m, k, n, threads()),
               "matmul (mxfp4)", (m, k, n))  # fmt: skip
    elif w.kind in IQ4_FORMATS:
        data, fmt = _contiguous(w.data, np.dtype(np.uint8)), IQ4_FORMATS.index(w.kind)
        _check(lib.matmul_iq4(_p(out), _p(x), _p(data), fmt, m, k, n, threads()),
               f"matmul ({w.kind})", (m, k, n))  # fmt: skip
    elif w.kind in KQUANT_FORMATS:
        data, fmt = _contiguous(w.data, np.dtype(np.uint8)), KQUANT_FORMATS.index(w.kind)
        _check(lib.matmul_kquants(_p(out), _p(x), _p(data), fmt, m, k, n, threads()),
               f"matmul ({w.kind})", (m, k, n))  # fmt: skip
    elif w.kind in RAW_FORMATS:  # Q5_0, Q5_1
        data, fmt = _contiguous(w.data, np.dtype(np.uint8)), RAW_FORMATS.index(w.kind) - 3
        _check(lib.matmul_q5(_p(out), _p(x), _p(data), fmt, m, k, n, threads()),
               f"matmul ({w.kind})", (m, k, n))  # fmt: skip
    elif w.kind == "fp8":
        data, scales = _contiguous(w.data, np.dtype(np.uint8)), _contiguous(w.scales, F32)
        _check(lib.matmul_fp8(_p(out), _p(x), _p(data), _p(scales), scales.shape[1], m, k, n,
                              threads()), "matmul (fp8)", (m, k, n))  # fmt: skip
    elif w.kind == "parts":
        mat = matrix(w)  # (alive through the call)
        _check(lib.matmul_matrix(_p(out), _p(x), addressof(mat), m, k, n, threads()),
               f"matmul ({w.kind})", (m, k, n))  # fmt: skip
    else:
        raise ValueError(f"matmul: unknown weight kind {w.kind!r}")
    return out


# the activations of the native gated MLPs (cpu_src/moe_experts.cpp's act ids, which
# decode_layers.cpp takes too); 3: gpt-oss's clamped SwiGLU, moe_experts only
NATIVE_ACTS = {"silu": 0, "gelu_tanh": 1, "gelu": 2}
SWIGLU_CLAMP = 3


def experts(h, layer, tokens, pair_w, offsets, act: str) -> np.ndarray | None:
    """A layer of experts' outputs in one native call (cpu_src/moe_experts.cpp), what
    ``moe.experts_forward``'s loop over the experts computes: h (T, D) normed; the (T*k,)
    pairs sorted by expert, ``tokens`` each one's row of h, ``pair_w`` its weight, expert e's
    ``offsets[e]:offsets[e + 1]`` (E + 1,) -> (T, D) float32; None for an activation it lacks
    or experts of different kinds (the loop runs instead). gpt-oss's experts (``layer.clamp``,
    ``layer.biases``): the clamped SwiGLU and each product's bias, in the same call."""
    code = SWIGLU_CLAMP if layer.clamp else NATIVE_ACTS.get(act)
    if code is None:
        return None
    alpha, limit = layer.clamp or (0.0, 0.0)
    gu_bias = dn_bias = None
    if layer.biases is not None:
        gu_bias, dn_bias = layer.biases[1], layer.biases[2]  # (E, 2F), (E, D) float32
    h = _c32(h)
    (t, d), f = h.shape, layer.down[0].shape[0]
    mats = _expert_matrices(layer)
    if mats is None:
        return None
    gate_up, down = mats
    out = np.zeros((t, d), F32)  # (T, D)
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)  # (E + 1,)
    tokens, pair_w = _i32(tokens), _c32(pair_w)  # (T*k,) each
    status = library().moe_experts(
        _p(out), _p(h), t, d, f, len(layer.down), addressof(gate_up), addressof(down),
        _p(offsets), _p(tokens), _p(pair_w), code, _p(gu_bias), _p(dn_bias), alpha, limit,
        threads(),
    )  # fmt: skip
    _check(status, "moe_experts", (t, d, f))
    return out


def _expert_matrices(layer):
    """A PackedExperts' (E,) Matrix arrays of gate|up and down, made once and kept on it (the
    parts' own arrays alive as long as it is); None where its experts' kinds differ or a plain
    matrix is not contiguous float32 (the loop converts those)."""
    if getattr(layer, "_native", None) is None:
        both = (layer.gate_up, layer.down)
        plain = [w for ws in both for w in ws if not isinstance(w, QuantWeight)]
        ok = all(w.dtype == F32 and w.flags.c_contiguous for w in plain)
        ok = ok and all(len({matrix(w).kind for w in ws}) == 1 for ws in both)
        mats = tuple((Matrix * len(ws))(*map(matrix, ws)) for ws in both) if ok else None
        layer._native = (mats,)
    return layer._native[0]


def _contiguous(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if a.dtype != dtype or not a.flags.c_contiguous:
        raise ValueError(f"a packed weight must be contiguous {dtype}, got {a.dtype}")
    return a
