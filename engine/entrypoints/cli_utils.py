"""What the command lines share: the parser that fails in one line (for bad flags and for a bad
value found later), comma lists as flag types, UTF-8 checks of text from the command line, the
seed's prompts, logging, and the throughput / latency table."""

from __future__ import annotations

import argparse
import logging
import re
import sys

import numpy as np

from engine.outputs import RequestOutput

SEED_PROMPTS = ["hi my name is", "today is a beautiful summer day", "hello there"]


class CliParser(argparse.ArgumentParser):
    """argparse whose errors are one line and exit 2 (argparse's default prints the usage too)."""

    def error(self, message):
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)

    def run(self, run, argv=None) -> int:
        """Parse ``argv`` and call ``run(args)``; a bad value (ValueError) is one line: exit 2."""
        args = self.parse_args(argv)
        try:
            return run(args)
        except ValueError as e:
            return self.fail(e)

    def fail(self, e: ValueError) -> int:
        """Print a bad value's message as one line, fields written as this CLI's flags: 2."""
        print(f"error: {self.flag_message(str(e))}", file=sys.stderr)
        return 2

    def flag_message(self, message: str) -> str:
        """The message led by the flag it is about: the field of ``EngineConfig: seed must ...``
        (or ``SamplingParams:``), else the first flag's field named in it (``max_num_seqs`` ->
        ``--max-num-seqs``). A message that starts with a flag stays as it is."""
        message = " ".join(message.split())
        flags = {a.dest: a.option_strings[0] for a in self._actions if a.option_strings}
        head = re.match(r"^(?:EngineConfig|SamplingParams): (\w+) ", message)
        if message.startswith("-") or (head and head.group(1) not in flags):
            return message
        if head:
            return f"{flags[head.group(1)]}: {message}"
        found = [(m.start(), dest) for dest in flags if (m := re.search(rf"\b{dest}\b", message))]
        return f"{flags[min(found)[1]]}: {message}" if found else message


def check_utf8(text: str, what: str) -> str:
    """``text`` when it is valid Unicode; command-line bytes that are not UTF-8 reach Python as
    surrogate escapes, a ValueError naming ``what`` here."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        bad = f"byte {code - 0xDC00:#04x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        raise ValueError(
            f"{what} is not valid UTF-8 ({bad} at character {e.start}); give UTF-8 text"
        ) from None
    return text


def int_list(text: str) -> list[int]:
    """``"1,8,32"`` -> [1, 8, 32] (an argparse type); each at least 1."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of integers") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be at least 1")
    return values


def float_list(text: str) -> list[float]:
    """``"1,2.5,inf"`` -> [1.0, 2.5, inf] (an argparse type)."""
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of numbers") from None


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
    return run_stats(len(outputs), prompt, gen, wall, ttft, itl) | _prefix_cache_stats(outputs)


def run_stats(requests: int, prompt: int, gen: int, wall: float, ttft: list, itl: list) -> dict:
    """The numbers format_stats prints: counts, rates over ``wall`` seconds, TTFT and ITL
    (mean, p50, p99 in ms) from seconds."""
    return dict(
        requests=requests,
        prompt_tokens=prompt,
        generated_tokens=gen,
        wall_s=wall,
        requests_per_s=requests / wall,
        output_tok_per_s=gen / wall,
        total_tok_per_s=(prompt + gen) / wall,
        ttft_ms=percentiles(ttft),
        itl_ms=percentiles(itl),
    )


def spec_stats(engine) -> dict:
    """Speculative decoding's counters for the stats table (nothing when it is off)."""
    st = engine.spec_stats
    if engine.config.speculative is None:
        return {}
    return dict(
        spec_drafts=st.num_drafts,
        spec_draft_tokens=st.num_draft_tokens,
        spec_accepted_tokens=st.num_accepted_tokens,
    )


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
    if "spec_drafts" in s:
        rows.append(("speculative decoding", _spec_row(s)))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _spec_row(s: dict) -> str:
    drafts, proposed, accepted = s["spec_drafts"], s["spec_draft_tokens"], s["spec_accepted_tokens"]
    if not drafts:
        return "no drafts"
    rate = 100 * accepted / max(proposed, 1)
    return (
        f"acceptance {rate:.1f}% ({accepted} of {proposed} draft tokens), "
        f"{1 + accepted / drafts:.2f} tokens per speculated step ({drafts} drafts)"
    )
