"""Mixtures of experts in GGUF files (llama.cpp's layout): what the metadata says about the
experts, and the names of a sparse layer's tensors.

  general.architecture   family      renormalized (llama.cpp's choice, unless
                                     ``<arch>.expert_weights_norm`` says otherwise)
  qwen3moe               qwen3_moe   yes
  qwen2moe               qwen2_moe   no
  llama + expert_count   mixtral     yes
  olmoe                  olmoe       no
  gpt-oss                gpt_oss     yes (the softmax of the top k logits; biases and the
                                     clamped SwiGLU: model_loader.gguf_gpt_oss)

Metadata: ``<arch>.expert_count`` (E), ``expert_used_count`` (top-k),
``expert_feed_forward_length`` (the experts' width; Mixtral's and OLMoE's converters write
none: ``feed_forward_length`` is it), ``expert_shared_feed_forward_length`` (Qwen2-MoE's shared
expert, ``feed_forward_length`` where absent, as llama.cpp reads it); ``expert_gating_func``,
when present, must be softmax. OLMoE's ``clip_qkv`` is ``<arch>.attention.clamp_kqv`` (llama.cpp's
OLMoE converter does not write it).

Tensors of a sparse layer: the router ``blk.N.ffn_gate_inp.weight`` (E, D) and the experts as
3-D tensors ``ffn_gate_exps``/``ffn_up_exps`` (E, F, D) and ``ffn_down_exps`` (E, D, F) (GGUF
lists dims fastest first: [D, F, E]), the stacked form the engine keeps. Qwen2-MoE's shared
expert: ``ffn_gate_shexp``/``ffn_up_shexp`` (Fs, D), ``ffn_down_shexp`` (D, Fs) and its gate
``ffn_gate_inp_shexp`` (D,) or (1, D). A layer is sparse when the file has its router; a
layer without one keeps the dense ``ffn_gate``/``ffn_up``/``ffn_down``.
"""

from __future__ import annotations

from typing import Any

from model_loader.moe import GPT_OSS_SWIGLU, MoeSpec

# general.architecture -> the mixture-of-experts family (llama: Mixtral, when it has experts)
MOE_ARCHITECTURES = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "olmoe": "olmoe"}
MOE_ARCHITECTURES["gpt-oss"] = "gpt_oss"
RENORMALIZED = {"qwen3_moe": True, "qwen2_moe": False, "mixtral": True, "olmoe": False}
RENORMALIZED["gpt_oss"] = True
SOFTMAX = 1  # gguf.ExpertGatingFuncType.SOFTMAX

ROUTER = "blk.{i}.ffn_gate_inp.weight"
# LayerWeights field -> GGUF name, for model_loader.moe.moe_layer_names
GGUF_STACKED = {
    "router": ROUTER,  # (E, D)
    "e_gate": "blk.{i}.ffn_gate_exps.weight",  # (E, F, D)
    "e_up": "blk.{i}.ffn_up_exps.weight",  # (E, F, D)
    "e_down": "blk.{i}.ffn_down_exps.weight",  # (E, D, F)
}
GGUF_SHARED = {
    "s_gate": "blk.{i}.ffn_gate_shexp.weight",  # (Fs, D)
    "s_up": "blk.{i}.ffn_up_shexp.weight",  # (Fs, D)
    "s_down": "blk.{i}.ffn_down_shexp.weight",  # (D, Fs)
    "s_logit": "blk.{i}.ffn_gate_inp_shexp.weight",  # (1, D); llama.cpp's (D,)
}
# the tensors only read as float32 (never a matrix the backend keeps in another format)
ROUTERS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


def moe_family(md: dict[str, Any], arch: str, family: str) -> str:
    """The family a GGUF is: a llama one with experts is Mixtral."""
    return "mixtral" if arch == "llama" and f"{arch}.expert_count" in md else family


def gguf_moe_spec(md: dict[str, Any], arch: str, family: str, sparse: tuple[bool, ...]):
    """The MoeSpec of a mixture-of-experts GGUF (``sparse``: which layers have a router)."""

    def count(key: str, default=None) -> int:
        value = md.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"gguf: missing required metadata key '{arch}.{key}'")
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"gguf: {arch}.{key} must be a positive integer, got {value!r}")
        return int(value)

    gating = md.get(f"{arch}.expert_gating_func", SOFTMAX)
    if gating != SOFTMAX:
        raise ValueError(f"gguf: {arch}.expert_gating_func {gating!r} is not softmax (1)")
    if not any(sparse):
        raise ValueError(f"gguf: {arch}.expert_count is set but no layer has '{ROUTER}'")
    dense = md.get(f"{arch}.feed_forward_length")
    n, top_k = count("expert_count"), count("expert_used_count")
    width = count("expert_feed_forward_length", dense)
    shared = count("expert_shared_feed_forward_length", dense) if family == "qwen2_moe" else 0
    renorm = bool(md.get(f"{arch}.expert_weights_norm", RENORMALIZED[family]))
    if family == "gpt_oss":  # llama.cpp's constants (model_loader.gguf_gpt_oss)
        return MoeSpec(n, top_k, width, renorm, sparse, 0, True, *GPT_OSS_SWIGLU)
    return MoeSpec(n, top_k, width, renorm, sparse, shared)


def clamp_kqv(md: dict[str, Any], arch: str) -> float | None:
    value = md.get(f"{arch}.attention.clamp_kqv")
    if value is not None and not value > 0:
        raise ValueError(f"gguf: {arch}.attention.clamp_kqv must be positive, got {value!r}")
    return None if value is None else float(value)
