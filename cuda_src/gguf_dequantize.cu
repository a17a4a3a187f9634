// gguf_dequantize.cu: a GGUF matrix W (N, K) kept in its blocks (gguf.cuh; `kind` picks the
// format) widened into out (N, K), the tile a larger batch's product hands to cuBLAS (engine/
// backends/cupy_blocks.py BlockGemm). One thread per unit (gguf.cuh), units numbered through
// the whole matrix (the rows' blocks are contiguous), so a block's units are neighbouring
// lanes of one warp: its first loads the header and shuffles it to the others; the units'
// stride through the block makes the warp's loads and stores runs of neighbours.
// Every weight byte is loaded once and every out element stored once, rounded to T.
#include "gguf.cuh"

// Grid: (cdiv(N * K / values per unit, 256),)  Block: (256,)
template <typename T>
__device__ __forceinline__ void gguf_dequantize(T* __restrict__ out,                   // (N, K)
                                                const unsigned char* __restrict__ w,  // (N, row bytes)
                                                int N, int K, int kind) {
  with_gguf_format(kind, [&](auto fmt) {
    using Fmt = decltype(fmt);
    const int lane = threadIdx.x % kWarpSize;
    const long long units = (long long)N * (K / Fmt::kValues) * Fmt::kUnits;
    const long long u = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long blk = u / Fmt::kUnits;
    const int part = int(u % Fmt::kUnits);
    const bool valid = u < units;
    const unsigned char* b = w + size_t(blk) * Fmt::kBytes;
    GgufHeader h = valid && part == 0 ? Fmt::header(b) : GgufHeader{};
    if constexpr (Fmt::kUnits > 1) {
#pragma unroll
      for (int i = 0; i < Fmt::kWords; ++i) h.w[i] = __shfl_sync(kFullMask, h.w[i], lane - part);
    }
    if (!valid) return;
    T* dst = out + size_t(blk) * Fmt::kValues;
    Fmt::unit(b, part, h, [&](int i, float v) { dst[i] = from_float<T>(v); });
  });
}

DTYPE_ENTRY_POINTS(gguf_dequantize, 5)
