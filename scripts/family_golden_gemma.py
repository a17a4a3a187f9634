"""Gemma 2 and Gemma 3 (text) for scripts/make_family_golden.py: their tiny configs and the
variants that must move their logits (a missed soft-cap, scale, post-norm, q/k norm, window or
per-kind RoPE). Imported by that script, in its throwaway venv with torch and transformers."""

from __future__ import annotations

import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

PAD = 0
GEMMA_MODELS = Gemma2ForCausalLM | Gemma3ForCausalLM


def rope(theta: float, **extra) -> dict:
    return {"rope_type": extra.pop("rope_type", "default"), "rope_theta": theta, **extra}


# name -> (config class, model class, config kwargs, first seed, notes)
GEMMA_FAMILIES = {
    "gemma2": (
        Gemma2Config,
        Gemma2ForCausalLM,
        dict(
            rope_parameters=rope(10000.0),
            head_dim=32,
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=24,
            sliding_window=16,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=10.0,
            pad_token_id=PAD,
            tie_word_embeddings=False,
        ),
        1000,
        "sandwich norms (post-attention and post-feedforward RMSNorm, all 1 + w), attention "
        "scale query_pre_attn_scalar^-1/2 = 24^-1/2, attention scores soft-capped at 5 and "
        "logits at 10 (tanh(x / cap) * cap), sliding window 16 on the even layers "
        "(Gemma2Config's default layer_types), untied",
    ),
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        dict(
            num_hidden_layers=6,
            rope_parameters={
                "full_attention": rope(1e6, rope_type="linear", factor=4.0),
                "sliding_attention": rope(10000.0),
            },
            head_dim=32,
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=24,
            sliding_window=24,
            pad_token_id=PAD,
            tie_word_embeddings=False,
        ),
        1100,
        "Gemma 3 text: 6 layers, five sliding (window 24) then one full (Gemma3TextConfig's "
        "default layer_types), per-kind RoPE (sliding: theta 1e4; full: theta 1e6, linear x4), "
        "q_norm/k_norm RMSNorm (1 + w) per head, sandwich norms, scale 24^-1/2, untied",
    ),
}


def _no_post_norms(model) -> None:
    for layer in model.model.layers:
        layer.post_attention_layernorm = torch.nn.Identity()
        layer.post_feedforward_layernorm = torch.nn.Identity()


def _no_qk_norm(model) -> None:
    for layer in model.model.layers:
        layer.self_attn.q_norm = torch.nn.Identity()
        layer.self_attn.k_norm = torch.nn.Identity()


GEMMA_VARIANTS = {
    "gemma2": {
        "no attention soft-capping": (dict(attn_logit_softcapping=None), None, 0.01),
        "no final soft-capping": (dict(final_logit_softcapping=None), None, 0.1),
        "attention scale head_dim^-1/2": (dict(query_pre_attn_scalar=32), None, 0.01),
        "no post-attention / post-feedforward norms": ({}, _no_post_norms, 0.1),
        "every layer full attention": (dict(layer_types=["full_attention"] * 3), None, 0.01),
        "sliding_window 17": (dict(sliding_window=17), None, 0.01),
    },
    "gemma3": {
        "sliding layers with the full layers' RoPE": (
            dict(
                rope_parameters={
                    "full_attention": rope(1e6, rope_type="linear", factor=4.0),
                    "sliding_attention": rope(1e6, rope_type="linear", factor=4.0),
                }
            ),
            None,
            0.01,
        ),
        "full layers without linear RoPE scaling": (
            dict(
                rope_parameters={
                    "full_attention": rope(1e6),
                    "sliding_attention": rope(10000.0),
                }
            ),
            None,
            0.01,
        ),
        "no q_norm / k_norm": ({}, _no_qk_norm, 0.1),
        "attention scale head_dim^-1/2": (dict(query_pre_attn_scalar=32), None, 0.01),
        "every layer full attention": (dict(layer_types=["full_attention"] * 6), None, 0.01),
        "sliding_window 25": (dict(sliding_window=25), None, 0.01),
    },
}
