"""GGUF's Q2_K and Q3_K kept as stored: a tiny llama GGUF with its matrices, table and LM head
in those types (random blocks, float16 factors giving values of a real model's size, written by
gguf-py) keeps them in the file's bytes on the cpu backend, logs none of them as dequantized,
and gives the tokens and logits of its float32 twin (numpy: exactly; cpu: against a numpy twin
that quantizes x as the kernels do); the cuda backend widens them at load and gives the numpy
backend's tokens. The layouts are checked against gguf-py's dequantizer in
tests/test_kquants.py, the kernels on every build in tests/test_cpu_kernels.py."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine import LLMEngine
from engine import kernels as K
from engine.frontend.llm import run_to_completion
from engine.sampling_params import SamplingParams
from model_loader.load import load_model
from model_loader.synthetic import make_tiny_model
from tests.test_kquants import assert_runs_as_the_float32_file, kinds, write_files
from tests.utils import SEED_PROMPTS, make_engine

# a Q3_K_M-like file's layers (Q3_K with Q2_K beside it) and one of each type in every place
LAYERS = [
    {"attn_q": "Q3_K", "attn_k": "Q3_K", "attn_v": "Q2_K", "attn_output": "Q3_K",
     "ffn_gate": "Q2_K", "ffn_up": "Q3_K", "ffn_down": "Q3_K"},
    {"attn_q": "Q2_K", "attn_k": "Q2_K", "attn_v": "Q3_K", "attn_output": "Q2_K",
     "ffn_gate": "Q2_K", "ffn_up": "Q2_K", "ffn_down": "Q2_K"},
]  # fmt: skip


@pytest.fixture(scope="module")
def low_files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("q2_q3_k")
    model_dir = make_tiny_model(tmp / "tok", seed=1)
    # d within +-0.02: Q2_K's values up to 45 d + 15 dmin, Q3_K's 128 d: about 1 to 3, as the
    # other k-quant files' values
    return write_files(tmp, model_dir, np.random.default_rng(), LAYERS, "Q2_K", "Q3_K", 0.02)


def test_a_q2_q3_gguf_is_kept_as_stored(low_files, caplog):
    blocks, _ = low_files
    caplog.set_level("INFO")
    loaded = load_model(str(blocks))
    cpu = make_engine(loaded, backend="cpu").backend
    l0, l1 = cpu.layers
    assert kinds(l0.w_qkv) == ["q3_k", "q2_k"] and kinds(l1.w_qkv) == ["q2_k", "q3_k"]
    assert kinds(l0.w_gate_up) == ["q2_k", "q3_k"] and l0.w_down.kind == "q3_k"
    assert kinds(l1.w_gate_up) == ["q2_k"] and l1.w_down.kind == "q2_k"
    assert l0.w_o.kind == "q3_k" and cpu.lm_head.kind == "q3_k"
    (raw,) = [t for t in gguf.GGUFReader(str(blocks)).tensors if t.name == "blk.1.ffn_down.weight"]
    np.testing.assert_array_equal(l1.w_down.data, raw.data)  # the file's bytes
    assert "q2_k" in caplog.text and "q3_k" in caplog.text  # the resident bytes by format
    assert "dequantized to float32 at load" not in caplog.text


def test_q2_q3_logits_equal_a_float32_load_and_the_twin(low_files, monkeypatch):
    blocks, f32 = (load_model(str(p)) for p in low_files)
    assert_runs_as_the_float32_file(blocks, f32, monkeypatch, max_tokens=6)


def test_the_cuda_backend_widens_them_and_gives_numpys_tokens(low_files):
    """cuda-cpu (the emulated device) takes Q2_K and Q3_K matrices as float32 values at load,
    as it takes Q5_K: the numpy backend's tokens, and logits to float32 rounding."""
    K.build_all_cpu()
    loaded = load_model(str(low_files[0]))
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)

    def run(engine):
        outs = run_to_completion(engine, SEED_PROMPTS[:2], greedy)
        return [(o.outputs[0].token_ids, np.stack(o.outputs[0].step_logits)) for o in outs]

    want = run(make_engine(loaded, backend="numpy", record_logits=True))
    kw = {"num_gpu_blocks": 64, "max_model_len": 256, "swap_space": 0.01, "record_logits": True}
    engine = LLMEngine(loaded=loaded, model="test", backend="cuda-cpu", **kw)
    assert engine.backend.layers[0].w_down.dtype == np.float32
    for (tg, g), (tw, w) in zip(run(engine), want, strict=True):
        assert tg == tw
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * np.abs(w).max())
