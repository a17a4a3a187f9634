"""The GPU check's tensor-parallel stage: two ranks over NCCL against one process, correctness only.

    NCCL_MULTI_RANK_GPU_ENABLE=1 python scripts/gpu_tp_check.py --model DIR --json OUT [--emulate]

On one GPU both ranks share it (NCCL >= 2.30 allows two ranks on one device with that variable).
Greedy tokens of three prompts must equal the single process's; the largest logit difference, the
NCCL version and each engine's start and run seconds are written to the JSON as they come.
``--emulate``: backend cuda-cpu (the emulated device and NCCL), as CI runs it.
Exit status: 0 when the tokens agree.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = ["hi my name is", "today is a beautiful summer day", "hello there"]


def run(loaded, backend: str, tp: int, out: dict) -> list:
    from engine.frontend.llm import run_to_completion
    from engine.frontend.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    t0 = time.perf_counter()
    engine = LLMEngine(
        loaded=loaded,
        model="check",
        backend=backend,
        tensor_parallel_size=tp,
        num_gpu_blocks=64,
        max_model_len=256,
        swap_space=0.01,
        record_logits=True,
    )
    t1 = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = run_to_completion(engine, PROMPTS, params)
    out[f"tp{tp}"] = {"start_s": round(t1 - t0, 2), "run_s": round(time.perf_counter() - t1, 2)}
    if tp > 1:
        out["nccl_version"] = engine.backend.nccl_version
        out["collectives_per_rank"] = [c for c, _ in engine.backend.comm_stats()]
        engine.backend.shutdown()
    return [o.outputs[0] for o in outputs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="checkpoint directory (the tiny model)")
    ap.add_argument("--json", required=True, help="where the results go, rewritten per stage")
    ap.add_argument("--emulate", action="store_true", help="backend cuda-cpu instead of cuda")
    args = ap.parse_args()
    from model_loader.load import load_model

    backend = "cuda-cpu" if args.emulate else "cuda"
    loaded, out = load_model(args.model), {"backend": backend}
    path = Path(args.json)
    one = run(loaded, backend, 1, out)
    path.write_text(json.dumps(out, indent=1))
    two = run(loaded, backend, 2, out)
    pairs = list(zip(one, two, strict=True))
    out["tokens_equal"] = [a.token_ids == b.token_ids for a, b in pairs]
    diffs = [np.abs(np.stack(a.step_logits) - np.stack(b.step_logits)).max() for a, b in pairs]
    out["max_logit_diff"] = float(max(diffs))
    path.write_text(json.dumps(out, indent=1))
    print(json.dumps(out))
    return 0 if all(out["tokens_equal"]) else 1


if __name__ == "__main__":
    sys.exit(main())
