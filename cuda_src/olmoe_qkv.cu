// olmoe_qkv.cu: OLMoE's changes to a token's q | k | v row, in place, before the rotation: with
// flags & 1 the q part RMS-normed as a whole (not per head), x * rsqrt(mean(x^2) + eps) *
// q_norm, and the k part with k_norm; with flags & 2 every value clamped to +-clip (clip_qkv).
// One block per row; each sum of squares a block_sum; float32, each element rounded once.
#include "common.cuh"

// Grid: (T,)  Block: (256,)
template <typename T>
__device__ __forceinline__ void olmoe_qkv(T* __restrict__ qkv,             // (T, q + 2 kv)
                                          const T* __restrict__ q_norm,    // (q,)
                                          const T* __restrict__ k_norm,    // (kv,)
                                          int q_dim, int kv_dim, float eps, float clip,
                                          int flags) {
  T* row = qkv + size_t(blockIdx.x) * (q_dim + 2 * kv_dim);
  float sq = 0.0f, sk = 0.0f;
  if (flags & 1) {
    for (int i = threadIdx.x; i < q_dim + kv_dim; i += blockDim.x) {
      const float x = to_float(row[i]);
      (i < q_dim ? sq : sk) += x * x;
    }
    sq = block_sum(sq);
    sk = block_sum(sk);
  }
  const float rq = rsqrtf(sq / float(q_dim) + eps), rk = rsqrtf(sk / float(kv_dim) + eps);
  for (int i = threadIdx.x; i < q_dim + 2 * kv_dim; i += blockDim.x) {
    float x = to_float(row[i]);
    if ((flags & 1) && i < q_dim) x = x * rq * to_float(q_norm[i]);
    if ((flags & 1) && i >= q_dim && i < q_dim + kv_dim) x = x * rk * to_float(k_norm[i - q_dim]);
    if (flags & 2) x = fminf(fmaxf(x, -clip), clip);
    row[i] = from_float<T>(x);
  }
}

DTYPE_ENTRY_POINTS(olmoe_qkv, 8)
