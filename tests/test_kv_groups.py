"""KV cache groups: a model whose layers attend differently (Gemma 2, Gemma 3, Qwen2 with
max_window_layers) keeps a page table per group, and each sliding group gives back the blocks
its window no longer sees.

The block accounting is checked after every step of a scripted run against what positions and
windows say, written out here; the grouped engine's tokens and logits against transformers'
golden data (blocks given back are NaN between steps, so a read of one would show) and against
the same model with grouping off.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine import SamplingParams
from engine.backends import kv_groups
from engine.backends.kv_groups import layer_groups
from engine.core.block_manager import NO_BLOCK
from engine.core.sequence import SequenceStatus
from engine.tools import kv_groups_count
from engine.utils import cdiv
from tests.test_families import check_outputs, golden, loaded
from tests.utils import make_engine, make_scheduler, make_seq

BS = 4
WINDOWS = (0, 8, 8, 12)  # a full group, two sliding groups of window 8, one of window 12
CHUNK = 12  # prefill tokens per step: chunks straddle the windows and the blocks


# -- the groups of a model ----------------------------------------------------------------------


def test_gemma2_groups_are_half_and_half():
    windows = [4096 if i % 2 == 0 else 0 for i in range(8)]  # sliding, global, ...
    g = layer_groups(windows, enabled=True)
    assert g.windows == (0, 4096) and g.num_slots == 4
    assert g.layers == ((1, 3, 5, 7), (0, 2, 4, 6))
    assert [g.layer_group[i] for i in range(8)] == [1, 0] * 4
    assert [g.layer_slot[i] for i in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_gemma3_groups_pad_the_last_sliding_group():
    windows = [0 if i % 6 == 5 else 512 for i in range(26)]  # five sliding per global
    g = layer_groups(windows, enabled=True)
    assert g.num_slots == 4 and g.windows == (0,) + (512,) * 6
    assert g.layers[0] == (5, 11, 17, 23)
    sliding = [i for i in range(26) if i % 6 != 5]
    assert [len(ls) for ls in g.layers[1:]] == [4, 4, 4, 4, 4, 2]  # the last one padded
    assert [i for ls in g.layers[1:] for i in ls] == sliding
    assert "7 KV groups of 4 slots" in g.describe()


def test_one_kind_is_one_group_and_grouping_off_keeps_every_block():
    assert layer_groups([8, 8, 8], enabled=True) == layer_groups([8, 8, 8], enabled=False)
    one = layer_groups([8, 8, 8], enabled=True)
    assert one.windows == (8,) and one.num_slots == 3 and not one.grouped
    off = layer_groups([0, 8, 8], enabled=False)
    assert off.windows == (0,) and off.layers == ((0, 1, 2),)


# -- exact block accounting of a scripted run -----------------------------------------------


def visible_entries(c: int, n: int, window: int) -> list[int]:
    """The table entries a sequence with c computed tokens and n scheduled holds in a group:
    from the block of the first key a query at c sees (window > 0) to the step's last token."""
    first = max(0, c - window + 1) // BS if window else 0
    return list(range(first, cdiv(c + n, BS)))


def check_step(sched, out, history: dict) -> None:
    """After schedule(): every running sequence's group tables hold exactly the entries
    ``visible_entries`` names (NO_BLOCK elsewhere); waiting ones hold nothing; the free
    blocks are the pool less the blocks held. Records which block each entry held."""
    bm, n_of = sched.block_manager, {s.seq_id: n for s, n in out.scheduled}
    held = set()
    for seq in sched.running:
        c, n = seq.num_computed_tokens, n_of.get(seq.seq_id, 0)
        tables = bm.tables(seq)
        assert len(tables) == len(WINDOWS)
        for g, (table, w) in enumerate(zip(tables, WINDOWS, strict=True)):
            entries = [i for i, b in enumerate(table) if b != NO_BLOCK]
            assert entries == visible_entries(c, n, w), (seq, g, c, n, table)
            assert len(table) == cdiv(c + n, BS)
            held.update(table[i] for i in entries)
            for i in entries:
                history.setdefault((seq.seq_id, g, i), table[i])
    for seq in sched.waiting:
        assert bm.held_blocks(seq) == 0
    assert bm.num_free_blocks == bm.num_blocks - len(held)


def run(sched, seqs: dict, targets: dict, history: dict, rng) -> None:
    """Steps until every sequence in ``seqs`` has ``targets[id]`` output tokens; each step
    checked (``check_step``) and the invariants kept."""
    while any(not s.is_finished for s in seqs.values()):
        out = sched.schedule()
        check_step(sched, out, history)
        sched.check_invariants()
        sched.update(out, {s.seq_id: rng.randrange(1, 32000) for s, _ in out.scheduled})
        sched.check_invariants()
        for seq in list(sched.running):
            if seq.num_output_tokens >= targets[seq.seq_id]:
                sched.finish(seq, "length")


def test_scripted_run_holds_exactly_each_windows_blocks():
    """Two sequences in chunks of 12 tokens over 4-token blocks, decoding across several
    windows, in a pool too small for both (one is preempted and recomputed); then a prompt
    that extends a finished one takes a prefix longer than any window from the cache: the
    full group's blocks all, each sliding group's only those of its window."""
    rng = random.Random(7)
    sched = make_scheduler(
        num_blocks=48,
        block_size=BS,
        max_model_len=128,
        windows=WINDOWS,
        enable_chunked_prefill=True,
        max_num_batched_tokens=CHUNK,
        enable_prefix_caching=True,
    )
    bm, history = sched.block_manager, {}
    a, b = make_seq(30 + rng.randrange(3)), make_seq(22 + rng.randrange(3))
    for seq in (a, b):
        sched.add(seq)
    run(sched, {a.seq_id: a, b.seq_id: b}, {a.seq_id: 40, b.seq_id: 40}, history, rng)
    assert sched.num_preemptions > 0  # the full group outgrew the pool
    assert bm.num_free_blocks == bm.num_blocks

    d = make_seq(50 + rng.randrange(3))
    sched.add(d)
    run(sched, {d.seq_id: d}, {d.seq_id: 2}, history, rng)
    e = make_seq(list(d.token_ids) + [rng.randrange(1, 32000) for _ in range(6)])
    sched.add(e)
    out = sched.schedule()
    check_step(sched, out, history)
    assert [s for s, _ in out.prefix_hits] == [e]
    k = e.num_computed_tokens // BS  # blocks taken from the cache
    assert k * BS > max(WINDOWS)  # the hit is longer than every window
    for g, (table, w) in enumerate(zip(bm.tables(e), WINDOWS, strict=True)):
        first = max(0, k * BS - w + 1) // BS if w else 0
        assert table[:first] == [NO_BLOCK] * first
        assert table[first:k] == [history[(d.seq_id, g, i)] for i in range(first, k)]
    sched.update(out, {e.seq_id: 1})
    sched.finish(e, "abort")
    sched.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


def test_abort_mid_prefill_and_swap_give_every_block_back():
    """Swap preemption moves every group's blocks to the CPU pool and back; an abort while
    another sequence is mid-prefill leaves nothing behind."""
    rng = random.Random(11)
    sched = make_scheduler(
        num_blocks=40,
        block_size=BS,
        num_cpu_blocks=64,
        max_model_len=128,
        windows=WINDOWS,
        enable_chunked_prefill=True,
        max_num_batched_tokens=CHUNK,
        preemption_mode="swap",
    )
    bm, history = sched.block_manager, {}
    seqs = [make_seq(26 + rng.randrange(5)) for _ in range(3)]
    for seq in seqs:
        sched.add(seq)
    swapped = False
    for _ in range(200):
        out = sched.schedule()
        check_step(sched, out, history)
        swapped |= bool(out.blocks_to_swap_out)
        for seq in sched.swapped:  # its CPU tables mirror the GPU ones it had
            assert len({len(t) for t in bm.cpu_tables(seq)}) == 1
        sched.update(out, {s.seq_id: rng.randrange(1, 32000) for s, _ in out.scheduled})
        sched.check_invariants()
        if all(s.num_output_tokens >= 30 for s in seqs[:2]):
            break
    assert swapped, "the pool never ran short"
    for seq in seqs:
        sched.abort(seq.request_id)
    sched.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks and bm.num_free_cpu_blocks == bm.num_cpu_blocks
    assert all(s.status == SequenceStatus.FINISHED for s in seqs)


# -- the engine: grouped models against golden data and against grouping off ------------------

CHUNKED = dict(enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=3)


def drive(name: str, backend: str, prompts, params, poison: bool = True, **args):
    """Every prompt to the end, invariants checked and every unheld, uncached block NaN after
    each step; -> (outputs in prompt order, engine, the most blocks the pool held at once)."""
    engine = make_engine(loaded(name), backend=backend, block_size=BS, record_logits=True, **args)
    bm = engine.block_manager
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done, peak = {}, 0
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step(stream=False)})
        engine.check_invariants()
        peak = max(peak, bm.num_blocks - bm.num_free_blocks)
        free = sorted(b for b in bm.free_blocks if b not in bm.block_hash)
        if poison and free:
            data = np.ascontiguousarray(engine.backend.read_blocks(free))
            data.view(np.uint8)[...] = 0xFF  # NaN in any float format
            engine.backend.write_blocks(free, data)
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    return [done[str(i)] for i in range(len(prompts))], engine, peak


def drive_golden(name: str, backend: str, **args):
    """The family's golden prompts to the end through ``drive`` (greedy, the golden number of
    tokens); -> (engine, outputs), the outputs held to transformers' tokens and logits."""
    cases = golden(name)["cases"]
    n = len(cases[0]["token_ids"])
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    prompts = [c["prompt_token_ids"] for c in cases]
    outs, engine, _ = drive(name, backend, prompts, params, **args)
    check_outputs(name, cases, outs)
    return engine, outs


@pytest.mark.parametrize("backend", ["numpy", "cpu", "cuda-cpu", "cuda-cpu-graphs"])
@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_grouped_engine_matches_transformers(name, backend):
    """Chunks of 16 tokens over 4-token blocks, a pool that makes the sliding groups give
    back blocks: transformers' tokens and logits, though every free block is NaN (cuda-cpu:
    eager, and with its decode steps through the captured graphs)."""
    args = dict(CHUNKED, enforce_eager=backend == "cuda-cpu")
    engine, _ = drive_golden(name, backend.removesuffix("-graphs"), **args)
    assert engine.block_manager.num_groups > 1 and engine.runner.kv_groups is not None
    if backend == "cuda-cpu-graphs":
        assert engine.backend.graphs, "no decode graphs were captured"


@pytest.mark.parametrize("name", ["gemma3", "qwen2_swa"])
def test_grouped_greedy_equals_grouping_off(name, monkeypatch):
    """Random prompts several windows long, with prefix caching: the same greedy tokens and
    logits as the same engine with one group of every layer, in fewer blocks."""
    rng = np.random.default_rng()
    vocab = loaded(name).config.vocab_size
    base = rng.integers(1, vocab, 60).tolist()
    prompts = [base + rng.integers(1, vocab, int(n)).tolist() for n in rng.integers(20, 50, 3)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    args = dict(CHUNKED, enable_prefix_caching=True, num_gpu_blocks=128)
    grouped, engine, peak = drive(name, "numpy", prompts, params, **args)
    assert engine.block_manager.num_groups > 1
    monkeypatch.setattr(kv_groups, "GROUPING", False)
    plain, engine, plain_peak = drive(name, "numpy", prompts, params, poison=False, **args)
    assert engine.block_manager.num_groups == 1
    slots, layers = grouped_slots(name), loaded(name).config.num_hidden_layers
    assert peak * slots < plain_peak * layers  # fewer bytes held at the peak
    for a, b in zip(grouped, plain, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        np.testing.assert_allclose(
            np.stack(a.outputs[0].step_logits), np.stack(b.outputs[0].step_logits), atol=1e-4
        )


def grouped_slots(name: str) -> int:
    return kv_groups.model_groups(loaded(name).config, enabled=True).num_slots


def test_single_window_model_is_one_group_as_before():
    """Mistral (window 8 on every layer): one group, one slot per layer, the window's blocks."""
    engine = make_engine(loaded("mistral"), backend="numpy", block_size=BS)
    bm, c = engine.block_manager, loaded("mistral").config
    assert bm.num_groups == 1 and bm.window == 8 and bm.windows == (8,)
    assert engine.backend.kv_cache.shape[0] == c.num_hidden_layers
    assert engine.runner.kv_groups is None and engine.backend.kv_groups is None


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize(
    "name, blocks, backend",
    [("gemma3", 18, "numpy"), ("gpt_oss", 16, "numpy"), ("gpt_oss", 16, "cuda-cpu")],
)
def test_grouped_preemption_matches_transformers(name, blocks, backend, mode):
    """A pool too small for three Gemma 3 (gpt-oss) sequences at once: one is preempted (its
    groups' blocks dropped, or swapped out and back), and the tokens and logits stay
    transformers' (gpt-oss on the GPU backend too: its sinks and expert kernels)."""
    args = dict(CHUNKED, num_gpu_blocks=blocks, max_model_len=96, preemption_mode=mode)
    engine, _ = drive_golden(name, backend, **args)
    assert engine.scheduler.num_preemptions > 0


def test_count_tool_holds_the_full_blocks_and_each_window():
    """engine/tools/kv_groups_count.py's drive (docs/benchmarks.md's count), small: at its
    last token a sequence of T tokens holds every block in the full group and, in each
    sliding group, those from the block of position T - W on; without groups every block."""
    T, W, layers, n = 160, 24, 8, 3
    args = type("Args", (), dict(tokens=T + kv_groups_count.DECODE, block_size=BS, chunk=32))
    T = args.tokens
    windows = [0 if i % 4 == 3 else W for i in range(layers)]
    grouped, plain = layer_groups(windows, enabled=True), layer_groups(windows, enabled=False)
    full = cdiv(T, BS)
    sliding = full - (T - W) // BS  # blocks (T - W) // BS .. full - 1
    held, fit = kv_groups_count.drive(grouped, 10 * full * 4, n, args)
    assert fit and held == [full + 3 * sliding] * n  # one full group, three sliding of 2 layers
    held, fit = kv_groups_count.drive(plain, n * full, n, args)
    assert fit and held == [full] * n
    assert not kv_groups_count.drive(plain, (n - 1) * full, n, args)[1]  # one waits


def test_fused_cpu_decode_reads_each_groups_tables(monkeypatch):
    """Qwen2 with window 8 on layers 1 and 2 (SiLU, no sandwich norms): its decode steps run
    cpu_src/decode_layers.cpp, each layer through its group's slots and tables; transformers'
    tokens and logits, though every free block is NaN."""
    from engine.backends.cpu_backend import CpuBackend

    fused = []
    run = CpuBackend._decode_layers

    def counted(self, x, b):
        fused.append(len(b.group_tables))
        return run(self, x, b)

    monkeypatch.setattr(CpuBackend, "_decode_layers", counted)
    cases = golden("qwen2_swa")["cases"]
    n = len(cases[0]["token_ids"])
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    prompts = [c["prompt_token_ids"] for c in cases]
    outs, engine, _ = drive("qwen2_swa", "cpu", prompts, params, **CHUNKED)
    assert engine.block_manager.windows == (0, 8, 8)  # one layer a group
    assert fused and set(fused) == {2}  # fused steps, each with both sliding groups
    check_outputs("qwen2_swa", cases, outs)
