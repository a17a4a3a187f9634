"""How long one big or hostile request keeps /health waiting: the server's event loop is free
while a worker thread handles a large body, but each long call into C or Rust (JSON parsing,
pydantic's validation, the tokenizer's list of ids) holds the interpreter lock.

    python scripts/bench_health_stall.py [--model smollm2] [--only NAME ...]

Starts a server in this process (tests/serve_utils.LiveServer, max_model_len 2048), then for
each body below sends it once while a second client polls /health every 5 ms, and prints the
body's size, its status, how long it took and the longest /health answer meanwhile. The bodies
sit at or near the default bounds of docs/server.md's "Limits and security".
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.tools.live_server import LiveServer  # noqa: E402
from model_loader.load import load_model  # noqa: E402

MiB = 1 << 20
N = 131_000  # just under --max-json-items
TEXT = "the quick brown fox " * (15 * MiB // 20)


def bodies(model: str) -> dict[str, tuple[str, dict]]:
    hi = {"model": model, "prompt": "hi", "max_tokens": 1}
    bias = {i: 1 for i in range(N // 5)}  # 26,200 members: just under the bound
    quarter = "summer day " * 23_800  # 261,800 characters
    return {
        "15 MiB text prompt": ("/v1/completions", {**hi, "prompt": TEXT}),
        "15 MiB chat message": (
            "/v1/chat/completions",
            {"model": model, "messages": [{"role": "user", "content": TEXT}], "max_tokens": 1},
        ),
        "131k prompt ids": ("/v1/completions", {**hi, "prompt": [12345] * N}),
        "2048 prompts of 63 ids": ("/v1/completions", {**hi, "prompt": [[7] * 63] * 2048}),
        "131k ids to /detokenize": ("/detokenize", {"model": model, "tokens": [12345] * N}),
        "1024 chat messages": (
            "/v1/chat/completions",
            {"model": model, "messages": [{"role": "user", "content": "hi"}] * 1024},
        ),
        "26k logit_bias entries": ("/v1/completions", {**hi, "logit_bias": bias}),
        "131k stop strings": ("/v1/completions", {**hi, "stop": ["ab"] * N}),
        "256 Ki chars to /tokenize": ("/tokenize", {"model": model, "prompt": quarter}),
    }  # fmt: skip


def measure(url: str, path: str, body: dict) -> tuple[float, int, float, float, int]:
    """(MiB sent, status, seconds it took, longest /health in ms, /health polls)."""
    raw = json.dumps(body, separators=(",", ":")).encode()
    done, answer = threading.Event(), {}

    def post():
        with httpx.Client(base_url=url, timeout=300) as client:
            start = time.perf_counter()
            headers = {"content-type": "application/json"}
            answer["status"] = client.post(path, content=raw, headers=headers).status_code
            answer["took"] = time.perf_counter() - start
        done.set()

    threading.Thread(target=post).start()
    longest, polls = 0.0, 0
    with httpx.Client(base_url=url, timeout=60) as client:
        while not done.is_set() or polls == 0:
            start = time.perf_counter()
            client.get("/health")
            longest, polls = max(longest, time.perf_counter() - start), polls + 1
            time.sleep(0.005)
    done.wait()
    return len(raw) / MiB, answer["status"], answer["took"], 1e3 * longest, polls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="model to serve (default smollm2)")
    ap.add_argument("--only", nargs="+", help="run only the bodies whose names start so")
    args = ap.parse_args()
    with LiveServer(load_model(args.model), max_model_len=2048, num_gpu_blocks=256) as server:
        for name, (path, body) in bodies("tiny").items():
            if args.only and not any(name.startswith(o) for o in args.only):
                continue
            size, status, took, longest, polls = measure(server.url, path, body)
            print(
                f"{name:26s} {size:6.2f} MiB  {status}  {took:6.2f} s  "
                f"/health at most {longest:5.0f} ms over {polls} polls",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
