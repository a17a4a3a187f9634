"""The replica router's policies (engine/entrypoints/replicas/routing.py), and the prefix-aware
policy in front of two real engines with prefix caching: on 4 system prompts x 16 users it finds the
cache at least 1.5x as often as round-robin, and each replica serves a fair share."""

from __future__ import annotations

import numpy as np
import pytest

from engine.entrypoints.replicas.routing import PrefixIndex, Router, chunk_names
from engine.sampling_params import SamplingParams
from tests.utils import make_engine


def _ids(rng, n: int) -> list[int]:
    return rng.integers(0, 1000, n).tolist()


def test_chunk_names_are_shared_exactly_up_to_the_first_difference():
    rng = np.random.default_rng()
    a = _ids(rng, 70)
    b = a[:40] + [a[40] + 1] + a[41:]  # differs in the third chunk of 16
    na, nb = chunk_names(a, 16), chunk_names(b, 16)
    assert len(na) == len(nb) == 4  # whole chunks only
    assert na[:2] == nb[:2] and not set(na[2:]) & set(nb[2:])


def test_the_index_matches_the_longest_prefix_each_replica_was_sent():
    rng = np.random.default_rng()
    system, other = _ids(rng, 48), _ids(rng, 48)
    index = PrefixIndex(chunk=16)
    index.insert(system + _ids(rng, 20), "a")
    index.insert(system[:32] + _ids(rng, 30), "b")
    prompt = system + _ids(rng, 9)
    assert index.match(prompt, ["a", "b", "c"]) == {"a": 48, "b": 32, "c": 0}
    assert index.match(other, ["a", "b"]) == {"a": 0, "b": 0}
    index.forget("a")
    assert index.match(prompt, ["a", "b"]) == {"a": 0, "b": 32}


def test_the_index_forgets_its_least_recently_used_chunks_first():
    rng = np.random.default_rng()
    old, new = _ids(rng, 64), _ids(rng, 64)
    index = PrefixIndex(chunk=16, capacity=6)
    index.insert(old, "a")
    index.insert(new, "b")  # 8 names: the 2 oldest (old's first chunks) go
    assert index.match(old, ["a"]) == {"a": 0}  # its first chunk is gone: no prefix left
    assert index.match(new, ["b"]) == {"b": 64}
    assert len(index.names) == 6


def test_round_robin_and_least_loaded():
    rr = Router("round-robin")
    loads = {"b": 3, "a": 0, "c": 1}
    assert [rr.choose([1], loads)[0] for _ in range(4)] == ["a", "b", "c", "a"]
    ll = Router("least-loaded")
    assert ll.choose([1], loads) == ("a", "load")
    assert ll.choose([1], {"a": 2, "b": 2}) == ("a", "load")  # the first of equals


def test_prefix_aware_prefers_the_cache_until_the_loads_drift_apart():
    rng = np.random.default_rng()
    system = _ids(rng, 64)
    router = Router("prefix-aware", imbalance=2)
    assert router.choose(system + _ids(rng, 5), {"a": 1, "b": 0}) == ("b", "load")  # no match
    assert router.choose(system + _ids(rng, 5), {"a": 0, "b": 2}) == ("b", "prefix")
    assert router.choose(system + _ids(rng, 5), {"a": 0, "b": 3}) == ("a", "load")  # imbalance
    assert router.choose(system + _ids(rng, 5), {"a": 2, "b": 2}) == ("a", "prefix")  # equals
    assert router.routed == {
        ("b", "load"): 1,
        ("b", "prefix"): 1,
        ("a", "load"): 1,
        ("a", "prefix"): 1,
    }
    with pytest.raises(ValueError, match="router must be one of round-robin, least-loaded"):
        Router("random")
    with pytest.raises(ValueError, match="no replica to route to"):
        router.choose([1], {})


# ---- in front of two engines ----


def _workload(tokenizer, seed: int) -> list[list[int]]:
    """4 system prompts (about 110 tokens each) x 16 users' questions (about 30): the users take
    turns, each turn every system prompt's next user, in a random order (the system prompts are
    all in use at once, as a multi-tenant server's are)."""
    rng = np.random.default_rng(seed)
    words = ["river", "stone", "cloud", "garden", "lantern", "window", "meadow", "harbor"]
    tail = "answer briefly and kindly."
    systems = [" ".join(rng.choice(words, 14)) + f" system {k}: {tail}" for k in range(4)]
    prompts = []
    for u in range(16):
        for k in rng.permutation(4):
            prompts.append(f"{systems[k]} user {u}: " + " ".join(rng.choice(words, 3)))
    return [tokenizer.encode(p) for p in prompts]


WAVE = 4  # requests that arrive together; the engines finish them before the next wave


def _serve(tiny, policy: str, prompts: list[list[int]]) -> tuple[float, dict]:
    """Route the prompts in waves to two engines whose pools (19 blocks of 16 tokens) hold
    about two system prompts each and two running requests; (the prefix cache's hit rate over
    both, requests per replica)."""
    engines = {
        name: make_engine(tiny, enable_prefix_caching=True, num_gpu_blocks=19, max_num_seqs=2)
        for name in ("r0", "r1")
    }
    router, served = Router(policy, imbalance=4), dict.fromkeys(engines, 0)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for wave in range(0, len(prompts), WAVE):
        for i, ids in enumerate(prompts[wave : wave + WAVE], start=wave):
            loads = {
                n: e.core_stats().num_waiting + e.core_stats().num_running
                for n, e in engines.items()
            }
            name, _ = router.choose(ids, loads)
            engines[name].add_request(f"q{i}", ids, params)
            served[name] += 1
        for e in engines.values():
            while e.has_unfinished_requests():
                e.step(stream=False)
    queries = sum(e.core_stats().prefix_cache_queries for e in engines.values())
    hits = sum(e.core_stats().prefix_cache_hits for e in engines.values())
    return hits / queries, served


def test_prefix_aware_routing_finds_the_cache_more_than_round_robin(tiny):
    """Each pool holds about two system prompts: round-robin sends all four to both replicas,
    which evict each other's; prefix-aware keeps two on each."""
    prompts = _workload(tiny.tokenizer, seed=int(np.random.default_rng().integers(1 << 20)))
    rr_rate, _ = _serve(tiny, "round-robin", prompts)
    pa_rate, served = _serve(tiny, "prefix-aware", prompts)
    assert pa_rate >= 1.5 * rr_rate, (pa_rate, rr_rate)
    assert min(served.values()) >= 0.3 * len(prompts), served


def test_prompts_that_share_nothing_are_spread_over_the_replicas(tiny):
    rng = np.random.default_rng()
    prompts = [rng.integers(3, 300, int(rng.integers(20, 60))).tolist() for _ in range(32)]
    _, served = _serve(tiny, "prefix-aware", prompts)
    assert min(served.values()) >= 0.3 * len(prompts), served
