"""One replica against two, and the routing policies, on a shared-prefix workload (not a test).

    python scripts/bench_replicas.py [--model smollm2] [--concurrency 8,32] [--num-gpu-blocks 64]

The workload: 4 system prompts (about 300 tokens each with SmolLM2's tokenizer) x 16 users'
questions, users taking turns (each turn every system prompt's next user, in a random order),
written to a prompts file for ``engine.bench_serve``. For each server (1 replica; 2 replicas with
each ``--router``), started fresh (``python -m engine.serve --data-parallel-size N
--enable-prefix-caching``), and each concurrency: bench_serve's output tok/s and TTFT p50/p99,
and the prefix cache's hit rate over the run (the engines' prefix_cache_hits / queries, summed
over the replicas, from /metrics before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

WORDS = "river stone cloud garden lantern window meadow harbor answer kindly briefly".split()


def write_prompts(path: Path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    systems = [f"System {k}: " + " ".join(rng.choice(WORDS, 280)) for k in range(4)]
    lines = []
    for u in range(16):
        for k in rng.permutation(4):
            lines.append(f"{systems[k]} User {u} asks: " + " ".join(rng.choice(WORDS, 12)))
    path.write_text("\n".join(lines) + "\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: str, dp: int, router: str, blocks: int, port: int):
    cmd = [sys.executable, "-m", "engine.serve", "--model", model, "--port", str(port)]
    cmd += ["--enable-prefix-caching", "--num-gpu-blocks", str(blocks), "--max-model-len", "512"]
    if dp > 1:
        cmd += ["--data-parallel-size", str(dp), "--router", router]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(240):
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}): {' '.join(cmd)}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not come up")


def cache_counts(url: str) -> tuple[float, float]:
    """(prefix cache hits, queries) summed over the replicas."""
    time.sleep(1.5)  # replicas publish their metrics every half second
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = {}
    for name in ("hits", "queries"):
        pattern = rf"^pagedllm:prefix_cache_{name}_total\{{[^}}]*\}} (\S+)$"
        total[name] = sum(float(v) for v in re.findall(pattern, text, re.M))
    return total["hits"], total["queries"]


def bench(url: str, prompts: Path, concurrency: int, max_tokens: int) -> dict:
    cmd = [sys.executable, "-m", "engine.bench_serve", "--url", url, "--json"]
    cmd += ["--prompts-file", str(prompts), "--num-requests", "64"]
    cmd += ["--concurrency", str(concurrency), "--max-tokens", str(max_tokens)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="the model (default smollm2)")
    ap.add_argument("--concurrency", default="8,32", help="comma list (default 8,32)")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens per request (default 16)")
    ap.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=96,
        help="each replica's pool, in blocks of 16 tokens (default 96: the four system "
        "prompts of about 20 blocks each, and little room for the running requests)",
    )
    args = ap.parse_args()
    prompts = Path(tempfile.mkdtemp()) / "prompts.txt"
    write_prompts(prompts)
    runs = [(1, "-"), (2, "round-robin"), (2, "least-loaded"), (2, "prefix-aware")]
    print("| replicas | router | concurrency | output tok/s | TTFT p50 ms | TTFT p99 ms |", end="")
    print(" hit rate |")
    print("|---|---|---|---|---|---|---|")  # the table goes to docs/benchmarks.md as it is
    for dp, router in runs:
        proc, url = start(args.model, dp, router, args.num_gpu_blocks, free_port())
        try:
            for c in map(int, args.concurrency.split(",")):
                h0, q0 = cache_counts(url)
                r = bench(url, prompts, c, args.max_tokens)
                h1, q1 = cache_counts(url)
                rate = (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0
                _, p50, p99 = r["ttft_ms"]
                row = [dp, router, c, f"{r['output_tok_per_s']:.1f}", f"{p50:.0f}", f"{p99:.0f}"]
                row += [f"{rate:.2f}"] + ([f"failed {r['failed']}"] if r["failed"] else [])
                print("| " + " | ".join(map(str, row)) + " |", flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
