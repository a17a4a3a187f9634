// lora_shrink.cu: the first half of the batched LoRA product (Punica's and S-LoRA's segmented
// "shrink"): for each row i of a tile, t[i] = x[i] @ A[slot]^T, its adapter's A. The step's
// LoRA rows are grouped by slot (order, the rows' indices slot by slot) and cut into tiles of
// at most kTileRows rows of one slot (tiles (n, 3): slot, first index into order, count), so a
// tile reads its adapter's A once for all of its rows. K is split into `splits` ranges of
// split_len columns, each block summing one range into its own float32 partial (P, T, R); the
// expand kernel (lora_expand.cu) adds the P partials in a fixed order: no atomics, the same
// result every run. Rows of no tile (the base model's) are neither read nor written.
#include "common.cuh"

constexpr int kTileRows = 16;  // rows per tile (engine/kernels/launch.py LORA_TILE_ROWS)
constexpr int kRankCols = 64;  // rank columns per block (LORA_RANK_COLS)
constexpr int kChunk = 32;     // K columns staged in shared memory per round

// Grid: (tiles, splits, cdiv(R, 64))  Block: (256,)
template <typename T>
__device__ __forceinline__ void lora_shrink(float* __restrict__ partial,   // (P, T, R)
                                            const T* __restrict__ x,       // (T, K)
                                            const T* __restrict__ a,       // (S, R, K)
                                            const int* __restrict__ order,  // (T,)
                                            const int* __restrict__ tiles,  // (n, 3)
                                            int rows, int K, int R, int slots, int split_len) {
  __shared__ float xs[kTileRows][kChunk + 1];
  __shared__ float as[kRankCols][kChunk + 1];
  __shared__ int row_of[kTileRows];  // the tile's rows
  const int* tile = tiles + 3 * blockIdx.x;
  const int slot = tile[0], first = tile[1], count = tile[2];
  if (count <= 0 || slot < 0 || slot >= slots) return;  // a padding tile
  const int k0 = blockIdx.y * split_len, k1 = min(K, k0 + split_len);
  const int j0 = blockIdx.z * kRankCols;
  const int tid = threadIdx.x, r = tid / 16, jg = tid % 16;  // row r, columns jg + 16 q
  const T* adapter = a + size_t(slot) * R * K;
  if (tid < kTileRows) row_of[tid] = tid < count ? order[first + tid] : 0;
  __syncthreads();
  float acc[kRankCols / 16] = {};
  for (int kc = k0; kc < k1; kc += kChunk) {
    for (int e = tid; e < kTileRows * kChunk; e += blockDim.x) {  // the tile's x columns
      const int rr = e / kChunk, k = kc + e % kChunk;
      xs[rr][e % kChunk] = rr < count && k < k1 ? to_float(x[size_t(row_of[rr]) * K + k]) : 0.0f;
    }
    for (int e = tid; e < kRankCols * kChunk; e += blockDim.x) {  // A's rows j0.. over them
      const int j = j0 + e / kChunk, k = kc + e % kChunk;
      as[e / kChunk][e % kChunk] = j < R && k < k1 ? to_float(adapter[size_t(j) * K + k]) : 0.0f;
    }
    __syncthreads();
#pragma unroll 4
    for (int k = 0; k < kChunk; ++k) {
      const float xv = xs[r][k];
#pragma unroll
      for (int q = 0; q < kRankCols / 16; ++q) acc[q] += xv * as[jg + 16 * q][k];
    }
    __syncthreads();
  }
  if (r >= count) return;
  float* out = partial + (size_t(blockIdx.y) * rows + row_of[r]) * R;
#pragma unroll
  for (int q = 0; q < kRankCols / 16; ++q) {
    const int j = j0 + jg + 16 * q;
    if (j < R) out[j] = acc[q];
  }
}

DTYPE_ENTRY_POINTS(lora_shrink, 10)
