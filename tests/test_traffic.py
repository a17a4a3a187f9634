"""The counting builds of the CPU emulation (cuda_src/cpu/emu_traffic.h): the bytes a kernel
loads from and stores to each array argument, as the compiled code asks for them."""

from __future__ import annotations

import textwrap
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import pytest

from engine import emulation as E
from engine import kernels as K

# Grid: (1,)  Block: (n,). copy: out[i] = x[i] (scalar); twice: out[i] = x[i] + x[i + 1], so
# each x[i] is read by two threads; vec: 16-byte loads and stores; shared: x staged through
# shared memory (shared memory is not global traffic).
SNIPPETS = """
#include "common.cuh"
extern "C" __global__ void copy(float* __restrict__ out, const float* __restrict__ x) {
  out[threadIdx.x] = x[threadIdx.x];
}
extern "C" __global__ void twice(float* __restrict__ out, const float* __restrict__ x) {
  out[threadIdx.x] = x[threadIdx.x] + x[(threadIdx.x + 1) % blockDim.x];
}
extern "C" __global__ void vec(float* __restrict__ out, const float* __restrict__ x) {
  reinterpret_cast<float4*>(out)[threadIdx.x] = reinterpret_cast<const float4*>(x)[threadIdx.x];
}
extern "C" __global__ void bump(float* __restrict__ x) {
  x[threadIdx.x] = x[threadIdx.x] + 1.0f;
}
extern "C" __global__ void shared(float* __restrict__ out, const float* __restrict__ x, int n) {
  __shared__ float buf[256];
  buf[threadIdx.x] = x[threadIdx.x];
  __syncthreads();
  float s = 0.0f;
  for (int i = 0; i < n; ++i) s += buf[i];
  out[threadIdx.x] = s;
}
"""


@pytest.fixture(scope="module")
def mod():
    """The counting builds; with the plain one (a test below loads it), compiled side by side
    first (cached by content hash, so the loads are hits)."""
    with ThreadPoolExecutor(2) as pool:
        jobs = [
            pool.submit(K.compile_cpu_source, textwrap.dedent(SNIPPETS), "emu_traffic", kind)
            for kind in ("reads", "writes", None)
        ]
        for job in jobs:
            job.result()
    return E.cpu_module_from_source(textwrap.dedent(SNIPPETS), "emu_traffic", counting=True)


def launch(mod, name, n, *args, threads=None):
    with E.memory_traffic() as t:
        mod.get_function(name)((1,), (threads or n,), args)
    return t


def test_each_access_is_counted_once_with_its_width(mod):
    rng = np.random.default_rng()
    n = int(rng.integers(8, 64)) * 4
    x = rng.standard_normal(n).astype(np.float32)
    out = np.empty_like(x)
    t = launch(mod, "copy", n, out, x)
    assert (t.read(x), t.written(out), t.read(out), t.written(x)) == (x.nbytes, x.nbytes, 0, 0)
    np.testing.assert_array_equal(out, x)
    t = launch(mod, "twice", n, out, x)
    assert (t.read(x), t.written(out)) == (2 * x.nbytes, x.nbytes)
    np.testing.assert_array_equal(out, x + np.roll(x, -1))
    t = launch(mod, "vec", n // 4, out, x)
    assert (t.read(x), t.written(out)) == (x.nbytes, x.nbytes)
    assert [r[1] - r[0] for r in t.launches[0][1]] == [x.nbytes, x.nbytes]


def test_an_in_place_update_counts_its_load_and_its_store_and_runs_once(mod):
    n = 96
    x = np.random.default_rng().standard_normal(n).astype(np.float32)
    want = x + 1.0
    t = launch(mod, "bump", n, x)
    assert (t.read(x), t.written(x)) == (x.nbytes, x.nbytes)
    np.testing.assert_array_equal(x, want)  # the loads-counting run's result was undone


def test_shared_memory_and_locals_are_not_global_traffic(mod):
    n = 128
    x = np.random.default_rng().standard_normal(n).astype(np.float32)
    out = np.empty_like(x)
    t = launch(mod, "shared", n, out, x, np.int32(n))
    assert (t.read(x), t.written(out)) == (x.nbytes, out.nbytes)  # n * n shared reads unseen
    np.testing.assert_allclose(out, np.full(n, x.sum()), rtol=1e-4)


def test_overlapping_arguments_are_one_range_and_plain_builds_count_nothing(mod):
    n = 64
    buf = np.random.default_rng().standard_normal(2 * n).astype(np.float32)
    t = launch(mod, "copy", n, buf[n:], buf[n // 2 : n // 2 + n])  # out overlaps x
    assert t.launches[0][1][0][:2] == (buf[n // 2 :].ctypes.data, buf.ctypes.data + buf.nbytes)
    assert (t.read(buf), t.written(buf)) == (4 * n, 4 * n)
    plain = E.cpu_module_from_source(textwrap.dedent(SNIPPETS), "emu_traffic")
    x, out = np.ones(n, np.float32), np.empty(n, np.float32)
    with E.memory_traffic() as t:
        plain.get_function("copy")((1,), (n,), (out, x))
    assert t.launches == []


def test_a_real_kernel_writes_exactly_its_output():
    rng = np.random.default_rng()
    T, D = int(rng.integers(1, 9)), 64 + 8 * int(rng.integers(0, 8))
    dt = ml_dtypes.bfloat16
    x = rng.standard_normal((T, D)).astype(dt)
    w = rng.standard_normal(D).astype(dt)
    out = np.empty_like(x)
    with E.memory_traffic() as t:
        E.counting_kernels().rms_norm(out, x, w, 1e-5)
    assert t.written(out) == out.nbytes and t.written(x) == 0
    assert t.read(x) >= x.nbytes and t.read(w) >= w.nbytes
    ref = np.empty_like(x)
    E.cpu_kernels().rms_norm(ref, x, w, 1e-5)
    np.testing.assert_array_equal(out.view(np.uint16), ref.view(np.uint16))
