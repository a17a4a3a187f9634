// moe_matmul.cu: one product of every expert that has rows, over the step's pairs bucketed by
// expert (moe_align.cu). For each position p in expert e's range offsets[e]..offsets[e + 1]:
// out[p] = x[src(p)] . W[e]^T (+ bias[e], float32, with flags & 1), src(p) = sorted[p] / gather
// when gather > 0 (the gate|up product reads its pair's token row), else p (the down product
// reads the activations already in sorted order). W (E, N, K) in T, or (format 1) in GGUF's
// MXFP4 blocks: 17 bytes per 32 values, an e8m0 exponent then 16 bytes of e2m1 codes (value j's
// code in byte j's low nibble, value j + 16's in its high one), a value kvalue * 2^(e - 128).
//
// A block takes 64 columns of one expert and walks its rows in tiles of 16: per 32-value step of
// K, the tile's x values and the 64 weight rows' values are staged in shared memory as float32
// (each thread loads 2 and 8, neighbouring threads neighbouring values), then each thread adds
// 32 products into its column for 4 of the tile's rows. An expert's weights are read once per
// 16 of its rows (once in a decode step), an expert with no rows not at all. Sums are float32,
// K in order; out is float32 with flags & 2, else rounded to T.
#include "common.cuh"

constexpr int kMoeCols = 64;     // columns per block (engine/kernels/moe_launch.py MOE_COLS)
constexpr int kMoeRows = 16;     // rows per tile (MOE_TILE_ROWS)
constexpr int kMoeStep = 32;     // K values per staging step
constexpr int kMoeThreads = 256;  // MOE_THREADS
constexpr int kMxfp4Bytes = 17;
constexpr int kMoeFlagBias = 1, kMoeFlagF32 = 2;

__device__ __forceinline__ float mxfp4_value(const unsigned char* row, int k) {
  const unsigned char* b = row + size_t(k / 32) * kMxfp4Bytes;
  const int j = k % 32;
  const int code = j < 16 ? (b[1 + j] & 15) : (b[1 + j - 16] >> 4);
  // e2m1 doubled: exponent x = bits 1-2, mantissa m = bit 0: m when x is 0, else (2 + m) << (x - 1)
  const int x = (code >> 1) & 3, m = code & 1;
  const int magnitude = x == 0 ? m : (2 + m) << (x - 1);
  const unsigned e = b[0];  // 2^(e - 128) as float32 bits (subnormal for e 0 and 1)
  const unsigned bits = e < 2 ? (0x00200000u << e) : ((e - 1u) << 23);
  return float((code & 8) ? -magnitude : magnitude) * __uint_as_float(bits);
}

// Grid: (cdiv(N, 64), E)  Block: (256,)
template <typename T>
__device__ __forceinline__ void moe_matmul(void* __restrict__ out,              // (P, N)
                                           const T* __restrict__ x,             // (rows, K)
                                           const void* __restrict__ w,          // (E, N, K)
                                           const float* __restrict__ bias,      // (E, N)
                                           const int* __restrict__ sorted,      // (P,)
                                           const int* __restrict__ offsets,     // (E + 1,)
                                           int N, int K, int gather, int format, int flags) {
  __shared__ float xs[kMoeRows][kMoeStep + 1];
  __shared__ float ws[kMoeCols][kMoeStep + 1];
  const int e = blockIdx.y, n0 = blockIdx.x * kMoeCols;
  const int begin = offsets[e], end = offsets[e + 1];
  if (begin == end) return;  // the whole block: no rows chose this expert
  const int col = threadIdx.x % kMoeCols, group = threadIdx.x / kMoeCols;  // 4 row groups
  const size_t row_bytes = format ? size_t(K / 32) * kMxfp4Bytes : size_t(K) * sizeof(T);
  const unsigned char* we = static_cast<const unsigned char*>(w) + size_t(e) * N * row_bytes;
  for (int r0 = begin; r0 < end; r0 += kMoeRows) {
    float acc[kMoeRows / 4] = {};
    for (int k0 = 0; k0 < K; k0 += kMoeStep) {
      for (int i = threadIdx.x; i < kMoeRows * kMoeStep; i += kMoeThreads) {
        const int r = i / kMoeStep, kk = i % kMoeStep, p = r0 + r, k = k0 + kk;
        float v = 0.0f;
        if (p < end && k < K) {
          const int src = gather > 0 ? sorted[p] / gather : p;
          v = to_float(x[size_t(src) * K + k]);
        }
        xs[r][kk] = v;
      }
      for (int i = threadIdx.x; i < kMoeCols * kMoeStep; i += kMoeThreads) {
        const int c = i / kMoeStep, kk = i % kMoeStep, n = n0 + c, k = k0 + kk;
        float v = 0.0f;
        if (n < N && k < K) {
          const unsigned char* row = we + size_t(n) * row_bytes;
          v = format ? mxfp4_value(row, k) : to_float(reinterpret_cast<const T*>(row)[k]);
        }
        ws[c][kk] = v;
      }
      __syncthreads();
#pragma unroll 8
      for (int kk = 0; kk < kMoeStep; ++kk) {
        const float wv = ws[col][kk];
#pragma unroll
        for (int i = 0; i < kMoeRows / 4; ++i) acc[i] += xs[group + 4 * i][kk] * wv;
      }
      __syncthreads();
    }
    const int n = n0 + col;
    if (n >= N) continue;
    const float b = (flags & kMoeFlagBias) ? bias[size_t(e) * N + n] : 0.0f;
#pragma unroll
    for (int i = 0; i < kMoeRows / 4; ++i) {
      const int p = r0 + group + 4 * i;
      if (p >= end) break;
      if (flags & kMoeFlagF32) {
        static_cast<float*>(out)[size_t(p) * N + n] = acc[i] + b;
      } else {
        static_cast<T*>(out)[size_t(p) * N + n] = from_float<T>(acc[i] + b);
      }
    }
  }
}

DTYPE_ENTRY_POINTS(moe_matmul, 11)
