// attention.cuh: one warp's online softmax over paged keys, shared by the decode and prefill
// attention kernels. A warp takes keys 32 at a time: lane j scores key first + j against the
// query (kept scaled in shared memory), the warp agrees on the running max, and each lane
// accumulates its slice of the output (dims lane, lane + 32, ...) from the 32 probabilities.
// All arithmetic is float32; K and V are read through the sequence's block table.
#pragma once

#include "common.cuh"

constexpr int kMaxHeadDim = 256;
constexpr int kDimsPerLane = kMaxHeadDim / kWarpSize;
constexpr int kAttnWarps = 4;  // attention blocks are 128 threads
constexpr int kAttnThreads = kAttnWarps * kWarpSize;

// Running state of one warp: max score m (all lanes agree), this lane's share of the
// exponent sum l, and this lane's slice of sum_j exp(s_j - m) * v_j.
struct SoftmaxState {
  float m;
  float l;
  float acc[kDimsPerLane];
};

__device__ __forceinline__ void softmax_init(SoftmaxState& st) {
  st.m = kNegLarge;
  st.l = 0.0f;
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i) st.acc[i] = 0.0f;
}

// Flat offset of token t's (kv_head) row in a (N, bs, Hkv, hd) cache.
__device__ __forceinline__ size_t kv_offset(const int* __restrict__ block_table, int t,
                                            int block_size, int num_kv_heads, int kv_head,
                                            int head_dim) {
  const size_t slot = size_t(block_table[t / block_size]) * block_size + t % block_size;
  return (slot * num_kv_heads + kv_head) * head_dim;
}

// Fold keys first .. first + count - 1 (count in 1..32) into the warp's state.
template <typename T>
__device__ __forceinline__ void attend_chunk(SoftmaxState& st,
                                             const float* __restrict__ q_scaled,  // (hd,) shared
                                             float* __restrict__ probs,  // (32,) warp's shared
                                             const T* __restrict__ k_cache,  // (N, bs, Hkv, hd)
                                             const T* __restrict__ v_cache,  // (N, bs, Hkv, hd)
                                             const int* __restrict__ block_table,  // (M,)
                                             int block_size, int num_kv_heads, int kv_head,
                                             int head_dim, int first, int count) {
  const int lane = threadIdx.x % kWarpSize;
  float score = kNegLarge;
  if (lane < count) {
    const T* k = k_cache + kv_offset(block_table, first + lane, block_size, num_kv_heads,
                                     kv_head, head_dim);
    score = 0.0f;
    for (int d = 0; d < head_dim; ++d) score += q_scaled[d] * to_float(k[d]);
  }
  const float m_new = fmaxf(st.m, warp_max(score));
  const float rescale = expf(st.m - m_new);
  const float p = lane < count ? expf(score - m_new) : 0.0f;
  st.l = st.l * rescale + p;
  st.m = m_new;
  __syncwarp();  // every lane has finished reading the previous chunk's probs
  probs[lane] = p;
  __syncwarp();
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i) st.acc[i] *= rescale;
  for (int j = 0; j < count; ++j) {
    const T* v = v_cache + kv_offset(block_table, first + j, block_size, num_kv_heads, kv_head,
                                     head_dim);
    const float pj = probs[j];
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i) {
      const int d = lane + i * kWarpSize;
      if (d < head_dim) st.acc[i] += pj * to_float(v[d]);
    }
  }
}
