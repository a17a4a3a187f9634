"""The LoRA kernels' global memory traffic in one decode step, against the adapters' bytes.

TinyLlama's shapes (hidden 2048, q 2048, k and v 256 each, intermediate 5632, 22 layers) in
bfloat16, a decode step of --rows rows spread over --adapters adapters of rank --rank on all seven
projections (row i on adapter i mod N), slots of --max-rank: lora_shrink and lora_expand run on
the counting builds of the CPU emulation (every load and store of the compiled kernels counted,
cuda_src/cpu/emu_traffic.h) for one layer's four products, times the layers. Prints the bytes
read from the slots' A and B, the rows' x and y, and the float32 partials, against the step's
adapters' own bytes (each module's A and B at its rank, bf16) and the base weights'.

    .venv/bin/python scripts/lora_traffic.py --rows 64 --adapters 4 --rank 16
"""

import argparse
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import emulation as E  # noqa: E402
from engine.kernels.launch import lora_tiles  # noqa: E402

D, Q, KV, F, LAYERS = 2048, 2048, 256, 5632, 22
MATRICES = {"qkv": (D, [Q, KV, KV]), "o": (Q, [D]), "gate_up": (D, [F, F]), "down": (F, [D])}
BF16 = np.dtype(ml_dtypes.bfloat16)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=64, help="decode rows in the step (default 64)")
    p.add_argument("--adapters", type=int, default=4, help="adapters the rows spread over")
    p.add_argument("--rank", type=int, default=16, help="each adapter's rank (default 16)")
    p.add_argument("--max-rank", type=int, default=16, help="the slots' rank (max_lora_rank)")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    S, R, r = args.adapters, args.max_rank, args.rank
    slots = (np.arange(args.rows) % S).astype(np.int32)
    order, tiles = lora_tiles(slots)
    k = E.counting_kernels()
    totals = dict(a=0, b=0, x=0, y_read=0, y_written=0)
    own = base = 0
    for _name, (K, widths) in MATRICES.items():
        M, N = len(widths), sum(widths)
        x = rng.standard_normal((args.rows, K)).astype(BF16)
        y = rng.standard_normal((args.rows, N)).astype(BF16)
        a = np.zeros((S, M * R, K), BF16)
        b = np.zeros((S, R, N), BF16)
        for m in range(M):
            a[:, m * R : m * R + r] = rng.standard_normal((S, r, K)).astype(BF16)
        b[:, :r] = rng.standard_normal((S, r, N)).astype(BF16)
        with E.memory_traffic() as t:
            k.lora(y, x, a, b, order, tiles, np.cumsum(widths).astype(np.int32))
        totals["a"] += t.read(a)
        totals["b"] += t.read(b)
        totals["x"] += t.read(x)
        totals["y_read"] += t.read(y)
        totals["y_written"] += t.written(y)
        own += S * (r * K * M + r * N) * 2  # each module's A (r, K) and B (r, n), bf16
        base += K * N * 2
    mib = lambda n: f"{n * LAYERS / 2**20:8.1f} MiB"  # noqa: E731
    print(f"decode step of {args.rows} rows over {S} adapters of rank {r} (slots of rank {R}), "
          f"{len(tiles)} tiles, TinyLlama's shapes x {LAYERS} layers, bfloat16:")  # fmt: skip
    print(f"  adapters' own bytes      {mib(own)}   base weights {mib(base)}")
    print(f"  read from the slots' A   {mib(totals['a'])}   B {mib(totals['b'])}")
    print(f"  the rows' x read         {mib(totals['x'])}   y read {mib(totals['y_read'])}, "
          f"written {mib(totals['y_written'])}")  # fmt: skip
    slots_read = totals["a"] + totals["b"]
    print(f"  slots read / adapters' bytes: {slots_read / own:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
