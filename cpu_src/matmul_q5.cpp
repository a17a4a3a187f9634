// Matrix products with GGUF's 5-bit weights as the file stores them: W transposed, (N, K),
// each row a run of blocks of 32 values (model_loader/kquants.py lays them out):
//   Q5_0 (22 bytes): d, 4 bytes of fifth bits, 16 bytes of nibbles: w = d (q - 16);
//   Q5_1 (24 bytes): d, m, the same: w = d q + m.
// (llama.cpp's fallbacks where a row is not whole super-blocks of 256: SmolLM2's 576.)
// x is quantized once per product, per row and 32 values: dx = absmax / 127, qx = round(x /
// dx) (ties to even), sx = sum(qx); a block's product is
//   Q5_0: dx d (sum q qx - 16 sx)      Q5_1: dx (d sum q qx + m sx)
// with the q unpacked to bytes 0..31. AVX2: vpmaddubsw and vpmaddwd; AVX512-VNNI: vpdpbusd;
// other CPUs: a plain loop (the integer sums are exact either way). Every batch size computes
// this same function: up to INT_MAX_ROWS rows of x each W row is unpacked once and dotted with
// every row; more rows (prefill) go through float32 tiles of NB W rows and the BLAS's sgemm.
// Threads: one task per run of W's rows.
#include <memory>
#include <vector>

#include "blas.h"
#include "common.h"
#include "dequant_tiles.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#include "int8_dots.h"  // hsum

namespace {

const long QK = 32;
const long NB = 64;
const long INT_MAX_ROWS = 64;  // rows of x up to which the integer dots run
const long GROUP = 16;         // rows of x a W row meets at once (dot_row's sums in registers)
const long GEMV_WORK = 1L << 19;

enum { Q5_0 = 0, Q5_1 = 1 };
const long BLOCK_BYTES[2] = {22, 24};

inline float half(const uint8_t* p) {
  f16 h;
  std::memcpy(&h, p, 2);
  return (float)h;
}

// A block's 32 q (0..31) into q; its d and the constant term's factor (Q5_0: -16 d; Q5_1: m).
template <int F> inline void unpack(const uint8_t* b, uint8_t* q, float& d, float& m) {
  const uint8_t* p = b + (F == Q5_0 ? 2 : 4);
  uint32_t qh;
  std::memcpy(&qh, p, 4);
  d = half(b);
  m = F == Q5_0 ? -16.0f * d : half(b + 2);
  for (int j = 0; j < 16; j++) {
    q[j] = (p[4 + j] & 15) | (((qh >> j) & 1) << 4);
    q[j + 16] = (p[4 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
  }
}

// x (M, K) -> qx int8, dx and sx (M, K/32): sx the sum of the block's qx.
void quantize_rows(int8_t* qx, float* dx, int32_t* sx, const float* x, long M, long K) {
  for (long m = 0; m < M; m++)
    for (long b = 0; b < K / QK; b++) {
      int8_t* q = qx + m * K + b * QK;
      const float d = quantize_block<QK>(q, x + m * K + b * QK);
      int s = 0;
#pragma omp simd reduction(+ : s)
      for (int i = 0; i < QK; i++) s += q[i];
      dx[m * (K / QK) + b] = d;
      sx[m * (K / QK) + b] = s;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
// A block's 32 q (0..31) in a register: byte i of the 16 nibble bytes gives values i (low) and
// i + 16 (high); bit i of qh, as 0x10 in byte i: qh's byte i / 8 broadcast to each byte, kept
// where its bit i % 8 is set.
inline __m256i block_q(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128((const __m128i*)(p + 4));
  const __m256i low = _mm256_set1_epi8(15);
  const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), low);
  uint32_t qh;
  std::memcpy(&qh, p, 4);
  const __m256i which = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                          0x0101010101010101, 0);
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), which);
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
  return _mm256_or_si256(nib, _mm256_and_si256(set, _mm256_set1_epi8(16)));
}

// out[m * N] for the M rows of x: one W row against each, q unpacked in registers; a row's
// sums in one float32 vector chain (its bits do not depend on the rows beside it).
template <int F>
void dot_row(float* out, long N, const uint8_t* w, const int8_t* qx, const float* dx,
             const int32_t* sx, long M, long K, float* acc) {
  const long nb = K / QK;
  __m256 vacc[GROUP];
  for (long m = 0; m < M; m++) vacc[m] = _mm256_setzero_ps(), acc[m] = 0.0f;
  for (long b = 0; b < nb; b++) {
    const uint8_t* blk = w + b * BLOCK_BYTES[F];
    const float d = half(blk), c = F == Q5_0 ? -16.0f * d : half(blk + 2);
    const __m256i q = block_q(blk + (F == Q5_0 ? 2 : 4));
    for (long m = 0; m < M; m++) {
      const __m256i xv = _mm256_loadu_si256((const __m256i*)(qx + m * K + b * QK));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
      const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, xv);
#else
      const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), _mm256_set1_epi16(1));
#endif
      const float e = dx[m * nb + b];
      vacc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * e), vacc[m]);
      acc[m] += c * e * (float)sx[m * nb + b];
    }
  }
  for (long m = 0; m < M; m++) out[m * N] = hsum(vacc[m]) + acc[m];
}
#else
// out[m * N] for the M rows of x: one W row against each, a block unpacked once for all M.
template <int F>
void dot_row(float* out, long N, const uint8_t* w, const int8_t* qx, const float* dx,
             const int32_t* sx, long M, long K, float* acc) {
  const long nb = K / QK;
  uint8_t q[QK];
  for (long m = 0; m < M; m++) acc[m] = 0.0f;
  for (long b = 0; b < nb; b++) {
    float d, c;
    unpack<F>(w + b * BLOCK_BYTES[F], q, d, c);
    for (long m = 0; m < M; m++) {
      const int8_t* x = qx + m * K + b * QK;
      int32_t is = 0;
#pragma omp simd reduction(+ : is)
      for (int i = 0; i < QK; i++) is += (int32_t)q[i] * x[i];
      acc[m] += dx[m * nb + b] * (d * (float)is + c * (float)sx[m * nb + b]);
    }
  }
  for (long m = 0; m < M; m++) out[m * N] = acc[m];
}
#endif

// out (M, N) with the integer dots, W's rows split over nt threads; each W row against the rows
// of x GROUP at a time (its bytes stay in L1 from one group to the next).
template <int F>
void gemv(float* out, const int8_t* qx, const float* dx, const int32_t* sx, const uint8_t* w,
          long M, long K, long N, int nt) {
  const long per = (N + nt - 1) / nt, row = K / QK * BLOCK_BYTES[F], nb = K / QK;
  on_threads(nt, [&](int t) {
    float acc[GROUP];
    for (long n = t * per; n < std::min(N, (t + 1) * per); n++)
      for (long m = 0; m < M; m += GROUP)
        dot_row<F>(out + m * N + n, N, w + n * row, qx + m * K, dx + m * nb, sx + m * nb,
                   std::min(GROUP, M - m), K, acc);
  });
}

template <int F> void dequant_row(float* out, const uint8_t* w, long K) {
  uint8_t q[QK];
  for (long b = 0; b < K / QK; b++) {
    float d, c;
    unpack<F>(w + b * BLOCK_BYTES[F], q, d, c);
    for (int i = 0; i < QK; i++) out[b * QK + i] = d * q[i] + c;
  }
}

template <int F>
void gemm_tiles(float* out, const int8_t* qx, const float* dx, const uint8_t* w, long M, long K,
                long N, int nt) {
  const long row = K / QK * BLOCK_BYTES[F];
  gemm_dequant_tiles<QK>(out, qx, dx, M, K, N, nt,
                         [&](float* r, long n) { dequant_row<F>(r, w + n * row, K); });
}

template <int F>
void matmul_5(float* out, const float* x, const uint8_t* w, long M, long K, long N, int threads) {
  std::unique_ptr<int8_t[]> qx(new int8_t[M * K]);
  std::unique_ptr<float[]> dx(new float[M * K / QK]);
  std::unique_ptr<int32_t[]> sx(new int32_t[M * K / QK]);
  quantize_rows(qx.get(), dx.get(), sx.get(), x, M, K);
  const long work = 2 * M * K * N;
  if (M > INT_MAX_ROWS) {
    const long nt = std::min<long>(threads_for(work, threads), std::max(1L, N / NB));
    gemm_tiles<F>(out, qx.get(), dx.get(), w, M, K, N, (int)nt);
    return;
  }
  const int nt = (int)std::min<long>(work < GEMV_WORK ? 1 : threads, N);
  gemv<F>(out, qx.get(), dx.get(), sx.get(), w, M, K, N, nt);
}

}  // namespace

// out: (M, N) float32; x: (M, K) float32; w: (N, K / 32 blocks of the format) bytes; format:
// 0 Q5_0, 1 Q5_1; all row-major contiguous. Returns 1 (nothing done) for a K that is not a
// multiple of 32, or an unknown format.
extern "C" int matmul_q5(float* out, const float* x, const uint8_t* w, int format, long M, long K,
                         long N, int threads) {
  if (K % QK || format < Q5_0 || format > Q5_1) return 1;
  if (M == 0) return 0;
  if (format == Q5_0)
    matmul_5<Q5_0>(out, x, w, M, K, N, threads);
  else
    matmul_5<Q5_1>(out, x, w, M, K, N, threads);
  return 0;
}
