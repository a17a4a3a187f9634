"""The cpu backend's matrix products alone, per weight format and per build of the kernels.

TinyLlama's four layer matrices (2048x2560 QKV, 2048x2048 O, 2048x11264 gate and up, 5632x2048
down) for a number of layers, random weights, each format as the engine packs it (float32
panels, bf16 panels, Q8_0, Q4_0, Q4_1, int8 panels; GGUF's Q2_K to Q6_K, Q5_0, Q5_1, MXFP4
and IQ4 as random blocks of the shape, the engine having no quantizer for them), or the matrices
``--shapes`` names; x of a given number of rows. Every
(format, build) pair is timed in the same process, in alternating rounds, so a noisy machine
moves them all alike. Prints, per pair, the fastest and the median sweep over all the layers,
and the weights' bytes over that time (at batch 1 the products are bound by it).

    .venv/bin/python scripts/bench_weight_formats.py --formats q4_0,q8_0 --isa native,x86-64-v3

Two versions of the kernels (this tree's and another checkout's, each built once by
``cpu_native.library_path``) compare in one process with ``--isa before=PATH,now=PATH``.
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.backends import cpu_native, cpu_ops, quant  # noqa: E402
from engine.backends.base import numpy_dtype  # noqa: E402
from model_loader import kquants  # noqa: E402

SHAPES = [(2048, 2560), (2048, 2048), (2048, 11264), (5632, 2048)]  # (K, N)
PACK = {
    "float32": quant.to_panels,
    "bf16": lambda w: quant.to_bf16_panels(w.astype(numpy_dtype("bfloat16")).astype(np.float32)),
    "int8": quant.to_int8_panels,
    **{kind: (lambda w, k=kind: quant.quantize(w, k)) for kind in quant.BLOCK_FORMATS},
    **{kind: (lambda w, k=kind: random_blocks(w.shape, k)) for kind in quant.RAW_FORMATS},
}


# kind -> byte offsets of a block's float16 factors, where not (0, 2)
HALVES = {"mxfp4": (), "q6_k": (208,), "q2_k": (80, 82), "q3_k": (108,)}
HALVES |= {"q5_0": (0,), "iq4_nl": (0,), "iq4_xs": (0,)}


def random_blocks(shape: tuple[int, int], kind: str) -> quant.QuantWeight:
    """A (K, N) weight of random GGUF blocks: random bytes, float16 factors 1e-3 (MXFP4's
    exponents 2^-9)."""
    k, n = shape
    per, size = kquants.LAYOUTS[kind.upper()]
    raw = np.random.default_rng(0).integers(0, 256, (n * k // per, size), dtype=np.uint8)
    if kind == "mxfp4":
        raw[:, 0] = 127 - 9
    for at in HALVES.get(kind, (0, 2)):
        raw[:, at : at + 2] = np.full((len(raw), 1), 1e-3, np.float16).view(np.uint8)
    return quant.QuantWeight(kind, raw.reshape(n, -1))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=6, help="TinyLlama layers of matrices (6)")
    p.add_argument(
        "--formats", default="float32,bf16,q8_0,q4_0", help=f"comma-separated, of {list(PACK)}"
    )
    p.add_argument("--rows", type=int, default=1, help="rows of x: the batch's tokens (1)")
    p.add_argument(
        "--isa",
        default="native",
        help="comma-separated builds of the kernels, of native, x86-64-v4 (AVX-512), "
        "x86-64-v3 (AVX2) and generic (the portable code), or NAME=PATH: a built library "
        "(another tree's, to compare two versions of the kernels in one process)",
    )
    p.add_argument("--rounds", type=int, default=9, help="alternating rounds per pair (9)")
    p.add_argument(
        "--shapes",
        default=",".join(f"{k}x{n}" for k, n in SHAPES),
        help="comma-separated KxN matrices of a layer (TinyLlama's four)",
    )
    return p


def main() -> None:
    args = build_parser().parse_args()
    formats, isas = args.formats.split(","), args.isa.split(",")
    unknown = [f for f in formats if f not in PACK]
    if unknown:
        raise SystemExit(f"--formats: unknown {unknown}; known: {list(PACK)}")
    libs = {}
    for entry in isas:
        name, _, path = entry.partition("=")
        lib = cpu_native.ctypes.CDLL(path or str(cpu_native.library_path(name)))
        cpu_native._declare(lib)
        libs[name] = lib
    rng = np.random.default_rng(0)
    mats = {f: [] for f in formats}  # format -> [(packed, K)]
    nbytes = dict.fromkeys(formats, 0)
    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]  # (K, N)
    for _ in range(args.layers):
        for k, n in shapes:
            w = rng.standard_normal((k, n), dtype=np.float32) * 0.02
            for f in formats:
                packed = PACK[f](w)
                mats[f].append(packed)
                nbytes[f] += packed.nbytes
    xs = {k: rng.standard_normal((args.rows, k), dtype=np.float32) for k, _ in shapes}
    pairs = [(f, name) for f in formats for name in libs]
    times = {p: [] for p in pairs}
    for _ in range(args.rounds):
        for f, name in pairs:
            cpu_native._lib[:] = [libs[name]]
            sweep(mats[f], xs)  # warm: the caches, the threads
            t0 = time.perf_counter()
            for _ in range(3):
                sweep(mats[f], xs)
            times[(f, name)].append((time.perf_counter() - t0) / 3)
    print(f"{args.layers} layers, {args.rows} rows, {cpu_ops.threads()} threads")
    for f, name in pairs:
        t = sorted(times[(f, name)])
        lo, mid = t[0], t[len(t) // 2]
        print(
            f"{f:8s} {name:10s} min {lo * 1e3:7.2f} ms  p50 {mid * 1e3:7.2f} ms  "
            f"{nbytes[f] / lo / 1e9:5.1f} / {nbytes[f] / mid / 1e9:5.1f} GB/s"
        )


def sweep(mats: list, xs: dict) -> None:
    for w in mats:
        cpu_ops.matmul(xs[w.shape[0]], w)


if __name__ == "__main__":
    main()
