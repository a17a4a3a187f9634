// Matrix products with an FP8 checkpoint's weights kept in 8 bits: W transposed, (N, K),
// float8_e4m3fn bytes, and scales (N, nbk) float32, one per row and run of K / nbk inputs (a
// per-tensor or per-channel scale: nbk = 1; 128x128 blocks: a block's scale on each of its
// rows). A weight's value is e4m3(q) * s in float32, one rounding: the values the loader's
// float32 widening gives (model_loader/fp8_checkpoint.py). x stays float32. (e4m3's NaN bytes,
// which no checkpoint holds, read as 480 on the F16C path.)
// Each thread's run of W rows is widened to those float32 values (widen_run): for up to
// DOT_ROWS rows of x a row at a time, into a buffer that stays in L1, dotted with each row of
// x (a vectorized float32 dot: decode); for more, a tile of NB rows at a time, which the BLAS's
// sgemm multiplies (prefill). So W is read once per call, 1 byte a weight.
#include <memory>

#include "blas.h"
#include "common.h"

#if defined(__F16C__) && defined(__AVX2__)
#if defined(__AVX512F__)
// GCC 12 takes the AVX-512 intrinsics' deliberately undefined operand for an uninitialized one
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#endif

namespace {

const long NB = 64;        // W rows per tile
const long DOT_ROWS = 4;   // rows of x up to which the tiles are dotted, not sgemm'd

// n e4m3 bytes q times s into t, float32. With F16C, eight at a time: e4m3's exponent and
// mantissa bits shifted into a float16's (s eeee mmm -> s 0eeee mmm0000000) are the value
// times 2^-8, subnormals included (neither has an implicit bit there), so the float16's
// float32 times 256 (exact) is the value, then times s: the same one rounding as the table's.
inline void widen_run(float* t, const uint8_t* q, long n, float s) {
  long k = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512 scale16 = _mm512_set1_ps(s), two8_16 = _mm512_set1_ps(256.0f);
  const __m256i sign16 = _mm256_set1_epi16((short)0x8000), low7_16 = _mm256_set1_epi16(0x7f);
  for (; k + 16 <= n; k += 16) {  // the same, sixteen at a time
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(q + k)));
    const __m256i h = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(b, 8), sign16),
                                      _mm256_slli_epi16(_mm256_and_si256(b, low7_16), 7));
    const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(h), two8_16);
    _mm512_storeu_ps(t + k, _mm512_mul_ps(v, scale16));
  }
#endif
#if defined(__F16C__) && defined(__AVX2__)
  const __m256 scale = _mm256_set1_ps(s), two8 = _mm256_set1_ps(256.0f);
  const __m128i sign = _mm_set1_epi16((short)0x8000), low7 = _mm_set1_epi16(0x7f);
  for (; k + 8 <= n; k += 8) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)(q + k)));
    const __m128i h = _mm_or_si128(_mm_and_si128(_mm_slli_epi16(b, 8), sign),
                                   _mm_slli_epi16(_mm_and_si128(b, low7), 7));
    const __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(h), two8);
    _mm256_storeu_ps(t + k, _mm256_mul_ps(v, scale));
  }
#endif
  for (; k < n; k++) t[k] = E4M3_VALUES.v[q[k]] * s;
}

// W rows r0 .. r0 + rows - 1 as float32 values into tile (rows, K).
void widen(float* tile, const uint8_t* w, const float* s, long r0, long rows, long K, long nbk) {
  const long bk = K / nbk;
  for (long r = 0; r < rows; r++)
    for (long b = 0; b < nbk; b++)
      widen_run(tile + r * K + b * bk, w + (r0 + r) * K + b * bk, bk, s[(r0 + r) * nbk + b]);
}

// a . b over n floats: four chains of 8 lanes (GCC leaves the plain reduction scalar here).
inline float dot(const float* a, const float* b, long n) {
  v8 acc[4] = {};
  long k = 0;
  for (; k + 32 <= n; k += 32)
    for (int j = 0; j < 4; j++) acc[j] += load8(a + k + 8 * j) * load8(b + k + 8 * j);
  for (; k + 8 <= n; k += 8) acc[0] += load8(a + k) * load8(b + k);
  const v8 v = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  float sum = 0.0f;
  for (int i = 0; i < 8; i++) sum += v[i];
  for (; k < n; k++) sum += a[k] * b[k];
  return sum;
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
      if (M > DOT_ROWS) {
        widen(tile.get(), w, scales, r0, rows, K, nbk);
        sgemm(ROW_MAJOR, NO_TRANS, TRANS, M, rows, K, 1.0f, x, K, tile.get(), K, 0.0f, out + r0,
              N);
        continue;
      }
      for (long r = 0; r < rows; r++) {  // decode: one row widened (in L1), dotted with each
        const float* b = tile.get();
        widen(tile.get(), w + (r0 + r) * K, scales + (r0 + r) * nbk, 0, 1, K, nbk);
        for (long m = 0; m < M; m++) out[m * N + r0 + r] = dot(x + m * K, b, K);
      }
    }
  });
  return 0;
}
