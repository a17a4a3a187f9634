// moe_combine.cu: each token's experts summed back into its row. out[t] = sum over j of
// weights[t, j] * y[inverse[t * k + j]] in float32, j in order (y: the down products' rows in
// the experts' sorted order, float32), plus with flags & 1 gate[t] * shared[t] (Qwen2-MoE's
// shared expert), rounded to T once. Threads stride over D.
#include "common.cuh"

// Grid: (T,)  Block: (128,)
template <typename T>
__device__ __forceinline__ void moe_combine(T* __restrict__ out,                // (T, D)
                                            const float* __restrict__ y,        // (T*k, D)
                                            const float* __restrict__ weights,  // (T, k)
                                            const int* __restrict__ inverse,    // (T*k,)
                                            const float* __restrict__ gate,     // (T,)
                                            const T* __restrict__ shared,       // (T, D)
                                            int D, int k, int flags) {
  const int t = blockIdx.x;
  const float* w = weights + size_t(t) * k;
  const int* at = inverse + size_t(t) * k;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float s = 0.0f;
    for (int j = 0; j < k; ++j) s += w[j] * y[size_t(at[j]) * D + d];
    if (flags & 1) s += gate[t] * to_float(shared[size_t(t) * D + d]);
    out[size_t(t) * D + d] = from_float<T>(s);
  }
}

DTYPE_ENTRY_POINTS(moe_combine, 9)
