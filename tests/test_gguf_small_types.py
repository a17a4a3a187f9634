"""GGUF's IQ4_XS/IQ4_NL and Q2_K/Q3_K kept as stored: a tiny llama GGUF with its matrices, table
and LM head in a pair of those types (random blocks, float16 factors giving values of a real
model's size, written by gguf-py) keeps them in the file's bytes on the cpu backend, logs none
of them as dequantized, and gives the tokens and logits of its float32 twin (numpy: exactly;
cpu: against a numpy twin that quantizes x as the kernels do); the cuda backend widens them at
load and gives the numpy backend's tokens. The layouts are checked against gguf-py's
dequantizer in tests/test_kquants.py, the kernels on every build in tests/test_cpu_kernels.py."""

from __future__ import annotations

import itertools

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

# per pair of types: (its layers, the table's and LM head's types, the blocks' d bound)
CASES = {
    # an IQ4_XS file's layers (llama-quantize's IQ4_NL where a row is not whole super-blocks);
    # d within +-0.001: IQ4_XS's values d (ls - 32) KV[q] up to about 4
    "iq4": (
        [{"attn_q": "IQ4_XS", "attn_k": "IQ4_XS", "attn_v": "IQ4_NL", "attn_output": "IQ4_XS",
          "ffn_gate": "IQ4_XS", "ffn_up": "IQ4_XS", "ffn_down": "IQ4_NL"},
         {"attn_q": "IQ4_NL", "attn_k": "IQ4_NL", "attn_v": "IQ4_NL", "attn_output": "IQ4_NL",
          "ffn_gate": "IQ4_NL", "ffn_up": "IQ4_XS", "ffn_down": "IQ4_XS"}],
        ("IQ4_NL", "IQ4_XS"), 0.001,
    ),
    # a Q3_K_M-like file's layers (Q3_K with Q2_K beside it); d within +-0.02: Q2_K's values up
    # to 45 d + 15 dmin, Q3_K's 128 d, about 1 to 3
    "q2_q3_k": (
        [{"attn_q": "Q3_K", "attn_k": "Q3_K", "attn_v": "Q2_K", "attn_output": "Q3_K",
          "ffn_gate": "Q2_K", "ffn_up": "Q3_K", "ffn_down": "Q3_K"},
         {"attn_q": "Q2_K", "attn_k": "Q2_K", "attn_v": "Q3_K", "attn_output": "Q2_K",
          "ffn_gate": "Q2_K", "ffn_up": "Q2_K", "ffn_down": "Q2_K"}],
        ("Q2_K", "Q3_K"), 0.02,
    ),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(CASES))
def files(request, tmp_path_factory):
    """(the blocks file, its float32 twin, the case's layers, its table type)."""
    layers, (first, second), d = CASES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    model_dir = make_tiny_model(tmp / "tok", seed=1)
    blocks, f32 = write_files(tmp, model_dir, np.random.default_rng(), layers, first, second, d)
    return blocks, f32, layers, second


def runs(layer: dict, *names: str) -> list[str]:
    """The kinds a fused matrix of these parts holds: neighbours of one type joined."""
    return [t.lower() for t, _ in itertools.groupby(layer[n] for n in names)]


def test_the_gguf_is_kept_as_stored(files, caplog):
    blocks, _, layers, table = files
    caplog.set_level("INFO")
    cpu = make_engine(load_model(str(blocks)), backend="cpu").backend
    for lw, want in zip(cpu.layers, layers, strict=True):
        assert kinds(lw.w_qkv) == runs(want, "attn_q", "attn_k", "attn_v")
        assert kinds(lw.w_gate_up) == runs(want, "ffn_gate", "ffn_up")
        assert lw.w_down.kind == want["ffn_down"].lower()
        assert lw.w_o.kind == want["attn_output"].lower()
    assert cpu.lm_head.kind == table.lower()
    (raw,) = [t for t in gguf.GGUFReader(str(blocks)).tensors if t.name == "blk.1.ffn_down.weight"]
    np.testing.assert_array_equal(cpu.layers[1].w_down.data, raw.data)  # the file's bytes
    for t in {t for layer in layers for t in layer.values()}:
        assert t.lower() in caplog.text  # the resident bytes by format
    assert "dequantized to float32 at load" not in caplog.text


def test_logits_equal_a_float32_load_and_the_twin(files, monkeypatch):
    blocks, f32 = (load_model(str(p)) for p in files[:2])
    assert_runs_as_the_float32_file(blocks, f32, monkeypatch, max_tokens=6)


def test_the_cuda_backend_widens_them_and_gives_numpys_tokens(files):
    """cuda-cpu (the emulated device) takes these matrices as float32 values at load, as it
    takes Q5_K: the numpy backend's tokens, and logits to float32 rounding."""
    K.build_all_cpu()
    loaded = load_model(str(files[0]))
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
