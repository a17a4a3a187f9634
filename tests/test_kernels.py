"""Every CUDA kernel, run on the CPU emulator, against its NumPy twin in numpy_ops.

Fresh random inputs each run (never zeros), outputs poisoned with NaN first so every element
must be written, ragged sizes, and every block's threads run forward, reversed and shuffled.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from engine import emulation as E
from engine import kernels as K
from engine.emulation import kernel_ops as C
from engine.utils import cdiv
from reference import kernel_ops as N

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
DTYPE_IDS = ["f32", "f16", "bf16"]
LENGTHS = [1, 15, 16, 17, 130]  # sequence lengths: around a block of 16, and over 100


def tolerance(dtype) -> dict:
    """Per-dtype tolerance: float32 ~1e-5 relative, float16 ~1e-3, bfloat16 ~1e-2."""
    return {
        np.dtype(np.float32): dict(rtol=1e-5, atol=1e-5),
        np.dtype(np.float16): dict(rtol=1e-3, atol=1e-3),
        np.dtype(ml_dtypes.bfloat16): dict(rtol=1e-2, atol=1e-2),
    }[np.dtype(dtype)]


def assert_close(actual, expected, dtype) -> None:
    assert not np.isnan(np.asarray(actual, np.float32)).any(), "an output was never written"
    np.testing.assert_allclose(
        np.asarray(actual, np.float32), np.asarray(expected, np.float32), **tolerance(dtype)
    )


def poisoned(shape, dtype) -> np.ndarray:
    return np.full(shape, np.nan, dtype)


@pytest.fixture
def rng():
    return np.random.default_rng()


def randn(rng, shape, dtype, scale=1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale + 0.1).astype(dtype)


kern = E.cpu_kernels


# The counting builds the traffic tests at the end of this file launch: (file, defines).
COUNTED_FILES = [(n, ()) for n in ("rms_norm", "fused_add_rms_norm", "act_and_mul", "embedding")]
COUNTED_FILES += [("rotary_cache", ()), ("paged_attention_reduce", ())]
COUNTED_FILES += [("paged_attention_decode", {"HEAD_DIM": 64, "BLOCK_SIZE": 16})]
ASAN_TEST = "test_kernels_under_address_sanitizer"


@pytest.fixture(scope="module", autouse=True)
def built_kernels(request, tmp_path_factory):
    """Compile every kernel file once, and the counting builds the traffic tests use, two g++
    processes at a time (cached by content hash, so a later load is a hit). Where the ASan
    pass is selected, it starts here, in its own process (its g++ and its runs beside this
    module's single-threaded emulator runs); its test waits for it and checks its result."""
    selected = {item.name for item in request.session.items}
    asan = None
    if ASAN_TEST in selected and not K.asan_enabled():
        asan = start_asan_pass(tmp_path_factory.mktemp("asan"))
    jobs = [(n, d, None) for n in K.kernel_names() for d in K.define_sets(n)]
    if not K.asan_enabled():  # the ASan pass runs no traffic test
        jobs += [(n, d, kind) for n, d in COUNTED_FILES for kind in ("reads", "writes")]
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda j: K.compile_cpu(j[0], counting=j[2], defines=j[1]), jobs))
        yield asan
    finally:
        if asan is not None and asan.proc.poll() is None:  # stopped before its test ran
            asan.proc.kill()
            asan.proc.wait()


# ---- row-wise kernels -------------------------------------------------------------------------


# (T, D): rows around a lane group and a block of rows, over 1,000 rows; widths that split into
# 16-byte vectors and widths that do not (37, 4097: scalar; 100: 8-byte), a row longer than the
# registers hold (4097), rows one warp, a block and over 1,000 threads wide (576, 2050, 4097)
ROW_SHAPES = [(1, 64), (15, 37), (16, 100), (17, 576), (1100, 64), (3, 2050), (2, 4097)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rms_norm(order, dtype, rng):
    for T, D in ROW_SHAPES:
        x, w = randn(rng, (T, D), dtype), randn(rng, (D,), dtype)
        out = poisoned((T, D), dtype)
        kern().rms_norm(out, x, w, 1e-5)
        assert_close(out, N.rms_norm(x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_fused_add_rms_norm(order, dtype, rng):
    for T, D in ROW_SHAPES:
        x, res, w = randn(rng, (T, D), dtype), randn(rng, (T, D), dtype), randn(rng, (D,), dtype)
        out, residual = poisoned((T, D), dtype), res.copy()
        kern().fused_add_rms_norm(out, residual, x, w, 1e-6)
        want_out, want_res = N.fused_add_rms_norm(x, res, w, 1e-6)
        assert_close(residual, want_res, dtype)
        assert_close(out, want_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_embedding(order, dtype, rng):
    for T, D in ROW_SHAPES:
        table = randn(rng, (300, D), dtype)
        ids = rng.integers(0, 300, T).astype(np.int32)
        out = poisoned((T, D), dtype)
        kern().embedding(out, ids, table)
        np.testing.assert_array_equal(out, N.embedding(ids, table))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_embedding_of_a_vocabulary_slice(order, dtype, rng):
    """A tensor-parallel rank's rows [start, start + n) of the vocabulary: its ids embed as
    their rows (scaled), every other id as zeros, so the ranks' outputs sum to the whole."""
    for T, D in OPTION_SHAPES:
        whole = randn(rng, (300, D), dtype)
        ids = rng.integers(0, 300, T).astype(np.int32)
        parts = []
        for start, stop in ((0, 97), (97, 210), (210, 300)):
            out = poisoned((T, D), dtype)
            kern().embedding(out, ids, whole[start:stop].copy(), 2.0, vocab_start=start)
            mine = (ids >= start) & (ids < stop)
            np.testing.assert_array_equal(out[~mine], 0)
            np.testing.assert_array_equal(out[mine], N.embedding(ids[mine], whole, 2.0))
            parts.append(out.astype(np.float32))
        np.testing.assert_array_equal(sum(parts), N.embedding(ids, whole, 2.0).astype(np.float32))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_silu_and_mul(order, dtype, rng):
    for T, F in ROW_SHAPES:
        gate_up = randn(rng, (T, 2 * F), dtype, scale=3.0)
        out = poisoned((T, F), dtype)
        kern().silu_and_mul(out, gate_up)
        assert_close(out, N.silu_and_mul(gate_up), dtype)


# rows in lane groups, a warp, a block, and past the registers (norms: read twice)
OPTION_SHAPES = [(15, 37), (17, 576), (3, 2050), (2, 4097)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rms_norms_with_weight_offset(order, dtype, rng):
    """Gemma's norms: scaled by (1 + w), w random (not zero), in float32."""
    for T, D in OPTION_SHAPES:
        x, res, w = randn(rng, (T, D), dtype), randn(rng, (T, D), dtype), randn(rng, (D,), dtype)
        out = poisoned((T, D), dtype)
        kern().rms_norm(out, x, w, 1e-6, offset=1.0)
        assert_close(out, N.rms_norm(x, w, 1e-6, offset=1.0), dtype)
        out, residual = poisoned((T, D), dtype), res.copy()
        kern().fused_add_rms_norm(out, residual, x, w, 1e-6, offset=1.0)
        want_out, want_res = N.fused_add_rms_norm(x, res, w, 1e-6, offset=1.0)
        assert_close(residual, want_res, dtype)
        assert_close(out, want_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_embedding_scale(order, dtype, rng):
    """Rows times sqrt(D) in float32, rounded once: exactly NumPy's float32 product."""
    for T, D in OPTION_SHAPES:
        table = randn(rng, (300, D), dtype)
        ids = rng.integers(0, 300, T).astype(np.int32)
        out = poisoned((T, D), dtype)
        kern().embedding(out, ids, table, scale=D**0.5)
        np.testing.assert_array_equal(out, N.embedding(ids, table, D**0.5))


@pytest.mark.parametrize("activation", ["gelu_tanh", "gelu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_act_and_mul(order, dtype, activation, rng):
    """GeGLU: tanh-approximated and exact gelu of the gate times up."""
    for T, F in OPTION_SHAPES:
        gate_up = randn(rng, (T, 2 * F), dtype, scale=3.0)
        out = poisoned((T, F), dtype)
        kern().act_and_mul(out, gate_up, activation)
        assert_close(out, N.act_and_mul(gate_up, activation), dtype)


def test_row_kernel_options_are_checked(rng):
    x = randn(rng, (3, 64), np.float32)
    with pytest.raises(ValueError, match=r"act_and_mul: activation must be one of silu, "):
        kern().act_and_mul(np.empty((3, 32), np.float32), x, "relu")
    with pytest.raises(ValueError, match=r"rms_norm: offset must be finite, got nan"):
        kern().rms_norm(np.empty_like(x), x, x[0], 1e-5, offset=float("nan"))
    with pytest.raises(ValueError, match=r"embedding: scale must be a number, got None"):
        kern().embedding(np.empty_like(x), np.zeros(3, np.int32), x, scale=None)


def test_row_launch_shapes():
    """Short rows share a block in lane groups, long ones get a block each, <= 1024 threads."""
    assert K.row_launch(1100, 64, 2) == ((35,), (128,), 4)  # 8 vectors: 4 lanes, 32 rows/block
    assert K.row_launch(17, 576, 2) == ((5,), (128,), 32)  # 72 vectors: a warp per row
    assert K.row_launch(3, 4096, 2) == ((3,), (256,), 256)  # 512 vectors: a block per row
    assert K.row_launch(2, 65536, 4) == ((2,), (1024,), 1024)


# ---- the paged cache ----------------------------------------------------------------------


def make_cache(rng, num_blocks, block_size, kv_heads, head_dim, dtype):
    shape = (num_blocks, block_size, kv_heads, head_dim)  # (N, bs, Hkv, hd)
    return randn(rng, shape, dtype), randn(rng, shape, dtype)


def block_tables_for(rng, lengths, block_size, num_blocks) -> np.ndarray:
    """(B, max_blocks) int32: distinct random blocks per sequence, padded with -1."""
    need = [cdiv(n, block_size) for n in lengths]
    ids = rng.permutation(num_blocks)[: sum(need)]
    table = np.full((len(lengths), max(need) + 2), -1, np.int32)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = ids[start : start + n]
        start += n
    return table


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)], ids=["gqa1", "gqa4", "gqa8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rotary_cache(order, dtype, heads, head_dim, rng):
    """q rotated into its buffer, k rotated and v copied into their slots; slot -1 rows write
    no K/V; every other slot keeps its (random) contents."""
    (H, Hkv), bs, blocks = heads, 16, 12
    theta = float(rng.choice([10000.0, 500000.0]))
    for T in LENGTHS:
        qkv = randn(rng, (T, (H + 2 * Hkv) * head_dim), dtype)
        positions = rng.integers(0, 4000, T).astype(np.int32)
        slots = rng.permutation(blocks * bs)[:T].astype(np.int32)
        slots[rng.random(T) < 0.2] = -1  # padding rows
        k_cache, v_cache = make_cache(rng, blocks, bs, Hkv, head_dim, dtype)
        want_k, want_v = k_cache.copy(), v_cache.copy()
        want_q = N.rotary_cache(qkv, positions, theta, want_k, want_v, slots, H)
        table = C.rope_table(4096, head_dim, theta)
        q = poisoned((T, H, head_dim), dtype)
        kern().rotary_cache(q, k_cache, v_cache, qkv, positions, slots, table)
        assert_close(q, want_q, dtype)
        assert_close(k_cache, want_k, dtype)
        np.testing.assert_array_equal(v_cache, want_v)
        untouched = np.setdiff1d(np.arange(blocks * bs), slots)
        flat_k, flat_want = k_cache.reshape(blocks * bs, -1), want_k.reshape(blocks * bs, -1)
        np.testing.assert_array_equal(flat_k[untouched], flat_want[untouched])


def rotary_weights(rng, mode, H, Hkv, hd, dtype) -> dict:
    """bias ((H + 2 Hkv) hd,) and/or non-unit per-head norm weights q_norm, k_norm (hd,)."""
    weights = {}
    if mode in ("bias", "both"):
        weights["bias"] = randn(rng, ((H + 2 * Hkv) * hd,), dtype)
    if mode in ("norm", "both"):
        weights["q_norm"], weights["k_norm"] = (randn(rng, (hd,), dtype) for _ in range(2))
    return weights


# head dims of one item per head (16, bf16), 6 items in a group of 8 lanes (96), a warp (128,
# f32 256) and several items a lane (250: scalar, 125 items over 32 lanes)
@pytest.mark.parametrize("mode", ["bias", "norm", "both"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rotary_cache_bias_and_head_norm(order, dtype, mode, rng):
    """Qwen2's q|k|v bias (v too), Qwen3's per-head RMSNorm of q and k before the rotation, and
    both; padding slots write no K/V."""
    (H, Hkv), bs, blocks = (8, 2), 16, 4
    for hd, T in ((16, 17), (96, 5), (128, 16), (250, 3), (256, 1)):
        qkv = randn(rng, (T, (H + 2 * Hkv) * hd), dtype)
        positions = rng.integers(0, 4000, T).astype(np.int32)
        slots = rng.permutation(blocks * bs)[:T].astype(np.int32)
        slots[rng.random(T) < 0.2] = -1
        weights = rotary_weights(rng, mode, H, Hkv, hd, dtype)
        k_cache, v_cache = make_cache(rng, blocks, bs, Hkv, hd, dtype)
        want_k, want_v = k_cache.copy(), v_cache.copy()
        want_q = N.rotary_cache(qkv, positions, 1e4, want_k, want_v, slots, H, **weights)
        q = poisoned((T, H, hd), dtype)
        table = C.rope_table(4096, hd, 1e4)
        kern().rotary_cache(q, k_cache, v_cache, qkv, positions, slots, table, **weights)
        assert_close(q, want_q, dtype)
        assert_close(k_cache, want_k, dtype)
        assert_close(v_cache, want_v, dtype)


def test_rotary_cache_rejects_bad_weights(rng):
    H, Hkv, hd, T = 4, 2, 64, 3
    k_cache = np.zeros((4, 16, Hkv, hd), np.float32)
    q, qkv = np.empty((T, H, hd), np.float32), np.empty((T, (H + 2 * Hkv) * hd), np.float32)
    args = (q, k_cache, k_cache, qkv, np.zeros(T, np.int32), np.zeros(T, np.int32))
    args += (C.rope_table(64, hd, 1e4),)
    w = np.ones(hd, np.float32)
    with pytest.raises(ValueError, match=r"rotary_cache: q_norm and k_norm go together, k_norm"):
        kern().rotary_cache(*args, q_norm=w)
    with pytest.raises(
        ValueError, match=r"rotary_cache: bias must have shape \(512\), got \(500,\)"
    ):
        kern().rotary_cache(*args, bias=np.zeros(500, np.float32))
    with pytest.raises(ValueError, match=r"rotary_cache: k_norm must be float32, got float16"):
        kern().rotary_cache(*args, q_norm=w, k_norm=w.astype(np.float16))


def test_rotary_cache_rejects_bad_shapes():
    k_cache = np.zeros((4, 16, 2, 64), np.float32)
    q = np.empty((3, 4, 64), np.float32)
    table, ids = C.rope_table(64, 64, 1e4), np.zeros(3, np.int32)
    with pytest.raises(ValueError, match=r"rotary_cache: qkv must have shape \(3, 512\)"):
        kern().rotary_cache(q, k_cache, k_cache, np.empty((3, 500), np.float32), ids, ids, table)
    odd = np.zeros((4, 16, 2, 63), np.float32)
    q63, qkv = np.empty((3, 4, 63), np.float32), np.empty((3, 8 * 63), np.float32)
    with pytest.raises(ValueError, match=r"head_dim must be even"):
        kern().rotary_cache(q63, odd, odd, qkv, ids, ids, np.zeros((64, 63), np.float32))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_copy_blocks_within_and_between_pools(order, dtype, rng):
    pool = randn(rng, (3, 2, 12, 16, 2, 32), dtype)  # (L, 2, N, bs, Hkv, hd)
    other = randn(rng, (3, 2, 7, 16, 2, 32), dtype)  # a smaller pool: swap space
    blocks = rng.permutation(12)
    pairs = np.stack([blocks[:4], blocks[4:8]], axis=1).astype(np.int32)  # copy-on-write
    want = pool.copy()
    N.copy_blocks(want, want, pairs)
    kern().copy_blocks(pool, pool, pairs)
    np.testing.assert_array_equal(pool, want)
    out_pairs = np.stack([blocks[:5], rng.permutation(7)[:5]], axis=1).astype(np.int32)
    want_other = other.copy()
    N.copy_blocks(pool, want_other, out_pairs)  # swap out
    kern().copy_blocks(pool, other, out_pairs)
    np.testing.assert_array_equal(other, want_other)


# ---- attention -------------------------------------------------------------------------------

GQA = [(2, 2), (6, 2), (8, 1)]  # (H, Hkv): ratios 1, 3, 8


DECODE_GQA = [(2, 2), (8, 2), (8, 1)]  # (H, Hkv): query heads per KV head 1, 4, 8
DECODE_LENGTHS = [1, 15, 16, 17, 1030]  # around a block of 16, and over 1,000


def decode_case(rng, lengths, heads, head_dim, dtype, bs=16):
    """q (B, H, hd), caches, block tables and lengths for one decode step."""
    (H, Hkv), num_blocks = heads, sum(cdiv(n, bs) for n in lengths) + 3
    k_cache, v_cache = make_cache(rng, num_blocks, bs, Hkv, head_dim, dtype)
    tables = block_tables_for(rng, lengths, bs, num_blocks)
    q = randn(rng, (len(lengths), H, head_dim), dtype)
    return q, k_cache, v_cache, tables, np.array(lengths, np.int32)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("heads", DECODE_GQA, ids=["gqa1", "gqa4", "gqa8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_paged_attention_decode(order, dtype, heads, head_dim, rng):
    """Ragged contexts in one batch, split as the SM count asks (several partitions), into
    partitions of 64 (17 for the longest), and into one partition (no reduce)."""
    q, k_cache, v_cache, tables, lens = decode_case(rng, DECODE_LENGTHS, heads, head_dim, dtype)
    scale = head_dim**-0.5
    want = N.paged_attention_decode(q, k_cache, v_cache, tables, lens, scale)
    assert kern().decode_split(int(lens.max()), len(lens), *heads)[0] > 1
    for partition in (None, 64, 1088):
        out = poisoned(q.shape, dtype)
        args = (out, q, k_cache, v_cache, tables, lens, scale, int(lens.max()), partition)
        kern().paged_attention_decode(*args)
        assert_close(out, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_paged_attention_decode_other_block_size_and_head_tiles(dtype, rng):
    """Blocks of 32 tokens (another build) and 16 query heads per KV head (two blocks of
    eight heads each); a max_context_len past every context, as a CUDA graph passes."""
    lengths = [700, 3, 64, 65]
    q, k_cache, v_cache, tables, lens = decode_case(rng, lengths, (16, 1), 64, dtype, bs=32)
    out = poisoned(q.shape, dtype)
    kern().paged_attention_decode(out, q, k_cache, v_cache, tables, lens, 0.125, 4096)
    assert_close(out, N.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.125), dtype)


class LaunchLog:
    """A ``Kernels`` load over the CPU builds that records each launch's entry and grid."""

    def __init__(self):
        self.launches: list[tuple[str, tuple]] = []

    def load(self, name, defines=()):
        module, log = E.cpu_module(name, defines), self.launches

        class Logged:
            def get_function(self, entry):
                fn = module.get_function(entry)

                def launch(grid, block, args, shared_mem=0):
                    log.append((entry, tuple(grid)))
                    fn(grid, block, args, shared_mem=shared_mem)

                return launch

        return Logged()


def test_decode_grid_serves_a_kv_heads_query_heads_and_reduces_only_partitions(rng):
    """One block per (KV head, up to 8 of its query heads, sequence, partition); the reduce
    runs only when the split made several partitions."""
    spy = LaunchLog()
    kernels = K.Kernels(spy.load)
    for lengths, P in (([100, 7], 1), ([1030, 7], 5)):
        q, k_cache, v_cache, tables, lens = decode_case(rng, lengths, (12, 2), 16, np.float32)
        out = poisoned(q.shape, np.float32)
        spy.launches.clear()
        kernels.paged_attention_decode(out, q, k_cache, v_cache, tables, lens, 0.25, max(lengths))
        want = N.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.25)
        assert_close(out, want, np.float32)
        entries = [("paged_attention_decode_f32", (2, 2, P))]  # 6 query heads per KV head
        entries += [("paged_attention_reduce_f32", (12, 2))] if P > 1 else []
        assert spy.launches == entries


def test_decode_split_fills_the_sms_within_partition_bounds():
    assert K.decode_split(100, 4, 132) == (1, 128)  # one partition: short context
    assert K.decode_split(1030, 4, 132) == (5, 256)  # 4 blocks: partitions of the 256 minimum
    assert K.decode_split(1030, 64, 132) == (3, 384)  # 64 blocks: 3 partitions fill 132 SMs
    assert K.decode_split(1030, 512, 132) == (3, 384)  # no partition over 512 tokens
    assert K.decode_split(4096, 4, 132) == (16, 256)
    for n, blocks in ((1, 1), (513, 7), (20000, 3), (999, 200)):
        P, size = K.decode_split(n, blocks, 132)
        assert size % K.DECODE_CHUNK == 0 and size <= K.PARTITION_SIZE
        assert (P - 1) * size < n <= P * size


@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_reads_each_kv_byte_once(group, rng):
    """The K and V bytes the step needs (each sequence's context rows, for every KV head):
    read at most 1.25 times over, with 1, 4 and 8 query heads per KV head."""
    dtype, Hkv, hd = ml_dtypes.bfloat16, 2, 64
    lengths = [1, 15, 16, 17, 300]
    q, k_cache, v_cache, tables, lens = decode_case(rng, lengths, (group * Hkv, Hkv), hd, dtype)
    out = poisoned(q.shape, dtype)
    with E.memory_traffic() as t:
        E.counting_kernels().paged_attention_decode(
            out, q, k_cache, v_cache, tables, lens, 0.125, 300, 128
        )
    assert_close(out, N.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.125), dtype)
    need = int(lens.sum()) * Hkv * hd * k_cache.itemsize
    assert need <= t.read(k_cache) <= 1.25 * need
    assert need <= t.read(v_cache) <= 1.25 * need
    assert t.written(k_cache) == t.written(v_cache) == 0


def poison_below(caches, table, first, bs) -> None:
    """NaN into one sequence's K and V rows at positions below ``first`` (through its table): a
    kernel that reads one of them, even masked, writes NaN (0 * NaN in the V sum)."""
    for p in range(first):
        for cache in caches:
            cache[table[p // bs], p % bs] = np.nan


# windows: one token, a context's length exactly (17: past a block), past a chunk of 64 (100,
# 400: neither multiples of 16 nor of 64), and longer than every context (700)
DECODE_WINDOWS = [1, 17, 100, 400, 700]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_paged_attention_decode_sliding_window(order, dtype, rng):
    """The query at position ctx - 1 sees keys max(0, ctx - W) .. ctx - 1: split as the SM
    count asks, into partitions of 64 (up to 7 of them), and with a max_context_len past
    every context (a CUDA graph's). Keys below the window hold NaN: never read."""
    lengths = [1, 16, 17, 130, 600]
    q, k_cache, v_cache, tables, lens = decode_case(rng, lengths, (8, 2), 64, dtype)
    for window in DECODE_WINDOWS:
        want = N.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.125, window)
        kc, vc = k_cache.copy(), v_cache.copy()
        for b, n in enumerate(lengths):
            poison_below((kc, vc), tables[b], max(0, n - window), 16)
        for partition, max_len in ((None, 600), (64, 600), (None, 4096)):
            out = poisoned(q.shape, dtype)
            args = (out, q, kc, vc, tables, lens, 0.125, max_len, partition, window)
            kern().paged_attention_decode(*args)
            assert_close(out, want, dtype)


def test_decode_split_covers_the_window_only():
    """The split (and the scratch the engine sizes from it) follows min(max_context_len, W)."""
    k = kern()
    assert k.decode_split(4096, 4, 8, 2, window=300) == k.decode_split(300, 4, 8, 2)
    assert k.decode_split(200, 4, 8, 2, window=300) == k.decode_split(200, 4, 8, 2)
    assert k.decode_split(4096, 4, 8, 2, window=0) == k.decode_split(4096, 4, 8, 2)
    with pytest.raises(ValueError, match=r"decode_split: window must be an int >= 0"):
        k.decode_split(100, 1, 8, 2, window=-1)


def test_windowed_decode_reads_only_the_windows_kv(rng):
    """Contexts of 1 to 1,030 tokens, a window of 100 and partitions of 64: each sequence's
    last min(ctx, 100) K and V rows, read at most 1.25 times over."""
    dtype, Hkv, hd, window = ml_dtypes.bfloat16, 2, 64, 100
    lengths = [1, 15, 100, 300, 1030]
    q, k_cache, v_cache, tables, lens = decode_case(rng, lengths, (8, Hkv), hd, dtype)
    out = poisoned(q.shape, dtype)
    with E.memory_traffic() as t:
        E.counting_kernels().paged_attention_decode(
            out, q, k_cache, v_cache, tables, lens, 0.125, 1030, 64, window
        )
    want = N.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.125, window)
    assert_close(out, want, dtype)
    need = sum(min(n, window) for n in lengths) * Hkv * hd * k_cache.itemsize
    assert need <= t.read(k_cache) <= 1.25 * need
    assert need <= t.read(v_cache) <= 1.25 * need


# (H, Hkv, head_dim, block_size): GQA groups 1, 4, 8 and 1; the tiny model's head_dim 16, 64,
# 128 and the largest, 256 (four 64-dim slices); blocks smaller and larger than a key chunk.
PREFILL_SHAPES = [(2, 2, 64, 16), (8, 2, 128, 8), (8, 1, 16, 32), (2, 2, 256, 16)]


def run_prefill(rng, dtype, shape, q_lens, ctx_lens):
    """Prefill attention over a fresh random cache against the NumPy twin."""
    H, Hkv, hd, bs = shape
    num_blocks = sum(cdiv(n, bs) for n in ctx_lens) + 3
    k_cache, v_cache = make_cache(rng, num_blocks, bs, Hkv, hd, dtype)
    tables = block_tables_for(rng, ctx_lens, bs, num_blocks)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    lens = np.array(ctx_lens, np.int32)
    q = randn(rng, (int(qsl[-1]), H, hd), dtype)
    out = poisoned(q.shape, dtype)
    scale = hd**-0.5
    kern().paged_attention_prefill(out, q, k_cache, v_cache, tables, qsl, lens, scale)
    assert_close(
        out, N.paged_attention_prefill(q, k_cache, v_cache, tables, qsl, lens, scale), dtype
    )


@pytest.mark.parametrize("shape", PREFILL_SHAPES, ids=lambda s: "h{}-kv{}-d{}-bs{}".format(*s))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_paged_attention_prefill(order, dtype, shape, rng):
    """Query runs of 1, 15, 16, 17, 33 and 70 tokens; the 15, 17, 33 and 70 start after a
    cached prefix (25, 20, 5 and 64 tokens), so tiles start off a 32-key boundary."""
    run_prefill(rng, dtype, shape, [1, 15, 16, 17, 33, 70], [1, 40, 16, 37, 38, 134])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_paged_attention_prefill_long_context(dtype, rng):
    """A 1,100-token query run (35 tiles) after a 30-token cached prefix, then a 3-token run."""
    run_prefill(rng, dtype, (2, 1, 64, 16), [1100, 3], [1130, 3])


def run_windowed_prefill(rng, dtype, shape, q_lens, ctx_lens, windows):
    """Sliding-window prefill against the NumPy twin, for each window; cache rows below the
    first key chunk any tile of a sequence needs hold NaN (skipped chunks are never read)."""
    H, Hkv, hd, bs = shape
    num_blocks = sum(cdiv(n, bs) for n in ctx_lens) + 3
    k_cache, v_cache = make_cache(rng, num_blocks, bs, Hkv, hd, dtype)
    tables = block_tables_for(rng, ctx_lens, bs, num_blocks)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    lens = np.array(ctx_lens, np.int32)
    q = randn(rng, (int(qsl[-1]), H, hd), dtype)
    for window in windows:
        args = (q, k_cache, v_cache, tables, qsl, lens, hd**-0.5, window)
        want = N.paged_attention_prefill(*args)
        kc, vc = k_cache.copy(), v_cache.copy()
        for b, (q_len, n) in enumerate(zip(q_lens, ctx_lens, strict=True)):
            first_chunk = max(0, n - q_len - window + 1) // K.PREFILL_TILE * K.PREFILL_TILE
            poison_below((kc, vc), tables[b], first_chunk, bs)
        out = poisoned(q.shape, dtype)
        kern().paged_attention_prefill(out, q, kc, vc, *args[3:])
        assert_close(out, want, dtype)


@pytest.mark.parametrize("shape", PREFILL_SHAPES[:2], ids=lambda s: "h{}-kv{}-d{}-bs{}".format(*s))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_paged_attention_prefill_sliding_window(order, dtype, shape, rng):
    """A row at position p sees keys p - W < k <= p. Windows of 1, under a 32-key chunk (7),
    just past one (33), a context's length (37) and past every context (200); runs of 1 to 70
    rows, most after a cached prefix (chunked prefill)."""
    q_lens, ctx_lens = [1, 15, 17, 33, 70], [1, 40, 37, 38, 134]
    run_windowed_prefill(rng, dtype, shape, q_lens, ctx_lens, [1, 7, 33, 37, 200])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_paged_attention_prefill_sliding_window_long_prefix(dtype, rng):
    """The last 70 tokens of a 1,000-token context with windows of 50 and 100 (blocks of 32,
    8 query heads per KV head): the tiles skip the ~900 keys below their windows."""
    run_windowed_prefill(rng, dtype, (8, 1, 16, 32), [70, 3], [1000, 3], [50, 100])


def test_paged_attention_prefill_rejects_bad_arguments(rng):
    qsl, lens, tables = (
        np.array([0, 3], np.int32),
        np.array([3], np.int32),
        np.zeros((1, 1), np.int32),
    )
    k_cache, v_cache = make_cache(rng, 2, 16, 1, 12, np.float32)
    q = randn(rng, (3, 2, 12), np.float32)
    with pytest.raises(ValueError, match=r"head_dim must be a multiple of 8, got 12"):
        kern().paged_attention_prefill(
            np.empty_like(q), q, k_cache, v_cache, tables, qsl, lens, 1.0
        )
    k_cache, v_cache = make_cache(rng, 2, 16, 1, 16, np.float32)
    raw = np.empty(k_cache.nbytes + 32, np.uint8)
    skew = (-raw.ctypes.data) % 16 + 4  # 4 bytes past a 16-byte boundary
    k_off = raw[skew : skew + k_cache.nbytes].view(np.float32).reshape(k_cache.shape)
    q = randn(rng, (3, 2, 16), np.float32)
    with pytest.raises(ValueError, match=r"k_cache must start on a 16-byte boundary"):
        kern().paged_attention_prefill(np.empty_like(q), q, k_off, v_cache, tables, qsl, lens, 1.0)


def test_attention_rejects_bad_arguments(rng):
    k_cache, v_cache = make_cache(rng, 4, 16, 2, 64, np.float32)
    q, lens = randn(rng, (2, 6, 64), np.float32), np.array([3, 5], np.int32)
    tables = np.array([[0], [1]], np.int32)
    out = np.empty_like(q)
    with pytest.raises(ValueError, match=r"context_lens must be int32, got int64"):
        kern().paged_attention_decode(
            out, q, k_cache, v_cache, tables, lens.astype(np.int64), 1.0, 5
        )
    with pytest.raises(ValueError, match=r"q must be C-contiguous"):
        q_t = np.asfortranarray(q)
        kern().paged_attention_decode(out, q_t, k_cache, v_cache, tables, lens, 1.0, 5)
    with pytest.raises(ValueError, match=r"query heads \(5\) must be a multiple of KV heads \(2\)"):
        q5 = randn(rng, (2, 5, 64), np.float32)
        kern().paged_attention_decode(np.empty_like(q5), q5, k_cache, v_cache, tables, lens, 1.0, 5)
    with pytest.raises(ValueError, match=r"out must have shape \(2, 6, 64\), got \(2, 6, 32\)"):
        bad = np.empty((2, 6, 32), np.float32)
        kern().paged_attention_decode(bad, q, k_cache, v_cache, tables, lens, 1.0, 5)


# ---- sampling ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_sample_greedy(order, dtype, rng):
    logits = randn(rng, (5, 1000), dtype, scale=3.0)
    logits[2, [10, 700]] = logits[2].max() + 1  # a tie: the lower index wins
    out = np.full(5, -1, np.int32)
    kern().sample_greedy(out, logits)
    np.testing.assert_array_equal(out, np.argmax(logits.astype(np.float32), axis=1))
    assert out[2] == 10


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_sample_greedy_ties_pick_the_first_max(order, dtype, rng):
    """Ties within one thread's stride, one warp, across warps; NaN and -inf never win, and a
    row with nothing else gives -1."""
    B, V, threads = 7, 2000, K.SAMPLE_THREADS
    logits = randn(rng, (B, V), dtype, scale=2.0)
    first = rng.integers(0, V - 800, B)  # (B,) where each row's first maximum goes (+700 fits)
    ties = [[1, 2 * threads], [5], [threads + 3], [31, 40, 700], [1], [], []]
    logits[5, rng.integers(0, V, 50)] = -np.inf  # some -inf entries, a finite max elsewhere
    for b, (f, others) in enumerate(zip(first, ties, strict=True)):
        logits[b, [f] + [f + d for d in others]] = logits[b].max() + 1  # one value, several places
    logits[6] = -np.inf  # nothing finite: no token
    logits[6, rng.integers(0, V, 9)] = np.nan
    below = np.flatnonzero(logits[4] < logits[4].max())  # not a maximum's place
    logits[4, rng.choice(below, 9)] = np.nan  # NaN beside finite values: never picked
    out = np.full(B, 7, np.int32)
    kern().sample_greedy(out, logits)
    np.testing.assert_array_equal(out[:6], first[:6])
    assert out[6] == -1


# ---- ops module and ASan ----------------------------------------------------------------------


def test_cuda_cpu_ops_match_numpy_ops(rng):
    """The ops module the engine uses: same signatures and results as numpy_ops."""
    T, D, H, Hkv, hd = 9, 48, 4, 2, 32
    x, r, w = (
        randn(rng, (T, D), np.float32),
        randn(rng, (T, D), np.float32),
        randn(rng, (D,), np.float32),
    )
    assert_close(C.rms_norm(x, w, 1e-5), N.rms_norm(x, w, 1e-5), np.float32)
    for a, b in zip(
        C.fused_add_rms_norm(x, r, w, 1e-5), N.fused_add_rms_norm(x, r, w, 1e-5), strict=True
    ):
        assert_close(a, b, np.float32)
    qkv = randn(rng, (T, (H + 2 * Hkv) * hd), np.float32)
    pos = np.arange(T) + 5000  # past the first table size
    caches = [randn(rng, (3, 4, Hkv, hd), np.float32) for _ in range(2)]
    twins = [c.copy() for c in caches]
    slots = np.array([0, 5, -1, 7, 2, 11, 3, -1, 9], np.int32)
    q = C.rotary_cache(qkv, pos, 1e4, *caches, slots, H)
    assert_close(q, N.rotary_cache(qkv, pos, 1e4, *twins, slots, H), np.float32)
    for a, b in zip(caches, twins, strict=True):
        assert_close(a, b, np.float32)
    ids = rng.integers(0, 50, T)
    table = randn(rng, (50, D), np.float32)
    np.testing.assert_array_equal(C.embedding(ids, table), N.embedding(ids, table))
    with pytest.raises(ValueError, match=r"token_ids must lie in \[0, 50\)"):
        C.embedding(np.array([3, 50]), table)
    pool = randn(rng, (2, 2, 6, 4, Hkv, hd), np.float32)
    with pytest.raises(ValueError, match=r"both a source and a destination"):
        C.copy_blocks(pool, pool, [(1, 2), (2, 3)])


OPS = ["embedding", "rms_norm", "fused_add_rms_norm", "act_and_mul", "silu_and_mul"]
OPS += ["rotary_cache", "paged_attention_decode", "paged_attention_prefill"]


def test_cuda_cpu_ops_options_match_numpy_ops(rng):
    """Both oracle modules take the same parameters with the same defaults, and agree on the
    options: embedding scale, norm offset, activations, bias and head norms, windows."""
    for name in OPS:
        params = [inspect.signature(getattr(m, name)).parameters for m in (C, N)]
        assert [(p.name, p.default) for p in params[0].values()] == [
            (p.name, p.default) for p in params[1].values()
        ], name
    T, D, H, Hkv, hd = 9, 48, 4, 2, 32
    x, r, w = (randn(rng, s, np.float32) for s in ((T, D), (T, D), (D,)))
    ids, table = rng.integers(0, 50, T), randn(rng, (50, D), np.float32)
    np.testing.assert_array_equal(C.embedding(ids, table, 6.9), N.embedding(ids, table, 6.9))
    assert_close(C.rms_norm(x, w, 1e-5, 1.0), N.rms_norm(x, w, 1e-5, 1.0), np.float32)
    for a, b in zip(
        C.fused_add_rms_norm(x, r, w, 1e-5, 1.0),
        N.fused_add_rms_norm(x, r, w, 1e-5, 1.0),
        strict=True,
    ):
        assert_close(a, b, np.float32)
    for act in K.ACTIVATIONS:
        assert_close(C.act_and_mul(r, act), N.act_and_mul(r, act), np.float32)
    with pytest.raises(ValueError, match=r"activation must be one of silu, gelu_tanh, gelu"):
        N.act_and_mul(r, "relu")
    qkv, pos = randn(rng, (T, (H + 2 * Hkv) * hd), np.float32), np.arange(T) + 3
    caches = [randn(rng, (3, 4, Hkv, hd), np.float32) for _ in range(2)]
    twins = [c.copy() for c in caches]
    slots = np.array([0, 5, -1, 7, 2, 11, 3, -1, 9], np.int32)
    weights = rotary_weights(rng, "both", H, Hkv, hd, np.float32)
    q = C.rotary_cache(qkv, pos, 1e4, *caches, slots, H, **weights, eps=1e-5)
    want = N.rotary_cache(qkv, pos, 1e4, *twins, slots, H, **weights, eps=1e-5)
    for a, b in zip([q, *caches], [want, *twins], strict=True):
        assert_close(a, b, np.float32)
    q, k_cache, v_cache, tables, lens = decode_case(rng, [5, 40, 90], (4, 2), 32, np.float32)
    for window in (3, 50):
        args = (q, k_cache, v_cache, tables, lens, 0.2, window)
        assert_close(C.paged_attention_decode(*args), N.paged_attention_decode(*args), np.float32)
    qsl = np.array([0, 5, 30, 40], np.int32)
    q = randn(rng, (40, 4, 32), np.float32)
    args = (q, k_cache, v_cache, tables, qsl, lens, 0.2, 20)
    assert_close(C.paged_attention_prefill(*args), N.paged_attention_prefill(*args), np.float32)


@dataclass
class AsanPass:
    """The ASan pass running in its own process, its output going to two files."""

    proc: subprocess.Popen
    stdout: Path
    stderr: Path

    def result(self) -> tuple[int, str, str]:
        """Wait for it: (exit status, stdout, stderr)."""
        rc = self.proc.wait()
        return rc, self.stdout.read_text(), self.stderr.read_text()


def start_asan_pass(folder: Path) -> AsanPass:
    """One pass of the paged-cache, attention and sampling tests with ASan builds (this file's
    tests, selected with -k, in a process with the ASan runtime preloaded)."""
    select = "forward and (f32 or sampling) and not long_context and not address_sanitizer"
    select += " and (cache or copy_blocks or attention or sample_greedy or rms_norm)"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", select]
    env = K.asan_env()
    env["PYTHONPATH"] = os.pathsep.join([str(K.REPO), env.get("PYTHONPATH", "")])
    out, err = folder / "stdout.txt", folder / "stderr.txt"
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.Popen(cmd, env=env, cwd=K.REPO, stdout=o, stderr=e, text=True)
    return AsanPass(proc, out, err)


@pytest.mark.slow
def test_kernels_under_address_sanitizer(built_kernels, tmp_path):
    """One pass of the paged-cache, attention and sampling tests with ASan builds (started
    with the module by built_kernels)."""
    asan = built_kernels or start_asan_pass(tmp_path)
    returncode, stdout, stderr = asan.result()
    assert returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert " passed" in stdout and "AddressSanitizer" not in stderr


# ---- global memory traffic (counting builds) ---------------------------------------------------


def counted(op: str, *args):
    """The traffic of one checked launch through the counting builds (memory_traffic)."""
    with E.memory_traffic() as t:
        getattr(E.counting_kernels(), op)(*args)
    return t


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_row_kernels_read_each_input_byte_once_and_write_exactly_their_outputs(dtype, rng):
    """x, residual and gate_up read once (a row kept in registers between the two passes of
    the norms), weight once per row, embedding's table once per row taken; outputs written
    exactly once, inputs never."""
    for T, D in ROW_SHAPES[:-1]:  # rows that fit the registers (4097 is read twice)
        x, r, w = randn(rng, (T, D), dtype), randn(rng, (T, D), dtype), randn(rng, (D,), dtype)
        out, e = poisoned((T, D), dtype), np.dtype(dtype).itemsize
        t = counted("rms_norm", out, x, w, 1e-5)
        assert (t.read(x), t.read(w), t.written(out)) == (x.nbytes, T * w.nbytes, out.nbytes)
        assert t.written(x) == t.written(w) == t.read(out) == 0
        t = counted("fused_add_rms_norm", out, r, x, w, 1e-5)
        assert (t.read(x), t.read(r)) == (x.nbytes, r.nbytes)
        assert t.written(r) == r.nbytes  # residual += x, stored once
        assert (t.read(w), t.written(out), t.read(out)) == (T * w.nbytes, out.nbytes, 0)
        gate_up, act = randn(rng, (T, 2 * D), dtype), poisoned((T, D), dtype)
        t = counted("silu_and_mul", act, gate_up)
        assert (t.read(gate_up), t.written(act), t.read(act)) == (gate_up.nbytes, act.nbytes, 0)
        table, ids = randn(rng, (300, D), dtype), rng.integers(0, 300, T).astype(np.int32)
        t = counted("embedding", out, ids, table)
        assert (t.read(table), t.written(out), t.written(table)) == (T * D * e, out.nbytes, 0)
        assert t.read(ids) <= ids.nbytes * max(1, K.row_launch(T, D, e)[2] // 32)


def test_row_kernel_options_keep_their_traffic(rng):
    """A norm offset, an embedding scale and the gelu activations read and write what the
    defaults do: inputs once, outputs exactly."""
    dtype, e = ml_dtypes.bfloat16, 2
    for T, D in [(17, 576), (3, 2050)]:
        x, w = randn(rng, (T, D), dtype), randn(rng, (D,), dtype)
        out, r = poisoned((T, D), dtype), randn(rng, (T, D), dtype)
        t = counted("rms_norm", out, x, w, 1e-5, 1.0)
        assert (t.read(x), t.read(w), t.written(out)) == (x.nbytes, T * w.nbytes, out.nbytes)
        t = counted("fused_add_rms_norm", out, r, x, w, 1e-5, 1.0)
        assert (t.read(x), t.read(r), t.written(r)) == (x.nbytes, r.nbytes, r.nbytes)
        assert (t.read(w), t.written(out)) == (T * w.nbytes, out.nbytes)
        table, ids = randn(rng, (300, D), dtype), rng.integers(0, 300, T).astype(np.int32)
        t = counted("embedding", out, ids, table, 48.0)
        assert (t.read(table), t.written(out), t.read(out)) == (T * D * e, out.nbytes, 0)
        gate_up = randn(rng, (T, 2 * D), dtype)
        for activation in ("gelu_tanh", "gelu"):
            t = counted("act_and_mul", out, gate_up, activation)
            assert (t.read(gate_up), t.written(out), t.read(out)) == (gate_up.nbytes, out.nbytes, 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rotary_cache_reads_each_input_byte_once(dtype, rng):
    """qkv's q rows, and k and v rows of tokens with a slot, read once; one cos/sin row per
    token; q written once, the caches exactly at the slots; nothing read from the outputs."""
    H, Hkv, hd, T, blocks, bs = 8, 2, 64, 37, 8, 16
    qkv = randn(rng, (T, (H + 2 * Hkv) * hd), dtype)
    pos = rng.integers(0, 4000, T).astype(np.int32)
    slots = rng.permutation(blocks * bs)[:T].astype(np.int32)
    slots[rng.random(T) < 0.3] = -1
    kc, vc = make_cache(rng, blocks, bs, Hkv, hd, dtype)
    q, table = poisoned((T, H, hd), dtype), C.rope_table(4096, hd, 1e4)
    t = counted("rotary_cache", q, kc, vc, qkv, pos, slots, table)
    e, cached = np.dtype(dtype).itemsize, int((slots >= 0).sum())
    assert t.read(qkv) == (T * H + cached * 2 * Hkv) * hd * e
    assert (t.read(table), t.read(pos), t.read(slots)) == (T * hd * 4, pos.nbytes, slots.nbytes)
    assert (t.written(q), t.read(q)) == (q.nbytes, 0)
    for cache in (kc, vc):
        assert (t.written(cache), t.read(cache)) == (cached * Hkv * hd * e, 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rotary_cache_with_bias_and_norm_reads_each_input_byte_once(dtype, rng):
    """With the bias and both norms: qkv still read once; the bias read once per token (its
    k and v parts only for tokens with a slot), q_norm once per token, k_norm once per token
    with a slot; the outputs written exactly as without them."""
    H, Hkv, hd, T, blocks, bs = 8, 2, 64, 37, 8, 16
    qkv = randn(rng, (T, (H + 2 * Hkv) * hd), dtype)
    pos = rng.integers(0, 4000, T).astype(np.int32)
    slots = rng.permutation(blocks * bs)[:T].astype(np.int32)
    slots[rng.random(T) < 0.3] = -1
    kc, vc = make_cache(rng, blocks, bs, Hkv, hd, dtype)
    weights = rotary_weights(rng, "both", H, Hkv, hd, dtype)
    want_k, want_v = kc.copy(), vc.copy()
    want_q = N.rotary_cache(qkv, pos, 1e4, want_k, want_v, slots, H, **weights)
    q, table = poisoned((T, H, hd), dtype), C.rope_table(4096, hd, 1e4)
    t = counted("rotary_cache", q, kc, vc, qkv, pos, slots, table, *weights.values())
    assert_close(q, want_q, dtype)
    assert_close(kc, want_k, dtype)
    e, cached = np.dtype(dtype).itemsize, int((slots >= 0).sum())
    row_bytes = (T * H + cached * 2 * Hkv) * hd * e
    assert (t.read(qkv), t.read(weights["bias"])) == (row_bytes, row_bytes)
    assert (t.read(weights["q_norm"]), t.read(weights["k_norm"])) == (T * hd * e, cached * hd * e)
    assert (t.read(table), t.written(q), t.read(q)) == (T * hd * 4, q.nbytes, 0)
    for cache in (kc, vc):
        assert (t.written(cache), t.read(cache)) == (cached * Hkv * hd * e, 0)
