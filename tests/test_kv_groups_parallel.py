"""KV groups on several ranks: every tensor-parallel rank runs the engine's groups, a pipeline
stage the groups of its layers (re-based slots, ``KVGroups.stage``); whole blocks for the KV
tiers are gathered from the stages' slots and cut back into them. Engines of 2 TP ranks, 2 PP
stages and 2 x 2 (worker processes, numpy ranks) against the single process: the same greedy
tokens and logits, the same blocks held (the sliding groups give theirs back), and tier hits
that load the pool's own bytes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine import SamplingParams
from engine.backends.kv_groups import layer_groups
from engine.executor.sharding import cut_slots, gather_slots
from tests.test_families import loaded
from tests.utils import make_engine

BS = 4
GEMMA3_26 = [0 if i % 6 == 5 else 512 for i in range(26)]  # five sliding per global


def test_a_stage_holds_its_layers_groups_in_re_based_slots():
    g = layer_groups(GEMMA3_26, enabled=True)  # 7 groups of 4 slots
    first, second = g.stage(range(0, 13)), g.stage(range(13, 26))
    assert first.windows == second.windows == g.windows
    assert first.layers == ((5, 11), (0, 1, 2, 3), (4, 6, 7, 8), (9, 10, 12), (), (), ())
    assert second.layers[0] == (4, 10) and second.layers[3] == (0,)  # layers 17, 23; 13
    assert second.layers[4:] == ((1, 2, 3, 5), (6, 7, 8, 9), (11, 12))  # 14-16, 18 ...
    assert first.num_slots == second.num_slots == 4
    assert [first.layer_slot[i] for i in (9, 10, 12)] == [0, 1, 2]
    assert g.stage_slots(range(13, 26), 3) == [(0, 3)]  # layer 13: the group's fourth slot
    gpt_oss = layer_groups([128, 0] * 12, enabled=True)  # two groups of 12: a stage needs 6
    assert gpt_oss.num_slots == 12 and gpt_oss.stage(range(0, 12)).num_slots == 6


@pytest.mark.parametrize("cuts", [(0, 13, 26), (0, 5, 17, 26), (0, 26)])
def test_stage_cuts_of_grouped_blocks_gather_back_whole(cuts):
    """Random whole blocks of random groups, cut into each stage's slots and gathered: every
    slot a layer of the block's group uses comes back (padded slots are zero)."""
    g = layer_groups(GEMMA3_26, enabled=True)
    rng = np.random.default_rng()
    n = 9
    whole = rng.standard_normal((g.num_slots, 2, n, BS, 2, 8)).astype(np.float32)
    groups = rng.integers(0, g.num_groups, n)
    stages = [range(a, b) for a, b in zip(cuts, cuts[1:], strict=False)]
    parts = [(s, cut_slots(g, s, whole, groups)) for s in stages]
    for s, part in parts:
        assert part.shape[0] == g.stage(s).num_slots
    got = gather_slots(g, parts, groups)
    for i, grp in enumerate(groups.tolist()):
        used = len(g.layers[grp])
        np.testing.assert_array_equal(got[:used, :, i], whole[:used, :, i])
        assert not got[used:, :, i].any()
    for s, part in parts:  # a stage's slot j of group grp: that group's layer there
        i = int(np.flatnonzero(groups == groups[0])[0])
        for j, slot in g.stage_slots(s, int(groups[0])):
            np.testing.assert_array_equal(part[j, :, i], whole[slot, :, i])


def gemma2_8():
    """Gemma 2's tiny model with 8 layers (its 2 repeated: sliding, global, ...): 2 groups of
    4 slots, so a pipeline stage holds 2 slots of each."""
    m = loaded("gemma2")
    c, w = m.config, m.weights
    windows = tuple(c.layer_windows[i % 2] for i in range(8))
    config = dataclasses.replace(c, num_hidden_layers=8, layer_windows=windows)
    weights = dataclasses.replace(w, layers=[w.layers[i % 2] for i in range(8)])
    return dataclasses.replace(m, config=config, weights=weights, source="gemma2 x 8 layers")


MODELS = {"gemma3": lambda: loaded("gemma3"), "gpt_oss": lambda: loaded("gpt_oss")}
MODELS["gemma2_8"] = gemma2_8
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
ARGS = dict(
    backend="numpy",
    block_size=BS,
    max_num_seqs=3,
    max_model_len=96,
    enable_chunked_prefill=True,
    max_num_batched_tokens=16,
    record_logits=True,
)


def run(model, prompts, **kw):
    """Every prompt to the end (all at once, or one at a time with ``one_by_one``); -> (engine,
    outputs in prompt order, the most blocks the pool held at once)."""
    one_by_one = kw.pop("one_by_one", False)
    engine = make_engine(model, **{**ARGS, **kw})
    bm, done, peak = engine.core.block_manager, {}, 0
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, PARAMS)
        while engine.has_unfinished_requests() and (one_by_one or i == len(prompts) - 1):
            done.update({o.request_id: o for o in engine.step(stream=False)})
            engine.check_invariants()
            peak = max(peak, bm.num_blocks - bm.num_free_blocks)
    return engine, [done[str(i)] for i in range(len(prompts))], peak


def same_outputs(a, b, exact: bool) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        lx, ly = np.stack(x.outputs[0].step_logits), np.stack(y.outputs[0].step_logits)
        if exact:
            assert lx.tobytes() == ly.tobytes()
        else:
            np.testing.assert_allclose(lx, ly, atol=1e-4)


@pytest.mark.parametrize(
    "name, tp, pp, backend",
    [
        ("gemma3", 2, 1, "numpy"),
        ("gemma3", 1, 2, "numpy"),
        ("gpt_oss", 2, 1, "numpy"),
        ("gemma2_8", 1, 2, "numpy"),
        ("gemma2_8", 2, 2, "numpy"),
        ("gemma3", 2, 1, "cuda-cpu"),
    ],
)
def test_grouped_ranks_equal_one_process(name, tp, pp, backend):
    """Prompts several windows long in chunks over a small pool: the single process's tokens
    and logits (a pipeline alone adds nothing up: bit for bit), the same blocks held at the
    peak, fewer than every layer's blocks (numpy ranks; cuda-cpu ranks, tensor parallel)."""
    model = MODELS[name]()
    rng, c = np.random.default_rng(), model.config
    prompts = [rng.integers(1, c.vocab_size, int(n)).tolist() for n in rng.integers(30, 62, 3)]
    _, one, one_peak = run(model, prompts, num_gpu_blocks=64, backend=backend)
    kw = dict(tensor_parallel_size=tp, pipeline_parallel_size=pp, backend=backend)
    engine, par, peak = run(
        model, prompts, num_gpu_blocks=64, distributed_executor_backend="mp", **kw
    )
    try:
        bm = engine.core.block_manager
        assert bm.num_groups > 1 and engine.core.backend.kv_groups is not None
        same_outputs(par, one, exact=tp == 1)
        assert peak == one_peak
        slots = engine.core.backend.kv_groups.num_slots
        full = sum(-(-(len(p) + PARAMS.max_tokens) // BS) for p in prompts)  # every block
        assert peak * slots < full * c.num_hidden_layers
    finally:
        engine.shutdown()


@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2)])
def test_tier_hits_on_grouped_stages_load_the_pools_bytes(tp, pp, tmp_path):
    """A small pool over the host and disk tiers, on 2 stages (of 1 or 2 ranks): prefixes
    evicted and loaded back (gathered from the stages' slots and cut into them again) give
    the logits of the single process's own pool hits."""
    model = gemma2_8()
    rng, vocab = np.random.default_rng(), model.config.vocab_size
    base, other = rng.integers(1, vocab, 60).tolist(), rng.integers(1, vocab, 70).tolist()
    prompts = [base + [7, 8, 9], other, base + rng.integers(1, vocab, 11).tolist()]
    kw = dict(max_num_seqs=1, one_by_one=True, enable_prefix_caching=True)
    _, pool, _ = run(model, prompts, num_gpu_blocks=400, **kw)
    tiers = dict(kv_offload_bytes=1 << 24, kv_cache_dir=str(tmp_path))
    par = dict(
        tensor_parallel_size=tp, pipeline_parallel_size=pp, distributed_executor_backend="mp"
    )
    engine, outs, _ = run(model, prompts, num_gpu_blocks=18, **kw, **tiers, **par)
    try:
        assert [o.num_cached_tokens for o in outs] == [o.num_cached_tokens for o in pool]
        assert engine.scheduler.tier_hits == outs[2].num_cached_tokens >= 60
        same_outputs(outs, pool, exact=tp == 1)
    finally:
        engine.shutdown()
