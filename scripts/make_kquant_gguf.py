"""Write a GGUF of random k-quant blocks in the layout of llama.cpp's Q4_K_M mix, TinyLlama's
shape by default: the embedding table and every attn_q/attn_k/attn_output/ffn_gate/ffn_up in
Q4_K, the LM head in Q6_K, attn_v and ffn_down in Q6_K on the layers llama.cpp gives more
bits (the first and last eighth, and every third between) and Q4_K elsewhere; norms F32; a
byte-level BPE tokenizer (model_loader.synthetic's) padded to the vocabulary. The blocks are
random bytes with small float16 factors: a decode's speed and memory do not depend on the
values, so the file times the products as a real Q4_K_M file of that shape would.

    python scripts/make_kquant_gguf.py OUT.gguf [--layers 22]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from model_loader import kquants  # noqa: E402
from model_loader.synthetic import train_tokenizer  # noqa: E402

Q = gguf.GGMLQuantizationType
SHAPE = dict(dim=2048, ffn=5632, heads=32, kv_heads=4, vocab=32000)  # TinyLlama-1.1B's


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v and ffn_down Q4_K_M keeps in Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def random_blocks(rng, type_name: str, rows: int, cols: int) -> np.ndarray:
    """(rows, bytes of a row) random blocks, float16 factors uniform in [0, 2e-3)."""
    per, size = kquants.LAYOUTS[type_name]
    raw = rng.integers(0, 256, (rows * cols // per, size), dtype=np.uint8)
    halves = (208,) if type_name == "Q6_K" else (0, 2)
    for at in halves:
        h = rng.uniform(0, 2e-3, len(raw)).astype(np.float16)
        raw[:, at : at + 2] = h.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def add_tokenizer(w: gguf.GGUFWriter, vocab: int) -> None:
    """A small BPE's tokens and merges, the token list padded to ``vocab`` entries."""
    tok = json.loads(train_tokenizer(320).to_str())
    ids = tok["model"]["vocab"]
    tokens = sorted(ids, key=ids.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    pad = [f"<pad{i}>" for i in range(vocab - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens + pad)
    w.add_token_merges(merges)
    w.add_token_types([1] * len(tokens) + [4] * len(pad))
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)


def write(path: Path, layers: int, seed: int = 0) -> Path:
    rng, s = np.random.default_rng(seed), SHAPE
    hd = s["dim"] // s["heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers), w.add_context_length(2048), w.add_embedding_length(s["dim"])
    w.add_feed_forward_length(s["ffn"]), w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"]), w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5), w.add_vocab_size(s["vocab"]), w.add_file_type(15)
    add_tokenizer(w, s["vocab"])
    mats = {"token_embd.weight": ("Q4_K", s["vocab"], s["dim"])}
    for i in range(layers):
        big = "Q6_K" if more_bits(i, layers) else "Q4_K"
        for name, rows, cols, t in [
            ("attn_q", s["dim"], s["dim"], "Q4_K"),
            ("attn_k", s["kv_heads"] * hd, s["dim"], "Q4_K"),
            ("attn_v", s["kv_heads"] * hd, s["dim"], big),
            ("attn_output", s["dim"], s["dim"], "Q4_K"),
            ("ffn_gate", s["ffn"], s["dim"], "Q4_K"),
            ("ffn_up", s["ffn"], s["dim"], "Q4_K"),
            ("ffn_down", s["dim"], s["ffn"], big),
        ]:
            mats[f"blk.{i}.{name}.weight"] = (t, rows, cols)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(s["dim"], np.float32))
    mats["output.weight"] = ("Q6_K", s["vocab"], s["dim"])
    w.add_tensor("output_norm.weight", np.ones(s["dim"], np.float32))
    for name, (t, rows, cols) in mats.items():
        w.add_tensor(name, random_blocks(rng, t, rows, cols), raw_dtype=Q[t])
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
    return path


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the .gguf file to write")
    p.add_argument("--layers", type=int, default=22, help="transformer layers (TinyLlama: 22)")
    args = p.parse_args(argv)
    print(write(args.out, args.layers))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
