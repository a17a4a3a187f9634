"""``python -m engine.diff``: the engine against the reference, step by step.

Runs the prompts greedily three ways: the engine (all prompts batched together, paged cache), the
reference with its KV cache, and the reference recomputing the whole sequence each step; and, where
golden data from Hugging Face transformers covers a prompt (``--golden``, by default
tests/golden/smollm2.json for ``--model smollm2``), a fourth: transformers' tokens, and its
first-step logits. Prints per step the tokens and the largest logit differences, then the first
divergence. Exit status 1 when tokens differ or logits differ beyond the dtype's tolerance.

    python -m engine.diff --model smollm2 --max-tokens 16
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from pathlib import Path

import numpy as np

from reference.generate import generate as reference_generate
from reference.loader import load_model

from .generate import SEED_PROMPTS, _Parser
from .llm import run_to_completion
from .llm_engine import LLMEngine
from .sampling_params import SamplingParams

DEFAULT_GOLDEN = {"smollm2": Path(__file__).resolve().parents[1] / "tests/golden/smollm2.json"}
GOLDEN_LOGIT_ATOL = 1e-3  # transformers vs us, float32, first step (the golden tests' bound)

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
    p.add_argument("--golden", help="golden JSON from tests/golden/make_golden.py (default: "
                   "tests/golden/smollm2.json for --model smollm2; 'none' to skip)")  # fmt: skip
    return p


def golden_logits(case: dict) -> np.ndarray:
    """A golden case's last-prompt-position logits, (V,) float32 (stored as base64)."""
    return np.frombuffer(base64.b64decode(case["last_logits_f32_b64"]), dtype="<f4")


def load_golden(args) -> dict:
    """prompt text -> (token ids, first-step logits (V,)) from transformers' golden run."""
    path = args.golden or DEFAULT_GOLDEN.get(args.model)
    if path is None or path == "none" or not Path(path).exists():
        return {}
    cases = json.loads(Path(path).read_text())["cases"]
    return {
        c["prompt"]: (c["token_ids"], golden_logits(c))
        for c in cases
        if c.get("add_special_tokens", True)  # plain prompts, encoded as engine.diff does
    }


def rel_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def run_engine(loaded, prompts: list[str], args) -> list:
    engine = LLMEngine(
        loaded=loaded, model=args.model, record_logits=True, backend=args.backend,
        dtype=args.dtype, block_size=args.block_size, swap_space=0,
        max_model_len=min(loaded.config.max_position_embeddings, 4096),
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    return [o.outputs[0] for o in run_to_completion(engine, prompts, params)]


def compare(prompt: str, eng, cached, recomp, tol: float, golden=None) -> bool:
    """Print the step table for one prompt; True when everything agrees.
    golden: (token ids, first-step logits) from transformers, or None."""
    print(f"\nprompt {prompt!r}")
    print(f"{'step':>4}  {'engine':>7} {'cached':>7} {'recomp':>7} {'golden':>7}  "
          f"{'|eng-cached|':>12}  {'|cached-recomp|':>15}  {'|eng-golden|':>12}")  # fmt: skip
    first_bad = None
    for s, (te, tc, tr) in enumerate(
        zip(eng.token_ids, cached.token_ids, recomp.token_ids, strict=True)
    ):
        d_ec = rel_diff(eng.step_logits[s], cached.logits[s])
        d_cr = rel_diff(cached.logits[s], recomp.logits[s])
        tokens = {te, tc, tr}
        tg, d_eg = "-", ""
        if golden is not None and s < len(golden[0]):
            tg = golden[0][s]
            tokens.add(tg)
        if golden is not None and s == 0:
            d_eg = float(np.max(np.abs(eng.step_logits[0] - golden[1])))
        bad = (
            len(tokens) > 1 or d_ec > tol or d_cr > tol or (d_eg != "" and d_eg > GOLDEN_LOGIT_ATOL)
        )
        flag = "  <-- differs" if bad else ""
        eg = f"{d_eg:>12.2e}" if d_eg != "" else f"{'':>12}"
        print(f"{s:>4}  {te:>7} {tc:>7} {tr:>7} {tg:>7}  {d_ec:>12.2e}  {d_cr:>15.2e}  {eg}{flag}")
        if bad and first_bad is None:
            first_bad = s
        if len(tokens) > 1:
            break  # past a token divergence the sequences no longer compare
    if first_bad is None:
        print(f"all {len(eng.token_ids)} steps agree (tolerance {tol:.0e} relative"
              f"{', golden logits 1e-03 absolute' if golden is not None else ''})")  # fmt: skip
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
    golden = load_golden(args)
    ok = True
    for prompt, eng in zip(prompts, engine_out, strict=True):
        ids = loaded.tokenizer.encode(prompt)
        cached = reference_generate(weights, loaded.config, ids, args.max_tokens, "cached")
        recomp = reference_generate(weights, loaded.config, ids, args.max_tokens, "recompute")
        ok &= compare(prompt, eng, cached, recomp, TOLERANCE[args.dtype], golden.get(prompt))
    print("\nOK: engine == reference" if ok else "\nFAIL: the engine and the reference differ")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
