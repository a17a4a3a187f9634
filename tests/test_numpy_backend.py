"""The NumPy backend's fast ops against numpy_ops, and its activation-peak estimate."""

from __future__ import annotations

import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest

from engine.backends import fast_ops
from engine.backends.forward_batch import ForwardBatch
from engine.backends.numpy_backend import NumpyBackend
from engine.utils import cdiv
from reference import kernel_ops as numpy_ops

BS, HKV, HD, H = 4, 2, 8, 6


def paged_setup(rng, lens):
    n_blocks = sum(cdiv(n, BS) for n in lens) + 3
    k = rng.standard_normal((n_blocks, BS, HKV, HD), dtype=np.float32)
    v = rng.standard_normal((n_blocks, BS, HKV, HD), dtype=np.float32)
    ids = rng.permutation(n_blocks)
    tables, i = [], 0
    for n in lens:
        nb = cdiv(n, BS)
        tables.append(list(ids[i : i + nb]) + [-1] * (10 - nb))
        i += nb
    return k, v, np.array(tables, dtype=np.int32)


def test_decode_attention_matches_numpy_ops():
    rng = np.random.default_rng(0)
    lens = np.array([1, 5, 13, 8], dtype=np.int32)
    k, v, tables = paged_setup(rng, lens)
    q = rng.standard_normal((4, H, HD), dtype=np.float32)
    want = numpy_ops.paged_attention_decode(q, k, v, tables, lens, 0.3)
    got = fast_ops.paged_attention_decode(q, k, v, tables, lens, 0.3)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [512, 3])
def test_prefill_attention_matches_numpy_ops(monkeypatch, chunk):
    monkeypatch.setattr(fast_ops, "QUERY_CHUNK", chunk)
    rng = np.random.default_rng(1)
    lens = np.array([7, 12, 3], dtype=np.int32)
    q_lens = np.array([7, 5, 1])  # the second starts part-way (cached prefix)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    k, v, tables = paged_setup(rng, lens)
    q = rng.standard_normal((int(qsl[-1]), H, HD), dtype=np.float32)
    want = numpy_ops.paged_attention_prefill(q, k, v, tables, qsl, lens, 0.4)
    got = fast_ops.paged_attention_prefill(q, k, v, tables, qsl, lens, 0.4)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_elementwise_ops_match_numpy_ops():
    rng = np.random.default_rng(2)
    x, r = rng.standard_normal((5, 16), dtype=np.float32), rng.standard_normal((5, 16), np.float32)
    w = rng.standard_normal(16, dtype=np.float32)
    np.testing.assert_allclose(
        fast_ops.rms_norm(x, w, 1e-5), numpy_ops.rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-6
    )
    for a, b in zip(
        fast_ops.fused_add_rms_norm(x, r, w, 1e-5),
        numpy_ops.fused_add_rms_norm(x, r, w, 1e-5),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    gate_up = rng.standard_normal((5, 32), dtype=np.float32) * 4  # silu's both tails
    np.testing.assert_allclose(
        fast_ops.silu_and_mul(gate_up), numpy_ops.silu_and_mul(gate_up), rtol=1e-6, atol=1e-7
    )
    pos = rng.integers(0, 100, 5).astype(np.int32)
    q, k = (
        rng.standard_normal((5, H, HD), np.float32),
        rng.standard_normal((5, HKV, HD), np.float32),
    )
    for a, b in zip(fast_ops.rotary(q, k, pos, 1e4), numpy_ops.rotary(q, k, pos, 1e4), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    caches = [np.zeros((3, BS, HKV, HD), np.float32) for _ in range(4)]
    kk, vv = k[:, :HKV], rng.standard_normal((5, HKV, HD), np.float32)
    slots = np.array([0, 5, -1, 11, 2], dtype=np.int32)
    fast_ops.reshape_and_cache(kk, vv, caches[0], caches[1], slots)
    numpy_ops.reshape_and_cache(kk, vv, caches[2], caches[3], slots)
    np.testing.assert_array_equal(caches[0], caches[2])
    np.testing.assert_array_equal(caches[1], caches[3])


def test_profile_peak_bounds_the_measured_peak(tiny):
    cfg = SimpleNamespace(block_size=16, dtype="auto")
    be = NumpyBackend(tiny.config, tiny.weights, cfg)
    t = 384  # one prefill of t tokens
    be.allocate_kv_cache(cdiv(t, 16), 0)
    blocks = np.arange(cdiv(t, 16), dtype=np.int32)
    pos = np.arange(t, dtype=np.int32)
    rng = np.random.default_rng(3)
    batch = ForwardBatch(
        token_ids=rng.integers(0, tiny.config.vocab_size, t).astype(np.int32),
        positions=pos,
        slot_mapping=pos.copy(),
        block_tables=blocks[None],
        context_lens=np.array([t], np.int32),
        query_start_loc=np.array([0, t], np.int32),
        num_decodes=0,
    )
    tracemalloc.start()
    be.forward(batch)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    estimate = be.profile_peak_bytes(t, t, 1)
    assert peak <= estimate <= 4 * peak, (peak, estimate)


def test_greedy_ids_skip_nan_and_give_no_token_for_an_empty_row():
    from engine.backends.base import greedy_ids

    rng = np.random.default_rng()
    logits = rng.standard_normal((4, 50)).astype(np.float32)  # (B, V)
    logits[1, 7] = np.nan  # beside finite values: never the answer
    logits[2] = -np.inf
    logits[3] = np.nan
    want = np.argmax(np.where(np.isnan(logits), -np.inf, logits), axis=1)
    got = greedy_ids(logits)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got[:2], want[:2])
    np.testing.assert_array_equal(got[2:], [-1, -1])
