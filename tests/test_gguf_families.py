"""GGUF files of the families, written as llama.cpp's converter writes them, load to the same
model as the Hugging Face checkpoint: qwen2 (q/k/v biases), qwen3 (q/k norms, head_dim 32),
gemma (norms stored as 1 + w), phi3 (fused attn_qkv and gate|up in ffn_up, sliding window),
llama3 (RoPE scaling as the rope_freqs.weight factors); gemma2 and gemma3 (sandwich norms,
soft-caps, sliding layers by period, Gemma 3's two RoPEs) run as llama.cpp runs them: its own
greedy tokens on files its converter wrote (scripts/make_llama_cpp_greedy_golden.py)."""

from __future__ import annotations

import dataclasses
import json
import math

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from model_loader.gguf_file import read_gguf
from model_loader.load import load_model
from model_loader.rope import inv_freq
from reference.model import forward
from tests.test_families import FAMILY_DIR, loaded
from tests.test_loaders import gguf_tokenizer_metadata, llama_cpp_permute
from tests.utils import make_engine

GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",  # phi3: gate | up, as llama.cpp keeps it
    "mlp.down_proj.weight": "ffn_down.weight",
}
# Gemma 2/3's sandwich norms: llama.cpp's ffn_norm is the MLP's input norm
SANDWICH_NAMES = {
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
ARCH = {"llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma", "phi3": "phi3"}
GEMMA = {"gemma2": "gemma2", "gemma3": "gemma3"}


def llama3_freq_factors(cfg) -> np.ndarray:
    """The rope_freqs.weight llama.cpp's converter writes: f_j / f_j(scaled), per frequency."""
    plain = inv_freq(cfg.rope.theta, cfg.head_dim)
    return (plain / inv_freq(cfg.rope, cfg.head_dim)).astype(np.float32)


def gguf_name(hf: str, sandwich: bool = False) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, i, rest = hf.split(".", 3)  # model.layers.{i}.rest
    return f"blk.{i}.{(SANDWICH_NAMES if sandwich else {}).get(rest) or GGUF_NAMES[rest]}"


def gemma_metadata(w: gguf.GGUFWriter, c, arch: str) -> None:
    """What llama.cpp's Gemma 2/3 converters write beyond the common keys."""
    if c.attn_softcap:
        w.add_attn_logit_softcapping(c.attn_softcap)
    if c.final_softcap:
        w.add_final_logit_softcapping(c.final_softcap)
    if arch == "gemma3":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(c.rope.factor)
        w.add_float32("gemma3.rope.freq_base_swa", c.local_rope.theta)


def write_family_gguf(name: str, path) -> None:
    m = loaded(name)
    c, arch = m.config, {**ARCH, **GEMMA}[name]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope.theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    if max(c.layer_windows, default=0):
        w.add_sliding_window(max(c.layer_windows))
    if arch in GEMMA:
        gemma_metadata(w, c, arch)
    gguf_tokenizer_metadata(w, FAMILY_DIR / name)
    if name == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_freq_factors(c))
    for hf, t in load_file(str(FAMILY_DIR / name / "model.safetensors")).items():
        if arch == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
            heads = c.num_attention_heads if "q_proj" in hf else c.num_key_value_heads
            t = llama_cpp_permute(t, heads)
        if arch.startswith("gemma") and hf.endswith("norm.weight"):
            t = t + np.float32(1.0)  # llama.cpp's Gemma converters store 1 + w
        if arch == "gemma2" and hf == "lm_head.weight":
            continue  # its converter drops it: Gemma 2's head is the embedding
        w.add_tensor(gguf_name(hf, arch in GEMMA), np.ascontiguousarray(t, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", sorted(ARCH))
def test_family_gguf_loads_as_the_hf_checkpoint(name, tmp_path):
    path = tmp_path / f"{name}.gguf"
    write_family_gguf(name, path)
    hf, gg = loaded(name), load_model(str(path))
    for field in ("family", "qkv_bias", "qk_norm", "norm_offset", "hidden_act", "head_dim"):
        assert getattr(gg.config, field) == getattr(hf.config, field), field
    assert [gg.config.window(i) for i in range(3)] == [hf.config.window(i) for i in range(3)]
    ids = list(np.random.default_rng().integers(3, 320, size=45))
    np.testing.assert_allclose(
        forward(gg.weights, gg.config, ids), forward(hf.weights, hf.config, ids), atol=2e-5
    )


def test_gguf_refuses_an_unknown_architecture(tmp_path):
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.ones((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="general.architecture 'mamba' is not supported"):
        read_gguf(path)


def test_llama3_freq_factors_are_the_scaling():
    c = loaded("llama3").config
    f = llama3_freq_factors(c)
    assert f.min() == pytest.approx(1.0) and f.max() == pytest.approx(8.0)
    assert math.isclose(float(f[0]), 1.0)


@pytest.mark.parametrize("name", sorted(GEMMA))
def test_gemma_gguf_is_the_checkpoint_as_llama_cpp_reads_it(name, tmp_path):
    """The file holds what llama.cpp keeps: attention scaled by head_dim ** -0.5 (the file has
    no query_pre_attn_scalar), and Gemma 2's head tied to its embedding: the checkpoint with
    those two changes, exactly."""
    path = tmp_path / f"{name}.gguf"
    write_family_gguf(name, path)
    hf, gg = loaded(name), load_model(str(path))
    cfg = dataclasses.replace(hf.config, query_pre_attn_scalar=None)
    weights = hf.weights
    if name == "gemma2":
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
        weights = dataclasses.replace(weights, lm_head=weights.embed)
    for field in ("layer_windows", "rope", "local_rope", "attn_softcap", "final_softcap"):
        assert getattr(gg.config, field) == getattr(cfg, field), field
    assert hf.config.query_pre_attn_scalar != hf.config.head_dim  # the change is seen
    ids = list(np.random.default_rng().integers(3, 320, size=70))
    np.testing.assert_array_equal(forward(gg.weights, gg.config, ids), forward(weights, cfg, ids))


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("name", sorted(GEMMA))
def test_gemma_gguf_greedy_tokens_are_llama_cpps(name, backend, tmp_path):
    """llama.cpp's greedy tokens after a 49-token prompt (two to three windows), through the
    engine with chunks that straddle a window."""
    from engine import SamplingParams

    case = json.loads((FAMILY_DIR / "llama_cpp_greedy.json").read_text())["cases"][name]["f32"]
    path = tmp_path / f"{name}.gguf"
    write_family_gguf(name, path)
    engine = make_engine(
        load_model(str(path)),
        backend=backend,
        max_num_batched_tokens=20,
        max_num_seqs=4,
        enable_chunked_prefill=True,
    )
    params = SamplingParams(temperature=0.0, max_tokens=len(case["token_ids"]), ignore_eos=True)
    engine.add_request("0", case["prompt_token_ids"], params)
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.finished), out)
    assert out.outputs[0].token_ids == case["token_ids"]
