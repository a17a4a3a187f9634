"""The cpu backend's expert step in one native call (cpu_ops.experts, cpu_src/moe_experts.cpp)
against moe.experts_forward's loop over the experts through the same ops' products: the same
bits for every kind whose products it cuts into column runs (the kernels run the same dots on
the same rows), float32 rounding for the kinds it runs whole on one thread (plain float32 and
bf16, whose loop products split K over the threads); the routing counts; a float64 reference;
the cases it leaves to the loop."""

from __future__ import annotations

import types

import numpy as np
import pytest

from engine.backends import cpu_ops, moe
from engine.backends.quant import (
    QuantWeight,
    quantize,
    to_bf16,
    to_bf16_panels,
    to_int8_panels,
    to_panels,
)
from reference.model import ACTIVATIONS
from reference.moe import route_token
from tests.test_kquants import random_raw

F32 = np.float32
D, F = 256, 256  # k-quant rows are whole super-blocks of 256
LOOP = types.SimpleNamespace(matmul=cpu_ops.matmul, act_and_mul=cpu_ops.act_and_mul)
KINDS = ["float32", "panels", "bf16_panels", "int8_panels", "bf16", "q8_0", "q4_0", "q4_1"]
KINDS += ["q4_k", "q5_k", "q6_k", "q5_0", "q5_1", "mxfp4", "parts", "q4_k/q8_0", "q2_k", "q3_k"]
WHOLE = ("float32", "bf16")  # run whole on one thread: float32 rounding, not the same bits


def kept(rng, kind: str, k: int, n: int):
    """A random (K, N) matrix kept as the cpu backend keeps that kind."""
    if kind in ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q5_0", "q5_1", "mxfp4"):
        scale = 0.5 if kind == "mxfp4" else 0.01  # MXFP4: its largest value's bound
        return QuantWeight(kind, random_raw(rng, kind.upper(), n, k, scale=scale))
    if kind == "parts":  # a GGUF's gate and up of two types side by side
        half = n // 2
        return QuantWeight(
            "parts", None, parts=(kept(rng, "q5_k", k, half), kept(rng, "q4_k", k, half))
        )
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(F32)
    stores = {"float32": lambda a: a, "panels": to_panels, "bf16_panels": to_bf16_panels}
    stores |= {"int8_panels": to_int8_panels, "bf16": to_bf16}
    return stores[kind](w) if kind in stores else quantize(w, kind)


def packed(rng, kind: str, experts: int, top_k: int) -> moe.PackedExperts:
    router = rng.standard_normal((D, experts)).astype(F32)  # (D, E)
    # "parts": Q5_K | Q4_K gate|up, Q6_K down; "q4_k/q8_0": Q4_K gate|up, Q8_0 down
    up_kind, down_kind = {"parts": ("parts", "q6_k"), "q4_k/q8_0": ("q4_k", "q8_0")}.get(
        kind, (kind, kind)
    )
    gate_up = [kept(rng, up_kind, D, 2 * F) for _ in range(experts)]
    down = [kept(rng, down_kind, F, D) for _ in range(experts)]
    return moe.PackedExperts(router, gate_up, down, top_k, renormalize=True)


def both(h, layer, act):
    """(the fused step's output, the loop's), and the routing counts the first one added."""
    before = layer.chosen.copy()
    fused = moe.experts_forward(h, layer, cpu_ops, act)
    counted = layer.chosen - before
    return fused, moe.experts_forward(h, layer, LOOP, act), counted


def assert_same(fused, loop, kind):
    if kind in WHOLE:
        np.testing.assert_allclose(fused, loop, rtol=1e-5, atol=1e-5 * np.abs(loop).max())
    else:
        np.testing.assert_array_equal(fused, loop)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 7, 40])
def test_the_fused_step_is_the_loop(kind, rows):
    rng = np.random.default_rng()
    layer = packed(rng, kind, experts=8, top_k=3)
    h = rng.standard_normal((rows, D)).astype(F32)  # (T, D)
    fused, loop, counted = both(h, layer, "silu")
    assert np.abs(loop).max() > 0
    assert_same(fused, loop, kind)
    ids = [e for t in range(rows) for e, _ in route_token(h[t] @ layer.router, 3, True)]
    assert counted.tolist() == np.bincount(ids, minlength=8).tolist()


@pytest.mark.parametrize("kind", ["q8_0", "q4_k", "panels", "q4_k/q8_0"])
@pytest.mark.parametrize("rows", [200, 300])
def test_experts_of_more_rows_than_the_integer_dots_take(kind, rows):
    """200 or 300 tokens over 4 experts, top 2: about 100 or 150 rows an expert, past the
    blocks' 64 rows, and the k-quants' 128 at 300 (those experts run each kernel whole on
    every thread; with Q4_K gate|up and Q8_0 down, past the smaller of the two)."""
    rng = np.random.default_rng()
    layer = packed(rng, kind, experts=4, top_k=2)
    h = rng.standard_normal((rows, D)).astype(F32)
    fused, loop, counted = both(h, layer, "silu")
    assert counted.max() > (128 if rows == 300 else 64)
    assert_same(fused, loop, kind)


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh"])
@pytest.mark.parametrize("kind", ["q8_0", "q4_k", "panels"])
def test_the_gelus(act, kind):
    """GELU (erf) has the loop's bits; the tanh form is within float32 rounding (the C
    library's tanh against NumPy's)."""
    rng = np.random.default_rng()
    layer = packed(rng, kind, experts=6, top_k=2)
    h = rng.standard_normal((5, D)).astype(F32)
    fused, loop, _ = both(h, layer, act)
    if act == "gelu":
        np.testing.assert_array_equal(fused, loop)
    else:
        np.testing.assert_allclose(fused, loop, rtol=1e-5, atol=1e-5 * np.abs(loop).max())


def test_the_fused_step_against_a_float64_computation():
    """Float32 panels: each token's experts in float64, weighted, summed (reference's
    routing)."""
    rng = np.random.default_rng()
    layer = packed(rng, "panels", experts=8, top_k=2)
    h = rng.standard_normal((7, D)).astype(F32)
    got = moe.experts_forward(h, layer, cpu_ops, "silu")
    silu = ACTIVATIONS["silu"]
    want = np.zeros((7, D))
    for t in range(7):
        for e, weight in route_token(h[t] @ layer.router, 2, True):
            gu = h[t].astype(np.float64) @ layer.gate_up[e].dequantize()  # (2F,)
            a = silu(gu[:F]) * gu[F:]
            want[t] += weight * (a @ layer.down[e].dequantize())
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_what_the_fused_step_leaves_to_the_loop():
    """An activation it lacks, experts of different kinds, or a plain matrix not float32:
    cpu_ops.experts answers None and experts_forward runs the loop (the same products: its
    output is the loop's)."""
    rng = np.random.default_rng()
    layer = packed(rng, "q8_0", experts=4, top_k=2)
    h = rng.standard_normal((3, D)).astype(F32)
    ids, weights = moe.route(h, layer.router, 2, True)
    order, counts, offsets = moe.group(ids, 4)
    args = (order // 2, weights.reshape(-1)[order], offsets)
    assert cpu_ops.experts(h, layer, *args, "relu") is None
    assert cpu_ops.experts(h, layer, *args, "silu") is not None
    mixed = packed(rng, "q8_0", experts=4, top_k=2)
    mixed.gate_up[2] = kept(rng, "q4_0", D, 2 * F)
    assert cpu_ops.experts(h, mixed, *args, "silu") is None
    wide = packed(rng, "float32", experts=4, top_k=2)
    wide.down[1] = wide.down[1].astype(np.float64)
    assert cpu_ops.experts(h, wide, *args, "silu") is None
    np.testing.assert_array_equal(
        moe.experts_forward(h, mixed, cpu_ops, "silu"), moe.experts_forward(h, mixed, LOOP, "silu")
    )


@pytest.mark.parametrize("kind", ["mxfp4", "q8_0", "float32"])
@pytest.mark.parametrize("rows", [1, 5, 90])
def test_gpt_oss_experts_biases_and_clamp(kind, rows):
    """gpt-oss's experts: each product's bias and the clamped SwiGLU (limit 0.6: many values
    clamped) in the same call, against the loop (its NumPy activation: float32 rounding, the
    C library's exp against NumPy's; for the 8-bit kinds an activation one bit apart may round
    to the next int8 step before the down product, one step of one value: 3e-4 of the largest
    output); without the biases the sums differ."""
    rng = np.random.default_rng()
    layer = packed(rng, kind, experts=6, top_k=3)
    e = len(layer.down)
    router_bias = rng.standard_normal(e).astype(F32)
    gate_up_bias = rng.standard_normal((e, 2 * F)).astype(F32)
    down_bias = rng.standard_normal((e, D)).astype(F32)
    layer.biases, layer.clamp = (router_bias, gate_up_bias, down_bias), (1.702, 0.6)
    h = rng.standard_normal((rows, D)).astype(F32)
    fused, loop, _ = both(h, layer, "silu")
    step = 1e-5 if kind == "float32" else 3e-4  # x quantized to 8 bits before each product
    np.testing.assert_allclose(fused, loop, rtol=1e-5, atol=step * np.abs(loop).max())
    layer.biases = (router_bias, 0 * gate_up_bias, 0 * down_bias)
    assert np.abs(moe.experts_forward(h, layer, cpu_ops, "silu") - fused).max() > 1e-2
