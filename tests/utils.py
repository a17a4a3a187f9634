"""Builders shared by the test modules (in the style of vLLM's tests/v1/core/utils.py): a change
to a constructor touches this file only. The loaded tiny model is the ``tiny`` fixture
(tests/conftest.py)."""

from __future__ import annotations

import dataclasses
import itertools
import random

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.core.sequence import Sequence
from engine.frontend.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.tools.live_server import SMALL_POOL

SEED_PROMPTS = ["hi my name is", "today is a beautiful summer day", "hello there"]

_rng = random.Random(2024)
_clock = itertools.count()


def random_tokens(n: int) -> list[int]:
    """n random token ids (the ids never matter to the scheduler or the block manager)."""
    return [_rng.randrange(32000) for _ in range(n)]


def patience(seconds: float) -> float:
    """How long a test waits for a process (a server, a replica, a Ray actor) to reach a state:
    ``seconds`` on an idle machine, stretched by its load (runnable processes per core over the
    last minute), so a busy machine slows such a test but does not fail it. A wait on state
    ends as soon as the state is reached, so a long deadline costs a passing test nothing."""
    import os

    return seconds * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def with_eos(loaded, eos: int):
    """``loaded`` with its config's EOS ids replaced by ``eos`` (what an engine stops at)."""
    config = dataclasses.replace(loaded.config, eos_token_ids=(eos,))
    return dataclasses.replace(loaded, config=config)


def make_engine(loaded, **engine_args) -> LLMEngine:
    """An engine on an already loaded model, with a small fixed pool unless engine_args say."""
    return LLMEngine(loaded=loaded, **{**SMALL_POOL, **engine_args})


def make_seq(
    prompt: int | list[int], max_tokens: int = 16, request_id: str | None = None
) -> Sequence:
    """A waiting sequence; prompt: its token ids, or a length for that many random ids.
    Arrival times increase with each call; the request id defaults to ``req<arrival>``."""
    arrival = float(next(_clock))
    ids = random_tokens(prompt) if isinstance(prompt, int) else prompt
    rid = request_id or f"req{arrival:.0f}"
    return Sequence(rid, ids, SamplingParams(max_tokens=max_tokens), arrival)


def make_scheduler(
    num_blocks: int = 10,
    block_size: int = 4,
    num_cpu_blocks: int = 0,
    max_model_len: int = 64,
    connector=None,
    windows: tuple[int, ...] = (),
    **config,
) -> Scheduler:
    """A scheduler over its own block manager; the token budget is max_model_len unless config
    says otherwise. ``enable_prefix_caching=True`` turns caching on in both; ``connector``: the
    block manager's KV tiers; ``windows``: its KV groups' windows (0: full attention)."""
    fields = dict(block_size=block_size, max_model_len=max_model_len)
    fields = {"max_num_batched_tokens": max_model_len, **fields, **config}
    cfg = EngineConfig(**fields)
    bm = BlockManager(
        num_blocks,
        block_size,
        num_cpu_blocks,
        enable_caching=cfg.enable_prefix_caching,
        connector=connector,
        windows=windows,
    )
    return Scheduler(cfg, bm)


def step(sched: Scheduler) -> SchedulerOutput:
    """One engine step with a fake model that samples a fresh random token for every scheduled
    sequence, checking the invariants before and after."""
    out = sched.schedule()
    sched.check_invariants()
    sched.update(out, {seq.seq_id: _rng.randrange(32000) for seq, _ in out.scheduled})
    sched.check_invariants()
    return out


def scheduled_ids(out: SchedulerOutput) -> list[tuple[int, int]]:
    """The step's (seq_id, num_new_tokens) pairs, decodes first."""
    return [(seq.seq_id, n) for seq, n in out.scheduled]


def shared_prefix_workload(seed: int, n: int = 12) -> tuple[list[list[int]], list[SamplingParams]]:
    """n prompts that share prefixes of two base prompts, greedy or seeded sampling."""
    rng = random.Random(seed)
    bases = [[rng.randrange(1, 250) for _ in range(24)] for _ in range(2)]
    prompts, params = [], []
    for i in range(n):
        shared = bases[i % 2][: rng.randint(0, 24)]
        prompts.append(shared + [rng.randrange(1, 250) for _ in range(rng.randint(1, 12))])
        temp = rng.choice([0.0, 0.9])
        params.append(SamplingParams(max_tokens=rng.randint(4, 20), temperature=temp, seed=i))
    return prompts, params


def kill_rank_mid_run(engine: LLMEngine, rank: int, prompt: str, message: str) -> None:
    """Start a request on a several-rank engine, SIGKILL rank ``rank``'s process, and check
    that the next steps raise a RuntimeError matching ``message`` within 10 seconds (longer on
    a busy machine: ``patience``)."""
    import os
    import signal
    import time

    import pytest

    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=16))
    engine.step()
    os.kill(engine.backend.pids[rank], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=message):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < patience(10)


def assert_same_greedy(one: list, many: list, tol: float = 1e-4) -> None:
    """Several ranks' outputs against one process's: the same greedy tokens, and each step's
    recorded logits (``record_logits``) within ``tol``."""
    import numpy as np

    for a, b in zip(one, many, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        got, want = np.stack(b.outputs[0].step_logits), np.stack(a.outputs[0].step_logits)
        np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
