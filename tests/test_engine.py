"""The engine end to end against the reference, the golden data, and its own block invariants."""

from __future__ import annotations

import time

import numpy as np
import pytest

from engine import LLMEngine, SamplingParams
from engine.core.messages import SampleDelta
from engine.frontend.llm import run_to_completion
from engine.frontend.output_processor import OutputProcessor
from engine.golden import read_golden
from engine.utils import MiB
from reference.generate import generate as reference_generate
from tests.spies import count_forwards
from tests.utils import SEED_PROMPTS, make_engine, with_eos

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def run_all(engine: LLMEngine, prompts, params, check=True) -> list:
    """Add every prompt, step until done (checking invariants each step); outputs in order."""
    outs = run_to_completion(engine, prompts, params, check_invariants=check)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return outs


def reference_tokens(loaded, prompt: str, n: int) -> list[int]:
    ids = loaded.tokenizer.encode(prompt)
    return reference_generate(loaded.weights, loaded.config, ids, n).token_ids


# ---- greedy equals the reference ----


def test_tiny_greedy_equals_reference_batched_and_alone(tiny):
    engine = make_engine(tiny, record_logits=True)
    batched = run_all(engine, SEED_PROMPTS, GREEDY)
    for prompt, out in zip(SEED_PROMPTS, batched, strict=True):
        ids = tiny.tokenizer.encode(prompt)
        ref = reference_generate(tiny.weights, tiny.config, ids, GREEDY.max_tokens)
        assert out.prompt_token_ids == ids
        assert out.token_ids == ref.token_ids
        got = np.stack(out.outputs[0].step_logits)  # (steps, V)
        np.testing.assert_allclose(got, np.stack(ref.logits), atol=1e-4, rtol=1e-4)
        assert out.text == tiny.tokenizer.decode(out.token_ids)
        (alone,) = run_all(engine, [prompt], GREEDY)
        assert alone.token_ids == out.token_ids
        assert out.finish_reason == "length"


def test_smollm2_greedy_equals_reference_golden_and_alone(smollm2):
    """On the cpu backend (auto's choice here); the numpy backend's SmolLM2 run is the single
    process that test_tensor_parallel's ranks are held against."""
    engine = make_engine(smollm2, num_gpu_blocks=32, max_model_len=512, backend="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    batched = run_all(engine, SEED_PROMPTS, params, check=False)
    golden = {c["prompt"]: c for c in read_golden("smollm2")["cases"]}
    for prompt, out in zip(SEED_PROMPTS, batched, strict=True):
        assert out.token_ids == reference_tokens(smollm2, prompt, 16) + out.token_ids[16:]
        if prompt in golden:
            assert out.prompt_token_ids == golden[prompt]["prompt_token_ids"]
            assert out.token_ids == golden[prompt]["token_ids"]
    short = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (alone,) = run_all(engine, [SEED_PROMPTS[1]], short, check=False)
    assert alone.token_ids == batched[1].token_ids[:12]


# ---- plain-greedy steps: argmax on the backend, no (B, V) logits to the host ----


def spy_forwards(engine: LLMEngine):
    """(forward, forward_greedy) counters installed on the engine's backend."""
    return count_forwards(engine.backend)


def mixed_params() -> list[SamplingParams]:
    """Plain greedy (the longest), then rows that need the host: a seeded draw (4 tokens), a
    min_tokens ban (3 of 5 tokens; EOS allowed after it), logprobs (6), a penalty (7): each is
    the only one left that needs the host for a step or more."""
    g = dict(temperature=0.0, ignore_eos=True)
    return [
        SamplingParams(max_tokens=12, **g),
        SamplingParams(temperature=0.8, top_k=20, seed=11, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=0.0, min_tokens=3, max_tokens=5),
        SamplingParams(logprobs=3, max_tokens=6, **g),
        SamplingParams(repetition_penalty=1.5, max_tokens=7, **g),
    ]


def test_plain_greedy_steps_never_bring_logits_to_the_host(tiny):
    engine = make_engine(tiny)
    forward, greedy = spy_forwards(engine)
    outs = run_all(engine, SEED_PROMPTS, GREEDY)
    assert forward.calls == 0 and greedy.calls == GREEDY.max_tokens  # one call per step
    for prompt, out in zip(SEED_PROMPTS, outs, strict=True):
        assert out.token_ids == reference_tokens(tiny, prompt, GREEDY.max_tokens)


HOST_ROWS = {  # a row that needs the host, and the steps it does (of its 4 tokens)
    "sampled": (SamplingParams(temperature=0.8, seed=5, max_tokens=4, ignore_eos=True), 4),
    "logprobs": (SamplingParams(temperature=0.0, logprobs=2, max_tokens=4, ignore_eos=True), 4),
    "penalty": (SamplingParams(temperature=0.0, presence_penalty=1.5, max_tokens=4), 4),
    "min_tokens": (SamplingParams(temperature=0.0, min_tokens=3, max_tokens=4), 3),
}


@pytest.mark.parametrize("kind", sorted(HOST_ROWS))
def test_one_host_row_sends_its_steps_to_the_host(tiny, kind):
    params, host_steps = HOST_ROWS[kind]
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine, host = make_engine(tiny), make_engine(tiny, record_logits=True)
    forward, greedy = spy_forwards(engine)
    outs = run_all(engine, SEED_PROMPTS[:2], [plain, params])
    want = run_all(host, SEED_PROMPTS[:2], [plain, params])
    assert (forward.calls, greedy.calls) == (host_steps, 8 - host_steps)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert outs[1].outputs[0].logprobs == want[1].outputs[0].logprobs
    assert outs[0].token_ids == reference_tokens(tiny, SEED_PROMPTS[0], 8)


def test_mixed_batch_falls_back_to_the_host_sampler(tiny):
    prompts = SEED_PROMPTS + ["the quick brown fox", "once upon a time"]
    engine = make_engine(tiny)
    forward, greedy = spy_forwards(engine)
    outs = run_all(engine, prompts, mixed_params())
    host = make_engine(tiny, record_logits=True)  # recording logits: every step on the host
    host_forward, host_greedy = spy_forwards(host)
    want = run_all(host, prompts, mixed_params())
    assert (forward.calls, greedy.calls) == (7, 5)  # host while a row needs it, then greedy
    assert (host_forward.calls, host_greedy.calls) == (12, 0)
    for out, ref in zip(outs, want, strict=True):
        assert out.token_ids == ref.token_ids and out.text == ref.text
        assert out.outputs[0].logprobs == ref.outputs[0].logprobs
    assert outs[0].token_ids == reference_tokens(tiny, prompts[0], 12)
    assert len(outs[3].outputs[0].logprobs) == 6 and len(outs[2].token_ids) >= 3


# ---- preemption and the pool ----


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_small_pool_preempts_and_gives_same_tokens(tiny, mode):
    prompts = SEED_PROMPTS + ["the quick brown fox", "once upon a time in a land"]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    big = run_all(make_engine(tiny), prompts, params)
    small = make_engine(tiny, num_gpu_blocks=8, max_model_len=64, preemption_mode=mode)
    outs = run_all(small, prompts, params)
    assert small.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in big]


def test_pool_size_from_memory_budget(tiny):
    engine = make_engine(tiny, num_gpu_blocks=None, memory_budget_bytes=64 << 20)
    be, cfg = engine.backend, engine.config
    peak = be.profile_peak_bytes(cfg.max_num_batched_tokens, cfg.max_model_len, cfg.max_num_seqs)
    swap = engine.block_manager.num_cpu_blocks * be.bytes_per_block  # host memory too
    expect = ((64 << 20) - be.weights_bytes - peak - swap) // be.bytes_per_block
    assert engine.block_manager.num_blocks == expect
    c = tiny.config
    assert (
        be.bytes_per_block == 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4 * 16
    )
    assert be.kv_cache.shape == (c.num_hidden_layers, 2, expect, 16, c.num_key_value_heads, 16)


def test_startup_fails_when_one_sequence_cannot_fit(tiny):
    with pytest.raises(ValueError, match="max_model_len=256 tokens needs 16 blocks"):
        make_engine(tiny, num_gpu_blocks=15)
    with pytest.raises(
        ValueError, match="activation peak of max_num_batched_tokens=2048 tokens .* needs"
    ):
        make_engine(tiny, num_gpu_blocks=None, memory_budget_bytes=MiB)


# ---- stops, n, streaming, abort ----


def test_stop_token_ids_stop_strings_and_min_tokens(tiny):
    engine = make_engine(tiny)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    (full,) = run_all(engine, [SEED_PROMPTS[0]], params)
    ids = full.token_ids
    stop_id = ids[5]
    first = ids.index(stop_id)
    (o,) = run_all(
        engine, [SEED_PROMPTS[0]], SamplingParams(**{**_greedy(), "stop_token_ids": [stop_id]})
    )
    assert o.token_ids == ids[: first + 1] and o.finish_reason == "stop"
    (o,) = run_all(
        engine,
        [SEED_PROMPTS[0]],
        SamplingParams(**{**_greedy(), "stop_token_ids": [stop_id], "min_tokens": first + 2}),
    )
    # the stop id is banned until first + 2 tokens exist: the same path up to it, then another
    assert o.token_ids[:first] == ids[:first] and stop_id not in o.token_ids[: first + 1]
    assert len(o.token_ids) > first + 1
    text = full.text
    at = next(i for i in range(len(text) // 2, len(text) - 1) if "\ufffd" not in text[i : i + 2])
    stop = text[at : at + 2]
    (o,) = run_all(engine, [SEED_PROMPTS[0]], SamplingParams(**{**_greedy(), "stop": [stop]}))
    assert o.finish_reason == "stop" and o.text == text[: text.index(stop)]


class _OneText:
    """A detokenizer whose every token reads as the same text."""

    def __init__(self, text: str):
        self.text = text

    def add(self, token: int) -> str:
        return self.text


@pytest.mark.parametrize("stop", [["dying", "stu"], ["stu", "dying"], ["udy", "dying", "stu"]])
def test_the_earliest_stop_string_wins_whatever_the_order(stop):
    """One token brings "I was studying": every stop string matches; the text ends before the
    first, and the core is told to finish the sample."""
    op = OutputProcessor(tokenizer=None)
    op._detokenizer = lambda ids, params: _OneText("I was studying")
    op.add_request("r", None, [1, 2], SamplingParams(stop=stop, max_tokens=8), 0.0)
    assert op.process([SampleDelta("r", 0, [5])], 1.0) == [("r", 0, 1)]
    (out,) = op.outputs()
    assert out.finished and out.outputs[0].text == "I was " and out.outputs[0].stop_reason == "stu"


def _greedy() -> dict:
    return dict(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_eos_ends_unless_ignored(tiny):
    engine = make_engine(tiny)
    (full,) = run_all(engine, [SEED_PROMPTS[2]], SamplingParams(**_greedy()))
    eos = full.token_ids[3]  # a model whose EOS is it
    engine = make_engine(with_eos(tiny, eos))
    (o,) = run_all(engine, [SEED_PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=24))
    assert o.token_ids == full.token_ids[: full.token_ids.index(eos) + 1]
    assert o.finish_reason == "stop"
    (o,) = run_all(engine, [SEED_PROMPTS[2]], SamplingParams(**_greedy()))
    assert o.token_ids == full.token_ids and o.finish_reason == "length"


def test_n_samples_streaming_and_abort(tiny):
    engine = make_engine(tiny)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=20, ignore_eos=True, seed=7)
    (o,) = run_all(engine, [SEED_PROMPTS[0]], params)
    assert [c.index for c in o.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in o.outputs}) == 3  # three different samples
    chunks = list(engine.stream(SEED_PROMPTS[1], SamplingParams(**_greedy())))
    (ref,) = run_all(engine, [SEED_PROMPTS[1]], SamplingParams(**_greedy()))
    assert "".join(c.text for c in chunks) == ref.text and len(chunks) > 1
    assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    engine.add_request("a", SEED_PROMPTS[0], SamplingParams(**_greedy()))
    engine.add_request("b", SEED_PROMPTS[1], SamplingParams(**_greedy()))
    engine.step()
    engine.step()
    assert engine.abort("a") and not engine.abort("nope")
    engine.check_invariants()
    finished = [o for _ in range(30) for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["b"]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_metrics_report_wall_clock_times(tiny):
    before = time.time()
    (o,) = run_all(make_engine(tiny), [SEED_PROMPTS[0]], SamplingParams(max_tokens=4))
    m = o.metrics
    assert before <= m.arrival_time <= m.first_token_time <= m.finish_time <= time.time()
    assert 0 < m.ttft <= m.e2e_latency and set(m.as_dict()) >= {"ttft", "e2e_latency", "itl"}


def test_metrics_and_max_model_len(tiny):
    engine = make_engine(tiny, max_model_len=32, num_gpu_blocks=4)
    (o,) = run_all(
        engine, [SEED_PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    )
    assert len(o.prompt_token_ids) + len(o.token_ids) == 32 and o.finish_reason == "length"
    m = o.metrics
    assert m.arrival_time < m.first_token_time <= m.finish_time
    assert m.ttft == pytest.approx(m.first_token_time - m.arrival_time, abs=1e-5)
    assert m.e2e_latency == pytest.approx(m.finish_time - m.arrival_time, abs=1e-5)
    assert len(m.itl) == len(o.token_ids) - 1 and min(m.itl) > 0


def test_a_greedy_row_with_no_token_ends_that_request_with_an_error(tiny):
    """The device argmax answers -1 for a row of NaN/-inf: that request fails with an error,
    the other one goes on, and every block comes back."""
    engine = make_engine(tiny)
    forward_greedy, calls = engine.backend.forward_greedy, []

    def first_row_fails_once(batch):
        ids = forward_greedy(batch)  # (B,)
        if not calls:
            ids[0] = -1
        calls.append(1)
        return ids

    engine.backend.forward_greedy = first_row_fails_once
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = run_to_completion(engine, ["hello there", "hi my name is"], sp)
    failed = [o.outputs[0] for o in outs if o.outputs[0].error]
    (ok,) = [o for o in outs if not o.outputs[0].error]
    assert len(failed) == 1 and "sampling failed" in failed[0].error
    assert failed[0].finish_reason == "abort" and len(ok.token_ids) == 4
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_stream_serves_each_of_n_samples_with_its_finish_reason(tiny):
    engine = make_engine(tiny)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, ignore_eos=True, seed=11)
    chunks = list(engine.stream(SEED_PROMPTS[0], params))
    (ref,) = run_all(engine, [SEED_PROMPTS[0]], params)  # the same seed: the same samples
    for c in ref.outputs:
        mine = [k for k in chunks if k.index == c.index]
        assert "".join(k.text for k in mine) == c.text
        assert [k.finish_reason for k in mine][-1] == "length"
        assert all(k.finish_reason is None for k in mine[:-1])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
