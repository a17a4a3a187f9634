"""``python -m engine.diff``: the engine against the reference, step by step.

Runs the prompts greedily three ways: the engine (all prompts batched together, paged cache), the
reference with its KV cache, and the reference recomputing the whole sequence each step. Prints per
step the three tokens and the largest logit differences, then the first divergence. Exit status 1
when tokens differ or logits differ beyond the dtype's tolerance.

    python -m engine.diff --model smollm2 --max-tokens 16
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from reference.generate import generate as reference_generate
from reference.loader import load_model

from .generate import SEED_PROMPTS, _Parser
from .llm_engine import LLMEngine
from .sampling_params import SamplingParams

# largest |a - b| allowed, relative to max|b| of the step's logits
TOLERANCE = {"float32": 1e-4, "auto": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m engine.diff", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF directory, .gguf file, Hub id or 'smollm2'")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable; default: the seed's 3)")
    p.add_argument(
        "--max-tokens", type=int, default=16, help="greedy steps per prompt (default 16)"
    )
    p.add_argument("--backend", default="numpy", choices=["numpy", "cuda", "cuda-cpu"],
                   help="engine backend (default numpy)")  # fmt: skip
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                   help="engine dtype; the reference always runs float32")  # fmt: skip
    p.add_argument("--block-size", type=int, default=16, help="engine block size (default 16)")
    return p


def rel_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def run_engine(loaded, prompts: list[str], args) -> list:
    engine = LLMEngine(
        loaded=loaded, model=args.model, record_logits=True, backend=args.backend,
        dtype=args.dtype, block_size=args.block_size, swap_space=0,
        max_model_len=min(loaded.config.max_position_embeddings, 4096),
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[str(i)].outputs[0] for i in range(len(prompts))]


def compare(prompt: str, eng, cached, recomp, tol: float) -> bool:
    """Print the step table for one prompt; True when everything agrees."""
    print(f"\nprompt {prompt!r}")
    print(f"{'step':>4}  {'engine':>7} {'cached':>7} {'recomp':>7}  {'|eng-cached|':>12}  "
          f"{'|cached-recomp|':>15}")  # fmt: skip
    first_bad = None
    for s, (te, tc, tr) in enumerate(
        zip(eng.token_ids, cached.token_ids, recomp.token_ids, strict=True)
    ):
        d_ec = rel_diff(eng.step_logits[s], cached.logits[s])
        d_cr = rel_diff(cached.logits[s], recomp.logits[s])
        bad = len({te, tc, tr}) > 1 or d_ec > tol or d_cr > tol
        flag = "  <-- differs" if bad else ""
        print(f"{s:>4}  {te:>7} {tc:>7} {tr:>7}  {d_ec:>12.2e}  {d_cr:>15.2e}{flag}")
        if bad and first_bad is None:
            first_bad = s
        if len({te, tc, tr}) > 1:
            break  # past a token divergence the sequences no longer compare
    if first_bad is None:
        print(f"all {len(eng.token_ids)} steps agree (tolerance {tol:.0e} relative)")
        return True
    print(f"first divergence at step {first_bad}")
    return False


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        loaded = load_model(args.model)
        prompts = args.prompt or list(SEED_PROMPTS)
        engine_out = run_engine(loaded, prompts, args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    weights = loaded.weights.astype(np.float32)
    ok = True
    for prompt, eng in zip(prompts, engine_out, strict=True):
        ids = loaded.tokenizer.encode(prompt)
        cached = reference_generate(weights, loaded.config, ids, args.max_tokens, "cached")
        recomp = reference_generate(weights, loaded.config, ids, args.max_tokens, "recompute")
        ok &= compare(prompt, eng, cached, recomp, TOLERANCE[args.dtype])
    print("\nOK: engine == reference" if ok else "\nFAIL: the engine and the reference differ")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
