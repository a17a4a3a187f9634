// silu_and_mul.cu: out = silu(gate) * up, where gate_up = [gate | up] along the last axis.
#include "common.cuh"

// Grid: (T,)  Block: (any, e.g. 256)
template <typename T>
__device__ __forceinline__ void silu_and_mul(T* __restrict__ out,            // (T, F)
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

DTYPE_ENTRY_POINTS(silu_and_mul, 3)
