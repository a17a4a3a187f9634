"""Every CUDA kernel, run on the CPU emulator, against its NumPy twin in numpy_ops.

Fresh random inputs each run (never zeros), outputs poisoned with NaN first so every element
must be written, ragged sizes, and every block's threads run forward, reversed and shuffled.
"""

from __future__ import annotations

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from engine import kernels as K
from engine.utils import cdiv
from tests.oracles import cuda_cpu_ops as C
from tests.oracles import numpy_ops as N

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


@pytest.fixture(params=K.ORDERS)
def order(request):
    K.set_thread_order(request.param, seed=int(np.random.default_rng().integers(1, 2**31)))
    yield request.param
    K.set_thread_order("forward")


kern = K.cpu_kernels


@pytest.fixture(scope="module", autouse=True)
def built_kernels():
    """Compile every kernel file once, two g++ processes at a time (cached by content hash)."""
    K.build_all_cpu()


# ---- row-wise kernels -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rms_norm(order, dtype, rng):
    for T, D in [(1, 64), (17, 200), (130, 576)]:
        x, w = randn(rng, (T, D), dtype), randn(rng, (D,), dtype)
        out = poisoned((T, D), dtype)
        kern().rms_norm(out, x, w, 1e-5)
        assert_close(out, N.rms_norm(x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_fused_add_rms_norm(order, dtype, rng):
    for T, D in [(1, 64), (16, 200), (130, 576)]:
        x, res, w = randn(rng, (T, D), dtype), randn(rng, (T, D), dtype), randn(rng, (D,), dtype)
        out, residual = poisoned((T, D), dtype), res.copy()
        kern().fused_add_rms_norm(out, residual, x, w, 1e-6)
        want_out, want_res = N.fused_add_rms_norm(x, res, w, 1e-6)
        assert_close(residual, want_res, dtype)
        assert_close(out, want_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_embedding(order, dtype, rng):
    table = randn(rng, (300, 96), dtype)
    for T in LENGTHS:
        ids = rng.integers(0, 300, T).astype(np.int32)
        out = poisoned((T, 96), dtype)
        kern().embedding(out, ids, table)
        np.testing.assert_array_equal(out, N.embedding(ids, table))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_silu_and_mul(order, dtype, rng):
    for T, F in [(1, 32), (17, 100), (130, 384)]:
        gate_up = randn(rng, (T, 2 * F), dtype, scale=3.0)
        out = poisoned((T, F), dtype)
        kern().silu_and_mul(out, gate_up)
        assert_close(out, N.silu_and_mul(gate_up), dtype)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rotary(order, dtype, head_dim, rng):
    theta = float(rng.choice([10000.0, 500000.0]))
    for T in LENGTHS:
        q, k = randn(rng, (T, 6, head_dim), dtype), randn(rng, (T, 2, head_dim), dtype)
        positions = rng.integers(0, 4000, T).astype(np.int32)
        q_out, k_out = q.copy(), k.copy()
        table = C.rope_table(4096, head_dim, theta)
        kern().rotary(q_out, k_out, positions, table)
        want_q, want_k = N.rotary(q, k, positions, theta)
        assert_close(q_out, want_q, dtype)
        assert_close(k_out, want_k, dtype)


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


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_reshape_and_cache_skips_negative_slots(order, dtype, rng):
    k_cache, v_cache = make_cache(rng, 20, 16, 2, 64, dtype)
    for T in LENGTHS:
        k, v = randn(rng, (T, 2, 64), dtype), randn(rng, (T, 2, 64), dtype)
        slots = rng.permutation(20 * 16)[:T].astype(np.int32)
        slots[rng.random(T) < 0.2] = -1  # padding tokens
        want_k, want_v = k_cache.copy(), v_cache.copy()
        N.reshape_and_cache(k, v, want_k, want_v, slots)
        kern().reshape_and_cache(k, v, k_cache, v_cache, slots)
        np.testing.assert_array_equal(k_cache, want_k)
        np.testing.assert_array_equal(v_cache, want_v)


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
        module, log = K.cpu_module(name, defines), self.launches

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
    with K.memory_traffic() as t:
        K.counting_kernels().paged_attention_decode(
            out, q, k_cache, v_cache, tables, lens, 0.125, 300, 128
        )
    assert_close(out, N.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.125), dtype)
    need = int(lens.sum()) * Hkv * hd * k_cache.itemsize
    assert need <= t.read(k_cache) <= 1.25 * need
    assert need <= t.read(v_cache) <= 1.25 * need
    assert t.written(k_cache) == t.written(v_cache) == 0


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", GQA, ids=["gqa1", "gqa3", "gqa8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_paged_attention_prefill(order, dtype, heads, head_dim, rng):
    """Query runs of 1, 15, 16, 17 and 110 tokens; some start after a cached prefix."""
    (H, Hkv), bs = heads, 16
    q_lens = [1, 15, 16, 17, 110]
    ctx_lens = [1, 15, 40, 17, 130]  # 25 and 20 tokens already cached before the queries
    k_cache, v_cache = make_cache(rng, 30, bs, Hkv, head_dim, dtype)
    tables = block_tables_for(rng, ctx_lens, bs, 30)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    lens = np.array(ctx_lens, np.int32)
    q = randn(rng, (int(qsl[-1]), H, head_dim), dtype)
    out = poisoned(q.shape, dtype)
    scale = head_dim**-0.5
    kern().paged_attention_prefill(out, q, k_cache, v_cache, tables, qsl, lens, scale)
    want = N.paged_attention_prefill(q, k_cache, v_cache, tables, qsl, lens, scale)
    assert_close(out, want, dtype)


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


def sampling_batch(rng, B, V):
    logits = randn(rng, (B, V), np.float32, scale=2.0)
    params = dict(
        temperature=rng.choice([0.0, 0.5, 1.0, 1.7], B).astype(np.float32),
        top_k=rng.choice([0, 1, 5, 50], B).astype(np.int32),
        top_p=rng.choice([1.0, 0.9, 0.5], B).astype(np.float32),
        min_p=rng.choice([0.0, 0.05], B).astype(np.float32),
        seeds=rng.integers(0, 2**63, B, dtype=np.uint64),
        steps=rng.integers(0, 1000, B).astype(np.int32),
    )
    return logits, params


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_sample_matches_numpy_twin(order, dtype, rng):
    logits, params = sampling_batch(rng, 12, 500)
    logits = logits.astype(dtype)
    out = np.full(12, -1, np.int32)
    kern().sample(out, logits, *params.values())
    np.testing.assert_array_equal(out, C.sample_numpy(logits.astype(np.float32), **params))


def test_sample_draw_depends_on_seed_and_step_not_on_batch(rng):
    logits, params = sampling_batch(rng, 12, 300)
    params["temperature"][:] = 1.0
    batch = C.sample(logits, **params)
    alone = [
        C.sample(logits[b : b + 1], **{k: v[b : b + 1] for k, v in params.items()})
        for b in range(12)
    ]
    np.testing.assert_array_equal(batch, np.concatenate(alone))
    params["steps"] += 1
    assert not np.array_equal(C.sample(logits, **params), batch)  # 12 rows: all equal ~never


def test_sample_frequencies_follow_the_softmax(rng):
    """Independent of the twin: 4000 draws (temperature 0.8, min-p) against the exact softmax."""
    V, B = 12, 4000
    z = randn(rng, (V,), np.float32)
    logits = np.repeat(z[None], B, axis=0)  # (B, V)
    ids = C.sample(logits, 0.8, 0, 1.0, 0.05, rng.integers(0, 2**63, B, dtype=np.uint64), 3)
    p = np.exp((z - z.max()) / 0.8).astype(np.float64)
    p[p < 0.05] = 0  # min-p: below 5% of the most likely token
    p /= p.sum()
    freq = np.bincount(ids, minlength=V) / B
    assert np.all(freq[p == 0] == 0)
    np.testing.assert_allclose(freq, p, atol=5 * np.sqrt(0.25 / B))  # 5 standard errors


def test_sample_support_is_the_filtered_set(rng):
    """top-k then top-p: every draw inside the smallest top set reaching p, each one drawn."""
    V, B, top_k, top_p = 40, 400, 10, 0.7
    z = randn(rng, (V,), np.float32, scale=0.5)
    logits = np.repeat(z[None], B, axis=0)  # (B, V)
    ids = C.sample(logits, 1.0, top_k, top_p, 0.0, rng.integers(0, 2**63, B, dtype=np.uint64), 0)
    best = np.argsort(-z)[:top_k]  # top-k, best first
    cum = np.cumsum(np.exp(z[best] - z.max()))
    support = best[: np.searchsorted(cum, top_p * cum[-1]) + 1]
    assert set(ids.tolist()) == set(support.tolist())


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
    q, k = randn(rng, (T, H, hd), np.float32), randn(rng, (T, Hkv, hd), np.float32)
    pos = np.arange(T) + 5000  # past the first table size
    for a, b in zip(C.rotary(q, k, pos, 1e4), N.rotary(q, k, pos, 1e4), strict=True):
        assert_close(a, b, np.float32)
    ids = rng.integers(0, 50, T)
    table = randn(rng, (50, D), np.float32)
    np.testing.assert_array_equal(C.embedding(ids, table), N.embedding(ids, table))
    with pytest.raises(ValueError, match=r"token_ids must lie in \[0, 50\)"):
        C.embedding(np.array([3, 50]), table)
    pool = randn(rng, (2, 2, 6, 4, Hkv, hd), np.float32)
    with pytest.raises(ValueError, match=r"both a source and a destination"):
        C.copy_blocks(pool, pool, [(1, 2), (2, 3)])


@pytest.mark.slow
def test_kernels_under_address_sanitizer():
    """One pass of the paged-cache, attention and sampling tests with ASan builds."""
    select = "forward and (f32 or sampling) and not long_context and not address_sanitizer"
    select += " and (cache or copy_blocks or attention or sample or rms_norm)"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", select]
    env = K.asan_env()
    env["PYTHONPATH"] = os.pathsep.join([str(K.REPO), env.get("PYTHONPATH", "")])
    result = subprocess.run(cmd, env=env, cwd=K.REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "AddressSanitizer" not in result.stderr
