"""The router at work: the rows a mixture of experts sends to each expert of each sparse layer,
counted by the backends (engine/backends/moe.py), carried in the core's stats and shown by
/metrics as pagedllm:moe_expert_tokens_total{layer, expert}; checked against the reference's
token-by-token routing (reference/moe.py) over the same tokens."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import reference.moe
from engine import SamplingParams
from engine.entrypoints.prometheus import PrometheusStatLogger
from engine.frontend.async_llm import StepStats
from engine.frontend.llm import run_to_completion
from reference.model import forward
from tests.test_families import loaded
from tests.utils import make_engine


def reference_counts(m, token_lists) -> dict[int, Counter]:
    """layer -> Counter(expert -> rows), the reference's routing of every row of each list."""
    index = {id(lw): i for i, lw in enumerate(m.weights.layers)}
    counts: dict[int, Counter] = {}
    plain = reference.moe.route_token

    def moe_mlp(x, lw, spec, act):
        for row in x.astype(np.float32) @ lw.router.astype(np.float32).T:  # (E,) per token
            chosen = plain(row, spec.top_k, spec.renormalize)
            counts.setdefault(index[id(lw)], Counter()).update(e for e, _ in chosen)
        return original(x, lw, spec, act)

    original = reference.moe.moe_mlp
    import reference.model as model

    model.moe_mlp = moe_mlp
    try:
        for ids in token_lists:
            forward(m.weights, m.config, ids)
    finally:
        model.moe_mlp = original
    return counts


@pytest.mark.parametrize("backend", ["numpy", "cpu", "cuda-cpu"])
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_expert_counts_are_the_references_routing(name, backend):
    m = loaded(name)
    rng = np.random.default_rng()
    prompts = [list(rng.integers(3, 320, size=n)) for n in rng.integers(5, 30, size=3)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine = make_engine(m, backend=backend)
    outs = run_to_completion(engine, prompts, params)
    # every row that ran: the prompts and each output token but the last
    ran = [p + list(o.token_ids[:-1]) for p, o in zip(prompts, outs, strict=True)]
    want = reference_counts(m, ran)
    got = engine.core_stats().expert_tokens
    assert [row[0] for row in got] == sorted(want)  # the sparse layers, in order
    experts = m.config.moe.num_experts
    for layer, *counts in got:
        assert counts == [want[layer][e] for e in range(experts)], f"layer {layer}"
        assert sum(counts) == sum(map(len, ran)) * m.config.moe.top_k


def test_a_dense_model_counts_nothing():
    engine = make_engine(loaded("qwen3"), backend="numpy")
    run_to_completion(engine, [[5, 6, 7]], SamplingParams(max_tokens=2))
    assert engine.core_stats().expert_tokens is None


def series(layer: int, expert: int) -> str:
    labels = f'expert="{expert}",layer="{layer}",model_name="m"'
    return f"pagedllm:moe_expert_tokens_total{{{labels}}}"


def test_metrics_show_the_counts_per_layer_and_expert():
    rng = np.random.default_rng()
    first = [[1, *rng.integers(0, 50, size=4).tolist()], [3, *rng.integers(0, 50, size=4).tolist()]]
    metrics = PrometheusStatLogger("m")
    metrics(StepStats(1.0, 1, 0, 0, 0.5, 0, 0, 0, 0, 0, [], expert_tokens=first))
    text = metrics.render().decode()
    for layer, *counts in first:
        for e, n in enumerate(counts):
            assert f"{series(layer, e)} {float(n)}\n" in text
    later = [[row[0], *(n + 7 for n in row[1:])] for row in first]
    metrics(StepStats(2.0, 1, 0, 0, 0.5, 0, 0, 0, 0, 0, [], expert_tokens=later))
    assert f"{series(3, 1)} {float(later[1][2])}\n" in metrics.render().decode()
    assert "moe_expert_tokens" not in PrometheusStatLogger("dense").render().decode()


def test_the_servers_metrics_count_a_requests_rows():
    """Through the server: a completion of a prompt and 4 tokens on Qwen3-MoE; /metrics' series
    of each sparse layer sum to top_k times the rows that ran (prompt + 3 fed back)."""
    import httpx

    from engine.tools.live_server import LiveServer

    m = loaded("qwen3_moe")
    prompt = np.random.default_rng().integers(3, 320, size=9).tolist()
    with LiveServer(m) as s:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
        body["temperature"] = 0.0
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        text = httpx.get(s.url + "/metrics", timeout=60).text
    sums: Counter = Counter()
    for line in text.splitlines():
        if line.startswith("pagedllm:moe_expert_tokens_total{"):
            layer = int(line.split('layer="')[1].split('"')[0])
            sums[layer] += float(line.rsplit(" ", 1)[1])
    sparse = [i for i, lw in enumerate(m.weights.layers) if lw.router is not None]
    assert sorted(sums) == sparse
    assert set(sums.values()) == {(9 + 3) * m.config.moe.top_k}
