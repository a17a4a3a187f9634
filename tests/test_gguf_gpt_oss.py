"""gpt-oss GGUF files: this test's writer holds to the layout llama.cpp's converter writes
(tests/data/gguf_moe_layout.json, scripts/record_gguf_moe_layout.py); the file loads to the
checkpoint's weights with llama.cpp's fixed SwiGLU constants; and the engine's greedy tokens on
it are llama.cpp's own (scripts/make_llama_cpp_greedy_golden.py: its converter's file run by
llama-simple)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file

from engine import SamplingParams
from engine.frontend.llm import run_to_completion
from model_loader.load import load_model
from reference.model import forward
from tests.test_families import FAMILY_DIR, loaded
from tests.test_gguf_moe import layout
from tests.test_loaders import add_tensor, gguf_tokenizer_metadata
from tests.utils import make_engine

LAYOUT = json.loads((Path(__file__).parent / "data" / "gguf_moe_layout.json").read_text())
NAMES = {  # HF name after model.layers.{i}. -> GGUF name after blk.{i}.
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.sinks": "attn_sinks.weight",
    "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias",
    "mlp.experts.down_proj_bias": "ffn_down_exps.bias",
    **{f"self_attn.{x}_proj.{k}": f"attn_{x}.{k}" for x in "qkv" for k in ("weight", "bias")},
    **{f"self_attn.o_proj.{k}": f"attn_output.{k}" for k in ("weight", "bias")},
}
LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "lm_head.weight": "output.weight",
    "model.norm.weight": "output_norm.weight",
}


def gguf_tensors() -> dict[str, np.ndarray]:
    """GGUF name -> array (NumPy orientation), as llama.cpp's converter lays a gpt-oss
    checkpoint out: gate and up de-interleaved into (E, F, D), down transposed to (E, D, F)."""
    out = {}
    for hf, t in load_file(str(FAMILY_DIR / "gpt_oss" / "model.safetensors")).items():
        if hf in TOP:
            out[TOP[hf]] = t
            continue
        i, rest = LAYER.fullmatch(hf).groups()
        blk = f"blk.{i}."
        if rest == "mlp.experts.gate_up_proj":  # (E, D, 2F), gate and up interleaved
            out[blk + "ffn_gate_exps.weight"] = t[:, :, 0::2].transpose(0, 2, 1)
            out[blk + "ffn_up_exps.weight"] = t[:, :, 1::2].transpose(0, 2, 1)
        elif rest == "mlp.experts.gate_up_proj_bias":  # (E, 2F)
            out[blk + "ffn_gate_exps.bias"], out[blk + "ffn_up_exps.bias"] = t[:, 0::2], t[:, 1::2]
        elif rest == "mlp.experts.down_proj":  # (E, F, D)
            out[blk + "ffn_down_exps.weight"] = t.transpose(0, 2, 1)
        else:
            out[blk + NAMES[rest]] = t
    return out


def write_gpt_oss_gguf(path, qtype=Q.F32, experts=None) -> None:
    """The tiny checkpoint as a GGUF file (weight matrices of 2 and 3 dims as qtype, the
    experts' as ``experts`` (None: qtype), the router and every vector float32), the metadata
    llama.cpp's converter writes. Q8_0 with MXFP4 experts is llama-quantize's MXFP4_MOE."""
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    for key, value in LAYOUT["gpt_oss"]["f32"]["metadata"].items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    gguf_tokenizer_metadata(w, FAMILY_DIR / "gpt_oss")
    for name, t in gguf_tensors().items():
        quantized = name.endswith(".weight") and t.ndim >= 2 and "ffn_gate_inp" not in name
        kind = (experts or qtype) if "_exps." in name else qtype
        add_tensor(w, name, np.ascontiguousarray(t, np.float32), kind if quantized else Q.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=["f32", "q8_0"])
def test_the_writer_writes_llama_cpps_layout(qtype, tmp_path):
    path = tmp_path / "gpt_oss.gguf"
    write_gpt_oss_gguf(path, qtype)
    got, want = layout(path), LAYOUT["gpt_oss"][qtype.name.lower()]
    assert got["architecture"] == want["architecture"] == "gpt-oss"
    assert got["tensors"] == want["tensors"]
    assert got["metadata"].keys() == want["metadata"].keys()


def test_gguf_loads_as_the_checkpoint_with_llama_cpps_constants(tmp_path):
    """Every weight as the safetensors checkpoint's; the windows, the experts and the yarn
    RoPE (untruncated) the same; the SwiGLU limit llama.cpp's 7 (the file has no key for it)."""
    path = tmp_path / "gpt_oss.gguf"
    write_gpt_oss_gguf(path)
    hf, gg = loaded("gpt_oss"), load_model(str(path))
    assert gg.config.layer_windows == hf.config.layer_windows == (8, 0, 8)
    assert gg.config.rope == hf.config.rope
    assert gg.config.moe.swiglu_limit == 7.0 and hf.config.moe.swiglu_limit == 1.5
    assert gg.config.moe.biases and gg.config.spec.sinks
    for a, b in zip(hf.weights.layers, gg.weights.layers, strict=True):
        for field in ("wq", "bq", "bo", "sinks", "e_gate", "e_up", "e_down", "router"):
            np.testing.assert_array_equal(getattr(b, field), getattr(a, field), field)
        for field in ("router_bias", "e_gate_bias", "e_up_bias", "e_down_bias", "mlp_norm"):
            np.testing.assert_array_equal(getattr(b, field), getattr(a, field), field)
    ids = list(np.random.default_rng().integers(3, 320, size=30))
    seven = forward(gg.weights, gg.config, ids)
    assert np.abs(seven - forward(hf.weights, hf.config, ids)).max() > 1e-3  # the limit acts


FILES = {"f32": (Q.F32, None), "mxfp4_moe": (Q.Q8_0, Q.MXFP4)}
QUANT_MARGIN = 0.05  # logits this close are a tie under 8-bit activations


def agreed(got: list[int], want: list[int], step_logits) -> int:
    """How many leading tokens agree; where they first differ, our top two logits must be
    within QUANT_MARGIN (a near tie), else the difference is a failure."""
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a != b:
            top2 = np.sort(np.asarray(step_logits[i]))[-2:]
            assert top2[1] - top2[0] < QUANT_MARGIN, f"step {i}: {a} != {b} by {top2}"
            return i
    return len(want)


@pytest.mark.parametrize("backend", ["numpy", "cpu", "cuda-cpu"])
@pytest.mark.parametrize("kind", sorted(FILES))
def test_greedy_tokens_are_llama_cpps(kind, backend, tmp_path):
    """llama.cpp's own greedy tokens after a 49-token prompt (six windows), in 20-token
    prefill chunks: on its converter's float32 file, all 24; on that file through
    llama-quantize's MXFP4_MOE (experts MXFP4, the other matrices Q8_0: gguf-py quantizes both
    as llama-quantize does, bit for bit; the experts stay in their blocks on the cpu backend)
    every token up to the first step whose top two logits are within QUANT_MARGIN of each
    other here (llama.cpp's activations are quantized to 8 bits and its KV cache is float16:
    a near tie may go either way), and at least the first 10."""
    case = json.loads((FAMILY_DIR / "llama_cpp_greedy.json").read_text())["cases"]["gpt_oss"]
    case = case[kind]
    path = tmp_path / "gpt_oss.gguf"
    write_gpt_oss_gguf(path, *FILES[kind])
    params = SamplingParams(temperature=0.0, max_tokens=len(case["token_ids"]), ignore_eos=True)
    engine = make_engine(
        load_model(str(path)), backend=backend, max_num_batched_tokens=20, max_num_seqs=4,
        enable_chunked_prefill=True, record_logits=True,
    )  # fmt: skip
    out = run_to_completion(engine, [case["prompt_token_ids"]], params)[0]
    if kind == "f32":
        assert out.token_ids == case["token_ids"]
    else:
        agree = agreed(out.token_ids, case["token_ids"], out.outputs[0].step_logits)
        assert agree >= 10, f"{agree} tokens agree"
    experts = next(lw.experts for lw in engine.backend.layers if lw.experts is not None)
    if backend == "cpu" and kind == "mxfp4_moe":
        assert {w.kind for w in (*experts.gate_up, *experts.down)} == {"mxfp4"}
    if backend == "cuda-cpu":  # the blocks as stored, read by moe_matmul
        assert experts.fmt == ("mxfp4" if kind == "mxfp4_moe" else "dtype")
        assert experts.gate_up.dtype == (np.uint8 if kind == "mxfp4_moe" else np.float32)
