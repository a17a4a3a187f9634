"""Golden data for tests/test_mxfp4.py: MXFP4 blocks dequantized by two other implementations,
gguf-py (0.19: ``gguf.quants.dequantize``, GGUF's 17-byte blocks) and transformers
(``convert_moe_packed_tensors``, a gpt-oss checkpoint's blocks and scales). Neither is a
dependency of the engine, so their answers are committed: tests/data/mxfp4_golden.npz.

    /tmp/golden-venv/bin/python scripts/make_mxfp4_golden.py  # gguf, torch, transformers

Random bytes; every exponent 0..255 occurs (subnormal, ordinary and infinite values).
"""

from pathlib import Path

import gguf
import numpy as np
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "mxfp4_golden.npz"


def main() -> None:
    rng = np.random.default_rng(20260807)
    gguf_raw = rng.integers(0, 256, (256, 17), dtype=np.uint8)  # (blocks, bytes)
    gguf_raw[:, 0] = rng.permutation(256)  # each exponent once
    with np.errstate(over="ignore"):
        gguf_values = gguf.quants.dequantize(gguf_raw, gguf.GGMLQuantizationType.MXFP4)
    hf_blocks = rng.integers(0, 256, (2, 32, 4, 16), dtype=np.uint8)  # (E, rows, cols/32, 16)
    hf_scales = rng.permutation(256).astype(np.uint8).reshape(2, 32, 4)  # each once
    hf_values = convert_moe_packed_tensors(
        torch.from_numpy(hf_blocks), torch.from_numpy(hf_scales), dtype=torch.float32
    ).numpy()  # (E, cols, rows): transformers transposes each expert
    np.savez_compressed(
        OUT,
        gguf_raw=gguf_raw,
        gguf_values=gguf_values.astype(np.float32),
        hf_blocks=hf_blocks,
        hf_scales=hf_scales,
        hf_values=hf_values.astype(np.float32),
    )
    print(f"wrote {OUT}: gguf {gguf_values.shape}, transformers {hf_values.shape}")


if __name__ == "__main__":
    main()
