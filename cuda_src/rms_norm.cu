// rms_norm.cu: out = x / sqrt(mean(x^2) + eps) * weight, one row per block.
#include "common.cuh"

// Grid: (T,)  Block: (multiple of 32, <= 1024)
template <typename T>
__device__ __forceinline__ void rms_norm(T* __restrict__ out,           // (T, D)
                                         const T* __restrict__ x,       // (T, D)
                                         const T* __restrict__ weight,  // (D,)
                                         int dim, float eps) {
  const size_t row = size_t(blockIdx.x) * dim;
  float squares = 0.0f;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    const float v = to_float(x[row + i]);
    squares += v * v;
  }
  const float inv_rms = rsqrtf(block_sum(squares) / float(dim) + eps);
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    out[row + i] = from_float<T>(to_float(x[row + i]) * inv_rms * to_float(weight[i]));
  }
}

DTYPE_ENTRY_POINTS(rms_norm, 5)
