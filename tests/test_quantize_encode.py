"""model_loader.kquant_encode: the bytes llama.cpp's ``llama-quantize`` wrote for the same
float32 values (tests/data/quantize_golden.npz, made by scripts/make_quantize_golden.py: rows
of length 256, 512 and 576 of four kinds, all-zero groups among them), equal block for block;
on fresh random values, the simple types against gguf-py's quantizers (an independent
implementation) and every type's round trip through model_loader.kquants' dequantizers."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from model_loader import kquant_encode, kquants

GOLDEN = Path(__file__).parent / "data" / "quantize_golden.npz"
Q = gguf.GGMLQuantizationType


def golden_cases():
    z = np.load(GOLDEN)
    return [tuple(k.split(":")) for k in z.files if not k.startswith("in:")]


@pytest.mark.parametrize("requested,name,stored", golden_cases())
def test_bytes_equal_llama_quantize(requested, name, stored):
    z = np.load(GOLDEN)
    x = z[f"in:{name}"]  # (rows, K) float32
    want = z[f"{requested}:{name}:{stored}"]  # (rows, bytes of a row): llama-quantize's
    got = kquant_encode.quantize(x, stored)
    assert got.shape == want.shape and got.dtype == np.uint8
    size = kquant_encode.ENCODED[stored][1]
    differing = np.flatnonzero((got.reshape(-1, size) != want.reshape(-1, size)).any(axis=1))
    assert len(differing) == 0, f"{stored} {name}: blocks {differing[:10]} differ"


def test_golden_covers_every_type_and_the_576_fallbacks():
    cases = golden_cases()
    assert {s for _, _, s in cases} == set(kquant_encode.ENCODE)
    fallbacks = {(r, s) for r, n, s in cases if n == "blk.0.ffn_down.weight"}
    assert {("Q4_K", "Q5_0"), ("Q5_K", "Q5_1"), ("Q6_K", "Q8_0")} <= fallbacks


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q5_0", "Q5_1"])
def test_simple_types_equal_gguf_py(type_name):
    rng = np.random.default_rng()
    x = (rng.standard_normal((19, 320)) * rng.uniform(0.01, 3, (19, 1))).astype(np.float32)
    got = kquant_encode.quantize(x, type_name)
    np.testing.assert_array_equal(got, gguf.quants.quantize(x, Q[type_name]))


# type -> largest RMS error of a round trip, relative to the values' RMS (Gaussian rows)
ROUND_TRIP = {"Q4_K": 0.12, "Q5_K": 0.06, "Q6_K": 0.03, "Q5_0": 0.07, "Q5_1": 0.06}


@pytest.mark.parametrize("type_name", list(ROUND_TRIP))
def test_round_trip_through_the_dequantizers(type_name):
    rng = np.random.default_rng()
    x = (rng.standard_normal((23, 512)) * rng.uniform(0.01, 3, (23, 1))).astype(np.float32)
    raw = kquant_encode.quantize(x, type_name)
    back = kquants.dequantize(raw, type_name)
    np.testing.assert_array_equal(back, gguf.quants.dequantize(raw, Q[type_name]))
    rel = np.sqrt(np.mean((back - x) ** 2, axis=1) / np.mean(x**2, axis=1))  # (rows,)
    assert rel.max() < ROUND_TRIP[type_name], rel.max()
    again = kquant_encode.quantize(back, type_name)  # values on the grid quantize near-alike
    assert np.abs(kquants.dequantize(again, type_name) - back).max() <= np.abs(back - x).max()


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="Q4_K: rows of 320 values are not whole blocks of 256"):
        kquant_encode.quantize(np.ones((2, 320), np.float32), "Q4_K")
    with pytest.raises(ValueError, match="no quantizer for GGUF type 'Q3_K'"):
        kquant_encode.quantize(np.ones((2, 256), np.float32), "Q3_K")
