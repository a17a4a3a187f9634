"""Mixtures of experts at load: what a config.json says about its experts, and a checkpoint's
expert tensors stacked per layer.

``MoeSpec`` is read once from config.json (``moe_spec``) and kept in ``ModelConfig.moe``: how
many experts, how many each token runs (top-k), their hidden width, whether the top-k routing
weights are renormalized to sum to one, and which layers are sparse (the others keep the dense
MLP of ``intermediate_size``).

  family     experts key                          renormalized   sparse layers
  qwen3_moe  num_experts (transformers 5 writes   norm_topk_prob  not in mlp_only_layers, and
             num_local_experts)                                   (i + 1) % decoder_sparse_step == 0
  qwen2_moe  num_experts (or num_local_experts)   norm_topk_prob  as qwen3_moe
  mixtral    num_local_experts                    always          every layer
  olmoe      num_experts (or num_local_experts)   norm_topk_prob  every layer
  gpt_oss    num_local_experts                    always          every layer

Each family's default for norm_topk_prob is false. The experts' width is moe_intermediate_size
(qwen3_moe, qwen2_moe) or intermediate_size (mixtral, olmoe). Qwen2-MoE adds a shared expert
to every sparse layer: a gated MLP of shared_expert_intermediate_size that every token runs,
its output scaled by sigmoid(w_s . x), w_s the (1, D) ``mlp.shared_expert_gate``; it is added
to the routed experts' sum.

gpt-oss's router has a bias (its logits are W_r x + b_r; the softmax over the top k logits
equals the renormalized top k of the softmax over all), each expert's three products have
biases, and its activation is a clamped SwiGLU: gate clamped to <= limit, up to [-limit,
limit], then (up + 1) * gate * sigmoid(alpha * gate) (``swiglu_limit``, 7; ``swiglu_alpha``,
1.702). Its checkpoints hold the fused form with gate and up interleaved along the columns:
``mlp.experts.gate_up_proj`` (E, D, 2F), gate columns 0::2 and up 1::2, its bias (E, 2F) alike,
``mlp.experts.down_proj`` (E, F, D) and ``down_proj_bias`` (E, D), the router
``mlp.router.weight`` and ``.bias``.

Checkpoints store each expert's matrices apart (what transformers 5's ``save_pretrained``
writes, converting back from the fused 3-D tensors it holds in memory):
``mlp.experts.{e}.gate_proj/up_proj/down_proj`` and the router ``mlp.gate`` (Qwen3-MoE);
``block_sparse_moe.experts.{e}.w1/w3/w2`` and ``block_sparse_moe.gate`` (Mixtral). The fused
form (``mlp.experts.gate_up_proj`` (E, 2F, D), gate rows first, ``mlp.experts.down_proj``
(E, D, F)) is read as well. ``stack_experts`` turns either into one (E, ...) array per matrix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

# config.json keys of the MoE families besides COMMON_KEYS (harmless ones: families.py)
QWEN3_MOE_KEYS = {
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
}
MIXTRAL_KEYS = {"num_local_experts", "num_experts_per_tok"}
QWEN2_MOE_KEYS = QWEN3_MOE_KEYS | {"shared_expert_intermediate_size"}
OLMOE_KEYS = {"num_experts", "num_local_experts", "num_experts_per_tok", "norm_topk_prob"}
# gpt-oss's clamped SwiGLU as the released models (and transformers' defaults, and llama.cpp for
# every gpt-oss GGUF) have it: (limit, alpha)
GPT_OSS_SWIGLU = (7.0, 1.702)
# gpt-oss: experts_per_token repeats num_experts_per_tok, initial_context_length the yarn
# scaling's original context (each checked equal)
GPT_OSS_KEYS = {
    "num_local_experts",
    "num_experts_per_tok",
    "experts_per_token",
    "initial_context_length",
    "swiglu_alpha",
    "swiglu_limit",
}

# LayerWeights field -> the stacked array's name, for a sparse layer ({i}: the layer)
STACKED = {
    "router": "model.layers.{i}.moe.router",  # (E, D)
    "e_gate": "model.layers.{i}.moe.gate",  # (E, F, D)
    "e_up": "model.layers.{i}.moe.up",  # (E, F, D)
    "e_down": "model.layers.{i}.moe.down",  # (E, D, F)
}
DENSE_MLP = ("w_gate", "w_up", "w_down")
# gpt-oss's biases of the router and the experts, stacked like the matrices
STACKED_BIAS = {
    "router_bias": "model.layers.{i}.moe.router_bias",  # (E,)
    "e_gate_bias": "model.layers.{i}.moe.gate_bias",  # (E, F)
    "e_up_bias": "model.layers.{i}.moe.up_bias",  # (E, F)
    "e_down_bias": "model.layers.{i}.moe.down_bias",  # (E, D)
}
# Qwen2-MoE's shared expert: LayerWeights field -> checkpoint name (kept per layer, not stacked)
SHARED = {
    "s_gate": "model.layers.{i}.mlp.shared_expert.gate_proj.weight",  # (Fs, D)
    "s_up": "model.layers.{i}.mlp.shared_expert.up_proj.weight",  # (Fs, D)
    "s_down": "model.layers.{i}.mlp.shared_expert.down_proj.weight",  # (D, Fs)
    "s_logit": "model.layers.{i}.mlp.shared_expert_gate.weight",  # (1, D)
}

# per family: the router's name, and each stacked matrix's per-expert name ({e}: the expert)
PER_EXPERT = {
    "qwen3_moe": (
        "model.layers.{i}.mlp.gate.weight",
        {
            "e_gate": "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
            "e_up": "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
            "e_down": "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
        },
    ),
    "qwen2_moe": (
        "model.layers.{i}.mlp.gate.weight",
        {
            "e_gate": "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
            "e_up": "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
            "e_down": "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
        },
    ),
    "mixtral": (
        "model.layers.{i}.block_sparse_moe.gate.weight",
        {
            "e_gate": "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
            "e_up": "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight",
            "e_down": "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",
        },
    ),
}
PER_EXPERT["olmoe"] = PER_EXPERT["qwen3_moe"]
FUSED_GATE_UP = "model.layers.{i}.mlp.experts.gate_up_proj"  # (E, 2F, D)
FUSED_DOWN = "model.layers.{i}.mlp.experts.down_proj"  # (E, D, F)
GPT_OSS_ROUTER = ("model.layers.{i}.mlp.router.weight", "model.layers.{i}.mlp.router.bias")
GPT_OSS_BIASES = (
    "model.layers.{i}.mlp.experts.gate_up_proj_bias",  # (E, 2F) gate and up interleaved
    "model.layers.{i}.mlp.experts.down_proj_bias",  # (E, D)
)


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int  # E
    top_k: int  # experts each token runs
    intermediate_size: int  # F of each expert's gated MLP
    renormalize: bool  # the top-k weights divided by their sum
    sparse: tuple[bool, ...]  # per layer: experts (True) or the dense MLP
    shared_intermediate_size: int = 0  # Fs of the sigmoid-gated shared expert (0: none)
    biases: bool = False  # gpt-oss: the router and each expert's products have biases
    swiglu_limit: float = 0.0  # gpt-oss's clamped SwiGLU (0: the family's activation)
    swiglu_alpha: float = GPT_OSS_SWIGLU[1]  # its sigmoid's gain

    def __post_init__(self):
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"config.json: num_experts_per_tok ({self.top_k}) must be in "
                f"[1, num_experts ({self.num_experts})]"
            )
        if self.intermediate_size <= 0:
            raise ValueError(
                f"config.json: the experts' intermediate size must be positive, got "
                f"{self.intermediate_size}"
            )


def _positive(d: dict, key: str, where: str, default=None) -> int:
    value = d.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def moe_spec(d: dict, family: str, num_layers: int, where: str = "config.json") -> MoeSpec:
    """The experts a qwen3_moe, qwen2_moe, mixtral, olmoe or gpt_oss config.json describes."""
    top_k = _positive(d, "num_experts_per_tok", where)
    if family == "gpt_oss":
        return _gpt_oss_spec(d, top_k, num_layers, where)
    key = "num_experts" if "num_experts" in d and family != "mixtral" else "num_local_experts"
    n = _positive(d, key, where)
    if family in ("mixtral", "olmoe"):
        renorm = True if family == "mixtral" else _flag(d, "norm_topk_prob", where)
        width = _positive(d, "intermediate_size", where)
        return MoeSpec(n, top_k, width, renorm, (True,) * num_layers)
    step = _positive(d, "decoder_sparse_step", where, 1)
    dense = d.get("mlp_only_layers") or []
    if not all(isinstance(i, int) and 0 <= i < num_layers for i in dense):
        raise ValueError(f"{where}: mlp_only_layers {dense!r} names a layer out of range")
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    renorm = _flag(d, "norm_topk_prob", where)
    shared = _positive(d, "shared_expert_intermediate_size", where) if family == "qwen2_moe" else 0
    width = _positive(d, "moe_intermediate_size", where)
    return MoeSpec(n, top_k, width, renorm, sparse, shared)


def _gpt_oss_spec(d: dict, top_k: int, num_layers: int, where: str) -> MoeSpec:
    if d.get("experts_per_token", top_k) != top_k:
        raise ValueError(
            f"{where}: experts_per_token ({d['experts_per_token']!r}) differs from "
            f"num_experts_per_tok ({top_k})"
        )
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    original = rope.get("original_max_position_embeddings") if isinstance(rope, dict) else None
    if d.get("initial_context_length", original) != original:
        raise ValueError(
            f"{where}: initial_context_length ({d['initial_context_length']!r}) differs from "
            f"the rope scaling's original_max_position_embeddings ({original!r})"
        )
    limit = d.get("swiglu_limit", GPT_OSS_SWIGLU[0])
    alpha = d.get("swiglu_alpha", GPT_OSS_SWIGLU[1])
    for key, value in (("swiglu_limit", limit), ("swiglu_alpha", alpha)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ValueError(f"{where}: {key} must be a positive number, got {value!r}")
    n, width = _positive(d, "num_local_experts", where), _positive(d, "intermediate_size", where)
    sparse = (True,) * num_layers
    return MoeSpec(n, top_k, width, True, sparse, 0, True, float(limit), float(alpha))


def _flag(d: dict, key: str, where: str) -> bool:
    value = d.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {key} must be true or false, got {value!r}")
    return value


def moe_layer_names(
    names: Mapping[str, str], spec: MoeSpec, stacked=STACKED, shared=SHARED, biases=STACKED_BIAS
) -> dict[str, str]:
    """A sparse layer's name table: the dense one without its MLP, with the stacked experts'
    names (``stacked``; a GGUF's are its own), the shared expert's (``shared``) and the
    biases (``biases``) where the spec has them."""
    out = {k: v for k, v in names.items() if k not in DENSE_MLP} | dict(stacked)
    out |= dict(biases) if spec.biases else {}
    return out | (dict(shared) if spec.shared_intermediate_size else {})


def moe_shapes(spec: MoeSpec, hidden: int) -> dict[str, tuple[int, ...]]:
    """The stacked fields' shapes."""
    e, f, d, fs = spec.num_experts, spec.intermediate_size, hidden, spec.shared_intermediate_size
    shapes = {"router": (e, d), "e_gate": (e, f, d), "e_up": (e, f, d), "e_down": (e, d, f)}
    if fs:
        shapes |= {"s_gate": (fs, d), "s_up": (fs, d), "s_down": (d, fs), "s_logit": (1, d)}
    if spec.biases:
        shapes |= {"router_bias": (e,), "e_gate_bias": (e, f), "e_up_bias": (e, f)}
        shapes |= {"e_down_bias": (e, d)}
    return shapes


def stack_experts(
    tensors: Mapping[str, np.ndarray], family: str, spec: MoeSpec, hidden: int
) -> dict[str, np.ndarray]:
    """The checkpoint's tensors with each sparse layer's router and experts under STACKED's
    names, one (E, ...) array per matrix (a copy: the experts' matrices side by side)."""
    if family == "gpt_oss":
        return _gpt_oss_experts(dict(tensors), spec)
    out, (router, per_expert) = dict(tensors), PER_EXPERT[family]
    shapes = moe_shapes(spec, hidden)
    for i, sparse in enumerate(spec.sparse):
        if not sparse:
            continue
        if router.format(i=i) in out:
            out[STACKED["router"].format(i=i)] = out.pop(router.format(i=i))
        if FUSED_GATE_UP.format(i=i) in out:
            _split_fused(out, i, spec)
            continue
        for field, name in per_expert.items():
            names = [name.format(i=i, e=e) for e in range(spec.num_experts)]
            for n in names:
                if n not in out:
                    raise ValueError(f"checkpoint: missing tensor {n!r} (expected shape "
                                     f"{shapes[field][1:]})")  # fmt: skip
                if tuple(out[n].shape) != shapes[field][1:]:
                    raise ValueError(f"checkpoint: tensor {n!r} has shape {tuple(out[n].shape)}, "
                                     f"config implies {shapes[field][1:]}")  # fmt: skip
            out[STACKED[field].format(i=i)] = np.stack([out.pop(n) for n in names])
    return out


def _split_fused(out: dict, i: int, spec: MoeSpec) -> None:
    """transformers 5's in-memory form: gate_up_proj (E, 2F, D) -> gate, up; down_proj."""
    gate_up, f = out.pop(FUSED_GATE_UP.format(i=i)), spec.intermediate_size
    if gate_up.ndim != 3 or gate_up.shape[1] != 2 * f:
        name, shape = FUSED_GATE_UP.format(i=i), tuple(gate_up.shape)
        raise ValueError(f"checkpoint: tensor {name!r} has shape {shape}, config implies "
                         f"(E, {2 * f}, hidden)")  # fmt: skip
    out[STACKED["e_gate"].format(i=i)] = gate_up[:, :f]
    out[STACKED["e_up"].format(i=i)] = gate_up[:, f:]
    down = out.pop(FUSED_DOWN.format(i=i), None)
    if down is None:
        raise ValueError(f"checkpoint: missing tensor {FUSED_DOWN.format(i=i)!r}")
    out[STACKED["e_down"].format(i=i)] = down


def _gpt_oss_experts(out: dict, spec: MoeSpec) -> dict[str, np.ndarray]:
    """gpt-oss's experts under STACKED's and STACKED_BIAS's names: gate_up_proj (E, D, 2F)
    de-interleaved and transposed into gate and up (E, F, D), down_proj (E, F, D) to (E, D, F),
    the biases split alike (a checkpoint's tensors missing or misshapen: the shape check of
    the loader names them); an MXFP4 checkpoint's blocks stay blocks (``_mxfp4_experts``)."""
    f = spec.intermediate_size
    for i in range(len(spec.sparse)):
        name, down_name = FUSED_GATE_UP.format(i=i), FUSED_DOWN.format(i=i)
        biases = [b.format(i=i) for b in GPT_OSS_BIASES]
        if name + "_blocks" in out:
            _mxfp4_experts(out, i)
        else:
            for n in (name, down_name):
                if n not in out:
                    raise ValueError(f"checkpoint: missing tensor {n!r}")
            gate_up, down = out.pop(name), out.pop(down_name)
            if gate_up.ndim != 3 or gate_up.shape[2] != 2 * f:
                shape = tuple(gate_up.shape)
                raise ValueError(f"checkpoint: tensor {name!r} has shape {shape}, config "
                                 f"implies (E, hidden, {2 * f})")  # fmt: skip
            out[STACKED["e_gate"].format(i=i)] = gate_up[:, :, 0::2].transpose(0, 2, 1)
            out[STACKED["e_up"].format(i=i)] = gate_up[:, :, 1::2].transpose(0, 2, 1)
            out[STACKED["e_down"].format(i=i)] = down.transpose(0, 2, 1)
        for n in biases:
            if n not in out:
                raise ValueError(f"checkpoint: missing tensor {n!r}")
        gate_up_bias, down_bias = (out.pop(n) for n in biases)
        out[STACKED_BIAS["e_gate_bias"].format(i=i)] = gate_up_bias[:, 0::2]
        out[STACKED_BIAS["e_up_bias"].format(i=i)] = gate_up_bias[:, 1::2]
        out[STACKED_BIAS["e_down_bias"].format(i=i)] = down_bias
        weight, bias = (n.format(i=i) for n in GPT_OSS_ROUTER)
        if weight in out:
            out[STACKED["router"].format(i=i)] = out.pop(weight)
        if bias in out:
            out[STACKED_BIAS["router_bias"].format(i=i)] = out.pop(bias)
    return out


def _mxfp4_experts(out: dict, i: int) -> None:
    """Layer i's MXFP4 experts (a gpt-oss checkpoint's ``*_blocks`` (E, rows, cols/32, 16) and
    ``*_scales`` (E, rows, cols/32), rows the outputs: gate_up's 2F interleaved, down's D) ->
    e_gate, e_up (E, F, D) and e_down (E, D, F) kept in GGUF's MXFP4 blocks, their values
    unchanged (model_loader.gguf_blocks.mxfp4_experts)."""
    from model_loader.gguf_blocks import mxfp4_experts

    parts = {}
    for fused in (FUSED_GATE_UP, FUSED_DOWN):
        name = fused.format(i=i)
        for suffix in ("_blocks", "_scales"):
            if name + suffix not in out:
                raise ValueError(f"checkpoint: missing tensor {name + suffix!r}")
        parts[fused] = (name, out.pop(name + "_blocks"), out.pop(name + "_scales"))
    name, blocks, scales = parts[FUSED_GATE_UP]
    for field, rows in (("e_gate", slice(0, None, 2)), ("e_up", slice(1, None, 2))):
        out[STACKED[field].format(i=i)] = mxfp4_experts(name, blocks[:, rows], scales[:, rows])
    out[STACKED["e_down"].format(i=i)] = mxfp4_experts(*parts[FUSED_DOWN])
