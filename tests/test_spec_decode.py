"""Speculative decoding (n-gram prompt lookup, greedy verification): outputs identical with it
on and off, whatever the engine does around it, and nothing leaks."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import SamplingParams
from engine.llm import run_to_completion
from engine.spec_decode import accept_greedy, parse_speculative_config, propose_ngram
from tests.test_families import loaded as family
from tests.utils import make_engine

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
NGRAM["prompt_lookup_max"] = 3


def naive_ngram(ids, k, n_min, n_max):
    """The definition, by brute force: the longest n-gram first, its earliest earlier match."""
    for n in range(n_max, n_min - 1, -1):
        if n >= len(ids):
            continue
        tail = ids[-n:]
        for start in range(len(ids) - n):
            if ids[start : start + n] == tail:
                return ids[start + n : start + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    k=st.integers(1, 6),
    n_min=st.integers(1, 3),
    extra=st.integers(0, 3),
)
def test_ngram_matches_its_definition(ids, k, n_min, extra):
    assert propose_ngram(ids, k, n_min, n_min + extra) == naive_ngram(ids, k, n_min, n_min + extra)


def test_ngram_prefers_the_longest_then_the_earliest_match():
    assert propose_ngram([1, 2, 9, 3, 2, 8, 1, 2], 2, 1, 2) == [9, 3]  # "1 2" beats "2"
    assert propose_ngram([5, 7, 5, 8, 5], 3, 1, 1) == [7, 5, 8]  # the earliest "5"
    assert propose_ngram([1, 2, 3], 3, 1, 3) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=6), st.data())
def test_accept_greedy_is_the_greedy_continuation(drafts, data):
    target = data.draw(st.lists(st.integers(0, 2), min_size=len(drafts) + 1))
    target = target[: len(drafts) + 1]
    got = accept_greedy(drafts, target)
    pairs = zip(drafts, target, strict=False)
    n = next((i for i, (d, t) in enumerate(pairs) if d != t), len(drafts))
    assert got == target[: n + 1] and got[:-1] == drafts[:n]


@pytest.mark.parametrize(
    "value, words",
    [
        ({"method": "draft_model", "model": "x"}, "'draft_model' is not implemented"),
        ({"method": "magic"}, "method must be one of"),
        ({**NGRAM, "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
        ({**NGRAM, "prompt_lookup_min": 4}, "prompt_lookup_max must be an integer >="),
        ({**NGRAM, "top_secret": 1}, "key 'top_secret' is not read"),
        ({**NGRAM, "disable_by_batch_size": 0}, "disable_by_batch_size must be"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_speculative_config_refusals(value, words):
    with pytest.raises(ValueError, match="speculative_config") as e:
        parse_speculative_config(value)
    assert words in str(e.value)


def test_one_bound_sets_the_other():
    c = parse_speculative_config('{"method": "ngram", "prompt_lookup_min": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.num_speculative_tokens) == (3, 3, 4)


def repetitive_prompts(rng, n: int, vocab: int) -> list[list[int]]:
    """Prompts that repeat a random phrase (prompt lookup finds drafts in them), and a few that
    do not."""
    out = []
    for i in range(n):
        phrase = rng.integers(3, vocab, size=int(rng.integers(3, 9))).tolist()
        out.append(
            phrase * int(rng.integers(2, 5)) if i % 4 else rng.integers(3, vocab, 9).tolist()
        )
    return out


def run(loaded, prompts, params, spec, **engine_args):
    engine = make_engine(loaded, speculative_config=spec and json.dumps(spec), **engine_args)
    outs = run_to_completion(engine, prompts, params, check_invariants=True)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [o.token_ids for o in outs], [o.text for o in outs], engine


def check_same(loaded, prompts, params, accepts=True, **engine_args):
    """Same tokens and text with speculation; drafts were verified (and, on a workload long
    enough that the model repeats itself, some accepted: several tokens in one step)."""
    want, want_text, _ = run(loaded, prompts, params, None, **engine_args)
    got, got_text, engine = run(loaded, prompts, params, NGRAM, **engine_args)
    assert got == want and got_text == want_text
    stats = engine.spec_stats
    assert stats.num_drafts > 0
    assert stats.num_accepted_tokens > 0 or not accepts
    return stats


@pytest.mark.parametrize("backend", ["numpy", "cuda-cpu"])
def test_greedy_outputs_identical_with_speculation(tiny, backend):
    rng = np.random.default_rng()
    prompts = repetitive_prompts(rng, 8, 320)
    params = SamplingParams(temperature=0.0, max_tokens=int(rng.integers(40, 60)), ignore_eos=True)
    stats = check_same(tiny, prompts, params, backend=backend)
    assert 1.0 < stats.mean_acceptance_length <= 5.0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_speculation_under_preemption(tiny, mode):
    rng = np.random.default_rng()
    prompts = repetitive_prompts(rng, 10, 320)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    engine_args = dict(backend="numpy", num_gpu_blocks=20, block_size=4, preemption_mode=mode)
    engine_args["max_model_len"] = 80
    check_same(tiny, prompts, params, swap_space=0.01, **engine_args)


def test_speculation_with_prefix_caching_chunked_prefill_and_mixed_sampling(tiny):
    rng = np.random.default_rng()
    prompts = repetitive_prompts(rng, 8, 320)
    prompts += [prompts[1] + [7, 8], prompts[2][:5]]  # shared prefixes
    params = [
        SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        if i % 3
        else SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    check_same(
        tiny,
        prompts,
        params,
        backend="numpy",
        block_size=4,
        num_gpu_blocks=96,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        max_num_seqs=8,
    )


def test_stops_and_max_tokens_inside_a_draft(tiny):
    """Stop ids and stop strings end a sequence at the token that stops it, even mid-draft."""
    rng = np.random.default_rng()
    prompts = repetitive_prompts(rng, 8, 320)
    base, _, _ = run(tiny, prompts, SamplingParams(temperature=0.0, max_tokens=30), None)
    stop_ids = sorted({t for out in base for t in out[5:8]})[:3]
    text = tiny.tokenizer.decode(base[1][6:8])
    for params in (
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=stop_ids),
        SamplingParams(temperature=0.0, max_tokens=30, stop=[text] if text.strip() else None),
        SamplingParams(temperature=0.0, max_tokens=int(rng.integers(2, 7)), ignore_eos=True),
    ):
        want, want_text, _ = run(tiny, prompts, params, None, backend="numpy")
        got, got_text, _ = run(tiny, prompts, params, NGRAM, backend="numpy")
        assert got == want and got_text == want_text


@pytest.mark.parametrize("name", ["mistral", "qwen3"])
def test_speculation_over_family_kernels(name):
    """Speculated runs through sliding windows (mistral) and q/k norms (qwen3) on cuda-cpu."""
    rng = np.random.default_rng()
    prompts = repetitive_prompts(rng, 6, 320)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine_args = dict(backend="cuda-cpu", block_size=4, num_gpu_blocks=96)
    check_same(family(name), prompts, params, accepts=False, **engine_args)


def test_async_scheduling_with_speculation(tiny):
    rng = np.random.default_rng()
    prompts = repetitive_prompts(rng, 6, 320)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    check_same(tiny, prompts, params, backend="numpy", async_scheduling=True)


def test_disable_by_batch_size(tiny):
    """Six sequences run together to the end: a limit of 5 proposes nothing, 6 proposes."""
    rng = np.random.default_rng()
    prompts = repetitive_prompts(rng, 6, 320)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    drafts = {}
    for limit in (5, 6):
        spec = json.dumps({**NGRAM, "disable_by_batch_size": limit})
        engine = make_engine(tiny, speculative_config=spec, backend="numpy")
        run_to_completion(engine, prompts, params)
        drafts[limit] = engine.spec_stats.num_drafts
    assert drafts[5] == 0 < drafts[6]


def test_server_speculates_and_exports_the_counters(tiny):
    """Greedy completions through the server equal the engine's without speculation, and
    /metrics carries vLLM's spec_decode counters (per position too)."""
    import re

    import httpx

    from tests.serve_utils import MODEL, LiveServer

    rng = np.random.default_rng()
    prompts = repetitive_prompts(rng, 4, 320)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    _, want, _ = run(tiny, prompts, params, None, backend="numpy")
    with LiveServer(tiny, backend="numpy", speculative_config=json.dumps(NGRAM)) as s:
        body = dict(model=MODEL, max_tokens=48, temperature=0.0, ignore_eos=True)
        got = []
        for p in prompts:
            r = httpx.post(s.url + "/v1/completions", json=body | {"prompt": p}, timeout=60)
            got.append(r.json()["choices"][0]["text"])
        text = httpx.get(s.url + "/metrics").text
        st = s.engine.spec_stats
    assert got == want

    def metric(name, labels=""):
        m = re.search(rf"^pagedllm:{name}\{{[^}}]*{labels}[^}}]*\}} (\S+)$", text, re.M)
        assert m, f"no {name} in /metrics"
        return float(m.group(1))

    assert st.num_drafts > 0
    assert metric("spec_decode_num_drafts_total") == st.num_drafts
    assert metric("spec_decode_num_draft_tokens_total") == st.num_draft_tokens
    assert metric("spec_decode_num_accepted_tokens_total") == st.num_accepted_tokens
    first = metric("spec_decode_num_accepted_tokens_per_pos_total", 'position="0"')
    assert first == st.accepted_per_pos[0]
