"""KV tiers under the prefix cache: exact block ids of stores and loads; the host tier's and the
disk tier's eviction order and byte bounds; a disk tier that survives a restart and refuses
files from another model or layout, truncated or damaged; engines sharing a directory; and the
engine's tokens with the tiers on equal those computed in full (its logprobs equal those of the
pool's own prefix hits, bit for bit) on every host backend and cache dtype."""

from __future__ import annotations

import logging
import os
import shutil
import threading

import numpy as np
import pytest

from engine import SamplingParams
from engine.config import EngineConfig
from engine.core.block_manager import hash_block
from engine.entrypoints.generate import main as generate_main
from engine.entrypoints.prometheus import PrometheusStatLogger
from engine.frontend.async_llm import StepStats, format_stats_line
from engine.kv_offload.cache_key import CacheKey, weights_fingerprint
from engine.kv_offload.connector import KVConnector
from engine.kv_offload.disk_tier import HEADER, DiskTier
from engine.kv_offload.host_tier import HostTier
from tests.test_prefix_caching import QUESTIONS, SYSTEM, chat_prompts, run_staggered
from tests.utils import make_engine, make_scheduler, make_seq, random_tokens, scheduled_ids, step

SHAPE = (2, 2, 4, 1, 8)  # (L, 2, block_size, Hkv, hd)
BLOCK = int(np.prod(SHAPE)) * 4  # float32 bytes
rng = np.random.default_rng()


def key_of(**kw) -> CacheKey:
    base = dict(weights="w", model="m", backend="numpy", dtype="float32")
    base |= dict(cache_dtype="float32", quantization=None, block_size=4, layers=2)
    return CacheKey(**(base | dict(kv_heads=1, head_dim=8) | kw))


def block() -> np.ndarray:
    return rng.standard_normal(SHAPE).astype(np.float32)


def chain(n: int, bs: int = 4) -> list[tuple[int, tuple]]:
    """n chained (hash, key) pairs of random tokens."""
    out, parent = [], None
    for _ in range(n):
        tokens = tuple(random_tokens(bs))
        h = hash_block(parent, tokens)
        out.append((h, (parent, tokens)))
        parent = h
    return out


# ---- the host tier ----


def test_host_tier_drops_the_least_recently_used_within_its_bytes():
    tier = HostTier(3 * BLOCK)
    (ha, ka), (hb, kb), (hc, kc), (hd, kd) = chain(4)
    a, b, c, d = block(), block(), block(), block()
    for h, k, x in ((ha, ka, a), (hb, kb, b), (hc, kc, c)):
        tier.put(h, k, x)
    assert tier.get(ha, ka) is a  # a is now the most recently used: b goes first
    tier.put(hd, kd, d)
    assert hb not in tier and [h in tier for h in (ha, hc, hd)] == [True] * 3
    assert tier.stats.used_bytes == 3 * BLOCK and tier.stats.evictions == 1
    assert tier.get(hc, (None, kc[1])) is None  # the same hash with another key: a miss
    big = HostTier(BLOCK - 1)
    big.put(ha, ka, a)  # larger than the whole tier: not kept
    assert len(big) == 0 and big.stats.used_bytes == 0


def test_connector_walks_the_tiers_in_order_and_promotes_a_disk_hit(tmp_path):
    host, disk = HostTier(8 * BLOCK), DiskTier(tmp_path, 1 << 20, key_of(), SHAPE, np.float32)
    conn = KVConnector([host, disk], SHAPE, np.float32)
    blocks = chain(3)
    data = [block() for _ in blocks]
    disk.put(*blocks[0], data[0])
    disk.put(*blocks[1], data[1])
    disk.flush()
    hashes, keys = [h for h, _ in blocks], [k for _, k in blocks]
    got = conn.fetch(hashes, keys)  # the third is nowhere: the run stops there
    assert len(got) == 2 and all((g == d).all() for g, d in zip(got, data, strict=False))
    assert [hashes[0] in host, hashes[1] in host] == [True, True]  # promoted
    assert (host.stats.queries, host.stats.hits, disk.stats.queries, disk.stats.hits) == (
        3,
        0,
        3,
        2,
    )
    assert conn.fetch(hashes, keys)[0] is host.get(*blocks[0])
    conn.save([(hashes[2], keys[2], data[2])])
    conn.flush()
    assert not conn.missing(hashes[2]) and disk.stats.stores == 3
    conn.close()


# ---- the disk tier ----


def disk(path, capacity=1 << 20, **key) -> DiskTier:
    return DiskTier(path, capacity, key_of(**key), SHAPE, np.float32)


def test_disk_tier_survives_a_restart_bit_for_bit(tmp_path):
    tier, blocks = disk(tmp_path), chain(5)
    data = [block() for _ in blocks]
    for (h, k), x in zip(blocks, data, strict=True):
        tier.put(h, k, x)
    tier.close()
    again = disk(tmp_path)
    assert again.stats.used_bytes == 5 * again.file_bytes
    for (h, k), x in zip(blocks, data, strict=True):
        got = again.get(h, k)
        assert got.dtype == np.float32 and got.tobytes() == x.tobytes()
    assert not list(again.dir.glob(".tmp-*"))  # every write renamed into place


def test_disk_tier_removes_the_least_recently_used_files_past_its_bound(tmp_path):
    tier, blocks = disk(tmp_path, capacity=10**9), chain(4)
    for i, (h, k) in enumerate(blocks[:3]):
        tier.put(h, k, block())
        tier.flush()
        os.utime(tier.path(h), (1000 + i, 1000 + i))  # a, b, c: oldest first
    assert tier.get(*blocks[0]) is not None  # touched: a is now the newest
    tier.stats.capacity_bytes = 3 * tier.file_bytes
    tier.put(*blocks[3], block())  # 4 files: past the bound, down to 90% of it (2 files)
    tier.flush()
    left = {h for h, _ in blocks if tier.path(h).exists()}
    assert left == {blocks[0][0], blocks[3][0]}  # b and c went, least recently used first
    assert tier.stats.evictions == 2 and tier.stats.used_bytes == 2 * tier.file_bytes
    tier.close()


def damage(path, how: str) -> None:
    raw = bytearray(path.read_bytes())
    if how == "flip":
        raw[len(raw) - 7] ^= 0x10  # a bit of the block's bytes
    elif how == "truncate":
        raw = raw[: len(raw) // 2]
    elif how == "header":
        raw[HEADER.size - 5] ^= 1  # the header's payload length
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "how, why",
    [
        ("flip", "checksum mismatch"),
        ("truncate", "bytes, a block here is"),
        ("header", "its header names another block or size"),
    ],
)
def test_disk_tier_ignores_a_damaged_file_with_one_line(tmp_path, caplog, how, why):
    tier, [(h, k)] = disk(tmp_path), chain(1)
    tier.put(h, k, block())
    tier.flush()
    damage(tier.path(h), how)
    with caplog.at_level(logging.WARNING, logger="engine"):
        assert tier.get(h, k) is None
    lines = [r.getMessage() for r in caplog.records if "kv disk tier: ignored" in r.getMessage()]
    assert len(lines) == 1 and why in lines[0]
    assert not tier.path(h).exists() and tier.stats.rejected == 1
    tier.close()


@pytest.mark.parametrize(
    "other, why",
    [
        (dict(weights="another"), "made for another model"),
        (dict(cache_dtype="bfloat16"), "made for another model, dtype or layout"),
        (dict(block_size=8), "bytes, a block here is"),
    ],
)
def test_disk_tier_ignores_a_file_made_for_another_key(tmp_path, caplog, other, why):
    """Another engine's file renamed into this one's place is never loaded."""
    [(h, k)] = chain(1)
    shape = SHAPE if "block_size" not in other else (2, 2, 8, 1, 8)
    theirs = DiskTier(tmp_path, 1 << 20, key_of(**other), shape, np.float32)
    k8 = (None, k[1] * 2) if "block_size" in other else k
    theirs.put(h, k8, rng.standard_normal(shape).astype(np.float32))
    theirs.close()
    ours = disk(tmp_path)
    assert ours.dir != theirs.dir  # each key has its own folder: no lookup meets the other's
    assert ours.get(h, k) is None
    shutil.copy(theirs.path(h), ours.path(h))
    with caplog.at_level(logging.WARNING, logger="engine"):
        assert ours.get(h, k) is None
    assert any(why in r.getMessage() for r in caplog.records)
    ours.close()


def test_two_engines_share_a_directory(tmp_path):
    """Two tiers (as two engines would) write overlapping blocks at once; a third reads every
    one back whole, and the directory's bound holds for them all."""
    blocks = chain(24)
    data = {h: block() for h, _ in blocks}
    capacity = 16 * disk(tmp_path).file_bytes

    def write(order):
        tier = disk(tmp_path, capacity=capacity)
        for h, k in order:
            tier.put(h, k, data[h])
        tier.close()

    threads = [threading.Thread(target=write, args=(o,)) for o in (blocks, blocks[::-1])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reader = disk(tmp_path, capacity=capacity)
    files = list(reader.dir.glob("*.kvb"))
    assert 0 < len(files) <= 16 and not list(reader.dir.glob(".tmp-*"))
    for h, k in blocks:
        got = reader.get(h, k)
        assert got is None or got.tobytes() == data[h].tobytes()
    assert reader.stats.rejected == 0


def test_weights_fingerprint_changes_with_one_matrix(tiny_model_dir, tmp_path):
    copy = tmp_path / "m"
    shutil.copytree(tiny_model_dir, copy)

    class Src:
        source, weights = str(copy), None

    before = weights_fingerprint(Src)
    assert weights_fingerprint(Src) == before
    [f] = list(copy.glob("*.safetensors"))
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 1
    f.write_bytes(bytes(raw))
    assert weights_fingerprint(Src) != before


# ---- the scheduler: exact block ids ----


def test_evicted_blocks_are_stored_and_a_later_prompt_loads_them_into_fresh_blocks():
    conn = KVConnector([HostTier(1 << 20)], (1, 2, 4, 1, 2), np.float32)
    sched = make_scheduler(num_blocks=6, block_size=4, enable_prefix_caching=True, connector=conn)
    bm = sched.block_manager
    a = make_seq(9)
    sched.add(a)
    step(sched)  # a: [0, 1, 2], blocks 0 and 1 full and cached
    sched.finish(a, "stop")  # free queue [3, 4, 5, 2, 1, 0]
    b = make_seq(21)
    sched.add(b)
    out = step(sched)  # b takes all six: a's cached 1 and 0 are evicted
    assert b.block_table == [3, 4, 5, 2, 1, 0]
    assert [(blk, h) for blk, h, *_ in out.blocks_to_store] == [
        (1, a.block_hashes[1]),
        (0, a.block_hashes[0]),
    ]
    saved = {h: np.full((1, 2, 4, 1, 2), blk, np.float32) for blk, h, *_ in out.blocks_to_store}
    conn.save([(h, key, saved[h]) for _, h, key, _ in out.blocks_to_store])  # the runner's part
    sched.finish(b, "stop")  # free queue [0, 1, 2, 5, 4, 3]; b's 3, 4, 5, 2, 1 cached
    again = make_seq(list(a.prompt_token_ids))
    sched.add(again)
    out = step(sched)
    [(seq, ids, loads, group)] = out.tier_loads
    assert seq is again and group == 0 and ids == [0, 1] and again.block_table == [0, 1, 2]
    assert [x[0, 0, 0, 0, 0] for x in loads] == [0.0, 1.0]  # a's blocks 0 and 1, in order
    assert scheduled_ids(out) == [(again.seq_id, 1)] and again.num_cached_tokens == 8
    # b's cached 1 and 2 were evicted for them: stored before the load overwrites block 1
    assert [(blk, h) for blk, h, *_ in out.blocks_to_store] == [
        (1, b.block_hashes[4]),
        (2, b.block_hashes[3]),
    ]
    assert bm.cached[a.block_hashes[0]] == 0 and bm.cached[a.block_hashes[1]] == 1
    assert (sched.tier_hits, sched.tier_queries) == (8, 9 + 21 + 9)


def test_tiers_need_the_prefix_cache():
    with pytest.raises(ValueError, match="kv_offload_bytes is a tier under the prefix cache"):
        EngineConfig(kv_offload_bytes=1 << 20)
    with pytest.raises(ValueError, match="kv_cache_dir is a tier .* enable_prefix_caching"):
        EngineConfig(kv_cache_dir="/tmp/x")
    with pytest.raises(ValueError, match="kv_disk_bytes bounds kv_cache_dir, which is not set"):
        EngineConfig(kv_disk_bytes=1 << 20, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="kv_offload_bytes must be an integer"):
        EngineConfig(kv_offload_bytes=-1, enable_prefix_caching=True)


# ---- the engine: the same tokens ----


def workload(tokenizer) -> list[str]:
    """Two conversations' prompts, alternating, so that a small pool evicts each prefix before
    it comes back."""
    a = chat_prompts(tokenizer, SYSTEM, QUESTIONS[:2])
    b = chat_prompts(tokenizer, SYSTEM[::-1], QUESTIONS[2:])
    return [a[0], b[0], a[1], b[1]]


PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
SMALL = dict(max_num_seqs=1, max_model_len=200, block_size=8)


def logprobs(outs) -> list:
    return [[sorted(d.items()) for d in o.outputs[0].logprobs] for o in outs]


def run_tiers(tiny, prompts, **kw):
    engine = make_engine(tiny, **SMALL, enable_prefix_caching=True, num_gpu_blocks=25, **kw)
    outs = run_staggered(engine, prompts, PARAMS)
    engine.check_invariants()
    return engine, outs


@pytest.mark.parametrize(
    "backend, cache",
    [
        ("numpy", "auto"),
        ("cpu", "auto"),
        ("cuda-cpu", "auto"),
        ("numpy", "bfloat16"),
        ("cpu", "fp8"),
    ],
)
def test_tier_hits_give_the_tokens_of_full_computation(tiny, tmp_path, backend, cache):
    prompts = workload(tiny.tokenizer)
    kw = dict(backend=backend, kv_cache_dtype=cache)
    if backend == "cuda-cpu":
        kw = dict(backend=backend)
    plain = run_staggered(make_engine(tiny, **SMALL, **kw), prompts, PARAMS)
    pool = run_staggered(
        make_engine(tiny, **SMALL, enable_prefix_caching=True, num_gpu_blocks=200, **kw),
        prompts,
        PARAMS,
    )
    engine, outs = run_tiers(tiny, prompts, kv_offload_bytes=1 << 24, **kw)
    assert engine.scheduler.tier_hits > 0
    assert [o.num_cached_tokens for o in outs] == [o.num_cached_tokens for o in pool]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert logprobs(outs) == logprobs(pool)  # the same bytes as the pool's own hits
    host = engine.core.connector.stats()[0]
    assert host.loads * 8 == engine.scheduler.tier_hits and host.stores > 0


def test_chunked_prefill_and_speculation_over_tier_hits(tiny):
    prompts = workload(tiny.tokenizer)
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'
    kw = dict(enable_chunked_prefill=True, max_num_batched_tokens=24, speculative_config=spec)
    plain = run_staggered(make_engine(tiny, **SMALL), prompts, PARAMS)
    engine, outs = run_tiers(tiny, prompts, kv_offload_bytes=1 << 24, **kw)
    assert engine.scheduler.tier_hits > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]


@pytest.mark.parametrize("tp, pp", [(2, 1), (4, 1), (1, 2)])
def test_parallel_ranks_store_and_load_whole_blocks(tiny, tmp_path, tp, pp):
    """The ranks' cuts (KV heads of tensor parallel, layers of pipeline stages; at tp 4 the
    tiny model's 2 KV heads are shared by pairs of ranks) gathered into whole blocks and cut
    again on the way back: the tokens of the same ranks computing in full, the logprobs of their
    own pool hits, and the whole blocks a restart on one rank could not tell apart in shape."""
    prompts = workload(tiny.tokenizer)
    kw = dict(backend="numpy", tensor_parallel_size=tp, pipeline_parallel_size=pp)
    plain = run_staggered(make_engine(tiny, **SMALL, **kw), prompts, PARAMS)
    pool_engine = make_engine(tiny, **SMALL, enable_prefix_caching=True, num_gpu_blocks=200, **kw)
    pool = run_staggered(pool_engine, prompts, PARAMS)
    engine, outs = run_tiers(
        tiny, prompts, kv_offload_bytes=1 << 24, kv_cache_dir=str(tmp_path), **kw
    )
    assert engine.scheduler.tier_hits > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert logprobs(outs) == logprobs(pool)
    whole = engine.backend.read_blocks([0, 1])  # (L, 2, n, bs, Hkv, hd)
    assert whole.shape == (2, 2, 2, 8, 2, 16)
    engine.backend.write_blocks([2, 3], whole)
    assert engine.backend.read_blocks([2, 3]).tobytes() == whole.tobytes()
    for e in (engine, pool_engine):
        e.shutdown()


def test_a_restarted_engine_loads_its_prefixes_from_disk(tiny, tmp_path, caplog):
    prompts = workload(tiny.tokenizer)
    first, outs = run_tiers(tiny, prompts, kv_cache_dir=str(tmp_path))
    first.shutdown()  # the pool's cached blocks are written too
    files = list(tmp_path.glob("*/*.kvb"))
    assert files and first.core.connector is None
    again, outs2 = run_tiers(tiny, prompts, kv_cache_dir=str(tmp_path))
    whole = [(len(o.prompt_token_ids) - 1) // 8 * 8 for o in outs2]
    assert [o.num_cached_tokens for o in outs2] == whole  # every prompt from disk
    assert [o.outputs[0].token_ids for o in outs2] == [o.outputs[0].token_ids for o in outs]
    # the bytes of a pool that computed them before, bit for bit
    warm = make_engine(tiny, **SMALL, enable_prefix_caching=True, num_gpu_blocks=200)
    run_staggered(warm, prompts, PARAMS)
    assert logprobs(outs2) == logprobs(run_staggered(warm, prompts, PARAMS))
    again.shutdown()
    for f in list(tmp_path.glob("*/*.kvb"))[::2]:
        damage(f, "flip")
    with caplog.at_level(logging.WARNING, logger="engine"):
        third, outs3 = run_tiers(tiny, prompts, kv_cache_dir=str(tmp_path))
    assert third.core.connector.stats()[0].rejected > 0
    assert any("checksum mismatch" in r.getMessage() for r in caplog.records)
    assert [o.outputs[0].token_ids for o in outs3] == [o.outputs[0].token_ids for o in outs]
    third.shutdown()


def test_another_dtype_never_loads_the_blocks_of_the_first(tiny, tmp_path):
    prompts = workload(tiny.tokenizer)
    first, outs = run_tiers(tiny, prompts, kv_cache_dir=str(tmp_path))
    first.shutdown()
    kw = dict(kv_cache_dir=str(tmp_path), kv_cache_dtype="bfloat16")
    other, outs2 = run_tiers(tiny, prompts, **kw)
    assert outs2[0].num_cached_tokens == 0  # the first engine's files are not its own
    assert [o.outputs[0].token_ids for o in outs2] == [o.outputs[0].token_ids for o in outs]
    other.shutdown()  # its writes finished
    assert len({p.parent for p in tmp_path.glob("*/*.kvb")}) == 2  # a folder per key


# ---- where the tiers show ----


def test_metrics_and_the_stats_line_show_the_tiers():
    tiers = [
        ["host", 100, 40, 5, 3, 3, 30, 4, 40, 1, 0],
        ["disk", 1000, 0, 2, 0, 0, 0, 4, 40, 0, 0],
    ]
    s = StepStats(1.0, 1, 0, 0, 0.5, 100, 20, 0, 0, 0, [], None, 100, 48, tiers)
    assert format_stats_line(s, 0, 0, 1.0).endswith("KV tier hit rate 48.0%")
    metrics = PrometheusStatLogger("m")
    metrics(s)
    text = metrics.render().decode()
    assert 'pagedllm:kv_tier_hits_total{model_name="m",tier="host"} 3.0' in text
    assert 'pagedllm:kv_tier_usage_bytes{model_name="m",tier="host"} 40.0' in text
    assert 'pagedllm:external_prefix_cache_hits_total{model_name="m"} 48.0' in text


def test_cli_restart_hits_the_disk_tier_and_the_replay_lists_it(tiny_model_dir, tmp_path, caplog):
    prompt = "once upon a time in a land far away there lived a small language model " * 3
    html = tmp_path / "run.html"
    flags = f"""--block-size 4 --max-tokens 4 --trace --enable-prefix-caching
    --num-gpu-blocks 64 --max-model-len 128 --swap-space 0 --no-tqdm --kv-cache-dir {tmp_path}"""
    argv = ["--model", str(tiny_model_dir), "--prompt", prompt, *flags.split()]
    assert generate_main(argv) == 0
    with caplog.at_level(logging.INFO, logger="engine.trace"):
        assert generate_main([*argv, "--trace-html", str(html)]) == 0
    hits = [r.getMessage() for r in caplog.records if "KV tier hit:" in r.getMessage()]
    assert len(hits) == 1 and "tokens loaded (blocks [" in hits[0]
    assert '"tier":' in html.read_text()


def test_the_conversations_benchmark_runs_each_configuration(tiny_model_dir, capsys, tmp_path):
    from engine.tools.bench import main as bench_main

    argv = ["--model", str(tiny_model_dir), "--workload", "conversations", "--conversations", "3"]
    argv += ["--turns", "2", "--system-tokens", "40", "--turn-tokens", "4", "--max-output", "2"]
    argv += ["--pool-prefixes", "1", "--block-size", "4", "--kv-cache-dir", str(tmp_path)]
    assert bench_main(argv) == 0
    out = capsys.readouterr().out
    for name in ("off", "host", "disk", "restart"):
        assert f"\n{name} " in out or out.startswith(f"{name} "), out
    assert "restart: first round's mean TTFT" in out
    served = {line.split()[0]: int(line.split("prompt tokens from the tiers ")[1].split()[0])
              for line in out.splitlines() if "prompt tokens from the tiers" in line}  # fmt: skip
    assert served["off"] == 0 and served["host"] > 0 and served["restart"] > 0


def test_a_cache_dir_that_cannot_be_written_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match=r"kv_cache_dir .*file/kv: cannot write there"):
        disk(blocker / "kv")


def test_async_scheduling_and_a_core_process_over_the_tiers(tiny, tiny_model_dir, tmp_path):
    """Steps that store or load blocks are not overlapped (they run after the step in flight);
    a core process saves its pool to the disk tier when it is shut down."""
    prompts = workload(tiny.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    plain = run_staggered(make_engine(tiny, **SMALL), prompts, params)
    engine, outs = run_tiers(tiny, prompts, kv_offload_bytes=1 << 24, async_scheduling=True)
    assert engine.scheduler.tier_hits > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    kw = dict(SMALL, enable_prefix_caching=True, num_gpu_blocks=25, kv_cache_dir=str(tmp_path))
    core = make_engine(tiny, model=str(tiny_model_dir), engine_core_process=True, **kw)
    try:
        got = run_staggered_outputs(core, prompts, params)
    finally:
        core.shutdown()
    assert got == [o.outputs[0].token_ids for o in plain]
    again = make_engine(tiny, **kw)
    warm = run_staggered(again, prompts, params)
    assert warm[0].num_cached_tokens > 0  # the core process's blocks, from disk
    assert [o.outputs[0].token_ids for o in warm] == got
    again.shutdown()


def run_staggered_outputs(engine, prompts, params) -> list:
    """Each request's token ids, for an engine whose invariants live in another process."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[str(i)].outputs[0].token_ids for i in range(len(prompts))]


def test_the_host_tier_is_planned_beside_the_pool_not_as_swap(tiny):
    """The host tier's bytes come out of the host pool's room; the swap pool (none with prefix
    caching) stays what it is, so the startup plan and the replay report it right."""
    base = dict(SMALL, enable_prefix_caching=True, memory_budget_bytes=64 << 20)
    plain = make_engine(tiny, **base, num_gpu_blocks=None)
    tiered = make_engine(tiny, **base, num_gpu_blocks=None, kv_offload_bytes=16 << 20)
    assert plain.kv_plan.swap_bytes == tiered.kv_plan.swap_bytes == 0
    assert tiered.kv_plan.room_bytes == plain.kv_plan.room_bytes - (16 << 20)
