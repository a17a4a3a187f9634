"""GPU measurements for ``engine.bench``: each figure next to its ceiling (needs a GPU).

    copy_bandwidth_gbs   device-to-device copy: bytes read + written per second (ceiling 1)
    bf16_matmul_tflops   one large bfloat16 cuBLAS product (ceiling 2)
    decode_itl           batch-1 inter-token latency vs reading the weights once at ceiling 1
    throughput           output tokens/s of N concurrent requests vs the decode-step roofline
    hf_generate          Hugging Face ``generate`` on the same model and workload (torch only there)

``python -m engine.bench_gpu --model DIR`` runs them all and prints one line per figure.
"""

from __future__ import annotations

import argparse
import json
import time

import ml_dtypes
import numpy as np

GiB = 1 << 30


def _timed(fn, repeats: int, stream=None) -> float:
    """Seconds per call of ``fn``, by CUDA events on ``stream`` (the one ``fn`` launches on;
    None: the current stream), after one warm-up."""
    import cupy

    stream = stream or cupy.cuda.get_current_stream()
    fn()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    for _ in range(repeats):
        fn()
    end.record(stream)
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / 1e3 / repeats


def _wall(fn, repeats: int) -> float:
    """Seconds per call of ``fn`` (which synchronises itself), after one warm-up."""
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def copy_bandwidth_gbs(nbytes: int = 2 * GiB, repeats: int = 10) -> float:
    """GB/s moved (read + write) by a device-to-device copy of ``nbytes``."""
    import cupy

    src, dst = cupy.ones(nbytes, np.uint8), cupy.empty(nbytes, np.uint8)
    seconds = _timed(lambda: dst.data.copy_from_device_async(src.data, nbytes), repeats)
    return 2 * nbytes / seconds / 1e9


def bf16_matmul_tflops(n: int = 8192, repeats: int = 10) -> float:
    """TFLOP/s of an (n, n) x (n, n) bfloat16 product through cuBLAS gemmEx (float32 sums)."""
    import cupy

    from .gemm import cupy_gemm

    rng = np.random.default_rng(0)

    def bf16(shape):  # drawn on the host, moved as raw bits: no CuPy bfloat16 cast kernel
        a = rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16)
        return cupy.asarray(a.view(np.uint16)).view(ml_dtypes.bfloat16)

    x, w = bf16((n, n)), bf16((n, n))
    out = cupy.empty((n, n), ml_dtypes.bfloat16)
    return 2 * n**3 / _timed(lambda: cupy_gemm(x, w, out), repeats) / 1e12


def make_engine(loaded, **kw):
    from .llm_engine import LLMEngine

    kw = {"backend": "cuda", "swap_space": 1, "num_gpu_blocks": 8192, **kw}
    return LLMEngine(loaded=loaded, model="bench", **kw)


def run_requests(engine, prompts, max_tokens: int) -> tuple[list, float]:
    """All prompts at once, ignore_eos; (outputs, seconds)."""
    from .llm import run_to_completion
    from .sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = run_to_completion(engine, prompts, sp)
    return outs, time.perf_counter() - t0


def decode_itl(loaded, bandwidth_gbs: float, prompt_len=32, tokens=128) -> dict:
    """Batch-1 decode: median inter-token latency vs weights bytes / bandwidth."""
    engine = make_engine(loaded, max_num_seqs=1)
    prompt = list(np.random.default_rng(0).integers(3, loaded.config.vocab_size, prompt_len))
    run_requests(engine, [prompt], 8)  # warm-up
    (out,), _ = run_requests(engine, [prompt], tokens)
    itl = float(np.median(out.metrics.itl))
    floor = engine.backend.weights_bytes / (bandwidth_gbs * 1e9)
    return {"itl_ms": 1e3 * itl, "floor_ms": 1e3 * floor, "ratio": itl / floor, "target": 1.5}


def decode_step_ms(engine, batch: int) -> dict:
    """One pure-decode forward of ``batch`` sequences: graph replay alone, and with logits."""
    from .forward_batch import ForwardBatch

    bs, ctx = engine.config.block_size, 128
    per = -(-ctx // bs)
    tables = np.arange(batch * per, dtype=np.int32).reshape(batch, per)
    pos = np.full(batch, ctx - 1, np.int32)
    fb = ForwardBatch(
        token_ids=np.full(batch, 5, np.int32), positions=pos,
        slot_mapping=(tables[:, -1] * bs + (ctx - 1) % bs).astype(np.int32),
        block_tables=tables, context_lens=pos + 1,
        query_start_loc=np.arange(batch + 1, dtype=np.int32), num_decodes=batch,
    )  # fmt: skip
    be = engine.backend
    with_logits = _wall(lambda: be.forward(fb), 20)  # inputs up, graph, logits down
    graph = be.graphs.get(batch)
    replay = _timed(graph, 20, be.device.stream) if graph else float("nan")
    return {"batch": batch, "replay_ms": 1e3 * replay, "forward_ms": 1e3 * with_logits}


def throughput(loaded, bandwidth_gbs: float, n=256, prompt_len=128, tokens=128) -> dict:
    """Output tokens/s of ``n`` concurrent requests vs the roofline of their decode step
    (weights plus every sequence's KV read once per step, at the measured bandwidth)."""
    engine = make_engine(loaded, max_num_seqs=n, max_num_batched_tokens=max(4096, n))
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(3, loaded.config.vocab_size, prompt_len)) for _ in range(n)]
    run_requests(engine, prompts[:8], 4)  # warm-up
    outs, seconds = run_requests(engine, prompts, tokens)
    produced = sum(len(o.token_ids) for o in outs)
    mean_ctx = prompt_len + tokens / 2
    kv = n * mean_ctx * loaded.config.kv_bytes_per_token(engine.backend.kv_dtype)
    step_floor = (engine.backend.weights_bytes + kv) / (bandwidth_gbs * 1e9)
    roofline = n / step_floor
    rate = produced / seconds
    step = decode_step_ms(engine, n)
    return {"tokens_per_s": rate, "roofline": roofline, "ratio": rate / roofline,
            "target": 0.5, "seconds": seconds, **step}  # fmt: skip


def hf_generate(model_dir: str, n=256, prompt_len=128, tokens=128) -> dict:
    """The same workload through transformers ``generate`` (greedy, one static batch)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model = model.to(device="cuda", dtype=torch.bfloat16).eval()  # bf16 whatever the version
    rng = np.random.default_rng(1)
    ids = torch.tensor(rng.integers(3, model.config.vocab_size, (n, prompt_len)), device="cuda")
    kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
    model.generate(ids[:8], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {"tokens_per_s": (out.shape[1] - prompt_len) * n / seconds, "seconds": seconds}


def run_all(model_dir: str, with_hf: bool = True) -> dict:
    from reference.loader import load_model

    res = {"copy_gbs": copy_bandwidth_gbs(), "bf16_tflops": bf16_matmul_tflops()}
    print(f"device copy bandwidth: {res['copy_gbs']:,.0f} GB/s   (ceiling 1)", flush=True)
    print(f"bf16 matmul 8192^3: {res['bf16_tflops']:,.0f} TFLOP/s   (ceiling 2)", flush=True)
    loaded = load_model(model_dir)
    res["itl"] = d = decode_itl(loaded, res["copy_gbs"])
    print(f"batch-1 decode ITL: {d['itl_ms']:.2f} ms vs weights/bandwidth {d['floor_ms']:.2f} ms "
          f"= {d['ratio']:.2f}x (target <= 1.5x)", flush=True)  # fmt: skip
    res["throughput"] = t = throughput(loaded, res["copy_gbs"])
    print(f"256 requests: {t['tokens_per_s']:,.0f} tok/s vs roofline {t['roofline']:,.0f} tok/s "
          f"= {t['ratio']:.2f} (target >= 0.5); decode step at 256: graph "
          f"{t['replay_ms']:.2f} ms, with logits {t['forward_ms']:.2f} ms", flush=True)  # fmt: skip
    if with_hf:
        res["hf"] = h = hf_generate(model_dir)
        res["engine_over_hf"] = t["tokens_per_s"] / h["tokens_per_s"]
        print(f"transformers generate: {h['tokens_per_s']:,.0f} tok/s; engine / HF = "
              f"{res['engine_over_hf']:.2f}x (target >= 3x)", flush=True)  # fmt: skip
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m engine.bench_gpu", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", required=True, help="a Hugging Face directory (bf16 safetensors)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)
    res = run_all(args.model, with_hf=not args.no_hf)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
