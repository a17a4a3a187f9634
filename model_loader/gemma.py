"""What Gemma 2 and Gemma 3 configs say beyond the family table: the attention's scale and
soft-capping, RoPE per layer kind, the text part of a Gemma 3 multimodal config, and the
language model's tensors of its checkpoint.

Gemma 2 and 3 read ``hidden_activation`` (``gelu_pytorch_tanh`` or the exact ``gelu``),
scale attention scores by ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``,
and (Gemma 2) soft-cap attention scores and final logits: ``tanh(x / cap) * cap``. Gemma 3's
sliding layers use their own RoPE: transformers 5 writes ``rope_parameters`` as
``{"full_attention": {...}, "sliding_attention": {...}}``; transformers 4 wrote ``rope_theta``
and ``rope_scaling`` for the full layers and ``rope_local_base_freq`` for the sliding ones.
"""

from __future__ import annotations

import logging

from model_loader.rope import RopeParams, parse_rope

log = logging.getLogger("model_loader")

# Gemma 3 (transformers 5's Gemma3TextConfig.default_theta): the full and the sliding layers'
# rope_theta when a config names none
GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}

# A Gemma3ForConditionalGeneration config.json's own keys besides text_config: the vision
# side (not run here: only the language model is) and bookkeeping.
MULTIMODAL_KEYS = {
    "architectures",
    "model_type",
    "text_config",
    "vision_config",
    "mm_tokens_per_image",
    "boi_token_index",
    "eoi_token_index",
    "image_token_index",
    "initializer_range",
    "tie_word_embeddings",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "_name_or_path",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "use_cache",
}
MULTIMODAL_ARCHITECTURE = "Gemma3ForConditionalGeneration"

# the multimodal checkpoint's prefixes: language model -> the text model's names, and the
# tensors of the vision side, which are left unread
LANGUAGE_PREFIXES = {
    "language_model.model.": "model.",  # as transformers 4 and 5 save it
    "model.language_model.": "model.",  # transformers 5's in-memory names
    "language_model.lm_head.": "lm_head.",
}
VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


def is_multimodal(d: dict) -> bool:
    """A Gemma3ForConditionalGeneration config: model_type gemma3, or that architecture with
    a text_config."""
    archs = d.get("architectures") or []
    return d.get("model_type") == "gemma3" or (
        "text_config" in d and MULTIMODAL_ARCHITECTURE in archs
    )


def text_config(d: dict, where: str = "config.json") -> dict:
    """A Gemma3ForConditionalGeneration config's language model as a gemma3_text config dict
    (its text_config, with the outer keys that apply to it); any other dict as it is."""
    if not is_multimodal(d):
        return d
    unknown = sorted(set(d) - MULTIMODAL_KEYS)
    if unknown:
        raise ValueError(f"{where}: key {unknown[0]!r} of a Gemma 3 multimodal config is not read")
    text = dict(d.get("text_config") or {})
    if text.get("model_type", "gemma3_text") != "gemma3_text":
        raise ValueError(
            f"{where}: text_config model_type {text['model_type']!r} is not gemma3_text"
        )
    text["model_type"] = "gemma3_text"
    text["architectures"] = [MULTIMODAL_ARCHITECTURE]
    # the LM head is tied to the language model's embeddings by the outer config's flag
    text["tie_word_embeddings"] = d.get("tie_word_embeddings", True)
    for key in ("dtype", "torch_dtype", "bos_token_id", "eos_token_id"):
        if key in d and key not in text:
            text[key] = d[key]
    return text


def language_model_tensors(tensors: dict) -> dict:
    """A Gemma 3 multimodal checkpoint's language-model tensors under the text model's names;
    its vision tower's and projector's are left out (logged). Other checkpoints as they are."""
    if not any(n.startswith(tuple(LANGUAGE_PREFIXES)) for n in tensors):
        return tensors
    out, vision = {}, 0
    for name, t in tensors.items():
        if name.startswith(VISION_PREFIXES):
            vision += 1
            continue
        for old, new in LANGUAGE_PREFIXES.items():
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        out[name] = t
    log.info(
        "Gemma 3 multimodal checkpoint: the language model only (%d vision tensors unread)", vision
    )
    return out


def attention_params(d: dict, fam, where: str = "config.json") -> dict:
    """ModelConfig's query_pre_attn_scalar, attn_softcap and final_softcap (0: none)."""
    out = {"query_pre_attn_scalar": None, "attn_softcap": 0.0, "final_softcap": 0.0}
    for key, field in (
        ("query_pre_attn_scalar", "query_pre_attn_scalar"),
        ("attn_logit_softcapping", "attn_softcap"),
        ("final_logit_softcapping", "final_softcap"),
    ):
        value = d.get(key)
        if value is None or key not in fam.keys:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"{where}: {key} must be a positive number, got {value!r}")
        out[field] = float(value)
    return out


def kind_ropes(d: dict, max_pos: int, where: str = "config.json") -> tuple:
    """(the full layers' RopeParams, the sliding layers' RopeParams) of a Gemma 3 config."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        extra = sorted(set(params) - set(GEMMA3_THETA))
        if extra:
            raise ValueError(f"{where}: rope_parameters kind {extra[0]!r} is not read")
        ropes = []
        for kind, theta in GEMMA3_THETA.items():
            p = {"rope_theta": theta, **(params.get(kind) or {})}
            ropes.append(parse_rope({"rope_parameters": p}, max_pos, where))
        return tuple(ropes)
    # transformers 4: rope_theta / rope_scaling for the full layers, rope_local_base_freq
    full = parse_rope({"rope_theta": GEMMA3_THETA["full_attention"], **d}, max_pos, where)
    local = d.get("rope_local_base_freq", GEMMA3_THETA["sliding_attention"])
    return full, RopeParams(theta=float(local))


def layer_types(d: dict, num_layers: int, pattern: int) -> list:
    """``layer_types``, else transformers' default: every ``pattern``-th layer full, the others
    sliding (Gemma 2: 2, even layers sliding; Gemma 3: ``sliding_window_pattern``, 6)."""
    types = d.get("layer_types")
    if types is not None:
        return types
    pattern = d.get("sliding_window_pattern", d.get("_sliding_window_pattern", pattern))
    if not isinstance(pattern, int) or pattern < 1:
        raise ValueError(
            f"config.json: sliding_window_pattern must be a positive int, got {pattern!r}"
        )
    return [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
    ]
