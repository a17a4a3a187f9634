"""model_loader.kquant_mix against the types llama.cpp's llama-quantize chose for every tensor
of three llama-shaped files in the mixes q4_k_m, q5_k_m, q6_k and q5_0
(tests/data/quantize_mix.json, made by scripts/make_quantize_mix_golden.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from model_loader import kquant_mix

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from make_quantize_mix_golden import shapes  # noqa: E402

GOLDEN = json.loads((Path(__file__).parent / "data" / "quantize_mix.json").read_text())
CASES = [(model, mix) for model in GOLDEN for mix in GOLDEN[model]["types"]]


@pytest.mark.parametrize("model,mix", CASES)
def test_types_equal_llama_quantize(model, mix):
    m = GOLDEN[model]["model"]
    want = GOLDEN[model]["types"][mix]  # name -> type llama-quantize wrote (F32: kept)
    got = kquant_mix.tensor_types(shapes(m), mix, m["layers"])
    assert set(got) == set(want)
    got = {name: t or "F32" for name, t in got.items()}  # the inputs were all float32
    assert got == want


def test_the_golden_has_each_rule_in_it():
    t = GOLDEN["ffn576"]["types"]["q4_k_m"]
    assert t["blk.0.attn_v.weight"] == "Q6_K" and t["blk.1.attn_v.weight"] == "Q4_K"
    assert t["blk.0.ffn_down.weight"] == "Q8_0" and t["blk.1.ffn_down.weight"] == "Q5_0"
    assert GOLDEN["tied12"]["types"]["q5_0"]["token_embd.weight"] == "Q6_K"
    assert GOLDEN["dim576"]["types"]["q4_k_m"]["output.weight"] == "Q8_0"


def test_more_bits_layers():
    assert [i for i in range(22) if kquant_mix.more_bits(i, 22)] == [
        0,
        1,
        4,
        7,
        10,
        13,
        16,
        19,
        20,
        21,
    ]


def test_unknown_mix_is_named():
    with pytest.raises(ValueError, match="unknown quantization mix 'q3_k_m'"):
        kquant_mix.tensor_types({"output.weight": (8, 256)}, "q3_k_m", 1)
