// rms_norm.cu: out = x / sqrt(mean(x^2) + eps) * weight, one row per block.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void rms_norm_row(T* __restrict__ out,           // (T, D)
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

// Grid: (T,)  Block: (multiple of 32, <= 1024)
extern "C" __global__ void rms_norm_f32(float* __restrict__ out, const float* __restrict__ x,
                                        const float* __restrict__ weight, int dim, float eps) {
  rms_norm_row(out, x, weight, dim, eps);
}

// Grid: (T,)  Block: (multiple of 32, <= 1024)
extern "C" __global__ void rms_norm_f16(__half* __restrict__ out, const __half* __restrict__ x,
                                        const __half* __restrict__ weight, int dim, float eps) {
  rms_norm_row(out, x, weight, dim, eps);
}

// Grid: (T,)  Block: (multiple of 32, <= 1024)
extern "C" __global__ void rms_norm_bf16(__nv_bfloat16* __restrict__ out,
                                         const __nv_bfloat16* __restrict__ x,
                                         const __nv_bfloat16* __restrict__ weight, int dim,
                                         float eps) {
  rms_norm_row(out, x, weight, dim, eps);
}
