// add_bias.cu: x (T, N) += bias (N,) in place, the sum in float32 rounded to T once (gpt-oss's
// o projection bias). Rows split as in rms_norm.cu; a thread strides over its row's elements.
#include "common.cuh"

// Grid: (cdiv(T, R),)  Block: (R * row_threads,), as rms_norm
template <typename T>
__device__ __forceinline__ void add_bias(T* __restrict__ x,                // (T, N)
                                         const float* __restrict__ bias,   // (N,)
                                         int rows, int width, int row_threads) {
  const int row = blockIdx.x * (blockDim.x / row_threads) + threadIdx.x / row_threads;
  if (row >= rows) return;
  T* r = x + size_t(row) * width;
  for (int i = threadIdx.x % row_threads; i < width; i += row_threads) {
    r[i] = from_float<T>(to_float(r[i]) + bias[i]);
  }
}

DTYPE_ENTRY_POINTS(add_bias, 5)
