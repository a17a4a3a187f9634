"""engine.tools.bench_gpu's ceilings, computed from the loaded weights' own shapes."""

from __future__ import annotations

import numpy as np
import pytest

from engine.tools import bench_gpu


def matmul_weights(loaded) -> int:
    """Every weight a decode token multiplies: each layer's 2-D matrices, and the LM head."""
    w = loaded.weights
    mats = [a for lw in w.layers for a in vars(lw).values() if a is not None and a.ndim == 2]
    per_layer = sum(a.size for a in mats)
    return per_layer + w.lm_head.size


@pytest.mark.parametrize("batch", [1, 7, 256])
def test_decode_step_flops_counts_every_product_and_attention(tiny, batch):
    c = tiny.config
    ctx = float(np.random.default_rng().integers(1, 4096))
    attention = 2 * 2 * batch * c.num_hidden_layers * c.num_attention_heads * c.head_dim * ctx
    want = 2 * batch * matmul_weights(tiny) + attention
    assert bench_gpu.decode_step_flops(c, batch, ctx) == pytest.approx(want, rel=1e-12)


class _Engine:
    class backend:
        kv_dtype = "bfloat16"
        weights_bytes = 2_000_000_000


def test_roofline_takes_the_longer_floor(tiny):
    c, n, ctx = tiny.config, 64, 192.0
    kv = n * ctx * c.kv_bytes_per_token("bfloat16")
    memory = bench_gpu.roofline(_Engine, c, n, ctx, bandwidth_gbs=4000.0, tflops=1e6)
    assert memory["bound"] == "memory"
    assert memory["roofline"] == pytest.approx(n * 4000e9 / (2e9 + kv))
    slow = 1e-9  # TFLOP/s: any step is compute-bound
    compute = bench_gpu.roofline(_Engine, c, n, ctx, bandwidth_gbs=4000.0, tflops=slow)
    assert compute["bound"] == "compute"
    flops = bench_gpu.decode_step_flops(c, n, ctx)
    assert compute["roofline"] == pytest.approx(n / (flops / (slow * 1e12)))


def test_decode_step_flops_count_only_the_window_a_layer_sees():
    from tests.test_families import loaded

    c = loaded("qwen2_swa").config  # layer 0 full, layers 1 and 2 a window of 8
    ctx = float(np.random.default_rng().integers(9, 4096))
    per_token = 4 * c.num_attention_heads * c.head_dim
    full = bench_gpu.decode_step_flops(c, 1, ctx) - bench_gpu.decode_step_flops(c, 1, 0.0)
    assert full == pytest.approx(per_token * (ctx + 8 + 8), rel=1e-12)
