// common.cuh: device helpers shared by every kernel in cuda_src/.
// Built by NVRTC/nvcc for the GPU and by g++ with cpu/cuda_emu.h for the CPU. No <math.h>:
// NVRTC has none, so no INFINITY either; kNegLarge stands in for minus infinity.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#ifndef DYNAMIC_SHARED
// Dynamic shared memory sized by the launch's shared_mem bytes, viewed as T[].
#define DYNAMIC_SHARED(T, name)                                  \
  extern __shared__ __align__(16) unsigned char name##_bytes[]; \
  T* name = reinterpret_cast<T*>(name##_bytes)
#endif

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xFFFFFFFFu;
constexpr float kNegLarge = -3.0e38f;  // below every finite logit; exp(kNegLarge - x) == 0

// ---- storage <-> float: 16-bit types are storage only, arithmetic is float32 ----------------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}

// ---- reductions (blockDim.x a multiple of 32, 1-D blocks) ------------------------------------
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = kWarpSize / 2; m > 0; m /= 2) v += __shfl_xor_sync(kFullMask, v, m);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int m = kWarpSize / 2; m > 0; m /= 2) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, m));
  return v;
}

// Sum over the block, returned to every thread. Every thread of the block must call it.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[kWarpSize];  // one per warp
  __shared__ float total;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  v = warp_sum(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float s = lane < int(blockDim.x / kWarpSize) ? partial[lane] : 0.0f;
    s = warp_sum(s);
    if (lane == 0) total = s;
  }
  __syncthreads();
  return total;  // next call's writes come after its first barrier, when all have read this
}

// Max over the block, returned to every thread. Every thread of the block must call it.
__device__ __forceinline__ float block_max(float v) {
  __shared__ float partial[kWarpSize];
  __shared__ float total;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  v = warp_max(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float s = lane < int(blockDim.x / kWarpSize) ? partial[lane] : kNegLarge;
    s = warp_max(s);
    if (lane == 0) total = s;
  }
  __syncthreads();
  return total;
}

// Sum over a row's threads, returned to each of them: a group of `row_threads` lanes (a power
// of two <= 32, aligned within its warp) or, when row_threads == blockDim.x, the whole block.
// Every thread of the warp (block) must call it, threads of rows past the end included.
__device__ __forceinline__ float row_sum(float v, int row_threads) {
  if (row_threads > kWarpSize) return block_sum(v);
  for (int m = row_threads / 2; m > 0; m /= 2) v += __shfl_xor_sync(kFullMask, v, m);
  return v;
}

// The larger (value, index) pair; equal values go to the lower index (numpy's argmax).
__device__ __forceinline__ void argmax_merge(float& v, int& i, float ov, int oi) {
  if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
}

// Argmax over the block of per-thread (value, index) candidates, returned to every thread.
__device__ __forceinline__ int block_argmax(float v, int i) {
  __shared__ float best_value[kWarpSize];
  __shared__ int best_index[kWarpSize];
  __shared__ int winner;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
#pragma unroll
  for (int m = kWarpSize / 2; m > 0; m /= 2) {
    argmax_merge(v, i, __shfl_xor_sync(kFullMask, v, m), __shfl_xor_sync(kFullMask, i, m));
  }
  if (lane == 0) best_value[warp] = v, best_index[warp] = i;
  __syncthreads();
  if (warp == 0) {
    const bool has = lane < int(blockDim.x / kWarpSize);
    v = has ? best_value[lane] : kNegLarge;
    i = has ? best_index[lane] : 0x7FFFFFFF;
#pragma unroll
    for (int m = kWarpSize / 2; m > 0; m /= 2) {
      argmax_merge(v, i, __shfl_xor_sync(kFullMask, v, m), __shfl_xor_sync(kFullMask, i, m));
    }
    if (lane == 0) winner = i;
  }
  __syncthreads();
  return winner;
}

// ---- vector access: W elements in one load or store of W * sizeof(T) <= 16 bytes ------------
#if defined(CUDA_EMU)  // may_alias: g++ -O2 would otherwise assume T and Vec never alias
#define VEC_ATTRIBUTES(bytes) __attribute__((may_alias, aligned(bytes)))
#else
#define VEC_ATTRIBUTES(bytes) __align__(bytes)
#endif

template <typename T, int W>
struct VEC_ATTRIBUTES(sizeof(T) * W) Vec {
  T v[W];
};

template <int W>
struct VecWidth {
  static constexpr int value = W;
};

template <int W, typename T>
__device__ __forceinline__ Vec<T, W> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, W>*>(p);
}

template <int W, typename T>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, W>& v) {
  *reinterpret_cast<Vec<T, W>*>(p) = v;
}

// The widest W (a power of two, W * sizeof(T) <= 16) that divides n, with every pointer
// aligned to W * sizeof(T): rows of n elements then split into whole, aligned vectors.
template <typename T, typename... P>
__device__ __forceinline__ int vec_width(int n, const P*... ptrs) {
  const size_t address_bits = (size_t(0) | ... | reinterpret_cast<size_t>(ptrs));
  int w = 16 / int(sizeof(T));
  while (w > 1 && (n % w != 0 || address_bits % (size_t(w) * sizeof(T)) != 0)) w /= 2;
  return w;
}

// f(VecWidth<w>()) for a w from vec_width<T>: one instantiation of f per possible width.
template <typename T, typename F>
__device__ __forceinline__ void with_vec_width(int w, F&& f) {
  if constexpr (sizeof(T) <= 2) {
    if (w == 8) return f(VecWidth<8>());
  }
  if (w == 4) return f(VecWidth<4>());
  if (w == 2) return f(VecWidth<2>());
  f(VecWidth<1>());
}

// ---- counter-based random numbers: Philox4x32-10, keyed by (seed), counter (i, step) ---------
// Mirrored bit for bit by engine/backends/cuda_cpu_ops.py (philox_uniform).
__device__ __forceinline__ unsigned philox_bits(unsigned long long seed, unsigned step,
                                                unsigned i) {
  unsigned c0 = i, c1 = step, c2 = 0u, c3 = 0u;
  unsigned k0 = unsigned(seed), k1 = unsigned(seed >> 32);
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const unsigned hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    const unsigned hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c0;
}

// Uniform in (0, 1), never 0 or 1: 23 random bits plus one half.
__device__ __forceinline__ float philox_uniform(unsigned long long seed, unsigned step,
                                                unsigned i) {
  return (float(philox_bits(seed, step, i) >> 9) + 0.5f) * (1.0f / 8388608.0f);
}

// Order-preserving map of a float's bits to unsigned: a < b  <=>  float_key(a) < float_key(b).
__device__ __forceinline__ unsigned float_key(float x) {
  const unsigned u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_float(unsigned k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

// ---- entry points: one template kernel, three extern "C" kernels ----------------------------
// A kernel is a __device__ template over its storage type T (float, __half or __nv_bfloat16)
// with a // Grid: line over it. DTYPE_ENTRY_POINTS(name, n) defines the entry points that the
// loaders look up, name_f32, name_f16 and name_bf16: each takes the n parameters of name<T>,
// pointers __restrict__, and calls name<T>; a wrong n does not compile.
// engine/kernels/build.py (entry_points) lists them by finding this macro; docs/kernels.md
// shows one expanded.
#define DTYPE_ENTRY_POINTS(name, n)       \
  DTYPE_ENTRY_POINT(name, n, float, f32)   \
  DTYPE_ENTRY_POINT(name, n, __half, f16)  \
  DTYPE_ENTRY_POINT(name, n, __nv_bfloat16, bf16)

#define DTYPE_ENTRY_POINT(name, n, T, suffix)                                                 \
  extern "C" __global__ void name##_##suffix(ENTRY_LIST_##n(ENTRY_PARAM, decltype(name<T>))) { \
    name<T>(ENTRY_LIST_##n(ENTRY_ARG, _));                                                   \
  }

// Parameter i of the function type F; a pointer comes back __restrict__ (top-level qualifiers
// are not part of a function's type, so the template's own __restrict__ does not show in F).
template <int i, typename F>
struct ParamOf;
template <typename A0, typename... A>
struct ParamOf<0, void(A0, A...)> {
  using type = A0;
};
template <int i, typename A0, typename... A>
struct ParamOf<i, void(A0, A...)> : ParamOf<i - 1, void(A...)> {};

template <typename P>
struct Restrict {
  using type = P;
};
template <typename P>
struct Restrict<P*> {
  using type = P* __restrict__;
};

template <int i, typename F>
using entry_param_t = typename Restrict<typename ParamOf<i, F>::type>::type;

// ENTRY_LIST_n(X, F) is X(0, F), ..., X(n - 1, F): the parameters a0 .. a{n-1}, or their names
// (n <= 20).
#define ENTRY_PARAM(i, F) entry_param_t<i, F> a##i
#define ENTRY_ARG(i, F) a##i
#define ENTRY_LIST_1(X, F) X(0, F)
#define ENTRY_LIST_2(X, F) ENTRY_LIST_1(X, F), X(1, F)
#define ENTRY_LIST_3(X, F) ENTRY_LIST_2(X, F), X(2, F)
#define ENTRY_LIST_4(X, F) ENTRY_LIST_3(X, F), X(3, F)
#define ENTRY_LIST_5(X, F) ENTRY_LIST_4(X, F), X(4, F)
#define ENTRY_LIST_6(X, F) ENTRY_LIST_5(X, F), X(5, F)
#define ENTRY_LIST_7(X, F) ENTRY_LIST_6(X, F), X(6, F)
#define ENTRY_LIST_8(X, F) ENTRY_LIST_7(X, F), X(7, F)
#define ENTRY_LIST_9(X, F) ENTRY_LIST_8(X, F), X(8, F)
#define ENTRY_LIST_10(X, F) ENTRY_LIST_9(X, F), X(9, F)
#define ENTRY_LIST_11(X, F) ENTRY_LIST_10(X, F), X(10, F)
#define ENTRY_LIST_12(X, F) ENTRY_LIST_11(X, F), X(11, F)
#define ENTRY_LIST_13(X, F) ENTRY_LIST_12(X, F), X(12, F)
#define ENTRY_LIST_14(X, F) ENTRY_LIST_13(X, F), X(13, F)
#define ENTRY_LIST_15(X, F) ENTRY_LIST_14(X, F), X(14, F)
#define ENTRY_LIST_16(X, F) ENTRY_LIST_15(X, F), X(15, F)
#define ENTRY_LIST_17(X, F) ENTRY_LIST_16(X, F), X(16, F)
#define ENTRY_LIST_18(X, F) ENTRY_LIST_17(X, F), X(17, F)
#define ENTRY_LIST_19(X, F) ENTRY_LIST_18(X, F), X(18, F)
#define ENTRY_LIST_20(X, F) ENTRY_LIST_19(X, F), X(19, F)
