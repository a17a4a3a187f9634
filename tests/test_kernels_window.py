"""The family parameters of the kernels against the NumPy backend's ops (engine.backends.fast_ops,
themselves held to transformers by tests/test_families.py): sliding windows in decode and
prefill (and the bytes a windowed decode reads), q/k/v bias and q/k norms in rotary_cache, the
GELU activations, the norm offset and the embedding scale."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import engine.emulation as E
from engine.backends import fast_ops as F
from engine.utils import cdiv
from tests.test_kernels import (
    assert_close,
    block_tables_for,
    decode_case,
    make_cache,
    poisoned,
    randn,
)

BF16 = ml_dtypes.bfloat16


@pytest.fixture
def rng():
    return np.random.default_rng()


@pytest.mark.parametrize("window", [1, 7, 16, 37, 100, 1000])
def test_decode_window_matches_numpy_and_reads_only_the_window(window, rng):
    dtype, Hkv, hd = BF16, 2, 64
    lengths = [1, 15, 40, 300, 333]
    q, k_cache, v_cache, tables, lens = decode_case(rng, lengths, (4 * Hkv, Hkv), hd, dtype)
    out = poisoned(q.shape, dtype)
    with E.memory_traffic() as t:
        E.counting_kernels().paged_attention_decode(
            out, q, k_cache, v_cache, tables, lens, 0.125, 333, 64, window=window
        )
    want = F.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.125, window)
    assert_close(out, want, dtype)
    need = int(np.minimum(lens, window).sum()) * Hkv * hd * k_cache.itemsize
    assert need <= t.read(k_cache) <= 1.25 * need + 16 * 5 * Hkv * hd * k_cache.itemsize


@pytest.mark.parametrize("window", [3, 8, 33, 500])
def test_decode_window_changes_the_result(window, rng):
    """A window shorter than the context must change the output (the test above can't pass by
    ignoring it), and one at least as long must not."""
    q, k_cache, v_cache, tables, lens = decode_case(rng, [60], (4, 2), 64, np.float32)
    a, b = poisoned(q.shape, np.float32), poisoned(q.shape, np.float32)
    E.cpu_kernels().paged_attention_decode(a, q, k_cache, v_cache, tables, lens, 0.125, 60)
    E.cpu_kernels().paged_attention_decode(
        b, q, k_cache, v_cache, tables, lens, 0.125, 60, window=window
    )
    assert (np.abs(a - b).max() > 1e-3) == (window < 60)


@pytest.mark.parametrize("window", [1, 5, 32, 45])
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_prefill_window_matches_numpy(window, dtype, rng):
    H, Hkv, hd, bs = 4, 2, 64, 16
    q_lens, ctx_lens = [70, 1, 33, 20], [70, 50, 100, 20]  # some runs are chunks of longer ones
    num_blocks = sum(cdiv(n, bs) for n in ctx_lens) + 3
    k_cache, v_cache = make_cache(rng, num_blocks, bs, Hkv, hd, dtype)
    tables = block_tables_for(rng, ctx_lens, bs, num_blocks)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    lens = np.array(ctx_lens, np.int32)
    q = randn(rng, (int(qsl[-1]), H, hd), dtype)
    out = poisoned(q.shape, dtype)
    E.cpu_kernels().paged_attention_prefill(
        out, q, k_cache, v_cache, tables, qsl, lens, 0.125, window=window
    )
    want = F.paged_attention_prefill(q, k_cache, v_cache, tables, qsl, lens, 0.125, window)
    assert_close(out, want, dtype)
    full = F.paged_attention_prefill(q, k_cache, v_cache, tables, qsl, lens, 0.125)
    assert np.abs(want.astype(np.float32) - full.astype(np.float32)).max() > 1e-2


def test_rotary_cache_bias_and_qk_norm_match_numpy(rng):
    from model_loader.rope import rope_table

    T, H, Hkv, hd, bs, N = 9, 4, 2, 32, 4, 8
    qkv = randn(rng, (T, (H + 2 * Hkv) * hd), np.float32)
    bias = randn(rng, ((H + 2 * Hkv) * hd,), np.float32)
    qn, kn = (1 + 0.3 * randn(rng, (hd,), np.float32) for _ in range(2))
    pos = rng.permutation(40)[:T].astype(np.int32)
    slots = rng.permutation(N * bs)[:T].astype(np.int32)
    k_cache, v_cache = make_cache(rng, N, bs, Hkv, hd, np.float32)
    k_want, v_want = k_cache.copy(), v_cache.copy()
    q = np.empty((T, H, hd), np.float32)
    table = rope_table(64, hd, 1e4)
    E.cpu_kernels().rotary_cache(
        q, k_cache, v_cache, qkv, pos, slots, table, bias=bias, q_norm=qn, k_norm=kn, eps=1e-6
    )
    x = qkv + bias
    qw = F.rms_norm(x[:, : H * hd].reshape(-1, hd), qn, 1e-6).reshape(T, H, hd)
    kw = F.rms_norm(x[:, H * hd : (H + Hkv) * hd].reshape(-1, hd), kn, 1e-6).reshape(T, Hkv, hd)
    qw, kw = F.rotary(qw, kw, pos, 1e4)
    F.reshape_and_cache(kw, x[:, (H + Hkv) * hd :].reshape(T, Hkv, hd), k_want, v_want, slots)
    np.testing.assert_allclose(q, qw, atol=1e-5)
    np.testing.assert_allclose(k_cache, k_want, atol=1e-5)
    np.testing.assert_allclose(v_cache, v_want, atol=1e-6)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
def test_act_and_mul_matches_numpy(activation, rng):
    gate_up = randn(rng, (5, 2 * 96), np.float32) * 3
    out = np.empty((5, 96), np.float32)
    E.cpu_kernels().act_and_mul(out, gate_up, activation)
    np.testing.assert_allclose(out, F.act_and_mul(gate_up, activation), atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="relu"):
        E.cpu_kernels().act_and_mul(out, gate_up, "relu")


def test_norm_offset_and_embedding_scale_match_numpy(rng):
    x, w = randn(rng, (6, 64), np.float32), 0.1 * randn(rng, (64,), np.float32)
    out = np.empty_like(x)
    E.cpu_kernels().rms_norm(out, x, w, 1e-6, 1.0)
    np.testing.assert_allclose(out, F.rms_norm(x, w, 1e-6, 1.0), atol=1e-5)
    table, ids = randn(rng, (20, 64), np.float32), rng.integers(0, 20, 7).astype(np.int32)
    emb = np.empty((7, 64), np.float32)
    E.cpu_kernels().embedding(emb, ids, table, 8.0)
    np.testing.assert_allclose(emb, F.embedding(ids, table, 8.0), rtol=1e-6)


def prefill_case(rng, heads, hd, bs, dtype):
    """Three query runs (40 of 40 tokens, 1 of 50, 25 of 70) over shuffled blocks: q (T, H,
    hd), the caches, block tables, query_start_loc and context lengths."""
    (H, Hkv), q_lens, ctx_lens = heads, [40, 1, 25], [40, 50, 70]
    num_blocks = sum(cdiv(n, bs) for n in ctx_lens) + 3
    k_cache, v_cache = make_cache(rng, num_blocks, bs, Hkv, hd, dtype)
    tables = block_tables_for(rng, ctx_lens, bs, num_blocks)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = randn(rng, (int(qsl[-1]), H, hd), dtype)
    return q, k_cache, v_cache, tables, qsl, np.array(ctx_lens, np.int32)


@pytest.mark.parametrize("softcap, window", [(2.0, 0), (5.0, 0), (5.0, 16)])
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_softcapped_decode_and_prefill_match_the_reference(softcap, window, dtype, rng):
    """Gemma 2's attention soft-capping, tanh(s / cap) * cap of every score, in both kernels:
    held to reference/kernel_ops (an independent einsum) and to the NumPy backend's ops, with
    a scale large enough that the cap changes the result."""
    from reference import kernel_ops as N

    scale, H, Hkv, hd, bs = 0.5, 4, 2, 64, 16
    q, k_cache, v_cache, tables, lens = decode_case(rng, [1, 30, 90], (H, Hkv), hd, dtype)
    out = poisoned(q.shape, dtype)
    E.cpu_kernels().paged_attention_decode(
        out, q, k_cache, v_cache, tables, lens, scale, 90, window=window, softcap=softcap
    )
    args = (q, k_cache, v_cache, tables, lens, scale, window)
    want = N.paged_attention_decode(*args, softcap)
    assert_close(out, want, dtype)
    assert_close(F.paged_attention_decode(*args, softcap), want, dtype)
    uncapped = N.paged_attention_decode(*args)
    assert np.abs(want.astype(np.float32) - uncapped.astype(np.float32)).max() > 1e-2

    q, k_cache, v_cache, tables, qsl, lens = prefill_case(rng, (H, Hkv), hd, bs, dtype)
    out = poisoned(q.shape, dtype)
    E.cpu_kernels().paged_attention_prefill(
        out, q, k_cache, v_cache, tables, qsl, lens, scale, window=window, softcap=softcap
    )
    args = (q, k_cache, v_cache, tables, qsl, lens, scale, window)
    want = N.paged_attention_prefill(*args, softcap)
    assert_close(out, want, dtype)
    assert_close(F.paged_attention_prefill(*args, softcap), want, dtype)
    uncapped = N.paged_attention_prefill(*args)
    assert np.abs(want.astype(np.float32) - uncapped.astype(np.float32)).max() > 1e-2


@pytest.mark.parametrize("partition_size, window", [(None, 0), (64, 0), (64, 16)])
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_sinks_in_decode_reduce_and_prefill_match_the_reference(partition_size, window, dtype, rng):
    """gpt-oss's sinks, one more logit per head whose share of the softmax is dropped, in the
    decode kernel (one partition: its own sum; several: the reduce kernel's) and the prefill
    kernel: held to reference/kernel_ops (a concatenated column) and to the NumPy backend's
    ops, a sink far above the scores among them."""
    from reference import kernel_ops as N

    scale, H, Hkv, hd, bs = 0.125, 4, 2, 64, 16
    sinks = (2 * rng.standard_normal(H)).astype(np.float32)
    sinks[rng.integers(H)] = 30.0
    q, k_cache, v_cache, tables, lens = decode_case(rng, [1, 30, 190], (H, Hkv), hd, dtype)
    out = poisoned(q.shape, dtype)
    E.cpu_kernels().paged_attention_decode(
        out, q, k_cache, v_cache, tables, lens, scale, 190, partition_size, window=window,
        sinks=sinks,
    )  # fmt: skip
    args = (q, k_cache, v_cache, tables, lens, scale, window, 0.0)
    want = N.paged_attention_decode(*args, sinks)
    assert_close(out, want, dtype)
    assert_close(F.paged_attention_decode(*args, sinks), want, dtype)
    plain = N.paged_attention_decode(*args)
    assert np.abs(want.astype(np.float32) - plain.astype(np.float32)).max() > 1e-2

    q, k_cache, v_cache, tables, qsl, lens = prefill_case(rng, (H, Hkv), hd, bs, dtype)
    out = poisoned(q.shape, dtype)
    E.cpu_kernels().paged_attention_prefill(
        out, q, k_cache, v_cache, tables, qsl, lens, scale, window=window, sinks=sinks
    )
    args = (q, k_cache, v_cache, tables, qsl, lens, scale, window, 0.0)
    want = N.paged_attention_prefill(*args, sinks)
    assert_close(out, want, dtype)
    assert_close(F.paged_attention_prefill(*args, sinks), want, dtype)


def test_softcap_must_be_a_number_at_least_zero(rng):
    q, k_cache, v_cache, tables, lens = decode_case(rng, [5], (4, 2), 64, np.float32)
    with pytest.raises(ValueError, match="softcap must be a number >= 0"):
        E.cpu_kernels().paged_attention_decode(
            poisoned(q.shape, np.float32), q, k_cache, v_cache, tables, lens, 0.1, 5, softcap=-1.0
        )
