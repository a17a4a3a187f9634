// Matrix products with an FP8 checkpoint's weights kept in 8 bits: W transposed, (N, K),
// float8_e4m3fn bytes, and scales (N, nbk) float32, one per row and run of K / nbk inputs (a
// per-tensor or per-channel scale: nbk = 1; 128x128 blocks: a block's scale on each of its
// rows). A weight's value is e4m3(q) * s in float32, one rounding: the values the loader's
// float32 widening gives (model_loader/checkpoint_quant.py). x stays float32.
// Each thread's W rows go through a tile of NB rows widened to those float32 values (the
// e4m3 table of common.h, times the scale): for up to DOT_ROWS rows of x each tile row is
// dotted with each (a vectorized float32 dot: decode), for more the tile goes to the BLAS's
// sgemm (prefill). So W is read once per call, 1 byte a weight.
#include <memory>

#include "blas.h"
#include "common.h"

namespace {

const long NB = 64;        // W rows per tile
const long DOT_ROWS = 4;   // rows of x up to which the tiles are dotted, not sgemm'd

// W rows r0 .. r0 + rows - 1 as float32 values into tile (rows, K).
void widen(float* tile, const uint8_t* w, const float* s, long r0, long rows, long K, long nbk) {
  const long bk = K / nbk;
  for (long r = 0; r < rows; r++) {
    const uint8_t* q = w + (r0 + r) * K;
    const float* sr = s + (r0 + r) * nbk;
    float* t = tile + r * K;
    for (long b = 0; b < nbk; b++) {
      const float sb = sr[b];
#pragma omp simd
      for (long k = b * bk; k < (b + 1) * bk; k++) t[k] = E4M3_VALUES.v[q[k]] * sb;
    }
  }
}

}  // namespace

// out: (M, N) float32 = x (M, K) float32 @ W^T; w: (N, K) e4m3 bytes; scales: (N, nbk)
// float32, nbk dividing K; row-major contiguous. Returns 1 (nothing done) where nbk does not
// divide K.
extern "C" int matmul_fp8(float* out, const float* x, const uint8_t* w, const float* scales,
                          long nbk, long M, long K, long N, int threads) {
  if (nbk <= 0 || K % nbk) return 1;
  if (M == 0) return 0;
  const long tiles = (N + NB - 1) / NB;
  const int nt = (int)std::min<long>(threads_for(2 * M * K * N, threads), tiles);
  const long per = (tiles + nt - 1) / nt;
  on_threads(nt, [&](int t) {
    std::unique_ptr<float[]> tile(new float[NB * K]);  // (NB, K)
    for (long j = t * per; j < std::min(tiles, (t + 1) * per); j++) {
      const long r0 = j * NB, rows = std::min(NB, N - r0);
      widen(tile.get(), w, scales, r0, rows, K, nbk);
      if (M > DOT_ROWS) {
        sgemm(ROW_MAJOR, NO_TRANS, TRANS, M, rows, K, 1.0f, x, K, tile.get(), K, 0.0f, out + r0,
              N);
        continue;
      }
      for (long m = 0; m < M; m++)
        for (long r = 0; r < rows; r++) {
          const float* a = x + m * K;
          const float* b = tile.get() + r * K;
          float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
          for (long k = 0; k < K; k++) acc += a[k] * b[k];
          out[m * N + r0 + r] = acc;
        }
    }
  });
  return 0;
}
