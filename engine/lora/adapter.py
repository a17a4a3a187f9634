"""A PEFT LoRA adapter directory -> the low-rank pairs of the engine's fused matrices.

PEFT's LoRA adds to a linear layer y = x W^T its low-rank update ``scale * (x A^T) B^T``, A
(r, in) and B (out, r) stored as ``...layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight``
in ``adapter_model.safetensors``; ``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with
``use_rslora``), r the module's own rank (``rank_pattern`` changes it per module; the shapes
say it). The engine's layers multiply four fused matrices (engine/backends/numpy_backend.py
``PackedLayer``: q|k|v, o, gate|up, down), so an adapter becomes, per layer and fused matrix,
A (in, R), its modules' A^T side by side, and each module's scale * B^T, which takes the
module's columns of x @ A to the module's columns of the fused output. A row's update is
``t = x @ A``, then for each module ``t[:, r0:r1] @ B_m`` added into its output columns.

Refused by name: a ``.bin`` adapter (a torch pickle), DoRA, ``modules_to_save``, a bias, layers
or modules this engine does not fuse (embeddings, the LM head), ``alpha_pattern``, a rank above
``max_lora_rank``, a shape that does not fit the model, NaN or infinite weights.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model_loader.config import ModelConfig

# PEFT module -> (fused matrix, its parts in order); a fused checkpoint's own names take all parts
MODULES = {
    "q_proj": ("w_qkv", (0,)),
    "k_proj": ("w_qkv", (1,)),
    "v_proj": ("w_qkv", (2,)),
    "qkv_proj": ("w_qkv", (0, 1, 2)),
    "o_proj": ("w_o", (0,)),
    "gate_proj": ("w_gate_up", (0,)),
    "up_proj": ("w_gate_up", (1,)),
    "gate_up_proj": ("w_gate_up", (0, 1)),
    "down_proj": ("w_down", (0,)),
}
EXPERT_MATRICES = ("w_gate_up", "w_down")  # a sparse layer's MLP: experts, no such matrices
KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


@dataclass
class LoRAWeights:
    """One adapter: ``layers[i][matrix] = (A (in, R), [(r0, r1, c0, B_m)])``, float32: its
    modules' A side by side, and each module's B_m (r1 - r0, n_m), the scale in it, for A's
    columns r0:r1 and the fused output's columns c0:c0 + n_m; a layer's matrix the adapter
    leaves alone is absent."""

    name: str
    rank: int  # the largest module rank
    layers: list[dict[str, tuple[np.ndarray, np.ndarray]]]

    @property
    def nbytes(self) -> int:
        pairs = [pair for layer in self.layers for pair in layer.values()]
        return sum(a.nbytes + sum(b.nbytes for *_, b in bs) for a, bs in pairs)


def shapes(cfg: ModelConfig) -> dict[str, tuple[int, list[int]]]:
    """Each fused matrix's input width and its parts' output widths (ModelConfig's)."""
    return cfg.fused_shapes


def load_adapter(path: str | Path, cfg: ModelConfig, max_rank: int, name: str = "") -> LoRAWeights:
    """The adapter at ``path`` (a PEFT directory, or llama.cpp's LoRA GGUF) for a model of
    ``cfg``; a ValueError naming what does not fit."""
    path = Path(path)
    where = f"LoRA adapter {name or path}"
    if path.suffix == ".gguf" and path.is_file():
        conf, tensors = _gguf(path, cfg, where)
    else:
        conf, tensors = _config(path, where), _tensors(path, where)
    modules: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, t in tensors.items():
        m = KEY.search(key)
        if m is None:
            raise ValueError(f"{where}: {key!r} is not a LoRA A or B of a layer's projection")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in MODULES:
            raise ValueError(f"{where}: target module {module!r} is not one of {sorted(MODULES)}")
        if layer >= cfg.num_hidden_layers:
            raise ValueError(f"{where}: layer {layer}, the model has {cfg.num_hidden_layers}")
        if MODULES[module][0] in EXPERT_MATRICES and cfg.moe and cfg.moe.sparse[layer]:
            raise ValueError(
                f"{where}: layer {layer} {module}: the layer's MLP is a mixture of experts "
                f"(LoRA on experts is not supported; its attention's projections are)"
            )
        if not np.isfinite(t).all():
            raise ValueError(f"{where}: {key} holds NaN or infinite values")
        modules.setdefault((layer, module), {})[ab] = t
    layers, rank = _fuse(modules, conf, cfg, max_rank, where)
    return LoRAWeights(name or str(path), rank, layers)


def _config(path: Path, where: str) -> dict:
    file = path / "adapter_config.json"
    if not file.is_file():
        raise ValueError(f"{where}: no adapter_config.json in {path}")
    try:
        conf = json.loads(file.read_text())
    except ValueError as e:
        raise ValueError(f"{where}: adapter_config.json is not JSON ({e})") from None
    refusals = {
        "peft_type": (conf.get("peft_type", "LORA") != "LORA", "is not LORA"),
        "use_dora": (bool(conf.get("use_dora")), "DoRA is not implemented"),
        "modules_to_save": (bool(conf.get("modules_to_save")), "is not implemented"),
        "bias": (conf.get("bias", "none") != "none", "LoRA biases are not implemented"),
        "alpha_pattern": (bool(conf.get("alpha_pattern")), "is not implemented"),
        "fan_in_fan_out": (bool(conf.get("fan_in_fan_out")), "(Conv1D layers) is not implemented"),
    }
    for field, (bad, why) in refusals.items():
        if bad:
            raise ValueError(f"{where}: {field}={conf.get(field)!r}: {why}")
    alpha = conf.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
        raise ValueError(f"{where}: lora_alpha must be a positive number, got {alpha!r}")
    return conf


def _tensors(path: Path, where: str) -> dict[str, np.ndarray]:
    file = path / "adapter_model.safetensors"
    if not file.is_file():
        if (path / "adapter_model.bin").exists():
            raise ValueError(
                f"{where}: adapter_model.bin is a torch pickle, which is not read; save the "
                "adapter with safe_serialization=True (adapter_model.safetensors)"
            )
        raise ValueError(f"{where}: no adapter_model.safetensors in {path}")
    from safetensors.numpy import load_file

    try:
        return {k: _float32(v) for k, v in load_file(str(file)).items()}
    except Exception as e:  # noqa: BLE001 - a damaged file, named
        raise ValueError(f"{where}: adapter_model.safetensors is not readable ({e})") from None


# llama.cpp's tensor names -> PEFT's modules (convert_lora_to_gguf.py writes blk.{i}.NAME.weight
# .lora_a (r, in) and .lora_b (out, r), and the alpha as adapter.lora.alpha)
GGUF_MODULES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_up_gate": "mlp.gate_up_proj",
}  # fmt: skip
GGUF_KEY = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")


def _gguf(path: Path, cfg: ModelConfig, where: str) -> tuple[dict, dict[str, np.ndarray]]:
    """llama.cpp's LoRA GGUF as PEFT's config and tensors: its alpha, and each pair under
    PEFT's name, the Q and K B rows put back in Hugging Face's order where llama.cpp's
    converter permuted them (as it permutes the base model's)."""
    import gguf

    from model_loader.gguf_file import PERMUTED_QK, unpermute_qk

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - not a GGUF, or damaged: named
        raise ValueError(f"{where}: not a readable GGUF ({e})") from None
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    if fields.get("general.type") != "adapter" or fields.get("adapter.type") != "lora":
        raise ValueError(f"{where}: the GGUF is not a LoRA adapter (general.type adapter)")
    arch = fields.get("general.architecture")
    tensors = {}
    for t in reader.tensors:
        m = GGUF_KEY.match(t.name)
        if m is None or m.group(2) not in GGUF_MODULES:
            raise ValueError(
                f"{where}: tensor {t.name!r} is not a LoRA pair of a layer's projection"
            )
        if t.tensor_type.name not in ("F32", "F16"):
            raise ValueError(f"{where}: tensor {t.name} is {t.tensor_type.name}; F32 or F16 only")
        layer, kind, ab = int(m.group(1)), m.group(2), m.group(3).upper()
        a = np.array(t.data, dtype=np.float32).reshape([int(n) for n in reversed(t.shape)])
        if ab == "B" and kind in ("attn_q", "attn_k") and arch in PERMUTED_QK:
            heads = cfg.num_attention_heads if kind == "attn_q" else cfg.num_key_value_heads
            if a.shape[0] == heads * cfg.head_dim:
                a = unpermute_qk(a, heads)
        tensors[f"layers.{layer}.{GGUF_MODULES[kind]}.lora_{ab}.weight"] = a
    alpha = fields.get("adapter.lora.alpha")
    if not isinstance(alpha, int | float) or not alpha > 0:
        raise ValueError(f"{where}: adapter.lora.alpha must be a positive number, got {alpha!r}")
    return {"lora_alpha": float(alpha)}, tensors


def _float32(t: np.ndarray) -> np.ndarray:
    return np.asarray(t, dtype=np.float32)


def _fuse(modules: dict, conf: dict, cfg: ModelConfig, max_rank: int, where: str):
    """Per layer, each fused matrix's (A, B) from its modules' pairs; the largest rank."""
    widths, rank = shapes(cfg), 0
    parts: dict[tuple[int, str], list] = {}
    for (layer, module), pair in sorted(modules.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{where}: layer {layer} {module} has lora_{''.join(pair)} alone")
        a, b = pair["A"], pair["B"]  # (r, in), (out, r)
        matrix, idx = MODULES[module]
        k, outs = widths[matrix]
        out = sum(outs[i] for i in idx)
        r = a.shape[0]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != k or b.shape != (out, r):
            raise ValueError(
                f"{where}: layer {layer} {module}: A {a.shape} and B {b.shape} do not fit the "
                f"model's ({r}, {k}) and ({out}, {r})"
            )
        if r > max_rank:
            raise ValueError(
                f"{where}: layer {layer} {module} has rank {r} > max_lora_rank {max_rank}"
            )
        rank = max(rank, r)
        alpha = float(conf["lora_alpha"])
        scale = alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r
        start = sum(outs[: idx[0]])  # the first column of the module's output in the fused one
        parts.setdefault((layer, matrix), []).append((a.T, scale * b.T, start))
    layers: list[dict] = [{} for _ in range(cfg.num_hidden_layers)]
    for (layer, matrix), pairs in parts.items():
        big_a = np.concatenate([a for a, _, _ in pairs], axis=1)  # (in, R)
        bs, r0 = [], 0
        for a, b, start in pairs:
            bs.append((r0, r0 + a.shape[1], start, np.ascontiguousarray(b)))
            r0 += a.shape[1]
        layers[layer][matrix] = (np.ascontiguousarray(big_a), bs)
    return layers, rank
