// sample.cu: draw one token per request from its logits, on the device, without sorting.
// For row b with temperature t > 0 (t <= 0 means greedy), scores z = logits / t, and
//   top-k  (0 < k < V): keep z >= the k-th largest z;
//   top-p  (p < 1):     of those, keep the smallest top set whose softmax mass reaches p
//                       (the largest threshold whose kept mass is >= p * total);
//   min-p  (m > 0):     keep exp(z - max z) >= m;
// the largest z is always kept. Thresholds are found by binary search over the float's
// order-preserving 32-bit key (32 block reductions each). The token is the Gumbel-max over
// the kept set, argmax z_i - log(-log(u_i)), with u_i from Philox keyed by the request's seed
// and counted by (i, step): a request's draw depends on (seed, step), never on the batch.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ float score(const T* __restrict__ row, int i, float temperature) {
  return to_float(row[i]) / temperature;
}

// Largest key t with count(key(z) >= t) >= k: the key of the k-th largest score.
template <typename T>
__device__ __forceinline__ unsigned top_k_key(const T* __restrict__ row, int vocab, float temp,
                                              int k) {
  unsigned lo = 0u, hi = 0xFFFFFFFFu;
  while (lo < hi) {
    const unsigned mid = lo + (hi - lo) / 2u + 1u;
    float n = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
      n += float_key(score(row, i, temp)) >= mid ? 1.0f : 0.0f;
    }
    if (block_sum(n) >= float(k)) lo = mid; else hi = mid - 1u;
  }
  return lo;
}

// Softmax mass (unnormalised, relative to z_max) of the scores with key >= threshold.
template <typename T>
__device__ __forceinline__ float mass_at_least(const T* __restrict__ row, int vocab, float temp,
                                               float z_max, unsigned threshold) {
  float s = 0.0f;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float z = score(row, i, temp);
    if (float_key(z) >= threshold) s += expf(z - z_max);
  }
  return block_sum(s);
}

// Largest key t >= floor whose mass reaches p of the mass above floor.
template <typename T>
__device__ __forceinline__ unsigned top_p_key(const T* __restrict__ row, int vocab, float temp,
                                              float z_max, unsigned floor, float p) {
  const float target = p * mass_at_least(row, vocab, temp, z_max, floor);
  unsigned lo = floor, hi = 0xFFFFFFFFu;
  while (lo < hi) {
    const unsigned mid = lo + (hi - lo) / 2u + 1u;
    if (mass_at_least(row, vocab, temp, z_max, mid) >= target) lo = mid; else hi = mid - 1u;
  }
  return lo;
}

// Grid: (B,)  Block: (multiple of 32, <= 1024)
template <typename T>
__device__ __forceinline__ void sample(int* __restrict__ out_ids,                  // (B,)
                                       const T* __restrict__ logits,               // (B, V)
                                       const float* __restrict__ temperature,      // (B,)
                                       const int* __restrict__ top_k,              // (B,)
                                       const float* __restrict__ top_p,            // (B,)
                                       const float* __restrict__ min_p,            // (B,)
                                       const unsigned long long* __restrict__ seeds,  // (B,)
                                       const int* __restrict__ steps,              // (B,)
                                       int vocab) {
  const int b = blockIdx.x;
  const T* row = logits + size_t(b) * vocab;
  const float temp = temperature[b];
  float best = kNegLarge;
  int index = 0x7FFFFFFF;
  if (temp <= 0.0f) {  // greedy
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) argmax_merge(best, index, to_float(row[i]), i);
    const int winner = block_argmax(best, index);
    if (threadIdx.x == 0) out_ids[b] = winner;
    return;
  }
  float z_max = kNegLarge;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) z_max = fmaxf(z_max, score(row, i, temp));
  z_max = block_max(z_max);
  const int k = top_k[b];
  const float p = top_p[b], m = min_p[b];
  unsigned threshold = (k > 0 && k < vocab) ? top_k_key(row, vocab, temp, k) : 0u;
  if (p < 1.0f) threshold = top_p_key(row, vocab, temp, z_max, threshold, p);
  threshold = min(threshold, float_key(z_max));
  const unsigned long long seed = seeds[b];
  const unsigned step = unsigned(steps[b]);
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float z = score(row, i, temp);
    const bool kept = float_key(z) >= threshold && (expf(z - z_max) >= m || z == z_max);
    if (!kept) continue;
    const float gumbel = -logf(-logf(philox_uniform(seed, step, unsigned(i))));
    argmax_merge(best, index, z + gumbel, i);
  }
  const int winner = block_argmax(best, index);
  if (threadIdx.x == 0) out_ids[b] = winner;
}

DTYPE_ENTRY_POINTS(sample, 9)
