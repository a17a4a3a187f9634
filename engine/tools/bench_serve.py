"""``python -m engine.bench_serve``: throughput and latency of a running server (not a test).

Sends ``--num-requests`` streamed completions (or chat completions with ``--chat``) to ``--url``,
at most ``--concurrency`` at once, all at the start or, with ``--request-rate R``, as a Poisson
process of R requests per second (exponential gaps, seeded by ``--seed``). Each asks for
``--max-tokens`` tokens with ignore_eos. It prints requests/s, output and total tokens/s, time to
first token and inter-token latency (the gaps between streamed chunks, as a client sees them).
Prompts: the seed's three, or a file. A comma list for ``--concurrency`` or ``--request-rate``
(one of them) runs the load once per value and prints each; ``--plot DIR`` writes PNG charts.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from engine.entrypoints.cli_utils import (
    SEED_PROMPTS,
    CliParser,
    float_list,
    format_stats,
    int_list,
    run_stats,
)
from engine.tools import plots


@dataclass
class Result:
    """One request as the client saw it."""

    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None  # seconds to the first text
    itl: list[float] = field(default_factory=list)  # seconds between chunks with text
    error: str = ""


def build_parser() -> CliParser:
    p = CliParser(prog="python -m engine.bench_serve", description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default :8000)")
    p.add_argument("--model", help="the model name to send (default: the server's first)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--num-requests", type=int, default=64, help="requests (default 64)")
    p.add_argument(
        "--concurrency",
        type=int_list,
        default=[16],
        metavar="N[,N...]",
        help="requests at once (default 16); a comma list (1,4,16) sweeps",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    p.add_argument(
        "--request-rate",
        type=float_list,
        default=[math.inf],
        metavar="R[,R...]",
        help="requests per second, Poisson arrivals (default inf: all at the start); a comma "
        "list sweeps",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times (default 0)")
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    p.add_argument("--prompts-file", help="a file with one prompt per line")
    p.add_argument(
        "--json", action="store_true", help="print the numbers as one JSON object (a line each)"
    )
    p.add_argument(
        "--plot",
        metavar="DIR",
        help="write PNG charts to DIR: TTFT/ITL CDFs of each run, throughput against the swept "
        "value (needs matplotlib: pip install '.[plot]')",
    )
    return p


def _body(args, model: str, prompt: str) -> tuple[str, dict]:
    body = dict(model=model, max_tokens=args.max_tokens, stream=True, ignore_eos=True)
    body["stream_options"] = {"include_usage": True}
    if args.chat:
        return "/v1/chat/completions", body | {"messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", body | {"prompt": prompt}


def _text(chunk: dict) -> str:
    choice = chunk["choices"][0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def one_request(client: httpx.AsyncClient, path: str, body: dict) -> Result:
    res, t0 = Result(), time.perf_counter()
    last = None
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
            return res
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                res.output_tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and _text(chunk):
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - t0
                else:
                    res.itl.append(now - last)
                last = now
    res.ok = True
    return res


async def run_load(
    args, prompts: list[str], concurrency: int, rate: float
) -> tuple[list[Result], float]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=args.url, headers=headers, timeout=600, limits=limits
    ) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        sem = asyncio.Semaphore(concurrency)
        starts = arrival_times(args.num_requests, rate, args.seed)  # (N,) seconds

        async def limited(i: int) -> Result:
            await asyncio.sleep(starts[i])
            async with sem:
                return await one_request(client, *_body(args, model, prompts[i % len(prompts)]))

        t0 = time.perf_counter()
        results = await asyncio.gather(*[limited(i) for i in range(args.num_requests)])
        return results, time.perf_counter() - t0


def arrival_times(n: int, rate: float, seed: int) -> np.ndarray:
    """(n,) seconds after the start at which each request is sent: all at 0 for an infinite
    rate, else a Poisson process (exponential gaps of mean 1 / rate)."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return np.cumsum(gaps) - gaps[0]


def summarize_results(results: list[Result], wall: float) -> dict:
    """The numbers of cli_utils.format_stats, plus failures, from what the client saw."""
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    gen = sum(r.output_tokens for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [x for r in ok for x in r.itl]
    return run_stats(len(ok), prompt, gen, wall, ttft, itl) | {"failed": len(results) - len(ok)}


def read_prompts(path: str | None) -> list[str]:
    if path is None:
        return list(SEED_PROMPTS)
    try:
        with open(path) as f:
            prompts = [line.rstrip("\n") for line in f if line.strip()]
    except OSError as e:
        raise ValueError(f"--prompts-file {path!r}: {e.strerror}") from None
    if not prompts:
        raise ValueError(f"--prompts-file {path!r} has no prompts")
    return prompts


def check_args(args) -> list[tuple[int, float]]:
    """The (concurrency, request rate) of each run: a sweep over one of the two lists."""
    for name in ("num_requests", "max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.concurrency) < 1:
        raise ValueError(f"--concurrency must be >= 1, got {min(args.concurrency)}")
    if not min(args.request_rate) > 0:
        rate = min(args.request_rate)
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {rate}")
    if len(args.concurrency) > 1 and len(args.request_rate) > 1:
        raise ValueError("--concurrency and --request-rate: sweep one of them at a time")
    if len(args.request_rate) > 1 and math.isinf(max(args.request_rate)):
        raise ValueError("--request-rate: a sweep takes finite rates (inf is a single run)")
    if args.plot:
        plots.plot_dir(args.plot)
        plots.pyplot()
    return [(c, r) for c in args.concurrency for r in args.request_rate]


def run(args) -> int:
    runs = check_args(args)
    prompts = read_prompts(args.prompts_file)
    done = []  # (stats, results) of each run
    for concurrency, rate in runs:
        try:
            results, wall = asyncio.run(run_load(args, prompts, concurrency, rate))
        except httpx.HTTPError as e:
            raise ValueError(f"{args.url}: {e}") from None
        stats = summarize_results(results, wall)
        stats |= dict(concurrency=concurrency, request_rate=None if math.isinf(rate) else rate)
        print_stats(stats, len(runs) > 1, args.json)
        for r in [r for r in results if not r.ok][:3]:
            print(f"error: {r.error}", file=sys.stderr)
        done.append((stats, results))
    if args.plot:
        workload = f"{args.num_requests} requests of {args.max_tokens} tokens"
        by_rate = len(args.request_rate) > 1
        for path in write_plots(plots.plot_dir(args.plot), done, by_rate, workload):
            print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    return 0 if all(stats["failed"] == 0 for stats, _ in done) else 1


def print_stats(stats: dict, heading: bool, as_json: bool) -> None:
    if as_json:
        print(json.dumps(stats))
        return
    if heading:
        print(f"concurrency {stats['concurrency']}, {_rate_text(stats['request_rate'])}:")
    print(format_stats(stats) + f"\nfailed  {stats['failed']}")


def _rate_text(rate: float | None) -> str:
    return "all sent at the start" if rate is None else f"{rate:g} req/s"


def write_plots(d, done: list[tuple[dict, list[Result]]], by_rate: bool, workload: str) -> list:
    """TTFT/ITL CDFs of each run (one file per swept value) and, for a sweep, throughput
    against the swept value; ``workload`` goes in the titles."""
    key, what = ("request_rate", "rate") if by_rate else ("concurrency", "c")
    paths = []
    for stats, results in done:
        ok = [r for r in results if r.ok]
        ttft = [1e3 * r.ttft for r in ok if r.ttft is not None]
        itl = [1e3 * x for r in ok for x in r.itl]
        name = f"concurrency {stats['concurrency']}, {_rate_text(stats['request_rate'])}"
        suffix = f"_{what}{stats[key]:g}" if len(done) > 1 else ""
        title = f"engine.bench_serve latency as the client sees it\n({workload}, {name})"
        paths.append(plots.latency_cdfs(d / f"serve_latency{suffix}.png", ttft, itl, title))
    if len(done) > 1:
        xs = [stats[key] for stats, _ in done]
        label = "request rate (requests/s)" if by_rate else "concurrency (requests in flight)"
        title = f"engine.bench_serve throughput vs {label.split(' (')[0]} ({workload})"
        tok = [stats["output_tok_per_s"] for stats, _ in done]
        paths.append(plots.throughput_sweep(d / "serve_throughput.png", xs, tok, label, title))
    return paths


def main(argv=None) -> int:
    return build_parser().run(run, argv)


if __name__ == "__main__":
    sys.exit(main())
