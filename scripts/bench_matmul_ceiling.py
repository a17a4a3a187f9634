"""The ``engine.bench`` workload with every non-matmul op replaced by a no-op of the right shape.

What remains is the matrix products plus the engine's own overhead: the most the NumPy backend
could reach on this machine with free attention and element-wise ops. Its outputs are garbage
(never use it for anything but this timing).

    .venv/bin/python scripts/bench_matmul_ceiling.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.backends import fast_ops  # noqa: E402
from engine.frontend.llm_engine import LLMEngine  # noqa: E402
from engine.tools import bench  # noqa: E402


def stub_everything_but_matmuls() -> None:
    fast_ops.rotary = lambda q, k, positions, theta: (q, k)
    fast_ops.reshape_and_cache = lambda *a, **k: None
    fast_ops.paged_attention_decode = lambda q, *a, **k: q
    fast_ops.paged_attention_prefill = lambda q, *a, **k: q
    fast_ops.rms_norm = lambda x, w, eps: x
    fast_ops.fused_add_rms_norm = lambda x, r, w, eps: (x, r)
    fast_ops.silu_and_mul = lambda gu: gu[:, : gu.shape[1] // 2]


def main() -> None:
    stub_everything_but_matmuls()
    args = bench.build_parser().parse_args([])
    engine = LLMEngine("smollm2", max_num_seqs=args.max_num_seqs)
    prompts, outs = bench.workload(args, engine.model_config.vocab_size)
    _, secs = bench.run_engine(engine, prompts, outs)
    n = sum(outs)
    print(f"matmul-only engine: {secs:.1f} s for {n} output tokens -> {n / secs:.1f} tok/s")


if __name__ == "__main__":
    main()
