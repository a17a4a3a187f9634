"""Write the models the GPU check needs, since nothing can be downloaded on the GPU machine.

    python scripts/make_random_model.py DIR [--tiny-only]

DIR/tiny        the tests' tiny random LLaMA (model_loader/synthetic.py), float32
DIR/tinyllama   TinyLlama-1.1B's shape (22 layers, hidden 2048, 32 heads, 4 KV heads, ffn 5632,
                vocab 32000) with random bfloat16 weights, a BPE tokenizer and a ChatML template
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model_loader.synthetic import make_tiny_model, save_tokenizer, train_tokenizer  # noqa: E402

TINYLLAMA = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


def random_bf16_weights(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    """HF-named bfloat16 tensors: uniform with unit-variance rows (fast to draw at 1.1B)."""
    rng = np.random.default_rng(seed)
    d, f, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nq, nkv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def mat(rows, cols, scale=1.0):  # (rows, cols), variance scale^2 / cols
        a = rng.random((rows, cols), dtype=np.float32) - np.float32(0.5)
        return (a * np.float32(scale * np.sqrt(12.0 / cols))).astype(ml_dtypes.bfloat16)

    def norm(n):  # (n,)
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(ml_dtypes.bfloat16)

    t = {"model.embed_tokens.weight": mat(cfg["vocab_size"], d, np.sqrt(d))}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(d)
        t[p + "self_attn.q_proj.weight"] = mat(nq, d)
        t[p + "self_attn.k_proj.weight"] = mat(nkv, d)
        t[p + "self_attn.v_proj.weight"] = mat(nkv, d)
        t[p + "self_attn.o_proj.weight"] = mat(d, nq)
        t[p + "post_attention_layernorm.weight"] = norm(d)
        t[p + "mlp.gate_proj.weight"] = mat(f, d)
        t[p + "mlp.up_proj.weight"] = mat(f, d)
        t[p + "mlp.down_proj.weight"] = mat(d, f)
    t["model.norm.weight"] = norm(d)
    t["lm_head.weight"] = mat(cfg["vocab_size"], d, 4.0)
    return t


def make_tinyllama_shaped(path: Path, seed: int = 0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(1000)  # a small BPE: every id it makes is < vocab_size
    eos = tok.token_to_id("<|endoftext|>")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": eos,
        "eos_token_id": eos,
        **TINYLLAMA,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    save_tokenizer(path, tok)  # add_bos_token false, as this tokenizer's post-processor says
    save_file(random_bf16_weights(TINYLLAMA, seed), str(path / "model.safetensors"))
    return path


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", nargs="?", default="models", help="where to write them (./models)")
    p.add_argument("--tiny-only", action="store_true", help="the tiny model alone")
    args = p.parse_args(argv)
    out, t0 = Path(args.dir), time.perf_counter()
    make_tiny_model(out / "tiny", seed=0)
    if not args.tiny_only:
        make_tinyllama_shaped(out / "tinyllama")
    print(f"models in {out} after {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
