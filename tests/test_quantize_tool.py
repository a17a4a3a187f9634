"""``python -m engine.tools.quantize`` and ``--quantization q4_k_m`` (model_loader.gguf_quantize,
model_loader.quantize_weights) on a tiny llama (width 256, ffn 576: ffn_down falls back):
  * a safetensors directory and a float32 GGUF of the same model written by the loader tests'
    own writer (tests/test_loaders.write_gguf: its own Q/K permutation and tokenizer keys) give
    the same tensors, byte for byte, in the types kquant_mix names;
  * the GGUF the tool writes loads in the engine with weights within the type's error of the
    checkpoint's (a wrong Q/K row order would be off by the weights' size);
  * ``--quantization q4_k_m`` on the checkpoint gives the same logits as loading that GGUF.
(llama.cpp itself is not run here: docs/models.md states what was checked against it.)"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from engine.frontend.llm import run_to_completion
from engine.sampling_params import SamplingParams
from engine.tools import quantize as tool
from model_loader import kquant_encode, kquant_mix
from model_loader.load import load_model
from model_loader.synthetic import make_tiny_model
from tests.test_loaders import write_gguf
from tests.utils import SEED_PROMPTS, make_engine

SHAPE = dict(hidden_size=256, intermediate_size=576, num_hidden_layers=4, num_attention_heads=4)
SHAPE.update(num_key_value_heads=2, head_dim=64)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(checkpoint dir, its float32 GGUF, the tool's q4_k_m GGUF of each)."""
    tmp = tmp_path_factory.mktemp("quantize")
    rng = np.random.default_rng()
    d = make_tiny_model(tmp / "ckpt", seed=int(rng.integers(1 << 30)), **SHAPE)
    cfg = load_model(str(d), weights=False).config
    keys = dict(SHAPE, vocab_size=cfg.vocab_size, rope_theta=cfg.rope_theta)
    keys.update(max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=1e-5)
    f32 = write_gguf(tmp / "f32.gguf", keys, load_file(str(d / "model.safetensors")), d)
    out = {}
    for src, dst in ((d, tmp / "from_ckpt.gguf"), (f32, tmp / "from_gguf.gguf")):
        assert tool.main([str(src), str(dst), "--type", "q4_k_m"]) == 0
        out[src] = dst
    return d, f32, out[d], out[f32]


def tensors(path):
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def test_checkpoint_and_gguf_give_the_same_bytes_in_the_mix_types(model, capsys):
    _, f32, a, b = model
    ta, tb, src = tensors(a), tensors(b), tensors(f32)
    assert set(ta) == set(tb) == set(src)
    shapes = {n: tuple(int(x) for x in reversed(t.shape)) for n, t in src.items()}
    want = kquant_mix.tensor_types(shapes, "q4_k_m", SHAPE["num_hidden_layers"])
    assert {ta[n].tensor_type.name for n in ta} >= {"Q4_K", "Q6_K", "Q5_0", "Q8_0"}
    for name in ta:
        assert ta[name].tensor_type.name == (want[name] or "F32"), name
        assert tb[name].tensor_type == ta[name].tensor_type, name
        np.testing.assert_array_equal(np.asarray(ta[name].data), np.asarray(tb[name].data), name)
        if want[name]:  # the blocks of the source's float32 values
            values = np.asarray(src[name].data, np.float32).reshape(shapes[name])
            raw = kquant_encode.quantize(values, want[name])
            np.testing.assert_array_equal(np.asarray(ta[name].data).reshape(raw.shape), raw)


def test_the_written_gguf_loads_near_the_checkpoint(model):
    d, _, a, _ = model
    ckpt, quant = load_model(str(d)), load_model(str(a))
    assert quant.tokenizer.encode("hello world") == ckpt.tokenizer.encode("hello world")
    for (name, x), (_, y) in zip(ckpt.weights.arrays(), quant.weights.arrays(), strict=True):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        rel = np.sqrt(np.mean((x - y) ** 2) / np.mean(x**2))
        assert rel < (0.12 if x.ndim == 2 else 1e-7), (name, rel)


def test_quantization_flag_equals_loading_the_tools_file(model):
    d, _, a, _ = model
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)

    def run(loaded, **kw):
        e = make_engine(loaded, backend="numpy", record_logits=True, **kw)
        outs = run_to_completion(e, SEED_PROMPTS[:2], greedy)
        return [(o.outputs[0].token_ids, np.stack(o.outputs[0].step_logits)) for o in outs]

    flag = run(load_model(str(d)), quantization="q4_k_m")
    for (tf, lf), (tg, lg) in zip(flag, run(load_model(str(a))), strict=True):
        assert tf == tg
        np.testing.assert_array_equal(lf, lg)


def test_quantization_flag_keeps_blocks_on_the_cpu_backend(model):
    e = make_engine(load_model(str(model[0])), backend="cpu", quantization="q5_k_m")
    kinds = {getattr(layer.w_down, "kind", None) for layer in e.backend.layers}
    assert e.backend.quantization == "q5_k_m" and kinds == {"q5_1", "q8_0"}


def test_refusals_are_one_line(model, capsys, tmp_path):
    _, _, a, _ = model
    assert tool.main([str(a), str(tmp_path / "again.gguf"), "--type", "q6_k"]) == 2
    err = capsys.readouterr().err
    assert "is already Q" in err and "F32, F16 or BF16" in err
    with pytest.raises(SystemExit):
        tool.main([str(a), str(tmp_path / "x.gguf"), "--type", "q3_k_m"])
    with pytest.raises(SystemExit) as e:
        tool.main(["--help"])
    assert e.value.code == 0
    assert "q4_k_m" in capsys.readouterr().out
