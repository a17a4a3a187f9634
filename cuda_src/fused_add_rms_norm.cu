// fused_add_rms_norm.cu: residual += x (in place, rounded to its dtype), then
// out = rms_norm(residual) * weight. One row per block.
#include "common.cuh"

// Grid: (T,)  Block: (multiple of 32, <= 1024)
template <typename T>
__device__ __forceinline__ void fused_add_rms_norm(T* __restrict__ out,         // (T, D)
                                                   T* __restrict__ residual,    // (T, D)
                                                   const T* __restrict__ x,     // (T, D)
                                                   const T* __restrict__ weight,  // (D,)
                                                   int dim, float eps) {
  const size_t row = size_t(blockIdx.x) * dim;
  float squares = 0.0f;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    const T sum = from_float<T>(to_float(residual[row + i]) + to_float(x[row + i]));
    residual[row + i] = sum;  // each thread re-reads only its own elements below
    const float v = to_float(sum);
    squares += v * v;
  }
  const float inv_rms = rsqrtf(block_sum(squares) / float(dim) + eps);
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    out[row + i] = from_float<T>(to_float(residual[row + i]) * inv_rms * to_float(weight[i]));
  }
}

DTYPE_ENTRY_POINTS(fused_add_rms_norm, 6)
