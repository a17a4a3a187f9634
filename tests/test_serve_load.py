"""The server under load and at shutdown: hundreds of streamed requests, some clients leaving
mid-stream, then nothing left running; SIGTERM and SIGHUP let running requests finish and exit
0."""

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from engine.tools.live_server import MODEL, LiveServer
from tests.utils import patience

NUM_REQUESTS, CONCURRENCY = 200, 32


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^pagedllm:{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m, f"no {name} in /metrics"
    return float(m.group(1))


async def _one(client, i: int, sem) -> tuple[str, int, int]:
    """(kind, tokens wanted, tokens got); every tenth client hangs up after two chunks."""
    leave = i % 10 == 0
    want = 200 if leave else 4 + i % 9
    kw = dict(model=MODEL, max_tokens=want, temperature=0.8, seed=i, stream=True)
    kw |= dict(stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async with sem:
        if i % 2:
            stream = await client.completions.create(prompt=f"hello there {i}", **kw)
        else:
            msgs = [{"role": "user", "content": f"hi my name is {i}"}]
            stream = await client.chat.completions.create(messages=msgs, **kw)
        got, chunks = None, 0
        async for chunk in stream:
            chunks += 1
            if leave and chunks == 2:
                await stream.close()
                return "left", want, 0
            if chunk.usage is not None:
                got = chunk.usage.completion_tokens
        return "done", want, got


async def _load(url: str):
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    sem = asyncio.Semaphore(CONCURRENCY)
    try:
        return await asyncio.gather(*[_one(client, i, sem) for i in range(NUM_REQUESTS)])
    finally:
        await client.close()


@pytest.mark.slow
def test_load_with_disconnects_leaves_nothing_running(tiny):
    with LiveServer(tiny, num_gpu_blocks=128) as s:
        results = asyncio.run(_load(s.url))
        done = [(want, got) for kind, want, got in results if kind == "done"]
        assert len(done) == NUM_REQUESTS - NUM_REQUESTS // 10
        assert all(want == got for want, got in done)
        deadline = time.monotonic() + patience(10)
        while True:  # the aborts of the last clients to leave land within a step or two
            text = httpx.get(s.url + "/metrics").text
            idle = _metric(text, "num_requests_running") == 0
            if idle and _metric(text, "kv_cache_usage_perc") == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert _metric(text, "num_requests_running") == 0
        assert _metric(text, "num_requests_waiting") == 0
        assert _metric(text, "kv_cache_usage_perc") == 0
        assert _metric(text, "request_success_total") == len(done)  # the others were aborted
        assert _metric(text, "generation_tokens_total") >= sum(w for w, _ in done)
        bm = s.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks


def _start_server(model_dir, extra=()) -> tuple[subprocess.Popen, str, list[str]]:
    """The server in its own process; (process, url, its stderr lines as they come)."""
    argv = [sys.executable, "-m", "engine.serve", "--model", str(model_dir), "--port", "0"]
    argv += ["--num-gpu-blocks", "64", "--max-model-len", "256", "--shutdown-timeout", "20"]
    argv += list(extra)  # later flags win
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + patience(180)
    for line in proc.stderr:
        m = re.search(r"running on (http://127\.0\.0\.1:\d+)", line)
        if m:
            log: list[str] = []
            threading.Thread(target=log.extend, args=(proc.stderr,), daemon=True).start()
            return proc, m.group(1), log
        assert time.monotonic() < deadline, "the server did not start"
    raise AssertionError(f"the server exited: {proc.wait()}")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stop_signal_lets_running_requests_finish(tiny_model_dir, sig):
    # the signal must find the requests running, whatever the machine's speed: each client
    # reads its first chunk, then reads no more until the signal is sent, and a response (500
    # chunks of 20 logprobs each, 360 KB) is more than the socket buffers hold at first, so the
    # server cannot have sent it all before then
    room = ["--max-model-len", "512", "--num-gpu-blocks", "160"]
    proc, url, log = _start_server(tiny_model_dir, room)
    try:
        results, started, sent = [], threading.Barrier(5), threading.Event()

        def stream_one(i: int):
            body = {"model": str(tiny_model_dir), "prompt": f"hello {i}", "max_tokens": 500}
            body |= {"stream": True, "ignore_eos": True, "temperature": 0, "logprobs": 20}
            text, first = [], True
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if first:
                        first = False
                        started.wait()
                        sent.wait(30)
                    text.append(line)
            results.append(text)

        threads = [threading.Thread(target=stream_one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        started.wait()  # every request is streaming
        proc.send_signal(sig)
        sent.set()
        for t in threads:
            t.join(60)
        assert proc.wait(60) == 0
        deadline = time.monotonic() + 10  # the reader thread may not have the last lines yet
        wanted = ("stopped by", "Waiting for connections to close")
        while time.monotonic() < deadline and not all(
            any(w in line for line in log) for w in wanted
        ):
            time.sleep(0.05)
        assert any("Waiting for connections to close" in line for line in log)  # in flight
        assert any(f"stopped by {sig.name}" in line for line in log)
        assert len(results) == 4
        for lines in results:
            assert lines[-2] == "data: [DONE]" or lines[-1] == "data: [DONE]"
            assert any('"finish_reason": "length"' in line for line in lines)
    finally:
        if proc.poll() is None:
            proc.kill()
