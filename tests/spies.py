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
