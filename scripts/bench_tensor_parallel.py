"""Tensor parallel on the host: decode step time at 1, 3 (or the sizes given) ranks, and the
time each rank spends in the collectives.

    python scripts/bench_tensor_parallel.py [--model smollm2] [--sizes 1 3] [--batch 8]

Each size runs the same ``--batch`` greedy requests; the timed steps are ``--steps`` decode
steps after every prompt has been prefilled. Printed per size: the median step time, and for
TP > 1 the collectives per step and the milliseconds per step the slowest rank spent in them
(copying its part in and waiting for the others at the barrier: on a host with fewer cores
than ranks, waiting includes the other ranks' compute).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import SamplingParams  # noqa: E402
from engine.frontend.llm_engine import LLMEngine  # noqa: E402
from model_loader.load import load_model  # noqa: E402


def run(loaded, tp: int, batch: int, steps: int) -> tuple[float, float, float]:
    """(median step ms, collectives per step, slowest rank's collective ms per step)."""
    engine = LLMEngine(
        loaded=loaded, model="bench", tensor_parallel_size=tp, max_model_len=512,
        num_gpu_blocks=batch * 8,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), f"Story number {i}: once upon a time", params)
    engine.step()  # the prefills
    stats = engine.backend.comm_stats() if tp > 1 else None
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    calls = secs = 0.0
    if stats is not None:
        after = engine.backend.comm_stats()
        calls = (after[0][0] - stats[0][0]) / steps
        secs = max(b[1] - a[1] for a, b in zip(stats, after, strict=True)) / steps
        engine.backend.shutdown()
    return 1e3 * statistics.median(times), calls, 1e3 * secs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="model to run (default smollm2)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 3], help="tensor-parallel sizes")
    ap.add_argument("--batch", type=int, default=8, help="sequences decoding together")
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed per size")
    args = ap.parse_args()
    loaded = load_model(args.model)
    for tp in args.sizes:
        step, calls, comm = run(loaded, tp, args.batch, args.steps)
        extra = f", {calls:.0f} collectives, {comm:.1f} ms in them (slowest rank)" if tp > 1 else ""
        print(f"TP {tp}: decode step {step:.1f} ms (batch {args.batch}){extra}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
