"""Bad input: a one-line ValueError from the API (others keep running), exit 2 from the CLI."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.entrypoints.generate import main as generate_main
from tests.utils import make_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny):
    return make_engine(tiny, num_gpu_blocks=32, max_model_len=64, swap_space=0)


BAD_REQUESTS = [
    ("", GREEDY, "prompt is empty"),
    ([], GREEDY, "prompt is empty"),
    ("hello " * 80, GREEDY, "more than max_model_len=64"),
    ([5, 999999], GREEDY, "token id 999999"),
    ("hi", "not params", "params must be a SamplingParams"),
]

BAD_PARAMS = [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
]


@pytest.mark.parametrize("prompt,params,message", BAD_REQUESTS)
def test_bad_request_fails_alone(engine, prompt, params, message):
    engine.add_request("good-1", "hi my name is", GREEDY)
    engine.step()
    with pytest.raises(ValueError, match=message) as e:
        engine.add_request("bad", prompt, params)
    assert "\n" not in str(e.value)
    engine.add_request("good-2", "hello there", GREEDY)
    done = set()
    while engine.has_unfinished_requests():
        done |= {o.request_id for o in engine.step() if o.finished}
        engine.check_invariants()
    assert done == {"good-1", "good-2"}
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("kw,field", BAD_PARAMS)
def test_bad_sampling_params_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field) as e:
        SamplingParams(**kw)
    assert "\n" not in str(e.value) and repr(next(iter(kw.values()))) in str(e.value)


def test_llm_generate_rejects_a_bad_prompt_and_stays_usable(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_gpu_blocks=32, max_model_len=64, swap_space=0)
    with pytest.raises(ValueError, match="prompt 1: prompt is empty"):
        llm.generate(["hello there", "", "hi"], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    outs = llm.generate(["hello there", [5, 6, 7]], GREEDY, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [12, 12] and outs[1].prompt is None
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_unknown_model_and_engine_values():
    with pytest.raises(ValueError, match="/no/such/model"):
        LLM("/no/such/model")
    with pytest.raises(ValueError, match="preemption_mode"):
        LLM("/no/such/model", preemption_mode="sometimes")
    with pytest.raises(ValueError, match="unknown engine argument 'blocksize'"):
        LLM("/no/such/model", blocksize=16)


CLI_CASES = [
    (["--max-tokens", "0"], "max_tokens"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "1.5"], "top_p"),
    (["--prompt", ""], "prompt is empty"),
    (["--prompt", "hello " * 80, "--max-model-len", "64"], "max_model_len=64"),
    (["--preemption-mode", "sometimes"], "invalid choice"),
    (["--block-size", "x"], "invalid int value"),
]


@pytest.mark.parametrize("argv,message", CLI_CASES)
def test_cli_bad_input_is_one_line_exit_2(tiny_model_dir, capsys, argv, message):
    argv = ["--model", str(tiny_model_dir), "--num-gpu-blocks", "32", "--swap-space", "0"] + argv
    try:
        rc = generate_main(argv + ["--no-tqdm"])
    except SystemExit as e:  # argparse errors exit directly
        rc = e.code
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert rc == 2 and len(err) == 1 and message in err[0]


def test_cli_unknown_model_exits_2_in_a_real_process():
    r = subprocess.run(
        [sys.executable, "-m", "engine.generate", "--model", "/no/such/model"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "/no/such/model" in r.stderr


# ---- every bad value is refused before anything is queued; the others keep running ----


def assert_all_free(engine):
    """Nothing left running, the invariants hold and every block is back in the pool."""
    engine.check_invariants()
    bm = engine.block_manager
    assert not engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks


def serve_others_after(engine, add_bad, message):
    """add_bad() raises a one-line ValueError matching message; a good request then finishes."""
    with pytest.raises(ValueError, match=message) as e:
        add_bad()
    assert "\n" not in str(e.value)
    engine.add_request("good", "hello there", GREEDY)
    done = set()
    for _ in range(50):  # bounded: a leak must fail, not spin
        done |= {o.request_id for o in engine.step() if o.finished}
        engine.check_invariants()
        if not engine.has_unfinished_requests():
            break
    assert done == {"good"}
    assert_all_free(engine)


@pytest.mark.parametrize(
    "arrival",
    ["x", float("nan"), float("inf"), -float("inf"), time.time(), 1e300, [1.0]],
    ids=["str", "nan", "inf", "-inf", "wall-clock", "1e300", "list"],
)
def test_bad_arrival_time_is_refused(engine, arrival):
    add = lambda: engine.add_request("bad", "hi", GREEDY, arrival_time=arrival)  # noqa: E731
    serve_others_after(engine, add, "arrival_time must be")


def test_arrival_time_is_on_the_monotonic_clock(engine):
    engine.add_request("past", "hi", GREEDY, arrival_time=np.float64(time.monotonic() - 2.0))
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert 2.0 <= outs["past"].metrics.ttft < 60.0
    arrival = outs["past"].metrics.arrival_time  # reported on the wall clock
    assert time.time() - 60.0 < arrival <= time.time() - 2.0
    assert_all_free(engine)


BAD_PROMPTS = [
    ([1.5, 2.7], "token ids must be integers"),
    (("5", "6"), "token ids must be integers"),
    ([True, False], "token ids must be integers"),
    ([5, None], "token ids must be integers"),
    ([[5, 6], [7]], "token ids must be integers"),
    (np.array([[5, 6], [7, 8]]), "1-D integer array"),
    (np.array([5.0, 6.0]), "1-D integer array"),
    ([5, -1], "token id -1 is outside"),
    ("bad \ud800", "lone surrogate at character 4"),
]


@pytest.mark.parametrize("prompt,message", BAD_PROMPTS)
def test_bad_prompt_is_refused(engine, prompt, message):
    serve_others_after(engine, lambda: engine.add_request("bad", prompt, GREEDY), message)


def test_numpy_token_ids_are_plain_ints(engine):
    ids = engine.add_request("np", np.array([5, 6, 7], dtype=np.int32), GREEDY)
    assert ids == [5, 6, 7] and all(type(t) is int for t in ids)
    engine.abort("np")
    assert_all_free(engine)


def test_huge_text_is_refused_before_tokenizing(engine, monkeypatch):
    calls = []
    monkeypatch.setattr(engine.tokenizer, "encode", lambda *a, **k: calls.append(a) or [5])
    add = lambda: engine.add_request("bad", "x" * 10_000_000, GREEDY)  # noqa: E731
    with pytest.raises(ValueError, match="characters, more than max_model_len=64"):
        add()
    assert calls == []  # never tokenized
    assert engine.max_prompt_chars >= 64  # one character per token at least


def test_n_above_max_num_seqs_is_refused_before_allocating(engine):
    add = lambda: engine.add_request("bad", "hi", SamplingParams(n=10**5))  # noqa: E731
    serve_others_after(engine, add, r"n must be in \[1, max_num_seqs=\d+\], got 100000")


def test_sampling_params_are_frozen(engine):
    p = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.n = 0
    assert p.n == 1


def test_bad_sampling_values_name_field_and_range():
    cases = [
        (dict(top_p=1e-50), r"top_p must be a finite number in \[1e-06, 1\]"),
        (dict(temperature=float("inf")), r"temperature must be a finite number in \[0, 100\]"),
        (dict(temperature=1e39, min_tokens=4), "temperature must be"),
        (dict(repetition_penalty=1e-45), r"repetition_penalty must be .* in \[0.01, 100\]"),
        (dict(logprobs=10**9), r"logprobs must be an integer in \[0, 20\]"),
        (dict(stop=5), "stop must be a non-empty string or a list of non-empty strings"),
        (dict(stop=[b"x"]), "stop must be"),
        (dict(stop_token_ids=np.array([[5]])), "stop_token_ids must be"),
        (dict(stop_token_ids=[True]), "stop_token_ids must be"),
        (dict(n=True), "n must be"),
        (dict(temperature=np.bool_(True)), "temperature must be"),
    ]
    for kw, message in cases:
        with pytest.raises(ValueError, match=rf"^SamplingParams: {message}") as e:
            SamplingParams(**kw)
        assert "\n" not in str(e.value)


def test_numpy_numbers_are_accepted_as_plain_python():
    p = SamplingParams(
        n=np.int64(2),
        top_k=np.int32(5),
        seed=np.uint64(7),
        temperature=np.float32(0.5),
        top_p=np.float64(0.9),
        logprobs=np.int16(20),
        stop_token_ids=np.array([5, 6]),
        stop=("a", "b"),
    )
    assert (p.n, p.top_k, p.seed, p.logprobs, p.temperature) == (2, 5, 7, 20, 0.5)
    assert [type(v) for v in (p.n, p.top_k, p.seed, p.temperature)] == [int, int, int, float]
    assert p.stop_token_ids == [5, 6] and type(p.stop_token_ids[0]) is int
    assert p.stop == ["a", "b"]


# ---- LLM.generate: nothing of a failed call keeps running ----


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), num_gpu_blocks=32, max_model_len=64, swap_space=0)


@pytest.mark.parametrize(
    "bad", ["bad \ud800", [5, None], [[5, 6], [7]], np.array([[5, 6], [7, 8]])]
)
def test_generate_cleans_up_after_a_bad_prompt(llm, bad):
    with pytest.raises(ValueError, match="prompt 1: "):
        llm.generate(["hello there", bad, "hi"], GREEDY, use_tqdm=False)
    assert_all_free(llm.engine)


def test_generate_cleans_up_after_ctrl_c_while_adding(llm, monkeypatch):
    add = llm.engine.add_request

    def add_then_interrupt(rid, *args, **kw):
        if rid.endswith("-1"):
            raise KeyboardInterrupt
        return add(rid, *args, **kw)

    monkeypatch.setattr(llm.engine, "add_request", add_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["hello there", "hi", "hi"], GREEDY, use_tqdm=False)
    assert_all_free(llm.engine)


def test_generate_cleans_up_after_ctrl_c_while_stepping(llm, monkeypatch):
    step, calls = llm.engine.step, []

    def step_then_interrupt(**kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step(**kwargs)

    monkeypatch.setattr(llm.engine, "step", step_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["hello there", "hi"], GREEDY, use_tqdm=False)
    assert_all_free(llm.engine)
    monkeypatch.undo()
    outs = llm.generate(["hello there"], GREEDY, use_tqdm=False)
    assert len(outs) == 1 and len(outs[0].token_ids) == 12


def test_generate_takes_numpy_token_ids(llm):
    (one,) = llm.generate(np.array([5, 6, 7]), GREEDY, use_tqdm=False)
    (two,) = llm.generate([np.int64(5), np.int64(6), np.int64(7)], GREEDY, use_tqdm=False)
    assert one.prompt_token_ids == two.prompt_token_ids == [5, 6, 7]
    assert one.token_ids == two.token_ids


# ---- LLMEngine.stream: leaving early aborts the request ----


def test_leaving_a_stream_early_aborts_its_request(engine):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    gen = engine.stream("hello there", params)
    next(gen)
    gen.close()
    assert_all_free(engine)
    for _piece in engine.stream("hello there", params):
        break  # the generator is dropped here, which closes it
    assert_all_free(engine)
