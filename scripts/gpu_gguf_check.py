"""The GPU check's GGUF stage: the block products of a Q4_K_M file's formats on the device.

    python scripts/gpu_gguf_check.py --json FILE [--emulate]

For each format the cuda backend keeps (Q8_0, Q4_0, Q5_0, Q4_K, Q6_K) and TinyLlama's product
shapes (N x K: qkv 2560 x 2048, o 2048 x 2048, gate_up 11264 x 2048, down 2048 x 5632, the LM
head 32000 x 2048; Q4_K and Q6_K, a Q4_K_M file's formats, on all five, the others on o and
gate_up), random blocks on the device:
  error     ``BlockGemm`` (engine/backends/cupy_blocks.py) at 1, 8 and 64 rows of bfloat16 x
            against x @ the NumPy-dequantized values (float32 BLAS; the largest error over
            the largest |value|; the 64-row product goes through the widened tile and cuBLAS)
  timing    seconds per product at 1, 4, 8 and 64 rows, the same product with the matrix
            widened to bfloat16 through cuBLAS, and the weight bytes read per second of the
            one-row product
``--emulate``: the emulated device, one small shape (64 x 512), one timed call each.
Exit status: 0 when every error is within 2e-2 (bfloat16 outputs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.backends.cupy_blocks import BlockGemm, DeviceBlocks  # noqa: E402
from engine.kernels.gguf_launch import GGUF_KINDS  # noqa: E402
from engine.tools.bench_gpu import Clock  # noqa: E402
from model_loader import kquants  # noqa: E402

SHAPES = {"qkv": (2560, 2048), "o": (2048, 2048), "gate_up": (11264, 2048)}
SHAPES |= {"down": (2048, 5632), "lm_head": (32000, 2048)}
HALVES = {"q8_0": (0,), "q4_0": (0,), "q5_0": (0,), "q4_k": (0, 2), "q6_k": (208,)}
BF16 = np.dtype(ml_dtypes.bfloat16)


def random_blocks(rng, kind: str, N: int, K: int) -> np.ndarray:
    """(N, bytes of a row) random blocks, float16 factors uniform in +-0.01."""
    _, per, size, _ = GGUF_KINDS[kind]
    raw = rng.integers(0, 256, (N * K // per, size), dtype=np.uint8)
    for at in HALVES[kind]:
        h = rng.uniform(-0.01, 0.01, len(raw)).astype(np.float16)
        raw[:, at : at + 2] = h.view(np.uint8).reshape(-1, 2)
    return raw.reshape(N, -1)


def values(kind: str, raw: np.ndarray) -> np.ndarray:
    if kind in ("q8_0", "q4_0"):
        return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind.upper()])
    return kquants.dequantize(raw, kind.upper())


def check(dev, rng, kind: str, N: int, K: int, repeats: int) -> dict:
    raw = random_blocks(rng, kind, N, K)
    w = values(kind, raw)  # (N, K) float32
    gemm = BlockGemm(dev.gemm, dev.kernels, dev.empty)
    clock = Clock(dev)
    with dev.active():
        blocks = DeviceBlocks([(kind, dev.upload(raw))], K)
        wide = dev.upload(w.astype(BF16))  # the matrix widened, as the backend did before
    row = {"N": N, "K": K, "weight_bytes": int(raw.nbytes), "error": {}, "seconds": {}}
    for M in (1, 4, 8, 64):
        x = rng.standard_normal((M, K), np.float32).astype(BF16)
        with dev.active():
            xd, out = dev.upload(x), dev.empty((M, N), BF16)
            ref_out = dev.empty((M, N), BF16)
        if M != 4:
            with dev.active():
                gemm(xd, blocks, out)
                got = dev.download(out).astype(np.float64)  # (M, N)
            want = (x.astype(np.float32) @ w.T).astype(np.float64)
            row["error"][M] = float(np.abs(got - want).max() / np.abs(want).max())
        blocks_s = clock.per_call(lambda: gemm(xd, blocks, out), repeats)  # noqa: B023
        wide_s = clock.per_call(lambda: dev.gemm(xd, wide, ref_out), repeats)  # noqa: B023
        row["seconds"][M] = {"blocks": blocks_s, "bf16_cublas": wide_s}
    row["blocks_gbs_1_row"] = raw.nbytes / row["seconds"][1]["blocks"] / 1e9
    return row


def run(path: Path, emulate: bool) -> int:
    from engine.devices.device import CupyDevice
    from engine.emulation.device import EmulatedDevice

    dev = EmulatedDevice() if emulate else CupyDevice()
    shapes = {"small": (64, 512)} if emulate else SHAPES
    repeats = 1 if emulate else 20
    rng = np.random.default_rng(0)
    with dev.active():
        dev.compile_kernels()
    results: dict = {"device": dev.name, "emulate": emulate, "formats": {}}
    worst = 0.0
    for kind in GGUF_KINDS:
        results["formats"][kind] = {}
        for name, (N, K) in shapes.items():
            if not emulate and kind not in ("q4_k", "q6_k") and name not in ("o", "gate_up"):
                continue
            t0 = time.perf_counter()
            row = check(dev, rng, kind, N, K, repeats)
            results["formats"][kind][name] = row
            worst = max(worst, *row["error"].values())
            path.write_text(json.dumps(results, indent=2))
            one = row["seconds"][1]
            print(
                f"{kind} {name:8s} {N}x{K}: 1 row {one['blocks'] * 1e6:8.1f} us "
                f"(bf16 cuBLAS {one['bf16_cublas'] * 1e6:8.1f} us, "
                f"{row['blocks_gbs_1_row']:6.1f} GB/s of blocks), "
                f"error {max(row['error'].values()):.2g}  [{time.perf_counter() - t0:.1f} s]",
                flush=True,
            )
    results["worst_error"] = worst
    path.write_text(json.dumps(results, indent=2))
    return 0 if worst <= 2e-2 else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True, type=Path, help="where the results go")
    p.add_argument("--emulate", action="store_true", help="the emulated device, not a GPU")
    args = p.parse_args(argv)
    return run(args.json, args.emulate)


if __name__ == "__main__":
    raise SystemExit(main())
