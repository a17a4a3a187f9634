"""The host's cost per decode step: the engine loop around a ``StubBackend``, whose forward
returns token ids at once, so everything timed is scheduling, batch preparation, token appends,
detokenizing and outputs (``python -m engine.bench --host-overhead``).

A run adds ``batch`` requests of random prompts (greedy, ignore_eos), steps until every one has
its first token, warms up, then times ``steps`` decode steps one by one, and finally steps the
requests to their end and checks each got exactly its tokens: those of ``stub_next_token``.

Each step is timed twice: on the wall clock and in this thread's CPU time. On a busy machine the
wall clock also counts the time other processes held the core, and a long step is more likely to
be interrupted than a short one; the CPU time is the host's own cost. The parts are CPU time.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import numpy as np

from engine.backends.stub import StubBackend, stub_next_token
from engine.frontend.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.utils import cdiv

# the parts of a step, as (name, attribute path on the engine) of the method that does each
# ("core": the engine core's whole step; the four after it are parts of it, "deltas" its
# token-id deltas for the frontend; "detok+stops" and "outputs" are the frontend's)
PARTS = (
    ("core", "core.step"),
    ("schedule", "core.scheduler.schedule"),
    ("prepare", "core.runner.prepare"),
    ("forward", "core.backend.forward_greedy"),
    ("update", "core._apply"),
    ("deltas", "core._outputs"),
    ("detok+stops", "output_processor.process"),
    ("outputs", "output_processor.outputs"),
)


def stub_backend(model_config, weights, config, device_step_s: float = 0.0) -> StubBackend:
    return StubBackend(model_config, config, device_step_s)


def stub_engine(
    loaded, batch: int, prompt_len: int, max_model_len: int, device_step_s=0.0, **engine_args
):
    """An engine of ``batch`` sequences over the stub backend, its pool sized to hold them;
    ``device_step_s``: the stub's modelled device step."""
    blocks = batch * cdiv(max_model_len, engine_args.get("block_size", 16)) + 1
    kw = dict(max_num_seqs=batch, max_num_batched_tokens=max(batch * prompt_len, max_model_len))
    kw.update(num_gpu_blocks=blocks, max_model_len=max_model_len, **engine_args)
    factory = functools.partial(stub_backend, device_step_s=device_step_s)
    return LLMEngine(loaded.source, loaded=loaded, backend_factory=factory, **kw)


@dataclass
class HostRun:
    batch: int
    stream: bool  # step() (an output per request per step) or step(stream=False)
    step_ms: list[float] = field(default_factory=list)  # whole steps, wall clock
    cpu_ms: list[float] = field(default_factory=list)  # whole steps, this thread's CPU time
    part_ms: dict[str, list[float]] = field(default_factory=dict)  # per part, per step (CPU)

    @property
    def median_ms(self) -> float:
        return float(np.median(self.step_ms))

    @property
    def median_cpu_ms(self) -> float:
        return float(np.median(self.cpu_ms))

    def part_median_ms(self, name: str) -> float:
        return float(np.median(self.part_ms[name])) if self.part_ms.get(name) else 0.0


def add_requests(engine: LLMEngine, batch: int, prompt_len: int, max_tokens: int, seed: int):
    """``batch`` random prompts of prompt_len ids: {request id: prompt ids}."""
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = {}
    for i in range(batch):
        prompts[str(i)] = rng.integers(100, vocab - 100, prompt_len).tolist()
        engine.add_request(str(i), prompts[str(i)], params)
    return prompts


def expected_tokens(prompts: list[list[int]], n: int, vocab: int) -> np.ndarray:
    """(R, n) the tokens the stub generates after each prompt, one step at a time for all of
    them together (the independent replay of what the engine should produce)."""
    last = np.array([p[-1] for p in prompts])  # (R,)
    pos = np.array([len(p) - 1 for p in prompts])  # (R,)
    out = np.empty((len(prompts), n), dtype=np.int64)  # (R, n)
    for i in range(n):
        last = out[:, i] = stub_next_token(last, pos + i, vocab)
    return out


def _step(engine: LLMEngine, stream: bool) -> list:
    return engine.step() if stream else engine.step(stream=False)


class _PartTimer:
    """Times the methods of PARTS on one engine (instance attributes that wrap them)."""

    def __init__(self, engine: LLMEngine):
        self.spent = {name: 0.0 for name, _ in PARTS}
        for name, path in PARTS:
            *owner_path, attr = path.split(".")
            owner = engine
            for a in owner_path:
                owner = getattr(owner, a)
            setattr(owner, attr, self._wrap(name, getattr(owner, attr)))

    def _wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[name] += time.thread_time() - t0

        return timed

    def take(self) -> dict[str, float]:
        spent, self.spent = self.spent, {name: 0.0 for name, _ in PARTS}
        return spent


def _timed_steps(engine, steps: int, stream: bool, parts: _PartTimer | None, run: HostRun):
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        _step(engine, stream)
        run.cpu_ms.append(1e3 * (time.thread_time() - c0))
        run.step_ms.append(1e3 * (time.perf_counter() - t0))
        if parts is not None:
            for name, s in parts.take().items():
                run.part_ms.setdefault(name, []).append(1e3 * s)


def measure(
    loaded,
    batch: int,
    *,
    steps: int = 50,
    warmup: int = 10,
    prompt_len: int = 64,
    stream: bool = True,
    split: bool = False,
    seed: int = 0,
    device_step_s: float = 0.0,
    async_scheduling: bool = False,
) -> HostRun:
    """Median host cost of ``steps`` decode steps at ``batch``; with ``split``, per part too
    (a second pass, so the wrappers' cost stays out of the whole-step figure). Every request is
    then run to its end and checked (AssertionError if a token or a count is wrong).
    ``device_step_s``: each step also takes that long on the stub's modelled device (the
    figure is then the step's period, device and host); ``async_scheduling``: the engine
    option, which overlaps the two."""
    max_tokens = warmup + 2 * steps + 4  # nobody finishes before the timed steps are over
    engine = stub_engine(
        loaded,
        batch,
        prompt_len,
        prompt_len + max_tokens,
        device_step_s,
        async_scheduling=async_scheduling,
    )
    prompts = add_requests(engine, batch, prompt_len, max_tokens, seed)
    sched = engine.scheduler
    while sched.waiting or any(not s.output_token_ids for s in sched.running):  # prefills
        _step(engine, stream)
    for _ in range(warmup):
        _step(engine, stream)
    run = HostRun(batch, stream)
    _timed_steps(engine, steps, stream, None, run)
    if split:
        parts = HostRun(batch, stream)
        _timed_steps(engine, steps, stream, _PartTimer(engine), parts)
        run.part_ms = parts.part_ms
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in _step(engine, stream) if o.finished})
    check_outputs(outputs, prompts, max_tokens, engine.model_config.vocab_size)
    return run


def check_outputs(outputs: dict, prompts: dict, max_tokens: int, vocab: int) -> None:
    """Every request finished by length with exactly the stub's tokens (AssertionError)."""
    assert outputs.keys() == prompts.keys(), f"{len(outputs)} of {len(prompts)} requests finished"
    want = expected_tokens(list(prompts.values()), max_tokens, vocab)  # (R, max_tokens)
    for rid, row in zip(prompts, want, strict=True):
        out = outputs[rid]
        assert out.finish_reason == "length", f"request {rid}: {out.finish_reason}"
        assert out.token_ids == row.tolist(), f"request {rid}: tokens differ from the stub's"


def format_table(runs: list[HostRun]) -> str:
    """A markdown table: batch, outputs (every step or final only), ms/step (median, wall clock
    and CPU time) and each part's median (CPU time)."""
    names = [name for name, _ in PARTS]
    head = "| batch | outputs of | ms/step wall | ms/step CPU | " + " | ".join(names) + " |"
    rule = "|" + "---|" * (4 + len(names))
    rows = [
        f"| {r.batch} | {'every step' if r.stream else 'final only'} | {r.median_ms:.3f} | "
        f"{r.median_cpu_ms:.3f} | " + " | ".join(f"{r.part_median_ms(n):.3f}" for n in names) + " |"
        for r in runs
    ]
    return "\n".join([head, rule, *rows])
