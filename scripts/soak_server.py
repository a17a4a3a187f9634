"""Soak the server with mixed requests and report how its memory (RSS) grows after warm-up.

    python scripts/soak_server.py [--requests 1000] [--model DIR] [--concurrency 16]

Starts ``python -m engine.serve`` on the given model (default: the tests' tiny random model,
written to a temporary directory) and sends a mix, ``--concurrency`` at a time: plain and
streamed completions and chats, prompts as token ids, requests refused for their length or
their parameters, big bodies (a quarter of a megabyte) to /tokenize, and streams the client
leaves after two chunks (engine/tools/soak_mix.py). The server's RSS (/proc/PID/status) is read
after the first 20% of the requests (warm-up) and at the end; the script prints both, the growth,
and the status codes it got, and exits 1 if any request got a 500 or the server died. Its fast
version in the suite is tests/test_server_limits.py::test_a_soak_leaves_nothing_behind.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.tools.soak_mix import one_request, send  # noqa: E402
from model_loader.synthetic import make_tiny_model  # noqa: E402


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def soak(url: str, n: int, concurrency: int, pid: int) -> tuple[float, float, dict]:
    rng, codes = random.Random(0), collections.Counter()
    warm = max(n // 5, 1)
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def run(i):
            async with sem:
                await send(client, one_request(i, rng), codes)

        await asyncio.gather(*(run(i) for i in range(warm)))
        after_warmup = rss_mib(pid)
        await asyncio.gather(*(run(i) for i in range(warm, n)))
        await asyncio.sleep(2)  # the engine finishes what the clients left
    return after_warmup, rss_mib(pid), dict(codes)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000, help="requests in all (default 1000)")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight at once")
    ap.add_argument("--model", help="model to serve (default: the tests' tiny random model)")
    ap.add_argument("--port", type=int, default=8765, help="the server's port (default 8765)")
    args = ap.parse_args()
    model = args.model or str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))
    cmd = [sys.executable, "-m", "engine.serve", "--model", model, "--port", str(args.port)]
    cmd += ["--max-model-len", "256", "--backend", "numpy", "--served-model-name", "m"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{args.port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        start = rss_mib(server.pid)
        t0 = time.monotonic()
        warm, end, codes = asyncio.run(soak(url, args.requests, args.concurrency, server.pid))
        alive = server.poll() is None and httpx.get(url + "/health").status_code == 200
    finally:
        server.terminate()
        server.wait(30)
    print(f"requests {args.requests} in {time.monotonic() - t0:.1f} s, status codes {codes}")
    print(f"RSS at start {start:.1f} MiB, after warm-up {warm:.1f} MiB, at the end {end:.1f} MiB")
    print(f"growth after warm-up: {end - warm:+.1f} MiB; server alive at the end: {alive}")
    return 0 if alive and 500 not in codes else 1


if __name__ == "__main__":
    raise SystemExit(main())
