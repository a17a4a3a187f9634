// silu_and_mul.cu: out = silu(gate) * up, where gate_up = [gate | up] along the last axis.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void silu_and_mul_row(T* __restrict__ out,            // (T, F)
                                                 const T* __restrict__ gate_up,  // (T, 2F)
                                                 int width) {
  const T* gate = gate_up + size_t(blockIdx.x) * 2 * width;
  const T* up = gate + width;
  T* dst = out + size_t(blockIdx.x) * width;
  for (int i = threadIdx.x; i < width; i += blockDim.x) {
    const float g = to_float(gate[i]);
    dst[i] = from_float<T>(g / (1.0f + expf(-g)) * to_float(up[i]));
  }
}

// Grid: (T,)  Block: (any, e.g. 256)
extern "C" __global__ void silu_and_mul_f32(float* __restrict__ out,
                                            const float* __restrict__ gate_up, int width) {
  silu_and_mul_row(out, gate_up, width);
}

// Grid: (T,)  Block: (any, e.g. 256)
extern "C" __global__ void silu_and_mul_f16(__half* __restrict__ out,
                                            const __half* __restrict__ gate_up, int width) {
  silu_and_mul_row(out, gate_up, width);
}

// Grid: (T,)  Block: (any, e.g. 256)
extern "C" __global__ void silu_and_mul_bf16(__nv_bfloat16* __restrict__ out,
                                             const __nv_bfloat16* __restrict__ gate_up,
                                             int width) {
  silu_and_mul_row(out, gate_up, width);
}
