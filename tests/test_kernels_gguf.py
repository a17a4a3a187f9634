"""The GGUF block kernels (cuda_src/gguf_matvec.cu, gguf_dequantize.cu) under the CPU emulation,
on fresh random blocks of each format: the small-batch product against x @ W^T in float64 with W
dequantized by NumPy (model_loader/kquants.py; gguf-py's dequantizer for Q8_0 and Q4_0), the
widening bit for bit against the same values, and each one's global memory traffic counted:
every weight byte loaded once, every output element stored once."""

from __future__ import annotations

import gguf
import ml_dtypes
import numpy as np
import pytest

from engine import emulation as E
from engine import kernels as K
from engine.kernels.gguf_launch import GGUF_KINDS, GGUF_MATVEC_MAX_BATCH, gguf_row_bytes
from model_loader import kquants

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
DTYPE_IDS = ["f32", "f16", "bf16"]
KINDS = list(GGUF_KINDS)
# where each format's float16 factors sit in a block
HALVES = {"q8_0": (0,), "q4_0": (0,), "q5_0": (0,), "q4_k": (0, 2), "q6_k": (208,)}
# the unit roundoff of a dtype, for the output's one rounding
ROUNDOFF = {np.dtype(np.float32): 2.0**-24, np.dtype(np.float16): 2.0**-11}
ROUNDOFF[np.dtype(ml_dtypes.bfloat16)] = 2.0**-8


@pytest.fixture
def rng():
    return np.random.default_rng()


@pytest.fixture(scope="module", autouse=True)
def built():
    """Both files' plain and counting builds, two g++ processes at a time (cached by hash)."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(n, c) for n in ("gguf_matvec", "gguf_dequantize") for c in (None, "reads", "writes")]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda j: K.compile_cpu(j[0], counting=j[1]), jobs))


def random_blocks(rng, kind: str, N: int, K_: int, scale: float = 0.02) -> np.ndarray:
    """(N, bytes of a row) uint8 random blocks of ``kind``, 16-byte aligned (as the device's
    allocations are): random bytes with the float16 factors uniform in +-scale."""
    _, per, size, _ = GGUF_KINDS[kind]
    raw = rng.integers(0, 256, (N * K_ // per, size), dtype=np.uint8)
    for at in HALVES[kind]:
        h = rng.uniform(-scale, scale, len(raw)).astype(np.float16)
        raw[:, at : at + 2] = h.view(np.uint8).reshape(-1, 2)
    buf = np.empty(raw.nbytes + 16, np.uint8)
    off = -buf.ctypes.data % 16
    out = buf[off : off + raw.nbytes].reshape(N, gguf_row_bytes(kind, K_))
    out[...] = raw.reshape(N, -1)
    return out


def values(kind: str, raw: np.ndarray) -> np.ndarray:
    """(N, K) float32: the blocks' values as NumPy dequantizes them."""
    if kind in ("q8_0", "q4_0"):
        return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind.upper()])
    return kquants.dequantize(raw, kind.upper())


def shape_of(kind: str) -> tuple[int, int]:
    """(N, K): rows not a multiple of the block's four, and more units per row than a warp's
    lanes with a last trip part full (37 blocks of 32, or 9 super-blocks of four units)."""
    per = GGUF_KINDS[kind][1]
    return 37, per * (37 if per == 32 else 9)


def assert_product(got, x, w64, out_dtype) -> None:
    """got ~ x @ w64^T: float32 sums (|error| within 1e-5 of the absolute terms' sum) and the
    output's one rounding."""
    x64 = np.asarray(x, np.float64)
    want = x64 @ w64.T
    bound = 1e-5 * (np.abs(x64) @ np.abs(w64).T) + ROUNDOFF[np.dtype(out_dtype)] * np.abs(want)
    got = np.asarray(got, np.float64)
    assert not np.isnan(got).any(), "an output was never written"
    err = np.abs(got - want)
    assert (err <= bound + 1e-30).all(), (err / (bound + 1e-30)).max()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_matvec_is_the_dequantized_product(kind, dtype, rng):
    N, K_ = shape_of(kind)
    raw = random_blocks(rng, kind, N, K_)
    w64 = values(kind, raw).astype(np.float64)
    for M in (1, 3, GGUF_MATVEC_MAX_BATCH):
        x = rng.standard_normal((M, K_)).astype(dtype)
        out = np.full((M, N), np.nan, dtype)
        E.cpu_kernels().gguf_matvec(out, x, raw, kind)
        assert_product(out, x, w64, dtype)


@pytest.mark.parametrize("kind", KINDS)
def test_matvec_writes_its_columns_of_a_wider_float32_out(kind, rng):
    """A fused matrix's part: columns col..col+N of the logits' float32 rows, the rest kept."""
    N, K_ = shape_of(kind)
    raw = random_blocks(rng, kind, N, K_)
    x = rng.standard_normal((2, K_)).astype(ml_dtypes.bfloat16)
    out = rng.standard_normal((2, N + 11)).astype(np.float32)
    before = out.copy()
    E.cpu_kernels().gguf_matvec(out, x, raw, kind, col=5)
    assert_product(out[:, 5 : 5 + N], x, values(kind, raw).astype(np.float64), np.float32)
    np.testing.assert_array_equal(out[:, :5], before[:, :5])
    np.testing.assert_array_equal(out[:, 5 + N :], before[:, 5 + N :])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_is_numpys_values_rounded_once(kind, dtype, rng):
    N, K_ = shape_of(kind)
    raw = random_blocks(rng, kind, N, K_)
    out = np.full((N, K_), np.nan, dtype)
    E.cpu_kernels().gguf_dequantize(out, raw, kind)
    want = values(kind, raw).astype(dtype)
    np.testing.assert_array_equal(out.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("kind", KINDS)
def test_each_weight_byte_is_loaded_once_and_each_output_stored_once(kind, rng):
    N, K_ = shape_of(kind)
    raw = random_blocks(rng, kind, N, K_)
    x = rng.standard_normal((3, K_)).astype(ml_dtypes.bfloat16)
    out = np.full((3, N), np.nan, ml_dtypes.bfloat16)
    with E.memory_traffic() as t:
        E.counting_kernels().gguf_matvec(out, x, raw, kind)
    assert (t.read(raw), t.written(out), t.read(out)) == (raw.nbytes, out.nbytes, 0)
    assert t.read(x) == N * x.nbytes  # each row's warp reads x once
    assert t.written(raw) == t.written(x) == 0
    tile = np.full((N, K_), np.nan, ml_dtypes.bfloat16)
    with E.memory_traffic() as t:
        E.counting_kernels().gguf_dequantize(tile, raw, kind)
    assert (t.read(raw), t.written(tile), t.read(tile)) == (raw.nbytes, tile.nbytes, 0)


def test_bad_arguments_are_one_line_errors(rng):
    raw = random_blocks(rng, "q4_k", 4, 512)
    x = np.ones((2, 512), np.float32)
    k = E.cpu_kernels()
    with pytest.raises(ValueError, match="^gguf: kind must be one of"):
        k.gguf_matvec(np.empty((2, 4), np.float32), x, raw, "q5_k")
    with pytest.raises(ValueError, match="whole blocks of 256 values, got K=300$"):
        k.gguf_matvec(np.empty((2, 4), np.float32), np.ones((2, 300), np.float32), raw, "q4_k")
    with pytest.raises(ValueError, match="^gguf_matvec: x must have 1 to 8 rows, got 9$"):
        k.gguf_matvec(np.empty((9, 4), np.float32), np.ones((9, 512), np.float32), raw, "q4_k")
    with pytest.raises(ValueError, match="do not fit out of width 4$"):
        k.gguf_matvec(np.empty((2, 4), np.float32), x, raw, "q4_k", col=1)
    with pytest.raises(ValueError, match="^gguf_dequantize: q4_k blocks must start on a 4-byte"):
        unaligned = np.empty(raw.nbytes + 1, np.uint8)[1:].reshape(raw.shape)
        k.gguf_dequantize(np.empty((4, 512), np.float32), unaligned, "q4_k")
