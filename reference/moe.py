"""A mixture of experts' MLP in NumPy, token by token: the plain statement of the routing the
engine's grouped products (engine/backends/moe.py) must reproduce.

Per token x (D,): router logits l = W_r x in float32 (E,); p = softmax(l); the top k experts by
p, ties to the lower index (torch.topk's order); their weights p_e, divided by their sum where
the family renormalizes (Mixtral always, Qwen3-MoE when norm_topk_prob); the output is
sum_e w_e * down_e(act(gate_e x) * up_e x). Qwen2-MoE adds its shared expert to that sum,
sigmoid(w_s . x) * down_s(act(gate_s x) * up_s x), for every token.

gpt-oss adds biases: l = W_r x + b_r; its products are gate_e x + bg_e, up_e x + bu_e and
down_e h + bd_e; its activation is the clamped SwiGLU (``clamped_swiglu``). Its router takes
the softmax of the top k logits, which is the top k of p renormalized.
"""

from __future__ import annotations

import numpy as np

from model_loader.moe import MoeSpec
from model_loader.weights import LayerWeights


def route_token(logits: np.ndarray, top_k: int, renormalize: bool) -> list[tuple[int, float]]:
    """One token's (E,) float32 router logits -> [(expert, weight)] of its top_k experts, the
    largest probability first, equal ones by expert index."""
    p = np.exp(logits - logits.max())
    p = p / p.sum()  # (E,) float32
    chosen = sorted(range(len(p)), key=lambda e: (-p[e], e))[:top_k]
    total = sum(p[e] for e in chosen) if renormalize else 1.0
    return [(e, p[e] / total) for e in chosen]


def clamped_swiglu(gate: np.ndarray, up: np.ndarray, alpha: float, limit: float) -> np.ndarray:
    """gpt-oss's activation: gate <= limit, -limit <= up <= limit, then
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
    return (up + 1) * (gate / (1 + np.exp(-alpha * gate)))


def moe_mlp(x: np.ndarray, lw: LayerWeights, spec: MoeSpec, act) -> np.ndarray:
    """x (T, D) normalized -> (T, D): each token through its chosen experts, weighted."""
    logits = x.astype(np.float32) @ lw.router.astype(np.float32).T  # (T, E) float32
    if lw.router_bias is not None:
        logits += lw.router_bias.astype(np.float32)
    out = np.zeros_like(x)  # (T, D)
    for t in range(x.shape[0]):
        for e, weight in route_token(logits[t], spec.top_k, spec.renormalize):
            gate, up = lw.e_gate[e] @ x[t], lw.e_up[e] @ x[t]  # (F,) x 2
            if spec.biases:
                gate, up = gate + lw.e_gate_bias[e], up + lw.e_up_bias[e]
            if spec.swiglu_limit:
                h = clamped_swiglu(gate, up, spec.swiglu_alpha, spec.swiglu_limit)
            else:
                h = act(gate) * up  # (F,)
            y = lw.e_down[e] @ h  # (D,)
            out[t] += x.dtype.type(weight) * (y + lw.e_down_bias[e] if spec.biases else y)
        if lw.s_logit is not None:
            h = act(lw.s_gate @ x[t]) * (lw.s_up @ x[t])  # (Fs,)
            gate = 1.0 / (1.0 + np.exp(-(lw.s_logit[0] @ x[t])))
            out[t] += x.dtype.type(gate) * (lw.s_down @ h)
    return out
