// gguf_matvec.cu: out (M, N) = x (M, K) @ W^T for a small batch (M <= 8) and a GGUF matrix W
// (N, K) kept in its blocks (gguf.cuh: Q8_0, Q4_0, Q5_0, Q4_K, Q6_K; `kind` picks the format
// for the whole launch). One warp per output row: lane l takes units l, l + 32, ... of the row.
// Units are strided through their block (gguf.cuh), so at each step the warp reads one or two
// runs of neighbouring weight bytes and of neighbouring x values (a warp covers one 256-value
// super-block, or one or two 32-value blocks, per step). Every weight byte is loaded once per
// product, by one lane, and multiplied into all M rows of x while it is in registers; a
// block's header is loaded by its first unit's lane and shuffled to the others. x stays in its
// dtype, widened to float32; sums are float32 per lane, then a warp sum per batch row; out is
// written once per element, rounded to T, or float32 when out_f32 (the logits): row m's
// columns col..col+N of an out whose rows are ldo elements apart (a fused matrix's part writes
// its own columns of the whole output).
#include "gguf.cuh"

constexpr int kMatvecWarps = 4;  // rows per block (engine/kernels/launch.py GGUF_MATVEC_ROWS)
constexpr int kMaxBatch = 8;     // GGUF_MATVEC_MAX_BATCH

template <typename Fmt, typename T>
__device__ __forceinline__ void matvec_row(void* out, const T* x, const unsigned char* row, int n,
                                           int K, int M, int ldo, int out_f32) {  // out: column col
  const int lane = threadIdx.x % kWarpSize;
  const int units = K / Fmt::kValues * Fmt::kUnits;
  float acc[kMaxBatch] = {};
  for (int base = 0; base < units; base += kWarpSize) {  // the same trips for every lane
    const int u = base + lane, blk = u / Fmt::kUnits, part = u % Fmt::kUnits;
    const bool valid = u < units;
    const unsigned char* b = row + size_t(blk) * Fmt::kBytes;
    GgufHeader h = valid && part == 0 ? Fmt::header(b) : GgufHeader{};
    if constexpr (Fmt::kUnits > 1) {
      const int first = lane - part;  // the block's first unit's lane
#pragma unroll
      for (int i = 0; i < Fmt::kWords; ++i) h.w[i] = __shfl_sync(kFullMask, h.w[i], first);
    }
    if (!valid) continue;
    const T* xb = x + size_t(blk) * Fmt::kValues;
    Fmt::unit(b, part, h, [&](int i, float w) {
#pragma unroll
      for (int m = 0; m < kMaxBatch; ++m) {
        if (m < M) acc[m] += w * to_float(xb[size_t(m) * K + i]);
      }
    });
  }
#pragma unroll
  for (int m = 0; m < kMaxBatch; ++m) {
    if (m >= M) break;
    const float s = warp_sum(acc[m]);
    if (lane != 0) continue;
    if (out_f32) {
      static_cast<float*>(out)[size_t(m) * ldo + n] = s;
    } else {
      static_cast<T*>(out)[size_t(m) * ldo + n] = from_float<T>(s);
    }
  }
}

// Grid: (cdiv(N, 4),)  Block: (128,)
template <typename T>
__device__ __forceinline__ void gguf_matvec(void* __restrict__ out,               // (M, ldo)
                                            const T* __restrict__ x,              // (M, K)
                                            const unsigned char* __restrict__ w,  // (N, row bytes)
                                            int N, int K, int M, int ldo, int col, int kind,
                                            int out_f32) {
  const int n = blockIdx.x * kMatvecWarps + threadIdx.x / kWarpSize;
  if (n >= N) return;  // a whole warp
  with_gguf_format(kind, [&](auto fmt) {
    using Fmt = decltype(fmt);
    const unsigned char* row = w + size_t(n) * (K / Fmt::kValues) * Fmt::kBytes;
    void* at = out_f32 ? static_cast<void*>(static_cast<float*>(out) + col)
                       : static_cast<void*>(static_cast<T*>(out) + col);
    matvec_row<Fmt>(at, x, row, n, K, M, ldo, out_f32);
  });
}

DTYPE_ENTRY_POINTS(gguf_matvec, 10)
