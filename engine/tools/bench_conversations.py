"""``python -m engine.bench --workload conversations``: long-prefix conversations on a pool too
small for them, with the KV tiers off, in host memory and on disk, side by side (not a test).

Each of ``--conversations`` conversations has a system prompt of its own (``--system-tokens``
random token ids) and ``--turns`` turns; a turn adds a user message (``--turn-tokens`` ids) to
the conversation so far (the system prompt, the earlier messages and the model's answers) and
asks for ``--max-output`` tokens (greedy, ignore_eos). Round r runs turn r of every
conversation in turn, ``--concurrency`` requests at a time, so each conversation comes back
after all the others: the pool (``--pool-prefixes`` conversations' worth of blocks unless
``--num-gpu-blocks`` says) has long evicted its prefix by then. Each configuration runs the
whole workload on a fresh engine over the model loaded once:

- ``off``: prefix caching alone;
- ``host``: a host-memory tier (``--kv-offload-bytes``, by default room for every conversation);
- ``disk``: a disk tier alone (``--kv-cache-dir``, by default a temporary directory);
- ``restart``: after ``disk``, its engine shut down and a new one started on the same directory,
  the first round again (the cold first round of ``disk`` is the reference); alone, with a
  ``--kv-cache-dir`` that an earlier process's ``disk`` run filled, a restart across processes.

Prints each configuration's mean and p50 TTFT (and the mean of turns 2 and later, the ones a
tier can serve: a conversation's first turn is new to every tier), output tokens/s and the
prompt tokens the tiers served, then the ratios.
"""

from __future__ import annotations

import tempfile
import time

import numpy as np

from engine.entrypoints.engine_args import engine_kwargs
from engine.frontend.llm import run_to_completion
from engine.frontend.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.utils import cdiv
from model_loader.load import load_model

CONFIGS = ("off", "host", "disk", "restart")


def add_args(p) -> None:
    g = p.add_argument_group("--workload conversations")
    g.add_argument("--conversations", type=int, default=32, help="conversations (default 32)")
    g.add_argument("--turns", type=int, default=4, help="turns of each (default 4)")
    g.add_argument(
        "--system-tokens", type=int, default=1500, help="system prompt tokens (default 1500)"
    )
    g.add_argument(
        "--turn-tokens", type=int, default=32, help="user message tokens a turn (default 32)"
    )
    g.add_argument(
        "--pool-prefixes",
        type=int,
        default=4,
        help="conversations the pool holds, when --num-gpu-blocks is not given (default 4)",
    )
    g.add_argument("--concurrency", type=int, default=1, help="requests run at once (default 1)")
    g.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated, of {', '.join(CONFIGS)} (default all; restart needs disk)",
    )


class Conversation:
    """Token ids so far: the system prompt, then each turn's message and answer."""

    def __init__(self, rng: np.random.Generator, args, vocab: int):
        self.rng, self.vocab, self.turn_tokens = rng, vocab, args.turn_tokens
        self.ids = self._random(args.system_tokens)

    def _random(self, n: int) -> list[int]:
        return self.rng.integers(100, self.vocab - 100, n).tolist()

    def ask(self) -> list[int]:
        """The next turn's prompt: the conversation with a new user message."""
        self.ids = self.ids + self._random(self.turn_tokens)
        return list(self.ids)

    def answer(self, token_ids: list[int]) -> None:
        self.ids = self.ids + list(token_ids)


def sizes(args, model_config) -> tuple[int, int, int]:
    """(max_model_len, pool blocks, bytes of every conversation's KV at its longest)."""
    longest = args.system_tokens + args.turns * (args.turn_tokens + args.max_output)
    bs = args.block_size or 16
    blocks = args.num_gpu_blocks or args.pool_prefixes * cdiv(longest, bs) + args.concurrency
    per_token = model_config.kv_bytes_per_token("float32")
    return longest + bs, blocks, args.conversations * longest * per_token


def run_rounds(engine: LLMEngine, args, rounds: int, seed: int) -> dict:
    """``rounds`` rounds of the workload: TTFTs, output tokens and wall time."""
    rng = np.random.default_rng(seed)
    convs = [
        Conversation(rng, args, engine.model_config.vocab_size) for _ in range(args.conversations)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_output, ignore_eos=True)
    ttfts, tokens, t0 = [], 0, time.perf_counter()
    for _ in range(rounds):
        for s in range(0, len(convs), args.concurrency):
            group = convs[s : s + args.concurrency]
            outs = run_to_completion(engine, [c.ask() for c in group], params)
            for c, o in zip(group, outs, strict=True):
                c.answer(o.outputs[0].token_ids)
                ttfts.append(o.metrics.ttft)
                tokens += len(o.outputs[0].token_ids)
    wall = time.perf_counter() - t0
    return dict(ttft=ttfts, tokens=tokens, wall=wall, served=engine.core_stats().tier_hits)


def run(args) -> int:
    loaded = load_model(args.model)
    max_len, blocks, all_kv = sizes(args, loaded.config)
    kw = engine_kwargs(args) | dict(enable_prefix_caching=True, num_gpu_blocks=blocks)
    kw.setdefault("max_model_len", max_len)
    for k in ("kv_offload_bytes", "kv_cache_dir", "kv_disk_bytes", "model"):
        kw.pop(k, None)
    host = dict(kv_offload_bytes=args.kv_offload_bytes or int(1.25 * all_kv))
    folder = args.kv_cache_dir or tempfile.mkdtemp(prefix="kv-tier-")
    disk = dict(kv_cache_dir=folder, kv_disk_bytes=args.kv_disk_bytes or int(1.25 * all_kv) + 1)
    configs = args.configs.split(",")
    print(
        f"{args.conversations} conversations x {args.turns} turns: system prompts of "
        f"{args.system_tokens} tokens, {args.turn_tokens}-token messages, {args.max_output}-token "
        f"answers; pool {blocks} blocks, concurrency {args.concurrency}; disk tier in {folder}"
    )
    rows = {}
    for name in configs:
        tiers = {"off": {}, "host": host, "disk": disk, "restart": disk}[name]
        engine = LLMEngine(loaded=loaded, **kw, **tiers)
        rounds = 1 if name == "restart" else args.turns
        rows[name] = run_rounds(engine, args, rounds, args.seed)
        engine.shutdown()
        print(row_line(name, rows[name], args.conversations), flush=True)
    print(ratios(rows, args.conversations))
    return 0


def row_line(name: str, r: dict, n: int) -> str:
    t = np.asarray(r["ttft"]) * 1e3
    later = f"turns 2+ {t[n:].mean():9.1f} ms  " if len(t) > n else ""
    return (
        f"{name:8s} TTFT mean {t.mean():9.1f} ms  p50 {np.median(t):9.1f} ms  turn 1 "
        f"{t[:n].mean():9.1f} ms  {later}output "
        f"{r['tokens'] / r['wall']:7.2f} tok/s  prompt tokens from the tiers {r['served']}  "
        f"wall {r['wall']:.1f} s"
    )


def ratios(rows: dict, n: int) -> str:
    """Mean TTFT of tiers off over each tier's; restart against the cold first round."""
    lines = []
    mean = {k: float(np.mean(r["ttft"])) for k, r in rows.items()}
    later = {k: float(np.mean(r["ttft"][n:] or [np.nan])) for k, r in rows.items()}
    tput = {k: r["tokens"] / r["wall"] for k, r in rows.items()}
    for k in ("host", "disk"):
        if "off" in rows and k in rows:
            lines.append(
                f"{k}: mean TTFT {mean['off'] / mean[k]:.1f}x lower than off (turns 2+: "
                f"{later['off'] / later[k]:.1f}x), output throughput {tput[k] / tput['off']:.2f}x"
            )
    if "restart" in rows and "disk" in rows:
        cold = float(np.mean(rows["disk"]["ttft"][:n]))
        lines.append(
            f"restart: first round's mean TTFT {cold / mean['restart']:.1f}x lower than cold"
        )
    return "\n".join(lines)
