"""``python -m engine.generate``: complete prompts with the engine and print what happened.

    python -m engine.generate                       # the seed's three prompts, default model
    python -m engine.generate --model smollm2 --prompt "hi my name is" --max-tokens 32 --trace
    python -m engine.generate --json ...            # one JSON object per request on stdout
    python -m engine.generate --chat --prompt "hello there"   # as a user message, chat template
    python -m engine.generate --logprobs 3 ...      # each token's logprob and the top 3
    python -m engine.generate --trace-html run.html # a replay of the run, to open in a browser

Logs (the startup block arithmetic, ``--trace``) go to stderr; bad input is one line, exit 2.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from engine.entrypoints.cli_utils import (
    SEED_PROMPTS,
    CliParser,
    check_utf8,
    format_stats,
    setup_logging,
    spec_stats,
    summarize,
)
from engine.entrypoints.engine_args import add_engine_args, check_engine_args, engine_kwargs
from engine.frontend.llm import LLM
from engine.lora.request import LoRARequest
from engine.sampling_params import SamplingParams

# (flag, type, help) for every SamplingParams field the CLI exposes
SAMPLING_FLAGS = [
    ("--n", int, "completions per prompt, at most --max-num-seqs (default 1)"),
    (
        "--temperature",
        float,
        "0 = greedy (default: the model's generation_config.json, else 0 here; vLLM's is 1.0)",
    ),
    ("--top-p", float, "nucleus sampling mass in (0, 1] (default 1)"),
    ("--top-k", int, "keep the k most likely tokens; 0 or -1 = off (default 0)"),
    ("--min-p", float, "drop tokens below min_p x p(most likely) (default 0)"),
    ("--presence-penalty", float, "subtract once per token already generated (default 0)"),
    ("--frequency-penalty", float, "subtract per occurrence in the output (default 0)"),
    ("--repetition-penalty", float, "> 1 discourages tokens seen in prompt or output (default 1)"),
    ("--max-tokens", int, "tokens to generate at most (default 32)"),
    ("--min-tokens", int, "tokens before EOS / stop ids may end a sequence (default 0)"),
    (
        "--logprobs",
        int,
        "print each generated token's log-probability and the top N, decoded: a line per token, "
        "or logprobs and cumulative_logprob in --json (default off)",
    ),
]


def build_parser() -> CliParser:
    p = CliParser(
        prog="python -m engine.generate",
        description="Generate completions with the paged engine (continuous batching).",
    )
    p.add_argument("--prompt", action="append", help="a prompt (repeatable; default: the seed's 3)")
    p.add_argument(
        "--prompts-file", help="a UTF-8 file with one prompt per line (blank lines skipped)"
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="send each prompt as a user message in the chat template; the prompt shown stays the "
        "message (--json adds messages and templated_prompt)",
    )
    for flag, typ, help_ in SAMPLING_FLAGS:
        p.add_argument(flag, type=typ, help=help_)
    p.add_argument("--stop", action="append", help="a stop string (repeatable; not in the output)")
    p.add_argument("--stop-token-ids", type=int, nargs="+", help="token ids that end a sequence")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    p.add_argument("--json", action="store_true", help="one JSON object per request on stdout")
    p.add_argument("--trace", action="store_true", help="log the life of every request")
    p.add_argument(
        "--trace-html",
        metavar="PATH",
        help="write a replay of the run to PATH: one self-contained HTML file (no network) with "
        "a timeline of the steps, the KV block pool at every step (a slider and a play button), "
        "each request's tokens, page table, states, TTFT and ITL, and the startup block "
        "arithmetic",
    )
    p.add_argument(
        "--lora",
        metavar="PATH",
        help="run every prompt with the LoRA adapter (a PEFT directory) at PATH over the base "
        "weights (sets --enable-lora; an adapter above rank 16 needs --max-lora-rank)",
    )
    p.add_argument(
        "--prompt-name",
        help="with --runner pooling: put the checkpoint's sentence-transformers prompt of this "
        "name (config_sentence_transformers.json, e.g. query) before each prompt",
    )
    p.add_argument("--no-tqdm", action="store_true", help="no progress bar")
    return add_engine_args(p)


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def sampling_params(args, defaults: dict | None = None) -> SamplingParams:
    """The flags' SamplingParams; a flag not given takes the model's default (``defaults``,
    from its generation_config.json), else greedy and 32 tokens."""
    kw = {_dest(f): getattr(args, _dest(f)) for f, _, _ in SAMPLING_FLAGS}
    kw = {**(defaults or {}), **{k: v for k, v in kw.items() if v is not None}}
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 32)
    stop = [check_utf8(s, "--stop") for s in args.stop] if args.stop else args.stop
    return SamplingParams(
        **kw, stop=stop, stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos
    )


def check_n(params: SamplingParams, max_num_seqs: int) -> None:
    """A request's n sequences are scheduled together: n cannot exceed max_num_seqs."""
    if params.n > max_num_seqs:
        raise ValueError(f"--n must be at most --max-num-seqs ({max_num_seqs}), got {params.n}")


def check_trace_html(path: str | None, core_process: bool = False) -> None:
    """--trace-html must name a file in an existing directory (checked before the run), and
    record an in-process engine core."""
    if path is None:
        return
    if core_process:
        raise ValueError(
            "--trace-html records an in-process engine core: not with --engine-core-process"
        )
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder):
        raise ValueError(f"--trace-html {path!r}: not a file in an existing directory")


def read_prompts(args) -> list[str]:
    """--prompt and --prompts-file, in that order; the seed's prompts when neither is given."""
    if args.prompt is None and not args.prompts_file:
        return list(SEED_PROMPTS)
    prompts = [check_utf8(p, "--prompt") for p in args.prompt or []]
    if args.prompts_file:
        prompts += read_prompts_file(args.prompts_file)
    return prompts


def read_prompts_file(path: str) -> list[str]:
    """The non-blank lines of a UTF-8 file; an unreadable, non-UTF-8 or empty file is a
    ValueError naming it."""
    what = f"--prompts-file {path!r}"
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{what}: cannot read it ({e.strerror}); give a readable file") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        bad = f"byte {data[e.start]:#04x} on line {line}"
        raise ValueError(f"{what} is not valid UTF-8 ({bad}); give a UTF-8 file") from None
    prompts = [line.rstrip("\r") for line in text.split("\n") if line.strip()]
    if not prompts:
        raise ValueError(f"{what} has no prompts (empty or blank); give one prompt per line")
    return prompts


def chat_prompts(prompts: list[str], tokenizer) -> list[str]:
    """Each prompt as the one user message of a conversation, in the model's chat template."""
    return [
        tokenizer.apply_chat_template(user_messages(p), tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]


def user_messages(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def json_row(output, prompt: str, args, tokenizer) -> dict:
    """One request's JSON: ``prompt`` is what the user gave; with --chat the messages and the
    templated text (what ``prompt_token_ids`` encode) come beside it; with --logprobs each
    completion's ``logprobs`` (see ``logprob_entries``) and ``cumulative_logprob``."""
    row = output.as_dict()
    if args.chat:
        row |= dict(prompt=prompt, messages=user_messages(prompt), templated_prompt=output.prompt)
    if args.logprobs is not None:
        row |= logprob_fields(output.outputs[0], args.logprobs, tokenizer)
        for r, c in zip(row.get("outputs", []), output.outputs, strict=False):  # --n > 1
            r |= logprob_fields(c, args.logprobs, tokenizer)
    return row


def logprob_fields(completion, n: int, tokenizer) -> dict:
    return dict(
        logprobs=logprob_entries(completion, n, tokenizer),
        cumulative_logprob=completion.cumulative_logprob,
    )


def logprob_entries(completion, n: int, tokenizer) -> list[dict]:
    """Per generated token, vLLM / OpenAI style: ``token_id``, ``token`` (decoded), ``logprob``,
    and ``top_logprobs``, the n most likely tokens of that step, most likely first."""
    steps = zip(completion.token_ids, completion.logprobs, strict=True)
    return [step_entry(token_id, lps, n, tokenizer) for token_id, lps in steps]


def step_entry(token_id: int, lps: dict[int, float], n: int, tokenizer) -> dict:
    top = sorted(lps.items(), key=lambda kv: -kv[1])[:n]
    entry = token_logprob(token_id, lps[token_id], tokenizer)
    return entry | dict(top_logprobs=[token_logprob(t, lp, tokenizer) for t, lp in top])


def token_logprob(token_id: int, logprob: float, tokenizer) -> dict:
    token = tokenizer.decode([token_id], skip_special_tokens=False)
    return dict(token_id=token_id, token=token, logprob=logprob)


def logprob_lines(completion, n: int, tokenizer) -> list[str]:
    """The text form: one line per generated token, the chosen token and its logprob, then the
    top-n alternatives."""
    lines = []
    for i, e in enumerate(logprob_entries(completion, n, tokenizer)):
        top = ", ".join(f"{t['token']!r} {t['logprob']:.3f}" for t in e["top_logprobs"])
        line = f"  {i:>4} {e['token']!r} {e['logprob']:.3f}"
        lines.append(f"{line}  top: {top}" if top else line)
    return lines


def print_output(output, prompt: str, args, tokenizer) -> None:
    """One request on stdout: a JSON line with --json, else a line per completion (and with
    --logprobs a line per generated token)."""
    if args.json:
        row = json_row(output, prompt, args, tokenizer)
        print(json.dumps(row, ensure_ascii=False), flush=True)
        return
    for c in output.outputs:
        print(f"{prompt!r} -> {c.text!r}  [{c.finish_reason}, {len(c.token_ids)} tokens]")
        if args.logprobs is not None:
            print(f"  logprobs (cumulative {c.cumulative_logprob:.3f}):")
            print("\n".join(logprob_lines(c, args.logprobs, tokenizer)))


def run(args) -> int:
    setup_logging(args.trace)
    params = sampling_params(args)  # bad values fail before the model loads
    check_n(params, check_engine_args(args).max_num_seqs)  # and bad engine values, --model
    prompts = read_prompts(args)  # and bad prompts
    check_trace_html(args.trace_html, args.engine_core_process)
    lora = None
    if args.lora:
        lora = LoRARequest(Path(args.lora).name or "lora", 1, args.lora)
        args.enable_lora = True
    llm = LLM(trace_html=args.trace_html, **engine_kwargs(args))
    params = sampling_params(args, llm.engine.sampling_defaults)
    tokenizer = llm.get_tokenizer()
    inputs = chat_prompts(prompts, tokenizer) if args.chat else prompts
    if llm.engine.config.runner == "pooling":  # --runner pooling: each prompt's vector
        try:
            return embed(llm, inputs, prompts, args)
        finally:
            llm.shutdown()
    try:
        t0 = time.perf_counter()
        bar = not (args.no_tqdm or args.json)
        outputs = llm.generate(inputs, params, use_tqdm=bar, lora_request=lora)
        wall = time.perf_counter() - t0
        for prompt, output in zip(prompts, outputs, strict=True):
            print_output(output, prompt, args, tokenizer)
        stats = format_stats(summarize(outputs, wall) | spec_stats(llm.engine))
    finally:
        llm.shutdown()  # a core process exits; KV tiers are saved
    print(stats, file=sys.stderr if args.json else sys.stdout)
    if args.trace_html:
        print(f"replay: {args.trace_html}", file=sys.stderr)
    return 0


def embed(llm, inputs, prompts, args) -> int:
    """--runner pooling: each prompt's vector (the checkpoint's pooling, --pooler-config), or a
    sequence classifier's label probabilities: a JSON line each with --json, else a line."""
    labels, quiet = llm.engine.model_config.labels, args.no_tqdm or args.json
    if labels:
        outs = llm.classify(inputs, use_tqdm=not quiet)
    else:
        outs = llm.embed(inputs, use_tqdm=not quiet, prompt_name=args.prompt_name)
    for prompt, out in zip(prompts, outs, strict=True):
        v = out.outputs.probs if labels else out.outputs.embedding
        if args.json:
            row = {"prompt": prompt, "prompt_tokens": len(out.prompt_token_ids)}
            row |= dict(zip(labels, v, strict=True)) if labels else {"embedding": v}
            print(json.dumps(row, ensure_ascii=False), flush=True)
        elif labels:
            probs = ", ".join(f"{name} {p:.4f}" for name, p in zip(labels, v, strict=True))
            print(f"{prompt!r} -> {probs}")
        else:
            norm = sum(x * x for x in v) ** 0.5
            head = ", ".join(f"{x:.4f}" for x in v[:4])
            print(f"{prompt!r} -> {len(v)} dimensions, norm {norm:.4f}: [{head}, ...]")
    return 0


def main(argv=None) -> int:
    return build_parser().run(run, argv)


if __name__ == "__main__":
    sys.exit(main())
