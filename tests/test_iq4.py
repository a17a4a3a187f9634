"""GGUF's IQ4_XS and IQ4_NL kept as stored: a tiny llama GGUF with its matrices, table and LM
head in those types (random blocks, float16 factors of a real model's size, written by
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

# an IQ4_XS file's layers (llama-quantize's IQ4_NL where a row is not whole super-blocks),
# and one of each type in every place
LAYERS = [
    {"attn_q": "IQ4_XS", "attn_k": "IQ4_XS", "attn_v": "IQ4_NL", "attn_output": "IQ4_XS",
     "ffn_gate": "IQ4_XS", "ffn_up": "IQ4_XS", "ffn_down": "IQ4_NL"},
    {"attn_q": "IQ4_NL", "attn_k": "IQ4_NL", "attn_v": "IQ4_NL", "attn_output": "IQ4_NL",
     "ffn_gate": "IQ4_NL", "ffn_up": "IQ4_XS", "ffn_down": "IQ4_XS"},
]  # fmt: skip


@pytest.fixture(scope="module")
def iq4_files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("iq4")
    model_dir = make_tiny_model(tmp / "tok", seed=1)
    # d within +-0.001: IQ4_XS's values d (ls - 32) KV[q] up to about 4, as the k-quants' file's
    return write_files(tmp, model_dir, np.random.default_rng(), LAYERS, "IQ4_NL", "IQ4_XS", 0.001)


def test_an_iq4_gguf_is_kept_as_stored(iq4_files, caplog):
    blocks, _ = iq4_files
    caplog.set_level("INFO")
    loaded = load_model(str(blocks))
    cpu = make_engine(loaded, backend="cpu").backend
    l0, l1 = cpu.layers
    assert kinds(l0.w_qkv) == ["iq4_xs", "iq4_nl"] and l1.w_qkv.kind == "iq4_nl"
    assert kinds(l0.w_gate_up) == ["iq4_xs"] and l0.w_down.kind == "iq4_nl"
    assert kinds(l1.w_gate_up) == ["iq4_nl", "iq4_xs"] and l1.w_down.kind == "iq4_xs"
    assert cpu.lm_head.kind == "iq4_xs"
    (raw,) = [t for t in gguf.GGUFReader(str(blocks)).tensors if t.name == "blk.0.ffn_down.weight"]
    np.testing.assert_array_equal(l0.w_down.data, raw.data)  # the file's bytes
    assert "iq4_xs" in caplog.text and "iq4_nl" in caplog.text  # the resident bytes by format
    assert "dequantized to float32 at load" not in caplog.text


def test_iq4_logits_equal_a_float32_load_and_the_twin(iq4_files, monkeypatch):
    blocks, f32 = (load_model(str(p)) for p in iq4_files)
    assert_runs_as_the_float32_file(blocks, f32, monkeypatch, max_tokens=6)


def test_the_cuda_backend_widens_them_and_gives_numpys_tokens(iq4_files):
    """cuda-cpu (the emulated device) takes IQ4 matrices as float32 values at load, as it takes
    Q5_K: the numpy backend's tokens, and logits to float32 rounding."""
    K.build_all_cpu()
    loaded = load_model(str(iq4_files[0]))
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
