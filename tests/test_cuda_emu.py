"""The CPU emulation of CUDA (cuda_src/cpu/cuda_emu.h): correct kernels give CUDA's results,
and each class of kernel bug it claims to catch is caught."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from engine import emulation as E
from engine import kernels as K

i32 = np.int32

# Each snippet is a small kernel file of its own; several hold a deliberate bug.
REVERSE = """
#include "common.cuh"
// Grid: (1,)  Block: (n,)   out[i] = x[n - 1 - i] through shared memory
extern "C" __global__ void reverse(float* __restrict__ out, const float* __restrict__ x, int n) {
  __shared__ float buf[256];
  buf[threadIdx.x] = x[threadIdx.x];
  SYNC
  out[threadIdx.x] = buf[n - 1 - threadIdx.x];
}
"""

UNINIT = """
#include "common.cuh"
// Grid: (1,)  Block: (32,)   reads shared memory nobody wrote
extern "C" __global__ void uninit(float* __restrict__ out, int* __restrict__ out_i) {
  __shared__ float f[32];
  __shared__ int k[32];
  out[threadIdx.x] = f[threadIdx.x] + 1.0f;
  out_i[threadIdx.x] = k[threadIdx.x];
}
// Grid: (1,)  Block: (32,)   dynamic shared memory: written, then read by the neighbour
extern "C" __global__ void dynamic(float* __restrict__ out, int write) {
  DYNAMIC_SHARED(float, buf);
  if (write) buf[threadIdx.x] = float(threadIdx.x);
  __syncthreads();
  out[threadIdx.x] = buf[(threadIdx.x + 1) % 32];
}
"""

BARRIERS = """
#include "common.cuh"
// Grid: (1,)  Block: (64,)   half the block returns before a barrier
extern "C" __global__ void early_exit(float* __restrict__ out) {
  if (threadIdx.x >= 32) return;
  __syncthreads();
  out[threadIdx.x] = 1.0f;
}
// Grid: (1,)  Block: (64,)   the two halves wait at different barriers
extern "C" __global__ void divergent(float* __restrict__ out) {
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1.0f;
}
"""

WARPS = """
#include "common.cuh"
// Grid: (1,)  Block: (32,)   a full-mask shuffle that half the warp skips
extern "C" __global__ void partial_shuffle(float* __restrict__ out) {
  float v = float(threadIdx.x);
  if (threadIdx.x < 16) v = __shfl_xor_sync(0xFFFFFFFFu, v, 1);
  out[threadIdx.x] = v;
}
// Grid: (1,)  Block: (32,)   lanes disagree on the mask
extern "C" __global__ void mask_mismatch(float* __restrict__ out) {
  const unsigned mask = threadIdx.x < 16 ? 0x0000FFFFu : 0xFFFFFFFFu;
  out[threadIdx.x] = __shfl_xor_sync(mask, 1.0f, 1);
}
// Grid: (1,)  Block: (48,)   a full-mask reduction in a block whose last warp has 16 lanes
extern "C" __global__ void partial_warp(float* __restrict__ out) {
  out[threadIdx.x] = warp_sum(1.0f);
}
// Grid: (1,)  Block: (64,)   lane 0 waits in a shuffle for lane 1, which waits at a barrier
extern "C" __global__ void deadlock(float* __restrict__ out) {
  float v = 1.0f;
  if (threadIdx.x == 0) v = __shfl_sync(0x3u, v, 1);
  __syncthreads();
  out[threadIdx.x] = v;
}
"""

INTRINSICS = """
#include "common.cuh"
// Grid: (1,)  Block: (64,)   every warp intrinsic, results per thread
extern "C" __global__ void intrinsics(int* __restrict__ out, int width) {
  const int lane = threadIdx.x % 32, v = int(threadIdx.x) * 10;
  int* o = out + threadIdx.x * 6;
  o[0] = __shfl_sync(0xFFFFFFFFu, v, 3, width);
  o[1] = __shfl_up_sync(0xFFFFFFFFu, v, 2, width);
  o[2] = __shfl_down_sync(0xFFFFFFFFu, v, 2, width);
  o[3] = __shfl_xor_sync(0xFFFFFFFFu, v, 5, width);
  o[4] = int(__ballot_sync(0xFFFFFFFFu, lane % 3 == 0));
  o[5] = __shfl_xor_sync(0x0000FFFFu << (16 * (lane / 16)), v, 1);
}
// Grid: (n_blocks,)  Block: (128,)   every thread adds to one counter
extern "C" __global__ void count(int* __restrict__ counter, float* __restrict__ sum) {
  atomicAdd(counter, 1);
  atomicAdd(sum, 0.5f);
}
// Grid: (1,)  Block: (32,)   reads x[n - 32 .. n - 1]: past the end when n > len(x)
extern "C" __global__ void overflow(float* __restrict__ out, const float* __restrict__ x, int n) {
  out[threadIdx.x] = x[threadIdx.x + n - 32];
}
// Grid: (1,)  Block: (32,)   writes past the end of its dynamic shared memory
extern "C" __global__ void smem_overflow(float* __restrict__ out) {
  DYNAMIC_SHARED(float, buf);
  buf[threadIdx.x + 1] = 1.0f;
  __syncthreads();
  out[threadIdx.x] = buf[threadIdx.x];
}
"""


def build(source: str, tag: str):
    return E.cpu_module_from_source(textwrap.dedent(source), tag)


# Every snippet build the tests below load: (source, tag).
SNIPPET_BUILDS = [(REVERSE.replace("SYNC", "__syncthreads();"), "emu_reverse_sync")]
SNIPPET_BUILDS += [(REVERSE.replace("SYNC", ""), "emu_reverse"), (UNINIT, "emu_uninit")]
SNIPPET_BUILDS += [(BARRIERS, "emu_barriers"), (WARPS, "emu_warps")]
SNIPPET_BUILDS += [(INTRINSICS, "emu_intrinsics")]


@pytest.fixture(scope="module", autouse=True)
def built_snippets():
    """Compile every snippet once, two g++ processes at a time (cached by content hash, so each
    test's build() is a load)."""
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda b: build(*b), SNIPPET_BUILDS))


def run_reverse(sync: str, n: int = 64) -> np.ndarray:
    mod = build(REVERSE.replace("SYNC", sync), "emu_reverse_sync" if sync else "emu_reverse")
    x = np.random.default_rng().standard_normal(n).astype(np.float32)
    out = np.full(n, np.nan, np.float32)
    mod.get_function("reverse")((1,), (n,), (out, x, i32(n)))
    return out, x[::-1]


def test_correct_kernel_passes_in_every_order(order):
    out, want = run_reverse("__syncthreads();")
    np.testing.assert_array_equal(out, want)


def test_missing_barrier_shows_in_forward_and_reversed_orders(order):
    out, want = run_reverse("")
    if order == "forward":  # thread 0 reads buf[63] before thread 63 wrote it
        assert np.isnan(out[0]) and not np.isnan(out[-1])
    elif order == "reversed":
        assert np.isnan(out[-1]) and not np.isnan(out[0])
    else:  # some thread runs before its partner
        assert np.isnan(out).any()


def test_uninitialised_shared_memory_reads_nan_and_minus_one():
    mod = build(UNINIT, "emu_uninit")
    out, out_i = np.zeros(32, np.float32), np.zeros(32, np.int32)
    mod.get_function("uninit")((1,), (32,), (out, out_i))
    assert np.isnan(out).all() and (out_i == -1).all()


def test_dynamic_shared_memory_is_poisoned_then_usable():
    fn = build(UNINIT, "emu_uninit").get_function("dynamic")
    out = np.zeros(32, np.float32)
    fn((1,), (32,), (out, i32(0)), shared_mem=32 * 4)
    assert np.isnan(out).all()
    fn((1,), (32,), (out, i32(1)), shared_mem=32 * 4)
    np.testing.assert_array_equal(out, (np.arange(32) + 1) % 32)


@pytest.mark.parametrize(
    "kernel,block,message",
    [
        ("early_exit", 64, r"reached by 32 of 64 threads; the others had exited"),
        ("divergent", 64, r"divergent __syncthreads: threads wait at emu_barriers.cu:\d+ and at"),
    ],
)
def test_barrier_bugs_are_caught(order, kernel, block, message):
    fn = build(BARRIERS, "emu_barriers").get_function(kernel)
    with pytest.raises(E.KernelLaunchError, match=message):
        fn((1,), (block,), (np.zeros(block, np.float32),))


@pytest.mark.parametrize(
    "kernel,block,message",
    [
        ("partial_shuffle", 32, r"reached only by lanes 0x0000ffff; lane 16 has exited"),
        # the 0x0000ffff group may complete before the full-mask lanes arrive: then lane 0
        # has exited when they wait for it
        ("mask_mismatch", 32, r"while other lanes wait at emu_warps.cu:\d+|lane 0 has exited"),
        ("partial_warp", 48, r"names lanes that do not exist \(block of 48 threads\)"),
        ("deadlock", 64, r"deadlock: .* mask 0x00000003 .*lane 1 waits at emu_warps.cu:\d+"),
    ],
)
def test_warp_bugs_are_caught(order, kernel, block, message):
    fn = build(WARPS, "emu_warps").get_function(kernel)
    with pytest.raises(E.KernelLaunchError, match=message):
        fn((1,), (block,), (np.zeros(block, np.float32),))


def expected_intrinsics(width: int) -> np.ndarray:
    """CUDA's documented results for the INTRINSICS kernel, (64, 6)."""
    out = np.zeros((64, 6), np.int64)
    for t in range(64):
        lane, warp = t % 32, t // 32
        base = lane - lane % width
        src = [
            base + 3 % width,
            lane - 2 if lane - base >= 2 else lane,
            lane + 2 if lane - base + 2 < width else lane,
            lane ^ 5 if (lane ^ 5) < base + width else lane,
        ]
        out[t, :4] = [(warp * 32 + s) * 10 for s in src]
        out[t, 4] = np.int32(np.uint32(sum(1 << i for i in range(32) if i % 3 == 0)))
        out[t, 5] = (warp * 32 + (lane ^ 1)) * 10
    return out


@pytest.mark.parametrize("width", [32, 8])
def test_warp_intrinsics_match_cuda_semantics(order, width):
    fn = build(INTRINSICS, "emu_intrinsics").get_function("intrinsics")
    out = np.full(64 * 6, -7, np.int32)
    fn((1,), (64,), (out, i32(width)))
    np.testing.assert_array_equal(out.reshape(64, 6), expected_intrinsics(width))


def test_atomics_count_every_thread_of_every_block(order):
    fn = build(INTRINSICS, "emu_intrinsics").get_function("count")
    counter, total = np.zeros(1, np.int32), np.zeros(1, np.float32)
    fn((7, 2), (128,), (counter, total))
    assert counter[0] == 7 * 2 * 128 and total[0] == 7 * 128


def test_launch_arguments_are_checked():
    fn = build(REVERSE.replace("SYNC", ""), "emu_reverse").get_function("reverse")
    x = np.zeros(8, np.float32)
    assert fn.signature == "ppi"
    with pytest.raises(TypeError, match=r"argument 2 must be np.int32"):
        fn((1,), (8,), (x, x, np.int64(8)))
    with pytest.raises(TypeError, match=r"3 arguments, got 2"):
        fn((1,), (8,), (x, x))
    with pytest.raises(E.KernelLaunchError, match=r"invalid block size"):
        fn((1,), (2048,), (x, x, i32(8)))


ASAN_SCRIPT = """
import numpy as np, textwrap
from engine import emulation as E
from engine import kernels as K
from tests.test_cuda_emu import INTRINSICS
mod = E.cpu_module_from_source(textwrap.dedent(INTRINSICS), "emu_intrinsics")
out, x = np.zeros(32, np.float32), np.ones(100, np.float32)
mod.get_function("overflow")((1,), (32,), (out, x, np.int32(100 + {extra})))
mod.get_function("smem_overflow")((1,), (31,), (out,), shared_mem={smem})
print("finished")
"""


def run_asan(extra: int, smem: int) -> subprocess.CompletedProcess:
    code = ASAN_SCRIPT.format(extra=extra, smem=smem)
    return subprocess.run(
        [sys.executable, "-c", code], env=K.asan_env(), cwd=K.REPO, capture_output=True, text=True
    )


@pytest.mark.slow
def test_asan_build_catches_out_of_bounds_global_and_shared_accesses():
    ok = run_asan(extra=0, smem=32 * 4)  # builds the ASan library the other two load
    assert ok.returncode == 0 and "finished" in ok.stdout, ok.stderr
    with ThreadPoolExecutor(2) as pool:  # one process per core
        global_run = pool.submit(run_asan, extra=1, smem=32 * 4)  # thread 31 reads x[100]
        shared_run = pool.submit(run_asan, extra=0, smem=31 * 4)  # thread 30 writes buf[31]
        global_oob, shared_oob = global_run.result(), shared_run.result()
    assert global_oob.returncode != 0 and "heap-buffer-overflow" in global_oob.stderr
    assert "READ of size 4" in global_oob.stderr
    assert shared_oob.returncode != 0 and "heap-buffer-overflow" in shared_oob.stderr
    assert "WRITE of size 4" in shared_oob.stderr
