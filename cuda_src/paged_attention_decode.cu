// paged_attention_decode.cu: one query token per sequence attends to its cached context (it
// sits at position context_lens[b] - 1, so no causal mask is needed): every key, or with a
// sliding window W > 0 the last W, keys max(0, ctx - W) .. ctx - 1 (Hugging Face's
// kv_idx > q_idx - W). The partitions split that visible span, starting at its first key, so
// keys below the window are never read. With softcap > 0 each score s becomes
// tanh(s / softcap) * softcap before the softmax (Gemma 2's attention soft-capping). With
// sinks (H,) (gpt-oss), head h's softmax has one more logit, sinks[h], whose share of the sum
// goes nowhere: added to the sum at the end (here, or by the reduce kernel with partitions).
//
// One thread block per (KV head, up to kMaxGroup of the query heads that share it, sequence,
// partition): every K and V row of the partition is read from global memory once and used for
// all of those query heads. A group of kLanes lanes reads one K/V row with 16-byte loads
// (HEAD_DIM and BLOCK_SIZE are compile-time constants: -DHEAD_DIM=64 -DBLOCK_SIZE=16). The
// partition is walked in chunks of kChunk tokens, each chunk's block ids read once into shared
// memory; per chunk the block scores the keys for every head into shared memory, folds them
// into a running max and exponent sum per head (online softmax), and adds the probability-
// weighted V rows to each thread's registers. With one partition (gridDim.z == 1) the block
// writes the output; otherwise it writes its normalised partial output, max score and
// exponent sum, and paged_attention_reduce.cu combines the partitions. docs/kernels.md has the
// work split as a table.
#include "common.cuh"

#if !defined(HEAD_DIM) || !defined(BLOCK_SIZE)
#error "paged_attention_decode.cu is built with -DHEAD_DIM=... -DBLOCK_SIZE=..."
#endif

namespace decode {

constexpr int kHeadDim = HEAD_DIM;
constexpr int kBlockSize = BLOCK_SIZE;
constexpr int kWarps = 4;  // 128 threads
constexpr int kThreads = kWarps * kWarpSize;
constexpr int kMaxGroup = 8;  // query heads per block (more: several blocks per KV head)
constexpr int kChunk = 64;    // tokens scored per round; partition sizes are multiples of it

// Elements per load: 16 bytes, or fewer when the head dim is not a multiple of it.
template <typename T>
__host__ __device__ constexpr int vec_elems() {
  int n = 16 / int(sizeof(T));
  while (kHeadDim % n) n /= 2;
  return n;
}

__host__ __device__ constexpr int pow2_at_least(int n) { return n <= 1 ? 1 : 2 * pow2_at_least((n + 1) / 2); }

// How a warp reads rows: kLanes lanes (a power of two) per row, kVecs loads of kVec elements
// per lane (vector i of lane l is elements [(i * kLanes + l) * kVec, ... + kVec) of the row).
template <typename T>
struct RowSplit {
  static constexpr int kVec = vec_elems<T>();
  static constexpr int kRowVecs = kHeadDim / kVec;  // loads in one row
  static constexpr int kLanes = pow2_at_least(kRowVecs < kWarpSize ? kRowVecs : kWarpSize);
  static constexpr int kVecs = (kRowVecs + kLanes - 1) / kLanes;
  static constexpr int kRowsPerWarp = kWarpSize / kLanes;
  static constexpr int kRowsPerPass = kWarps * kRowsPerWarp;  // rows the block reads at once
};

template <typename T, int N>
struct __align__(sizeof(T) * N) Vec {
  T v[N];
};

// What one block shares: the scaled queries, a chunk's scores (then probabilities) per head,
// the chunk's block ids, the running softmax state per head, and each warp's output slice.
struct Shared {
  float q[kMaxGroup][kHeadDim];
  float p[kMaxGroup][kChunk];
  int blocks[kChunk + 1];  // a chunk touches at most kChunk + 1 blocks (kBlockSize 1: kChunk)
  float m[kMaxGroup], l[kMaxGroup], rescale[kMaxGroup];
  float acc[kWarps][kMaxGroup][kHeadDim];
};

// The block ids of tokens first .. first + n - 1 into s.blocks, one table read per block.
__device__ __forceinline__ void load_block_ids(Shared& s, const int* __restrict__ table, int first,
                                               int n) {
  const int b0 = first / kBlockSize, count = (first + n - 1) / kBlockSize - b0 + 1;
  for (int i = threadIdx.x; i < count; i += kThreads) s.blocks[i] = table[b0 + i];
}

// Element offset of chunk token j's row (for kv_head) in a (N, bs, Hkv, hd) cache.
__device__ __forceinline__ size_t row_offset(const Shared& s, int first, int j, int num_kv_heads,
                                             int kv_head) {
  const int t = first + j, block = s.blocks[t / kBlockSize - first / kBlockSize];
  const size_t slot = size_t(block) * kBlockSize + t % kBlockSize;
  return (slot * num_kv_heads + kv_head) * kHeadDim;
}

// Scores of the chunk's n keys against every head's query -> s.p[g][j] (soft-capped when
// softcap > 0).
template <typename T>
__device__ __forceinline__ void score_chunk(Shared& s, const T* __restrict__ k_cache,
                                            int num_kv_heads, int kv_head, int heads, int first,
                                            int n, float softcap) {
  using R = RowSplit<T>;
  const int lane = threadIdx.x % kWarpSize, li = lane % R::kLanes;
  const int rg = (threadIdx.x / kWarpSize) * R::kRowsPerWarp + lane / R::kLanes;
  for (int j0 = 0; j0 < n; j0 += R::kRowsPerPass) {  // n is the same for the whole block
    const int j = j0 + rg;
    float dot[kMaxGroup];
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) dot[g] = 0.0f;
    if (j < n) {
      const auto* row = reinterpret_cast<const Vec<T, R::kVec>*>(
          k_cache + row_offset(s, first, j, num_kv_heads, kv_head));
#pragma unroll
      for (int i = 0; i < R::kVecs; ++i) {
        const int vi = i * R::kLanes + li;
        if (vi >= R::kRowVecs) break;
        const Vec<T, R::kVec> k = row[vi];  // one 16-byte load
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) {
          if (g >= heads) break;
#pragma unroll
          for (int e = 0; e < R::kVec; ++e) dot[g] += s.q[g][vi * R::kVec + e] * to_float(k.v[e]);
        }
      }
    }
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
#pragma unroll
      for (int m = R::kLanes / 2; m > 0; m /= 2) dot[g] += __shfl_xor_sync(kFullMask, dot[g], m);
    }
    if (j < n && li == 0) {
      for (int g = 0; g < heads; ++g) {
        s.p[g][j] = softcap > 0.0f ? tanhf(dot[g] / softcap) * softcap : dot[g];
      }
    }
  }
}

// Per head (one warp each): fold the chunk's scores into the running max and sum, turn them
// into probabilities exp(score - max) in place, and keep the factor old sums are rescaled by.
__device__ __forceinline__ void softmax_chunk(Shared& s, int heads, int n) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  for (int g = warp; g < heads; g += kWarps) {
    float m = kNegLarge;
    for (int j = lane; j < n; j += kWarpSize) m = fmaxf(m, s.p[g][j]);
    const float m_old = s.m[g], m_new = fmaxf(m_old, warp_max(m));
    float sum = 0.0f;
    for (int j = lane; j < n; j += kWarpSize) {
      const float p = expf(s.p[g][j] - m_new);
      s.p[g][j] = p;
      sum += p;
    }
    sum = warp_sum(sum);
    if (lane == 0) {
      const float r = expf(m_old - m_new);
      s.l[g] = s.l[g] * r + sum, s.m[g] = m_new, s.rescale[g] = r;
    }
  }
}

// acc (this thread's slice of every head's output) rescaled, then += p[g][j] * V row j.
template <typename T, typename Acc>
__device__ __forceinline__ void value_chunk(Acc& acc, const Shared& s,
                                            const T* __restrict__ v_cache, int num_kv_heads,
                                            int kv_head, int heads, int first, int n) {
  using R = RowSplit<T>;
  const int lane = threadIdx.x % kWarpSize, li = lane % R::kLanes;
  const int rg = (threadIdx.x / kWarpSize) * R::kRowsPerWarp + lane / R::kLanes;
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    const float r = g < heads ? s.rescale[g] : 0.0f;
#pragma unroll
    for (int i = 0; i < R::kVecs * R::kVec; ++i) acc[g][i] *= r;
  }
  for (int j = rg; j < n; j += R::kRowsPerPass) {
    const auto* row = reinterpret_cast<const Vec<T, R::kVec>*>(
        v_cache + row_offset(s, first, j, num_kv_heads, kv_head));
#pragma unroll
    for (int i = 0; i < R::kVecs; ++i) {
      const int vi = i * R::kLanes + li;
      if (vi >= R::kRowVecs) break;
      const Vec<T, R::kVec> v = row[vi];  // one 16-byte load
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) {
        if (g >= heads) break;
        const float p = s.p[g][j];
#pragma unroll
        for (int e = 0; e < R::kVec; ++e) acc[g][i * R::kVec + e] += p * to_float(v.v[e]);
      }
    }
  }
}

// Sum acc over the row groups of each warp (shuffles), then each warp's sums to s.acc[warp].
template <typename T, typename Acc>
__device__ __forceinline__ void store_warp_acc(Shared& s, Acc& acc, int heads) {
  using R = RowSplit<T>;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
#pragma unroll
    for (int i = 0; i < R::kVecs * R::kVec; ++i) {
#pragma unroll
      for (int m = R::kLanes; m < kWarpSize; m *= 2) {
        acc[g][i] += __shfl_xor_sync(kFullMask, acc[g][i], m);
      }
    }
  }
  if (lane >= R::kLanes) return;
  for (int g = 0; g < heads; ++g) {
#pragma unroll
    for (int i = 0; i < R::kVecs; ++i) {
      const int vi = i * R::kLanes + lane;
      if (vi >= R::kRowVecs) break;
#pragma unroll
      for (int e = 0; e < R::kVec; ++e) s.acc[warp][g][vi * R::kVec + e] = acc[g][i * R::kVec + e];
    }
  }
}

}  // namespace decode

// Grid: (Hkv * ceil(G / 8), B, P)  Block: (128,)   G = query heads per KV head
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
    int num_kv_heads, int group, int max_blocks, float scale, int partition_size, int window,
    float softcap,
    const float* __restrict__ sinks,     // (H,) sink logits (read when use_sinks)
    int use_sinks) {
  using namespace decode;
  using R = RowSplit<T>;
  __shared__ Shared s;
  const int tiles = gridDim.x / num_kv_heads;
  const int kv_head = blockIdx.x / tiles, tile = blockIdx.x % tiles;
  const int h0 = kv_head * group + tile * kMaxGroup, heads = min(kMaxGroup, group - tile * kMaxGroup);
  const int num_heads = num_kv_heads * group, b = blockIdx.y, part = blockIdx.z;
  const int num_parts = gridDim.z, context = context_lens[b];
  const int lo = window > 0 ? max(0, context - window) : 0;  // the first visible key
  const int start = lo + part * partition_size;
  if (part > 0 && start >= context) return;  // the whole block: past this sequence's end
  const int end = min(start + partition_size, context);
  const size_t row0 = size_t(b) * num_heads + h0;  // (b, h0) row of q and out
  for (int i = threadIdx.x; i < heads * kHeadDim; i += kThreads) {
    s.q[i / kHeadDim][i % kHeadDim] = to_float(q[row0 * kHeadDim + i]) * scale;
  }
  if (threadIdx.x < kMaxGroup) s.m[threadIdx.x] = kNegLarge, s.l[threadIdx.x] = 0.0f;
  float acc[kMaxGroup][R::kVecs * R::kVec];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
#pragma unroll
    for (int i = 0; i < R::kVecs * R::kVec; ++i) acc[g][i] = 0.0f;
  }
  const int* table = block_tables + size_t(b) * max_blocks;
  for (int first = start; first < end; first += kChunk) {
    const int n = min(kChunk, end - first);
    __syncthreads();  // the previous chunk's block ids and probabilities are used up
    load_block_ids(s, table, first, n);
    __syncthreads();
    score_chunk(s, k_cache, num_kv_heads, kv_head, heads, first, n, softcap);
    __syncthreads();
    softmax_chunk(s, heads, n);
    __syncthreads();
    value_chunk<T>(acc, s, v_cache, num_kv_heads, kv_head, heads, first, n);
  }
  store_warp_acc<T>(s, acc, heads);
  __syncthreads();
  for (int i = threadIdx.x; i < heads * kHeadDim; i += kThreads) {
    const int g = i / kHeadDim, d = i % kHeadDim;
    float o = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) o += s.acc[w][g][d];
    const size_t row = row0 + g;
    if (use_sinks && num_parts == 1) {  // sum' = l e^(m - top) + e^(sink - top)
      const float sink = sinks[h0 + g], top = fmaxf(s.m[g], sink), keep = expf(s.m[g] - top);
      o *= keep / (s.l[g] * keep + expf(sink - top));
    } else {
      o *= s.l[g] > 0.0f ? 1.0f / s.l[g] : 0.0f;
    }
    if (num_parts == 1) {
      out[row * kHeadDim + d] = from_float<T>(o);
    } else {
      part_out[(row * num_parts + part) * kHeadDim + d] = o;
    }
  }
  if (num_parts > 1 && int(threadIdx.x) < heads) {
    const size_t row = row0 + threadIdx.x;
    part_max[row * num_parts + part] = s.m[threadIdx.x];
    part_sum[row * num_parts + part] = s.l[threadIdx.x];
  }
}

DTYPE_ENTRY_POINTS(paged_attention_decode, 18)
