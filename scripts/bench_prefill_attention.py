"""The cpu backend's prefill attention alone (cpu_src/paged_attention_prefill.cpp): causal
attention of whole prompts over a float32 paged cache, SmolLM2's and TinyLlama's head shapes,
best of five runs, on the kernels' threads. Set PAGEDLLM_CPU_ISA=x86-64-v3 for the AVX2 build;
``--numpy`` times the numpy backend's op instead (engine/backends/fast_ops.py).

    .venv/bin/python scripts/bench_prefill_attention.py [--numpy]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.backends import cpu_ops, fast_ops  # noqa: E402

# name: (query heads, KV heads, head dim, prompt tokens, prompts)
CASES = {
    "SmolLM2 heads, 14 x 282": (9, 3, 64, 282, 14),
    "SmolLM2 heads, 8 x 512": (9, 3, 64, 512, 8),
    "TinyLlama heads, 8 x 512": (32, 4, 64, 512, 8),
    "TinyLlama heads, 1 x 2048": (32, 4, 64, 2048, 1),
}


def run(op, H: int, hkv: int, hd: int, n: int, B: int, bs: int = 16) -> float:
    """Seconds for one call of ``op`` on B prompts of n tokens (best of 5)."""
    rng = np.random.default_rng(0)
    blocks = B * -(-n // bs)
    k = rng.standard_normal((blocks, bs, hkv, hd), dtype=np.float32)  # (N, bs, Hkv, hd)
    v = rng.standard_normal((blocks, bs, hkv, hd), dtype=np.float32)
    tables = np.arange(blocks, dtype=np.int32).reshape(B, -1)  # (B, blocks per prompt)
    lens = np.full(B, n, np.int32)
    qsl = np.arange(B + 1, dtype=np.int32) * n
    q = rng.standard_normal((B * n, H, hd), dtype=np.float32)  # (T, H, hd)
    op(q, k, v, tables, qsl, lens, 0.125)  # warm-up
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        op(q, k, v, tables, qsl, lens, 0.125)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ops = fast_ops if "--numpy" in sys.argv[1:] else cpu_ops
    for name, (H, hkv, hd, n, B) in CASES.items():
        took = run(ops.paged_attention_prefill, H, hkv, hd, n, B)
        flops = B * n * (n + 1) / 2 * H * hd * 4  # the causal scores and values
        print(f"{name}: {took * 1e3:.1f} ms, {flops / took / 1e9:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
