"""``--kv-cache-dtype``: a 16-bit or 8-bit float KV cache under float32 weights on the host
backends. K and V are rounded to it once, when written (checked against NumPy's own rounding of
the float32 engine's cache; the 8-bit floats saturate at their largest finite value), the cpu
backend agrees with the numpy one, the pool holds two or four times the blocks in the same
memory. Where it is not built it is refused by name (test_quant.py, with ``--quantization``);
what the 8-bit cache costs SmolLM2 in KL divergence is bounded there too."""

from __future__ import annotations

import numpy as np
import pytest

from engine.backends.base import numpy_dtype
from engine.frontend.llm import run_to_completion
from engine.sampling_params import SamplingParams
from tests.utils import SEED_PROMPTS, assert_same_greedy, make_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


SMALL = ["bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"]
TOP = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}  # the largest finite values


@pytest.mark.parametrize("cache", SMALL)
def test_layer0_cache_holds_the_float32_values_rounded(tiny, cache):
    """One prefill: layer 0's K and V come from the same float32 arithmetic in both engines,
    so the smaller pool must equal the float32 pool rounded by NumPy (nearest even)."""
    engines = [make_engine(tiny, backend="cpu", kv_cache_dtype=c) for c in ("float32", cache)]
    one = SamplingParams(temperature=0.0, max_tokens=1)
    for e in engines:
        run_to_completion(e, SEED_PROMPTS, one)
    full, half = (e.backend.kv_cache[0] for e in engines)  # (2, N, bs, Hkv, hd)
    assert full.dtype == np.float32 and half.dtype == numpy_dtype(cache)
    assert np.count_nonzero(full) > 1000  # the prompts were written
    top = TOP.get(cache, np.inf)
    np.testing.assert_array_equal(half, np.clip(full, -top, top).astype(half.dtype))


@pytest.mark.parametrize("cache", SMALL)
def test_cpu_against_numpy_with_a_smaller_cache(tiny, cache):
    """Greedy tokens equal and logits close between the backends (1e-3: a K or V value that the
    two compute an ulp apart can round to neighbouring values of the cache); against a float32
    cache the logits move (the cache is really smaller) but stay near: every step's for 16
    bits, the first step's for 8 (its 3 or 2 mantissa bits move the tiny model's logits, of
    up to 18, by 0.3 and 1.2, and later steps can pick other tokens)."""
    runs = {}
    for backend, c in (("numpy", cache), ("cpu", cache), ("cpu", "float32")):
        e = make_engine(tiny, backend=backend, kv_cache_dtype=c, record_logits=True)
        runs[backend, c] = run_to_completion(e, SEED_PROMPTS, GREEDY)
    assert_same_greedy(runs["numpy", cache], runs["cpu", cache], tol=1e-3)
    sixteen_bits = numpy_dtype(cache).itemsize == 2
    steps = slice(None) if sixteen_bits else slice(0, 1)
    moved = max(
        np.abs(np.stack(a.step_logits[steps]) - np.stack(b.step_logits[steps])).max()
        for a, b in zip(
            (r.outputs[0] for r in runs["cpu", cache]),
            (r.outputs[0] for r in runs["cpu", "float32"]),
            strict=True,
        )
    )
    assert 1e-6 < moved < (0.1 if sixteen_bits else 3.0)


@pytest.mark.parametrize("cache, times", [("bfloat16", 2), ("fp8", 4)])
def test_the_pool_holds_more_blocks_in_the_same_memory(tiny, cache, times):
    budget = 64 << 20
    pools = {}
    for c in ("auto", cache):
        e = make_engine(
            tiny, backend="cpu", kv_cache_dtype=c, num_gpu_blocks=None,
            memory_budget_bytes=budget,
        )  # fmt: skip
        pools[c] = (e.backend.bytes_per_block, e.backend.kv_cache.shape[2], e.backend)
    (full_bytes, full_blocks, f32), (small_bytes, small_blocks, small) = pools.values()
    assert f32.cache_dtype == "float32"
    assert small.cache_dtype == {"fp8": "fp8_e4m3"}.get(cache, cache)  # vLLM's fp8 is e4m3
    assert small_bytes * times == full_bytes == tiny.config.kv_bytes_per_block(16, "float32")
    assert small.kv_cache.nbytes == small_blocks * small_bytes
    assert small.kv_cache.dtype.itemsize == 4 // times
    assert 0.95 * times * full_blocks <= small_blocks <= 1.05 * times * full_blocks
