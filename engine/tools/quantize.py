"""``python -m engine.tools.quantize IN OUT --type q4_k_m|q5_k_m|q6_k|q5_0``: a model -> a GGUF
file in one of llama.cpp's quantization mixes, block for block what ``llama-quantize`` writes
(no importance matrix) for the same float32 values; llama.cpp and the engine load it.

IN is a float32/float16/bfloat16 .gguf file, or a Hugging Face safetensors directory of a
llama model with a byte-level BPE tokenizer. One line per tensor: its name, shape, type in and
out, and the seconds it took.

  q4_k_m  Q4_K; attn_v and ffn_down Q6_K on the first and last eighth of the layers and every
          third between; the LM head Q6_K
  q5_k_m  the same with Q5_K
  q6_k    Q6_K throughout
  q5_0    Q5_0 throughout, the LM head Q6_K
A row length that is not a multiple of 256 falls back to Q5_0 (from Q4_K), Q5_1 (Q5_K) or Q8_0
(Q6_K). docs/models.md ("Quantizing to GGUF") has the details.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from model_loader.gguf_quantize import quantize_file
from model_loader.kquant_mix import BASE


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m engine.tools.quantize",
        description="A model -> a GGUF file in one of llama.cpp's quantization mixes, block "
        "for block what llama-quantize writes (no importance matrix) for the same float32 values.",
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("src", metavar="IN", help="a float .gguf file or a safetensors directory")
    p.add_argument("dst", metavar="OUT", help="the .gguf file to write")
    p.add_argument("--type", required=True, choices=list(BASE), help="the quantization mix")
    args = p.parse_args(argv)
    if Path(args.dst).resolve() == Path(args.src).resolve():
        p.error("OUT must differ from IN")
    t0 = time.perf_counter()
    try:
        written = quantize_file(args.src, args.dst, args.type)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    counts: dict[str, int] = {}
    for t in written.values():
        counts[t] = counts.get(t, 0) + 1
    mib = Path(args.dst).stat().st_size / 2**20
    kinds = ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))
    print(f"wrote {args.dst}: {len(written)} tensors ({kinds}), {mib:.1f} MiB, "
          f"{time.perf_counter() - t0:.1f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
