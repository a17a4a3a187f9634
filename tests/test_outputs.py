"""What CompletionOutput derives from what the engine recorded; outputs as snapshots: what an
output reads is what its request held when the output was made, however late it is read and
whatever the request did since (more tokens, a stop string that dropped tokens, its end); keyword
construction, ``==``, ``repr`` and pickling as the dataclasses had them."""

import math
import pickle

import numpy as np
import pytest

from engine.core.messages import SampleDelta
from engine.frontend.llm import run_to_completion
from engine.frontend.output_processor import OutputProcessor
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from tests.utils import make_engine


def test_cumulative_logprob_sums_the_sampled_tokens(tiny):
    with_lp = SamplingParams(temperature=0.7, seed=3, max_tokens=6, logprobs=1)
    out = run_to_completion(make_engine(tiny), ["hello there"], with_lp)[0].outputs[0]
    want = sum(lp[t] for t, lp in zip(out.token_ids, out.logprobs, strict=True))
    assert math.isclose(out.cumulative_logprob, want) and out.cumulative_logprob < 0
    plain = SamplingParams(temperature=0, max_tokens=3)
    assert (
        run_to_completion(make_engine(tiny), ["hi"], plain)[0].outputs[0].cumulative_logprob is None
    )


ARRIVAL = 10.0  # time.monotonic() seconds, as handed to add_request


def _feed(tok, params, prompt, chunks, nows, read_now):
    """Run the chunks (lists of ids) through a processor, one core step each, with a logprob
    dict and a (V,) logits row per id; the outputs, and for each output what reading it at once
    gave (for the outputs whose index is in read_now)."""
    op = OutputProcessor(tok, record_logits=True)
    op.add_request("r", None, prompt, params, ARRIVAL)
    outs, early = [], {}
    for k, (ids, now) in enumerate(zip(chunks, nows, strict=True)):
        end = "length" if k == len(chunks) - 1 else None
        lps = [{t: -float(t) / 7, t + 1: -1.0} for t in ids]
        logits = [np.full(4, t, dtype=np.float32) for t in ids]
        op.process([SampleDelta("r", 0, ids, finish_reason=end, logprobs=lps, logits=logits)], now)
        for o in op.outputs():
            if len(outs) in read_now:
                early[len(outs)] = _read(o)
            outs.append(o)
    return op, outs, early


def _read(o: RequestOutput) -> tuple:
    c = o.outputs[0]
    logits = [float(x[0]) for x in c.step_logits]
    return (list(o.prompt_token_ids), list(c.token_ids), c.text, list(c.logprobs), logits,
            o.metrics.as_dict())  # fmt: skip


def test_outputs_read_late_are_what_the_request_held_then(tiny):
    tok, rng = tiny.tokenizer, np.random.default_rng()
    prompt = rng.integers(5, 200, 6).tolist()
    ids = rng.integers(5, tok.vocab_size - 5, 12).tolist()
    nows = np.cumsum(rng.uniform(0.01, 0.1, len(ids))) + ARRIVAL + 0.5  # (T,)
    params = SamplingParams(max_tokens=len(ids), logprobs=1)
    op, outs, early = _feed(tok, params, prompt, [[t] for t in ids], nows.tolist(), {0, 5, 11})
    assert len(outs) == len(ids)
    prompt.append(-1)  # the caller's list changing later changes no output
    for k, o in enumerate(outs):
        got = _read(o)
        assert got == early.get(k, got)
        p_ids, c_ids, text, lps, logits, m = got
        assert p_ids == prompt[:-1] and c_ids == ids[: k + 1] == [int(x) for x in logits]
        assert text == tok.decode(ids[: k + 1]) or k < len(ids) - 1  # held back till the end
        assert lps == [{t: -float(t) / 7, t + 1: -1.0} for t in ids[: k + 1]]
        assert m["arrival_time"] == ARRIVAL + op.wall_offset
        assert m["first_token_time"] == nows[0] + op.wall_offset
        assert m["itl"] == pytest.approx(np.diff(nows[: k + 1]).tolist(), abs=1e-12)
        assert (m["finish_time"] is None) == (k < len(ids) - 1) == (not o.finished)
    outs[3].outputs[0].token_ids.append(-5)  # an output's list is its own
    assert outs[3].outputs[0].token_ids[-1] == -5 and outs[4].outputs[0].token_ids[-1] == ids[4]


def _stop_case(tok, rng) -> tuple[list[int], str]:
    """Nine ids of whole words and a stop string that first shows in the text of ids 4 to 6."""
    words = tok.encode("the quick brown fox jumps over a lazy dog", add_special_tokens=False)
    while True:
        ids = rng.choice(words, 9).tolist()
        early, text = tok.decode(ids[:3]), tok.decode(ids[:6])
        stop = text[-2:]
        if stop.strip() and stop not in early:
            return ids, stop


def test_a_stop_string_that_drops_tokens_leaves_earlier_outputs_as_they_were(tiny):
    tok, rng = tiny.tokenizer, np.random.default_rng()
    ids, stop = _stop_case(tok, rng)
    chunks = [ids[:3], ids[3:]]  # the stop string ends in the second step, ids after it dropped
    params = SamplingParams(max_tokens=len(ids), logprobs=1, stop=[stop])
    _, outs, early = _feed(tok, params, [1, 2], chunks, [ARRIVAL + 1, ARRIVAL + 2], {0})
    first, last = outs[0].outputs[0], outs[-1].outputs[0]
    assert _read(outs[0]) == early[0] and first.token_ids == ids[:3]
    assert last.finish_reason == "stop" and last.stop_reason == stop
    kept = len(last.token_ids)
    assert 3 < kept <= 6 and last.token_ids == ids[:kept] and len(last.logprobs) == kept


def _fields(rng) -> dict:
    metrics = RequestMetrics(arrival_time=rng.uniform(), itl=rng.uniform(size=3).tolist())
    ids = rng.integers(0, 100, 4).tolist()
    comp = CompletionOutput(
        index=0, text="ab", token_ids=ids, finish_reason="length", logprobs=[{i: -1.0} for i in ids]
    )
    prompt = rng.integers(0, 100, 3).tolist()
    return dict(request_id="x", prompt="p", prompt_token_ids=prompt, outputs=[comp],
                finished=True, metrics=metrics, num_cached_tokens=2)  # fmt: skip


def test_keyword_construction_eq_repr_and_pickle_as_dataclasses():
    rng = np.random.default_rng()
    fields = _fields(rng)
    a = RequestOutput(**fields)
    assert all(getattr(a, f) is fields[f] for f in fields)  # held as given, not copied
    b = pickle.loads(pickle.dumps(a))
    assert b == a and b is not a and b.outputs[0].cumulative_logprob == -4.0
    assert repr(a).startswith("RequestOutput(request_id='x', prompt='p', prompt_token_ids=[")
    assert "CompletionOutput(index=0, text='ab', token_ids=[" in repr(a)
    b.outputs[0].token_ids = [7]
    assert b.token_ids == [7] and a != b


def _plain_or_not(tok, logprobs, chunks, nows, streams) -> tuple[bool, list[tuple]]:
    """One request through a processor, the chunks as its deltas (the first with its cached
    tokens, the last ending it), outputs(stream) after each; whether it ran plain, and what
    each output read (logprobs left out: only one of the two asks for them)."""
    op = OutputProcessor(tok)
    op.add_request("r", "p", [7, 8, 9], SamplingParams(max_tokens=99, logprobs=logprobs), ARRIVAL)
    plain, read = op.requests["r"].plain, []
    for k, (ids, now, stream) in enumerate(zip(chunks, nows, streams, strict=True)):
        kw = dict(num_cached_tokens=0) if k == 0 else {}
        kw["finish_reason"] = "length" if k == len(chunks) - 1 else None
        if logprobs is not None:
            kw["logprobs"] = [{t: -1.0} for t in ids]
        op.process([SampleDelta("r", 0, ids, **kw)], now)
        for o in op.outputs(stream):
            c, m = o.outputs[0], o.metrics  # its clock offsets are the processor's own
            read.append((k, o.finished, c.text, c.text_delta, c.token_ids, c.finish_reason,
                         o.prompt_token_ids, o.num_cached_tokens, m.ttft, m.itl,
                         m.finish_time is None))  # fmt: skip
    return plain, read


def test_a_plain_request_reads_as_the_general_path_does(smollm2):
    """A plain request (one sample, no stop strings, no logprobs) takes the short paths; its
    outputs equal those of the same request asking for logprobs (the general path), steps
    of one token and of several, streamed or not, lone UTF-8 bytes and special tokens among
    the ids; its text is the decode of its ids, the deltas its pieces."""
    tok, rng = smollm2.tokenizer, np.random.default_rng()
    lone = [i for i, t in enumerate(tok.byte_tables[1].texts) if t is None]
    ids = rng.integers(0, tok.vocab_size, 60)
    odd = rng.random(60) < 0.3
    ids[odd] = rng.choice(lone, int(odd.sum()))
    ids[:3] = [0, 1, 2]  # special tokens, skipped
    cuts = np.sort(rng.choice(np.arange(1, 60), 30, replace=False))
    chunks = [c.tolist() for c in np.split(ids, cuts)]
    nows = (ARRIVAL + np.cumsum(rng.uniform(0.01, 0.1, len(chunks)))).tolist()
    streams = (rng.random(len(chunks)) < 0.8).tolist()
    plain, got = _plain_or_not(tok, None, chunks, nows, streams)
    general, want = _plain_or_not(tok, 1, chunks, nows, streams)
    assert plain and not general
    assert got == want and len(got) == sum(streams[:-1]) + 1
    assert got[-1][2] == tok.decode(ids.tolist()) == "".join(r[3] for r in got)
