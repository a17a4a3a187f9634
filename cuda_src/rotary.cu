// rotary.cu: rotary position embedding on Q and K in place, one token per block, in Hugging
// Face's rotate-half layout: element i pairs with i + hd/2,
//   x[i]      <- x[i] * cos - x[i + hd/2] * sin
//   x[i+hd/2] <- x[i + hd/2] * cos + x[i] * sin
// cos_sin[p] holds cos(p * f_j) for j < hd/2, then sin(p * f_j), with f_j = theta^(-2j/hd),
// computed once on the host in float64 (float32 angles lose ~1e-4 at positions in the 1000s).
// A position outside [0, max_positions) leaves its token unrotated (the wrapper rejects it).
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void rotate_heads(T* __restrict__ x,               // (n_heads, hd)
                                             const float* __restrict__ cos_sin,  // (hd,)
                                             int n_heads, int head_dim) {
  const int half = head_dim / 2;
  for (int e = threadIdx.x; e < n_heads * half; e += blockDim.x) {
    T* head = x + (e / half) * head_dim;
    const int i = e % half;
    const float c = cos_sin[i], s = cos_sin[half + i];
    const float a = to_float(head[i]), b = to_float(head[i + half]);
    head[i] = from_float<T>(a * c - b * s);
    head[i + half] = from_float<T>(b * c + a * s);
  }
}

// Grid: (T,)  Block: (any, e.g. 128)
template <typename T>
__device__ __forceinline__ void rotary(T* __restrict__ q,                  // (T, H, hd)
                                       T* __restrict__ k,                  // (T, Hkv, hd)
                                       const int* __restrict__ positions,  // (T,)
                                       const float* __restrict__ cos_sin,  // (P, hd)
                                       int num_heads, int num_kv_heads, int head_dim,
                                       int max_positions) {
  const int t = blockIdx.x, pos = positions[t];
  if (pos < 0 || pos >= max_positions) return;
  const float* table = cos_sin + size_t(pos) * head_dim;
  rotate_heads(q + size_t(t) * num_heads * head_dim, table, num_heads, head_dim);
  rotate_heads(k + size_t(t) * num_kv_heads * head_dim, table, num_kv_heads, head_dim);
}

DTYPE_ENTRY_POINTS(rotary, 8)
