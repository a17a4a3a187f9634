"""Speculative decoding (n-gram prompt lookup, greedy verification): outputs identical with it
on and off, whatever the engine does around it, and nothing leaks."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from engine import SamplingParams
from engine.core.sequence import Sequence
from engine.core.spec_decode import (
    accept_greedy,
    accept_sampled,
    parse_speculative_config,
    propose_ngram,
)
from engine.core.spec_step import DraftPrefix, target_probs
from engine.frontend.llm import run_to_completion
from model_loader.load import load_model
from model_loader.synthetic import make_tiny_model
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
        ({"method": "eagle", "model": "x"}, "'eagle' is not implemented"),
        ({"method": "draft_model"}, "'draft_model' needs a 'model'"),
        ({"model": "x", "prompt_lookup_min": 2}, "key 'prompt_lookup_min' is not read"),
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
    if spec is None:
        engine_args.pop("draft_loaded", None)
    engine = make_engine(loaded, speculative_config=spec and json.dumps(spec), **engine_args)
    outs = run_to_completion(engine, prompts, params, check_invariants=True)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    if engine.drafter is not None:  # the draft's pool is whole again too
        assert engine.drafter.num_free_blocks == engine.drafter.num_blocks
    return [o.token_ids for o in outs], [o.text for o in outs], engine


def check_same(loaded, prompts, params, accepts=True, spec=NGRAM, **engine_args):
    """Same tokens and text with speculation; drafts were verified (and, on a workload long
    enough that the model repeats itself, some accepted: several tokens in one step)."""
    want, want_text, _ = run(loaded, prompts, params, None, **engine_args)
    got, got_text, engine = run(loaded, prompts, params, spec, **engine_args)
    assert got == want and got_text == want_text
    stats = engine.spec_stats
    assert stats.num_drafts > 0
    assert stats.num_accepted_tokens > 0 or not accepts
    return stats


@pytest.mark.parametrize("backend", ["numpy", "cpu", "cuda-cpu"])
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
    """Greedy requests keep their tokens exactly beside sampled ones (which speculate too and
    draw differently, from the same distribution: tested below), unless the two best logits
    tie within float32 rounding: a verify step computes its rows in a batch of another shape
    than a decode step's, so such a tie may go either way, and nothing else may differ."""
    rng = np.random.default_rng()
    prompts = repetitive_prompts(rng, 8, 320)
    prompts += [prompts[1] + [7, 8], prompts[2][:5]]  # shared prefixes
    params = [
        SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        if i % 3
        else SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    engine_args = dict(backend="numpy", block_size=4, num_gpu_blocks=96, max_num_seqs=8)
    engine_args |= dict(enable_prefix_caching=True, enable_chunked_prefill=True)
    ref = make_engine(tiny, record_logits=True, max_num_batched_tokens=16, **engine_args)
    outs = run_to_completion(ref, prompts, params, check_invariants=True)
    assert ref.block_manager.num_free_blocks == ref.block_manager.num_blocks
    got, _, engine = run(tiny, prompts, params, NGRAM, max_num_batched_tokens=16, **engine_args)
    for i, (o, g) in enumerate(zip(outs, got, strict=True)):
        assert len(g) == params[i].max_tokens
        if params[i].greedy and g != o.token_ids:  # only where float32 rounding decides a tie
            j = next(k for k, (a, b) in enumerate(zip(g, o.token_ids, strict=True)) if a != b)
            top2 = np.sort(o.outputs[0].step_logits[j])[-2:]
            assert top2[1] - top2[0] < 1e-5, f"prompt {i}: token {j} differs, not at a tie"
    assert engine.spec_stats.num_accepted_tokens > 0


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

    from engine.tools.live_server import MODEL, LiveServer

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


def tv(counts: np.ndarray, p: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - p).sum())


@pytest.mark.parametrize("case", ["random", "draft_has_p_zero", "draft_is_certain", "uniform"])
def test_rejection_sampling_is_exact_per_position(case):
    """Token 0 ~ p_0; token 1, given draft 0 was accepted, ~ p_1: within 3 x 0.5 sqrt(V / N) in
    total variation (the drafts' proposal is one-hot, as prompt lookup's is)."""
    rng, V, N = np.random.default_rng(), 6, 20000
    p = rng.dirichlet(np.full(V, 0.7), size=3)  # (3, V)
    drafts = [int(rng.integers(V)), int(rng.integers(V))]
    if case == "draft_has_p_zero":
        p[0, drafts[0]] = 0.0
    if case == "draft_is_certain":
        p[0] = np.eye(V)[drafts[0]]
    if case == "uniform":
        p[:] = 1.0 / V
    p /= p.sum(axis=1, keepdims=True)
    first, second = np.zeros(V), np.zeros(V)
    gen = np.random.default_rng(int(rng.integers(2**32)))
    for _ in range(N):
        out = accept_sampled(p, drafts, gen)
        first[out[0]] += 1
        if out[0] == drafts[0]:
            second[out[1]] += 1
    bound = 3 * 0.5 * np.sqrt(V / N)
    assert tv(first, p[0]) <= bound
    if case == "draft_has_p_zero":
        assert first[drafts[0]] == 0  # strict u < p: never accepted
    if second.sum() > 1000:
        assert tv(second, p[1]) <= 3 * 0.5 * np.sqrt(V / second.sum())


def draftable_prompt(top3) -> list[int]:
    """A prompt [a, d, ...base] whose likely first token is a, and whose lookup draft after a
    (d, what followed a before) is one of the top 3 then: so drafts are accepted too."""
    rng = np.random.default_rng(7)
    for _ in range(200):
        base = rng.integers(3, 320, 6).tolist()
        a, d = (int(t) for t in rng.integers(3, 320, 2))
        for _ in range(6):  # the prompt's own tokens move its top 3: iterate to a fixed point
            first, p_first = top3([a, d, *base])
            after, p_after = top3([a, d, *base, first[0]])
            if first[0] == a and d in after and p_first[0] > 0.3 and p_after[after.index(d)] > 0.2:
                return [a, d, *base]
            a, d = first[0], after[0]
    raise AssertionError("no draftable prompt found")


def top3_under(loaded):
    """ids -> (the 3 most likely next tokens, their probabilities) under temperature 1 and
    top_k 3, from the reference forward in float64."""
    from reference.model import forward

    def top3(ids):
        logits = forward(loaded.weights, loaded.config, ids).astype(np.float64)
        top = np.argsort(-logits, kind="stable")[:3]
        e = np.exp(logits[top] - logits[top].max())
        return top.tolist(), e / e.sum()

    return top3


def exact_continuations(top3, prompt: list[int], length: int = 3) -> dict[tuple, float]:
    """Every continuation of ``length`` tokens that top_k 3 sampling can draw, and its exact
    probability."""
    if length == 0:
        return {(): 1.0}
    out = {}
    for t, pt in zip(*top3(prompt), strict=True):
        for rest, pr in exact_continuations(top3, prompt + [t], length - 1).items():
            out[(t, *rest)] = pt * pr
    return out


def assert_drawn_from(outs, exact: dict[tuple, float]) -> None:
    """The outputs' continuations against the exact distribution: chi-square at p = 0.001, the
    cells expecting fewer than 5 pooled."""
    counts = dict.fromkeys(exact, 0)
    for o in outs:
        counts[tuple(o.token_ids)] += 1  # a KeyError: a continuation outside the top 3s
    keys = list(exact)
    expected = np.array([exact[t] for t in keys]) * len(outs)
    observed = np.array([counts[t] for t in keys])
    big = expected >= 5
    chi2 = ((observed[big] - expected[big]) ** 2 / expected[big]).sum()
    rest_e, rest_o = expected[~big].sum(), observed[~big].sum()
    cells = int(big.sum())
    if rest_e > 0:
        chi2 += (rest_o - rest_e) ** 2 / rest_e
        cells += 1
    assert chi2 < CHI2_999[cells - 1], (chi2, cells)


def test_rejection_sampling_through_the_engine_matches_the_exact_distribution(tiny):
    """The whole pipeline (scheduler, paged cache, speculated rows, rejection sampling): the
    distribution over 3-token continuations with top_k 3 equals the exact one computed from the
    reference forward (27 outcomes; chi-square, fixed seed, p > 0.001)."""
    top3 = top3_under(tiny)
    prompt = draftable_prompt(top3)
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    spec = json.dumps({**NGRAM, "prompt_lookup_min": 1})
    engine = make_engine(tiny, speculative_config=spec, backend="numpy", seed=1234)
    outs = run_to_completion(engine, [prompt] * 2000, params)
    assert engine.spec_stats.num_accepted_tokens > 0
    assert_drawn_from(outs, exact_continuations(top3, prompt))


# chi-square critical values at p = 0.001 for df = 1..30
CHI2_999 = [
    10.83,
    13.82,
    16.27,
    18.47,
    20.52,
    22.46,
    24.32,
    26.12,
    27.88,
    29.59,
    31.26,
    32.91,
    34.53,
    36.12,
    37.70,
    39.25,
    40.79,
    42.31,
    43.82,
    45.31,
    46.80,
    48.27,
    49.73,
    51.18,
    52.62,
    54.05,
    55.48,
    56.89,
    58.30,
    59.70,
]


def test_seeded_sampled_request_same_alone_and_in_a_batch(tiny):
    """With speculation on (and room for every draft), a seeded request draws the same tokens
    whatever shares its steps."""
    rng = np.random.default_rng()
    prompts = repetitive_prompts(rng, 7, 320)[1:]  # the first repeats a phrase
    # its tokens drawn from the phrase's alone: every one has come before, so it drafts at once
    phrase = sorted(set(prompts[0]))
    seeded = SamplingParams(
        temperature=0.9, top_k=20, max_tokens=30, seed=42, ignore_eos=True,
        allowed_token_ids=phrase,
    )  # fmt: skip
    others = SamplingParams(temperature=0.7, max_tokens=25, ignore_eos=True)
    spec = json.dumps({**NGRAM, "prompt_lookup_min": 1})
    alone = make_engine(tiny, speculative_config=spec, backend="numpy")
    (want,) = run_to_completion(alone, prompts[:1], seeded)
    batch = make_engine(tiny, speculative_config=spec, backend="numpy")
    got = run_to_completion(batch, prompts, [seeded] + [others] * 5)[0]
    assert got.token_ids == want.token_ids
    assert alone.spec_stats.num_drafts > 0


def test_stats_line_reports_acceptance(tiny):
    from engine.frontend.async_llm import engine_snapshot, format_stats_line

    rng = np.random.default_rng()
    engine = make_engine(tiny, speculative_config=json.dumps(NGRAM), backend="numpy")
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    run_to_completion(engine, repetitive_prompts(rng, 8, 320), params)
    line = format_stats_line(engine_snapshot(engine, 0.0), 10, 10, 1.0)
    st = engine.spec_stats
    assert f"spec decode acceptance {100 * st.acceptance_rate:.1f}%" in line
    assert f"mean acceptance length {st.mean_acceptance_length:.2f}" in line


def test_aborts_between_steps_and_inside_a_speculated_step(tiny):
    """Requests aborted between steps, and one aborted while its speculated step runs (between
    schedule and update): the others keep their greedy tokens, every block comes back."""
    rng = np.random.default_rng()
    prompts = repetitive_prompts(rng, 8, 320)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    keep = [0, 2, 3, 5, 6, 7]
    want, _, _ = run(tiny, [prompts[i] for i in keep], params, None, backend="numpy")
    engine = make_engine(tiny, speculative_config=json.dumps(NGRAM), backend="numpy")
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    forward = engine.runner.forward

    aborted_inside = []

    def forward_and_abort(out, greedy=False):  # request 4 leaves while its forward runs
        ids = {s.seq_id for s, _ in out.scheduled if s.request_id == "4"}
        if not aborted_inside and ids & set(out.drafts):
            aborted_inside.append(engine.abort("4"))
        return forward(out, greedy)

    engine.runner.forward = forward_and_abort
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step()})
        engine.check_invariants()
        steps += 1
        if steps == 3:
            engine.abort("1")
    assert [done[str(i)].token_ids for i in keep] == want
    assert aborted_inside == [True]  # request 4 was speculating when it left
    assert all(len(done[r].token_ids) < 48 for r in ("1", "4") if r in done)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.spec_stats.num_accepted_tokens > 0


def test_logprobs_of_speculated_tokens_come_from_the_target(tiny):
    """A greedy request with logprobs speculates too: the same tokens, and each token's top-3
    logprobs equal those without speculation (the verify rows' logits, within float32)."""
    rng = np.random.default_rng()
    prompts = repetitive_prompts(rng, 6, 320)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=3)
    outs = {}
    for spec in (None, json.dumps(NGRAM)):
        engine = make_engine(tiny, speculative_config=spec, backend="numpy")
        outs[spec] = run_to_completion(engine, prompts, params)
    assert engine.spec_stats.num_accepted_tokens > 0
    for a, b in zip(outs[None], outs[json.dumps(NGRAM)], strict=True):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert x.keys() == y.keys()
            assert max(abs(x[t] - y[t]) for t in x) < 1e-4


# ---- draft model ----
DRAFT = {"method": "draft_model", "model": "test-draft", "num_speculative_tokens": 4}


def layer_skip(loaded, num_layers: int = 1):
    """The target's first layers alone, as a draft: the same vocabulary and tokenizer, guesses
    that agree with the target often but not always."""
    c = loaded.config
    config = dataclasses.replace(
        c, num_hidden_layers=num_layers, layer_windows=c.layer_windows[:num_layers]
    )
    weights = dataclasses.replace(loaded.weights, layers=loaded.weights.layers[:num_layers])
    return dataclasses.replace(loaded, config=config, weights=weights, source="layer-skip draft")


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """Another random tiny model with the same tokenizer: its guesses are nearly all wrong."""
    return load_model(str(make_tiny_model(tmp_path_factory.mktemp("draft") / "m", seed=7)))


@pytest.mark.parametrize("backend", ["numpy", "cuda-cpu"])
def test_draft_model_equal_to_the_target_accepts_everything(tiny, backend):
    """Draft = target: every draft token is accepted, every step yields k + 1 tokens (max_tokens
    = 1 + 5m leaves room for whole drafts), and the tokens are those without speculation."""
    rng = np.random.default_rng()
    prompts = [rng.integers(3, 320, int(rng.integers(3, 30))).tolist() for _ in range(6)]
    max_tokens = 1 + 5 * int(rng.integers(3, 8))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    args = dict(backend=backend, draft_loaded=tiny)
    stats = check_same(tiny, prompts, params, spec=DRAFT, **args)
    assert stats.acceptance_rate == 1.0 and stats.mean_acceptance_length == 5.0
    assert stats.accepted_per_pos == [stats.num_drafts] * 4


def test_draft_model_partial_and_wrong_drafts_give_the_same_tokens(tiny, other_draft):
    """A layer-skip draft (partly right) and an unrelated one (wrong): greedy tokens equal,
    with prefix caching, chunked prefill and a pool small enough to preempt, and both pools
    whole at the end."""
    rng = np.random.default_rng()
    prompts = repetitive_prompts(rng, 10, 320)
    prompts += [prompts[1] + [7, 8]]  # a shared prefix
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    args = dict(backend="numpy", block_size=4, num_gpu_blocks=28, max_model_len=80)
    args |= dict(enable_prefix_caching=True, enable_chunked_prefill=True)
    args |= dict(max_num_batched_tokens=24, max_num_seqs=8)
    skip = check_same(tiny, prompts, params, spec=DRAFT, draft_loaded=layer_skip(tiny), **args)
    assert 0.0 < skip.acceptance_rate < 1.0
    wrong = check_same(
        tiny, prompts, params, accepts=False, spec=DRAFT, draft_loaded=other_draft, **args
    )
    assert wrong.acceptance_rate < skip.acceptance_rate


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_draft_model_under_preemption_and_aborts(tiny, mode):
    rng = np.random.default_rng()
    prompts = repetitive_prompts(rng, 10, 320)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    args = dict(backend="numpy", num_gpu_blocks=20, block_size=4, preemption_mode=mode)
    args |= dict(max_model_len=80, swap_space=0.01, draft_loaded=layer_skip(tiny))
    want, _, _ = run(tiny, prompts, params, None, **args)
    engine = make_engine(tiny, speculative_config=json.dumps(DRAFT), **args)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    schedule, preempted = engine.scheduler.schedule, []

    def spy(drafts=None):
        out = schedule(drafts)
        preempted.extend(out.preempted)
        return out

    engine.scheduler.schedule = spy
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step()})
        engine.check_invariants()
        steps += 1
        if steps == 6:
            assert engine.abort("3")
    assert preempted, "the pool was meant to force preemption"
    assert [done[str(i)].token_ids for i in range(10) if i != 3] == want[:3] + want[4:]
    assert engine.drafter.num_free_blocks == engine.drafter.num_blocks
    assert engine.spec_stats.num_accepted_tokens > 0


def test_draft_model_sampled_requests_keep_their_distribution(tiny):
    """Sampled requests with a layer-skip draft: the distribution over 3-token continuations
    (top_k 3; the last two from one speculated step) equals the exact one from the reference
    forward (27 outcomes; chi-square, fixed seed)."""
    n_req = 1000
    prompt = np.random.default_rng(5).integers(3, 320, 12).tolist()
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    spec = json.dumps({**DRAFT, "num_speculative_tokens": 1})
    draft = layer_skip(tiny)
    engine = make_engine(
        tiny, speculative_config=spec, backend="numpy", seed=99, draft_loaded=draft
    )
    outs = run_to_completion(engine, [prompt] * n_req, params)
    assert engine.spec_stats.num_drafts == n_req  # every request speculated its last two
    assert 0 < engine.spec_stats.num_accepted_tokens < n_req
    assert_drawn_from(outs, exact_continuations(top3_under(tiny), prompt))


def test_draft_model_refusals(tiny):
    """A draft whose vocabulary, tokenizer or context length does not fit is refused at
    startup, naming what is wrong."""
    import copy

    from engine.core.spec_step import check_draft

    small_vocab = dataclasses.replace(tiny, config=dataclasses.replace(tiny.config, vocab_size=256))
    with pytest.raises(ValueError, match="vocab_size 256 != the target's 320"):
        check_draft(small_vocab, tiny, 256)
    tok = copy.copy(tiny.tokenizer)
    tok.backend = Tokenizer.from_str(tiny.tokenizer.backend.to_str())
    tok.backend.add_tokens(["zzzz-not-in-the-target"])
    with pytest.raises(ValueError, match="tokenizer is not the target's"):
        check_draft(dataclasses.replace(tiny, tokenizer=tok), tiny, 256)
    short = dataclasses.replace(
        tiny, config=dataclasses.replace(tiny.config, max_position_embeddings=128)
    )
    with pytest.raises(ValueError, match="max_position_embeddings 128 < max_model_len 256"):
        make_engine(tiny, speculative_config=json.dumps(DRAFT), draft_loaded=short)
    check_draft(layer_skip(tiny), tiny, 256)  # the same vocabulary: accepted


def test_draft_model_in_the_memory_plan(tiny):
    """Under one memory budget, each target block also pays for a draft block, and the draft's
    weights, lookahead blocks and activation peak come out of the budget: the exact counts."""
    from engine.utils import cdiv

    draft = layer_skip(tiny)
    args = dict(backend="numpy", block_size=4, max_num_seqs=4, max_num_batched_tokens=256)
    budget = tiny.weights.nbytes() + draft.weights.nbytes() + 12_000_000
    args |= dict(num_gpu_blocks=None, memory_budget_bytes=budget, swap_space=0)
    plain = make_engine(tiny, **args)
    spec = json.dumps({**DRAFT, "num_speculative_tokens": 6})
    eng = make_engine(tiny, speculative_config=spec, draft_loaded=draft, **args)
    be, dbe = eng.backend, eng.drafter.backend
    lookahead = 4 * (cdiv(6, 4) + 1)
    peak = be.profile_peak_bytes(256, 256, 4) + dbe.profile_peak_bytes(256, 256, 4)
    room = budget - be.weights_bytes - dbe.weights_bytes - peak - lookahead * dbe.bytes_per_block
    assert eng.kv_plan.num_blocks == room // (be.bytes_per_block + dbe.bytes_per_block)
    assert eng.kv_plan.num_blocks < plain.kv_plan.num_blocks
    assert eng.kv_plan.num_draft_blocks == eng.kv_plan.num_blocks + lookahead
    assert dbe.kv_cache.shape[2] == eng.kv_plan.num_draft_blocks  # (L, 2, blocks, ...)


@pytest.mark.parametrize("spec", ["ngram", "draft_model"])
def test_penalised_greedy_requests_keep_their_tokens(tiny, spec):
    """Greedy with penalties and min_tokens is not plain greedy: its rows go through the
    sampler's processing, each counting the drafts before it as output. The tokens equal those
    without speculation, and drafts were accepted."""
    rng = np.random.default_rng()
    prompts = repetitive_prompts(rng, 12, 320)
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=1.1),
        SamplingParams(temperature=0.0, max_tokens=40, presence_penalty=0.3, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=40, min_tokens=30),
    ] * 4
    args = dict(backend="numpy")
    if spec == "draft_model":
        args["draft_loaded"] = layer_skip(tiny)
    want, _, _ = run(tiny, prompts, params, None, **args)
    got, _, engine = run(tiny, prompts, params, NGRAM if spec == "ngram" else DRAFT, **args)
    assert got == want
    assert engine.spec_stats.num_accepted_tokens > 0


def test_each_verify_row_is_the_samplers_row_after_its_drafts(tiny):
    """Row j of a speculated run has the distribution the plain sampler gives the sequence
    once it has drafts 1..j as output: penalties, min_tokens, temperature, top-k/p, min-p, on
    random logits and random parameters."""
    from engine.core.sampler import sampling_probs

    rng = np.random.default_rng()
    engine = make_engine(tiny, backend="numpy")
    V = 320
    for _ in range(30):
        greedy = rng.random() < 0.3
        params = SamplingParams(
            temperature=0.0 if greedy else float(rng.uniform(0.3, 1.5)),
            top_k=int(rng.choice([0, 5, 50])),
            top_p=float(rng.choice([1.0, 0.8])),
            min_p=float(rng.choice([0.0, 0.05])),
            repetition_penalty=float(rng.choice([1.0, 1.3])),
            presence_penalty=float(rng.uniform(0, 1.5)),
            frequency_penalty=float(rng.uniform(0, 1.5)),
            min_tokens=int(rng.integers(0, 8)),
        )
        seq = Sequence("r", rng.integers(3, V, 6).tolist(), params, 0.0)
        for t in rng.integers(3, 12, int(rng.integers(0, 5))).tolist():  # a few repeats
            seq.append_token(t)
        drafts = rng.integers(3, 12, 4).tolist()
        rows = (3 * rng.standard_normal((5, V))).astype(np.float32)  # (k+1, V)
        views = [DraftPrefix(seq, drafts[:j]) for j in range(5)]
        got = target_probs(engine.sampler, rows, views)  # (k+1, V)
        for j in range(5):
            alone = Sequence("r", seq.prompt_token_ids, params, 0.0)
            for t in seq.output_token_ids + drafts[:j]:
                alone.append_token(t)
            x = engine.sampler.process(rows[j : j + 1], [alone])  # (1, V)
            if greedy:
                want = np.zeros(V)
                want[np.argmax(x[0])] = 1.0
            else:
                want = sampling_probs(x, [params])[0]
            np.testing.assert_allclose(got[j], want, rtol=1e-6, atol=1e-7)
