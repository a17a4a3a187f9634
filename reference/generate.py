"""Greedy decoding with the reference model, two ways.

recompute: every step runs the whole sequence again and keeps the last row (cost grows with length).
cached:    prefill once, keeping K and V per layer; each step then runs one token (cost ~constant).

    python -m reference.generate --model smollm2 --prompt "hi my name is" --max-tokens 16
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from model_loader.config import ModelConfig
from model_loader.weights import ModelWeights
from reference.model import KVCache, forward


@dataclass
class GenerateResult:
    token_ids: list[int] = field(default_factory=list)  # generated ids, prompt excluded
    logits: list[np.ndarray] = field(default_factory=list)  # per step, (V,)
    step_times: list[float] = field(default_factory=list)  # seconds per generated token


def generate(
    weights: ModelWeights,
    config: ModelConfig,
    prompt_ids,
    max_tokens: int,
    mode: str = "cached",
    eos_token_ids=(),
) -> GenerateResult:
    """Greedy decode up to ``max_tokens`` ids, stopping after one in ``eos_token_ids``."""
    if mode not in ("cached", "recompute"):
        raise ValueError(f"mode must be 'cached' or 'recompute', got {mode!r}")
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids is empty")
    ids = list(prompt_ids)
    cache = KVCache() if mode == "cached" else None
    new = ids  # tokens this step must run: the prompt first, then one at a time when cached
    out = GenerateResult()
    for _ in range(max_tokens):
        t0 = time.perf_counter()
        logits = forward(weights, config, ids if cache is None else new, cache)  # (V,)
        token = int(np.argmax(logits))
        out.step_times.append(time.perf_counter() - t0)
        out.logits.append(logits)
        out.token_ids.append(token)
        ids.append(token)
        new = [token]
        if token in eos_token_ids:
            break
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m reference.generate",
        description="Greedy completion with the NumPy reference transformer.",
    )
    p.add_argument("--model", required=True, help="HF directory, .gguf file, Hub id, or smollm2")
    p.add_argument("--prompt", required=True, help="prompt text (BOS added as the model says)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument(
        "--mode",
        choices=["cached", "recompute"],
        default="cached",
        help="cached: KV cache, one token per step; recompute: rerun the whole sequence each step",
    )
    p.add_argument(
        "--dtype", choices=["float32", "float64"], default="float32", help="compute dtype"
    )
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the EOS token")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = p.parse_args(argv)
    if args.max_tokens < 1:
        p.error(f"--max-tokens must be at least 1, got {args.max_tokens}")
    return args


def main(argv=None) -> int:
    from model_loader.load import load_model

    args = parse_args(argv)
    try:
        m = load_model(args.model)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompt_ids = m.tokenizer.encode(args.prompt)
    if not prompt_ids:
        print("error: the prompt is empty after tokenization", file=sys.stderr)
        return 2
    weights = m.weights.astype(np.dtype(args.dtype))
    eos = () if args.ignore_eos else tuple(m.config.eos_token_ids)
    res = generate(weights, m.config, prompt_ids, args.max_tokens, args.mode, eos)
    text = m.tokenizer.decode(res.token_ids)
    if args.json:
        print(
            json.dumps({"prompt_token_ids": prompt_ids, "token_ids": res.token_ids, "text": text})
        )
        return 0
    print(args.prompt + text)
    steps = res.step_times
    decode = steps[1:] or steps
    print(
        f"[{args.mode}, {args.dtype}] {len(prompt_ids)} prompt tokens, {len(steps)} generated; "
        f"first token {steps[0] * 1e3:.1f} ms, then {np.mean(decode) * 1e3:.1f} ms/token "
        f"(last {steps[-1] * 1e3:.1f} ms)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
