"""``python -m engine.diff``: the engine against the reference, step by step.

Runs the prompts greedily three ways: the engine (all prompts batched together, paged cache), the
reference with its KV cache, and the reference recomputing the whole sequence each step; and, where
golden data from Hugging Face transformers covers a prompt (``--golden``, by default
engine/golden/smollm2.json for ``--model smollm2``), a fourth: transformers' tokens, and its
first-step logits. Prints per step the tokens and the largest logit differences, then the first
divergence. Exit status 1 when tokens differ or logits differ beyond the dtype's tolerance.

    python -m engine.diff --model smollm2 --max-tokens 16
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from engine.entrypoints.cli_utils import SEED_PROMPTS, CliParser, check_utf8
from engine.entrypoints.engine_args import add_engine_args, check_engine_args, engine_kwargs
from engine.frontend.llm import run_to_completion
from engine.frontend.llm_engine import LLMEngine
from engine.golden import LOGITS_ATOL, golden_logits, golden_path
from engine.sampling_params import SamplingParams
from model_loader.load import load_model
from reference.generate import generate as reference_generate

DEFAULT_GOLDEN = {"smollm2": golden_path("smollm2")}
# engine defaults of this CLI: the NumPy backend in float32, no swap pool
ENGINE_DEFAULTS = dict(backend="numpy", dtype="float32", swap_space=0)

# largest |a - b| allowed, relative to max|b| of the step's logits
TOLERANCE = {"float32": 1e-4, "auto": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}


def build_parser() -> CliParser:
    p = CliParser(prog="python -m engine.diff", description=__doc__.splitlines()[0])
    p.add_argument("--prompt", action="append", help="a prompt (repeatable; default: the seed's 3)")
    p.add_argument(
        "--max-tokens", type=int, default=16, help="greedy steps per prompt (default 16)"
    )
    p.add_argument(
        "--golden",
        help="golden JSON from scripts/make_golden.py (default: engine/golden/smollm2.json for "
        "--model smollm2; 'none' to skip)",
    )
    return add_engine_args(p, defaults=ENGINE_DEFAULTS, required=("model",))


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
    """Every prompt greedily through the engine, recording each step's logits."""
    kw = engine_kwargs(args)
    kw.setdefault("max_model_len", min(loaded.config.max_position_embeddings, 4096))
    engine = LLMEngine(loaded=loaded, record_logits=True, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    return [o.outputs[0] for o in run_to_completion(engine, prompts, params)]


def compare(prompt: str, eng, cached, recomp, tol: float, golden=None) -> bool:
    """Print the step table for one prompt; True when everything agrees.
    golden: (token ids, first-step logits) from transformers, or None."""
    print(f"\nprompt {prompt!r}")
    tokens = f"{'step':>4}  {'engine':>7} {'cached':>7} {'recomp':>7} {'golden':>7}"
    print(f"{tokens}  {'|eng-cached|':>12}  {'|cached-recomp|':>15}  {'|eng-golden|':>12}")
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
        bad = len(tokens) > 1 or d_ec > tol or d_cr > tol or (d_eg != "" and d_eg > LOGITS_ATOL)
        flag = "  <-- differs" if bad else ""
        eg = f"{d_eg:>12.2e}" if d_eg != "" else f"{'':>12}"
        print(f"{s:>4}  {te:>7} {tc:>7} {tr:>7} {tg:>7}  {d_ec:>12.2e}  {d_cr:>15.2e}  {eg}{flag}")
        if bad and first_bad is None:
            first_bad = s
        if len(tokens) > 1:
            break  # past a token divergence the sequences no longer compare
    if first_bad is None:
        also = f", golden logits {LOGITS_ATOL:.0e} absolute" if golden is not None else ""
        print(f"all {len(eng.token_ids)} steps agree (tolerance {tol:.0e} relative{also})")
        return True
    print(f"first divergence at step {first_bad}")
    return False


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        prompts = [check_utf8(p, "--prompt") for p in args.prompt or SEED_PROMPTS]
        check_engine_args(args)  # bad engine values and --model fail before the model loads
        loaded = load_model(args.model)
        engine_out = run_engine(loaded, prompts, args)
    except ValueError as e:
        return parser.fail(e)
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
