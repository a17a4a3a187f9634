"""Random LoRA adapters in PEFT's layout, to time and test adapter serving without a fine-tune.

For timing (``python -m engine.bench --lora-adapters``, every layer's seven projections) and for
golden data (scripts/make_lora_golden.py --smollm2, whose
adapters the tests write again from the same seeds). Float32, A ~ N(0, 1 / in) and
B ~ N(0, b_scale^2 / r): with the default 0.1 the outputs move but stay the model's kind of text.

    python -m engine.tools.random_lora --model smollm2 --rank 8 --seed 3 --out /tmp/smollm2-r8
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from engine.lora.adapter import MODULES, shapes

PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(
    path: Path,
    cfg,
    rank: int,
    seed: int,
    modules=PARTS,
    alpha: float | None = None,
    rslora: bool = False,
    b_scale: float = 0.1,
) -> Path:
    """A PEFT adapter directory at ``path`` for a model of ``cfg`` on ``modules`` (of PARTS),
    ``lora_alpha`` ``alpha`` (default: the rank), rsLoRA's scale with ``rslora``; the same bytes
    for the same arguments. Returns ``path``."""
    from safetensors.numpy import save_file

    unknown = sorted(set(modules) - set(PARTS))
    if unknown:
        raise ValueError(f"random adapter: unknown modules {unknown}; known: {', '.join(PARTS)}")
    rng = np.random.default_rng(seed)
    widths = shapes(cfg)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for module in [m for m in PARTS if m in modules]:
            matrix, (part,) = MODULES[module]
            k, outs = widths[matrix]
            where = "self_attn" if matrix in ("w_qkv", "w_o") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{where}.{module}"
            a = rng.standard_normal((rank, k)) / np.sqrt(k)
            b = rng.standard_normal((outs[part], rank)) * (b_scale / np.sqrt(rank))
            tensors[f"{key}.lora_A.weight"] = a.astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = b.astype(np.float32)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    conf = dict(
        peft_type="LORA", r=rank, lora_alpha=rank if alpha is None else alpha,
        target_modules=[m for m in PARTS if m in modules], use_rslora=rslora,
    )  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(conf))
    return path


def main(argv=None) -> int:
    from engine.entrypoints.cli_utils import CliParser
    from model_loader.load import load_model

    p = CliParser(prog="python -m engine.tools.random_lora", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="the model it fits (default smollm2)")
    p.add_argument("--out", required=True, type=Path, help="the adapter directory to write")
    p.add_argument("--rank", type=int, default=16, help="its rank (default 16)")
    p.add_argument("--seed", type=int, default=0, help="the random weights' seed (default 0)")
    p.add_argument(
        "--modules", default=",".join(PARTS), help="comma-separated targets (default all seven)"
    )
    p.add_argument("--alpha", type=float, default=None, help="lora_alpha (default: the rank)")
    p.add_argument("--rslora", action="store_true", help="use_rslora: scale alpha / sqrt(r)")
    p.add_argument("--b-scale", type=float, default=0.1, help="B's spread (default 0.1)")
    args = p.parse_args(argv)
    if args.rank < 1:
        return p.fail(ValueError(f"rank must be at least 1, got {args.rank}"))
    try:
        cfg = load_model(args.model, weights=False).config
        write_random_adapter(
            args.out, cfg, args.rank, args.seed, args.modules.split(","), args.alpha,
            args.rslora, args.b_scale,
        )  # fmt: skip
    except ValueError as e:
        return p.fail(e)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
