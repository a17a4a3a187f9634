"""Golden bytes for model_loader.kquant_encode: random float32 rows (row lengths 256, 512 and
576; Gaussian rows, rows with outliers, all-positive rows, rows whose groups differ in scale by
1000x, a few all-zero groups) written to a float32 llama GGUF, quantized by llama.cpp's
``llama-quantize --pure`` to each type, the tensors' bytes read back and saved with the inputs:

    python scripts/make_quantize_golden.py LLAMA_QUANTIZE [tests/data/quantize_golden.npz]

Types: Q4_K, Q5_K, Q6_K (the 576-long rows fall back to Q5_0, Q5_1, Q8_0, as llama.cpp does),
Q5_0, Q5_1, Q8_0, Q4_0. Run at development time only (the tests read the .npz).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np

TYPES = {"Q4_K": 15, "Q5_K": 17, "Q6_K": 18, "Q5_0": 8, "Q5_1": 9, "Q8_0": 7, "Q4_0": 2}
SHAPES = {  # tensor -> (rows, row length)
    "blk.0.attn_q.weight": (24, 256),
    "blk.0.ffn_up.weight": (12, 512),
    "blk.0.ffn_down.weight": (12, 576),
}


def rows(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """(n, k) float32 rows of four kinds, in turn."""
    out = np.empty((n, k), np.float32)
    for i in range(n):
        kind = i % 4
        if kind == 0:
            r = rng.normal(0, 0.02, k)
        elif kind == 1:  # heavy tails: a few outliers
            r = rng.standard_t(3, k) * 0.01
        elif kind == 2:  # all positive (the affine searches' min > 0 path)
            r = rng.uniform(0.1, 1.0, k)
        else:  # groups of 16 values 1000x apart (tiny scales that round to 0 bits)
            r = rng.normal(0, 1, k) * np.repeat(rng.choice([1.0, 1e-3], k // 16), 16)
            if i % 8 == 3:
                r[32:64] = 0.0  # an all-zero group
        out[i] = r
    return out


def write_f32(path: Path, values: dict[str, np.ndarray]) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1), w.add_context_length(64), w.add_embedding_length(256)
    w.add_feed_forward_length(512), w.add_head_count(4), w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5), w.add_file_type(0)
    for name, a in values.items():
        w.add_tensor(name, a)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()


def main(argv: list[str]) -> int:
    exe, out = Path(argv[0]), Path(argv[1] if len(argv) > 1 else "tests/data/quantize_golden.npz")
    rng = np.random.default_rng(20261207)
    values = {name: rows(rng, n, k) for name, (n, k) in SHAPES.items()}
    saved = {f"in:{name}": a for name, a in values.items()}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "f32.gguf"
        write_f32(src, values)
        for type_name in TYPES:
            dst = Path(tmp) / f"{type_name}.gguf"
            cmd = [str(exe), "--pure", str(src), str(dst), type_name, "1"]
            subprocess.run(cmd, check=True, capture_output=True)
            for t in gguf.GGUFReader(str(dst)).tensors:
                if t.name in SHAPES:
                    saved[f"{type_name}:{t.name}:{t.tensor_type.name}"] = np.array(t.data)
    np.savez_compressed(out, **saved)
    print(out, sorted(k for k in saved if not k.startswith("in:")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
