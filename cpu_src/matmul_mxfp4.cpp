// Matrix products with MXFP4 weights (gpt-oss's experts) as a GGUF file stores them
// (model_loader/mxfp4.py): W transposed, (N, K), each row a run of 17-byte blocks of 32 values,
// the e8m0 exponent e then 16 bytes of e2m1 codes (byte j: value j low, value j + 16 high):
// w = KV[code] 2^(e - 128), KV the e2m1 values doubled (0, 1, 2, 3, 4, 6, 8, 12 and their
// negatives), exact integers, as llama.cpp takes them. x is quantized once per product, per row
// and 32 values: dx = absmax / 127, qx = round(x / dx) (ties to even); a block's product is
//   dx 2^(e - 128) sum(KV[code] qx)
// an integer dot and one float factor (2^(e - 128) dx, a W row's ahead of its dots). AVX2 and
// AVX-512: two blocks a step, as matmul_blocks.cpp takes Q4_0's: their codes in one 32-byte
// register of low nibbles and one of high, each through vpshufb into KV + 12 (unsigned,
// 0..24), times qx (reordered to match, once per product) by vpmaddubsw and vpmaddwd
// (AVX512-VNNI: vpdpbusd), each 32-bit lane starting from -12 times the sum of its x values,
// so the lanes hold sum(KV qx) exactly, lanes 0-3 the first block's. aarch64: vqtbl1q_s8
// into KV, then vdotq_s32 (or widening multiplies). Other CPUs: a plain loop. The integer sums
// are exact on every path; only the float additions' order differs. Every batch size computes
// this same function: up to INT_MAX_ROWS rows of x each W row is read once and dotted with the
// rows GROUP at a time; more rows (prefill) go through float32 tiles of W and the BLAS's sgemm.
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
#define MX_X86 1
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif
// hsum, dot2 (KV + 12 <= 24: two pairs of products fit int16), dot16
#include "int8_dots.h"

namespace {

const long QK = 32, BLOCK = 17;  // values and bytes of a block
const long NB = 64;              // W rows per thread at least, in the tiles' product
const long INT_MAX_ROWS = 64;    // rows of x up to which the integer dots run
const int GROUP = 8;             // rows of x a W row meets at once (their sums in registers)
const long GEMV_WORK = 1L << 19;
const int8_t KV[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// 2^(e - 128) for each e8m0 byte e, as float32 (ggml's e8m0_to_fp32_half; e 0 and 1
// subnormal), made at compile time: one load a block.
struct HalfScales {
  float v[256];
  constexpr HalfScales() : v() {
    for (int e = 0; e < 256; e++) {
      float x = 1.0f;
      for (int i = e; i < 128; i++) x *= 0.5f;
      for (int i = 128; i < e; i++) x *= 2.0f;
      v[e] = x;
    }
  }
};
static constexpr HalfScales HALF{};

// A W row's factors, ahead of its dots: ds (MR, nb) = 2^(e_b - 128) dx[m, b]; the row's
// 2^(e_b - 128) first, in ds's room past them (ds: room for (MR + 1, nb)), so that the
// products run over contiguous floats.
inline void row_scales(float* ds, const uint8_t* w, const float* dx, long nb, int MR) {
  float* h = ds + MR * nb;  // (nb,)
  for (long b = 0; b < nb; b++) h[b] = HALF.v[w[b * BLOCK]];
  for (int m = 0; m < MR; m++)
#pragma omp simd
    for (long b = 0; b < nb; b++) ds[m * nb + b] = h[b] * dx[m * nb + b];
}

// A block's 32 codes as their KV values, in value order.
inline void unpack(const uint8_t* blk, int8_t* v) {
  for (int j = 0; j < 16; j++) {
    v[j] = KV[blk[1 + j] & 15];
    v[j + 16] = KV[blk[1 + j] >> 4];
  }
}

// x (M, K) -> qx (M, K) int8, dx (M, K/32): d = absmax / 127, q = round(x / d).
void quantize_rows(int8_t* qx, float* dx, const float* x, long M, long K) {
  for (long m = 0; m < M; m++)
    for (long b = 0; b < K / QK; b++)
      dx[m * (K / QK) + b] = quantize_block<QK>(qx + m * K + b * QK, x + m * K + b * QK);
}

#if defined(MX_X86)
// x for the x86 dots: each pair of blocks' 64 qx reordered to [b0[0..15], b1[0..15],
// b0[16..31], b1[16..31]], the order of the pair's codes as pair_u lays them out (low nibbles,
// then high), and xc (M, K/32, 8) the lanes' starts, -12 times the sum of the x values each
// 32-bit lane meets (KV + 12 in the products), at the pair's first block; an odd count's last
// block keeps its own order, its lanes 4 consecutive values each.
void pair_blocks(int8_t* qx, int32_t* xc, long M, long K) {
  const long nb = K / QK;
  for (long m = 0; m < M; m++)
    for (long b = 0; b < nb; b += 2) {
      int8_t* v = qx + m * K + b * QK;
      int32_t* c = xc + (m * nb + b) * 8;
      if (b + 1 == nb) {
        for (int l = 0; l < 8; l++)
          c[l] = -12 * (v[4 * l] + v[4 * l + 1] + v[4 * l + 2] + v[4 * l + 3]);
        break;
      }
      int8_t t[64];
      for (int h = 0; h < 4; h++) std::memcpy(t + h * 16, v + (h % 2 * 2 + h / 2) * 16, 16);
      std::memcpy(v, t, 64);
      for (int l = 0; l < 8; l++) {
        int sum = 0;
        for (int i = 0; i < 4; i++) sum += t[4 * l + i] + t[32 + 4 * l + i];
        c[l] = -12 * sum;
      }
    }
}

// KV + 12 per code, in each 16-byte lane for vpshufb.
#define MX_TABLE 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0

// Two sets of 16 code bytes (block b's at p, b + 1's at p + BLOCK) as KV + 12: lo their low
// nibbles (values 0..15 of b, then of b + 1), hi their high ones (values 16..31).
inline void pair_u(const uint8_t* p, __m256i& lo, __m256i& hi) {
  const __m256i table = _mm256_setr_epi8(MX_TABLE, MX_TABLE), low = _mm256_set1_epi8(15);
  const __m256i v = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)p)),
      _mm_loadu_si128((const __m128i*)(p + BLOCK)), 1);
  lo = _mm256_shuffle_epi8(table, _mm256_and_si256(v, low));
  hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
}

// out[m * N] for the MR rows of x (in pair_blocks' order): one W row (its blocks at w) against
// each; ds: room for (MR + 1, nb). Two blocks a step, lanes 0-3 the first, 4-7 the second; a
// row's sums in one chain of float32 vectors, whatever MR (its bits do not depend on the rows
// beside it).
template <int MR>
void dot_row(float* out, long N, const uint8_t* w, const int8_t* qx, const int32_t* xc,
             const float* dx, long K, float* ds) {
  const long nb = K / QK;
  row_scales(ds, w, dx, nb, MR);
  const __m256i halves = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0);
  __m256 acc[MR];
  for (int m = 0; m < MR; m++) acc[m] = _mm256_setzero_ps();
  long b = 0;
  for (; b + 2 <= nb; b += 2) {
    __m256i lo, hi;
    pair_u(w + b * BLOCK + 1, lo, hi);
    for (int m = 0; m < MR; m++) {
      const int8_t* x = qx + m * K + b * QK;
      const __m256i c = _mm256_loadu_si256((const __m256i*)(xc + (m * nb + b) * 8));
      const __m256i dot = dot2(c, lo, x, hi, x + 32);
      const __m256 d2 = _mm256_permutevar_ps(
          _mm256_castpd_ps(_mm256_broadcast_sd((const double*)(ds + m * nb + b))), halves);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), d2, acc[m]);
    }
  }
  if (b < nb) {  // an odd count's last block, in its own order: the codes in both halves
    const __m256i table = _mm256_setr_epi8(MX_TABLE, MX_TABLE), zero = _mm256_setzero_si256();
    const __m128i q = _mm_loadu_si128((const __m128i*)(w + b * BLOCK + 1));
    const __m256i v = _mm256_broadcastsi128_si256(q);
    const __m256i n = _mm256_srlv_epi64(v, _mm256_set_epi64x(4, 4, 0, 0));
    const __m256i u = _mm256_shuffle_epi8(table, _mm256_and_si256(n, _mm256_set1_epi8(15)));
    for (int m = 0; m < MR; m++) {
      const int8_t* x = qx + m * K + b * QK;
      const __m256i c = _mm256_loadu_si256((const __m256i*)(xc + (m * nb + b) * 8));
      const __m256i dot = dot2(c, u, x, zero, x);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(ds + m * nb + b),
                               acc[m]);
    }
  }
  for (int m = 0; m < MR; m++) out[m * N] = hsum(acc[m]);
}
#elif defined(__ARM_NEON)
template <int MR>
void dot_row(float* out, long N, const uint8_t* w, const int8_t* qx, const int32_t*,
             const float* dx, long K, float* ds) {
  const long nb = K / QK;
  row_scales(ds, w, dx, nb, MR);
  const int8x16_t table = vld1q_s8(KV);
  float32x4_t acc[MR];
  for (int m = 0; m < MR; m++) acc[m] = vdupq_n_f32(0.0f);
  for (long b = 0; b < nb; b++) {
    const uint8_t* blk = w + b * BLOCK;
    const uint8x16_t v = vld1q_u8(blk + 1);
    const int8x16_t lo = vqtbl1q_s8(table, vandq_u8(v, vdupq_n_u8(15)));
    const int8x16_t hi = vqtbl1q_s8(table, vshrq_n_u8(v, 4));
    for (int m = 0; m < MR; m++) {
      const int8_t* xb = qx + m * K + b * QK;
      const int32x4_t dot = dot16(dot16(vdupq_n_s32(0), lo, vld1q_s8(xb)), hi, vld1q_s8(xb + 16));
      acc[m] = vfmaq_n_f32(acc[m], vcvtq_f32_s32(dot), ds[m * nb + b]);
    }
  }
  for (int m = 0; m < MR; m++) out[m * N] = vaddvq_f32(acc[m]);
}
#else
// The portable code: a block's codes unpacked once for all MR rows, then loops the compiler
// vectorizes.
template <int MR>
void dot_row(float* out, long N, const uint8_t* w, const int8_t* qx, const int32_t*,
             const float* dx, long K, float* ds) {
  const long nb = K / QK;
  row_scales(ds, w, dx, nb, MR);
  float acc[MR] = {};
  for (long b = 0; b < nb; b++) {
    int8_t v[QK];
    unpack(w + b * BLOCK, v);
    for (int m = 0; m < MR; m++) {
      const int8_t* xb = qx + m * K + b * QK;
      int32_t dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int i = 0; i < QK; i++) dot += v[i] * xb[i];
      acc[m] += (float)dot * ds[m * nb + b];
    }
  }
  for (int m = 0; m < MR; m++) out[m * N] = acc[m];
}
#endif

// dot_row for r (1..MR) rows of x.
template <int MR = GROUP>
void dot_rows(long r, float* out, long N, const uint8_t* w, const int8_t* qx, const int32_t* xc,
              const float* dx, long K, float* ds) {
  if constexpr (MR > 1) {
    if (r < MR) return dot_rows<MR - 1>(r, out, N, w, qx, xc, dx, K, ds);
  }
  dot_row<MR>(out, N, w, qx, xc, dx, K, ds);
}

// out (M, N) with the integer dots, W's rows split over nt threads; each W row against the rows
// of x GROUP at a time (its bytes stay in L1 from one group to the next).
void gemv(float* out, const int8_t* qx, const int32_t* xc, const float* dx, const uint8_t* w,
          long M, long K, long N, int nt) {
  const long per = (N + nt - 1) / nt, nb = K / QK, row = nb * BLOCK;
  on_threads(nt, [&](int t) {
    std::vector<float> ds((GROUP + 1) * nb);  // (GROUP + 1, nb): a W row's factors
    for (long n = t * per; n < std::min(N, (t + 1) * per); n++)
      for (long m = 0; m < M; m += GROUP)
        dot_rows(std::min<long>(GROUP, M - m), out + m * N + n, N, w + n * row, qx + m * K,
                 xc + m * nb * 8, dx + m * nb, K, ds.data());
  });
}

// One W row (K values) as float32: KV[code] 2^(e - 128), exact.
void dequant_row(float* out, const uint8_t* w, long K) {
  for (long b = 0; b < K / QK; b++) {
    int8_t v[QK];
    unpack(w + b * BLOCK, v);
    const float d = HALF.v[w[b * BLOCK]];
    for (int i = 0; i < QK; i++) out[b * QK + i] = (float)v[i] * d;
  }
}

}  // namespace

// out: (M, N) float32; x: (M, K) float32; w: (N, K / 32 blocks of 17 bytes) uint8; all
// row-major contiguous. Returns 1 (nothing done) for a K that is not a multiple of 32.
extern "C" int matmul_mxfp4(float* out, const float* x, const uint8_t* w, long M, long K, long N,
                            int threads) {
  if (K % QK) return 1;
  if (M == 0) return 0;
  std::unique_ptr<int8_t[]> qx(new int8_t[M * K]);
  std::unique_ptr<float[]> dx(new float[M * K / QK]);
  quantize_rows(qx.get(), dx.get(), x, M, K);
  const long work = 2 * M * K * N;
  if (M > INT_MAX_ROWS) {
    const long nt = std::min<long>(threads_for(work, threads), std::max(1L, N / NB));
    const long row = K / QK * BLOCK;
    gemm_dequant_tiles<QK>(out, qx.get(), dx.get(), M, K, N, (int)nt,
                           [&](float* r, long n) { dequant_row(r, w + n * row, K); });
    return 0;
  }
  std::unique_ptr<int32_t[]> xc;  // (M, K/32, 8): the x86 dots' lane starts
#if defined(MX_X86)
  xc.reset(new int32_t[M * K / 4]);
  pair_blocks(qx.get(), xc.get(), M, K);
#endif
  const int nt = (int)std::min<long>(work < GEMV_WORK ? 1 : threads, N);
  gemv(out, qx.get(), xc.get(), dx.get(), w, M, K, N, nt);
  return 0;
}
