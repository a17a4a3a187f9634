"""KV memory of a model whose layers attend differently, with KV groups and without: counted by
driving the scheduler and block manager (no forward runs; the counts do not depend on it).

    python -m engine.tools.kv_groups_count [--layers 26] [--period 6] [--window 512]
        [--seqs 16] [--tokens 4096] [--block-size 16] [--chunk 2048]

The model is Gemma-3-shaped: ``--layers`` layers, each ``--period``-th global (full attention),
the others sliding with ``--window``. Its sequences have ``--tokens`` - 256 prompt tokens and
decode 256 more. Printed: the blocks held (in layer-blocks: blocks x the layers each holds) by
each sequence at the step that computes its last token, summed, with groups and with every
block kept, and their ratio;
then how many such sequences run at once without a preemption in a fixed pool, the bytes of
``--seqs`` sequences under full attention, with groups and without.
"""

from __future__ import annotations

import argparse
import logging
import random

from engine.backends.kv_groups import KVGroups, layer_groups
from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence
from engine.utils import cdiv

DECODE = 256  # tokens each sequence decodes after its prompt


def drive(groups: KVGroups, num_blocks: int, n: int, args) -> tuple[list[int], bool]:
    """n sequences of args.tokens tokens through a scheduler over num_blocks blocks of
    groups.num_slots layers, each finished once its last token is computed: (the blocks each
    held at the step that computed its last token, whether all n ran at once with no
    preemption)."""
    cfg = EngineConfig(
        model="gemma3-shaped",
        block_size=args.block_size,
        max_model_len=args.tokens + 1,
        max_num_seqs=n,
        max_num_batched_tokens=args.chunk,
        enable_chunked_prefill=True,
    )
    bm = BlockManager(num_blocks, args.block_size, windows=groups.windows)
    sched, rng = Scheduler(cfg, bm), random.Random(0)
    prompt = [rng.randrange(1, 32000) for _ in range(args.tokens - DECODE)]
    seqs = [Sequence(str(i), prompt) for i in range(n)]
    for seq in seqs:
        sched.add(seq)
    held, together = [], 0
    while sched.has_unfinished():
        out = sched.schedule()
        together = max(together, len(sched.running))
        held += [
            bm.held_blocks(s) for s, k in out.scheduled if s.num_computed_tokens + k == args.tokens
        ]
        sched.update(out, {s.seq_id: 1 for s, _ in out.scheduled})
        for seq in [s for s in sched.running if s.num_computed_tokens >= args.tokens]:
            sched.finish(seq, "length")
    return held, together == n and sched.num_preemptions == 0


def most_that_fit(groups: KVGroups, num_blocks: int, args) -> int:
    """The most sequences that run together to args.tokens tokens without a preemption."""
    n = 1
    while drive(groups, num_blocks, n + 1, args)[1]:
        n += 1
    return n


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=26, help="layers of the model")
    p.add_argument("--period", type=int, default=6, help="every period-th layer is global")
    p.add_argument("--window", type=int, default=512, help="the sliding layers' window")
    p.add_argument("--seqs", type=int, default=16, help="sequences run together")
    p.add_argument("--tokens", type=int, default=4096, help="tokens of each sequence")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block")
    p.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens per step")
    args = p.parse_args(argv)
    logging.getLogger("engine.scheduler").setLevel(logging.ERROR)  # the preemptions' lines
    windows = [0 if i % args.period == args.period - 1 else args.window for i in range(args.layers)]
    grouped, plain = layer_groups(windows, enabled=True), layer_groups(windows, enabled=False)
    full = cdiv(args.tokens, args.block_size) * args.seqs  # blocks of every layer
    held = sum(drive(grouped, full * args.layers, args.seqs, args)[0]) * grouped.num_slots
    kept = sum(drive(plain, full, args.seqs, args)[0]) * args.layers
    print(grouped.describe())
    print(
        f"{args.seqs} sequences of {args.tokens} tokens, each at its last token: {held} "
        f"layer-blocks held with groups, {kept} with every block kept: {held / kept:.3f}x"
    )
    pool = full * args.layers  # layer-blocks: the bytes of args.seqs full-attention sequences
    fit_plain = most_that_fit(plain, pool // args.layers, args)
    fit = most_that_fit(grouped, pool // grouped.num_slots, args)
    print(
        f"a pool of {pool} layer-blocks ({args.seqs} full-attention sequences' bytes) runs "
        f"{fit_plain} sequences of {args.tokens} tokens at once without groups, {fit} with"
    )


if __name__ == "__main__":
    main()
