"""Random LoRA adapters in PEFT's layout, for timing (``python -m engine.bench --lora-adapters``):
every layer's seven projections, rank r, float32, A ~ N(0, 1 / in) and B ~ N(0, 0.01 / r), so the
outputs move but stay the model's kind of text."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from engine.lora.adapter import MODULES, shapes

PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(path: Path, cfg, rank: int, seed: int) -> Path:
    """A PEFT adapter directory at ``path`` for a model of ``cfg``; returns ``path``."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    widths = shapes(cfg)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for module in PARTS:
            matrix, (part,) = MODULES[module]
            k, outs = widths[matrix]
            where = "self_attn" if matrix in ("w_qkv", "w_o") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{where}.{module}"
            a = rng.standard_normal((rank, k)) / np.sqrt(k)
            b = rng.standard_normal((outs[part], rank)) * (0.1 / np.sqrt(rank))
            tensors[f"{key}.lora_A.weight"] = a.astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = b.astype(np.float32)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    conf = dict(peft_type="LORA", r=rank, lora_alpha=rank, target_modules=list(PARTS))
    (path / "adapter_config.json").write_text(json.dumps(conf))
    return path
