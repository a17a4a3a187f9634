"""KV groups under the KV tiers: each group's evicted blocks are stored under (group, hash), a
later prompt loads every block of a full-attention group and only the window's blocks of a
sliding one, and a prefix past the pool hits may take one group's blocks from the pool and
another's from a tier (exact block ids and bytes, in the scheduler); a grouped engine whose
prefixes are evicted from the pool and served from the host or the disk tier gives the tokens
of the same model with grouping off and, bit for bit, the logits of its own pool hits; the disk
tier keeps a grouped layout's files apart from another layout's, and refuses a group's file in
another's place."""

from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest

from engine import SamplingParams
from engine.backends import kv_groups
from engine.core.block_manager import NO_BLOCK
from engine.core.window_blocks import first_visible_block
from engine.kv_offload.connector import KVConnector
from engine.kv_offload.disk_tier import DiskTier
from engine.kv_offload.host_tier import HostTier
from tests.test_families import loaded
from tests.test_kv_tiers import chain, key_of
from tests.utils import make_engine, make_scheduler, make_seq, scheduled_ids, step

BS = 4
SHAPE = (1, 2, BS, 1, 2)  # a block of a one-slot group: (G, 2, bs, Hkv, hd)


# ---- the scheduler: exact block ids ----


def test_each_groups_evicted_blocks_are_stored_and_a_window_loads_only_its_blocks():
    """Windows (0, 8): a 17-token prompt's 4 full blocks of each group are evicted (stored
    under their group), then the same prompt loads group 0's four and group 1's last two (the
    window of token 17 starts in block 2): the bytes of the very blocks stored, in order."""
    conn = KVConnector([HostTier(1 << 20)], SHAPE, np.float32)
    sched = make_scheduler(
        num_blocks=10, block_size=BS, windows=(0, 8), enable_prefix_caching=True, connector=conn
    )
    bm = sched.block_manager
    a = make_seq(17)
    sched.add(a)
    step(sched)  # a: 5 blocks a group, 4 full ones cached in each
    a_tables = bm.tables(a)
    sched.finish(a, "stop")
    b = make_seq(17)
    sched.add(b)
    out = step(sched)  # b takes all ten: a's eight cached blocks are evicted
    stored = {(g, h): blk for blk, h, _, g in out.blocks_to_store}
    want = {(g, a.block_hashes[i]): a_tables[g][i] for g in (0, 1) for i in range(4)}
    assert stored == want
    data = {k: np.full(SHAPE, blk + 100 * k[0], np.float32) for k, blk in stored.items()}
    conn.save([(h, key, data[g, h], g) for _, h, key, g in out.blocks_to_store])
    assert all(not conn.missing(h, g) for g, h in stored) and len(conn.tiers[0]) == 8
    sched.finish(b, "stop")
    again = make_seq(list(a.prompt_token_ids))
    sched.add(again)
    out = step(sched)
    assert scheduled_ids(out) == [(again.seq_id, 1)] and again.num_cached_tokens == 16
    loads = {g: (ids, [x.flat[0] for x in arrays]) for _, ids, arrays, g in out.tier_loads}
    assert loads[0][1] == [a_tables[0][i] for i in range(4)]
    assert loads[1][1] == [a_tables[1][i] + 100 for i in (2, 3)]  # the window's blocks only
    full, sliding = bm.tables(again)
    assert full[:4] == loads[0][0] and len(full) == 5
    assert sliding[:4] == [NO_BLOCK, NO_BLOCK, *loads[1][0]] and len(sliding) == 5
    assert conn.stats()[0].loads == 6
    sched.check_invariants()


def test_the_full_groups_pool_blocks_and_a_windows_tier_blocks_make_one_prefix():
    """Windows (0, 8): a's blocks are freed sliding group first, so a 9-token prompt evicts
    (and stores) that group's blocks 3, 2 and 1 while the full group keeps all four in the
    pool. a's prompt again: its pool prefix is 1 block (the window of block 2 needs 1 and 2 in
    the sliding group); past it, the full group takes its pool blocks 1-3 and the sliding group
    loads its window's 2 and 3 from the tier, NO_BLOCK before them."""
    conn = KVConnector([HostTier(1 << 20)], SHAPE, np.float32)
    sched = make_scheduler(
        num_blocks=12, block_size=BS, windows=(0, 8), enable_prefix_caching=True, connector=conn
    )
    bm = sched.block_manager
    a = make_seq(17)
    sched.add(a)
    step(sched)
    a_full, a_sliding = bm.tables(a)
    sched.finish(a, "stop")
    b = make_seq(9)
    sched.add(b)
    out = step(sched)  # 6 blocks: the 2 never used, then the sliding group's 4, 3, 2 and 1
    assert sorted((g, blk) for blk, _, _, g in out.blocks_to_store) == [
        (1, a_sliding[i]) for i in sorted((1, 2, 3), key=lambda i: a_sliding[i])
    ]
    conn.save(
        [(h, key, np.full(SHAPE, blk, np.float32), g) for blk, h, key, g in out.blocks_to_store]
    )
    sched.finish(b, "stop")
    again = make_seq(list(a.prompt_token_ids))
    sched.add(again)
    out = step(sched)
    assert out.prefix_hits == [(again, [a_full[0]])]  # the sliding group's block 0: not taken
    assert again.num_cached_tokens == 16 and (sched.prefix_cache_hits, sched.tier_hits) == (4, 12)
    [(seq, ids, arrays, group)] = out.tier_loads
    assert seq is again and group == 1 and [x.flat[0] for x in arrays] == a_sliding[2:4]
    full, sliding = bm.tables(again)
    assert full[:4] == a_full[:4] and sliding[:4] == [NO_BLOCK, NO_BLOCK, *ids]
    assert scheduled_ids(out) == [(again.seq_id, 1)]
    sched.check_invariants()


# ---- the engine: the same tokens, the pool's own bytes ----

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ARGS = dict(
    backend="numpy",
    block_size=BS,
    max_num_seqs=1,
    max_model_len=96,
    enable_chunked_prefill=True,
    max_num_batched_tokens=16,
    record_logits=True,
)


def prompts(name: str) -> list[list[int]]:
    """A 60-token prefix twice (a sliding window is 24 or 8 tokens), two other prompts between
    them that push the first out of a small pool, then the second of those again, longer."""
    rng, vocab = np.random.default_rng(), loaded(name).config.vocab_size
    base = rng.integers(1, vocab, 60).tolist()
    others = [rng.integers(1, vocab, 70).tolist() for _ in range(2)]
    extra = [rng.integers(1, vocab, n).tolist() for n in (9, 13, 3)]
    return [base + extra[0], *others, base + extra[1], others[0] + extra[2]]


def run(name: str, prompts, **kw):
    """One prompt at a time, to the end; every free, uncached block NaN after each step (a
    read of one shows). -> (engine, outputs, the most blocks the pool held at once)."""
    engine = make_engine(loaded(name), enable_prefix_caching=True, **ARGS, **kw)
    bm, outs, peak = engine.core.block_manager, [], 0
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, PARAMS)
        while engine.has_unfinished_requests():
            outs += engine.step(stream=False)
            engine.check_invariants()
            peak = max(peak, bm.num_blocks - bm.num_free_blocks)
            free = sorted(b for b in bm.free_blocks if b not in bm.block_hash)
            if free:
                data = np.ascontiguousarray(engine.core.backend.read_blocks(free))
                data.view(np.uint8)[...] = 0xFF  # NaN in any float format
                engine.core.backend.write_blocks(free, data)
    return engine, outs, peak


def window_loads(bm, cached_tokens: list[int]) -> int:
    """The blocks a prompt with ``c`` cached tokens loads when the tiers serve all of them: a
    full group's every block, a sliding group's from its window's first on."""
    bs = bm.block_size
    return sum(c // bs - first_visible_block(c, w, bs) for c in cached_tokens for w in bm.windows)


def logits(out) -> np.ndarray:
    return np.stack(out.outputs[0].step_logits)


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("name", ["gemma3", "gpt_oss"])
def test_tier_hits_of_a_grouped_model(name, tier, tmp_path, monkeypatch):
    """Its prefixes evicted from a small pool and served from a tier: the pool's own hits'
    logits bit for bit, grouping off's tokens and logits (float32 rounding), each sliding group
    loading its window's blocks alone, and fewer blocks held than grouping off."""
    ps = prompts(name)
    _, pool, _ = run(name, ps, num_gpu_blocks=400)
    tiers = dict(kv_offload_bytes=1 << 24) if tier == "host" else dict(kv_cache_dir=str(tmp_path))
    engine, outs, peak = run(name, ps, num_gpu_blocks=14, **tiers)
    bm, sched = engine.core.block_manager, engine.scheduler
    assert bm.num_groups > 1 and engine.core.connector is not None
    cached = [o.num_cached_tokens for o in outs]
    assert cached == [o.num_cached_tokens for o in pool] and cached[3] >= 60 and cached[4] >= 68
    assert sched.tier_hits == sum(cached)  # every hit from the tier: the pool had evicted them
    assert engine.core.connector.stats()[0].loads == window_loads(bm, cached)
    for a, b in zip(outs, pool, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert logits(a).tobytes() == logits(b).tobytes()
    monkeypatch.setattr(kv_groups, "GROUPING", False)
    plain_engine, plain, plain_peak = run(name, ps, num_gpu_blocks=400)
    assert plain_engine.core.block_manager.num_groups == 1
    for a, b in zip(outs, plain, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        np.testing.assert_allclose(logits(a), logits(b), atol=1e-4)
    slots = kv_groups.model_groups(loaded(name).config, enabled=True).num_slots
    assert peak * slots < plain_peak * loaded(name).config.num_hidden_layers
    engine.shutdown()


def test_a_restart_loads_each_group_from_disk_and_another_layout_loads_nothing(
    tmp_path, monkeypatch
):
    """The pool's blocks of every group are saved at shutdown; a restarted grouped engine
    serves the prompts from disk with the same tokens, the files of groups > 0 named apart and
    the key naming the groups; the same model with grouping off finds none of them."""
    ps = prompts("gemma3")
    first, outs, _ = run("gemma3", ps, num_gpu_blocks=14, kv_cache_dir=str(tmp_path))
    first.shutdown()
    [folder] = list(tmp_path.iterdir())
    assert list(folder.glob("*-g5.kvb")) and list(folder.glob("????????????????.kvb"))
    assert '"kv_groups": "1 slots|0:5;24:0;' in (folder / "key.json").read_text()
    again, outs2, _ = run("gemma3", ps[3:], num_gpu_blocks=14, kv_cache_dir=str(tmp_path))
    assert [o.num_cached_tokens for o in outs2] == [(len(p) - 1) // BS * BS for p in ps[3:]]
    assert [o.outputs[0].token_ids for o in outs2] == [o.outputs[0].token_ids for o in outs[3:]]
    again.shutdown()
    monkeypatch.setattr(kv_groups, "GROUPING", False)
    other, outs3, _ = run("gemma3", ps[3:], num_gpu_blocks=100, kv_cache_dir=str(tmp_path))
    assert [o.num_cached_tokens for o in outs3] == [0, 0]  # its key differs: another folder
    assert [o.outputs[0].token_ids for o in outs3] == [o.outputs[0].token_ids for o in outs[3:]]
    other.shutdown()
    assert len(list(tmp_path.iterdir())) == 2


def test_disk_tier_keeps_groups_apart_and_refuses_a_groups_file_in_anothers_place(tmp_path, caplog):
    tier, [(h, k)] = DiskTier(tmp_path, 1 << 20, key_of(), SHAPE, np.float32), chain(1)
    rng = np.random.default_rng()
    x, y = (rng.standard_normal(SHAPE).astype(np.float32) for _ in range(2))
    tier.put(h, k, x, group=0)
    tier.put(h, k, y, group=3)
    tier.flush()
    assert tier.get(h, k, 3).tobytes() == y.tobytes() and tier.get(h, k).tobytes() == x.tobytes()
    assert not tier.holds(h, 1) and tier.get(h, k, 1) is None
    shutil.copy(tier.path(h, 3), tier.path(h, 1))  # group 3's file where group 1's would be
    with caplog.at_level(logging.WARNING, logger="engine"):
        assert tier.get(h, k, 1) is None
    assert any("its header names another block" in r.getMessage() for r in caplog.records)
    assert not tier.path(h, 1).exists() and tier.stats.rejected == 1
    tier.close()
