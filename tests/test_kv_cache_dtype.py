"""``--kv-cache-dtype``: a 16-bit KV cache under float32 weights on the host backends. K and V
are rounded to it once, when written (checked against NumPy's own rounding of the float32
engine's cache), the cpu backend agrees with the numpy one, the pool holds twice the blocks in
the same memory. Where it is not built it is refused by name (test_quant.py, with
``--quantization``)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.backends.base import numpy_dtype
from engine.llm import run_to_completion
from engine.sampling_params import SamplingParams
from tests.utils import SEED_PROMPTS, assert_same_greedy, make_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.mark.parametrize("cache", ["bfloat16", "float16"])
def test_layer0_cache_holds_the_float32_values_rounded(tiny, cache):
    """One prefill: layer 0's K and V come from the same float32 arithmetic in both engines,
    so the 16-bit pool must equal the float32 pool rounded by NumPy (nearest even)."""
    engines = [make_engine(tiny, backend="cpu", kv_cache_dtype=c) for c in ("float32", cache)]
    one = SamplingParams(temperature=0.0, max_tokens=1)
    for e in engines:
        run_to_completion(e, SEED_PROMPTS, one)
    full, half = (e.backend.kv_cache[0] for e in engines)  # (2, N, bs, Hkv, hd)
    assert full.dtype == np.float32 and half.dtype == numpy_dtype(cache)
    assert np.count_nonzero(full) > 1000  # the prompts were written
    np.testing.assert_array_equal(half, full.astype(half.dtype))


@pytest.mark.parametrize("cache", ["bfloat16", "float16"])
def test_cpu_against_numpy_with_a_16_bit_cache(tiny, cache):
    """Greedy tokens equal and logits close between the backends (1e-3: a K or V value that the
    two compute an ulp apart can round to neighbouring 16-bit values); against a float32 cache
    the logits move (the cache is really 16-bit) but stay near."""
    runs = {}
    for backend, c in (("numpy", cache), ("cpu", cache), ("cpu", "float32")):
        e = make_engine(tiny, backend=backend, kv_cache_dtype=c, record_logits=True)
        runs[backend, c] = run_to_completion(e, SEED_PROMPTS, GREEDY)
    assert_same_greedy(runs["numpy", cache], runs["cpu", cache], tol=1e-3)
    moved = max(
        np.abs(np.stack(a.outputs[0].step_logits) - np.stack(b.outputs[0].step_logits)).max()
        for a, b in zip(runs["cpu", cache], runs["cpu", "float32"], strict=True)
    )
    assert 1e-6 < moved < 0.1


def test_the_pool_holds_twice_the_blocks_in_the_same_memory(tiny):
    budget = 64 << 20
    pools = {}
    for cache in ("auto", "bfloat16"):
        e = make_engine(
            tiny, backend="cpu", kv_cache_dtype=cache, num_gpu_blocks=None,
            memory_budget_bytes=budget,
        )  # fmt: skip
        pools[cache] = (e.backend.bytes_per_block, e.backend.kv_cache.shape[2], e.backend)
    (full_bytes, full_blocks, f32), (half_bytes, half_blocks, b16) = pools.values()
    assert f32.cache_dtype == "float32" and b16.cache_dtype == "bfloat16"
    assert half_bytes * 2 == full_bytes == tiny.config.kv_bytes_per_block(16, "float32")
    assert b16.kv_cache.nbytes == half_blocks * half_bytes
    assert 1.9 * full_blocks <= half_blocks <= 2.1 * full_blocks
