// Products of many rows of x (prompts) with weights kept in blocks: W's rows dequantized
// TILE_ROWS at a time into a float32 tile, multiplied by the BLAS's sgemm with x's quantized
// values (x~ = qx dx per Q values), so that every batch size computes the same function of x
// quantized as the integer dots do. Shared by the block formats' files.
#pragma once
#include <memory>

#include "blas.h"
#include "common.h"

const long TILE_ROWS = 64;

// out (M, N) = x~ (M, K) @ W^T, W's rows split over nt threads; dequant(row, n) writes W row n's
// K values as float32 into row; tile_rows W rows a tile (each sgemm call packs all of x anew).
template <long Q, class Dequant>
void gemm_dequant_tiles(float* out, const int8_t* qx, const float* dx, long M, long K, long N,
                        int nt, Dequant dequant, long tile_rows = TILE_ROWS) {
  std::unique_ptr<float[]> xf(new float[M * K]);  // (M, K): x's quantized values
  for (long i = 0; i < M * K; i++) xf[i] = qx[i] * dx[i / Q];
  const long per = ((N + nt - 1) / nt + 7) / 8 * 8;
  on_threads(nt, [&](int t) {
    const long n0 = std::min(N, t * per), n1 = std::min(N, n0 + per);
    std::unique_ptr<float[]> tile(new float[tile_rows * K]);  // (tile_rows, K)
    for (long r0 = n0; r0 < n1; r0 += tile_rows) {
      const long rows = std::min(tile_rows, n1 - r0);
      for (long r = 0; r < rows; r++) dequant(tile.get() + r * K, r0 + r);
      sgemm(ROW_MAJOR, NO_TRANS, TRANS, M, rows, K, 1.0f, xf.get(), K, tile.get(), K, 0.0f,
            out + r0, N);
    }
  });
}
