"""Gemma 2 and Gemma 3 configs: what transformers derives from them, their layouts, refusals."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from model_loader.config import ModelConfig
from model_loader.load import load_model
from model_loader.rope import RopeParams
from model_loader.synthetic import TINY_SHAPE
from reference.model import forward
from tests.test_families import FAMILY_DIR

GEMMA2 = {
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    **TINY_SHAPE,
    "num_hidden_layers": 4,
    "sliding_window": 16,
}
GEMMA3 = {**GEMMA2, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text"}


def cfg(base: dict, **overrides) -> ModelConfig:
    return ModelConfig.from_hf_dict({**base, **overrides})


def test_gemma2_defaults_as_transformers():
    """Without layer_types, the even layers slide (Gemma2Config's default); softcaps read."""
    c = cfg(GEMMA2, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    assert [c.window(i) for i in range(4)] == [16, 0, 16, 0]
    assert (c.attn_softcap, c.final_softcap) == (50.0, 30.0)
    assert c.attn_scale == pytest.approx(16**-0.5)  # head_dim 64 / 4 heads: no scalar given
    c = cfg(GEMMA2, query_pre_attn_scalar=144, hidden_activation="gelu")
    assert c.attn_scale == pytest.approx(1 / 12) and c.hidden_act == "gelu"  # exact, as ACT2FN
    assert cfg(GEMMA2).hidden_act == "gelu_tanh" and cfg(GEMMA2).local_rope is None


def test_gemma3_layer_types_and_kind_ropes():
    c = cfg(GEMMA3, num_hidden_layers=7)  # five sliding per full, and theta defaults 1e6 / 1e4
    assert [c.window(i) for i in range(7)] == [16] * 5 + [0, 16]
    assert c.rope == RopeParams(theta=1e6) and c.local_rope == RopeParams(theta=1e4)
    assert c.layer_rope(0) == c.local_rope and c.layer_rope(5) == c.rope
    c = cfg(GEMMA3, sliding_window_pattern=2)
    assert [c.window(i) for i in range(4)] == [16, 0, 16, 0]


def test_gemma3_transformers4_layout_reads_the_same(tmp_path):
    """The gemma3 golden checkpoint's config in transformers 4's layout: rope_theta and
    rope_scaling for the full layers, rope_local_base_freq for the sliding ones."""
    src = FAMILY_DIR / "gemma3"
    d = json.loads((src / "config.json").read_text())
    rope = d.pop("rope_parameters")
    full, local = rope["full_attention"], rope["sliding_attention"]
    d["rope_theta"] = full.pop("rope_theta")
    d["rope_scaling"] = full
    d["rope_local_base_freq"] = local["rope_theta"]
    d.pop("layer_types")
    d["sliding_window_pattern"] = 6
    t4 = tmp_path / "gemma3_t4"
    shutil.copytree(src, t4)
    (t4 / "config.json").write_text(json.dumps(d))
    assert ModelConfig.from_json(t4 / "config.json") == load_model(str(src)).config


def test_gemma3_multimodal_checkpoint_loads_its_language_model(tmp_path):
    """Gemma3ForConditionalGeneration as transformers 5 saves it (text_config inside,
    language_model.model.* tensors beside vision_tower.* and multi_modal_projector.*): the
    language model alone is loaded, and computes what the text checkpoint does."""
    src = FAMILY_DIR / "gemma3"
    text = json.loads((src / "config.json").read_text())
    mm = tmp_path / "gemma3_mm"
    shutil.copytree(src, mm)
    outer = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": {k: v for k, v in text.items() if k not in ("architectures", "dtype")},
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32},
        "mm_tokens_per_image": 4,
        "image_token_index": 262144,
        "tie_word_embeddings": False,
        "dtype": "float32",
    }
    (mm / "config.json").write_text(json.dumps(outer))
    rng = np.random.default_rng()
    tensors = {
        (n.replace("model.", "language_model.model.", 1) if n.startswith("model.") else n): t
        for n, t in load_file(str(src / "model.safetensors")).items()
    }
    tensors["vision_tower.embeddings.patch_embedding.weight"] = rng.standard_normal((32, 3, 2, 2))
    tensors["multi_modal_projector.mm_input_projection_weight"] = rng.standard_normal((32, 64))
    save_file(
        {n: np.asarray(t, np.float32) for n, t in tensors.items()}, str(mm / "model.safetensors")
    )
    a, b = load_model(str(src)), load_model(str(mm))
    assert a.config == b.config
    ids = rng.integers(3, 320, size=50).tolist()
    np.testing.assert_array_equal(
        forward(a.weights, a.config, ids), forward(b.weights, b.config, ids)
    )


@pytest.mark.parametrize(
    "base, overrides, words",
    [
        (GEMMA2, {"sliding_window": None}, "gemma2 needs sliding_window"),
        (GEMMA2, {"final_logit_softcapping": -1.0}, "final_logit_softcapping must be a positive"),
        (GEMMA2, {"hidden_activation": "silu"}, "hidden_activation 'silu'"),
        (GEMMA2, {"rope_local_base_freq": 1e4}, "key 'rope_local_base_freq'"),
        (GEMMA3, {"attn_logit_softcapping": 50.0}, "'attn_logit_softcapping'"),
        (GEMMA3, {"rope_parameters": {"chunked_attention": {}, "full_attention": {}}}, "kind"),
        (GEMMA3, {"layer_types": ["chunked_attention"] * 4}, "'chunked_attention'"),
        (
            {"model_type": "gemma3", "text_config": GEMMA3, "audio_config": {}},
            {},
            "key 'audio_config'",
        ),
    ],
)
def test_gemma_refusals_name_the_key(base, overrides, words):
    with pytest.raises(ValueError, match="config.json") as e:
        cfg(base, **overrides)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_null_softcapping_is_accepted_for_gemma3():
    c = cfg(GEMMA3, attn_logit_softcapping=None, final_logit_softcapping=None)
    assert (c.attn_softcap, c.final_softcap) == (0.0, 0.0)
