"""``python -m engine.generate``: complete prompts with the engine and print what happened.

    python -m engine.generate                       # the seed's three prompts, default model
    python -m engine.generate --model smollm2 --prompt "hi my name is" --max-tokens 32 --trace
    python -m engine.generate --json ...            # one JSON object per request on stdout

Logs (the startup block arithmetic, ``--trace``) go to stderr; bad input is one line, exit 2.
"""

from __future__ import annotations

import json
import sys
import time

from engine.llm import LLM
from engine.sampling_params import SamplingParams

from .cli_utils import SEED_PROMPTS, CliParser, format_stats, setup_logging, summarize
from .engine_args import add_engine_args, engine_config, engine_kwargs

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


def build_parser() -> CliParser:
    p = CliParser(
        prog="python -m engine.generate",
        description="Generate completions with the paged engine (continuous batching).",
    )
    p.add_argument("--prompt", action="append", help="a prompt (repeatable; default: the seed's 3)")
    p.add_argument("--prompts-file", help="a file with one prompt per line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    for flag, typ, help_ in SAMPLING_FLAGS:
        p.add_argument(flag, type=typ, help=help_)
    p.add_argument("--stop", action="append", help="a stop string (repeatable; not in the output)")
    p.add_argument("--stop-token-ids", type=int, nargs="+", help="token ids that end a sequence")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    p.add_argument("--json", action="store_true", help="one JSON object per request on stdout")
    p.add_argument("--trace", action="store_true", help="log the life of every request")
    p.add_argument("--no-tqdm", action="store_true", help="no progress bar")
    return add_engine_args(p)


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


def run(args) -> int:
    setup_logging(args.trace)
    params = sampling_params(args)  # bad values fail before the model loads
    engine_config(args)  # and bad engine values too
    llm = LLM(**engine_kwargs(args))
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
