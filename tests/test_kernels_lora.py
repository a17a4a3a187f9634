"""The batched LoRA kernels (cuda_src/lora_shrink.cu, lora_expand.cu) under the CPU emulation:
each adapter's rows get x @ A^T @ B added in float32 (against float64 NumPy), the base model's
rows stay as they were, bit for bit, and the traffic is each tile's adapter once."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from engine import emulation as E
from engine import kernels as K
from engine.kernels.launch import LORA_TILE_ROWS, lora_max_tiles, lora_split, lora_tiles

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
TOL = {np.float32: 1e-5, np.float16: 2e-3, ml_dtypes.bfloat16: 1.6e-2}  # relative to |y|


@pytest.fixture(scope="module", autouse=True)
def built():
    for name in ("lora_shrink", "lora_expand"):
        K.compile_cpu(name)
        for kind in ("reads", "writes"):
            K.compile_cpu(name, counting=kind)


@pytest.fixture
def rng():
    return np.random.default_rng()


def problem(rng, dtype, T=45, K=300, widths=(256, 64, 64), S=3, R=8):
    """x (T, K), a (S, M R, K), b (S, R, N), y (T, N), slots (T,): slot 0 has over a tile of
    rows, slot 2 none, every adapter's rank below R (zeros past it), some base rows."""
    M, N = len(widths), sum(widths)
    x = rng.standard_normal((T, K)).astype(dtype)
    a = np.zeros((S, M * R, K), np.float32)
    b = np.zeros((S, R, N), np.float32)
    for s in range(S):
        r = int(rng.integers(1, R))  # this adapter's rank
        for m in range(M):
            a[s, m * R : m * R + r] = rng.standard_normal((r, K)) / np.sqrt(K)
        b[s, :r] = rng.standard_normal((r, N))
    slots = rng.choice([-1, 0, 1], T, p=[0.2, 0.55, 0.25]).astype(np.int32)
    slots[: LORA_TILE_ROWS + 3] = 0
    rng.shuffle(slots)
    y = rng.standard_normal((T, N)).astype(dtype)
    ends = np.cumsum(widths).astype(np.int32)
    return x, a.astype(dtype), b.astype(dtype), y, slots, ends


def expected(x, a, b, y, slots, ends) -> np.ndarray:
    """y + each row's update in float64 from the stored (rounded) inputs."""
    R = b.shape[1]
    out = y.astype(np.float64)
    starts = np.r_[0, ends[:-1]]
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        t = a[s].astype(np.float64) @ x[i].astype(np.float64)  # (M R,)
        for m, (c0, c1) in enumerate(zip(starts, ends, strict=True)):
            out[i, c0:c1] += t[m * R : (m + 1) * R] @ b[s, :, c0:c1].astype(np.float64)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f16", "bf16"])
def test_each_adapters_rows_get_their_update_and_base_rows_stay(dtype, rng, order):
    x, a, b, y, slots, ends = problem(rng, dtype)
    idx, tiles = lora_tiles(slots, pad_to=lora_max_tiles(len(slots), 3) + 2)  # spare tiles
    want = expected(x, a, b, y, slots, ends)
    got = y.copy()
    E.cpu_kernels().lora(got, x, a, b, idx, tiles, ends)
    base = slots < 0
    assert np.array_equal(got[base].view(np.uint8), y[base].view(np.uint8))  # untouched
    g, w = got[~base].astype(np.float64), want[~base]
    assert np.abs(g - w).max() <= TOL[dtype] * np.abs(w).max(), order
    assert np.abs(g - y[~base].astype(np.float64)).max() > 0.1  # the update is not nothing


def test_tiles_cover_each_adapter_row_once(rng):
    slots = rng.integers(-1, 5, 200).astype(np.int32)
    idx, tiles = lora_tiles(slots, pad_to=lora_max_tiles(200, 5))
    real = tiles[tiles[:, 2] > 0]
    assert len(tiles) == lora_max_tiles(200, 5) >= len(real)
    rows = np.concatenate([idx[f : f + n] for _, f, n in real.tolist()])
    assert sorted(rows.tolist()) == np.flatnonzero(slots >= 0).tolist()
    for s, f, n in real.tolist():
        assert 1 <= n <= LORA_TILE_ROWS and (slots[idx[f : f + n]] == s).all()


def test_the_traffic_is_each_tiles_adapter_once(rng):
    """Counted loads and stores: x's LoRA rows once, each tile's A and B once, y's LoRA rows
    read and written once, the base rows' never."""
    dtype = ml_dtypes.bfloat16
    x, a, b, y, slots, ends = problem(rng, dtype, K=600)
    idx, tiles = lora_tiles(slots)
    e, n_lora = 2, int((slots >= 0).sum())
    with E.memory_traffic() as t:
        E.counting_kernels().lora(y, x, a, b, idx, tiles, ends)
    K_, R_all, N = x.shape[1], a.shape[1], y.shape[1]
    assert lora_split(K_) < K_  # K is split, each range read once
    assert t.read(x) == n_lora * K_ * e
    assert t.read(a) == len(tiles) * R_all * K_ * e  # one adapter's A per tile
    assert t.read(b) == len(tiles) * b.shape[1] * N * e
    assert t.read(y) == t.written(y) == n_lora * N * e
    assert t.written(x) == t.written(a) == t.written(b) == 0


def test_bad_arguments_are_named(rng):
    x, a, b, y, slots, ends = problem(rng, np.float32)
    idx, tiles = lora_tiles(slots)
    k = E.cpu_kernels()
    with pytest.raises(ValueError, match="module_ends must have 1 to 3 entries"):
        k.lora(y, x, a, b, idx, tiles, np.array([10, 20, 30, 384], np.int32))
    with pytest.raises(ValueError, match=r"lora: b must have shape \(3, 8, 384\)"):
        k.lora(y, x, a, b[:, :4].copy(), idx, tiles, ends)
    with pytest.raises(ValueError, match="lora: a must be float32, got float16"):
        k.lora(y, x, a.astype(np.float16), b, idx, tiles, ends)
