"""A mixture of experts' kernels on the device (cuda_src/moe_*.cu): routing, the pairs bucketed
by expert, the grouped products over the activations' dtype and MXFP4 blocks, the combine,
against NumPy (tests/test_kernels_moe.py runs the same checks on the CPU builds). The families'
tiny mixtures run end to end in tests/test_gpu.py."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

pytestmark = pytest.mark.gpu  # skipped without a GPU, or failed with REQUIRE_GPU=1 (conftest)

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
IDS = ["f32", "f16", "bf16"]


@pytest.fixture
def dev(gpu_device):
    with gpu_device.active():
        yield gpu_device


@pytest.fixture
def rng():
    return np.random.default_rng()


def randn(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale + 0.1).astype(dtype)


def poisoned(dev, shape, dtype):
    return dev.upload(np.full(shape, np.nan, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_expert_kernels(dev, dtype, rng):
    """moe_route, moe_align, moe_matmul (the dtype's weights and MXFP4 blocks) and moe_combine
    on the device: a layer of experts against NumPy's routing and float64 products."""
    from engine.backends import moe
    from model_loader import mxfp4
    from tests.test_kernels_moe import TOL as MOE_TOL
    from tests.test_kernels_moe import expert_products, random_mxfp4

    T, E_, k, D, N = 40, 8, 2, 96, 136
    h = randn(rng, (T, D), dtype)
    router = randn(rng, (E_, D), np.float32)
    ids, w = dev.upload(np.zeros((T, k), np.int32)), dev.upload(np.zeros((T, k), np.float32))
    dev.kernels.moe_route(ids, w, dev.upload(h), dev.upload(router), k, True)
    want_ids, want_w = moe.route(h.astype(np.float32), router.T.copy(), k, True)
    host_ids = dev.download(ids)
    assert (host_ids == want_ids).mean() > 0.95  # a near tie may order differently in float32
    order = [dev.upload(np.zeros(T * k, np.int32)) for _ in range(2)]
    offsets, totals = dev.upload(np.zeros(E_ + 1, np.int32)), dev.upload(np.zeros(E_, np.uint64))
    dev.kernels.moe_align(*order, offsets, totals, ids, dev.upload(np.arange(T, dtype=np.int32)))
    sorted_pairs, inverse, offs = (
        dev.download(order[0]),
        dev.download(order[1]),
        dev.download(offsets),
    )
    np.testing.assert_array_equal(dev.download(totals), np.bincount(host_ids.ravel(), minlength=E_))
    weights = {"dtype": randn(rng, (E_, N, D), dtype, 0.1), "mxfp4": random_mxfp4(rng, E_, N, D)}
    for fmt, wt in weights.items():
        values = (
            wt if fmt == "dtype" else mxfp4.dequantize_blocks(wt.reshape(-1, 17)).reshape(E_, N, D)
        )
        out = poisoned(dev, (T * k, N), np.float32)
        dev.kernels.moe_matmul(out, dev.upload(h), dev.upload(wt), order[0], offsets, k, fmt=fmt)
        want = expert_products(h, values, host_ids, sorted_pairs, offs, k)
        assert np.abs(dev.download(out) - want).max() <= MOE_TOL[dtype] * np.abs(want).max(), fmt
    y = rng.standard_normal((T * k, D)).astype(np.float32)
    out = poisoned(dev, (T, D), dtype)
    dev.kernels.moe_combine(out, dev.upload(y), w, order[1])
    want = np.einsum("tk,tkd->td", dev.download(w), y[inverse].reshape(T, k, D))
    got = dev.download(out).astype(np.float64)
    assert np.abs(got - want).max() <= MOE_TOL[dtype] * np.abs(want).max()
