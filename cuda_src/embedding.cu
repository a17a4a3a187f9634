// embedding.cu: out[t] = table[token_ids[t] - vocab_start] * scale, rows split as in
// rms_norm.cu, in vectors of up to 16 bytes. An id outside [vocab_start, vocab_start + V)
// writes zeros: a tensor-parallel rank holds rows vocab_start.. of the vocabulary, and the
// ranks' outputs sum to the whole embedding. scale (Gemma's sqrt(hidden)) multiplies in float32 and rounds once; 1
// copies the row bit for bit.
#include "common.cuh"

// Grid: (cdiv(T, R),)  Block: (R * row_threads,), as rms_norm
template <typename T>
__device__ __forceinline__ void embedding(T* __restrict__ out,                // (T, D)
                                          const int* __restrict__ token_ids,  // (T,)
                                          const T* __restrict__ table,        // (V, D)
                                          int rows, int vocab, int dim, int row_threads,
                                          float scale, int vocab_start) {
  const int row = blockIdx.x * (blockDim.x / row_threads) + threadIdx.x / row_threads;
  const int lane = threadIdx.x % row_threads, group = row_threads < kWarpSize ? row_threads : kWarpSize;
  // the id read once per lane group (per warp of a longer row), then shared by a shuffle
  int id = lane % group == 0 && row < rows ? token_ids[row] : 0;
  id = __shfl_sync(kFullMask, id, 0, group) - vocab_start;
  if (row >= rows) return;
  const bool valid = id >= 0 && id < vocab;
  const T* src = table + size_t(valid ? id : 0) * dim;
  T* dst = out + size_t(row) * dim;
  with_vec_width<T>(vec_width<T>(dim, src, dst), [&](auto vec) {
    constexpr int W = decltype(vec)::value;
    Vec<T, W> zero;
#pragma unroll
    for (int e = 0; e < W; ++e) zero.v[e] = from_float<T>(0.0f);
    for (int i = lane; i < dim / W; i += row_threads) {
      Vec<T, W> r = valid ? load_vec<W>(src + i * W) : zero;
      if (scale != 1.0f) {  // the same for every thread
#pragma unroll
        for (int e = 0; e < W; ++e) r.v[e] = from_float<T>(to_float(r.v[e]) * scale);
      }
      store_vec<W>(dst + i * W, r);
    }
  });
}

DTYPE_ENTRY_POINTS(embedding, 9)
