// silu_and_mul.cu: out = silu(gate) * up, where gate_up = [gate | up] along the last axis.
// Rows split as in rms_norm.cu, in vectors of up to 16 bytes.
#include "common.cuh"

// Grid: (cdiv(T, R),)  Block: (R * row_threads,), as rms_norm
template <typename T>
__device__ __forceinline__ void silu_and_mul(T* __restrict__ out,            // (T, F)
                                             const T* __restrict__ gate_up,  // (T, 2F)
                                             int rows, int width, int row_threads) {
  const int row = blockIdx.x * (blockDim.x / row_threads) + threadIdx.x / row_threads;
  if (row >= rows) return;
  const T* gate = gate_up + size_t(row) * 2 * width;
  const T* up = gate + width;
  T* dst = out + size_t(row) * width;
  with_vec_width<T>(vec_width<T>(width, gate, up, dst), [&](auto vec) {
    constexpr int W = decltype(vec)::value;
    for (int i = threadIdx.x % row_threads; i < width / W; i += row_threads) {
      const Vec<T, W> g = load_vec<W>(gate + i * W), u = load_vec<W>(up + i * W);
      Vec<T, W> r;
#pragma unroll
      for (int e = 0; e < W; ++e) {
        const float a = to_float(g.v[e]);
        r.v[e] = from_float<T>(a / (1.0f + expf(-a)) * to_float(u.v[e]));
      }
      store_vec<W>(dst + i * W, r);
    }
  });
}

DTYPE_ENTRY_POINTS(silu_and_mul, 5)
