// Matrix products with GGUF's IQ4_NL and IQ4_XS weights as the file stores them
// (model_loader/iq4.py): W transposed, (N, K), each row a run of blocks whose values are 4-bit
// indices into KV, sixteen int8 levels:
//   IQ4_NL (32 values, 18 bytes): d, 16 bytes of indices (byte j: value j low, j + 16 high):
//          w = d KV[q];
//   IQ4_XS (256 values, 136 bytes): d, 8 six-bit scales ls_j (2 + 4 bytes), then 8 runs of
//          32 values in IQ4_NL's order: w = d (ls_j - 32) KV[q].
// x is quantized once per product, per row and block of W: dx = absmax / 127, qx = round(x /
// dx) (ties to even), per 32 values for IQ4_NL (llama.cpp's Q8_0) and per 256 for IQ4_XS (its
// Q8_K); a block's product is integers and one float factor:
//   IQ4_NL: dx d sum(KV[q] qx)      IQ4_XS: dx d sum_j (ls_j - 32) sum(KV[q] qx)
// (|sum| < 2^31). AVX-512: 64 values a register (iq4_dot_avx512.h). AVX2: a run of 16 index
// bytes as 32 indices in value order (the high nibbles shifted into the upper 128 bits),
// vpshufb into KV, then the signed product by the sign trick, |KV| times qx with KV's sign
// (vpmaddubsw: a pair's sum fits int16), and vpmaddwd against ls - 32 (IQ4_NL: 1).
// aarch64: vqtbl1q_s8 into KV, then vdotq_s32 (or widening multiplies). Other CPUs: a plain
// loop. The integer sums are exact on every path; only the float additions' order differs.
// Every batch size computes this same function: up to INT_MAX_ROWS rows of x each W row is read
// once and dotted with the rows GROUP at a time; more rows (prefill) go through float32 tiles
// of W (d KV[q], IQ4_XS (d (ls - 32)) KV[q]) and the BLAS's sgemm.
// Threads: one task per run of W's rows.
#include <memory>
#include <vector>

#include "blas.h"
#include "common.h"
#include "dequant_tiles.h"

#if defined(__AVX2__) && defined(__FMA__)
#if defined(__AVX512F__)
// GCC 12 takes the AVX-512 intrinsics' deliberately undefined operand for an uninitialized one
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#define IQ_X86 1
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif
#include "int8_dots.h"  // hsum, dot16

namespace {

enum { IQ4_NL = 0, IQ4_XS = 1 };
constexpr long VALUES[2] = {32, 256}, BYTES[2] = {18, 136};  // a block's values, bytes
const long NB = 64;  // W rows per thread at least, in the tiles' product
// W rows per float32 tile (each sgemm call packs all of x anew: fewer, larger calls, as the
// k-quants')
const long TILE = 256;
const long INT_MAX_ROWS = 64;  // rows of x up to which the integer dots run
const int GROUP = 4;           // rows of x a W row meets at once (their sums in registers)
const long GEMV_WORK = 1L << 19;
const int8_t KV[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

inline float half(const uint8_t* p) {
  f16 h;
  std::memcpy(&h, p, 2);
  return (float)h;
}

// A block's d and its runs' integer scales (IQ4_NL: one run, scale 1), and where each run's
// 16 index bytes start.
template <int F> inline float head(const uint8_t* b, int* ls, const uint8_t** qs) {
  if constexpr (F == IQ4_NL) {
    ls[0] = 1, qs[0] = b + 2;
  } else {
    const int h = b[2] | b[3] << 8;
    for (int j = 0; j < 8; j++) {
      ls[j] = (((b[4 + j / 2] >> 4 * (j % 2)) & 15) | ((h >> 2 * j) & 3) << 4) - 32;
      qs[j] = b + 8 + 16 * j;
    }
  }
  return half(b);
}

// x (M, K) -> qx (M, K) int8, dx (M, K/Q): d = absmax / 127, q = round(x / d), per Q values.
template <long Q> void quantize_rows(int8_t* qx, float* dx, const float* x, long M, long K) {
  for (long m = 0; m < M; m++)
    for (long b = 0; b < K / Q; b++)
      dx[m * (K / Q) + b] = quantize_block<Q>(qx + m * K + b * Q, x + m * K + b * Q);
}

#if defined(IQ_X86)
// 16 index bytes -> their 32 KV values in value order (low nibbles, then high).
inline __m256i levels(const uint8_t* p) {
  const __m128i kv = _mm_loadu_si128((const __m128i*)KV);
  const __m256i table = _mm256_broadcastsi128_si256(kv);
  const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)p));
  const __m256i n = _mm256_srlv_epi64(v, _mm256_set_epi64x(4, 4, 0, 0));
  return _mm256_shuffle_epi8(table, _mm256_and_si256(n, _mm256_set1_epi8(15)));
}

// acc + ls * (the products of the 32 levels kv (ukv = |kv|) with the 32 qx at x), summed per
// 32-bit lane.
template <int F>
inline __m256i dot32(__m256i acc, __m256i kv, __m256i ukv, const int8_t* x, int ls) {
  const __m256i sx = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)x), kv);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  if constexpr (F == IQ4_NL) return _mm256_dpbusd_epi32(acc, ukv, sx);
  return _mm256_dpwssd_epi32(acc, _mm256_maddubs_epi16(ukv, sx), _mm256_set1_epi16((short)ls));
#else
  const __m256i p16 = _mm256_maddubs_epi16(ukv, sx);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p16, _mm256_set1_epi16((short)ls)));
#endif
}

#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define IQ_AVX512 1
#include "iq4_dot_avx512.h"

// out[m * N] for the MR rows of x: one W row (its blocks at w) against each; a row's sums in
// one chain of float32 vectors, whatever MR (its bits do not depend on the rows beside it).
template <int F, int MR>
void dot_row(float* out, long N, const uint8_t* w, const int8_t* qx, const float* dx, long K) {
  if constexpr (F == IQ4_XS)
    iq4::dot_row_xs<MR>(out, N, w, qx, dx, K);
  else
    iq4::dot_row_nl<MR>(out, N, w, qx, dx, K);
}
#else
// out[m * N] for the MR rows of x: one W row (its blocks at w) against each; a row's sums in
// one chain of float32 vectors, whatever MR (its bits do not depend on the rows beside it).
template <int F, int MR>
void dot_row(float* out, long N, const uint8_t* w, const int8_t* qx, const float* dx, long K) {
  constexpr long Q = VALUES[F], R = Q / 32;
  const long nb = K / Q;
  __m256 acc[MR];
  for (int m = 0; m < MR; m++) acc[m] = _mm256_setzero_ps();
  for (long b = 0; b < nb; b++) {
    int ls[8];
    const uint8_t* qs[8];
    const float d = head<F>(w + b * BYTES[F], ls, qs);
    __m256i isum[MR];
    for (int m = 0; m < MR; m++) isum[m] = _mm256_setzero_si256();
    for (long j = 0; j < R; j++) {
      const __m256i kv = levels(qs[j]), ukv = _mm256_abs_epi8(kv);
      for (int m = 0; m < MR; m++)
        isum[m] = dot32<F>(isum[m], kv, ukv, qx + m * K + b * Q + 32 * j, ls[j]);
    }
    for (int m = 0; m < MR; m++)
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]), _mm256_set1_ps(d * dx[m * nb + b]),
                               acc[m]);
  }
  for (int m = 0; m < MR; m++) out[m * N] = hsum(acc[m]);
}
#endif
#elif defined(__ARM_NEON)
template <int F, int MR>
void dot_row(float* out, long N, const uint8_t* w, const int8_t* qx, const float* dx, long K) {
  constexpr long Q = VALUES[F], R = Q / 32;
  const long nb = K / Q;
  const int8x16_t table = vld1q_s8(KV);
  float32x4_t acc[MR];
  for (int m = 0; m < MR; m++) acc[m] = vdupq_n_f32(0.0f);
  for (long b = 0; b < nb; b++) {
    int ls[8];
    const uint8_t* qs[8];
    const float d = head<F>(w + b * BYTES[F], ls, qs);
    int32x4_t isum[MR];
    for (int m = 0; m < MR; m++) isum[m] = vdupq_n_s32(0);
    for (long j = 0; j < R; j++) {
      const uint8x16_t v = vld1q_u8(qs[j]);
      const int8x16_t lo = vqtbl1q_s8(table, vandq_u8(v, vdupq_n_u8(15)));
      const int8x16_t hi = vqtbl1q_s8(table, vshrq_n_u8(v, 4));
      for (int m = 0; m < MR; m++) {
        const int8_t* x = qx + m * K + b * Q + 32 * j;
        const int32x4_t dot = dot16(dot16(vdupq_n_s32(0), lo, vld1q_s8(x)), hi, vld1q_s8(x + 16));
        isum[m] = vmlaq_n_s32(isum[m], dot, ls[j]);
      }
    }
    for (int m = 0; m < MR; m++)
      acc[m] = vfmaq_n_f32(acc[m], vcvtq_f32_s32(isum[m]), d * dx[m * nb + b]);
  }
  for (int m = 0; m < MR; m++) out[m * N] = vaddvq_f32(acc[m]);
}
#else
// The portable code: a run's indices looked up once for all MR rows, then loops the compiler
// vectorizes.
template <int F, int MR>
void dot_row(float* out, long N, const uint8_t* w, const int8_t* qx, const float* dx, long K) {
  constexpr long Q = VALUES[F], R = Q / 32;
  const long nb = K / Q;
  float acc[MR] = {};
  for (long b = 0; b < nb; b++) {
    int ls[8];
    const uint8_t* qs[8];
    const float d = head<F>(w + b * BYTES[F], ls, qs);
    int32_t isum[MR] = {};
    for (long j = 0; j < R; j++) {
      int8_t v[32];
      for (int i = 0; i < 16; i++) v[i] = KV[qs[j][i] & 15], v[i + 16] = KV[qs[j][i] >> 4];
      for (int m = 0; m < MR; m++) {
        const int8_t* x = qx + m * K + b * Q + 32 * j;
        int32_t dot = 0;
#pragma omp simd reduction(+ : dot)
        for (int i = 0; i < 32; i++) dot += v[i] * x[i];
        isum[m] += ls[j] * dot;
      }
    }
    for (int m = 0; m < MR; m++) acc[m] += (float)isum[m] * (d * dx[m * nb + b]);
  }
  for (int m = 0; m < MR; m++) out[m * N] = acc[m];
}
#endif

// dot_row for r (1..MR) rows of x.
template <int F, int MR = GROUP>
void dot_rows(long r, float* out, long N, const uint8_t* w, const int8_t* qx, const float* dx,
              long K) {
  if constexpr (MR > 1) {
    if (r < MR) return dot_rows<F, MR - 1>(r, out, N, w, qx, dx, K);
  }
  dot_row<F, MR>(out, N, w, qx, dx, K);
}

// out (M, N) with the integer dots, W's rows split over nt threads; each W row against the rows
// of x GROUP at a time (its bytes stay in L1 from one group to the next).
template <int F>
void gemv(float* out, const int8_t* qx, const float* dx, const uint8_t* w, long M, long K, long N,
          int nt) {
  const long per = (N + nt - 1) / nt, nb = K / VALUES[F], row = nb * BYTES[F];
  on_threads(nt, [&](int t) {
    for (long n = t * per; n < std::min(N, (t + 1) * per); n++)
      for (long m = 0; m < M; m += GROUP)
        dot_rows<F>(std::min<long>(GROUP, M - m), out + m * N + n, N, w + n * row, qx + m * K,
                    dx + m * nb, K);
  });
}

// One W row (K values) as float32: d KV[q] (IQ4_XS: (d (ls - 32)) KV[q]), as
// model_loader/iq4.py computes them.
template <int F> void dequant_row(float* out, const uint8_t* w, long K) {
  constexpr long Q = VALUES[F];
  for (long b = 0; b < K / Q; b++) {
    int ls[8];
    const uint8_t* qs[8];
    const float d = head<F>(w + b * BYTES[F], ls, qs);
    for (long j = 0; j < Q / 32; j++) {
      const float s = F == IQ4_NL ? d : d * (float)ls[j];
      float* o = out + b * Q + 32 * j;
      for (int i = 0; i < 16; i++) o[i] = s * KV[qs[j][i] & 15], o[i + 16] = s * KV[qs[j][i] >> 4];
    }
  }
}

template <int F>
void matmul_f(float* out, const float* x, const uint8_t* w, long M, long K, long N, int threads) {
  constexpr long Q = VALUES[F];
  std::unique_ptr<int8_t[]> qx(new int8_t[M * K]);
  std::unique_ptr<float[]> dx(new float[M * K / Q]);
  quantize_rows<Q>(qx.get(), dx.get(), x, M, K);
  const long work = 2 * M * K * N;
  if (M > INT_MAX_ROWS) {
    const long nt = std::min<long>(threads_for(work, threads), std::max(1L, N / NB));
    const long row = K / Q * BYTES[F];
    gemm_dequant_tiles<Q>(out, qx.get(), dx.get(), M, K, N, (int)nt,
                          [&](float* r, long n) { dequant_row<F>(r, w + n * row, K); }, TILE);
    return;
  }
#if defined(IQ_AVX512)
  if constexpr (F == IQ4_XS) iq4::xs_order(qx.get(), M, K);
#endif
  const int nt = (int)std::min<long>(work < GEMV_WORK ? 1 : threads, N);
  gemv<F>(out, qx.get(), dx.get(), w, M, K, N, nt);
}

}  // namespace

// out: (M, N) float32; x: (M, K) float32; w: (N, K / values a block) blocks; format: 0 IQ4_NL
// (32 values, 18 bytes), 1 IQ4_XS (256, 136); all row-major contiguous. Returns 1 (nothing done)
// for a K that is not whole blocks, or an unknown format.
extern "C" int matmul_iq4(float* out, const float* x, const uint8_t* w, int format, long M,
                          long K, long N, int threads) {
  if (format < IQ4_NL || format > IQ4_XS || K % VALUES[format]) return 1;
  if (M == 0) return 0;
  if (format == IQ4_NL)
    matmul_f<IQ4_NL>(out, x, w, M, K, N, threads);
  else
    matmul_f<IQ4_XS>(out, x, w, M, K, N, threads);
  return 0;
}
