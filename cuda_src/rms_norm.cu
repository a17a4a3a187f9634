// rms_norm.cu: out = x / sqrt(mean(x^2) + eps) * (offset + weight), offset 0 (Llama) or 1
// (Gemma). Each row is split among row_threads threads (a group of lanes, or the whole block
// for long rows) in vectors of up to 16 bytes; x is read once (norm.cuh).
#include "norm.cuh"

// R rows per block: row_threads a power of two <= 32 (R = blockDim.x / row_threads), or
// row_threads == blockDim.x (R = 1); engine/kernels/launch.py row_launch picks them.
// Grid: (cdiv(T, R),)  Block: (R * row_threads,)
template <typename T>
__device__ __forceinline__ void rms_norm(T* __restrict__ out,           // (T, D)
                                         const T* __restrict__ x,       // (T, D)
                                         const T* __restrict__ weight,  // (D,)
                                         int rows, int dim, int row_threads, float eps,
                                         float offset) {
  const int row = blockIdx.x * (blockDim.x / row_threads) + threadIdx.x / row_threads;
  const int lane = threadIdx.x % row_threads;
  const bool valid = row < rows;
  const size_t base = size_t(valid ? row : 0) * dim;
  with_vec_width<T>(vec_width<T>(dim, out, x, weight), [&](auto width) {
    constexpr int W = decltype(width)::value;
    auto load = [&](int i) { return load_vec<W>(x + base + i * W); };
    normalize_row<T, W>(out + base, weight, dim, lane, row_threads, valid, eps, offset, load,
                        load);
  });
}

DTYPE_ENTRY_POINTS(rms_norm, 8)
