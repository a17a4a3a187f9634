// lora_expand.cu: the second half of the batched LoRA product (the segmented "expand"): for
// each row i of a tile (lora_shrink.cu's tiles) and each output column c,
//   y[i, c] += sum_j t[i, m R_m + j] * B[slot, j, c]
// where m is the module (q, k or v of a fused q|k|v product; gate or up) whose columns hold c
// (module_ends (M,): the end column of each), R_m the rank of a module's slice of t and of B
// (every module padded with zeros to it), and t[i] the sum of lora_shrink's P partials, added
// in split order. The update is float32 and y is rounded once. One thread per column, a tile's
// t staged in shared memory kRankChunk ranks at a time: the tile reads its B columns once.
#include "common.cuh"

constexpr int kTileRows = 16;   // lora_shrink.cu kTileRows
constexpr int kMaxModules = 3;  // q | k | v
constexpr int kRankChunk = 32;  // ranks staged per round

// Grid: (tiles, cdiv(N, 256))  Block: (256,)
template <typename T>
__device__ __forceinline__ void lora_expand(T* __restrict__ y,                   // (T, N)
                                            const float* __restrict__ partial,   // (P, T, M R_m)
                                            const T* __restrict__ b,             // (S, R_m, N)
                                            const int* __restrict__ order,       // (T,)
                                            const int* __restrict__ tiles,       // (n, 3)
                                            const int* __restrict__ module_ends,  // (M,)
                                            int rows, int N, int rank, int modules, int slots,
                                            int splits) {
  __shared__ float ts[kTileRows][kMaxModules][kRankChunk];
  __shared__ int row_of[kTileRows];
  const int* tile = tiles + 3 * blockIdx.x;
  const int slot = tile[0], first = tile[1], count = tile[2];
  if (count <= 0 || slot < 0 || slot >= slots) return;  // a padding tile
  const int tid = threadIdx.x, c = blockIdx.y * blockDim.x + tid;
  if (tid < kTileRows) row_of[tid] = tid < count ? order[first + tid] : 0;
  int m = 0;  // this column's module
  while (m + 1 < modules && c >= module_ends[m]) ++m;
  const size_t R = size_t(modules) * rank, plane = size_t(rows) * R;
  const T* bs = b + size_t(slot) * rank * N;
  float acc[kTileRows] = {};
  __syncthreads();
  for (int j0 = 0; j0 < rank; j0 += kRankChunk) {
    for (int e = tid; e < kTileRows * modules * kRankChunk; e += blockDim.x) {
      const int rr = e / (modules * kRankChunk), mm = e / kRankChunk % modules;
      const int j = j0 + e % kRankChunk;
      float s = 0.0f;
      if (rr < count && j < rank) {
        const float* p = partial + size_t(row_of[rr]) * R + size_t(mm) * rank + j;
        for (int sp = 0; sp < splits; ++sp) s += p[sp * plane];
      }
      ts[rr][mm][e % kRankChunk] = s;
    }
    __syncthreads();
    if (c < N) {
      const int jn = min(kRankChunk, rank - j0);
      for (int j = 0; j < jn; ++j) {
        const float bv = to_float(bs[size_t(j0 + j) * N + c]);
#pragma unroll
        for (int r = 0; r < kTileRows; ++r) acc[r] += ts[r][m][j] * bv;
      }
    }
    __syncthreads();
  }
  if (c >= N) return;
  for (int r = 0; r < count; ++r) {
    T* dst = y + size_t(row_of[r]) * N + c;
    *dst = from_float<T>(to_float(*dst) + acc[r]);
  }
}

DTYPE_ENTRY_POINTS(lora_expand, 12)
