// Matrix products with Q8_0 weights (llama.cpp's and GGUF's 8-bit format): W is kept
// transposed, (N, K) int8, each output's row cut into blocks of 32 inputs with one float16
// scale each (w = q * d, d = absmax / 127: 34 bytes per 32 weights). x is quantized the same
// way as it comes in (per row, blocks of 32, one float32 scale each), so a block's product is
// a 32-term integer dot times two scales:
//   out[m, n] = sum over blocks b of dw[n, b] * dx[m, b] * sum_i qw[n, 32b + i] * qx[m, 32b + i]
// Every batch size computes this same function (of x quantized), in float32.
// M <= GEMV_MAX_ROWS (decode at small batch, bound by memory): each W row is read once and
// dotted with every row of x. AVX2: the integer dot of 32 int8 pairs is llama.cpp's trick,
// |w| (unsigned) times x with w's sign (vpsignb) through vpmaddubsw (pairs summed to int16:
// 2 * 127 * 127 fits) and vpmaddwd against ones (int32), then one float FMA per block with
// the two scales' product. Other CPUs: the same sums in a plain loop (the integer sums are
// exact either way; only the float additions' order differs).
// More rows (prefill, large batches): x's quantized values and a tile of NB W rows are
// expanded to float32 and multiplied by the BLAS's sgemm, since on AVX2 without VNNI the
// integer dot does no more multiplies per instruction than a float32 FMA.
// Threads: one task per run of W's rows (the GEMV), per slice of NB rows (the tiles).
#include <memory>
#include <vector>

#include "blas.h"
#include "common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

const long QK = 32;     // weights per block
const long NB = 128;    // W rows per float32 tile
const long GEMV_WORK = 1L << 19;

// x (M, K) -> qx (M, K) int8, dx (M, K / QK) float32: d = absmax / 127, q = round(x / d)
// (ties to even), a block of zeros d = 0, q = 0.
void quantize_rows(int8_t* qx, float* dx, const float* x, long M, long K) {
  for (long m = 0; m < M; m++)
    for (long b = 0; b < K / QK; b++) {
      const float* v = x + m * K + b * QK;
      float amax = 0.0f;
#pragma omp simd reduction(max : amax)
      for (int i = 0; i < QK; i++) amax = std::max(amax, std::fabs(v[i]));
      const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
      int8_t* q = qx + m * K + b * QK;
#pragma omp simd
      for (int i = 0; i < QK; i++) q[i] = (int8_t)std::nearbyint(v[i] * id);
      dx[m * (K / QK) + b] = d;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Eight int32 sums of a 32-pair block: |w| * (x signed by w), pairs to int16, pairs to int32.
inline __m256 block_dot(__m256i aw, __m256i w, const int8_t* x) {
  const __m256i sx = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)x), w);
  const __m256i p16 = _mm256_maddubs_epi16(aw, sx);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

// out[m * N] for the MR rows of x: W row w (K) dotted with each. (Two W rows at a time,
// sharing x's loads, measured slower: two streams per thread, and spills at 8 rows.)
template <int MR>
void dot_row(float* out, long N, const int8_t* w, const f16* dw, const int8_t* qx,
             const float* dx, long K) {
  __m256 acc[MR];
  for (int m = 0; m < MR; m++) acc[m] = _mm256_setzero_ps();
  const long nb = K / QK;
  for (long b = 0; b < nb; b++) {
    const __m256i wv = _mm256_loadu_si256((const __m256i*)(w + b * QK));
    const __m256i aw = _mm256_sign_epi8(wv, wv);
    const float d = (float)dw[b];
    for (int m = 0; m < MR; m++) {
      const __m256 s = _mm256_set1_ps(d * dx[m * nb + b]);
      acc[m] = _mm256_fmadd_ps(block_dot(aw, wv, qx + m * K + b * QK), s, acc[m]);
    }
  }
  for (int m = 0; m < MR; m++) out[m * N] = hsum(acc[m]);
}
#else
template <int MR>
void dot_row(float* out, long N, const int8_t* w, const f16* dw, const int8_t* qx,
             const float* dx, long K) {
  const long nb = K / QK;
  for (int m = 0; m < MR; m++) {
    float acc = 0.0f;
    for (long b = 0; b < nb; b++) {
      int32_t s = 0;
      for (int i = 0; i < QK; i++) s += (int32_t)w[b * QK + i] * qx[m * K + b * QK + i];
      acc += (float)s * ((float)dw[b] * dx[m * nb + b]);
    }
    out[m * N] = acc;
  }
}
#endif

// out (MR, N): every W row dotted with the MR quantized rows of x, the rows split over nt.
template <int MR>
void gemv(float* out, const int8_t* qx, const float* dx, const int8_t* w, const f16* dw, long K,
          long N, int nt) {
  const long per = (N + nt - 1) / nt;
  const long nb = K / QK;
  on_threads(nt, [&](int t) {
    for (long n = t * per; n < std::min(N, (t + 1) * per); n++)
      dot_row<MR>(out + n, N, w + n * K, dw + n * nb, qx, dx, K);
  });
}

// out (M, N) = x~ (M, K) @ W^T through float32 tiles of NB W rows and sgemm.
void gemm_tiles(float* out, const int8_t* qx, const float* dx, const int8_t* w, const f16* dw,
                long M, long K, long N, int nt) {
  const long nb = K / QK;
  std::unique_ptr<float[]> xf(new float[M * K]);  // (M, K): x's quantized values
  for (long i = 0; i < M * K; i++) xf[i] = qx[i] * dx[i / QK];
  const long per = ((N + nt - 1) / nt + 7) / 8 * 8;
  on_threads(nt, [&](int t) {
    const long n0 = std::min(N, t * per), n1 = std::min(N, n0 + per);
    std::unique_ptr<float[]> tile(new float[NB * K]);  // (NB, K)
    for (long r0 = n0; r0 < n1; r0 += NB) {
      const long rows = std::min(NB, n1 - r0);
      for (long r = 0; r < rows; r++)
        for (long b = 0; b < nb; b++) {
          const float d = (float)dw[(r0 + r) * nb + b];
          const int8_t* q = w + (r0 + r) * K + b * QK;
          float* tr = tile.get() + r * K + b * QK;
#pragma omp simd
          for (int i = 0; i < QK; i++) tr[i] = q[i] * d;
        }
      sgemm(ROW_MAJOR, NO_TRANS, TRANS, M, rows, K, 1.0f, xf.get(), K, tile.get(), K, 0.0f,
            out + r0, N);
    }
  });
}

}  // namespace

// out: (M, N) float32; x: (M, K) float32; w: (N, K) int8; dw: (N, K / 32) float16 bits;
// K a multiple of 32; all row-major contiguous. Returns 1 (nothing done) if K is not.
extern "C" int matmul_q8_0(float* out, const float* x, const int8_t* w, const f16* dw, long M,
                           long K, long N, int threads) {
  if (K % QK) return 1;
  if (M == 0) return 0;
  std::unique_ptr<int8_t[]> qx(new int8_t[M * K]);
  std::unique_ptr<float[]> dx(new float[M * K / QK]);
  quantize_rows(qx.get(), dx.get(), x, M, K);
  const long work = 2 * M * K * N;
  if (M > GEMV_MAX_ROWS) {
    const long nt = std::min<long>(threads_for(work, threads), std::max(1L, N / NB));
    gemm_tiles(out, qx.get(), dx.get(), w, dw, M, K, N, (int)nt);
    return 0;
  }
  const int nt = (int)std::min<long>(work < GEMV_WORK ? 1 : threads, N);
  switch (M) {
    case 1: gemv<1>(out, qx.get(), dx.get(), w, dw, K, N, nt); break;
    case 2: gemv<2>(out, qx.get(), dx.get(), w, dw, K, N, nt); break;
    case 3: gemv<3>(out, qx.get(), dx.get(), w, dw, K, N, nt); break;
    case 4: gemv<4>(out, qx.get(), dx.get(), w, dw, K, N, nt); break;
    case 5: gemv<5>(out, qx.get(), dx.get(), w, dw, K, N, nt); break;
    case 6: gemv<6>(out, qx.get(), dx.get(), w, dw, K, N, nt); break;
    case 7: gemv<7>(out, qx.get(), dx.get(), w, dw, K, N, nt); break;
    default: gemv<8>(out, qx.get(), dx.get(), w, dw, K, N, nt); break;
  }
  return 0;
}
