"""``python -m engine.quant_eval``: what weights in fewer bytes cost in accuracy, measured.

Runs the float32 model and the same model with ``--dtype bfloat16``, a ``--quantization``
(int8, or a GGUF block format: q8_0, q4_0, q4_1) or a 16-bit ``--kv-cache-dtype``,
teacher-forced over one token sequence (prefills of ``--chunk`` tokens over the paged cache,
logits at every position), and prints the KL divergence KL(p_float32 || p_quantized) per
position (mean, p99, max), how often the two top-1 tokens agree, and both perplexities.

    python -m engine.quant_eval --model smollm2 --quantization int8 --tokens 2000
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from engine.backends import get_backend
from engine.backends.forward_batch import ForwardBatch, token_slots
from engine.config import KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig
from engine.core.sampler import log_softmax
from engine.entrypoints.cli_utils import CliParser
from engine.kernels.build import REPO
from engine.utils import cdiv
from model_loader.load import load_model


@dataclass
class Agreement:
    tokens: int  # positions compared (each predicts the next token)
    mean_kl: float
    p99_kl: float
    max_kl: float
    top1: float  # fraction of positions whose argmax is the same
    ppl_ref: float  # perplexity of the float32 model on the text
    ppl_quant: float

    def lines(self) -> str:
        return (
            f"positions {self.tokens}\n"
            f"KL(p_float32 || p_quantized) mean {self.mean_kl:.3g}, p99 {self.p99_kl:.3g}, "
            f"max {self.max_kl:.3g}\n"
            f"top-1 agreement {100 * self.top1:.2f}%\n"
            f"perplexity float32 {self.ppl_ref:.4f}, quantized {self.ppl_quant:.4f}"
        )


def project_text() -> str:
    """The text the tool reads by default: this repository's docs/*.md, concatenated."""
    return "\n\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))


def teacher_forced_logits(backend, tokens: np.ndarray, chunk: int, bar=None) -> np.ndarray:
    """(T,) token ids -> (T, V) float32 logits at every position, in prefills of ``chunk``
    tokens over a fresh paged cache (each chunk attends to the ones before it)."""
    bs, n = backend.block_size, len(tokens)
    backend.allocate_kv_cache(cdiv(n, bs), 0)
    table = np.arange(cdiv(n, bs), dtype=np.int32)[None, :]  # (1, blocks)
    out = np.empty((n, backend.cfg.vocab_size), np.float32)  # (T, V)
    for start in range(0, n, chunk):
        ids = tokens[start : start + chunk].astype(np.int32)  # (t,)
        lens = np.array([start + len(ids)], np.int32)
        qsl = np.array([0, len(ids)], np.int32)
        positions, slots = token_slots(qsl, lens, table, bs)
        batch = ForwardBatch(
            ids, positions.astype(np.int32), slots.astype(np.int32), table, lens, qsl, 0,
            sample_rows=np.arange(len(ids), dtype=np.int32),
        )  # fmt: skip
        out[start : start + len(ids)] = backend.forward(batch)
        if bar is not None:
            bar.update(len(ids))
    backend.kv_cache = backend.cpu_cache = None
    return out


def agreement(ref: np.ndarray, quant: np.ndarray, tokens: np.ndarray) -> Agreement:
    """(T, V) logits of both models over ``tokens`` (T,): position i predicts token i+1."""
    kls, nll_r, nll_q, same = [], [], [], []
    for s in range(0, len(tokens) - 1, 256):
        e = min(s + 256, len(tokens) - 1)
        lp = log_softmax(ref[s:e].astype(np.float64))  # (t, V)
        lq = log_softmax(quant[s:e].astype(np.float64))
        kls.append((np.exp(lp) * (lp - lq)).sum(axis=1))
        rows, nxt = np.arange(e - s), tokens[s + 1 : e + 1]
        nll_r.append(-lp[rows, nxt])
        nll_q.append(-lq[rows, nxt])
        same.append(lp.argmax(axis=1) == lq.argmax(axis=1))
    kl = np.maximum(np.concatenate(kls), 0.0)  # rounding can leave -1e-17
    return Agreement(
        tokens=len(kl),
        mean_kl=float(kl.mean()),
        p99_kl=float(np.percentile(kl, 99)),
        max_kl=float(kl.max()),
        top1=float(np.concatenate(same).mean()),
        ppl_ref=float(np.exp(np.concatenate(nll_r).mean())),
        ppl_quant=float(np.exp(np.concatenate(nll_q).mean())),
    )


def evaluate(
    loaded, config: EngineConfig, tokens, chunk=512, float32_lm_head=False, progress=False
):
    """The float32 model against ``config``'s (same backend) over ``tokens`` -> Agreement."""
    tokens = np.asarray(tokens, np.int64)
    ref_config = EngineConfig(model=config.model, backend=config.backend, dtype="float32")
    # a GGUF's file values in float32, even where the cpu backend would keep its Q8_0 blocks
    float32 = dataclasses.replace(loaded.config, stored_matrix_type=None)
    bar = tqdm(total=2 * len(tokens), unit="tok", disable=not progress)
    with bar:
        ref = get_backend(ref_config.backend, float32, loaded.weights, ref_config)
        want = teacher_forced_logits(ref, tokens, chunk, bar)
        quant = get_backend(config.backend, loaded.config, loaded.weights, config)
        if float32_lm_head:
            quant.lm_head = ref.lm_head
        del ref
        got = teacher_forced_logits(quant, tokens, chunk, bar)
    return agreement(want, got, tokens)


def build_parser() -> CliParser:
    about = " ".join(__doc__.split("\n\n")[1].split())  # the paragraph under the title
    p = CliParser(prog="python -m engine.quant_eval", description=about)
    p.add_argument("--model", default="smollm2", help="HF directory, .gguf or 'smollm2' (default)")
    p.add_argument(
        "--backend",
        choices=["cpu", "numpy"],
        default="cpu",
        help="backend of both runs (default cpu: bf16, int8 and blocks kept as such; numpy: the "
        "same values in float32)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="dtype of the compared run (default float32: only --quantization differs)",
    )
    p.add_argument(
        "--quantization", choices=QUANTIZATIONS, help="weight quantization of the compared run"
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="KV-cache dtype of the compared run (default auto: the --dtype's)",
    )
    p.add_argument(
        "--float32-lm-head",
        action="store_true",
        help="keep the compared run's LM head in float32 (only its layers' matrices reduced)",
    )
    p.add_argument("--text", help="UTF-8 text file to read (default: this repository's docs/*.md)")
    p.add_argument("--tokens", type=int, default=2000, help="tokens of it read (default 2000)")
    p.add_argument("--chunk", type=int, default=512, help="tokens per prefill (default 512)")
    return p


def read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--text {path}: cannot read it as UTF-8 text ({e})") from None


def run(args) -> int:
    smaller_cache = args.kv_cache_dtype not in ("auto", "float32")
    if args.dtype == "float32" and args.quantization is None and not smaller_cache:
        raise ValueError(
            "--dtype float32 without --quantization or a 16- or 8-bit --kv-cache-dtype: "
            "nothing to compare"
        )
    if args.tokens < 2 or args.chunk < 1:
        raise ValueError(
            f"--tokens must be at least 2 and --chunk 1, got {args.tokens}, {args.chunk}"
        )
    text = read_text(args.text) if args.text else project_text()
    config = EngineConfig(
        model=args.model, backend=args.backend, dtype=args.dtype, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )  # fmt: skip
    loaded = load_model(args.model)
    tokens = loaded.tokenizer.encode(text)[: args.tokens]
    if len(tokens) < args.tokens:
        raise ValueError(f"--text has {len(tokens)} tokens, fewer than --tokens {args.tokens}")
    limit = loaded.config.max_position_embeddings
    if len(tokens) > limit:
        raise ValueError(f"--tokens {len(tokens)} is beyond the model's {limit} positions")
    result = evaluate(loaded, config, tokens, args.chunk, args.float32_lm_head, progress=True)
    head = "float32" if args.float32_lm_head else "as the layers"
    what = (
        f"dtype {args.dtype}, quantization {args.quantization or 'none'}, KV cache "
        f"{args.kv_cache_dtype}, LM head {head}"
    )
    print(f"{args.model} on {args.backend}: float32 against {what}")
    print(result.lines())
    return 0


def main(argv=None) -> int:
    return build_parser().run(run, argv)
