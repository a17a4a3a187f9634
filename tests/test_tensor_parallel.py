"""Tensor and pipeline parallel on the host: each rank's cut, the shared-memory collectives, and
engines of 2 to 8 ranks (worker processes: TP 2, 3, 4 and 8, PP 2, TP x PP 2 x 2 and 3 x 2)
against the single process: the same greedy and seeded tokens, logits within float32 rounding,
through preemption and prefix caching; a dead worker is an error naming its rank, in seconds."""

from __future__ import annotations

import json
import multiprocessing as mp
import time

import httpx
import numpy as np
import pytest

from engine.config import EngineConfig
from engine.devices.comm import ShmComm
from engine.entrypoints.generate import main as generate_main
from engine.executor.sharding import Shard, Stage, check_pipeline_parallel, check_tensor_parallel
from engine.frontend.llm import run_to_completion
from engine.sampling_params import SamplingParams
from engine.tools.live_server import MODEL, LiveServer
from model_loader.config import ModelConfig
from model_loader.load import load_model
from model_loader.synthetic import make_tiny_model
from reference.generate import generate as reference_generate
from tests.utils import assert_same_greedy, kill_rank_mid_run, make_engine

PROMPTS = ["hi my name is", "today is a beautiful summer day", "hello there"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _cfg(h: int, hkv: int, f: int = 100, v: int = 97, layers: int = 1) -> ModelConfig:
    return ModelConfig(
        vocab_size=v,
        hidden_size=8 * h,
        intermediate_size=f,
        num_hidden_layers=layers,
        num_attention_heads=h,
        num_key_value_heads=hkv,
        head_dim=8,
    )


# ---- shards ----


@pytest.mark.parametrize("h, hkv, n", [(4, 2, 2), (4, 2, 4), (8, 2, 8), (9, 3, 3), (12, 4, 2)])
def test_shards_partition_the_model(h, hkv, n):
    """Query heads, MLP units and vocabulary rows are cut into disjoint near-equal slices that
    cover the model; each rank holds exactly the K/V heads its query heads read."""
    cfg = _cfg(h, hkv)
    shards = [Shard.of(cfg, r, n) for r in range(n)]
    for name, size in (("q_heads", h), ("ffn", cfg.intermediate_size), ("vocab", 97)):
        parts = [getattr(s, name) for s in shards]
        assert [i for p in parts for i in p] == list(range(size)), name
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
    for s in shards:
        assert sorted({q // cfg.gqa_group for q in s.q_heads}) == list(s.kv_heads)
        local = s.config(cfg)
        assert local.num_attention_heads * n == h and local.head_dim == 8


def test_shard_weights_are_the_rows_and_columns_of_the_whole(tiny):
    cfg, w = tiny.config, tiny.weights
    s = Shard.of(cfg, 1, 2)  # query heads 2-3, K/V head 1
    part, hd = s.weights(w, cfg), cfg.head_dim
    lw, pw = w.layers[0], part.layers[0]
    np.testing.assert_array_equal(pw.wq, lw.wq[2 * hd : 4 * hd])
    np.testing.assert_array_equal(pw.wk, lw.wk[hd : 2 * hd])
    np.testing.assert_array_equal(pw.wo, lw.wo[:, 2 * hd : 4 * hd])
    np.testing.assert_array_equal(pw.w_down, lw.w_down[:, 80:160])
    np.testing.assert_array_equal(part.embed, w.embed[160:320])


def test_stages_partition_the_layers():
    cfg = _cfg(4, 2, layers=30)
    stages = [Stage.of(cfg, s, 4) for s in range(4)]
    assert [list(s.layers) for s in stages] == [
        list(range(0, 7)), list(range(7, 15)), list(range(15, 22)), list(range(22, 30))
    ]  # fmt: skip
    assert stages[0].first and stages[3].last and not stages[1].first
    w = stages[1].config(cfg)
    assert w.num_hidden_layers == 8
    with pytest.raises(ValueError, match="pipeline_parallel_size 31 is more than the model's 30"):
        check_pipeline_parallel(cfg, 31)


@pytest.mark.parametrize(
    "h, hkv, n, message",
    [
        (9, 3, 2, "tensor_parallel_size 2 does not divide the model's 9 attention heads"),
        (12, 4, 6, "tensor_parallel_size 6 neither divides the model's 4 KV heads nor is a"),
    ],
)
def test_world_sizes_the_heads_cannot_take_are_refused(h, hkv, n, message):
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(_cfg(h, hkv), n)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            {"tensor_parallel_size": 4, "pipeline_parallel_size": 4},
            "tensor_parallel_size x pipeline_parallel_size is 16 ranks, more than 8",
        ),
        (
            {"pipeline_parallel_size": 2, "speculative_config": '{"model": "x"}'},
            "draft model is not implemented under tensor or pipeline parallel",
        ),
        ({"ray_address": "auto"}, "ray_address needs distributed_executor_backend 'ray'"),
        (
            {"tensor_parallel_size": 2, "distributed_executor_backend": "uni"},
            "'uni' runs one rank; 2 ranks \\(tensor x pipeline parallel\\) need 'mp'",
        ),
        (
            {"pipeline_parallel_size": 2, "backend": "cuda-cpu"},
            "pipeline parallel runs on the numpy backend only; the cuda-cpu backend's ranks",
        ),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ],
)
def test_what_is_not_built_is_refused_by_name(args, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**args)


def test_the_executor_defaults_to_the_world_size():
    assert EngineConfig().distributed_executor_backend == "uni"
    assert EngineConfig(tensor_parallel_size=2).distributed_executor_backend == "mp"
    assert EngineConfig(pipeline_parallel_size=2).distributed_executor_backend == "mp"


# ---- the collectives ----


def _rank_main(comm: ShmComm, rank: int, seed: int, out, bad: bool) -> None:
    comm.attach(rank)
    rng = np.random.default_rng(seed + rank)
    try:
        x = rng.standard_normal((37, 11)).astype(np.float32)
        out.put(("reduce", rank, comm.all_reduce(x)))
        big = rng.standard_normal(1000).astype(np.float32)  # four pieces of a 256-float slot
        out.put(("big", rank, comm.all_reduce(big)))
        g = rng.standard_normal((5, 3 + rank)).astype(np.float32)
        out.put(("gather", rank, comm.all_gather(g, 3 + comm.world - 1)))
        odd = np.ones(7 if bad and rank == 1 else 6, np.float32)
        out.put(("odd", rank, comm.all_reduce(odd)))
    except (ValueError, RuntimeError) as e:
        out.put(("error", rank, str(e)))


def _run_ranks(world: int, seed: int, bad: bool = False, die: int | None = None) -> dict:
    """Each rank's answers, from forked processes."""
    ctx = mp.get_context("fork")
    comm = ShmComm(world, 256 * 4, timeout=1.0)
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(comm, r, seed, out, bad)) for r in range(world)]
    for r, p in enumerate(procs):
        if r != die:
            p.start()
    got: dict = {}
    try:
        for _ in range(4 * world if die is None else world - 1):
            kind, rank, value = out.get(timeout=20)
            got.setdefault(kind, {})[rank] = value
            if kind == "error" and len(got["error"]) == world - (die is not None):
                break
    finally:
        for r, p in enumerate(procs):
            if r != die:
                p.join(10)
        comm.close()
    return got


def test_all_reduce_and_all_gather_give_every_rank_the_same_bits():
    seed = int(np.random.default_rng().integers(1 << 30))
    got = _run_ranks(3, seed)
    xs = [np.random.default_rng(seed + r).standard_normal((37, 11)) for r in range(3)]
    want = xs[0].astype(np.float32) + xs[1].astype(np.float32) + xs[2].astype(np.float32)
    for r in range(3):
        np.testing.assert_array_equal(got["reduce"][r], want)  # rank order: exact
        np.testing.assert_array_equal(got["big"][r], got["big"][0])
        assert got["gather"][r].shape == (5, 3 + 4 + 5)
        np.testing.assert_array_equal(got["gather"][r], got["gather"][0])
        np.testing.assert_array_equal(got["odd"][r], np.full(6, 3, np.float32))
    assert got["big"][0].shape == (1000,)


def test_a_rank_that_breaks_the_rules_or_dies_is_an_error_not_a_hang():
    got = _run_ranks(3, 0, bad=True)
    assert set(got["error"]) == {0, 1, 2}
    assert all("ranks gave [6, 7, 6] elements" in m for m in got["error"].values())
    start = time.monotonic()
    got = _run_ranks(3, 0, die=2)  # rank 2 never comes: the others time out
    assert set(got["error"]) == {0, 1} and time.monotonic() - start < 10
    assert all("did not reach the collective within 1 s" in m for m in got["error"].values())


# ---- engines ----


@pytest.mark.parametrize("tp, pp", [(2, 1), (4, 1), (1, 2), (2, 2)])
def test_tiny_tensor_and_pipeline_parallel_equal_one_process(tiny, tp, pp):
    one = run_to_completion(make_engine(tiny, record_logits=True), PROMPTS, GREEDY)
    sizes = dict(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    engine = make_engine(tiny, **sizes, record_logits=True)
    assert engine.backend.name == "numpy-mp" and engine.backend.world == tp * pp
    many = run_to_completion(engine, PROMPTS, GREEDY)
    assert_same_greedy(one, many)
    seeded = SamplingParams(temperature=0.8, max_tokens=24, seed=7, n=2, ignore_eos=True)
    a = run_to_completion(make_engine(tiny), PROMPTS, seeded)
    b = run_to_completion(engine, PROMPTS, seeded)
    assert [[c.token_ids for c in o.outputs] for o in a] == [
        [c.token_ids for c in o.outputs] for o in b
    ]
    engine.backend.shutdown()


@pytest.fixture(scope="module")
def tiny8(tmp_path_factory):
    """The tiny model with 8 query heads and 2 K/V heads: 8 ranks replicate each K/V head 4x."""
    path = make_tiny_model(tmp_path_factory.mktemp("tiny8"), num_attention_heads=8, head_dim=8)
    return load_model(str(path))


def test_eight_ranks_with_replicated_kv_heads(tiny8):
    one = run_to_completion(make_engine(tiny8), PROMPTS, GREEDY)
    engine = make_engine(tiny8, tensor_parallel_size=8)
    many = run_to_completion(engine, PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in one] == [o.outputs[0].token_ids for o in many]
    per_block = engine.backend.rank_sizes[0][1]
    assert engine.backend.bytes_per_block == 8 * per_block  # each rank its one K/V head
    assert per_block == 16 * 2 * 2 * 1 * 8 * 4  # block x K,V x layers x 1 head x hd x float32
    engine.backend.shutdown()


@pytest.mark.parametrize("mode, tp, pp", [("recompute", 2, 1), ("swap", 1, 2)])
def test_preemption_under_tensor_and_pipeline_parallel(tiny, mode, tp, pp):
    prompts = PROMPTS + ["the quick brown fox", "once upon a time in a land"]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    small = dict(num_gpu_blocks=8, max_model_len=64, preemption_mode=mode)
    one = run_to_completion(make_engine(tiny, **small), prompts, params)
    engine = make_engine(tiny, tensor_parallel_size=tp, pipeline_parallel_size=pp, **small)
    many = run_to_completion(engine, prompts, params, check_invariants=True)
    assert engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in one] == [o.outputs[0].token_ids for o in many]
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    engine.backend.shutdown()


def test_prefix_caching_under_tensor_parallel(tiny):
    shared = "once upon a time in a land far away there lived a fox who "
    prompts = [shared + p for p in PROMPTS] * 2
    one = run_to_completion(make_engine(tiny), prompts, GREEDY)
    engine = make_engine(tiny, tensor_parallel_size=2, enable_prefix_caching=True)
    many = run_to_completion(engine, prompts, GREEDY)
    assert engine.scheduler.prefix_cache_hits > 0
    assert [o.outputs[0].token_ids for o in one] == [o.outputs[0].token_ids for o in many]
    engine.backend.shutdown()


def test_smollm2_tensor_3_alone_and_with_pipeline_2(smollm2):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    small = dict(num_gpu_blocks=32, max_model_len=128)
    one = run_to_completion(make_engine(smollm2, **small, backend="numpy"), prompts, params)
    for tp, pp in ((3, 1), (3, 2)):  # pipeline alone: the tiny model's tests
        sizes = dict(tensor_parallel_size=tp, pipeline_parallel_size=pp)
        engine = make_engine(smollm2, **sizes, **small)
        many = run_to_completion(engine, prompts, params)
        got = [o.outputs[0].token_ids for o in many]
        assert [o.outputs[0].token_ids for o in one] == got, (tp, pp)
        engine.backend.shutdown()


@pytest.mark.parametrize("pp", [1, 2])
def test_a_killed_worker_is_an_error_naming_its_rank(tiny, pp):
    engine = make_engine(tiny, tensor_parallel_size=2, pipeline_parallel_size=pp)
    victim = engine.backend.world - 1
    died = rf"worker rank {victim} \(stage {pp - 1}, tensor-parallel rank 1\): it died"
    kill_rank_mid_run(engine, victim, PROMPTS[0], died)
    assert not any(p.is_alive() for p in engine.backend.procs)  # the others are stopped too


# ---- the command line and the server ----


def test_generate_with_tensor_and_pipeline_parallel(tiny_model_dir, tiny, capsys):
    flags = "--json --max-tokens 8 --ignore-eos --max-model-len 128 --num-gpu-blocks 16"
    parallel = "--tensor-parallel-size 2 --pipeline-parallel-size 2"
    argv = ["--model", str(tiny_model_dir), "--prompt", PROMPTS[1], *f"{flags} {parallel}".split()]
    assert generate_main(argv) == 0
    row = json.loads(capsys.readouterr().out)
    ref = reference_generate(tiny.weights, tiny.config, row["prompt_token_ids"], 8)
    assert row["token_ids"] == ref.token_ids


def test_the_server_with_tensor_parallel(tiny):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = run_to_completion(make_engine(tiny), PROMPTS, params)
    body = {"model": MODEL, "prompt": PROMPTS, "max_tokens": 12, "temperature": 0}
    with LiveServer(tiny, tensor_parallel_size=2) as s, httpx.Client(base_url=s.url) as http:
        r = http.post("/v1/completions", json={**body, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        texts = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
        assert texts == [o.outputs[0].text for o in want]
        s.engine.backend.shutdown()


def test_speculation_and_async_scheduling_under_tensor_parallel(tiny):
    """The verification forward (every row of a drafted run) and the overlapped greedy steps go
    through the executor like any other: the single process's tokens."""
    prompts = ["a b c a b c a b c a b", *PROMPTS]
    ngram = '{"method": "ngram", "num_speculative_tokens": 3}'
    for extra in ({"speculative_config": ngram}, {"async_scheduling": True}):
        one = run_to_completion(make_engine(tiny, **extra), prompts, GREEDY)
        engine = make_engine(tiny, tensor_parallel_size=2, **extra)
        many = run_to_completion(engine, prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in one] == [o.outputs[0].token_ids for o in many]
        if "speculative_config" in extra:
            assert engine.spec_stats.num_accepted_tokens > 0
        engine.backend.shutdown()
