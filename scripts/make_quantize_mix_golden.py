"""The types llama.cpp's ``llama-quantize`` gives each tensor of a llama-shaped float32 GGUF in
the mixes q4_k_m, q5_k_m, q6_k and q5_0, for three shapes (8 layers, ffn 576: ffn_down falls
back; 12 layers with the embedding tied; 4 layers of width 576: every matrix reading the
residual falls back and the LM head is Q8_0), saved as JSON for tests/test_quantize_mix.py:

    python scripts/make_quantize_mix_golden.py LLAMA_QUANTIZE [tests/data/quantize_mix.json]

Run at development time only; only the type lists are kept.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np

MIXES = {"q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M", "q6_k": "Q6_K", "q5_0": "Q5_0"}
MODELS = {
    "ffn576": dict(layers=8, dim=256, ffn=576, heads=4, kv_heads=2, vocab=320, tied=False),
    "tied12": dict(layers=12, dim=256, ffn=512, heads=4, kv_heads=1, vocab=320, tied=True),
    "dim576": dict(layers=4, dim=576, ffn=1024, heads=9, kv_heads=3, vocab=320, tied=False),
}


def shapes(m: dict) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> NumPy shape (rows, row length) of a llama model ``m``."""
    d, f, hd = m["dim"], m["ffn"], m["dim"] // m["heads"]
    out = {"token_embd.weight": (m["vocab"], d), "output_norm.weight": (d,)}
    if not m["tied"]:
        out["output.weight"] = (m["vocab"], d)
    for i in range(m["layers"]):
        for name, shape in [
            ("attn_norm", (d,)),
            ("attn_q", (d, d)),
            ("attn_k", (m["kv_heads"] * hd, d)),
            ("attn_v", (m["kv_heads"] * hd, d)),
            ("attn_output", (d, d)),
            ("ffn_norm", (d,)),
            ("ffn_gate", (f, d)),
            ("ffn_up", (f, d)),
            ("ffn_down", (d, f)),
        ]:
            out[f"blk.{i}.{name}.weight"] = shape
    return out


def write_f32(path: Path, m: dict, rng) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(m["layers"]), w.add_context_length(64), w.add_embedding_length(m["dim"])
    w.add_feed_forward_length(m["ffn"]), w.add_head_count(m["heads"])
    w.add_head_count_kv(m["kv_heads"]), w.add_layer_norm_rms_eps(1e-5), w.add_file_type(0)
    w.add_vocab_size(m["vocab"])
    for name, shape in shapes(m).items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32) * np.float32(0.02))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()


def main(argv: list[str]) -> int:
    exe, out = Path(argv[0]), Path(argv[1] if len(argv) > 1 else "tests/data/quantize_mix.json")
    rng, result = np.random.default_rng(0), {}
    with tempfile.TemporaryDirectory() as tmp:
        for key, m in MODELS.items():
            src = Path(tmp) / f"{key}.gguf"
            write_f32(src, m, rng)
            result[key] = {"model": m, "types": {}}
            for mix, ftype in MIXES.items():
                dst = Path(tmp) / f"{key}-{mix}.gguf"
                subprocess.run([str(exe), str(src), str(dst), ftype, "1"], check=True,
                               capture_output=True)  # fmt: skip
                tensors = gguf.GGUFReader(str(dst)).tensors
                result[key]["types"][mix] = {t.name: t.tensor_type.name for t in tensors}
    out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
