// paged_attention_decode.cu: one query token per sequence attends to its whole cached context
// (it sits at position context_lens[b] - 1, so no causal mask is needed). Grouped-query
// heads: query head h reads KV head h / (H / Hkv). The context is split into partitions of
// partition_size tokens, one block each (flash-decoding): with one partition (gridDim.z == 1)
// the block writes the output; otherwise it writes its normalised partial output, max score
// and exponent sum, and paged_attention_reduce.cu combines the partitions.
#include "attention.cuh"

// Grid: (H, B, P)  Block: (128,)
template <typename T>
__device__ __forceinline__ void paged_attention_decode(
    T* __restrict__ out,                  // (B, H, hd)
    float* __restrict__ part_out,         // (B, H, P, hd) partial outputs, when P > 1
    float* __restrict__ part_max,         // (B, H, P) max score of each partition
    float* __restrict__ part_sum,         // (B, H, P) sum of exp(score - max)
    const T* __restrict__ q,              // (B, H, hd)
    const T* __restrict__ k_cache,        // (N, bs, Hkv, hd)
    const T* __restrict__ v_cache,        // (N, bs, Hkv, hd)
    const int* __restrict__ block_tables, // (B, max_blocks)
    const int* __restrict__ context_lens, // (B,)
    int num_kv_heads, int head_dim, int block_size, int max_blocks, float scale,
    int partition_size) {
  __shared__ float q_scaled[kMaxHeadDim];
  __shared__ float probs[kAttnWarps][kWarpSize];
  __shared__ float warp_m[kAttnWarps], warp_l[kAttnWarps];  // each warp's max and sum
  __shared__ float warp_acc[kAttnWarps][kMaxHeadDim];
  const int h = blockIdx.x, b = blockIdx.y, part = blockIdx.z, num_parts = gridDim.z;
  const int num_heads = gridDim.x, kv_head = h / (num_heads / num_kv_heads);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int context = context_lens[b], start = part * partition_size;
  if (part > 0 && start >= context) return;  // the whole block: past this sequence's end
  const int end = min(start + partition_size, context);
  const size_t row = size_t(b) * num_heads + h;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    q_scaled[d] = to_float(q[row * head_dim + d]) * scale;
  }
  __syncthreads();

  SoftmaxState st;
  softmax_init(st);
  const int* table = block_tables + size_t(b) * max_blocks;
  for (int first = start + warp * kWarpSize; first < end; first += kAttnThreads) {
    attend_chunk(st, q_scaled, probs[warp], k_cache, v_cache, table, block_size, num_kv_heads,
                 kv_head, head_dim, first, min(kWarpSize, end - first));
  }
  const float l = warp_sum(st.l);
  if (lane == 0) warp_m[warp] = st.m, warp_l[warp] = l;
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i) {
    const int d = lane + i * kWarpSize;
    if (d < head_dim) warp_acc[warp][d] = st.acc[i];
  }
  __syncthreads();

  float m = kNegLarge, total = 0.0f;
  for (int w = 0; w < kAttnWarps; ++w) m = fmaxf(m, warp_m[w]);
  for (int w = 0; w < kAttnWarps; ++w) total += warp_l[w] * expf(warp_m[w] - m);
  const float inv_total = total > 0.0f ? 1.0f / total : 0.0f;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float o = 0.0f;
    for (int w = 0; w < kAttnWarps; ++w) o += warp_acc[w][d] * expf(warp_m[w] - m);
    if (num_parts == 1) {
      out[row * head_dim + d] = from_float<T>(o * inv_total);
    } else {
      part_out[(row * num_parts + part) * head_dim + d] = o * inv_total;
    }
  }
  if (num_parts > 1 && threadIdx.x == 0) {
    part_max[row * num_parts + part] = m;
    part_sum[row * num_parts + part] = total;
  }
}

DTYPE_ENTRY_POINTS(paged_attention_decode, 15)
