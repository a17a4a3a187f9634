// paged_attention_reduce.cu: combine the partitions written by paged_attention_decode.cu.
// With partition p's max m_p, exponent sum l_p and normalised output o_p, and M = max m_p:
//   out = sum_p o_p * l_p * exp(m_p - M) / sum_p l_p * exp(m_p - M).
// Sequence b has ceil(span / partition_size) partitions (at least one), span its visible keys:
// context_lens[b], or min(context_lens[b], window) with a sliding window > 0 (as the decode).
// With sinks (H,) (gpt-oss), M also covers the head's sink s and the sum gains exp(s - M).
#include "common.cuh"

// Grid: (H, B)  Block: (any, e.g. 128)
template <typename T>
__device__ __forceinline__ void paged_attention_reduce(
    T* __restrict__ out,                   // (B, H, hd)
    const float* __restrict__ part_out,    // (B, H, P, hd)
    const float* __restrict__ part_max,    // (B, H, P)
    const float* __restrict__ part_sum,    // (B, H, P)
    const int* __restrict__ context_lens,  // (B,)
    int head_dim, int max_parts, int partition_size, int window,
    const float* __restrict__ sinks,       // (H,) sink logits (read when use_sinks)
    int use_sinks) {
  const int num_heads = gridDim.x;
  const size_t row = size_t(blockIdx.y) * num_heads + blockIdx.x;
  const int context = context_lens[blockIdx.y];
  const int span = window > 0 ? min(context, window) : context;
  const int parts = max(1, min(max_parts, (span + partition_size - 1) / partition_size));
  const float* m = part_max + row * max_parts;
  const float* l = part_sum + row * max_parts;
  float m_all = kNegLarge, total = 0.0f;
  for (int p = 0; p < parts; ++p) m_all = fmaxf(m_all, m[p]);
  if (use_sinks) m_all = fmaxf(m_all, sinks[blockIdx.x]);
  for (int p = 0; p < parts; ++p) total += l[p] * expf(m[p] - m_all);
  if (use_sinks) total += expf(sinks[blockIdx.x] - m_all);
  const float inv_total = total > 0.0f ? 1.0f / total : 0.0f;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float o = 0.0f;
    for (int p = 0; p < parts; ++p) {
      o += part_out[(row * max_parts + p) * head_dim + d] * l[p] * expf(m[p] - m_all);
    }
    out[row * head_dim + d] = from_float<T>(o * inv_total);
  }
}

DTYPE_ENTRY_POINTS(paged_attention_reduce, 11)
