"""A layer of experts on the host backends (numpy, cpu): routing and the grouped expert products.

Face: ``pack_experts`` (at load: a LayerWeights' router and stacked experts -> ``PackedExperts``)
and ``experts_forward`` (per step: normed hidden states -> the layer's MLP output), through the
backend's own ``ops`` (``matmul``, ``act_and_mul``), so each backend's product formats apply.

Per step and layer:
  route    router logits h @ W_r in float32 (T, E); softmax over the experts; the top k per token
           (a stable sort of -p: equal probabilities go to the lower expert index, torch.topk's
           order); their weights, renormalized to sum to one where the family says so
  group    the T*k (token, expert) pairs bucketed by expert: a stable argsort of the expert ids
           gives the sorted pairs, bincount the counts, their cumulative sum the offsets
  experts  each expert with rows: its tokens' rows gathered (n_e, D), one gate|up product,
           act(gate) * up, one down product, scaled by each pair's weight and added into its
           token's row (a token picks an expert at most once, so a bucket's rows are distinct),
           the experts in increasing order. An ops with ``experts`` (the cpu backend's: all of
           them in one native call, the same products and sums) runs this whole part; it
           answers None where it cannot (an activation it lacks), and the loop over the
           experts runs
  shared   Qwen2-MoE's shared expert over every row: gate|up product, act(gate) * up, down
           product, scaled by sigmoid(h @ w_s) per row (w_s float32, as the router), added
gpt-oss adds a bias to the router's logits and to each product (float32, added to the product's
rows), and its activation is the clamped SwiGLU (``clamped_swiglu``) instead of act(gate) * up.
Each chosen expert's matrices are read once per step, whatever its number of tokens; each
layer counts the rows routed to each of its experts (``PackedExperts.chosen``, cumulative: the
backend's ``expert_tokens``, /metrics' pagedllm:moe_expert_tokens). The router stays float32
whatever ``--quantization`` or ``--dtype`` does to the experts' matrices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from model_loader.gguf_blocks import stack_rows
from model_loader.moe import MoeSpec

F32 = np.dtype(np.float32)


@dataclass
class PackedExperts:
    """One layer's experts as a backend keeps them."""

    router: np.ndarray  # (D, E) float32, never quantized
    gate_up: list  # E kept (D, 2F) matrices: gate | up columns
    down: list  # E kept (F, D) matrices
    top_k: int
    renormalize: bool
    shared: tuple | None = None  # (D, 1) float32 gate, kept (D, 2Fs) gate|up, kept (Fs, D) down
    chosen: np.ndarray | None = None  # (E,) int64: rows routed to each expert so far
    biases: tuple | None = None  # gpt-oss, float32: (E,) router, (E, 2F) gate|up, (E, D) down
    clamp: tuple | None = None  # gpt-oss's (alpha, limit): clamped SwiGLU instead of ``act``

    def __post_init__(self):
        if self.chosen is None:
            self.chosen = np.zeros(len(self.gate_up), np.int64)

    def arrays(self):
        """Every kept array once (for byte counts)."""
        yield self.router
        yield from self.gate_up
        yield from self.down
        yield from self.shared or ()
        yield from self.biases or ()

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays())


def pack_experts(lw, spec: MoeSpec, rounded, keep) -> PackedExperts:
    """A sparse layer's router and experts -> PackedExperts: each expert's gate and up stacked
    and transposed to (D, 2F), its down to (F, D), each through ``keep`` (the backend's matrix
    store), values first through ``rounded`` (the backend's dtype)."""
    n = spec.num_experts
    # gate | up rows of each expert (a GGUF's blocks stay blocks: model_loader.gguf_blocks)
    gate_up = [keep(stack_rows([rounded(lw.e_gate[e]), rounded(lw.e_up[e])]).T) for e in range(n)]
    down = [keep(rounded(lw.e_down[e]).T) for e in range(n)]
    router = np.ascontiguousarray(np.asarray(rounded(lw.router), dtype=F32).T)  # (D, E)
    shared = None
    if lw.s_logit is not None:
        shared = (
            np.ascontiguousarray(np.asarray(rounded(lw.s_logit), dtype=F32).T),  # (D, 1)
            keep(np.concatenate([rounded(lw.s_gate), rounded(lw.s_up)]).T),  # (D, 2Fs)
            keep(rounded(lw.s_down).T),  # (Fs, D)
        )
    biases = clamp = None
    if spec.biases:
        f32 = [np.ascontiguousarray(np.asarray(rounded(a), dtype=F32)) for a in
               (lw.router_bias, lw.e_gate_bias, lw.e_up_bias, lw.e_down_bias)]  # fmt: skip
        biases = (f32[0], np.concatenate(f32[1:3], axis=1), f32[3])  # (E,), (E, 2F), (E, D)
    if spec.swiglu_limit:
        clamp = (spec.swiglu_alpha, spec.swiglu_limit)
    return PackedExperts(
        router, gate_up, down, spec.top_k, spec.renormalize, shared, biases=biases, clamp=clamp
    )


def route(h: np.ndarray, router: np.ndarray, top_k: int, renormalize: bool, bias=None):
    """h (T, D), router (D, E) (and its (E,) ``bias``) -> ((T, k) expert ids, (T, k) float32
    weights), the most probable expert first, equal probabilities by lower index."""
    logits = np.asarray(h, dtype=F32) @ router  # (T, E) float32
    if bias is not None:
        logits += bias
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)  # (T, E)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :top_k]  # (T, k)
    weights = np.take_along_axis(p, ids, axis=1)  # (T, k)
    if renormalize:
        weights /= weights.sum(axis=1, keepdims=True)
    return ids, weights


def group(ids: np.ndarray, num_experts: int):
    """(T, k) expert ids -> (sorted pairs (T*k,): pair t*k + j ordered by expert, stable;
    (E,) counts; (E + 1,) offsets: expert e's pairs are sorted[offsets[e]:offsets[e + 1]])."""
    flat = ids.reshape(-1)  # (T*k,)
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=num_experts)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    return order, counts, offsets


def clamped_swiglu(gate_up: np.ndarray, alpha: float, limit: float) -> np.ndarray:
    """gpt-oss's activation: (n, 2F) gate | up -> (n, F) float32, gate clamped to <= limit,
    up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""
    f = gate_up.shape[1] // 2
    gate = np.minimum(gate_up[:, :f], F32.type(limit))
    up = np.clip(gate_up[:, f:], F32.type(-limit), F32.type(limit))
    return (up + 1) * (gate / (1 + np.exp(-F32.type(alpha) * gate)))


def _expert(h: np.ndarray, layer: PackedExperts, e: int, ops, act: str) -> np.ndarray:
    """Rows h (n, D) through expert e -> (n, D) float32, its biases and clamp where it has."""
    gate_up = ops.matmul(h, layer.gate_up[e])  # (n, 2F)
    if layer.biases is None:
        return ops.matmul(ops.act_and_mul(gate_up, act), layer.down[e])
    gate_up = np.asarray(gate_up, dtype=F32) + layer.biases[1][e]
    a = clamped_swiglu(gate_up, *layer.clamp) if layer.clamp else ops.act_and_mul(gate_up, act)
    return ops.matmul(np.ascontiguousarray(a, dtype=F32), layer.down[e]) + layer.biases[2][e]


def experts_forward(h: np.ndarray, layer: PackedExperts, ops, act: str) -> np.ndarray:
    """h (T, D) normed -> (T, D) float32: each token's top-k experts, weighted and summed."""
    bias = None if layer.biases is None else layer.biases[0]
    ids, weights = route(h, layer.router, layer.top_k, layer.renormalize, bias)  # (T, k) x 2
    order, counts, offsets = group(ids, len(layer.gate_up))
    layer.chosen += counts  # what /metrics shows: the router at work
    tokens = order // layer.top_k  # (T*k,) each sorted pair's token
    pair_w = weights.reshape(-1)[order]  # (T*k,) each sorted pair's weight
    fused = getattr(ops, "experts", None)  # the cpu backend's: every expert in one call
    out = None if fused is None else fused(h, layer, tokens, pair_w, offsets, act)
    if out is None:  # (T, D): the loop, expert by expert
        out = np.zeros((h.shape[0], layer.router.shape[0]), F32)
        for e in np.flatnonzero(counts):
            lo, hi = offsets[e], offsets[e + 1]
            rows = tokens[lo:hi]  # (n_e,) distinct tokens
            out[rows] += _expert(h[rows], layer, e, ops, act) * pair_w[lo:hi, None]  # (n_e, D)
    if layer.shared is not None:
        logit, gate_up, down = layer.shared
        gate = 1.0 / (1.0 + np.exp(-(np.asarray(h, dtype=F32) @ logit)))  # (T, 1)
        out += ops.matmul(ops.act_and_mul(ops.matmul(h, gate_up), act), down) * gate
    return out
