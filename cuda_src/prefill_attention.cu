// prefill_attention.cu: causal attention for variable-length runs of query tokens over the
// paged cache (their own K and V already written), tiled as FlashAttention-2 does it with FMA.
// Sequence b's queries are rows query_start_loc[b] .. query_start_loc[b+1]-1, the LAST q_len of
// its context_lens[b] tokens, so the first context_lens[b] - q_len keys may come from earlier
// steps (chunked prefill, prefix caching). Query row r at position p sees keys 0..p, or with a
// sliding window W > 0 keys p - W + 1 .. p (Hugging Face's kv_idx > q_idx - W). With
// softcap > 0 each score s becomes tanh(s / softcap) * softcap before the mask (Gemma 2). With
// sinks (H,) (gpt-oss) a head's sink logit joins each row's sum at the end, its share dropped.
//
// A block serves a tile of 32 query rows of one sequence for one query head; each of its four
// warps owns 8 rows. The keys go by in chunks of 32: the block stages the chunk's K (then V)
// in shared memory, 64 dims at a time, with 16-byte loads; lane j scores key j against the
// warp's 8 rows (queries pre-scaled in shared memory); each row keeps its running max and sum
// (online softmax), and each lane accumulates output dims lane, lane + 32, ... of its 8 rows.
// Only chunks that reach past the tile's first position (the diagonal) or below its last
// row's window are masked; with a window, chunks below every row's window are skipped. All
// arithmetic is float32.
#include "common.cuh"

constexpr int kTileRows = 32;                     // query rows per block
constexpr int kRowsPerWarp = kTileRows / 4;       // 4 warps, 128 threads
constexpr int kTileKeys = kWarpSize;              // keys per chunk: one per lane
constexpr int kDimTile = 64;                      // K/V dims staged at once
constexpr int kMaxDim = 256;                      // largest head_dim
constexpr int kSlices = kMaxDim / kDimTile;       // dim slices of the largest head
constexpr int kDimsPerLane = kMaxDim / kWarpSize; // output dims a lane owns
constexpr int kKvStride = kDimTile + 4;           // padded row: 16-byte reads hit 8 banks apart
constexpr int kProbStride = kTileRows + 4;
static_assert(kRowsPerWarp == 8, "a lane writes and reads its rows' probabilities as two Float4");

struct __align__(16) Vec16 {  // one 16-byte load or store
  unsigned w[4];
};
struct __align__(16) Float4 {
  float x[4];
};

// The sequence that owns block slot y: sequence b has slots b + qsl[b] / 32 onwards, at least
// ceil(q_len / 32) of them before sequence b + 1's, so the grid needs B + ceil(T / 32) - 1.
__device__ __forceinline__ int sequence_of_slot(const int* __restrict__ query_start_loc,
                                                int num_seqs, int y) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (mid + query_start_loc[mid] / kTileRows <= y) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Stage dims d0 .. d0 + width - 1 of keys 0 .. count - 1 of the chunk into buf as float; key
// j's row starts at cache + rows[j]. One 16-byte load per thread per step.
template <typename T>
__device__ __forceinline__ void stage_slice(float* __restrict__ buf,        // (32, kKvStride)
                                            const T* __restrict__ cache,    // (N, bs, Hkv, hd)
                                            const size_t* __restrict__ rows,  // (32,) shared
                                            int count, int d0, int width) {
  constexpr int kVec = 16 / sizeof(T);
  const int per_key = width / kVec;
  for (int i = threadIdx.x; i < count * per_key; i += blockDim.x) {
    const int j = i / per_key, d = (i % per_key) * kVec;
    union {
      Vec16 raw;
      T vals[kVec];
    } in;
    in.raw = *reinterpret_cast<const Vec16*>(cache + rows[j] + d0 + d);
#pragma unroll
    for (int e = 0; e < kVec; e += 4) {
      Float4 f;
#pragma unroll
      for (int k = 0; k < 4; ++k) f.x[k] = to_float(in.vals[e + k]);
      *reinterpret_cast<Float4*>(buf + j * kKvStride + d + e) = f;
    }
  }
}

// Running state of one warp's 8 rows: max m (all lanes agree), this lane's share of the
// exponent sum l, and this lane's output dims lane + 32 i of each row.
struct TileState {
  float m[kRowsPerWarp];
  float l[kRowsPerWarp];
  float acc[kRowsPerWarp][kDimsPerLane];
};

// Add dims d0 .. d0 + width - 1 of q . k to each row's score of this lane's key.
__device__ __forceinline__ void score_slice(float (&s)[kRowsPerWarp],
                                            const float* __restrict__ q_tile,  // (32, hd)
                                            const float* __restrict__ kbuf,  // (32, kKvStride)
                                            int head_dim, int d0, int width) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const float* q_rows = q_tile + warp * kRowsPerWarp * head_dim + d0;
  for (int d = 0; d < width; d += 4) {
    const Float4 k = *reinterpret_cast<const Float4*>(kbuf + lane * kKvStride + d);
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const Float4 q = *reinterpret_cast<const Float4*>(q_rows + r * head_dim + d);  // broadcast
#pragma unroll
      for (int e = 0; e < 4; ++e) s[r] += q.x[e] * k.x[e];
    }
  }
}

// Fold the chunk's scores into the rows' softmax state; probabilities go to probs[key][row].
// In a masked chunk key `key_pos` is hidden from a row at position p when key_pos > p, or,
// with a window W > 0, key_pos <= p - W.
__device__ __forceinline__ void softmax_chunk(TileState& st, float (&s)[kRowsPerWarp],
                                              float* __restrict__ probs,  // (32, kProbStride)
                                              bool masked, int key_pos, int row_pos0,
                                              int last_pos, int window) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  float p[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int pos = min(row_pos0 + r, last_pos);
    const bool hidden = masked && (key_pos > pos || (window > 0 && key_pos <= pos - window));
    const float m_new = fmaxf(st.m[r], warp_max(hidden ? kNegLarge : s[r]));
    const float rescale = expf(st.m[r] - m_new);
    p[r] = hidden ? 0.0f : expf(s[r] - m_new);
    st.l[r] = st.l[r] * rescale + p[r];
    st.m[r] = m_new;
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i) st.acc[r][i] *= rescale;
  }
  Float4* dst = reinterpret_cast<Float4*>(probs + lane * kProbStride + warp * kRowsPerWarp);
  dst[0] = Float4{{p[0], p[1], p[2], p[3]}};
  dst[1] = Float4{{p[4], p[5], p[6], p[7]}};
}

// acc[r][dims of slice s] += sum_j probs[j][r] * v[j]; vbuf holds the slice's V rows. The
// slice loop is unrolled, so s is a constant and acc stays in registers.
__device__ __forceinline__ void accumulate_slice(TileState& st,
                                                 const float* __restrict__ probs,  // (32, 36)
                                                 const float* __restrict__ vbuf,  // (32, 68)
                                                 int s, int count, int width) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  constexpr int kPerSlice = kDimTile / kWarpSize;  // 2 dims per lane per slice
  for (int j = 0; j < count; ++j) {
    const Float4* pj = reinterpret_cast<const Float4*>(probs + j * kProbStride) + warp * 2;
    const Float4 p0 = pj[0], p1 = pj[1];  // broadcast: rows 0-3, 4-7
#pragma unroll
    for (int i = 0; i < kPerSlice; ++i) {
      const int d = lane + i * kWarpSize;
      const float v = d < width ? vbuf[j * kKvStride + d] : 0.0f;
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        st.acc[r][s * kPerSlice + i] += p0.x[r] * v;
        st.acc[r + 4][s * kPerSlice + i] += p1.x[r] * v;
      }
    }
  }
}

// Grid: (H, B + ceil(T / 32) - 1)  Block: (128,)  Shared: 32 * head_dim floats
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
    int max_blocks, float scale, int window, float softcap,
    const float* __restrict__ sinks,          // (H,) sink logits (read when use_sinks)
    int use_sinks) {
  DYNAMIC_SHARED(float, q_tile);                    // (32, hd) queries * scale
  __shared__ __align__(16) float kv[kTileKeys * kKvStride];     // (32, 68) a K or V slice
  __shared__ __align__(16) float probs[kTileKeys * kProbStride];  // (32 keys, 36) per row
  __shared__ size_t rows[kTileKeys];                // cache offset of each key's row
  const int h = blockIdx.x, num_heads = gridDim.x, kv_head = h / (num_heads / num_kv_heads);
  const int slot = gridDim.y - 1 - blockIdx.y;  // last tiles (the most keys) launch first
  const int b = sequence_of_slot(query_start_loc, num_seqs, slot);
  const int row0 = query_start_loc[b] + (slot - b - query_start_loc[b] / kTileRows) * kTileRows;
  const int row_end = query_start_loc[b + 1];
  if (row0 >= row_end) return;  // a spare slot: the whole block, before any barrier
  const int q_len = row_end - query_start_loc[b];
  const int pos0 = context_lens[b] - q_len + (row0 - query_start_loc[b]);  // tile's first row
  const int last_pos = pos0 + min(kTileRows, row_end - row0) - 1;  // rows past it: copies of it
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;

  for (int i = threadIdx.x; i < kTileRows * head_dim; i += blockDim.x) {
    const int row = row0 + i / head_dim;
    q_tile[i] = row < row_end
                    ? to_float(q[(size_t(row) * num_heads + h) * head_dim + i % head_dim]) * scale
                    : 0.0f;
  }
  TileState st;
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    st.m[r] = kNegLarge;
    st.l[r] = 0.0f;
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i) st.acc[r][i] = 0.0f;
  }

  const int* table = block_tables + size_t(b) * max_blocks;
  // With a window: start at the chunk holding the first row's first visible key, and mask the
  // chunks that hold keys below the last row's window (key <= last_pos - window).
  // A key of the first chunk below the first row's window is masked; its lane reads the first
  // visible key instead: the page-table entries before it may name blocks given back (a
  // sliding-window model's), which must not be read.
  const int lo_key = window > 0 ? max(0, pos0 - window + 1) : 0;
  const int first0 = lo_key / kTileKeys * kTileKeys;
  for (int first = first0; first <= last_pos; first += kTileKeys) {
    const int count = min(kTileKeys, last_pos + 1 - first);
    if (int(threadIdx.x) < count) {  // one table read per key per chunk, for every K and V slice
      const int t = max(first + int(threadIdx.x), lo_key);
      rows[threadIdx.x] =
          ((size_t(table[t / block_size]) * block_size + t % block_size) * num_kv_heads +
           kv_head) * head_dim;
    }
    float s[kRowsPerWarp] = {};
#pragma unroll
    for (int sl = 0; sl < kSlices; ++sl) {
      const int d0 = sl * kDimTile, width = min(kDimTile, head_dim - d0);
      if (width <= 0) break;
      __syncthreads();  // rows written; the previous slice's readers are done
      stage_slice(kv, k_cache, rows, count, d0, width);
      __syncthreads();
      score_slice(s, q_tile, kv, head_dim, d0, width);
    }
    if (softcap > 0.0f) {
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) s[r] = tanhf(s[r] / softcap) * softcap;
    }
    const int row_pos0 = pos0 + warp * kRowsPerWarp;
    const bool masked = first + kTileKeys - 1 > pos0 || (window > 0 && first <= last_pos - window);
    softmax_chunk(st, s, probs, masked, first + lane, row_pos0, last_pos, window);
#pragma unroll
    for (int sl = 0; sl < kSlices; ++sl) {
      const int d0 = sl * kDimTile, width = min(kDimTile, head_dim - d0);
      if (width <= 0) break;
      __syncthreads();  // probs written; the K slice's readers are done
      stage_slice(kv, v_cache, rows, count, d0, width);
      __syncthreads();
      accumulate_slice(st, probs, kv, sl, count, width);
    }
  }

#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int row = row0 + warp * kRowsPerWarp + r;
    const float total = warp_sum(st.l[r]);
    if (row >= row_end) continue;
    float inv_total = 1.0f / total;  // its own key is visible to every row: total > 0
    if (use_sinks) {  // sum' = total e^(m - top) + e^(sink - top)
      const float top = fmaxf(st.m[r], sinks[h]), keep = expf(st.m[r] - top);
      inv_total = keep / (total * keep + expf(sinks[h] - top));
    }
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i) {
      const int d = lane + i * kWarpSize;
      if (d < head_dim) out[(size_t(row) * num_heads + h) * head_dim + d] =
          from_float<T>(st.acc[r][i] * inv_total);
    }
  }
}

DTYPE_ENTRY_POINTS(prefill_attention, 18)
