// norm.cuh: one row's RMS normalisation, shared by rms_norm.cu and fused_add_rms_norm.cu.
// A row of `dim` elements is split among `row_threads` threads in vectors of W elements
// (common.cuh vec_width); each thread keeps its first kRowCache vectors in registers between
// the two passes, so a row that fits (dim <= row_threads * W * kRowCache) is read once. The
// scale is (offset + weight) in float32: offset 0 for Llama's norms, 1 for Gemma's (1 + w).
#pragma once

#include "common.cuh"

constexpr int kRowCache = 4;  // vectors per thread held between the sum and the scaling

template <typename T, int W>
__device__ __forceinline__ float sum_squares(const Vec<T, W>& a) {
  float s = 0.0f;
#pragma unroll
  for (int e = 0; e < W; ++e) s += to_float(a.v[e]) * to_float(a.v[e]);
  return s;
}

// out = a * inv_rms * (offset + weight), element by element, rounded once to T. Offset 0 leaves
// the weight as it is (-0.0 included).
template <typename T, int W>
__device__ __forceinline__ Vec<T, W> scaled(const Vec<T, W>& a, float inv_rms,
                                            const Vec<T, W>& weight, float offset) {
  Vec<T, W> r;
#pragma unroll
  for (int e = 0; e < W; ++e) {
    const float w = offset == 0.0f ? to_float(weight.v[e]) : offset + to_float(weight.v[e]);
    r.v[e] = from_float<T>(to_float(a.v[e]) * inv_rms * w);
  }
  return r;
}

// out_row[i] = rms_norm(row)[i] * (offset + weight[i]) for this thread's vectors i = lane, lane +
// row_threads, ...: first(i) loads vector i in the first pass (and may store, as fused_add's
// residual does), again(i) loads it anew in the second pass, for vectors past the cache.
// Threads of a row past the end (valid false) load nothing but join the reduction.
template <typename T, int W, typename First, typename Again>
__device__ __forceinline__ void normalize_row(T* __restrict__ out_row,
                                              const T* __restrict__ weight, int dim, int lane,
                                              int row_threads, bool valid, float eps,
                                              float offset, First first, Again again) {
  const int nvec = dim / W;
  Vec<T, W> cache[kRowCache] = {};
  float squares = 0.0f;
#pragma unroll
  for (int j = 0; j < kRowCache; ++j) {
    const int i = lane + j * row_threads;
    if (valid && i < nvec) cache[j] = first(i), squares += sum_squares(cache[j]);
  }
  for (int i = lane + kRowCache * row_threads; valid && i < nvec; i += row_threads) {
    squares += sum_squares(first(i));
  }
  const float inv_rms = rsqrtf(row_sum(squares, row_threads) / float(dim) + eps);
  if (!valid) return;
#pragma unroll
  for (int j = 0; j < kRowCache; ++j) {
    const int i = lane + j * row_threads;
    if (i < nvec) {
      store_vec<W>(out_row + i * W, scaled(cache[j], inv_rms, load_vec<W>(weight + i * W), offset));
    }
  }
  for (int i = lane + kRowCache * row_threads; i < nvec; i += row_threads) {
    store_vec<W>(out_row + i * W, scaled(again(i), inv_rms, load_vec<W>(weight + i * W), offset));
  }
}
