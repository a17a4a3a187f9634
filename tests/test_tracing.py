"""The trace of each request (engine/tracing.py): what it logs, and that it forgets finished
sequences."""

from __future__ import annotations

import logging

from engine import SamplingParams
from tests.utils import make_engine


def test_tracer_keeps_only_live_sequences(tiny, caplog):
    """Over many requests (some aborted mid-way) the tracer's tables hold at most one batch of
    sequences (those of the last step), and nothing once every request is done."""
    engine = make_engine(tiny, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    tables = engine.core.trace_schedule.tables
    with caplog.at_level(logging.INFO, logger="engine.trace"):
        for i in range(60):
            engine.add_request(f"r{i}", [5 + i % 7, 9, 11], params)
            if i % 5 == 4:
                engine.step()
                engine.abort(f"r{i - 1}")
            engine.step()
            assert len(tables) <= engine.config.max_num_seqs
        while engine.has_unfinished_requests():
            engine.step()
        engine.step()
    assert "scheduled as prefill" in caplog.text
    assert tables == {}
