"""The engine core in its own process (``engine_core_process``): the same outputs as the
in-process core, refusals by name, stop strings finished in the core, and a killed core an
error for every caller within seconds."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from engine import SamplingParams
from engine.core.messages import CoreRequest, QueueFullError
from engine.frontend.core_client import Add, CoreLoop
from engine.frontend.llm import run_to_completion
from engine.frontend.recorder import Recorder
from engine.structured_params import StructuredOutputsParams
from engine.tools.live_server import MODEL, LiveServer
from model_loader.load import load_model
from tests.utils import SEED_PROMPTS, make_engine

PROMPTS = [*SEED_PROMPTS, "the cat sat on the"]


@pytest.fixture(scope="module")
def engines(tiny, tiny_model_dir):
    """(core in a process, core in this one) over the tiny model."""
    far = make_engine(tiny, model=str(tiny_model_dir), engine_core_process=True)
    yield far, make_engine(tiny)
    far.shutdown()
    assert far.core.proc.poll() is not None, "the core process outlived its shutdown"


def _workload(near) -> list[list[SamplingParams]]:
    """Per prompt: greedy; seeded samples with logprobs; a stop string, then a stop token id,
    from the first prompt's greedy text, so it ends on them (its max_tokens, which the core
    would run on to, beyond the others')."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    (full,) = run_to_completion(near, PROMPTS[:1], greedy)
    text, ids = full.outputs[0].text, full.token_ids
    stop = next(text[i : i + 2] for i in range(6, len(text) - 2) if text[i : i + 2].strip())
    short = [SamplingParams(temperature=0.0, max_tokens=8)] * (len(PROMPTS) - 1)
    long = dict(temperature=0.0, max_tokens=200, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=7, n=2, max_tokens=12, logprobs=2)
    return [
        [greedy] * len(PROMPTS),
        [sampled] * len(PROMPTS),
        [SamplingParams(**long, stop=[stop]), *short],
        [SamplingParams(**long, stop_token_ids=[ids[9]]), *short],
    ]


def test_the_core_process_gives_the_in_process_outputs(engines):
    far, near = engines
    for params in _workload(near):
        got = run_to_completion(far, PROMPTS, params)
        want = run_to_completion(near, PROMPTS, params)
        for g, w, p in zip(got, want, params, strict=True):
            assert len(g.outputs) == len(w.outputs) == p.n
            for a, b in zip(g.outputs, w.outputs, strict=True):
                assert (a.token_ids, a.text) == (b.token_ids, b.text), p
                assert (a.finish_reason, a.stop_reason) == (b.finish_reason, b.stop_reason)
                if p.logprobs is not None:  # the same tokens; floats from other batches
                    for x, y in zip(a.logprobs, b.logprobs, strict=True):
                        assert x.keys() == y.keys()
                        assert all(abs(x[t] - y[t]) < 1e-4 for t in x)
        assert got[0].finish_reason == "stop" or params[0].max_tokens < 200
        # every sequence ended in the core too (a stop string's when its Finish ran, before
        # the check's): nothing runs, every block is free
        far.check_invariants()
        stats = far.core.stats()
        assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)


def test_a_reused_request_id_takes_none_of_the_earlier_requests_tokens(engines):
    """An id aborted (or finished by a stop string) while the core ran on, reused at once: the
    core's late deltas for the earlier request must not reach the new one."""
    far, near = engines
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    (want,) = run_to_completion(near, PROMPTS[1:2], short)
    for _ in range(3):
        far.add_request("0", PROMPTS[0], long)
        for _ in range(3):
            far.step()
        far.abort("0")
        (got,) = run_to_completion(far, PROMPTS[1:2], short)  # id "0" again
        assert got.token_ids == want.token_ids


def test_the_frontend_holds_no_weights(engines, tiny, tiny_model_dir):
    """The core loads the weights; beside it the frontend loads the config and tokenizer."""
    far, _ = engines
    assert far.loaded.weights is None
    with pytest.raises(ValueError, match="Recorder records an in-process engine core"):
        Recorder(far)  # it reads the core's scheduler and pool: refused, not left unread
    bare = load_model(str(tiny_model_dir), weights=False)
    assert bare.weights is None and bare.config == tiny.config
    assert bare.tokenizer.encode("hi there") == tiny.tokenizer.encode("hi there")


def test_refusals_in_the_core_come_back_by_name(engines):
    far, _ = engines
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(ValueError, match="regex"):
        far.add_request("bad", "hi", bad)
    assert "bad" not in far.output_processor and not far.has_unfinished_requests()
    with pytest.raises(ValueError, match="prompt"):  # the frontend's own checks, before
        far.add_request("long", list(range(300)))
    (out,) = run_to_completion(far, ["hi"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out.token_ids) == 3  # and it goes on serving


def test_the_queue_bound_counts_the_adds_the_core_has_not_read(engines):
    """max_waiting checked in the frontend: the core's counters and the adds sent since."""
    far, _ = engines
    n = far.config.max_num_seqs
    # long enough that the core, stepping on its own, cannot finish them before the next add
    # (at 2 tokens a loaded machine's frontend was once slower than the core's two steps)
    params = SamplingParams(n=n, max_tokens=64, ignore_eos=True)
    far.add_request("fills", "hi", params, max_waiting=0)  # every free slot, nobody waits
    with pytest.raises(QueueFullError, match="queue is full"):
        far.add_request("waits", "hi", SamplingParams(max_tokens=2), max_waiting=0)
    assert "waits" not in far.output_processor
    while far.has_unfinished_requests():
        far.step()
    far.check_invariants()  # the core has read every add: the bound sees the slots free again
    far.add_request("runs", "hi", SamplingParams(max_tokens=2), max_waiting=0)
    while far.has_unfinished_requests():
        far.step()


def test_a_request_the_core_refuses_ends_aborted_with_why(tiny):
    """The core's own refusal (here a reused id, which the frontend would have caught) ends
    each sample at once with the reason, in the next outputs."""
    core = make_engine(tiny).core
    loop = CoreLoop(core, None, None, os.getpid())
    req = CoreRequest("r", [5, 6, 7], SamplingParams(n=2), 0.0)
    loop.handle(Add(req))
    loop.handle(Add(req))
    assert [(d.request_id, d.index, d.finish_reason) for d in loop.refused] == [
        ("r", 0, "abort"),
        ("r", 1, "abort"),
    ]
    assert all("request_id 'r' is not a new string id" in d.error for d in loop.refused)
    assert core.num_added_seqs == 4  # the refused sequences count as queued (and ended)


def test_a_killed_core_fails_the_server_within_seconds(tiny, tiny_model_dir):
    """kill -9 of the core process: /health and every request are 503 naming it, within 10 s."""
    args = dict(model=str(tiny_model_dir), engine_core_process=True)
    with LiveServer(tiny, **args) as s, httpx.Client(base_url=s.url, timeout=30) as http:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "ignore_eos": True}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        os.kill(s.engine.core.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        while http.get("/health").status_code == 200:
            assert time.monotonic() - t0 < 10, "/health still 200 10 s after the core died"
            time.sleep(0.05)
        health = http.get("/health")
        assert health.status_code == 503 and "killed by SIGKILL" in health.text
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 503 and "killed by SIGKILL" in r.text
