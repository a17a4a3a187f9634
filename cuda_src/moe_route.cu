// moe_route.cu: a mixture of experts' routing, one token per block. The router's logits in
// float32, logit[e] = h . router[e] (+ bias[e] with flags & 1), h widened from T and the router
// float32 (never quantized); softmax over the E experts; the top k probabilities, the largest
// first, equal ones to the lower expert index (torch.topk's order); with flags & 4 renormalized
// to sum to one. With flags & 2, router row E is a shared expert's gate (Qwen2-MoE) and
// gate[t] = sigmoid(h . router[E]). One warp per router row (lanes stride over D, then a warp
// sum); the softmax and the k picks over the block (block_max, block_sum, block_argmax).
#include "common.cuh"

constexpr int kRouteFlagBias = 1, kRouteFlagGate = 2, kRouteFlagRenorm = 4;
constexpr int kMaxTopK = 32;  // engine/kernels/moe_launch.py MOE_MAX_TOP_K

// Grid: (T,)  Block: (256,)  Shared: (E + 1) floats
template <typename T>
__device__ __forceinline__ void moe_route(int* __restrict__ ids,               // (T, k)
                                          float* __restrict__ weights,         // (T, k)
                                          float* __restrict__ gate,            // (T,)
                                          const T* __restrict__ h,             // (T, D)
                                          const float* __restrict__ router,    // (E (+1), D)
                                          const float* __restrict__ bias,      // (E,)
                                          int D, int E, int k, int flags) {
  DYNAMIC_SHARED(float, p);  // (E + 1,) logits, then probabilities; -1 once picked
  __shared__ float picked[kMaxTopK];
  __shared__ int picked_id[kMaxTopK];
  const int t = blockIdx.x, lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int warps = blockDim.x / kWarpSize, rows = E + ((flags & kRouteFlagGate) ? 1 : 0);
  const T* x = h + size_t(t) * D;
  for (int e = warp; e < rows; e += warps) {
    const float* r = router + size_t(e) * D;
    float s = 0.0f;
    for (int d = lane; d < D; d += kWarpSize) s += to_float(x[d]) * r[d];
    s = warp_sum(s);
    if (lane == 0) p[e] = (e < E && (flags & kRouteFlagBias)) ? s + bias[e] : s;
  }
  __syncthreads();
  float m = kNegLarge;
  for (int e = threadIdx.x; e < E; e += blockDim.x) m = fmaxf(m, p[e]);
  m = block_max(m);
  float sum = 0.0f;
  for (int e = threadIdx.x; e < E; e += blockDim.x) sum += expf(p[e] - m);
  sum = block_sum(sum);
  for (int e = threadIdx.x; e < E; e += blockDim.x) p[e] = expf(p[e] - m) / sum;
  __syncthreads();
  for (int j = 0; j < k; ++j) {
    float v = -2.0f;  // below every probability and every picked one's -1
    int i = 0x7FFFFFFF;
    for (int e = threadIdx.x; e < E; e += blockDim.x) argmax_merge(v, i, p[e], e);
    const int w = block_argmax(v, i);
    if (threadIdx.x == 0) picked[j] = p[w], picked_id[j] = w, p[w] = -1.0f;
    __syncthreads();
  }
  if (threadIdx.x != 0) return;
  float total = 0.0f;
  for (int j = 0; j < k; ++j) total += picked[j];
  for (int j = 0; j < k; ++j) {
    ids[size_t(t) * k + j] = picked_id[j];
    weights[size_t(t) * k + j] = (flags & kRouteFlagRenorm) ? picked[j] / total : picked[j];
  }
  if (flags & kRouteFlagGate) gate[t] = 1.0f / (1.0f + expf(-p[E]));
}

DTYPE_ENTRY_POINTS(moe_route, 10)
