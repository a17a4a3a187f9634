"""What ``python -m engine.bench`` adds with ``--sweep-concurrency`` and ``--plot DIR``.

- ``sweep``: the same workload once per concurrency (the engine's ``max_num_seqs``; every request
  is queued at the start, so that is how many decode at once), on a fresh engine over the same
  loaded weights: output tokens/s per value.
- ``decode_step_split``: a batch-1 decode run with a timer around each op of a host backend
  (``backend.ops``, the matrix products included) and around the backend's forward. A decode
  step's mean time is then: each op's time, the rest of the forward (Python), and the engine
  outside the forward (scheduling, sampling, outputs; the ITL minus the forward). The timers add
  about a microsecond per op call. The cpu backend runs this split with its one-call decode step
  off (``fuse_decode``): the same kernels, called one by one from Python where the timers see
  them, so its "rest of the forward" is the Python that the one call saves.
- ``write_plots``: the charts of engine/tools/plots.py from those numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections import defaultdict

from engine.entrypoints.cli_utils import int_list, summarize
from engine.frontend.llm_engine import LLMEngine
from engine.tools import plots
from model_loader.load import load_model

OP_LABELS = {
    "paged_attention_decode": "attention",
    "rms_norm": "RMS norms",
    "fused_add_rms_norm": "RMS norms",
    "rotary": "rotary",
    "reshape_and_cache": "KV cache writes",
    "rotary_cache": "rotary + KV cache writes",  # the cpu backend's fused kernel
    "matmul": "matrix products",
    "act_and_mul": "activation x mul",
    "embedding": "embedding",
}
REST_OF_FORWARD = "rest of forward"
OUTSIDE_FORWARD = "engine outside forward"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sweep-concurrency",
        type=int_list,
        metavar="N,N,...",
        help="also run the workload at each of these max_num_seqs (e.g. 1,8,32) and print "
        "output tok/s per value",
    )
    p.add_argument(
        "--plot",
        metavar="DIR",
        help="write PNG charts to DIR: TTFT/ITL CDFs, the batch-1 decode step by part against "
        "its matrix products, and throughput vs concurrency with --sweep-concurrency "
        "(needs matplotlib: pip install '.[plot]')",
    )


def check_args(args) -> None:
    """Before the model loads: the --plot folder exists (made) and matplotlib imports."""
    if args.plot:
        plots.plot_dir(args.plot)
        plots.pyplot()


def run_extras(args, engine, run_engine, outputs, workload, floor_ms: float) -> None:
    """After the bench's own numbers: the sweep (printed) and the charts, as the flags ask.
    ``workload``: (prompts, output lengths); the batch-1 split runs the first prompt's 32
    tokens, as the bench's batch-1 ITL does."""
    rows = sweep(engine, run_engine, *workload, args.sweep_concurrency or [])
    if rows:
        print(format_sweep(rows))
    if not args.plot:
        return
    split = decode_step_split(engine, run_engine, workload[0][0][:32], args.batch1_tokens)
    print(format_split(split, floor_ms))
    lists = dict(
        ttft_ms=[1e3 * o.metrics.ttft for o in outputs if o.metrics.ttft is not None],
        itl_ms=[1e3 * x for o in outputs for x in o.metrics.itl],
    )
    names = dict(
        latency=f"{engine.backend.name}, {len(outputs)} requests",
        split=f"{engine.backend.name}, mean of {args.batch1_tokens - 1} steps",
        sweep=f"{engine.backend.name}, {len(outputs)} requests each",
    )
    for path in write_plots(plots.plot_dir(args.plot), lists, split, floor_ms, rows, names):
        print(f"wrote {path}")


def sweep(
    engine: LLMEngine, run_engine, prompts, out_lens, values: list[int], loaded=None
) -> list[dict]:
    """The workload at each ``max_num_seqs`` in ``values``: summarize's numbers + concurrency.
    ``loaded``: the model with its weights (an engine keeps none), else loaded again."""
    rows = []
    if loaded is None and values:
        loaded = load_model(engine.config.model)
    for c in values:
        config = dataclasses.replace(engine.config, max_num_seqs=c)
        eng = LLMEngine(config=config, loaded=loaded)
        run_engine(eng, [prompts[0][:16]], [4])  # warm-up
        outputs, wall = run_engine(eng, prompts, out_lens)
        rows.append(summarize(outputs, wall) | {"concurrency": c})
        del eng  # its KV pool goes before the next one is allocated
    return rows


def format_sweep(rows: list[dict]) -> str:
    lines = ["concurrency  output tok/s  TTFT p50 ms  ITL p50 ms"]
    for r in rows:
        tok, ttft, itl = r["output_tok_per_s"], r["ttft_ms"][1], r["itl_ms"][1]
        lines.append(f"{r['concurrency']:>11}  {tok:>12.1f}  {ttft:>11.1f}  {itl:>10.1f}")
    return "\n".join(lines)


class _TimedOps:
    """``backend.ops`` with a timer around each function: seconds per op name in ``totals``."""

    def __init__(self, ops):
        self._ops, self.totals = ops, defaultdict(float)

    def __getattr__(self, name):
        fn = getattr(self._ops, name)
        if not callable(fn):
            return fn

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[name] += time.perf_counter() - t0

        return timed


def decode_step_split(engine: LLMEngine, run_engine, prompt, n: int) -> dict[str, float]:
    """Mean ms per batch-1 decode step by part (see the module docstring); their sum is the
    run's mean ITL. A backend without host ``ops`` (the GPU ones) gives the ITL alone."""
    backend = engine.backend
    if backend.name not in ("cpu", "numpy"):
        outs, _ = run_engine(engine, [prompt], [n])
        itl = outs[0].metrics.itl
        return {f"decode step ({backend.name}, not split)": 1e3 * sum(itl) / len(itl)}
    ops = backend.ops
    timed_ops, ops_s, fwd_s = _TimedOps(ops), defaultdict(float), []
    forwards = {name: getattr(backend, name) for name in ("forward", "forward_greedy")}

    def timed_forward(fn):
        def forward(batch):
            timed_ops.totals.clear()
            t0 = time.perf_counter()
            out = fn(batch)
            if batch.num_decodes == batch.num_seqs:  # a decode step: keep its times
                fwd_s.append(time.perf_counter() - t0)
                for name, s in timed_ops.totals.items():
                    ops_s[OP_LABELS.get(name, name)] += s
            return out

        return forward

    backend.ops = timed_ops
    for name, fn in forwards.items():
        setattr(backend, name, timed_forward(fn))
    own_fuse = vars(backend).get("fuse_decode")  # an instance's own setting, to restore
    if hasattr(backend, "fuse_decode"):
        backend.fuse_decode = False  # the cpu backend's one-call decode step hides the ops
    try:
        outs, _ = run_engine(engine, [prompt], [n])
    finally:
        backend.ops = ops
        for name in forwards:
            delattr(backend, name)  # the class's methods again
        if own_fuse is not None:
            backend.fuse_decode = own_fuse
        elif "fuse_decode" in vars(backend):
            del backend.fuse_decode  # the class's value again
    return _split_ms(ops_s, fwd_s, outs[0].metrics.itl)


def _split_ms(ops_s: dict, fwd_s: list[float], itl: list[float]) -> dict[str, float]:
    """Seconds summed over the decode steps -> mean ms per step by part."""
    assert len(fwd_s) == len(itl), f"{len(fwd_s)} decode forwards for {len(itl)} ITL gaps"
    steps = len(itl)
    parts = {label: 1e3 * s / steps for label, s in sorted(ops_s.items(), key=lambda kv: -kv[1])}
    parts[REST_OF_FORWARD] = 1e3 * (sum(fwd_s) - sum(ops_s.values())) / steps
    parts[OUTSIDE_FORWARD] = 1e3 * (sum(itl) - sum(fwd_s)) / steps
    return parts


def format_split(parts: dict[str, float], floor_ms: float) -> str:
    total = sum(parts.values())
    items = ", ".join(f"{k} {v:.1f}" for k, v in parts.items())
    return f"batch-1 decode step {total:.1f} ms ({floor_ms:.1f} ms matrix products alone): {items}"


def write_plots(d, stats_lists: dict, split: dict, floor_ms: float, rows, names: dict) -> list:
    """The bench's charts in folder ``d``: latency CDFs, the decode-step split, the sweep;
    ``names``: each chart's title suffix (latency, split, sweep)."""
    paths = [
        plots.latency_cdfs(
            d / "bench_latency.png",
            stats_lists["ttft_ms"],
            stats_lists["itl_ms"],
            f"engine.bench latency ({names['latency']})",
        ),
        plots.step_split(
            d / "bench_decode_step.png",
            split,
            floor_ms,
            f"batch-1 decode step by part vs its matrix products alone ({names['split']})",
        ),
    ]
    if rows:
        paths.append(
            plots.throughput_sweep(
                d / "bench_concurrency.png",
                [r["concurrency"] for r in rows],
                [r["output_tok_per_s"] for r in rows],
                "concurrency (max_num_seqs, requests decoding at once)",
                f"engine.bench throughput vs concurrency ({names['sweep']})",
            )
        )
    return paths
