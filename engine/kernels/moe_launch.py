"""Checked launches of a mixture of experts' kernels (cuda_src/moe_route.cu, moe_align.cu,
moe_matmul.cu, moe_combine.cu, act_and_mul.cu's clamped SwiGLU; add_bias.cu, gpt-oss's o projection
bias; olmoe_qkv.cu, OLMoE's whole q and k norms and clip_qkv): ``MoeLaunches`` is a part of
``Kernels`` (its ``_fn`` loader and ``_rows``).

A layer of experts per step, T tokens, each running its top k of E experts (P = T * k pairs):
  moe_route    h (T, D) -> ids (T, k), weights (T, k) float32 (and a shared expert's gate (T,))
  moe_align    ids -> sorted (P,), inverse (P,), offsets (E + 1,): the pairs bucketed by expert
  moe_matmul   every expert's rows through its (N, K) matrix, the rows in sorted order
  moe_combine  each token's k rows weighted and summed (plus the shared expert's gated row)
Every kernel reads only device arrays, with no host synchronisation, so a decode graph captures
a layer of experts like any other.
"""

from __future__ import annotations

import numpy as np

from engine.kernels.checks import check as _check
from engine.kernels.checks import finite as _finite
from engine.kernels.checks import suffix as _suffix
from engine.utils import cdiv

MOE_MAX_TOP_K = 32  # moe_route.cu kMaxTopK
MOE_COLS = 64  # moe_matmul.cu kMoeCols: columns per block
MOE_TILE_ROWS = 16  # moe_matmul.cu kMoeRows: an expert's weights are read once per 16 rows
MOE_THREADS = 256  # moe_matmul.cu kMoeThreads
ROUTE_THREADS = 256
ALIGN_THREADS = 256
COMBINE_THREADS = 128
MXFP4_BLOCK = (32, 17)  # values and bytes of a GGUF MXFP4 block
CLAMPED_SWIGLU = 3  # act_and_mul.cu's id of gpt-oss's activation
WEIGHT_FORMATS = {"dtype": 0, "mxfp4": 1}  # moe_matmul.cu's format argument
i32, f32 = np.int32, np.float32


class MoeLaunches:
    def moe_route(self, ids, weights, h, router, top_k: int, renormalize: bool, bias=None,
                  gate=None) -> None:  # fmt: skip
        """ids (T, k) int32 and weights (T, k) float32 = the top k of softmax(h @ router[:E].T
        (+ bias)), the most probable first, equal ones by lower index, renormalized to sum to
        one where asked. router (E, D) float32, or (E + 1, D) with ``gate`` (T,) float32:
        gate = sigmoid(h @ router[E]) (a shared expert's)."""
        op = "moe_route"
        T, D = h.shape
        E = router.shape[0] - (gate is not None) if hasattr(router, "shape") else 0
        if not 1 <= top_k <= min(E, MOE_MAX_TOP_K):
            raise ValueError(f"{op}: top_k must be in [1, min(E, {MOE_MAX_TOP_K})], got {top_k}")
        _check(op, "h", h, (T, D))
        _check(op, "router", router, (E + (gate is not None), D), np.float32)
        _check(op, "ids", ids, (T, top_k), np.int32)
        _check(op, "weights", weights, (T, top_k), np.float32)
        flags = 4 if renormalize else 0
        if bias is not None:
            _check(op, "bias", bias, (E,), np.float32)
            flags |= 1
        if gate is not None:
            _check(op, "gate", gate, (T,), np.float32)
            flags |= 2
        if T:
            unused = weights  # a pointer the kernel does not read without its flag
            args = (ids, weights, unused if gate is None else gate, h, router)
            args += (unused if bias is None else bias, i32(D), i32(E), i32(top_k), i32(flags))
            shared = 4 * (E + 1)
            self._fn(op, f"{op}_{_suffix(op, h)}")((T,), (ROUTE_THREADS,), args, shared_mem=shared)

    def moe_align(self, sorted_pairs, inverse, offsets, totals, ids, slots) -> None:
        """The pairs of ids (T, k) (pair t*k + j) bucketed by expert: offsets (E + 1,) int32,
        expert e's pairs sorted_pairs[offsets[e]:offsets[e + 1]], inverse[p] the position of
        pair p; totals (E,) uint64 += each expert's pairs whose token's slot (T,) is >= 0."""
        op = "moe_align"
        E = totals.shape[0] if hasattr(totals, "shape") else 0
        T, k = ids.shape if getattr(ids, "ndim", 0) == 2 else (0, 0)
        P = T * k
        _check(op, "ids", ids, (T, k), np.int32)
        _check(op, "slots", slots, (T,), np.int32)
        _check(op, "totals", totals, (E,), np.uint64)
        _check(op, "offsets", offsets, (E + 1,), np.int32)
        _check(op, "sorted_pairs", sorted_pairs, (P,), np.int32)
        _check(op, "inverse", inverse, (P,), np.int32)
        if E < 1:
            raise ValueError(f"{op}: totals must have one entry per expert, got {E}")
        args = (sorted_pairs, inverse, offsets, totals, ids, slots, i32(P), i32(E), i32(max(k, 1)))
        self._fn(op, f"{op}_f32")((1,), (ALIGN_THREADS,), args, shared_mem=12 * E)

    def moe_matmul(self, out, x, w, sorted_pairs, offsets, gather: int, bias=None,
                   fmt: str = "dtype") -> None:  # fmt: skip
        """out[p] = x[src(p)] @ W[e].T (+ bias[e]) for every expert e and position p of its
        range, src(p) = sorted_pairs[p] // gather when gather > 0, else p. W (E, N, K): ``w`` in
        x's dtype, or with fmt "mxfp4" (E, N, K / 32 * 17) uint8 GGUF MXFP4 blocks. out (P, N) in
        x's dtype or float32; bias (E, N) float32."""
        op = "moe_matmul"
        K = x.shape[1] if getattr(x, "ndim", 0) == 2 else 0
        if fmt not in WEIGHT_FORMATS:
            raise ValueError(f"{op}: fmt must be one of {', '.join(WEIGHT_FORMATS)}, got {fmt!r}")
        E, N = (w.shape[0], w.shape[1]) if getattr(w, "ndim", 0) == 3 else (0, 0)
        if fmt == "mxfp4":
            if K % MXFP4_BLOCK[0]:
                raise ValueError(f"{op}: mxfp4 rows must be whole blocks of 32, got K={K}")
            _check(op, "w", w, (E, N, K // MXFP4_BLOCK[0] * MXFP4_BLOCK[1]), np.uint8)
        else:
            _check(op, "w", w, (E, N, K), x.dtype)
        P = sorted_pairs.shape[0] if hasattr(sorted_pairs, "shape") else 0
        _check(op, "x", x, (None, K))
        _check(op, "sorted_pairs", sorted_pairs, (P,), np.int32)
        _check(op, "offsets", offsets, (E + 1,), np.int32)
        _check(op, "out", out, (P, N))
        out_f32 = np.dtype(out.dtype) == np.float32
        if not out_f32 and np.dtype(out.dtype) != np.dtype(x.dtype):
            raise ValueError(f"{op}: out must be {x.dtype} or float32, got {out.dtype}")
        if not (isinstance(gather, int | np.integer) and gather >= 0):
            raise ValueError(f"{op}: gather must be an int >= 0, got {gather!r}")
        if bias is not None:
            _check(op, "bias", bias, (E, N), np.float32)
        flags = (1 if bias is not None else 0) | (2 if out_f32 else 0)
        if P and N:
            args = (out, x, w, out if bias is None else bias, sorted_pairs, offsets, i32(N))
            args += (i32(K), i32(gather), i32(WEIGHT_FORMATS[fmt]), i32(flags))
            grid = (cdiv(N, MOE_COLS), E)
            self._fn(op, f"{op}_{_suffix(op, x)}")(grid, (MOE_THREADS,), args)

    def moe_combine(self, out, y, weights, inverse, gate=None, shared=None) -> None:
        """out (T, D) = each token's k rows of y (P, D) float32 (at inverse[t*k + j]) times
        weights (T, k), summed in j order, plus gate (T,) * shared (T, D) where given."""
        op = "moe_combine"
        T, k = weights.shape if getattr(weights, "ndim", 0) == 2 else (0, 0)
        D = out.shape[1] if getattr(out, "ndim", 0) == 2 else 0
        _check(op, "weights", weights, (T, k), np.float32)
        _check(op, "y", y, (T * k, D), np.float32)
        _check(op, "inverse", inverse, (T * k,), np.int32)
        _check(op, "out", out, (T, D))
        if (gate is None) != (shared is None):
            raise ValueError(f"{op}: gate and shared go together")
        if gate is not None:
            _check(op, "gate", gate, (T,), np.float32)
            _check(op, "shared", shared, (T, D), out.dtype)
        if T:
            args = (out, y, weights, inverse, weights if gate is None else gate)
            args += (out if shared is None else shared, i32(D), i32(k), i32(gate is not None))
            self._fn(op, f"{op}_{_suffix(op, out)}")((T,), (COMBINE_THREADS,), args)

    def olmoe_qkv(self, qkv, q_dim: int, kv_dim: int, q_norm=None, k_norm=None,
                  eps: float = 1e-5, clip: float | None = None) -> None:  # fmt: skip
        """OLMoE's q | k | v rows (T, q_dim + 2 kv_dim) in place: with q_norm (q_dim,) and
        k_norm (kv_dim,) the q and k parts RMS-normed as wholes; with clip every value clamped
        to +-clip."""
        op = "olmoe_qkv"
        T = qkv.shape[0] if getattr(qkv, "ndim", 0) == 2 else 0
        _check(op, "qkv", qkv, (T, q_dim + 2 * kv_dim))
        if (q_norm is None) != (k_norm is None):
            raise ValueError(f"{op}: q_norm and k_norm go together")
        flags = 0
        if q_norm is not None:
            _check(op, "q_norm", q_norm, (q_dim,), qkv.dtype)
            _check(op, "k_norm", k_norm, (kv_dim,), qkv.dtype)
            flags |= 1
        if clip is not None:
            if _finite(op, "clip", clip) <= 0:
                raise ValueError(f"{op}: clip must be > 0, got {clip}")
            flags |= 2
        if T and flags:
            norms = (qkv, qkv) if q_norm is None else (q_norm, k_norm)
            args = (qkv, *norms, i32(q_dim), i32(kv_dim), f32(_finite(op, "eps", eps)))
            args += (f32(clip or 0.0), i32(flags))
            self._fn(op, f"{op}_{_suffix(op, qkv)}")((T,), (256,), args)

    def add_bias(self, x, bias) -> None:
        """x (T, N) += bias (N,) float32, rounded once (gpt-oss's o projection)."""
        op = "add_bias"
        T, N = x.shape if getattr(x, "ndim", 0) == 2 else (0, 0)
        _check(op, "x", x, (T, N))
        _check(op, "bias", bias, (N,), np.float32)
        self._rows(op, x, (x, bias))

    def clamped_swiglu(self, out, gate_up, alpha: float, limit: float) -> None:
        """gpt-oss's activation over gate_up (T, 2F) = [gate | up]: gate clamped to <= limit,
        up to [-limit, limit], out = (up + 1) * gate * sigmoid(alpha * gate)."""
        op = "act_and_mul"
        T, F2 = gate_up.shape if getattr(gate_up, "ndim", 0) == 2 else (0, 1)
        _check(op, "gate_up", gate_up, (T, F2))
        if F2 % 2:
            raise ValueError(f"{op}: gate_up width must be even, got {F2}")
        _check(op, "out", out, (T, F2 // 2), gate_up.dtype)
        alpha, limit = _finite(op, "alpha", alpha), _finite(op, "limit", limit)
        if limit <= 0:
            raise ValueError(f"{op}: limit must be > 0, got {limit}")
        self._rows(op, out, (out, gate_up), i32(CLAMPED_SWIGLU), f32(alpha), f32(limit))
