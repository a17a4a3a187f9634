// prefill_attention.cu: causal attention for variable-length runs of query tokens over the
// paged cache (their own K and V already written). Sequence b's queries are rows
// query_start_loc[b] .. query_start_loc[b+1]-1, the LAST q_len of its context_lens[b] tokens,
// so the first context_lens[b] - q_len keys may come from earlier steps (chunked prefill,
// prefix caching). Query row r at position p sees keys 0..p. Each warp serves one query row
// for one head; a block holds 4 consecutive rows, which may belong to different sequences.
#include "attention.cuh"

// The sequence whose query rows contain `row`: the last b with query_start_loc[b] <= row.
__device__ __forceinline__ int sequence_of(const int* __restrict__ query_start_loc,
                                          int num_seqs, int row) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (query_start_loc[mid] <= row) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Grid: (H, ceil(T / 4))  Block: (128,)
template <typename T>
__device__ __forceinline__ void prefill_attention(
    T* __restrict__ out,                      // (T, H, hd)
    const T* __restrict__ q,                  // (T, H, hd)
    const T* __restrict__ k_cache,            // (N, bs, Hkv, hd)
    const T* __restrict__ v_cache,            // (N, bs, Hkv, hd)
    const int* __restrict__ block_tables,     // (B, max_blocks)
    const int* __restrict__ query_start_loc,  // (B + 1,)
    const int* __restrict__ context_lens,     // (B,)
    int num_seqs, int num_tokens, int num_kv_heads, int head_dim, int block_size,
    int max_blocks, float scale) {
  __shared__ float q_scaled[kAttnWarps][kMaxHeadDim];
  __shared__ float probs[kAttnWarps][kWarpSize];
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int h = blockIdx.x, num_heads = gridDim.x, kv_head = h / (num_heads / num_kv_heads);
  const int row = blockIdx.y * kAttnWarps + warp;
  if (row >= num_tokens) return;  // the whole warp; this kernel has no block-wide barrier
  const int b = sequence_of(query_start_loc, num_seqs, row);
  const int q_len = query_start_loc[b + 1] - query_start_loc[b];
  const int pos = context_lens[b] - q_len + (row - query_start_loc[b]);
  const size_t q_row = (size_t(row) * num_heads + h) * head_dim;
  for (int d = lane; d < head_dim; d += kWarpSize) {
    q_scaled[warp][d] = to_float(q[q_row + d]) * scale;
  }
  __syncwarp();

  SoftmaxState st;
  softmax_init(st);
  const int* table = block_tables + size_t(b) * max_blocks;
  for (int first = 0; first <= pos; first += kWarpSize) {
    attend_chunk(st, q_scaled[warp], probs[warp], k_cache, v_cache, table, block_size,
                 num_kv_heads, kv_head, head_dim, first, min(kWarpSize, pos + 1 - first));
  }
  const float total = warp_sum(st.l);
  const float inv_total = total > 0.0f ? 1.0f / total : 0.0f;
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i) {
    const int d = lane + i * kWarpSize;
    if (d < head_dim) out[q_row + d] = from_float<T>(st.acc[i] * inv_total);
  }
}

DTYPE_ENTRY_POINTS(prefill_attention, 14)
