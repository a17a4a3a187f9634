"""A mixture of experts' CUDA kernels (cuda_src/moe_route.cu, moe_align.cu, moe_matmul.cu,
moe_combine.cu, and act_and_mul.cu's clamped SwiGLU) under the CPU emulation, each against
NumPy: the host backends' routing (engine/backends/moe.py), float64 products of the stored
values, MXFP4 blocks widened by model_loader.mxfp4; and the traffic: an expert's weights read
once per 16 of its rows, an expert no row chose not at all."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from engine import emulation as E
from engine import kernels as K
from engine.backends import moe
from model_loader import mxfp4

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
IDS = ["f32", "f16", "bf16"]
TOL = {np.float32: 2e-5, np.float16: 2e-3, ml_dtypes.bfloat16: 1.6e-2}  # relative to max |y|
FILES = ("moe_route", "moe_align", "moe_matmul", "moe_combine", "act_and_mul")


@pytest.fixture(scope="module", autouse=True)
def built():
    for name in FILES:
        K.compile_cpu(name)
    for kind in ("reads", "writes"):
        K.compile_cpu("moe_matmul", counting=kind)


@pytest.fixture
def rng():
    return np.random.default_rng()


kern = E.cpu_kernels


def routed(rng, T: int, E_: int, k: int) -> np.ndarray:
    """(T, k) int32 distinct experts per token, some experts chosen by none."""
    ids = np.stack([rng.choice(E_ - 2, k, replace=False) for _ in range(T)]).astype(np.int32)
    return ids + (ids >= 3).astype(np.int32)  # expert 3 and the last: no rows


def aligned(ids: np.ndarray, E_: int):
    P = ids.size
    out = [np.empty(P, np.int32), np.empty(P, np.int32), np.empty(E_ + 1, np.int32)]
    totals = np.zeros(E_, np.uint64)
    kern().moe_align(*out, totals, ids, np.arange(len(ids), dtype=np.int32))
    return (*out, totals)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_route_is_the_host_backends_routing(order, dtype, rng):
    T, D, E_, k = 13, 72, 20, 4
    h = rng.standard_normal((T, D)).astype(dtype)
    router = rng.standard_normal((E_ + 1, D)).astype(np.float32)  # the last row: a shared gate
    bias = rng.standard_normal(E_).astype(np.float32)
    for renorm, b in ((True, None), (False, bias)):
        ids, w = np.empty((T, k), np.int32), np.empty((T, k), np.float32)
        gate = np.empty(T, np.float32)
        kern().moe_route(ids, w, h, router, k, renorm, bias=b, gate=gate)
        hf = h.astype(np.float32)
        want_ids, want_w = moe.route(hf, router[:E_].T.copy(), k, renorm, b)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_allclose(w, want_w, rtol=3e-5, atol=1e-8)  # logits: sums in another order
        want_gate = 1 / (1 + np.exp(-(hf.astype(np.float64) @ router[E_])))
        np.testing.assert_allclose(gate, want_gate, rtol=1e-5)
        if renorm:
            np.testing.assert_allclose(w.sum(1), 1, rtol=1e-6)


def test_route_ties_go_to_the_lower_expert(order, rng):
    """Equal router rows give equal probabilities: torch.topk's order, the lower index first."""
    T, D, E_ = 5, 40, 8
    h = rng.standard_normal((T, D)).astype(np.float32)
    router = rng.standard_normal((E_, D)).astype(np.float32)
    router[6] = router[2] = router[5] * 3  # 2, 5 and 6 tie, far ahead of the rest
    router[5] = router[2]
    ids, w = np.empty((T, 3), np.int32), np.empty((T, 3), np.float32)
    kern().moe_route(ids, w, h, router, 3, False)
    want = moe.route(h, router.T.copy(), 3, False)[0]
    np.testing.assert_array_equal(ids, want)
    for row in ids:  # each row: the three tied experts, in increasing order
        assert sorted(row.tolist()) == row.tolist() or set(row.tolist()) != {2, 5, 6}


def test_align_buckets_each_pair_once_and_counts(order, rng):
    T, E_, k = 37, 16, 4
    ids = routed(rng, T, E_, k)
    sorted_pairs, inverse, offsets, totals = aligned(ids, E_)
    counts = np.bincount(ids.reshape(-1), minlength=E_)
    np.testing.assert_array_equal(offsets, np.r_[0, np.cumsum(counts)])
    np.testing.assert_array_equal(totals, counts)
    assert sorted(sorted_pairs.tolist()) == list(range(T * k))
    np.testing.assert_array_equal(sorted_pairs[inverse], np.arange(T * k))
    for e in range(E_):
        span = sorted_pairs[offsets[e] : offsets[e + 1]]
        assert (ids.reshape(-1)[span] == e).all()
    slots = np.arange(T, dtype=np.int32)
    slots[::3] = -1  # rows with no KV slot (padding) are bucketed but not counted
    kern().moe_align(sorted_pairs, inverse, offsets, totals, ids, slots)  # totals keep adding
    counted = ids[np.arange(T) % 3 != 0].ravel()
    np.testing.assert_array_equal(totals, counts + np.bincount(counted, minlength=E_))
    np.testing.assert_array_equal(offsets, np.r_[0, np.cumsum(counts)])


def expert_products(x, ws, ids, sorted_pairs, offsets, gather, bias=None):
    """float64 out (P, N) of the stored values: each position's row through its expert."""
    P, N = sorted_pairs.shape[0], ws.shape[1]
    out = np.zeros((P, N))
    for e in range(ws.shape[0]):
        for p in range(offsets[e], offsets[e + 1]):
            src = sorted_pairs[p] // gather if gather else p
            out[p] = ws[e].astype(np.float64) @ x[src].astype(np.float64)
            out[p] += 0 if bias is None else bias[e]
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_matmul_gathers_each_pairs_row_through_its_expert(order, dtype, rng):
    """K and N not whole tiles, an expert with more than one tile of rows, experts with none;
    out in the dtype and in float32, with and without biases."""
    T, E_, k, K_, N = 29, 8, 3, 72, 80
    ids = routed(rng, T, E_, k)
    ids[:20, 0] = 1  # expert 1: at least 20 rows, two tiles
    ids[:20, 1:] = np.where(ids[:20, 1:] == 1, 0, ids[:20, 1:])
    sorted_pairs, inverse, offsets, _ = aligned(ids, E_)
    x = rng.standard_normal((T, K_)).astype(dtype)
    w = (rng.standard_normal((E_, N, K_)) / np.sqrt(K_)).astype(dtype)
    bias = rng.standard_normal((E_, N)).astype(np.float32)
    for out_dtype, b in ((dtype, None), (np.float32, bias)):
        out = np.full((T * k, N), np.nan, out_dtype)
        kern().moe_matmul(out, x, w, sorted_pairs, offsets, k, bias=b)
        want = expert_products(x, w, ids, sorted_pairs, offsets, k, b)
        err = np.abs(out.astype(np.float64) - want).max()
        assert err <= TOL[dtype] * np.abs(want).max(), (order, out_dtype)
    # the down product's shape: rows already in sorted order (gather 0)
    a = rng.standard_normal((T * k, K_)).astype(dtype)
    out = np.full((T * k, N), np.nan, np.float32)
    kern().moe_matmul(out, a, w, sorted_pairs, offsets, 0)
    want = expert_products(a, w, ids, sorted_pairs, offsets, 0)
    assert np.abs(out - want).max() <= TOL[dtype] * np.abs(want).max()


def random_mxfp4(rng, E_: int, N: int, K_: int) -> np.ndarray:
    """(E, N, K/32 * 17) uint8 GGUF MXFP4 blocks: random codes, exponents around 2^0."""
    blocks = rng.integers(0, 256, (E_ * N * (K_ // 32), 17), dtype=np.uint8)
    blocks[:, 0] = rng.integers(120, 132, len(blocks))
    return blocks.reshape(E_, N, -1)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_matmul_reads_mxfp4_blocks(dtype, rng):
    T, E_, k, K_, N = 9, 6, 2, 96, 70
    ids = routed(rng, T, E_, k)
    sorted_pairs, _, offsets, _ = aligned(ids, E_)
    w = random_mxfp4(rng, E_, N, K_)
    values = mxfp4.dequantize_blocks(w.reshape(-1, 17)).reshape(E_, N, K_)
    x = rng.standard_normal((T, K_)).astype(dtype)
    out = np.full((T * k, N), np.nan, np.float32)
    kern().moe_matmul(out, x, w, sorted_pairs, offsets, k, fmt="mxfp4")
    want = expert_products(x, values, ids, sorted_pairs, offsets, k)
    assert np.abs(out - want).max() <= 2e-6 * np.abs(want).max()  # float32 sums of exact values


def test_matmul_reads_each_chosen_expert_once_per_tile(rng):
    """Counted loads: an expert's weights once per 16 of its rows, an unchosen expert's never."""
    T, E_, k, K_, N = 21, 8, 2, 64, 96
    ids = routed(rng, T, E_, k)
    ids[:18, 0] = 0
    ids[:18, 1] = np.where(ids[:18, 1] == 0, 1, ids[:18, 1])
    sorted_pairs, _, offsets, _ = aligned(ids, E_)
    x = rng.standard_normal((T, K_)).astype(np.float16)
    w = rng.standard_normal((E_, N, K_)).astype(np.float16)
    out = np.empty((T * k, N), np.float16)
    with E.memory_traffic() as t:
        E.counting_kernels().moe_matmul(out, x, w, sorted_pairs, offsets, k)
    counts = np.diff(offsets)
    tiles = -(-counts // 16)  # per expert
    assert counts[0] >= 18 and tiles[0] == 2 and counts[3] == 0
    assert t.read(w) == tiles.sum() * N * K_ * 2  # (counted per argument: the sum)
    assert t.written(out) == T * k * N * 2


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_combine_sums_each_tokens_rows(order, dtype, rng):
    T, E_, k, D = 11, 8, 3, 50
    ids = routed(rng, T, E_, k)
    _, inverse, _, _ = aligned(ids, E_)
    y = rng.standard_normal((T * k, D)).astype(np.float32)
    w = rng.random((T, k)).astype(np.float32)
    gate = rng.random(T).astype(np.float32)
    shared = rng.standard_normal((T, D)).astype(dtype)
    for extra in ((), (gate, shared)):
        out = np.full((T, D), np.nan, dtype)
        kern().moe_combine(out, y, w, inverse, *extra)
        want = np.einsum("tk,tkd->td", w.astype(np.float64), y[inverse].reshape(T, k, D))
        if extra:
            want += gate[:, None] * shared.astype(np.float64)
        assert np.abs(out.astype(np.float64) - want).max() <= TOL[dtype] * np.abs(want).max()


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_clamped_swiglu_is_gpt_oss_activation(order, dtype, rng):
    gate_up = (rng.standard_normal((7, 2 * 48)) * 4).astype(dtype)  # past the limit both ways
    out = np.full((7, 48), np.nan, dtype)
    kern().clamped_swiglu(out, gate_up, 1.702, 1.5)
    want = moe.clamped_swiglu(gate_up.astype(np.float32), 1.702, 1.5)
    assert np.abs(out.astype(np.float64) - want).max() <= TOL[dtype] * np.abs(want).max()
    assert np.abs(gate_up.astype(np.float32)).max() > 3  # the clamp acted


def test_bad_arguments_are_named(rng):
    h = rng.standard_normal((3, 32)).astype(np.float32)
    router = rng.standard_normal((4, 32)).astype(np.float32)
    ids, w = np.empty((3, 2), np.int32), np.empty((3, 2), np.float32)
    with pytest.raises(ValueError, match=r"moe_route: top_k must be in \[1, min\(E, 32\)\]"):
        kern().moe_route(np.empty((3, 5), np.int32), w, h, router, 5, True)
    with pytest.raises(ValueError, match="moe_route: router must be float32"):
        kern().moe_route(ids, w, h, router.astype(np.float16), 2, True)
    sp, offs = np.zeros(6, np.int32), np.zeros(5, np.int32)
    with pytest.raises(ValueError, match="moe_matmul: mxfp4 rows must be whole blocks of 32"):
        kern().moe_matmul(np.empty((6, 8), np.float32), h[:, :20].copy(),
                          np.zeros((4, 8, 17), np.uint8), sp, offs, 2, fmt="mxfp4")  # fmt: skip
    with pytest.raises(ValueError, match="moe_matmul: fmt must be one of dtype, mxfp4"):
        kern().moe_matmul(np.empty((6, 8), np.float32), h, np.zeros((4, 8, 32), np.float32),
                          sp, offs, 2, fmt="q4_k")  # fmt: skip
    with pytest.raises(ValueError, match="moe_combine: gate and shared go together"):
        kern().moe_combine(np.empty((3, 4), np.float32), np.zeros((6, 4), np.float32), w,
                           sp, gate=np.zeros(3, np.float32))  # fmt: skip
    with pytest.raises(ValueError, match="act_and_mul: limit must be > 0"):
        kern().clamped_swiglu(np.empty((3, 16), np.float32), h, 1.7, 0.0)
