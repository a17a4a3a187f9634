"""GPU measurements, each figure next to its ceiling.

    copy        device-to-device copy: bytes read + written per second (ceiling 1)
    gemm        one large bfloat16 product on the engine's cuBLAS handle (ceiling 2)
    itl         batch-1 inter-token latency, graphs and eager, vs reading the weights once at
                the measured copy bandwidth (target: at most 1.3x)
    throughput  output tokens/s of N concurrent requests, graphs and eager, vs the roofline
                of their decode step: the larger of its bytes / copy bandwidth and its FLOPs /
                the measured bf16 matmul rate (target: at least 0.5x); and one decode step's
                time at batch N
    hf          Hugging Face ``generate`` on the same model and workload (torch only there);
                the engine's throughput over it (target: at least 3x)

``python -m engine.tools.bench_gpu --model DIR --json FILE`` runs them in that order. Each figure is
guarded on its own (an exception is recorded as that figure's ``error`` and the next one runs)
and FILE is rewritten after each, so a run cut short still leaves every figure it reached.
``--emulate`` runs the same code on the emulated device (backend ``cuda-cpu``) with a small
workload: it checks the benchmark itself, its numbers say nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from datetime import UTC, datetime

import ml_dtypes
import numpy as np

from engine.utils import cdiv

GiB = 1 << 30
TARGETS = dict(itl=1.3, throughput=0.5, hf=3.0)  # ITL/floor at most; others at least
FULL = dict(requests=256, prompt_len=128, output_len=128, copy_bytes=2 * GiB, gemm_n=8192)
SMALL = dict(requests=4, prompt_len=16, output_len=8, copy_bytes=1 << 24, gemm_n=256)


class Clock:
    """Seconds per call of ``fn`` after one warm-up: CUDA events on the device's stream on a
    GPU (``fn`` only launches), wall time on the emulated device."""

    def __init__(self, device):
        self.device = device

    def per_call(self, fn, repeats: int) -> float:
        with self.device.active():
            fn()
            if not self.device.is_gpu:
                t0 = time.perf_counter()
                for _ in range(repeats):
                    fn()
                return (time.perf_counter() - t0) / repeats
            import cupy

            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(self.device.stream)
            for _ in range(repeats):
                fn()
            end.record(self.device.stream)
            end.synchronize()
            return cupy.cuda.get_elapsed_time(start, end) / 1e3 / repeats


def copy_bandwidth(device, nbytes: int) -> dict:
    """GB/s moved (read + write) by a device-to-device copy of ``nbytes``."""
    with device.active():
        src, dst = device.zeros((nbytes,), np.uint8), device.empty((nbytes,), np.uint8)
    if device.is_gpu:  # one cudaMemcpyAsync on the device's stream

        def copy():
            dst.data.copy_from_device_async(src.data, nbytes, device.stream)
    else:

        def copy():
            np.copyto(dst, src)

    seconds = Clock(device).per_call(copy, 10)
    return {"gbs": 2 * nbytes / seconds / 1e9, "bytes": nbytes}


def gemm_tflops(device, n: int) -> dict:
    """TFLOP/s of an (n, n) x (n, n) bfloat16 product (float32 sums) on the engine's handle."""
    rng = np.random.default_rng(0)
    with device.active():
        x, w = (
            device.upload(rng.standard_normal((n, n), np.float32).astype(ml_dtypes.bfloat16))
            for _ in range(2)
        )
        out = device.empty((n, n), ml_dtypes.bfloat16)
    seconds = Clock(device).per_call(lambda: device.gemm(x, w, out), 10)
    return {"tflops": 2 * n**3 / seconds / 1e12, "n": n}


def make_engine(loaded, backend: str, eager: bool, **kw):
    from engine.frontend.llm_engine import LLMEngine

    kw = {"swap_space": 1, "num_gpu_blocks": 8192, "enforce_eager": eager, **kw}
    return LLMEngine(loaded=loaded, model="bench", backend=backend, **kw)


def run_requests(engine, prompts, max_tokens: int) -> tuple[list, float]:
    """All prompts at once, greedy, ignore_eos; (outputs, seconds)."""
    from engine.frontend.llm import run_to_completion
    from engine.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = run_to_completion(engine, prompts, sp)
    return outs, time.perf_counter() - t0


def random_prompts(loaded, n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, loaded.config.vocab_size, length)] for _ in range(n)]


def decode_itl(loaded, backend: str, eager: bool, bandwidth_gbs: float | None, w: dict) -> dict:
    """Batch-1 decode: median inter-token latency vs weights bytes / bandwidth."""
    engine = make_engine(loaded, backend, eager, max_num_seqs=1)
    prompt = random_prompts(loaded, 1, w["prompt_len"], 0)
    run_requests(engine, prompt, 4)  # warm-up
    (out,), _ = run_requests(engine, prompt, w["output_len"])
    itl = float(np.median(out.metrics.itl))
    res = {"itl_ms": 1e3 * itl, "graphs": sorted(engine.backend.graphs)}
    if bandwidth_gbs:
        floor = engine.backend.weights_bytes / (bandwidth_gbs * 1e9)
        res |= {"floor_ms": 1e3 * floor, "ratio": itl / floor}
    return res


def decode_step_ms(engine, batch: int) -> dict:
    """One pure-decode forward of ``batch`` sequences (128-token contexts), inputs up and ids
    down, and the graph replay alone where there is one."""
    from engine.backends.forward_batch import ForwardBatch

    bs, ctx = engine.config.block_size, 128
    per = cdiv(ctx, bs)
    tables = np.arange(batch * per, dtype=np.int32).reshape(batch, per)
    pos = np.full(batch, ctx - 1, np.int32)
    fb = ForwardBatch(
        token_ids=np.full(batch, 5, np.int32),
        positions=pos,
        slot_mapping=(tables[:, -1] * bs + (ctx - 1) % bs).astype(np.int32),
        block_tables=tables,
        context_lens=pos + 1,
        query_start_loc=np.arange(batch + 1, dtype=np.int32),
        num_decodes=batch,
    )
    be = engine.backend
    be.forward_greedy(fb)
    t0 = time.perf_counter()
    for _ in range(10):
        be.forward_greedy(fb)
    res = {"batch": batch, "step_ms": 1e3 * (time.perf_counter() - t0) / 10}
    graph = be.graphs.get(batch)
    if graph is not None:
        res["replay_ms"] = 1e3 * Clock(be.device).per_call(graph, 10)
    return res


def decode_step_flops(config, batch: int, context: float) -> float:
    """FLOPs of one decode step of ``batch`` sequences at a mean ``context``: two per weight of
    every matrix product (QKV, O, gate-up, down, LM head) per token, plus attention's QK^T and
    PV (two each per query head, head dim and context token it sees: a sliding-window layer
    sees at most its window)."""
    c = config
    D, F, L = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    per_layer = D * (c.q_dim + 2 * c.kv_dim) + c.q_dim * D + 3 * D * F
    matmul = 2 * batch * (L * per_layer + c.vocab_size * D)
    seen = sum(min(context, c.window(i)) if c.window(i) else context for i in range(L))
    attention = 4 * batch * c.num_attention_heads * c.head_dim * seen
    return float(matmul + attention)


def roofline(engine, config, n: int, context: float, bandwidth_gbs, tflops) -> dict:
    """Tokens/s if a decode step of ``n`` sequences took its longer floor: the weights and every
    sequence's KV read once at the copy bandwidth, or its FLOPs at the matmul rate."""
    kv = n * context * config.kv_bytes_per_token(engine.backend.kv_dtype)
    memory_s = (engine.backend.weights_bytes + kv) / (bandwidth_gbs * 1e9)
    compute_s = decode_step_flops(config, n, context) / (tflops * 1e12) if tflops else 0.0
    bound = "memory" if memory_s >= compute_s else "compute"
    return {"roofline": n / max(memory_s, compute_s), "bound": bound}


def throughput(
    loaded, backend: str, eager: bool, bandwidth_gbs: float | None, tflops, w: dict
) -> dict:
    """Output tokens/s of ``requests`` concurrent requests vs the roofline of their decode step
    (``roofline``)."""
    n = w["requests"]
    engine = make_engine(loaded, backend, eager, max_num_seqs=n, max_num_batched_tokens=4096)
    prompts = random_prompts(loaded, n, w["prompt_len"], 1)
    run_requests(engine, prompts[: min(n, 8)], 4)  # warm-up
    outs, seconds = run_requests(engine, prompts, w["output_len"])
    rate = sum(len(o.token_ids) for o in outs) / seconds
    res = {"tokens_per_s": rate, "seconds": seconds, **decode_step_ms(engine, n)}
    if bandwidth_gbs:
        mean_ctx = w["prompt_len"] + w["output_len"] / 2
        res |= roofline(engine, loaded.config, n, mean_ctx, bandwidth_gbs, tflops)
        res["ratio"] = rate / res["roofline"]
    return res


def hf_generate(model_dir: str, w: dict) -> dict:
    """The same workload through transformers ``generate`` (greedy, one static batch, bf16)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model = model.to(device="cuda", dtype=torch.bfloat16).eval()
    n, p, t = w["requests"], w["prompt_len"], w["output_len"]
    rng = np.random.default_rng(1)
    ids = torch.tensor(rng.integers(3, model.config.vocab_size, (n, p)), device="cuda")
    kw = dict(max_new_tokens=t, min_new_tokens=t, do_sample=False, pad_token_id=0)
    model.generate(ids[:8], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {"tokens_per_s": (out.shape[1] - p) * n / seconds, "seconds": seconds}


def summary(name: str, r: dict) -> str:
    """One line a figure."""
    if "error" in r:
        return f"{name}: FAILED {r['error']}"
    if name == "copy":
        return f"copy: {r['gbs']:,.0f} GB/s device to device (ceiling 1)"
    if name == "gemm":
        return f"gemm: {r['tflops']:,.1f} TFLOP/s bf16 {r['n']}^3 (ceiling 2)"
    if name.startswith("itl"):
        ratio = ""
        if "ratio" in r:
            ratio = f" vs weights/bandwidth {r['floor_ms']:.2f} ms = {r['ratio']:.2f}x"
            ratio += f" (target <= {TARGETS['itl']}x)"
        return f"{name}: {r['itl_ms']:.2f} ms batch-1 ITL{ratio}"
    if name.startswith("throughput"):
        roof = ""
        if "ratio" in r:
            roof = f" vs {r['bound']}-bound roofline {r['roofline']:,.0f} = {r['ratio']:.2f}x"
            roof += f" (target >= {TARGETS['throughput']}x)"
        replay = f", graph replay {r['replay_ms']:.2f} ms" if "replay_ms" in r else ""
        return (
            f"{name}: {r['tokens_per_s']:,.0f} tok/s{roof}; decode step at {r['batch']}: "
            f"{r['step_ms']:.2f} ms{replay}"
        )
    if name == "hf":
        over = f"; engine {r['engine_over_hf']:.2f}x" if "engine_over_hf" in r else ""
        return f"hf: transformers generate {r['tokens_per_s']:,.0f} tok/s{over} (target >= 3x)"
    return f"{name}: " + ", ".join(f"{k} {v}" for k, v in r.items())


def run_all(model_dir: str, out_json: str | None, emulate: bool, with_hf: bool) -> dict:
    from engine.devices.device import CupyDevice
    from engine.emulation.device import EmulatedDevice
    from model_loader.load import load_model

    w = SMALL if emulate else FULL
    backend = "cuda-cpu" if emulate else "cuda"
    res: dict = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "workload": w}
    state: dict = {}

    def figure(name, fn):
        t0 = time.perf_counter()
        try:
            res[name] = fn()
        except Exception as exc:
            res[name] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
            res[name]["traceback"] = traceback.format_exc()
        res[name]["wall_s"] = round(time.perf_counter() - t0, 2)
        if out_json:
            with open(out_json, "w") as f:
                json.dump(res, f, indent=2, default=float)
        print(summary(name, res[name]), flush=True)

    def device():
        state["device"] = dev = EmulatedDevice() if emulate else CupyDevice()
        return {"name": dev.name, "backend": backend}

    figure("device", device)
    dev = state.get("device")
    figure("copy", lambda: copy_bandwidth(dev, w["copy_bytes"]))
    figure("gemm", lambda: gemm_tflops(dev, w["gemm_n"]))
    figure("load", lambda: {"source": state.setdefault("loaded", load_model(model_dir)).source})
    loaded, bw = state.get("loaded"), None if emulate else res["copy"].get("gbs")
    tflops = res["gemm"].get("tflops")
    for eager in (False, True):
        tag = "eager" if eager else "graphs"
        figure(f"itl_{tag}", lambda e=eager: decode_itl(loaded, backend, e, bw, w))
        figure(f"throughput_{tag}", lambda e=eager: throughput(loaded, backend, e, bw, tflops, w))
    if with_hf and not emulate:
        figure("hf", lambda: hf_vs_engine(model_dir, w, res["throughput_graphs"]))
    return res


def hf_vs_engine(model_dir: str, w: dict, ours: dict) -> dict:
    """``hf_generate`` and the engine's graphs throughput over it."""
    theirs = hf_generate(model_dir, w)
    if "tokens_per_s" in ours:
        theirs["engine_over_hf"] = ours["tokens_per_s"] / theirs["tokens_per_s"]
    return theirs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m engine.tools.bench_gpu", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", required=True, help="a Hugging Face directory (bf16 safetensors)")
    p.add_argument("--json", help="write the figures to this file, rewritten after each")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    p.add_argument(
        "--emulate",
        action="store_true",
        help="the emulated device (backend cuda-cpu) and a small workload: checks the benchmark",
    )
    args = p.parse_args(argv)
    res = run_all(args.model, args.json, args.emulate, with_hf=not args.no_hf)
    failed = [k for k, v in res.items() if isinstance(v, dict) and "error" in v]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
