"""Config reading that cannot guess: families, RoPE layouts, and every refusal by name."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

from model_loader.config import ModelConfig
from model_loader.families import FAMILIES, HARMLESS_KEYS
from model_loader.load import load_model
from model_loader.rope import RopeParams, inv_freq, parse_rope
from model_loader.synthetic import TINY_SHAPE
from reference.model import forward
from tests.test_families import FAMILY_DIR

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    **TINY_SHAPE,
    "num_hidden_layers": 3,
    "max_position_embeddings": 256,
}


def cfg(**overrides) -> ModelConfig:
    d = {**BASE, **overrides}
    return ModelConfig.from_hf_dict({k: v for k, v in d.items() if v is not None})


def test_transformers5_rope_parameters_are_read():
    """SmolLM2 as transformers 5 saves it: rope_theta only inside rope_parameters."""
    c = cfg(rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    assert c.rope_theta == 100000.0 and c.rope == RopeParams(theta=100000.0)


def test_transformers4_and_5_layouts_read_the_same_llama3_rope():
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    scaling["original_max_position_embeddings"] = 32
    t4 = cfg(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **scaling})
    older = cfg(rope_theta=500000.0, rope_scaling={"type": "llama3", **scaling})
    t5 = cfg(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **scaling})
    assert t4 == older == t5
    assert t5.rope.rope_type == "llama3" and t5.rope_theta == 500000.0


def test_transformers4_layout_checkpoint_gives_identical_logits(tmp_path):
    """The llama3 family checkpoint, its config rewritten in the transformers-4 layout."""
    src = FAMILY_DIR / "llama3"
    t4_dir = tmp_path / "llama3_t4"
    shutil.copytree(src, t4_dir)
    d = json.loads((src / "config.json").read_text())
    rope = d.pop("rope_parameters")
    d["rope_theta"] = rope.pop("rope_theta")
    d["rope_scaling"] = rope
    d["torch_dtype"] = d.pop("dtype")
    (t4_dir / "config.json").write_text(json.dumps(d))
    a, b = load_model(str(src)), load_model(str(t4_dir))
    assert a.config == b.config
    ids = list(np.random.default_rng().integers(3, 320, size=50))
    np.testing.assert_array_equal(
        forward(a.weights, a.config, ids), forward(b.weights, b.config, ids)
    )


def test_llama3_frequencies_are_scaled_only_at_long_wavelengths():
    r = RopeParams(500000.0, "llama3", 8.0, 1.0, 4.0, 32)
    plain, scaled = inv_freq(500000.0, 16), inv_freq(r, 16)
    wavelen = 2 * math.pi / plain
    np.testing.assert_array_equal(scaled[wavelen < 32 / 4], plain[wavelen < 32 / 4])
    np.testing.assert_allclose(scaled[wavelen > 32], plain[wavelen > 32] / 8.0)


def test_linear_and_yarn_rope():
    lin = cfg(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4})
    np.testing.assert_allclose(inv_freq(lin.rope, 16), inv_freq(1e4, 16) / 4.0)
    yarn = cfg(
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 1e6,
        }
    )
    assert yarn.rope.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1.0)
    f, base = inv_freq(yarn.rope, 16), inv_freq(1e6, 16)
    assert f[0] == base[0] and f[-1] == pytest.approx(base[-1] / 4.0)  # extrapolated | interpolated


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"model_type": "gpt2", "architectures": None}, "model_type 'gpt2'"),
        ({"model_type": "gemma3n", "architectures": None}, "model_type 'gemma3n'"),
        ({"architectures": ["DeepseekV3ForCausalLM"]}, "'DeepseekV3ForCausalLM' is not"),
        ({"architectures": ["Qwen2ForCausalLM"]}, "does not match model_type 'llama'"),
        ({"my_new_knob": 3}, "key 'my_new_knob'"),
        ({"sliding_window": 4096}, "key 'sliding_window'"),  # not a Llama key
        ({"attention_bias": True}, "attention_bias=True"),
        ({"mlp_bias": True}, "mlp_bias=True"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
        ({"rope_scaling": {"type": "longrope", "short_factor": [1.0]}}, "'longrope'"),
        ({"rope_parameters": {"rope_type": "ntk-magic", "rope_theta": 1e4}}, "'ntk-magic'"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "beta": 1}}, "rope key 'beta'"),
        ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial_rot"),
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "'bitsandbytes'"),
        ({"final_logit_softcapping": 30.0}, "'final_logit_softcapping'"),
        ({"attn_logit_softcapping": 50.0}, "'attn_logit_softcapping'"),
        ({"query_pre_attn_scalar": 256}, "'query_pre_attn_scalar'"),
        ({"is_encoder_decoder": True}, "is_encoder_decoder=True"),
    ],
)
def test_config_refusals_name_the_key(overrides, words):
    with pytest.raises(ValueError, match="config.json") as e:
        cfg(**overrides)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_unknown_family_lists_what_is_supported():
    with pytest.raises(ValueError) as e:
        cfg(model_type="falcon", architectures=None)
    for name in FAMILIES:
        assert name in str(e.value)


@pytest.mark.parametrize(
    "family, overrides, words",
    [
        ("gemma", {"hidden_activation": "gelu_pytorch_tanh", "hidden_act": "silu"}, "'silu'"),
        ("gemma", {"hidden_activation": "silu"}, "disagree"),
        ("gemma", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("qwen3", {"attention_bias": True}, "attention_bias=True"),
        ("qwen2", {"layer_types": ["full_attention"] * 2}, "layer_types has 2 entries"),
        (
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 8, "layer_types": ["chunked"] * 3},
            "'chunked'",
        ),
        ("mistral", {"sliding_window": -1}, "sliding_window must be a positive integer"),
        ("phi3", {"rope_scaling": {"type": "longrope", "long_factor": [1.0]}}, "'longrope'"),
    ],
)
def test_family_refusals(family, overrides, words):
    arch = FAMILIES[family].architectures[0]
    with pytest.raises(ValueError, match=words):
        cfg(model_type=family, architectures=[arch], **overrides)


def test_windows_as_transformers_derives_them():
    qwen = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
    off = cfg(**qwen, use_sliding_window=False, sliding_window=8, max_window_layers=1)
    on = cfg(**qwen, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert [off.window(i) for i in range(3)] == [0, 0, 0]
    assert [on.window(i) for i in range(3)] == [0, 8, 8]
    mistral = cfg(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=8)
    assert [mistral.window(i) for i in range(3)] == [8, 8, 8]
    assert cfg().window(0) == 0


def test_harmless_keys_are_accepted():
    c = cfg(**{k: None for k in ("pad_token_id", "initializer_range")}, use_cache=True)
    assert c.family == "llama"
    assert "rope_theta" not in HARMLESS_KEYS and "sliding_window" not in HARMLESS_KEYS


def test_bad_config_is_refused_before_weights_are_read(tmp_path):
    """The weights file is garbage: a config refusal must come first."""
    d = tmp_path / "m"
    shutil.copytree(FAMILY_DIR / "llama", d)
    (d / "model.safetensors").write_bytes(b"not a checkpoint")
    conf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**conf, "final_logit_softcapping": 30.0}))
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        load_model(str(d))


def test_every_family_checkpoint_reads_its_flags():
    from tests.test_families import loaded

    flags = {
        name: (c.family, c.qkv_bias, c.qk_norm, c.norm_offset, c.hidden_act, c.head_dim)
        for name in ("qwen2", "qwen3", "gemma", "phi3")
        for c in [loaded(name).config]
    }
    assert flags["qwen2"][:3] == ("qwen2", True, False)
    assert flags["qwen3"][:3] == ("qwen3", False, True) and flags["qwen3"][5] == 32
    assert flags["gemma"][3:5] == (1.0, "gelu_tanh")
    gemma = {"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}
    assert cfg(**gemma, hidden_act="gelu").hidden_act == "gelu_tanh"  # as transformers 5
    assert loaded("llama3").config.eos_token_ids[:2] == (0, 2)
    assert loaded("llama").config.rope_theta == 50000.0
    assert parse_rope({}, 256) == RopeParams()


def test_phi3_fused_tensor_of_the_wrong_shape_is_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    d = tmp_path / "phi3"
    shutil.copytree(FAMILY_DIR / "phi3", d)
    tensors = load_file(str(d / "model.safetensors"))
    name = "model.layers.1.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-8]  # a few rows short
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="qkv_proj.weight' is of shape \\(120, 64\\)"):
        load_model(str(d))
