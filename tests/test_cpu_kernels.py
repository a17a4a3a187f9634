"""The native CPU kernels (``cpu_src/`` through ``engine.backends.cpu_ops``) against their NumPy
twins in ``reference/kernel_ops`` computed in float64 (a 16- or 8-bit cache read exactly),
on ragged shapes: context lengths 1, 15, 16, 17 and over 1,000, GQA groups 1, 2, 3 and 8, head
dims 64, 80 and 128, float32, bfloat16 and the two 8-bit float caches (and float16 once),
sliding windows; on one thread and on two, which give the same bits (a task's arithmetic does
not depend on the thread that runs it)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from engine.backends import cpu_native, cpu_ops
from engine.backends.base import numpy_dtype
from engine.backends.quant import (
    BLOCK_FORMATS,
    IQ4_FORMATS,
    KQUANT_FORMATS,
    RAW_FORMATS,
    quantize,
    to_bf16_panels,
    to_int8,
    to_int8_panels,
    to_panels,
)
from engine.utils import cdiv
from reference import kernel_ops as numpy_ops
from tests.native import remote
from tests.test_blocks import assert_product, random_weight
from tests.test_checkpoint_quant import assert_fp8_products, assert_q4_z_products
from tests.test_kquants import assert_kquant_product, kquant_weight, quantized_x, x_block

CACHES = ["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
DT = {name: numpy_dtype(name) for name in CACHES}
BF16 = DT["bfloat16"]
FP8 = ["fp8_e4m3", "fp8_e5m2"]
LENS = [1, 15, 16, 17, 1100]
# (Hkv, group, hd, window); hd 80 takes the kernels' loops for any multiple of 16
SHAPES = [(1, 1, 64, 0), (3, 3, 64, 0), (1, 8, 128, 0), (2, 8, 64, 20), (2, 2, 80, 0)]
NAMES = [f"hkv{h}-g{g}-hd{d}" + (f"-window{w}" if w else "") for h, g, d, w in SHAPES]


@pytest.fixture(scope="module", params=remote.BUILDS, autouse=True)
def build(request):
    """Every test on each build of the kernels: this machine's own, x86-64-v3 (AVX2, FMA,
    F16C), the architecture's baseline (the portable code), and aarch64 under qemu-user. CI
    has the tools for all four; elsewhere a build this machine cannot make or run is skipped
    with the reason."""
    if request.param == "native":
        yield request.param
        return
    try:
        lib = remote.load(request.param)
    except LookupError as e:
        if os.environ.get("CI") and "lacks" not in str(e):
            raise
        pytest.skip(f"the {request.param} build: {e}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_native, "_lib", [lib])
        if isinstance(lib, remote.RemoteLibrary):
            mp.setattr(cpu_ops, "_p", lambda a: a)  # the arrays themselves go down the pipe
        yield request.param
    if isinstance(lib, remote.RemoteLibrary):
        lib.close()


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request, monkeypatch):
    monkeypatch.setattr(cpu_ops, "threads", lambda: request.param)
    return request.param


def values(rng, shape, dtype):
    """Normal values in a cache's dtype; an 8-bit float's spread over 2^-10..2^6 times that,
    so its subnormals and most of its exponents occur."""
    x = rng.standard_normal(shape)
    if dtype.itemsize == 1:
        x *= 2.0 ** rng.uniform(-10, 6, shape)
    return x.astype(dtype)


def paged(rng, lens, hkv, hd, dtype, bs=16):
    """K and V pools holding each sequence's rows in shuffled blocks, and the block tables."""
    n_blocks = sum(cdiv(n, bs) for n in lens) + 2
    k = values(rng, (n_blocks, bs, hkv, hd), dtype)
    v = values(rng, (n_blocks, bs, hkv, hd), dtype)
    ids, at = rng.permutation(n_blocks), 0
    tables = np.full((len(lens), cdiv(max(lens), bs) + 1), -1, np.int32)
    for b, n in enumerate(lens):
        tables[b, : cdiv(n, bs)] = ids[at : at + cdiv(n, bs)]
        at += cdiv(n, bs)
    return k, v, tables


def f64(a):
    return a.astype(np.float64)


def close(got, want, v):
    """Within float32's accumulated rounding, relative to the outputs or (an 8-bit cache's
    values spread up to a few hundred) to the largest V, whose sums can cancel to 1."""
    atol = 2e-5 * max(1.0, float(np.abs(f64(v)).max()) / 8)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=atol)


@pytest.mark.parametrize("shape", SHAPES, ids=NAMES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", *FP8])
def test_decode_attention(threads, shape, dtype):
    hkv, group, hd, window = shape
    rng = np.random.default_rng([hkv, group, hd, window, threads])
    lens = rng.permutation(LENS)
    k, v, tables = paged(rng, lens, hkv, hd, DT[dtype])
    q = rng.standard_normal((len(lens), hkv * group, hd), dtype=np.float32)
    want = numpy_ops.paged_attention_decode(f64(q), f64(k), f64(v), tables, lens, 0.125, window)
    got = cpu_ops.paged_attention_decode(q, k, v, tables, lens, 0.125, window)
    assert got.dtype == np.float32
    close(got, want, v)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8_e4m3"])
def test_decode_attention_few_long_sequences(threads, dtype):
    """Two sequences on two threads: a task per (sequence, KV head), each over several chunks
    of keys (a chunk is 256), the next task's first chunk asked for over the last one."""
    rng = np.random.default_rng([threads, 5])
    lens = np.array([int(rng.integers(700, 1300)), int(rng.integers(257, 600))], np.int32)
    k, v, tables = paged(rng, lens, 2, 128, DT[dtype])
    q = rng.standard_normal((2, 16, 128), dtype=np.float32)
    want = numpy_ops.paged_attention_decode(f64(q), f64(k), f64(v), tables, lens, 0.1)
    got = cpu_ops.paged_attention_decode(q, k, v, tables, lens, 0.1)
    close(got, want, v)


@pytest.mark.parametrize("bs", [1, 8, 32, 48])
@pytest.mark.parametrize("dtype", ["float32", "float16", "fp8_e5m2"])
def test_decode_attention_walks_any_block_size(threads, bs, dtype):
    """A tile of keys (16) spans several blocks, one, or part of one: the key offsets are
    walked block by block."""
    rng = np.random.default_rng([bs, threads])
    lens = rng.permutation(LENS[:4] + [int(rng.integers(90, 200))])
    k, v, tables = paged(rng, lens, 2, 64, DT[dtype], bs)
    q = rng.standard_normal((len(lens), 6, 64), dtype=np.float32)
    want = numpy_ops.paged_attention_decode(f64(q), f64(k), f64(v), tables, lens, 0.125)
    got = cpu_ops.paged_attention_decode(q, k, v, tables, lens, 0.125)
    close(got, want, v)


@pytest.mark.parametrize("shape", SHAPES, ids=NAMES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", *FP8])
def test_prefill_attention(threads, shape, dtype):
    """Runs of 1, 15, 3, 17 and 130 query rows; all but the first start part-way into their
    sequence (a cached prefix)."""
    hkv, group, hd, window = shape
    rng = np.random.default_rng([hkv, group, hd, window, threads, 1])
    lens = np.array(LENS, np.int32)
    q_lens = np.array([1, 15, 3, 17, 130])
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    k, v, tables = paged(rng, lens, hkv, hd, DT[dtype])
    q = rng.standard_normal((int(qsl[-1]), hkv * group, hd), dtype=np.float32)
    args = (tables, qsl, lens, 0.125, window)
    want = numpy_ops.paged_attention_prefill(f64(q), f64(k), f64(v), *args)
    got = cpu_ops.paged_attention_prefill(q, k, v, *args)
    close(got, want, v)


@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8_e4m3"])
def test_softcapped_attention(threads, window, dtype):
    """Gemma 2's soft-capping, tanh(s / cap) * cap of every score, in both kernels, against
    the reference's einsum; a scale large enough that the cap changes the output."""
    rng = np.random.default_rng()
    lens = rng.permutation(LENS)
    k, v, tables = paged(rng, lens, 2, 64, DT[dtype])
    q = rng.standard_normal((len(lens), 8, 64), dtype=np.float32)
    args = (tables, lens, 0.5, window)
    want = numpy_ops.paged_attention_decode(f64(q), f64(k), f64(v), *args, 3.0)
    close(cpu_ops.paged_attention_decode(q, k, v, *args, 3.0), want, v)
    uncapped = numpy_ops.paged_attention_decode(f64(q), f64(k), f64(v), *args)
    assert np.abs(want - uncapped).max() > 1e-2
    q_lens = np.array([1, 15, 3, 17, 130])
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    lens = np.array(LENS, np.int32)
    k, v, tables = paged(rng, lens, 2, 64, DT[dtype])
    q = rng.standard_normal((int(qsl[-1]), 8, 64), dtype=np.float32)
    args = (tables, qsl, lens, 0.5, window)
    want = numpy_ops.paged_attention_prefill(f64(q), f64(k), f64(v), *args, 3.0)
    close(cpu_ops.paged_attention_prefill(q, k, v, *args, 3.0), want, v)


@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8_e4m3"])
def test_attention_with_sinks(threads, window, dtype):
    """gpt-oss's sinks, one more logit per head in every softmax whose share is dropped, in
    both kernels against the reference's (a concatenated column); sinks drawn around the
    scores' range and one far above them (the sum's larger term then the sink's)."""
    rng = np.random.default_rng()
    lens = rng.permutation(LENS)
    k, v, tables = paged(rng, lens, 2, 64, DT[dtype])
    q = rng.standard_normal((len(lens), 8, 64), dtype=np.float32)
    sinks = (3 * rng.standard_normal(8)).astype(np.float32)
    sinks[rng.integers(8)] = 40.0  # above every score: that head's output nearly vanishes
    args = (tables, lens, 0.125, window, 0.0)
    want = numpy_ops.paged_attention_decode(f64(q), f64(k), f64(v), *args, sinks)
    close(cpu_ops.paged_attention_decode(q, k, v, *args, sinks), want, v)
    plain = numpy_ops.paged_attention_decode(f64(q), f64(k), f64(v), *args)
    assert np.abs(want - plain).max() > 1e-2
    q_lens = np.array([1, 15, 3, 17, 130])
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    lens = np.array(LENS, np.int32)
    k, v, tables = paged(rng, lens, 2, 64, DT[dtype])
    q = rng.standard_normal((int(qsl[-1]), 8, 64), dtype=np.float32)
    args = (tables, qsl, lens, 0.125, window, 0.0)
    want = numpy_ops.paged_attention_prefill(f64(q), f64(k), f64(v), *args, sinks)
    close(cpu_ops.paged_attention_prefill(q, k, v, *args, sinks), want, v)


@pytest.mark.parametrize("dtype", FP8)
def test_every_8_bit_value_is_read_exactly(threads, dtype):
    """Sequences of one key: the attention's output is that key's V row, so rows holding all
    256 byte values (NaN and, for e5m2, the infinities among them) must come out as NumPy
    widens them, from both kernels."""
    rng = np.random.default_rng([threads, len(dtype)])
    hd, dt = 64, DT[dtype]
    codes = rng.permutation(256).astype(np.uint8).reshape(4, 1, 1, hd)  # 4 blocks of one row
    v = codes.view(dt)  # (4, bs 1, Hkv 1, hd)
    k = values(rng, v.shape, dt)
    tables = rng.permutation(4).astype(np.int32)[:, None]  # (4, 1)
    lens = np.ones(4, np.int32)
    q = rng.standard_normal((4, 2, hd), dtype=np.float32)
    want = np.repeat(v[tables[:, 0], 0].astype(np.float32), 2, axis=1)  # (4, H 2, hd)
    got = cpu_ops.paged_attention_decode(q, k, v, tables, lens, 0.125)
    np.testing.assert_array_equal(got, want)
    qsl = np.arange(5, dtype=np.int32)
    got = cpu_ops.paged_attention_prefill(q, k, v, tables, qsl, lens, 0.125)
    np.testing.assert_array_equal(got, want)
    assert np.isnan(want).sum() == {"fp8_e4m3": 4, "fp8_e5m2": 12}[dtype]


def test_attention_bits_do_not_depend_on_the_thread_count(monkeypatch):
    rng = np.random.default_rng(7)
    lens = np.array(LENS * 3, np.int32)
    k, v, tables = paged(rng, lens, 3, 64, BF16)
    q = rng.standard_normal((len(lens), 9, 64), dtype=np.float32)
    qsl = np.arange(len(lens) + 1, dtype=np.int32)
    outs = []
    for n in (1, 2, 3):
        monkeypatch.setattr(cpu_ops, "threads", lambda n=n: n)
        outs.append(cpu_ops.paged_attention_decode(q, k, v, tables, lens, 0.1))
        outs.append(cpu_ops.paged_attention_prefill(q, k, v, tables, qsl, lens, 0.1))
    for a, b in zip(outs[2:], outs[:-2], strict=True):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("dtype", CACHES)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "bias-and-head-norms"])
def test_rotary_fused_with_the_cache_write(threads, dtype, qk_norm):
    """q rotated, k rotated and v written into their slots with one rounding to the cache's
    dtype (an 8-bit float saturating at its largest finite value: one token's K and V are
    beyond e4m3's 448); padding slots (< 0) written nowhere."""
    rng = np.random.default_rng([threads, qk_norm, len(dtype)])
    n_tok, H, hkv, hd, bs, n_blocks = 37, 6, 2, 64, 16, 5
    qkv = rng.standard_normal((n_tok, (H + 2 * hkv) * hd), dtype=np.float32)
    qkv[7] *= 2000.0
    positions = rng.integers(0, 4000, n_tok).astype(np.int32)
    slots = rng.permutation(n_blocks * bs)[:n_tok].astype(np.int32)
    slots[[3, 20]] = -1
    extra = {}
    if qk_norm:
        extra = dict(
            bias=rng.standard_normal(qkv.shape[1], dtype=np.float32),
            q_norm=rng.standard_normal(hd, dtype=np.float32),
            k_norm=rng.standard_normal(hd, dtype=np.float32),
            eps=1e-6,
        )
    dt = DT[dtype]
    fill = values(rng, (n_blocks, bs, hkv, hd), dt)  # (the 8-bit values at most 2^6 x normal)
    caches = {name: [fill.copy(), fill.copy()] for name in ("want", "got")}
    want = numpy_ops.rotary_cache(qkv, positions, 1e4, *caches["want"], slots, H, **extra)
    got = cpu_ops.rotary_cache(qkv, positions, 1e4, *caches["got"], slots, H, **extra)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    untouched = np.setdiff1d(np.arange(n_blocks * bs), slots)
    for w, g in zip(caches["want"], caches["got"], strict=True):  # K, then V
        step = {4: 1e-5, 2: 1e-2, 1: 0.25}[dt.itemsize]  # a value's neighbours in the dtype
        np.testing.assert_allclose(f64(g), f64(w), rtol=step, atol=1e-6)
        if dtype != "float32":  # one rounding of nearly the same float: nearly always equal
            assert (f64(g) == f64(w)).mean() > 0.99
        assert np.isfinite(f64(g)).all()  # saturated, not NaN or infinite
        assert np.array_equal(
            g.reshape(-1, hkv, hd)[untouched], fill.reshape(-1, hkv, hd)[untouched]
        )
    if dtype == "fp8_e4m3":  # token 7's V (never normalized) was beyond 448
        assert np.abs(f64(caches["got"][1])).max() == 448


@pytest.mark.parametrize("rows", [1, 17, 700])
def test_norms_and_silu(threads, rows):
    rng = np.random.default_rng([rows, threads])
    D, F = 576, 1536
    x, r = (rng.standard_normal((rows, D), dtype=np.float32) for _ in range(2))
    w = rng.standard_normal(D, dtype=np.float32)
    np.testing.assert_allclose(
        cpu_ops.rms_norm(x, w, 1e-5), numpy_ops.rms_norm(f64(x), w, 1e-5), rtol=1e-5, atol=1e-5
    )
    want_out, want_res = numpy_ops.fused_add_rms_norm(f64(x), f64(r), w, 1e-5, offset=1.0)
    got_out, got_res = cpu_ops.fused_add_rms_norm(x, r.copy(), w, 1e-5, offset=1.0)
    np.testing.assert_allclose(got_res, want_res, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got_out, want_out, rtol=1e-5, atol=1e-5)
    gate_up = 4 * rng.standard_normal((rows, 2 * F), dtype=np.float32)
    gate_up[0, :3] = [-100.0, 100.0, 0.0]  # e^-g beyond float32 both ways
    np.testing.assert_allclose(
        cpu_ops.silu_and_mul(gate_up), numpy_ops.silu_and_mul(f64(gate_up)), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 64])
def test_matmul_on_the_kernels_threads(threads, rows):
    """Column slices per thread through the BLAS NumPy ships (a row: runs of W's rows, partial
    sums added; 2 to 8 rows: matmul_quant.cpp's GEMV); widths that do not split evenly."""
    rng = np.random.default_rng([rows, threads, 3])
    for k, n in [(576, 960), (1536, 577), (64, 49)]:
        x = rng.standard_normal((rows, k), dtype=np.float32)
        w = rng.standard_normal((k, n), dtype=np.float32)
        got = cpu_ops.matmul(x, w)
        assert got.shape == (rows, n) and got.dtype == np.float32
        np.testing.assert_allclose(got, f64(x) @ f64(w), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("kind", ["float32", "int8"])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 12, 13, 64, 97])
def test_matmul_over_panels(threads, rows, kind):
    """matmul_panels.cpp: float32 (to_panels) or int8 with a scale per column (to_int8_panels)
    weights in (N/16, K, 16) panels against float64 of the values they hold: row counts that
    fill a tile (12 rows with AVX-512, 6 without), leave rows over, and cross a block of 96
    rows; one or two rows (four sets of sums over k, K not a multiple of four); an odd panel
    count (a group of two and one left) and a single panel; K of 3 and 1,537."""
    rng = np.random.default_rng()
    for k, n in [(576, 960), (1537, 48), (3, 16), (64, 4096)]:
        x = rng.standard_normal((rows, k), dtype=np.float32)
        w = (rng.standard_normal((k, n)) * rng.uniform(0.1, 3, n)).astype(np.float32)
        panels = to_panels(w) if kind == "float32" else to_int8_panels(w)
        assert panels.shape == (k, n) and panels.data.shape == (n // 16, k, 16)
        want = w if kind == "float32" else to_int8(w).dequantize()
        np.testing.assert_array_equal(panels.dequantize(), want)
        got = cpu_ops.matmul(x, panels)
        assert got.shape == (rows, n) and got.dtype == np.float32
        np.testing.assert_allclose(got, f64(x) @ f64(want), rtol=1e-4, atol=3e-3)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 12, 13, 64, 97])
def test_matmul_over_bf16_panels(threads, rows):
    """matmul_panels_bf16.cpp: bf16 weights in (N/16, K/2, 32) panels (to_bf16_panels) times x
    rounded to bf16, against float64 (AVX512-BF16's dot products where the build has them,
    float32 FMAs elsewhere): row counts that fill a tile (12, or 4 with AVX2), leave rows over
    and cross a block of 96; an odd panel count and a single panel; K of 2 and 1,538. x's
    rounding is to nearest even with ties (values halfway between two bf16s) in both
    directions, and the panels hold the matrix's bf16 values exactly."""
    rng = np.random.default_rng()
    for k, n in [(576, 960), (1538, 48), (2, 16), (64, 4096)]:
        x = rng.standard_normal((rows, k), dtype=np.float32)
        bits = x.view(np.uint32)
        bits[:, :4] = (bits[:, :4] & 0xFFFF0000) | 0x8000  # ties: to even, up or down
        bits[:, 1::8] |= 0x10000  # odd in bf16: a tie rounds away from it
        w = rng.standard_normal((k, n), dtype=np.float32).astype(BF16).astype(np.float32)
        panels = to_bf16_panels(w)
        assert panels.shape == (k, n) and panels.data.shape == (n // 16, k // 2, 32)
        np.testing.assert_array_equal(panels.dequantize(), w)
        got = cpu_ops.matmul(x, panels)
        assert got.shape == (rows, n) and got.dtype == np.float32
        want = f64(x.astype(BF16)) @ f64(w)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("kind", BLOCK_FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 9, 23, 64, 65, 139])
def test_matmul_over_gguf_blocks(threads, kind, rows):
    """matmul_blocks.cpp on each build (AVX2's vpmaddubsw, AVX-512 VNNI, the plain loops, ARM):
    the GEMV, the integer dots over chunks of W, the float32 tiles and VNNI's 16 rows of W at
    a time (65 rows and more; N of 5, 33 and 272: chunks cut short), against the NumPy twin
    (tests/test_blocks.py has the rest); K of 1, 3 and 18 blocks (Q4's dots take blocks in
    pairs), (1536, 272) on two threads."""
    rng = np.random.default_rng()
    for k, n in [(32, 5), (96, 16), (576, 33), (1536, 272)]:
        x = rng.standard_normal((rows, k), dtype=np.float32)
        x[:, 3] *= 40
        assert_product(x, quantize(random_weight(rng, k, n), kind))


@pytest.mark.parametrize("rows", [1, 9, 65])
def test_matmul_over_q4_z_blocks(threads, rows):
    """A 4-bit checkpoint's q4_z blocks on each build: Q4_1's bits where Q4_1 holds the same
    values, the twin's product for any zero point (tests/test_checkpoint_quant.py)."""
    rng = np.random.default_rng()
    for n, k in [(33, 96), (272, 1536)]:
        assert_q4_z_products(rng, rows, n, k)


@pytest.mark.parametrize("rows", [1, 5])
def test_matmul_over_fp8(threads, rows):
    """An FP8 checkpoint's e4m3 bytes on each build (AVX-512's 16 at a time, F16C's 8, the
    table): the float64 product of their float32 values (tests/test_checkpoint_quant.py)."""
    assert_fp8_products(rows)


@pytest.mark.parametrize("kind", [k for k in RAW_FORMATS if k not in KQUANT_FORMATS + IQ4_FORMATS])
@pytest.mark.parametrize("rows", [1, 6, 19, 64, 129])
def test_matmul_over_gguf_kquants(threads, kind, rows):
    """matmul_q5.cpp and matmul_mxfp4.cpp on each build (AVX2's vpmaddubsw, VNNI's vpdpbusd,
    the plain loops, ARM): the integer dots (up to 64 rows) and the float32 tiles (more), against
    the float64 product of the NumPy dequantizer's values, within x's 8-bit quantization; K of
    1, 3 and 6 blocks of 256 and 9 blocks of 32 (SmolLM2's 288), N of 5, 33 and 130 (two
    threads). The k-quants and IQ4 have the tighter tests below."""
    rng = np.random.default_rng()
    shapes = [(256, 5), (768, 130), (1536, 33)] + ([] if x_block(kind) == 256 else [(288, 7)])
    for k, n in shapes:
        x = rng.standard_normal((rows, k), dtype=np.float32)
        x[:, 3] *= 40  # an outlier widens its block's step
        w = kquant_weight(rng, kind, k, n)
        got = cpu_ops.matmul(x, w)
        assert got.shape == (rows, n) and got.dtype == np.float32
        assert_kquant_product(x, w, got)


@pytest.mark.parametrize("kind", IQ4_FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 8, 65])
def test_iq4_products_are_exact_integer_sums(threads, kind, rows):
    """matmul_iq4.cpp on each build (vpshufb and the sign trick, VNNI, NEON's tbl, the plain
    loop; 1, 3 and 8 rows: one, a partial and a whole run of 4; 65: the float32 tiles) against
    the float64 product of x quantized as the kernels do (per 32 values for IQ4_NL, 256 for
    IQ4_XS) and the NumPy dequantizer's values: the integer sums are exact, so only float32
    rounding of the block factors and sums is left (a wrong index, scale or nibble is ~1e-3)."""
    rng = np.random.default_rng()
    shapes = [(256, 5), (1536, 33)] + ([(288, 19)] if kind == "iq4_nl" else [(768, 130)])
    for k, n in shapes:
        x = rng.standard_normal((rows, k), dtype=np.float32)
        x[:, 3] *= 40
        w = kquant_weight(rng, kind, k, n)
        xq, vals = quantized_x(x, x_block(kind)), w.dequantize().astype(np.float64)
        got = cpu_ops.matmul(x, w)
        err = np.abs(got - xq @ vals)
        assert (err <= 1e-5 * (np.abs(xq) @ np.abs(vals))).all(), kind


@pytest.mark.parametrize("kind", KQUANT_FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 19, 64, 129])
def test_kquant_products_are_exact_integer_sums(threads, kind, rows):
    """matmul_kquants.cpp on each build (Q2_K and Q3_K's 2-bit pairs and third bits, their
    4-bit and packed 6-bit scales among the others; 1 row: the two-row decode; 3 and 19: runs of
    4 (AVX2: 16) whole and partial; 64 and 129: the VNNI GEMM from 64 rows, with a group of x
    partly empty, the integer dots below 128 without it and the float32 tiles past) against
    the float64 product of x quantized as Q8_K and the NumPy dequantizer's values: the integer
    sums are exact, so only float32 rounding is left (a wrong bit, scale or min is ~1e-3 of the
    sums)."""
    rng = np.random.default_rng()
    for k, n in [(256, 5), (768, 130), (1536, 33)]:
        x = rng.standard_normal((rows, k), dtype=np.float32)
        x[:, 3] *= 40
        w = kquant_weight(rng, kind, k, n)
        xq, vals = quantized_x(x, 256), w.dequantize().astype(np.float64)
        err = np.abs(cpu_ops.matmul(x, w) - xq @ vals)
        assert (err <= 1e-5 * (np.abs(xq) @ np.abs(vals))).all(), kind


@pytest.mark.parametrize("kind", [k for k in RAW_FORMATS if k.endswith("_k")] + list(IQ4_FORMATS))
def test_a_kquant_decode_has_the_bits_of_a_batch_row(threads, kind):
    """One row of x (a decode: AVX2 takes a k-quant's W rows two at a time) gives each output the
    bits the same row gets inside a batch of rows (one W row at a time): N odd, so a row goes
    alone."""
    rng = np.random.default_rng()
    x = rng.standard_normal((1, 768), dtype=np.float32)
    w = kquant_weight(rng, kind, 768, 131)
    one = cpu_ops.matmul(x, w)  # (1, 131)
    batch = cpu_ops.matmul(np.concatenate([x, x * 2, x]), w)  # (3, 131)
    np.testing.assert_array_equal(one[0], batch[0])
    np.testing.assert_array_equal(one[0], batch[2])


def test_panels_need_whole_panels():
    with pytest.raises(ValueError, match=r"panels: .* multiple of 16, got \(8, 20\)"):
        to_panels(np.ones((8, 20), np.float32))
    with pytest.raises(ValueError, match=r"bf16 panels: .* got \(7, 16\)"):
        to_bf16_panels(np.ones((7, 16), np.float32))


@pytest.mark.parametrize("vocab", [7, 8, 1003])
def test_argmax_rows_is_greedy_ids(threads, vocab):
    """The first maximum of each row, NaN never winning, -1 for a row with nothing above -inf:
    rows with ties, NaNs, +inf, all -inf, all NaN, and a maximum in the last (unvectorized)
    columns, against numpy_backend.greedy_ids."""
    from engine.backends.base import greedy_ids

    rng = np.random.default_rng([vocab, threads])
    x = rng.standard_normal((40, vocab)).astype(np.float32)
    x[1, rng.integers(vocab, size=3)] = np.nan
    x[2] = -np.inf
    x[3] = np.nan
    x[4, rng.integers(vocab)] = np.inf
    x[5, [0, vocab - 1]] = 9.0  # a tie: the first one wins
    x[6, vocab - 1] = 9.0  # the maximum in the last column
    x[7, :-1] = -np.inf
    want = greedy_ids(x)
    assert (want[[2, 3]] == -1).all() and want[5] == 0 and want[6] == vocab - 1
    np.testing.assert_array_equal(cpu_ops.argmax_rows(x), want)
