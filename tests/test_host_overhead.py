"""The host loop around the stub backend: the host-overhead benchmark's run, the batch the runner
prepares from its persistent page tables (against a plain flattening), and ``step(stream=False)``
against streaming steps."""

import numpy as np
import pytest

from engine.backends.stub import StubBackend, stub_next_token
from engine.frontend.llm import run_to_completion
from engine.frontend.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.tools import host_overhead
from engine.utils import cdiv
from model_loader.tokenizer import IncrementalDetokenizer


def stub_engine(loaded, **engine_args) -> LLMEngine:
    return LLMEngine(
        loaded.source, loaded=loaded, backend_factory=host_overhead.stub_backend, **engine_args
    )


def test_host_overhead_run_prints_its_figures(smollm2):
    """A short run at batch 1 and 64, both ways of stepping: every request ends with exactly the
    stub's tokens (measure checks them), and each figure is there and positive."""
    runs = [
        host_overhead.measure(smollm2, b, steps=8, warmup=2, prompt_len=24, split=True, stream=s)
        for b in (1, 64)
        for s in (False, True)
    ]
    print("\n" + host_overhead.format_table(runs))
    for run in runs:
        assert len(run.step_ms) == len(run.cpu_ms) == 8 and min(run.step_ms) > 0
        assert all(len(run.part_ms[name]) == 8 for name, _ in host_overhead.PARTS)
        assert run.part_median_ms("forward") > 0


def test_host_overhead_check_catches_a_wrong_token(smollm2):
    prompts = {"0": [5, 6, 7], "1": [8, 9]}
    vocab = smollm2.config.vocab_size
    want = host_overhead.expected_tokens(list(prompts.values()), 4, vocab)  # (2, 4)
    outs = {}
    for rid, row in zip(prompts, want, strict=True):
        outs[rid] = type("Out", (), dict(finish_reason="length", token_ids=row.tolist()))()
    host_overhead.check_outputs(outs, prompts, 4, vocab)
    outs["1"].token_ids[2] += 1
    with pytest.raises(AssertionError, match="request 1: tokens differ"):
        host_overhead.check_outputs(outs, prompts, 4, vocab)


def test_stub_backend_needs_num_gpu_blocks(smollm2):
    with pytest.raises(ValueError, match="^StubBackend: num_gpu_blocks must be set"):
        stub_engine(smollm2, max_model_len=64)


def plain_batch(out, block_size: int) -> dict:
    """The step's arrays, flattened sequence by sequence from the scheduler's output."""
    tokens, positions, slots, tables, ctx = [], [], [], [], []
    for seq, n in out.scheduled:
        start = seq.num_computed_tokens
        tokens += seq.token_ids[start : start + n]
        positions += list(range(start, start + n))
        table = seq.block_table[: cdiv(start + n, block_size)]
        slots += [table[p // block_size] * block_size + p % block_size for p in positions[-n:]]
        tables.append(table)
        ctx.append(start + n)
    width = max(map(len, tables))
    padded = [t + [-1] * (width - len(t)) for t in tables]
    qsl = np.cumsum([0] + [n for _, n in out.scheduled])
    return dict(
        token_ids=tokens,
        positions=positions,
        slot_mapping=slots,
        block_tables=padded,
        context_lens=ctx,
        query_start_loc=qsl.tolist(),
    )


class PrepareChecker:
    """Wraps ``runner.prepare``: every batch it builds must equal ``plain_batch``."""

    def __init__(self, runner):
        self.prepare, self.block_size, self.steps = runner.prepare, runner.block_size, 0
        runner.prepare = self

    def __call__(self, out):
        batch = self.prepare(out)
        for name, want in plain_batch(out, self.block_size).items():
            got = getattr(batch, name)
            assert got.dtype == np.int32, name
            assert got.tolist() == want, f"step {self.steps}: {name}"
        assert batch.num_decodes == out.num_decodes
        self.steps += 1
        return batch


@pytest.mark.parametrize(
    "mode",
    [
        dict(preemption_mode="recompute"),
        dict(preemption_mode="swap", swap_space=0.01),
        dict(enable_prefix_caching=True),
        dict(enable_chunked_prefill=True, max_num_batched_tokens=48),
    ],
    ids=["recompute", "swap", "prefix-caching", "chunked"],
)
def test_prepared_batches_match_a_plain_flattening_under_preemption(smollm2, mode):
    """A pool too small for the batch (preemptions, swaps, prefix hits, chunks): every step's
    batch equals the plain flattening, and every request gets exactly the stub's tokens."""
    rng = np.random.default_rng(7)
    vocab = smollm2.config.vocab_size
    base = rng.integers(100, vocab - 100, 40).tolist()
    prompts = [base[: rng.integers(8, 40)] + rng.integers(100, 900, 5).tolist() for _ in range(12)]
    lens = rng.integers(5, 40, len(prompts)).tolist()
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
    engine = stub_engine(smollm2, num_gpu_blocks=24, max_num_seqs=8, max_model_len=96, **mode)
    checker = PrepareChecker(engine.runner)
    outs = run_to_completion(engine, prompts, params, check_invariants=True)
    assert checker.steps > max(lens)
    if "enable_prefix_caching" not in mode and "enable_chunked_prefill" not in mode:
        assert engine.scheduler.num_preemptions > 0
    for prompt, n, out in zip(prompts, lens, outs, strict=True):
        want = host_overhead.expected_tokens([prompt], n, vocab)[0].tolist()
        assert out.token_ids == want and out.finish_reason == "length"


def mixed_requests(vocab: int) -> list[tuple[list[int], SamplingParams]]:
    """Greedy and seeded sampling, n=2, stop strings, stop token ids, EOS, min_tokens."""
    rng = np.random.default_rng(3)
    prompt = [rng.integers(100, vocab - 100, int(k)).tolist() for k in rng.integers(4, 30, 8)]
    last, pos = np.array([prompt[3][-1]]), np.array([len(prompt[3]) - 1])
    stop_id = int(stub_next_token(last, pos, vocab)[0])  # request 3's first token stops it
    return [
        (prompt[0], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)),
        (prompt[1], SamplingParams(temperature=1.0, seed=11, max_tokens=15, n=2)),
        (prompt[2], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=25)),
        (prompt[3], SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_id])),
        (prompt[4], SamplingParams(temperature=0.0, max_tokens=30, stop=["e", "th"])),
        (prompt[5], SamplingParams(temperature=1.0, seed=5, max_tokens=12, logprobs=2)),
        (prompt[6], SamplingParams(temperature=0.0, max_tokens=9, min_tokens=3)),
        (prompt[7], SamplingParams(temperature=0.0, max_tokens=4, stop=["\n"])),
    ]


def final_outputs(engine: LLMEngine, requests, stream: bool) -> dict:
    """Every request's last output, stepping with ``step(stream)``; with stream=False each step
    must return finished outputs only."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step(stream=stream):
            assert stream or o.finished
            done[o.request_id] = o
    return done


def test_final_only_steps_give_the_same_outputs_as_streaming(smollm2):
    """Text, tokens, finish and stop reasons, logprobs: the same with and without per-step
    outputs (text detokenized at the end versus token by token), and each text is the
    tokenizer's decode of its tokens, cut at its stop string."""
    vocab, tok = smollm2.config.vocab_size, smollm2.tokenizer
    requests = mixed_requests(vocab)
    kw = dict(num_gpu_blocks=64, max_num_seqs=8, max_model_len=128)
    final = final_outputs(stub_engine(smollm2, **kw), requests, stream=False)
    streamed = final_outputs(stub_engine(smollm2, **kw), requests, stream=True)
    assert final.keys() == streamed.keys() == {str(i) for i in range(len(requests))}
    for rid, (_, params) in enumerate(requests):
        a, b = final[str(rid)], streamed[str(rid)]
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            assert (ca.token_ids, ca.text) == (cb.token_ids, cb.text), rid
            assert (ca.finish_reason, ca.stop_reason) == (cb.finish_reason, cb.stop_reason)
            assert ca.logprobs == cb.logprobs
            full = tok.decode(ca.token_ids)
            assert full.startswith(ca.text) and (ca.text == full or params.stop), rid
    reasons = {c.finish_reason for o in final.values() for c in o.outputs}
    assert reasons == {"stop", "length"}


def test_add_last_equals_adding_one_by_one_then_finish(smollm2):
    tok, rng = smollm2.tokenizer, np.random.default_rng(1)
    for _ in range(20):
        ids = rng.integers(0, tok.vocab_size, int(rng.integers(1, 12))).tolist()
        for skip in (True, False):
            one = IncrementalDetokenizer(tok, [1], skip_special_tokens=skip)
            want = "".join(map(one.add, ids)) + one.finish()
            assert IncrementalDetokenizer(tok, [1], skip).add_last(ids) == want
            half = IncrementalDetokenizer(tok, [1], skip)
            assert half.add(ids[0]) + half.add_last(ids[1:]) == want


def test_stub_backend_logits_pick_its_token(smollm2):
    """forward's logits and forward_greedy's ids agree (the sampled path sees the same model)."""
    engine = stub_engine(smollm2, num_gpu_blocks=8, max_model_len=64)
    assert isinstance(engine.backend, StubBackend)
    engine.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=1))
    out = engine.scheduler.schedule()
    batch = engine.runner.prepare(out)
    logits = engine.backend.forward(batch)  # (1, V)
    assert logits.argmax(-1).tolist() == engine.backend.forward_greedy(batch).tolist()
    assert engine.backend.forward_greedy(batch).tolist() == [
        host_overhead.expected_tokens([[5, 6, 7, 8]], 1, smollm2.config.vocab_size)[0, 0]
    ]
