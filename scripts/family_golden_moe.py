"""The mixture-of-experts entries of make_family_golden.py's FAMILIES and VARIANTS (kept apart so
that file stays small): tiny Qwen3-MoE and Mixtral checkpoints.

In memory transformers 5 holds each layer's experts as fused 3-D parameters
(experts.gate_up_proj (E, 2F, D), experts.down_proj (E, D, F)); save_pretrained writes them
back per expert (mlp.experts.{e}.gate_proj/up_proj/down_proj; Mixtral's
block_sparse_moe.experts.{e}.w1/w3/w2), the form real checkpoints have. make_family_golden's
randomise draws the 3-D ones N(0, 1/fan_in) like the matrices, the router (mlp.gate) too.
"""

from __future__ import annotations

import torch
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM


def _rope(theta: float) -> dict:
    return {"rope_type": "default", "rope_theta": theta}


# name -> (config class, model class, config kwargs, first seed, notes), as FAMILIES
MOE_FAMILIES = {
    "qwen3_moe": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(
            rope_parameters=_rope(1e6),
            head_dim=16,
            tie_word_embeddings=False,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        ),
        1000,
        "8 experts, top-2, renormalized (norm_topk_prob), expert width 32; layer 1 dense "
        "(mlp_only_layers [1], width intermediate_size 160); q_norm/k_norm; untied",
    ),
    "mixtral": (
        MixtralConfig,
        MixtralForCausalLM,
        dict(
            rope_parameters=_rope(10000.0),
            head_dim=16,
            tie_word_embeddings=False,
            num_local_experts=4,
            intermediate_size=64,
            num_experts_per_tok=2,
            sliding_window=8,
        ),
        1100,
        "4 experts, top-2, always renormalized, expert width intermediate_size 64; sliding "
        "window 8 on every layer; untied",
    ),
}


def _top1(model) -> None:
    for layer in model.model.layers:
        router = getattr(layer.mlp, "gate", None)
        if router is not None:
            router.top_k = 1


def _mixtral_not_renormalized(model) -> None:
    for layer in model.model.layers:
        router = layer.mlp.gate

        def forward(h, router=router):  # MixtralTopKRouter.forward without the division
            logits = torch.nn.functional.linear(h.reshape(-1, router.hidden_dim), router.weight)
            probs = torch.nn.functional.softmax(logits.float(), dim=-1)
            value, index = torch.topk(probs, router.top_k, dim=-1)
            return logits, value, index

        router.forward = forward


MOE_VARIANTS = {
    "qwen3_moe": {
        "top-k weights not renormalized": (dict(norm_topk_prob=False), None, 0.1),
        "top-1 routing": ({}, _top1, 0.1),
    },
    "mixtral": {
        "top-k weights not renormalized": ({}, _mixtral_not_renormalized, 0.1),
        "no sliding window": (dict(sliding_window=None), None, 0.1),
        "top-1 routing": ({}, _top1, 0.1),
    },
}
