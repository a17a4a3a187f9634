// fused_add_rms_norm.cu: residual += x (in place, rounded to its dtype), then
// out = rms_norm(residual) * (offset + weight). Rows split as in rms_norm.cu; residual and x
// are read once and residual written once (norm.cuh).
#include "norm.cuh"

// Grid: (cdiv(T, R),)  Block: (R * row_threads,), as rms_norm
template <typename T>
__device__ __forceinline__ void fused_add_rms_norm(T* __restrict__ out,           // (T, D)
                                                   T* __restrict__ residual,      // (T, D)
                                                   const T* __restrict__ x,       // (T, D)
                                                   const T* __restrict__ weight,  // (D,)
                                                   int rows, int dim, int row_threads,
                                                   float eps, float offset) {
  const int row = blockIdx.x * (blockDim.x / row_threads) + threadIdx.x / row_threads;
  const int lane = threadIdx.x % row_threads;
  const bool valid = row < rows;
  const size_t base = size_t(valid ? row : 0) * dim;
  with_vec_width<T>(vec_width<T>(dim, out, residual, x, weight), [&](auto width) {
    constexpr int W = decltype(width)::value;
    auto add = [&](int i) {  // residual[i] += x[i], rounded; the sum
      const Vec<T, W> r = load_vec<W>(residual + base + i * W), a = load_vec<W>(x + base + i * W);
      Vec<T, W> sum;
#pragma unroll
      for (int e = 0; e < W; ++e) sum.v[e] = from_float<T>(to_float(r.v[e]) + to_float(a.v[e]));
      store_vec<W>(residual + base + i * W, sum);  // re-read below only by this thread
      return sum;
    };
    auto again = [&](int i) { return load_vec<W>(residual + base + i * W); };
    normalize_row<T, W>(out + base, weight, dim, lane, row_threads, valid, eps, offset, add,
                        again);
  });
}

DTYPE_ENTRY_POINTS(fused_add_rms_norm, 9)
