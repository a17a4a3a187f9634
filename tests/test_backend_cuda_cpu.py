"""The ``cuda-cpu`` backend: the whole engine with every operation run by the CUDA kernels on the
CPU emulator gives the reference's greedy tokens (tiny model, SmolLM2), with preemption too."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine import LLMEngine, SamplingParams
from engine import kernels as K
from engine.backends.cupy_backend import CupyBackend
from engine.emulation.device import EmulatedDevice
from engine.frontend.llm import run_to_completion
from engine.generate import main as generate_main
from engine.golden import read_golden
from reference.generate import generate as reference_generate

PROMPTS = ["hi my name is", "today is a beautiful summer day", "hello there"]


def make_engine(loaded, **kw) -> LLMEngine:
    kw = {"num_gpu_blocks": 64, "max_model_len": 256, "swap_space": 0.01, **kw}
    return LLMEngine(loaded=loaded, model="test", backend="cuda-cpu", **kw)


@pytest.fixture(scope="module", autouse=True)
def built_kernels():
    """Compile every kernel file once, two g++ processes at a time (cached by content hash)."""
    K.build_all_cpu()


def test_backend_is_the_gpu_backend_on_the_emulated_device(tiny, caplog):
    with caplog.at_level("INFO", logger="engine.backend"):
        engine = make_engine(tiny)
    be = engine.backend
    assert type(be) is CupyBackend and type(be.device) is EmulatedDevice
    assert be.name == "cuda-cpu" and be.kv_dtype == "float32"
    assert be.max_num_seqs == 256 and sorted(be.graphs) == [1, 2, 4, 8]  # the emulator's limit
    assert "backend cuda-cpu: CupyBackend on cpu (CUDA emulation)" in caplog.text


def test_tiny_greedy_equals_reference(tiny):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = run_to_completion(make_engine(tiny, record_logits=True), PROMPTS, greedy)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ref = reference_generate(tiny.weights, tiny.config, tiny.tokenizer.encode(prompt), 24)
        assert out.token_ids == ref.token_ids
        got = np.stack(out.outputs[0].step_logits)  # (steps, V)
        np.testing.assert_allclose(got, np.stack(ref.logits), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tiny_small_pool_preempts_and_keeps_reference_tokens(tiny, mode):
    prompts = PROMPTS + ["the quick brown fox", "once upon a time in a land"]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    small = make_engine(tiny, num_gpu_blocks=8, max_model_len=64, preemption_mode=mode)
    outs = run_to_completion(small, prompts, params)
    assert small.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        ids = tiny.tokenizer.encode(prompt)
        assert out.token_ids == reference_generate(tiny.weights, tiny.config, ids, 40).token_ids


@pytest.mark.slow
def test_smollm2_greedy_equals_golden(smollm2):
    """SmolLM2-135M (30 layers) in float32 against the committed Hugging Face golden tokens."""
    cases = {c["prompt"]: c for c in read_golden("smollm2")["cases"]}
    n = 6
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    engine = make_engine(smollm2, num_gpu_blocks=32, max_model_len=512)
    outs = run_to_completion(engine, PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.prompt_token_ids == cases[prompt]["prompt_token_ids"]
        assert out.token_ids == cases[prompt]["token_ids"][:n]


def test_generate_cli_on_cuda_cpu(tiny_model_dir, tiny, capsys):
    argv = [
        "--model",
        str(tiny_model_dir),
        "--backend",
        "cuda-cpu",
        "--json",
        "--prompt",
        PROMPTS[0],
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--num-gpu-blocks",
        "16",
        "--swap-space",
        "0",
        "--max-model-len",
        "128",
        "--no-tqdm",
    ]
    assert generate_main(argv) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ids = tiny.tokenizer.encode(PROMPTS[0])
    assert row["token_ids"] == reference_generate(tiny.weights, tiny.config, ids, 6).token_ids
