"""MXFP4 (model_loader/mxfp4.py): GGUF's blocks dequantized bit for bit as gguf-py does and a
gpt-oss checkpoint's blocks as transformers does (their answers committed:
scripts/make_mxfp4_golden.py), fresh random blocks against the format's definition, the
checkpoint's nibbles repacked into GGUF's blocks with their values unchanged, the kept matrix's
rows de-interleaved and stacked, and the cpu backend's product of a repacked matrix. The
kernels' products on every build: tests/test_cpu_kernels.py (RAW_FORMATS' "mxfp4")."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.backends import cpu_ops
from engine.backends.quant import QuantWeight, keep_stored
from model_loader import kquants, mxfp4
from model_loader.gguf_blocks import BlockMatrix, mxfp4_experts, mxfp4_matrix, stack_rows
from tests.test_kquants import assert_kquant_product

GOLDEN = np.load(Path(__file__).parent / "data" / "mxfp4_golden.npz")


def bits(a: np.ndarray) -> np.ndarray:
    """float32 -> its bits, -0 as 0 (a checkpoint's e2m1 -0 is GGUF's code 8, 0)."""
    return (np.asarray(a, np.float32) + np.float32(0)).view(np.uint32)


def spec_values(codes: np.ndarray, e: np.ndarray) -> np.ndarray:
    """The OCP definition in float64: e2m1 (sign, 2 exponent bits, 1 mantissa bit) times
    2^(e - 127), then float32 (exact, or inf past its range)."""
    sign = np.where(codes & 8, -1.0, 1.0)
    ex, man = (codes >> 1) & 3, codes & 1
    mag = np.where(ex == 0, 0.5 * man, (1 + 0.5 * man) * 2.0 ** (ex.astype(float) - 1))
    with np.errstate(over="ignore"):
        return (sign * mag * 2.0 ** (e.astype(float) - 127)).astype(np.float32)


def random_hf(rng, *shape) -> tuple[np.ndarray, np.ndarray]:
    """A checkpoint's (*shape, 16) blocks and (*shape) scales, values of a model's size."""
    blocks = rng.integers(0, 256, (*shape, 16), dtype=np.uint8)
    return blocks, rng.integers(118, 126, shape, dtype=np.uint8)


def test_gguf_blocks_dequantize_as_gguf_py_does():
    raw = GOLDEN["gguf_raw"]  # (256, 17): every exponent once
    mine = kquants.dequantize(raw.reshape(4, -1), "MXFP4").reshape(raw.shape[0], 32)
    np.testing.assert_array_equal(mine.view(np.uint32), GOLDEN["gguf_values"].view(np.uint32))


def test_random_blocks_dequantize_to_the_definition():
    rng = np.random.default_rng()
    raw = rng.integers(0, 256, (7, 40 * 17), dtype=np.uint8)  # 7 rows of 40 blocks
    blocks = raw.reshape(-1, 17)
    codes = np.concatenate([blocks[:, 1:] & 15, blocks[:, 1:] >> 4], axis=1)  # (280, 32)
    want = spec_values(codes, blocks[:, :1]).reshape(7, 40 * 32)
    got = kquants.dequantize(raw, "MXFP4")
    assert got.shape == (7, 1280) and got.dtype == np.float32
    np.testing.assert_array_equal(bits(got), bits(want))


def test_checkpoint_blocks_dequantize_as_transformers_does():
    blocks, scales = GOLDEN["hf_blocks"], GOLDEN["hf_scales"]  # (2, 32, 4, 16), (2, 32, 4)
    theirs = GOLDEN["hf_values"].transpose(0, 2, 1)  # transformers' (E, cols, rows), back
    mine = mxfp4.hf_values(blocks, scales)  # (2, 32, 128)
    np.testing.assert_array_equal(mine.view(np.uint32), theirs.view(np.uint32))
    kept = mxfp4_experts("gate_up", blocks, scales)
    assert kept.shape == (2, 32, 128) and kept[1].kind == "mxfp4"
    np.testing.assert_array_equal(bits(np.asarray(kept)), bits(theirs))


def test_repacked_blocks_keep_the_checkpoints_values():
    rng = np.random.default_rng()
    blocks = rng.integers(0, 256, (24, 5, 16), dtype=np.uint8)  # (rows, cols/32, 16)
    scales = rng.integers(0, 256, (24, 5), dtype=np.uint8)
    m = mxfp4_matrix("down", blocks, scales)
    assert isinstance(m, BlockMatrix) and m.shape == (24, 160) and m.raw.shape == (24, 85)
    pairs = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(24, 5, 32)  # value 2j, 2j + 1
    want = spec_values(pairs, scales[:, :, None]).reshape(24, 160)
    np.testing.assert_array_equal(bits(np.asarray(m)), bits(want))
    np.testing.assert_array_equal(bits(mxfp4.hf_values(blocks, scales)), bits(want))


def test_gate_and_up_rows_deinterleave_and_experts_stack():
    """gpt-oss's gate_up rows alternate gate, up: rows 0::2 and 1::2 of each expert, stacked
    gate | up, and experts stacked, all still in blocks with the checkpoint's values."""
    rng = np.random.default_rng()
    blocks, scales = random_hf(rng, 3, 10, 2)  # 3 experts, 2F = 10 rows, D = 64
    values = mxfp4.hf_values(blocks, scales)  # (3, 10, 64)
    experts = mxfp4_experts("gate_up", blocks, scales)
    per_expert = []
    for e in range(3):
        m = experts[e]
        fused = stack_rows([m.take_rows(slice(0, None, 2)), m.take_rows(slice(1, None, 2))])
        assert isinstance(fused.parts[0], BlockMatrix) and len(fused.parts) == 1  # one matrix
        want = np.concatenate([values[e, 0::2], values[e, 1::2]])  # (10, 64): gate | up
        np.testing.assert_array_equal(bits(np.asarray(fused)), bits(want))
        per_expert.append(fused.parts[0])
    stacked = stack_rows(per_expert)  # (30, 64)
    assert stacked.shape == (30, 64) and len(stacked.parts) == 1
    want = np.concatenate([np.concatenate([v[0::2], v[1::2]]) for v in values])
    np.testing.assert_array_equal(bits(np.asarray(stacked)), bits(want))


@pytest.mark.parametrize("rows", [1, 16, 70])
def test_the_cpu_backend_multiplies_a_repacked_matrix(rows):
    rng = np.random.default_rng()
    blocks, scales = random_hf(rng, 48, 9)  # (48, 288): N 48, K 288
    w = keep_stored(mxfp4_matrix("down", blocks, scales).T)
    assert isinstance(w, QuantWeight) and w.kind == "mxfp4" and w.shape == (288, 48)
    np.testing.assert_array_equal(bits(w.dequantize()), bits(mxfp4.hf_values(blocks, scales).T))
    x = rng.standard_normal((rows, 288), dtype=np.float32)
    assert_kquant_product(x, w, cpu_ops.matmul(x, w))


def test_bad_checkpoint_blocks_are_one_line():
    blocks, scales = np.zeros((4, 2, 16), np.uint8), np.zeros((4, 3), np.uint8)
    with pytest.raises(
        ValueError, match=r"^mxfp4: blocks must be .* got \(4, 2, 16\) and \(4, 3\)$"
    ):
        mxfp4.from_hf(blocks, scales)
    with pytest.raises(ValueError, match="^mxfp4: blocks and scales must be uint8, got int8"):
        mxfp4.from_hf(blocks.view(np.int8), scales[:, :2])
    with pytest.raises(ValueError, match=r"^mxfp4: 'w' blocks must be \(rows, cols/32, 16\)"):
        mxfp4_matrix("w", blocks[None], scales[None, :, :2])
