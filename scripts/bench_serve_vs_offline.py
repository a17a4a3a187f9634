"""The server's output tokens per second against the offline ``LLM`` on the same workload and
backend (not a test): ``python scripts/bench_serve_vs_offline.py``.

The workload is ``bench_serve``'s: the seed prompts in turn, ``--max-tokens`` each with
ignore_eos, the model's default sampling parameters. Offline: one ``LLM.generate`` of all of
them. Server: ``python -m engine.serve`` started for each core placement (the engine thread's
own, then ``--engine-core-process``), ``--num-requests`` streamed at ``--concurrency`` by
bench_serve's client. Prints one line per run and the ratio to offline.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine import LLM  # noqa: E402
from engine.tools.bench_serve import read_prompts, run_load, summarize_results  # noqa: E402


def offline(args, prompts: list[str]) -> float:
    """Output tok/s of one LLM.generate of the whole workload (after a warm-up request)."""
    llm = LLM(args.model, max_model_len=args.max_model_len)
    params = llm.engine.default_sampling_params(max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], params, use_tqdm=False)
    batch = [prompts[i % len(prompts)] for i in range(args.num_requests)]
    t0 = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / wall


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served(args, prompts: list[str], extra: list[str]) -> float:
    """Output tok/s the bench_serve client sees from a server started with ``extra`` flags."""
    port = _free_port()
    cmd = [sys.executable, "-m", "engine.serve", "--model", args.model, "--port", str(port)]
    cmd += ["--max-model-len", str(args.max_model_len), *extra]
    server = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.DEVNULL, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, f"the server exited ({server.returncode})"
            assert time.monotonic() < deadline, "the server did not start in 300 s"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        load = argparse.Namespace(**vars(args), url=url, api_key=None, chat=False, seed=0)
        load.model = None
        warm = argparse.Namespace(**{**vars(load), "num_requests": 1})
        asyncio.run(run_load(warm, prompts, 1, float("inf")))
        results, wall = asyncio.run(run_load(load, prompts, args.concurrency, float("inf")))
        stats = summarize_results(results, wall)
        assert stats["failed"] == 0, f"{stats['failed']} requests failed"
        return stats["output_tok_per_s"]
    finally:
        server.terminate()
        server.wait(30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="the model (default smollm2)")
    p.add_argument("--num-requests", type=int, default=128, help="requests (default 128)")
    p.add_argument("--concurrency", type=int, default=64, help="server requests at once (64)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default 32)")
    p.add_argument("--max-model-len", type=int, default=1024, help="(default 1024)")
    args = p.parse_args()
    prompts = read_prompts(None)
    base = offline(args, prompts)
    print(f"offline LLM.generate: {base:.1f} output tok/s")
    for name, extra in (
        ("server, core in its thread", []),
        ("server, core process", ["--engine-core-process"]),
    ):
        tps = served(args, prompts, extra)
        print(f"{name}: {tps:.1f} output tok/s, {tps / base:.2f}x offline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
