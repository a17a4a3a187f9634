"""The mixture-of-experts entries of make_family_golden.py's FAMILIES and VARIANTS (kept apart so
that file stays small): tiny Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE checkpoints.

In memory transformers 5 holds each layer's experts as fused 3-D parameters
(experts.gate_up_proj (E, 2F, D), experts.down_proj (E, D, F)); save_pretrained writes them
back per expert (mlp.experts.{e}.gate_proj/up_proj/down_proj; Mixtral's
block_sparse_moe.experts.{e}.w1/w3/w2), the form real checkpoints have. make_family_golden's
randomise draws the 3-D ones N(0, 1/fan_in) like the matrices, the router (mlp.gate) too.
"""

from __future__ import annotations

import torch
from transformers import (
    GptOssConfig,
    GptOssForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)


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
    "qwen2_moe": (
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        dict(
            rope_parameters=_rope(1e6),
            tie_word_embeddings=False,
            use_sliding_window=False,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=96,
            decoder_sparse_step=1,
            mlp_only_layers=[2],
        ),
        1200,
        "8 experts, top-2, not renormalized (norm_topk_prob false, the default), expert width "
        "32; a shared expert of width 96 scaled by sigmoid(shared_expert_gate . x); q/k/v "
        "biases; layer 2 dense (mlp_only_layers [2], width 160); untied",
    ),
    "olmoe": (
        OlmoeConfig,
        OlmoeForCausalLM,
        dict(
            rope_parameters=_rope(10000.0),
            tie_word_embeddings=False,
            num_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,
            clip_qkv=1.5,
        ),
        1300,
        "8 experts, top-2, not renormalized (norm_topk_prob false), expert width "
        "intermediate_size 32; q_norm (64,) and k_norm (32,) over the whole q and k "
        "projections; q, k, v clamped to +-1.5 after the norms (clip_qkv); untied",
    ),
    "gpt_oss": (
        GptOssConfig,
        GptOssForCausalLM,
        dict(
            head_dim=16,
            tie_word_embeddings=False,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=32,
            sliding_window=8,
            swiglu_limit=1.5,
        ),
        1400,
        "gpt-oss: 4 experts, top-2 (softmax over the two chosen logits), router with a bias; "
        "experts' gate_up_proj (E, D, 2F) with gate and up interleaved (columns 0::2, 1::2) "
        "and biases, clamped SwiGLU (gate <= limit, |up| <= limit, (up + 1) * gate * "
        "sigmoid(1.702 gate)) with swiglu_limit 1.5 (7 in the released models) so the clamp "
        "acts here; q/k/v/o biases; a learned sink logit per head in every softmax; layers "
        "sliding (window 8), full, sliding (GptOssConfig's default layer_types); yarn RoPE "
        "(the config's default: factor 32, original context 4096, theta 150000); untied",
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


def _no_shared_expert(model) -> None:
    for layer in model.model.layers:
        if hasattr(layer.mlp, "shared_expert"):
            layer.mlp.shared_expert.down_proj.weight.zero_()


def _shared_expert_ungated(model) -> None:
    for layer in model.model.layers:
        if hasattr(layer.mlp, "shared_expert_gate"):  # sigmoid(40) == 1 in float32
            layer.mlp.shared_expert_gate.forward = lambda h: torch.full_like(h[..., :1], 40.0)


def _no_qkv_bias(model) -> None:
    for pname, p in model.named_parameters():
        if pname.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
            p.zero_()


def _qk_norm_per_head(model) -> None:
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    for layer in model.model.layers:
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):

            def forward(x, norm=norm):  # each head's head_dim values normalised apart
                h = x.reshape(*x.shape[:-1], -1, head_dim)
                h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
                return norm.weight * h.reshape(x.shape)

            norm.forward = forward


def _no_sinks(model) -> None:
    for layer in model.model.layers:
        layer.self_attn.sinks.fill_(-float("inf"))


def _no_router_bias(model) -> None:
    for layer in model.model.layers:
        layer.mlp.router.bias.zero_()


def _gate_up_not_interleaved(model) -> None:
    for layer in model.model.layers:  # gate = the first F columns, up = the last F
        ex, f = layer.mlp.experts, layer.mlp.experts.intermediate_size
        for name in ("gate_up_proj", "gate_up_proj_bias"):
            p = getattr(ex, name)
            p.copy_(torch.stack([p[..., :f], p[..., f:]], dim=-1).reshape(p.shape))


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
    "qwen2_moe": {
        "no shared expert": ({}, _no_shared_expert, 0.1),
        "shared expert not gated": ({}, _shared_expert_ungated, 0.1),
        "top-k weights renormalized": (dict(norm_topk_prob=True), None, 0.1),
        "q/k/v without biases": ({}, _no_qkv_bias, 0.1),
    },
    "gpt_oss": {
        "no attention sinks": ({}, _no_sinks, 0.01),
        "router without its bias": ({}, _no_router_bias, 0.01),
        "swiglu_limit 7 (no clamp here)": (dict(swiglu_limit=7.0), None, 0.01),
        "gate and up halves, not interleaved": ({}, _gate_up_not_interleaved, 0.01),
        "every layer full attention": (dict(layer_types=["full_attention"] * 3), None, 0.01),
        "rope without yarn": (dict(rope_parameters=_rope(150000.0)), None, 0.01),
    },
    "olmoe": {
        "q/k norm per head, not over the projection": ({}, _qk_norm_per_head, 0.1),
        "no clip_qkv": (dict(clip_qkv=None), None, 0.1),
        "top-k weights renormalized": (dict(norm_topk_prob=True), None, 0.1),
    },
}
