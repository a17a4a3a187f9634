"""The model families this code runs, and the one table of what each reads from config.json.

A checkpoint's ``model_type`` (or its ``architectures``) picks a ``Family``; anything else is
refused before a byte of weights is read. Every key of config.json must be one the family reads,
one that cannot change the forward (``HARMLESS_KEYS``: bookkeeping, dropout, training-only), or
it is refused by name: a key that changes the math and is silently ignored gives other tokens.

What differs from Llama is a handful of flags, each implemented in the reference, the NumPy
backend and the CUDA kernels:

  family   q/k/v bias  q/k norm  norms    MLP          embeddings   window
  llama    -           -         w        SiLU         x            -
  mistral  -           -         w        SiLU         x            sliding_window
  qwen2    yes         -         w        SiLU         x            layer_types
  qwen3    -           per head  w        SiLU         x            layer_types
  phi3     -           -         w        SiLU         x            sliding_window
  gemma    -           -         (1 + w)  GELU (tanh)  x sqrt(D)    -
  gemma2   -           -         sandw.   GELU (tanh)  x sqrt(D)    layer_types (2)
  gemma3   -           per head  sandw.   GELU (tanh)  x sqrt(D)    layer_types (6)
  qwen3_moe  as qwen3, with experts in place of the MLP (use_sliding_window: every layer)
  qwen2_moe  as qwen2, with experts and a sigmoid-gated shared expert in place of the MLP
  mixtral    as mistral, with experts in place of the MLP
  olmoe      RMSNorm of the whole q and k projections (not per head) before RoPE, then q, k
             and v clamped to +-clip_qkv when set; experts in place of the MLP
  gpt_oss    biases on q, k, v and o; a learned sink logit per head in every softmax; sliding
             and full layers alternating (layer_types); yarn RoPE; experts with biases and a
             clamped SwiGLU in place of the MLP

Gemma 2 and 3 ("sandw.": (1 + w) RMSNorm before and after attention and the MLP) also scale
attention by ``query_pre_attn_scalar ** -0.5``; Gemma 2 soft-caps attention scores and logits,
Gemma 3 gives its sliding layers their own RoPE (``model_loader.gemma``).
A mixture of experts' own keys are read by ``model_loader.moe`` (``MoeSpec``).

Phi-3 stores q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj``; the loader splits
them (``model_loader.hf_weights``).
"""

from __future__ import annotations

from dataclasses import dataclass

from model_loader.gemma import layer_types as gemma_layer_types
from model_loader.moe import (
    GPT_OSS_KEYS,
    MIXTRAL_KEYS,
    OLMOE_KEYS,
    QWEN2_MOE_KEYS,
    QWEN3_MOE_KEYS,
)

# Keys read by every family (model_loader.config.ModelConfig.from_hf_dict).
COMMON_KEYS = {
    "quantization_config",  # model_loader.checkpoint_quant: read, or refused by what it says
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "torch_dtype",
    "dtype",
    "num_labels",  # a sequence classifier's (with id2label)
    "id2label",
    "problem_type",
}

# Keys that do not change an inference forward: bookkeeping, dropout (off at inference),
# initialisation, generation defaults older configs carry (generation_config.json has its own),
# transformers' output switches.
HARMLESS_KEYS = {
    "_name_or_path",
    "matryoshka_dimensions",  # the embedding cuts a pooling model declares (read by the engine)
    "is_matryoshka",
    "transformers_version",
    "initializer_range",
    "use_cache",
    "pad_token_id",
    "attention_dropout",
    "resid_pdrop",
    "embd_pdrop",
    "pretraining_tp",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "torchscript",
    "chunk_size_feed_forward",
    "label2id",
    "tokenizer_class",
    "prefix",
    "sep_token_id",
    "decoder_start_token_id",
    "task_specific_params",
    "finetuning_task",
    "use_bfloat16",
    "tf_legacy_loss",
    "pruned_heads",
    "tie_encoder_decoder",
    "is_decoder",
    "add_cross_attention",
    "cross_attention_hidden_size",
    "max_length",
    "min_length",
    "do_sample",
    "early_stopping",
    "num_beams",
    "num_beam_groups",
    "diversity_penalty",
    "temperature",
    "top_k",
    "top_p",
    "typical_p",
    "repetition_penalty",
    "length_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "num_return_sequences",
    "output_scores",
    "return_dict_in_generate",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
    "auto_map",  # custom code for other libraries; the family alone decides the math here
}
# a mixture of experts' training-only keys: the router's auxiliary loss, its logits as an
# output, Mixtral's jitter (applied in training mode only)
HARMLESS_KEYS |= {"router_aux_loss_coef", "output_router_logits", "router_jitter_noise"}

# Keys that must hold one value (the one implemented), else the checkpoint is refused.
# key -> (values accepted, what the key would ask for).
FIXED_VALUES = {
    "attention_bias": ((False, None), "biases on the attention projections"),
    "mlp_bias": ((False, None), "biases on the MLP projections"),
    "is_encoder_decoder": ((False, None), "an encoder-decoder model"),
    "use_bidirectional_attention": ((False, None), "bidirectional attention"),
    "partial_rotary_factor": ((1.0, 1, None), "rotary embeddings on part of each head"),
    "qkv_bias": ((True, None), "q, k and v projections without biases"),  # Qwen2-MoE's
}

# Keys that name a feature no family here implements: refused by name whatever their value
# (unless null).
UNSUPPORTED_KEYS = {
    "final_logit_softcapping": "logit soft-capping",
    "attn_logit_softcapping": "attention soft-capping",
    "query_pre_attn_scalar": "a query scale other than 1/sqrt(head_dim)",
}  # a family that reads one of these (its keys) takes it


# hidden_act value -> the activation's name in this code (reference.model.ACTIVATIONS).
SILU = {"silu": "silu"}
# transformers 5's GemmaConfig rewrites "gelu" to "gelu_pytorch_tanh": Gemma's GELU is tanh's
GEMMA_GELU = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu_tanh"}
# Gemma 2 and 3 read hidden_activation as it is: "gelu" is the exact one there
GEMMA2_GELU = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


@dataclass(frozen=True)
class Family:
    name: str  # config.json model_type
    architectures: tuple[str, ...]
    keys: frozenset[str] = frozenset()  # read besides COMMON_KEYS
    qkv_bias: bool = False  # q/k/v projections carry biases (no config key says so)
    qk_norm: bool | str = False  # True: per-head RMSNorm of q and k before RoPE;
    #   "projection": over each token's whole q and k projections (OLMoE)
    norm_offset: float = 0.0  # every RMSNorm scales by (norm_offset + w)
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size)
    activations: dict = None  # hidden_act value -> activation (None: SILU)
    window: str = "none"  # none | global (sliding_window) | layer_types | pattern | flag
    #   (when use_sliding_window: every layer) | layer_types_odd (qwen2_moe: layer_types,
    #   else when use_sliding_window the even-indexed layers below max_window_layers)
    fused_projections: bool = False  # qkv_proj, gate_up_proj in the checkpoint
    sandwich_norms: bool = False  # RMSNorm of the attention's and the MLP's outputs too
    act_key: str = "hidden_act"  # the config key naming the activation
    window_pattern: int = 0  # window "pattern": every n-th layer full without layer_types
    kind_rope: bool = False  # sliding layers have their own RoPE (model_loader.gemma)
    moe: bool = False  # experts in place of the MLP (model_loader.moe)
    sinks: bool = False  # a learned per-head logit joins every softmax's denominator, and the
    #   o projection has a bias (gpt-oss)
    fixed: dict = None  # FIXED_VALUES entries this family holds to other values
    rope_theta: float = 10000.0  # rope_theta when config.json names none
    example: str = ""  # a checkpoint of the family
    differs: str = ""  # what differs from Llama, for the docs


GEMMA2_KEYS = {
    "attention_bias",
    "hidden_activation",
    "use_bidirectional_attention",
    "query_pre_attn_scalar",
    "sliding_window",
    "layer_types",
}
GEMMA3_KEYS = {"rope_local_base_freq", "sliding_window_pattern", "_sliding_window_pattern"}
GEMMA2_FLAGS = dict(
    norm_offset=1.0,
    scale_embeddings=True,
    activations=GEMMA2_GELU,
    act_key="hidden_activation",
    sandwich_norms=True,
    window="pattern",
)

QWEN_WINDOW_KEYS = {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}

FAMILIES = {
    f.name: f
    for f in (
        Family(
            "llama",
            ("LlamaForCausalLM",),
            frozenset({"attention_bias", "mlp_bias"}),
            example="TinyLlama/TinyLlama-1.1B-Chat-v1.0, meta-llama/Llama-3.2-1B-Instruct",
            differs="the baseline (Llama 3: llama3 RoPE scaling, several EOS ids)",
        ),
        Family(
            "mistral",
            ("MistralForCausalLM",),
            frozenset({"sliding_window"}),
            window="global",
            example="mistralai/Mistral-7B-v0.1",
            differs="sliding-window attention",
        ),
        Family(
            "qwen2",
            ("Qwen2ForCausalLM",),
            frozenset(QWEN_WINDOW_KEYS),
            qkv_bias=True,
            window="layer_types",
            example="Qwen/Qwen2.5-0.5B-Instruct",
            differs="biases on q, k and v; sliding window on some layers when enabled",
        ),
        Family(
            "qwen3",
            ("Qwen3ForCausalLM",),
            frozenset(QWEN_WINDOW_KEYS | {"attention_bias"}),
            qk_norm=True,
            window="layer_types",
            example="Qwen/Qwen3-0.6B",
            differs="RMSNorm of each q and k head before RoPE; head_dim apart from hidden/heads",
        ),
        Family(
            "phi3",
            ("Phi3ForCausalLM",),
            frozenset(
                {
                    "sliding_window",
                    "original_max_position_embeddings",
                    "partial_rotary_factor",
                    "attention_bias",
                }
            ),
            window="global",
            fused_projections=True,
            example="microsoft/Phi-3-mini-4k-instruct",
            differs="fused qkv_proj and gate_up_proj (split at load); sliding window",
        ),
        Family(
            "gemma",
            ("GemmaForCausalLM",),
            frozenset({"attention_bias", "hidden_activation", "use_bidirectional_attention"}),
            norm_offset=1.0,
            scale_embeddings=True,
            activations=GEMMA_GELU,
            example="google/gemma-2b",
            differs="(1 + w) norms, GELU-tanh gated MLP, embeddings times sqrt(hidden_size)",
        ),
        Family(
            "gemma2",
            ("Gemma2ForCausalLM",),
            frozenset(GEMMA2_KEYS | {"attn_logit_softcapping", "final_logit_softcapping"}),
            **GEMMA2_FLAGS,
            window_pattern=2,
            example="google/gemma-2-2b-it",
            differs="Gemma's, plus sandwich norms, query_pre_attn_scalar, attention and logit "
            "soft-capping, sliding window on alternate layers",
        ),
        Family(
            "gemma3_text",
            ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
            frozenset(GEMMA2_KEYS | GEMMA3_KEYS),
            **GEMMA2_FLAGS,
            qk_norm=True,
            window_pattern=6,
            kind_rope=True,
            example="google/gemma-3-1b-it, google/gemma-3-4b-it (its language model)",
            differs="Gemma 2's without soft-capping, plus (1 + w) RMSNorm of q and k heads, "
            "five sliding layers per full one, the sliding layers' own RoPE",
        ),
        Family(
            "qwen3_moe",
            ("Qwen3MoeForCausalLM",),
            frozenset(
                QWEN3_MOE_KEYS
                | {"use_sliding_window", "sliding_window"}
                | {"max_window_layers", "attention_bias"}
            ),  # fmt: skip
            qk_norm=True,
            window="flag",
            moe=True,
            example="Qwen/Qwen3-30B-A3B",
            differs="as qwen3, experts in place of the MLP (top-k of num_experts; dense layers: "
            "mlp_only_layers, decoder_sparse_step)",
        ),
        Family(
            "mixtral",
            ("MixtralForCausalLM",),
            frozenset(MIXTRAL_KEYS | {"sliding_window"}),
            window="global",
            moe=True,
            example="mistralai/Mixtral-8x7B-v0.1",
            differs="as mistral, experts in place of the MLP (top-k of num_local_experts, "
            "renormalized)",
        ),
        Family(
            "qwen2_moe",
            ("Qwen2MoeForCausalLM",),
            frozenset(QWEN2_MOE_KEYS | QWEN_WINDOW_KEYS | {"qkv_bias"}),
            qkv_bias=True,
            window="layer_types_odd",
            moe=True,
            example="Qwen/Qwen1.5-MoE-A2.7B",
            differs="as qwen2, experts (top-k of num_experts) and a shared expert scaled by "
            "sigmoid(shared_expert_gate) in place of the MLP",
        ),
        Family(
            "olmoe",
            ("OlmoeForCausalLM",),
            frozenset(OLMOE_KEYS | {"clip_qkv", "attention_bias"}),
            qk_norm="projection",
            moe=True,
            example="allenai/OLMoE-1B-7B-0924",
            differs="RMSNorm of the whole q and k projections, clip_qkv, experts (top-k of "
            "num_experts) in place of the MLP",
        ),
        Family(
            "gpt_oss",
            ("GptOssForCausalLM",),
            frozenset(GPT_OSS_KEYS | {"attention_bias", "sliding_window", "layer_types"}),
            qkv_bias=True,
            sinks=True,
            window="pattern",
            window_pattern=2,
            moe=True,
            fixed={"attention_bias": ((True, None), "attention projections without biases")},
            rope_theta=150000.0,
            example="openai/gpt-oss-20b",
            differs="q/k/v/o biases, a sink logit per head, alternating sliding (128) and full "
            "layers, experts with biases and a clamped SwiGLU (top-k of num_local_experts)",
        ),
    )
}

ARCHITECTURES = {a: f for f in FAMILIES.values() for a in f.architectures}
# each family's sequence classifier (transformers' *ForSequenceClassification: the same
# decoder, a score head on the last token instead of the LM head; the pooling runner's)
CLASSIFIERS = {
    a.replace("ForCausalLM", "ForSequenceClassification"): f
    for f in FAMILIES.values()
    for a in f.architectures
    if a.endswith("ForCausalLM")
}
ARCHITECTURES |= CLASSIFIERS


def supported() -> str:
    names = ", ".join(f"{f.name} ({'/'.join(f.architectures)})" for f in FAMILIES.values())
    return f"{names}; each also as *ForSequenceClassification"


def is_classifier(d: dict) -> bool:
    """config.json names a sequence classifier's architecture."""
    return any(a in CLASSIFIERS for a in d.get("architectures") or [])


def family_of(d: dict, where: str = "config.json") -> Family:
    """The family a config dict names by model_type (else architectures), or ValueError."""
    model_type = d.get("model_type")
    archs = d.get("architectures") or []
    if model_type is None and not archs:  # a bare config (older tests, hand-written): Llama
        return FAMILIES["llama"]
    fam = FAMILIES.get(model_type) if model_type is not None else None
    if model_type is not None and fam is None:
        raise ValueError(f"{where}: model_type {model_type!r} is not supported; {supported()}")
    for arch in archs:
        other = ARCHITECTURES.get(arch)
        if other is None:
            raise ValueError(f"{where}: architecture {arch!r} is not supported; {supported()}")
        if fam is not None and other is not fam:
            raise ValueError(
                f"{where}: architecture {arch!r} does not match model_type {model_type!r}"
            )
        fam = other
    return fam


def check_keys(d: dict, fam: Family, where: str = "config.json") -> None:
    """Every key is read, harmless, or holds its one implemented value; else ValueError."""
    for key, value in d.items():
        if key in UNSUPPORTED_KEYS and value is not None and key not in fam.keys:
            raise ValueError(f"{where}: {key!r} ({UNSUPPORTED_KEYS[key]}) is not supported")
        fixed = (fam.fixed or {}).get(key, FIXED_VALUES.get(key))
        if fixed is not None and value not in fixed[0]:
            raise ValueError(f"{where}: {key}={value!r} ({fixed[1]}) is not supported")
    known = COMMON_KEYS | HARMLESS_KEYS | fam.keys | set(UNSUPPORTED_KEYS)
    unknown = sorted(k for k in d if k not in known)
    if unknown:
        raise ValueError(
            f"{where}: key {unknown[0]!r} is not read for model_type {fam.name!r} (it may "
            f"change the computation, so the checkpoint is refused)"
        )
    acts, key = activations(fam), fam.act_key
    act = d.get(key, next(iter(acts)))
    if act not in acts:
        raise ValueError(
            f"{where}: {key} {act!r} is not supported for {fam.name} (supported: {', '.join(acts)})"
        )
    # transformers 4's Gemma read hidden_activation; 5 reads hidden_act (Gemma 2 and 3 the other)
    other = "hidden_activation" if key == "hidden_act" else "hidden_act"
    legacy = d.get(other)
    if legacy is not None and acts.get(legacy) != acts[act]:
        raise ValueError(
            f"{where}: {other} {legacy!r} and {key} {act!r} disagree; "
            f"set both to the activation the checkpoint was trained with"
        )


def activations(fam: Family) -> dict:
    """hidden_act value -> activation name, for the family."""
    return fam.activations or SILU


def activation(d: dict, fam: Family) -> str:
    acts = activations(fam)
    return acts[d.get(fam.act_key, next(iter(acts)))]


def layer_windows(d: dict, fam: Family, num_layers: int, where: str = "config.json") -> tuple:
    """Per layer, its sliding window (0: full attention), as transformers 5 derives it."""
    if fam.window == "none":
        return (0,) * num_layers
    window = d.get("sliding_window")
    gated = fam.window in ("layer_types", "layer_types_odd", "flag")  # by use_sliding_window
    if gated and not d.get("use_sliding_window", False):
        window = None
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"{where}: sliding_window must be a positive integer, got {window!r}")
    if fam.window in ("global", "flag"):  # flag: transformers 5's Qwen3-MoE, every layer
        return (window or 0,) * num_layers
    types = d.get("layer_types")
    if fam.window == "pattern":
        if window is None:
            raise ValueError(f"{where}: {fam.name} needs sliding_window (its sliding layers')")
        types = gemma_layer_types(d, num_layers, fam.window_pattern)
    if types is None:
        first = d.get("max_window_layers", num_layers)
        odd = fam.window == "layer_types_odd"  # Qwen2MoeConfig's rule, else Qwen2Config's
        types = [
            "sliding_attention" if window and (i < first and i % 2 == 0 if odd else i >= first)
            else "full" for i in range(num_layers)
        ]  # fmt: skip
    if len(types) != num_layers:
        raise ValueError(f"{where}: layer_types has {len(types)} entries for {num_layers} layers")
    bad = sorted(set(types) - {"full_attention", "sliding_attention", "full"})
    if bad:
        raise ValueError(f"{where}: layer type {bad[0]!r} is not supported")
    return tuple((window or 0) if t == "sliding_attention" else 0 for t in types)
