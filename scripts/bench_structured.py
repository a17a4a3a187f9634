"""The cost of structured output: decode step time of a batch of 64 with 0, 8 and 64 of its
rows constrained by a JSON schema, and the compile time of that schema.

    python scripts/bench_structured.py [--model smollm2] [--steps 20] [--batch 64]

Each configuration runs the same 64 greedy requests; the timed steps are the first ``--steps``
decode steps after every prompt has been prefilled (all rows still running: the schema's
output is longer than that). The configurations run interleaved, ``--repeats`` times, and the
median step time of each is printed with its overhead against 0 constrained rows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import SamplingParams  # noqa: E402
from engine.core.structured import StructuredOutputsParams  # noqa: E402
from engine.frontend.llm_engine import LLMEngine  # noqa: E402
from model_loader.load import load_model  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "maxLength": 60},
        "role": {"enum": ["admin", "user", "guest"]},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["id", "name", "email", "role", "score", "active", "tags", "address"],
}


def step_times(engine: LLMEngine, batch: int, constrained: int, steps: int) -> list[float]:
    so = StructuredOutputsParams(json=SCHEMA)
    for i in range(batch):
        rule = dict(structured_outputs=so) if i < constrained else dict(ignore_eos=True)
        params = SamplingParams(temperature=0.0, max_tokens=steps + 8, **rule)
        engine.add_request(f"{constrained}-{i}", f"User {i} as a JSON record:", params)
    while (
        any(s.num_output_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting
    ):
        engine.step()  # the prefills
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    running = len(engine.scheduler.running)
    assert running == batch, f"{batch - running} rows finished inside the timed steps"
    for i in range(batch):
        engine.abort(f"{constrained}-{i}")
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="model to load (default smollm2)")
    ap.add_argument("--batch", type=int, default=64, help="running requests (default 64)")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per run")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved runs per configuration")
    args = ap.parse_args()
    loaded = load_model(args.model)
    engine = LLMEngine(loaded=loaded, model=args.model, max_model_len=512, max_num_seqs=args.batch)
    t0 = time.perf_counter()
    compiler = engine.structured_compiler()
    build = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiler.compile(StructuredOutputsParams(json=SCHEMA))
    took = (time.perf_counter() - t0) * 1e3
    print(f"compiler built in {build * 1e3:.0f} ms; schema compiled in {took:.1f} ms")
    configs = (0, 8, args.batch)
    runs = {c: [] for c in configs}
    step_times(engine, args.batch, 0, 3)  # warm-up
    for _ in range(args.repeats):
        for c in configs:
            runs[c] += step_times(engine, args.batch, c, args.steps)
    base = statistics.median(runs[0])
    for c in configs:
        med = statistics.median(runs[c])
        more = (med / base - 1) * 100
        print(f"{c:3d} of {args.batch} rows constrained: step {med * 1e3:7.1f} ms ({more:+.1f}%)")


if __name__ == "__main__":
    main()
