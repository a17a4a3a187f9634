"""``python -m engine.bench``: offline throughput and latency of the engine (not a test).

Workload: ``--num-requests`` requests of random token ids, prompt lengths uniform in
[--min-prompt, --max-prompt], outputs uniform in [--min-output, --max-output] tokens with
ignore_eos, all from ``--seed``. Prints requests/s, output and total tokens/s, TTFT and ITL
percentiles; then batch-1 decode ITL next to the time the step's matrix products alone take,
and the steps in which all ``--max-num-seqs`` sequences decode against their products alone:
the run's steps (p50) against one measurement after it, and the last such step replayed,
alternated with the products ten times (robust to a machine whose speed drifts).
With ``--peer transformers`` the same workload runs through Hugging Face ``generate`` in
static batches (torch and transformers are imported only there) and the ratio is printed.
``--sweep-concurrency`` and ``--plot DIR`` are engine/tools/bench_plot.py's.

With ``--host-overhead`` it measures the host instead: the engine loop at batch 1, 64 and 256
around a stub backend whose forward returns token ids at once (``engine.tools.host_overhead``), and
prints the median ms per decode step, split into its parts, for ``step(stream=False)`` (outputs
of finished requests only, as ``LLM.generate`` steps) and ``step()`` (an output per request per
step, as the server streams). ``--device-step-ms MS`` adds the overlap figure: batch 256 with
a stub that models a device step of MS ms, ms per step with ``async_scheduling`` off and on.
"""

from __future__ import annotations

import copy
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.backends.forward_batch import ForwardBatch
from engine.entrypoints.cli_utils import CliParser, format_stats, percentiles, spec_stats, summarize
from engine.entrypoints.engine_args import add_engine_args, check_engine_args, engine_kwargs
from engine.frontend.chat import chat_prompt_ids
from engine.frontend.llm import run_to_completion
from engine.frontend.llm_engine import LLMEngine
from engine.lora.request import LoRARequest
from engine.sampling_params import SamplingParams
from engine.tools import bench_conversations, bench_plot, host_overhead
from engine.tools.random_lora import write_random_adapter
from engine.utils import MiB
from model_loader.load import load_model

# engine defaults of this CLI (--seed is the workload's, so the engine keeps its seed 0)
HOST_BATCHES = (1, 64, 256)  # --host-overhead
ENGINE_DEFAULTS = dict(model="smollm2", backend="auto", max_num_seqs=64, swap_space=0.5)


WORKLOADS = ("random", "copy", "open", "conversations")


def build_parser() -> CliParser:
    p = CliParser(prog="python -m engine.bench", description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=64, help="requests (default 64)")
    p.add_argument("--min-prompt", type=int, default=16, help="shortest prompt (default 16)")
    p.add_argument("--max-prompt", type=int, default=256, help="longest prompt (default 256)")
    p.add_argument("--min-output", type=int, default=64, help="fewest outputs (default 64)")
    p.add_argument("--max-output", type=int, default=128, help="most outputs (default 128)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="random",
        help="random: random token prompts and output lengths (ignore_eos); copy: chat prompts "
        "asking to repeat or lightly edit a passage of about 100-300 tokens (greedy to EOS or "
        "--max-output); open: open-ended chat questions (greedy to EOS or --max-output); "
        "conversations: multi-turn conversations with long system prompts on a small pool, the "
        "KV tiers off, in host memory, on disk and after a restart (engine/tools/"
        "bench_conversations.py; its flags below) (default random)",
    )
    p.add_argument("--batch1-tokens", type=int, default=32, help="batch-1 decode steps timed")
    p.add_argument(
        "--lora-adapters",
        type=int,
        default=0,
        help="random LoRA adapters (every projection, rank --lora-rank) the requests take in "
        "turn: request i runs with adapter i mod N (sets --enable-lora, --max-loras N) "
        "(default 0: the base model)",
    )
    p.add_argument("--lora-rank", type=int, default=16, help="their rank (default 16)")
    p.add_argument("--peer", choices=["transformers"], help="also run a peer implementation")
    p.add_argument("--peer-batch", type=int, default=64, help="peer static batch (default 64)")
    bench_plot.add_args(p)
    bench_conversations.add_args(p)
    p.add_argument(
        "--host-overhead",
        action="store_true",
        help="measure the host's cost per decode step instead (batch 1, 64, 256; the model's "
        "forward replaced by a stub that returns token ids at once; the real tokenizer)",
    )
    p.add_argument(
        "--host-steps", type=int, default=50, help="decode steps timed per batch (default 50)"
    )
    p.add_argument(
        "--device-step-ms",
        type=float,
        default=0.0,
        help="with --host-overhead: also time batch 256 with a stub device step of this many ms, "
        "async scheduling off and on (default 0: not run)",
    )
    return add_engine_args(p, defaults=ENGINE_DEFAULTS, exclude=("seed",))


def make_engine(args) -> LLMEngine:
    """The engine of the flags; max_model_len defaults to the longest prompt + output."""
    kw = engine_kwargs(args)
    kw.setdefault("max_model_len", args.max_prompt + args.max_output)
    if args.lora_adapters:
        kw |= dict(enable_lora=True, max_loras=args.lora_adapters, max_lora_rank=args.lora_rank)
    return LLMEngine(**kw)


def lora_memory_line(engine: LLMEngine, n: int) -> str:
    """The adapters' memory: the loaded pairs, and what the backend keeps besides them."""
    manager = getattr(engine.core, "lora", None)
    pairs = sum(w.nbytes for w in manager.loaded.values()) if manager is not None else 0
    extra = getattr(engine.backend, "lora_bytes", 0)
    pairs, extra = pairs // n, extra // n
    return (
        f"LoRA memory per adapter: {pairs / MiB:.1f} MiB loaded ({pairs:,} bytes of float32 "
        f"pairs, host); {extra / MiB:.1f} MiB more in the {engine.backend.name} backend's own "
        f"layout ({extra:,} bytes)"
    )


def random_loras(engine: LLMEngine, args) -> list:
    """--lora-adapters random adapters in a temporary directory, as LoRARequests."""
    if not args.lora_adapters:
        return []
    folder = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    cfg = engine.model_config
    return [
        LoRARequest(
            f"random{i}", i + 1, str(write_random_adapter(folder / str(i), cfg, args.lora_rank, i))
        )
        for i in range(args.lora_adapters)
    ]


def workload(args, vocab: int, tokenizer=None):
    """(prompts, output lengths); the chat workloads need the model's tokenizer."""
    if args.workload != "random":
        return chat_workload(args, tokenizer)
    rng = np.random.default_rng(args.seed)
    lens = rng.integers(args.min_prompt, args.max_prompt + 1, args.num_requests)
    outs = rng.integers(args.min_output, args.max_output + 1, args.num_requests)
    prompts = [rng.integers(100, vocab - 100, n).tolist() for n in lens]
    return prompts, outs.tolist()


SENTENCES = [
    "The committee met on Tuesday to review the budget for the new library.",
    "After a long discussion, the members agreed to extend the weekend opening hours.",
    "Volunteers organised a book fair that raised more than two thousand dollars.",
    "The river flooded the lower fields twice this spring, so planting was delayed.",
    "Our team shipped the new search feature and the error rate dropped by half.",
    "Please bring your own water bottle, a hat and sturdy shoes for the hike.",
    "The recipe needs two cups of flour, a pinch of salt and warm water.",
    "Trains to the airport leave every twenty minutes from the central station.",
    "The museum will close early on Friday for the installation of a new exhibit.",
    "She fixed the leaking tap, painted the fence and still had time for tea.",
]
COPY_ASKS = [
    "Repeat the following passage exactly, word for word:",
    "Rewrite this passage with every sentence in the past tense, changing nothing else:",
    "Copy this text, replacing every number written in words with digits:",
]
OPEN_ASKS = [
    "Write a short story about a dragon who learns to bake bread.",
    "Explain why the sky is blue to a ten year old.",
    "Give me five ideas for a birthday party in the park.",
    "What are the pros and cons of working from home?",
]


def chat_workload(args, tokenizer):
    """Chat prompts (token ids through the chat template) and their output caps."""
    rng = np.random.default_rng(args.seed)
    prompts, outs = [], []
    for _ in range(args.num_requests):
        if args.workload == "copy":
            n = int(rng.integers(5, 16))  # sentences: about 100-300 tokens
            passage = " ".join(rng.choice(SENTENCES, n).tolist())
            text = f"{rng.choice(COPY_ASKS)}\n\n{passage}"
        else:
            text = str(rng.choice(OPEN_ASKS))
        prompts.append(chat_prompt_ids(tokenizer, [{"role": "user", "content": text}], True))
        outs.append(args.max_output)
    return prompts, outs


def run_engine(
    engine: LLMEngine, prompts, out_lens, ignore_eos=True, loras=()
) -> tuple[list, float]:
    """Every prompt with its output length, greedy (to EOS too unless ignore_eos), request i
    with ``loras[i % len(loras)]`` if any: (outputs, seconds)."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=ignore_eos) for n in out_lens
    ]
    per = [loras[i % len(loras)] for i in range(len(prompts))] if loras else None
    t0 = time.perf_counter()
    outputs = run_to_completion(engine, prompts, params, loras=per)
    return outputs, time.perf_counter() - t0


def experts_read(ex) -> list:
    """A layer of experts' (gate_up, down) pairs that one token reads: top_k of them (the
    first experts, as if the router chose them)."""
    return list(zip(ex.gate_up[: ex.top_k], ex.down[: ex.top_k], strict=True))


def matmul_only_ms(backend, batch: int, repeats: int = 10) -> float:
    """Best time of one step's matrix products alone (every layer + LM head) at this batch,
    through the backend's own product (``ops.matmul``); a layer of experts: top_k of them."""
    x = np.random.default_rng(0).standard_normal((batch, backend.cfg.hidden_size), np.float32)
    mm, c = backend.ops.matmul, backend.cfg
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for lw in backend.layers:
            qkv = mm(x, lw.w_qkv)
            _ = mm(np.ascontiguousarray(qkv[:, : c.q_dim]), lw.w_o)
            mlps = [(lw.w_gate_up, lw.w_down)] if lw.experts is None else experts_read(lw.experts)
            for gate_up, down in mlps:
                a = mm(x, gate_up)  # (batch, 2F)
                _ = mm(np.ascontiguousarray(a[:, : a.shape[1] // 2]), down)
        _ = mm(x, backend.lm_head)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


@dataclass
class FullSteps:
    """The seconds of each step in which all ``batch`` sequences decode (one token each), a
    copy of the last such step's batch, and the backend's own greedy forward (to replay it)."""

    seconds: list[float] = field(default_factory=list)
    batch: ForwardBatch | None = None
    forward_greedy: Callable | None = None


def time_full_decode_steps(engine: LLMEngine, batch: int) -> FullSteps:
    """Install a timer on the backend's forwards; the FullSteps it returns fills as the engine
    runs steps in which ``batch`` sequences all decode."""
    backend, full = engine.backend, FullSteps()
    full.forward_greedy = backend.forward_greedy

    def timed(fn):
        def forward(b):
            t0 = time.perf_counter()
            out = fn(b)
            if b.num_seqs == batch and b.num_decodes == batch and len(b.token_ids) == batch:
                full.seconds.append(time.perf_counter() - t0)
                if b.prev_rows is None:
                    full.batch = copy.deepcopy(b)
            return out

        return forward

    backend.forward, backend.forward_greedy = map(timed, (backend.forward, backend.forward_greedy))
    return full


def replayed_step_ratios(backend, full: FullSteps, rounds: int = 10) -> tuple[float, float, list]:
    """The last full step replayed, alternated with the products alone at its batch, ``rounds``
    times: (step p50 ms, products p50 ms, each round's step / products). Alternating keeps a
    machine whose speed drifts (a shared VM) from moving one side of the ratio only. The replay
    writes the step's K/V into the slots it wrote before; the run is over by then."""
    steps, products = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        full.forward_greedy(full.batch)
        steps.append(1e3 * (time.perf_counter() - t0))
        products.append(matmul_only_ms(backend, full.batch.num_seqs, 1))
    ratios = [s / p for s, p in zip(steps, products, strict=True)]
    return float(np.median(steps)), float(np.median(products)), ratios


def batch1_itl_ms(engine: LLMEngine, prompt, n: int) -> list[float]:
    outs, _ = run_engine(engine, [prompt], [n])
    return outs[0].metrics.itl


def run_peer(args, prompts, out_lens) -> float:
    """Output tokens/s of transformers ``generate`` in static batches (greedy), in the engine's
    --dtype where it names a 16-bit one (bfloat16, float16), float32 otherwise."""
    import torch  # only here: not a project dependency
    from transformers import AutoModelForCausalLM

    from model_loader.load import resolve_model

    path = resolve_model(args.model)
    kw = dict(gguf_file=path.name) if path.is_file() else {}
    model = AutoModelForCausalLM.from_pretrained(
        path.parent if path.is_file() else path, dtype=getattr(torch, peer_dtype(args)), **kw
    ).eval()
    t0, useful = time.perf_counter(), 0
    for s in range(0, len(prompts), args.peer_batch):
        batch, lens = prompts[s : s + args.peer_batch], out_lens[s : s + args.peer_batch]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            n = max(lens)
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        useful += sum(lens)
    return useful / (time.perf_counter() - t0)


def peer_dtype(args) -> str:
    """The peer's torch dtype: the engine's --dtype if 16-bit, else float32."""
    return {"bfloat16": "bfloat16", "half": "float16", "float16": "float16"}.get(
        args.dtype, "float32"
    )


def check_workload(args) -> None:
    """The workload flags: counts >= 1, each minimum at most its maximum (ValueError naming)."""
    counts = ("num_requests", "min_prompt", "min_output", "batch1_tokens", "peer_batch")
    counts += ("conversations", "turns", "system_tokens", "turn_tokens", "pool_prefixes")
    counts += ("concurrency", "lora_rank")
    if args.lora_adapters < 0:
        raise ValueError(f"lora_adapters must be at least 0, got {args.lora_adapters}")
    configs = args.configs.split(",")
    unknown = sorted(set(configs) - set(bench_conversations.CONFIGS))
    if unknown:
        raise ValueError(f"configs: unknown {unknown}; known: {bench_conversations.CONFIGS}")
    if "restart" in configs and "disk" not in configs and not args.kv_cache_dir:
        raise ValueError(
            "configs: restart reruns the disk configuration's directory; add disk, or give the "
            "--kv-cache-dir an earlier run filled"
        )
    if args.device_step_ms < 0:
        raise ValueError(f"device_step_ms must be at least 0, got {args.device_step_ms}")
    for flag in (*counts, "host_steps"):
        if getattr(args, flag) < 1:
            raise ValueError(f"{flag} must be at least 1, got {getattr(args, flag)}")
    pairs = [("min_prompt", "max_prompt"), ("min_output", "max_output")]
    if args.workload == "conversations":  # its answers are --max-output tokens each
        pairs = []
    for low, high in pairs:
        if getattr(args, low) > getattr(args, high):
            raise ValueError(f"{low} ({getattr(args, low)}) is more than {high}")


def run_host_overhead(args) -> int:
    """The host-overhead table (``--host-overhead``)."""
    loaded = load_model(args.model)
    steps, seed = args.host_steps, args.seed
    runs = [
        host_overhead.measure(loaded, b, steps=steps, split=True, stream=stream, seed=seed)
        for b in HOST_BATCHES
        for stream in (False, True)
    ]
    print(f"host ms per decode step (median of {steps}), stub forward, {args.model} tokenizer")
    print("outputs of 'final only': step(stream=False); 'every step': step()")
    print(host_overhead.format_table(runs))
    if args.device_step_ms > 0:
        print(f"\nms per decode step at batch 256, stub device step {args.device_step_ms:g} ms")
        print(overlap_table(loaded, args.device_step_ms / 1e3, steps, seed))
    return 0


def overlap_table(loaded, device_step_s: float, steps: int, seed: int) -> str:
    """Batch 256, a modelled device step: median ms per step (wall clock), async off and on."""
    rows = ["| outputs of | async off | async on |", "|---|---|---|"]
    for stream in (False, True):
        ms = [
            host_overhead.measure(
                loaded,
                256,
                steps=steps,
                stream=stream,
                seed=seed,
                device_step_s=device_step_s,
                async_scheduling=on,
            ).median_ms
            for on in (False, True)
        ]
        kind = "every step" if stream else "final only"
        rows.append(f"| {kind} | {ms[0]:.2f} | {ms[1]:.2f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.workload == "conversations":  # its tiers sit under the prefix cache
        args.enable_prefix_caching = True
    try:
        check_workload(args)
        check_engine_args(args)  # bad engine values and --model fail before the model loads
        if args.backend in ("cuda", "cuda-cpu") and args.workload != "conversations":
            raise ValueError(
                f"--backend {args.backend} is not timed here: this benchmark times the host "
                "backends' products (numpy, cpu); python -m engine.tools.bench_gpu times the "
                "device backends"
            )
        bench_plot.check_args(args)
        if args.host_overhead:
            return run_host_overhead(args)
        if args.workload == "conversations":
            return bench_conversations.run(args)
        engine = make_engine(args)
    except ValueError as e:
        return parser.fail(e)
    prompts, out_lens = workload(args, engine.model_config.vocab_size, engine.tokenizer)
    loras = random_loras(engine, args)
    run_engine(engine, [prompts[0][:16]], [4], loras=loras[:1])  # warm-up
    full_steps = time_full_decode_steps(engine, args.max_num_seqs)
    outputs, wall = run_engine(engine, prompts, out_lens, args.workload == "random", loras)
    stats = summarize(outputs, wall) | spec_stats(engine)
    b = engine.backend
    weights = b.quantization or b.kv_dtype
    what = f"{b.name}, weights {weights}, KV cache {b.cache_dtype}, {args.num_requests} requests"
    if loras:
        what += f" over {len(loras)} LoRA adapters of rank {args.lora_rank}"
    print(f"engine ({what}):")
    print(format_stats(stats))
    if loras:
        print(lora_memory_line(engine, len(loras)))
    itl = batch1_itl_ms(engine, prompts[0][:32], args.batch1_tokens)
    mean, p50, p99 = percentiles(itl)
    mm = matmul_only_ms(engine.backend, 1)
    itl_line = f"batch-1 ITL mean/p50/p99 {mean:.1f} / {p50:.1f} / {p99:.1f} ms"
    ratio = f"ITL p50 is {p50 / mm:.2f}x the matmul time"
    print(f"{itl_line}; matrix products alone {mm:.1f} ms per step -> {ratio}")
    batch_mm = matmul_only_ms(engine.backend, args.max_num_seqs, 3)
    print(f"matrix products alone at batch {args.max_num_seqs}: {batch_mm:.1f} ms per step")
    if full_steps.seconds:
        step = 1e3 * float(np.median(full_steps.seconds))
        print(
            f"decode steps of all {args.max_num_seqs} sequences: p50 {step:.1f} ms over "
            f"{len(full_steps.seconds)} steps -> {step / batch_mm:.2f}x the matmul time"
        )
    if full_steps.batch is not None:
        step, products, ratios = replayed_step_ratios(engine.backend, full_steps)
        print(
            f"the last such step replayed, alternated with the products alone ({len(ratios)} "
            f"rounds): step p50 {step:.3f} ms, products p50 {products:.3f} ms -> "
            f"{float(np.median(ratios)):.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f}x)"
        )
    bench_plot.run_extras(args, engine, run_engine, outputs, (prompts, out_lens), mm)
    if args.peer:
        try:
            peer = run_peer(args, prompts, out_lens)
        except ImportError as e:
            print(f"error: --peer transformers needs torch and transformers ({e})", file=sys.stderr)
            return 2
        ours = stats["output_tok_per_s"]
        peer_line = (
            f"peer transformers ({peer_dtype(args)}, static batches of {args.peer_batch}): "
            f"{peer:.1f}"
        )
        print(f"{peer_line} output tok/s; engine {ours:.1f} -> {ours / peer:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
