"""``python -m engine.generate``: complete prompts with the engine and print what happened.

    python -m engine.generate                       # the seed's three prompts, default model
    python -m engine.generate --model smollm2 --prompt "hi my name is" --max-tokens 32 --trace
    python -m engine.generate --json ...            # one JSON object per request on stdout

Logs (the startup block arithmetic, ``--trace``) go to stderr; bad input is one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import numpy as np

from .config import BACKENDS, DTYPES, PREEMPTION_MODES, EngineConfig
from .outputs import RequestOutput
from .sampling_params import SamplingParams

SEED_PROMPTS = ["hi my name is", "today is a beautiful summer day", "hello there"]

# (flag, type, help) for every SamplingParams field the CLI exposes
SAMPLING_FLAGS = [
    ("--n", int, "completions per prompt (default 1)"),
    ("--temperature", float, "0 = greedy (default 0 here; vLLM's default is 1.0)"),
    ("--top-p", float, "nucleus sampling mass in (0, 1] (default 1)"),
    ("--top-k", int, "keep the k most likely tokens; 0 or -1 = off (default 0)"),
    ("--min-p", float, "drop tokens below min_p x p(most likely) (default 0)"),
    ("--presence-penalty", float, "subtract once per token already generated (default 0)"),
    ("--frequency-penalty", float, "subtract per occurrence in the output (default 0)"),
    ("--repetition-penalty", float, "> 1 discourages tokens seen in prompt or output (default 1)"),
    ("--max-tokens", int, "tokens to generate at most (default 32)"),
    ("--min-tokens", int, "tokens before EOS / stop ids may end a sequence (default 0)"),
    ("--logprobs", int, "return the top-N log-probabilities per token (default off)"),
]

# (flag, type, help) for every EngineConfig field the CLI exposes
ENGINE_FLAGS = [
    ("--block-size", int, "tokens per KV-cache block (default 16)"),
    ("--num-gpu-blocks", int, "override the pool size computed from the memory budget"),
    ("--max-model-len", int, "prompt + output tokens per sequence (default: the model's)"),
    ("--max-num-seqs", int, "sequences per step at most (default 256)"),
    ("--max-num-batched-tokens", int, "tokens per step at most (default max(len, 2048))"),
    ("--swap-space", float, "GiB of host memory for swapped-out blocks (default 4)"),
    ("--gpu-memory-utilization", float, "fraction of memory (NumPy: available RAM) (default 0.9)"),
    ("--memory-budget-bytes", int, "NumPy backend: explicit memory budget in bytes"),
]


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m engine.generate",
        description="Generate completions with the paged engine (continuous batching).",
    )
    p.add_argument("--model", help="HF directory, .gguf file, Hub id or 'smollm2' (default: "
                   "TinyLlama when cached or reachable, else the bundled SmolLM2)")  # fmt: skip
    p.add_argument("--prompt", action="append", help="a prompt (repeatable; default: the seed's 3)")
    p.add_argument("--prompts-file", help="a file with one prompt per line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    for flag, typ, help_ in SAMPLING_FLAGS + ENGINE_FLAGS:
        p.add_argument(flag, type=typ, help=help_)
    p.add_argument("--stop", action="append", help="a stop string (repeatable; not in the output)")
    p.add_argument("--stop-token-ids", type=int, nargs="+", help="token ids that end a sequence")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    p.add_argument("--seed", type=int, default=0, help="engine seed for sampling (default 0)")
    p.add_argument(
        "--preemption-mode",
        choices=PREEMPTION_MODES,
        help="what to do with a running sequence when blocks run out: recompute (free its "
        "blocks, re-prefill later; default) or swap (copy its blocks to host memory)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        help="weights and KV-cache dtype; auto keeps the checkpoint's "
        "(float32 on the NumPy backends)",
    )
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        help="auto: cuda when CuPy sees a GPU, else numpy; numpy: NumPy on the host; cuda-cpu: "
        "the CUDA kernels under the CPU emulation; cuda: the kernels on a GPU through CuPy",
    )
    p.add_argument(
        "--enable-chunked-prefill",
        action="store_true",
        help="split long prefills into chunks that fit the token budget, mixed with decodes",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        help="reuse the KV blocks of a prompt prefix already computed for an earlier request "
        "(full blocks, matched by chained hashes; needs --preemption-mode recompute)",
    )
    p.add_argument(
        "--enforce-eager", action="store_true", help="cuda backend: no CUDA graphs for decode"
    )
    p.add_argument("--json", action="store_true", help="one JSON object per request on stdout")
    p.add_argument("--trace", action="store_true", help="log the life of every request")
    p.add_argument("--no-tqdm", action="store_true", help="no progress bar")
    return p


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse's default prints the usage too)
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def sampling_params(args) -> SamplingParams:
    kw = {_dest(f): getattr(args, _dest(f)) for f, _, _ in SAMPLING_FLAGS}
    kw = {k: v for k, v in kw.items() if v is not None}
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 32)
    return SamplingParams(
        **kw, stop=args.stop, stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos
    )


def engine_args(args) -> dict:
    kw = {_dest(f): getattr(args, _dest(f)) for f, _, _ in ENGINE_FLAGS}
    kw.update(preemption_mode=args.preemption_mode, dtype=args.dtype, backend=args.backend)
    kw = {k: v for k, v in kw.items() if v is not None}
    return dict(
        kw,
        seed=args.seed,
        enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching,
        enforce_eager=args.enforce_eager,
    )


def read_prompts(args, tokenizer) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        try:
            with open(args.prompts_file) as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            raise ValueError(f"--prompts-file {args.prompts_file!r}: {e.strerror}") from None
    prompts = prompts if (args.prompt is not None or args.prompts_file) else list(SEED_PROMPTS)
    if args.chat:
        msgs = [[{"role": "user", "content": p}] for p in prompts]
        prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True) for m in msgs]
    return prompts


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
    return dict(
        requests=len(outputs), prompt_tokens=prompt, generated_tokens=gen, wall_s=wall,
        requests_per_s=len(outputs) / wall, output_tok_per_s=gen / wall,
        total_tok_per_s=(prompt + gen) / wall, ttft_ms=percentiles(ttft), itl_ms=percentiles(itl),
    ) | _prefix_cache_stats(outputs)  # fmt: skip


def _prefix_cache_stats(outputs: list[RequestOutput]) -> dict:
    hits = [o.num_cached_tokens for o in outputs if o.num_cached_tokens is not None]
    return dict(prefix_cache_hit_tokens=sum(hits)) if hits else {}


def format_stats(s: dict) -> str:
    rows = [
        ("requests", f"{s['requests']}"),
        ("prompt tokens", f"{s['prompt_tokens']}"),
        ("generated tokens", f"{s['generated_tokens']}"),
        ("wall time", f"{s['wall_s']:.2f} s"),
        (
            "throughput",
            f"{s['requests_per_s']:.2f} req/s, {s['output_tok_per_s']:.1f} output "
            f"tok/s, {s['total_tok_per_s']:.1f} total tok/s",
        ),  # fmt: skip
        ("TTFT mean/p50/p99", "{:.1f} / {:.1f} / {:.1f} ms".format(*s["ttft_ms"])),
        ("ITL mean/p50/p99", "{:.1f} / {:.1f} / {:.1f} ms".format(*s["itl_ms"])),
    ]
    if "prefix_cache_hit_tokens" in s:
        hits, prompt = s["prefix_cache_hit_tokens"], s["prompt_tokens"]
        rate = f"{100 * hits / max(prompt, 1):.1f}% ({hits} of {prompt} prompt tokens)"
        rows.append(("prefix cache hit rate", rate))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def setup_logging(trace: bool) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)  # fmt: skip
    logging.getLogger("engine.trace").setLevel(logging.INFO if trace else logging.WARNING)


def run(args) -> int:
    from .llm import LLM

    setup_logging(args.trace)
    params = sampling_params(args)  # bad values fail before the model loads
    EngineConfig(**engine_args(args))
    llm = LLM(args.model, **engine_args(args))
    prompts = read_prompts(args, llm.get_tokenizer())
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not (args.no_tqdm or args.json))
    wall = time.perf_counter() - t0
    for o in outputs:
        if args.json:
            print(json.dumps(o.as_dict(), ensure_ascii=False), flush=True)
        else:
            for c in o.outputs:
                print(f"{o.prompt!r} -> {c.text!r}  [{c.finish_reason}, {len(c.token_ids)} tokens]")
    stats = format_stats(summarize(outputs, wall))
    print(stats, file=sys.stderr if args.json else sys.stdout)
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
