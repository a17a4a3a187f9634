"""What the command lines share: the parser that fails in one line, the seed's prompts, logging,
and the throughput / latency table."""

from __future__ import annotations

import argparse
import logging
import sys

import numpy as np

from engine.outputs import RequestOutput

SEED_PROMPTS = ["hi my name is", "today is a beautiful summer day", "hello there"]


class CliParser(argparse.ArgumentParser):
    """argparse whose errors are one line and exit 2 (argparse's default prints the usage too)."""

    def error(self, message):
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def setup_logging(trace: bool) -> None:
    """INFO logs on stderr; the per-request trace (``engine.trace``) only when asked for."""
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    logging.getLogger("engine.trace").setLevel(logging.INFO if trace else logging.WARNING)


def percentiles(xs: list[float]) -> tuple[float, float, float]:
    """(mean, p50, p99) in milliseconds; zeros when empty."""
    if not xs:
        return 0.0, 0.0, 0.0
    a = np.asarray(xs) * 1e3
    return float(a.mean()), float(np.percentile(a, 50)), float(np.percentile(a, 99))


def summarize(outputs: list[RequestOutput], wall: float) -> dict:
    """The stats table's numbers; prefix_cache_hit_tokens only when prefix caching was on."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    gen = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    ttft = [o.metrics.ttft for o in outputs if o.metrics.ttft is not None]
    itl = [x for o in outputs for x in o.metrics.itl]
    stats = dict(
        requests=len(outputs),
        prompt_tokens=prompt,
        generated_tokens=gen,
        wall_s=wall,
        requests_per_s=len(outputs) / wall,
        output_tok_per_s=gen / wall,
        total_tok_per_s=(prompt + gen) / wall,
        ttft_ms=percentiles(ttft),
        itl_ms=percentiles(itl),
    )
    return stats | _prefix_cache_stats(outputs)


def _prefix_cache_stats(outputs: list[RequestOutput]) -> dict:
    hits = [o.num_cached_tokens for o in outputs if o.num_cached_tokens is not None]
    return dict(prefix_cache_hit_tokens=sum(hits)) if hits else {}


def format_stats(s: dict) -> str:
    throughput = (
        f"{s['requests_per_s']:.2f} req/s, {s['output_tok_per_s']:.1f} output tok/s, "
        f"{s['total_tok_per_s']:.1f} total tok/s"
    )
    rows = [
        ("requests", f"{s['requests']}"),
        ("prompt tokens", f"{s['prompt_tokens']}"),
        ("generated tokens", f"{s['generated_tokens']}"),
        ("wall time", f"{s['wall_s']:.2f} s"),
        ("throughput", throughput),
        ("TTFT mean/p50/p99", "{:.1f} / {:.1f} / {:.1f} ms".format(*s["ttft_ms"])),
        ("ITL mean/p50/p99", "{:.1f} / {:.1f} / {:.1f} ms".format(*s["itl_ms"])),
    ]
    if "prefix_cache_hit_tokens" in s:
        hits, prompt = s["prefix_cache_hit_tokens"], s["prompt_tokens"]
        rate = f"{100 * hits / max(prompt, 1):.1f}% ({hits} of {prompt} prompt tokens)"
        rows.append(("prefix cache hit rate", rate))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
