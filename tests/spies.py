"""Test spies shared by the engine, CPU-device and GPU test modules."""

from __future__ import annotations


class CallCounter:
    """Wraps a backend method or a graph replay: counts its calls and still makes them."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


def count_forwards(backend) -> tuple[CallCounter, CallCounter]:
    """Install counters on ``backend.forward`` and ``backend.forward_greedy``; returns both."""
    backend.forward = CallCounter(backend.forward)
    backend.forward_greedy = CallCounter(backend.forward_greedy)
    return backend.forward, backend.forward_greedy


class ScheduleSpy:
    """Wraps ``Scheduler.schedule``: after each call, the block manager's state (every live
    sequence's GPU and CPU table, the free queue) and what the step scheduled."""

    def __init__(self, engine):
        self.engine, self.schedule = engine, engine.scheduler.schedule
        self.steps: list[dict] = []
        engine.scheduler.schedule = self

    def __call__(self, drafts=None):
        out = self.schedule(drafts)
        self.steps.append(self.snapshot() | {"run": [(s.seq_id, n) for s, n in out.scheduled]})
        self.steps[-1]["pre"] = [s.seq_id for s in out.preempted]
        return out

    def snapshot(self) -> dict:
        live = self.engine.scheduler.live_seqs()
        return {
            "tab": {s.seq_id: list(s.block_table) for s in live if s.block_table},
            "cpu": {s.seq_id: list(s.cpu_block_table) for s in live if s.cpu_block_table},
            "free": list(self.engine.block_manager.free_blocks),
        }
