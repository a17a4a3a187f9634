// Matrix products with MXFP4 weights (gpt-oss's experts) as a GGUF file stores them
// (model_loader/mxfp4.py): W transposed, (N, K), each row a run of 17-byte blocks of 32 values,
// the e8m0 exponent e then 16 bytes of e2m1 codes (byte j: value j low, value j + 16 high):
// w = KV[code] 2^(e - 128), KV the e2m1 values doubled (0, 1, 2, 3, 4, 6, 8, 12 and their
// negatives), exact integers, as llama.cpp takes them. x is quantized once per product, per row
// and 32 values: dx = absmax / 127, qx = round(x / dx) (ties to even); a block's product is
//   dx 2^(e - 128) sum(KV[code] qx)
// an integer dot and one float factor. AVX2: the codes through vpshufb into KV + 12 (unsigned,
// 0..24), times qx by vpmaddubsw and vpmaddwd (AVX512-VNNI: vpdpbusd), each of the 8 lanes
// starting from -12 times its 4 qx's sum (xc, once per product), so the lanes hold
// sum(KV qx) exactly; AVX-512 with VNNI takes two blocks a 64-byte register. aarch64: vqtbl1q_s8
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
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define MX_512 1
#endif
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

namespace {

const long QK = 32, BLOCK = 17;  // values and bytes of a block
const long NB = 64;              // W rows per thread at least, in the tiles' product
const long INT_MAX_ROWS = 64;    // rows of x up to which the integer dots run
const int GROUP = 8;             // rows of x a W row meets at once (their sums in registers)
const long GEMV_WORK = 1L << 19;
const int8_t KV[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// 2^(e - 128) as float32: ggml's e8m0_to_fp32_half (e 0 and 1 subnormal).
inline float half_scale(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
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

#if defined(MX_X86)
// xc (M, K/32, 8): -12 times the sum of each 4 qx, the start of each lane's dot (KV + 12 in
// the products).
void lane_sums(int32_t* xc, const int8_t* qx, long M, long K) {
  for (long i = 0; i < M * K / 4; i++)
    xc[i] = -12 * (qx[4 * i] + qx[4 * i + 1] + qx[4 * i + 2] + qx[4 * i + 3]);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// KV + 12 per code, in each 16-byte lane for vpshufb.
#define MX_TABLE 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0

// A block's 32 codes (16 bytes at q) as KV + 12, in value order: the bytes in both halves, the
// high half shifted by a nibble, then the table.
inline __m256i block_u(const uint8_t* q) {
  const __m256i table = _mm256_setr_epi8(MX_TABLE, MX_TABLE);
  const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)q));
  const __m256i n = _mm256_srlv_epi64(b, _mm256_set_epi64x(4, 4, 0, 0));
  return _mm256_shuffle_epi8(table, _mm256_and_si256(n, _mm256_set1_epi8(15)));
}

// The 8 lanes of sum(KV qx) over a block: u its codes (block_u), x its 32 qx, c its xc.
inline __m256i block_dot(__m256i u, const int8_t* x, const int32_t* c) {
  const __m256i xv = _mm256_loadu_si256((const __m256i*)x);
  const __m256i cv = _mm256_loadu_si256((const __m256i*)c);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(cv, u, xv);
#else  // KV + 12 <= 24: a pair of products fits int16 (2 * 24 * 127)
  return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(u, xv), _mm256_set1_epi16(1)),
                          cv);
#endif
}

#if defined(MX_512)
// Blocks b and b + 1 (at blk) as KV + 12 in one register: block b's 32 values, then b + 1's.
inline __m512i pair_u(const uint8_t* blk) {
  const __m512i table = _mm512_broadcast_i32x4(_mm_setr_epi8(MX_TABLE));
  const __m256i b0 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(blk + 1)));
  const __m256i b1 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(blk + 18)));
  const __m512i b = _mm512_inserti64x4(_mm512_castsi256_si512(b0), b1, 1);
  const __m512i n = _mm512_srlv_epi64(b, _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0));
  return _mm512_shuffle_epi8(table, _mm512_and_si512(n, _mm512_set1_epi8(15)));
}
#endif

// out[m * N] for the MR rows of x: one W row (its blocks at w) against each; a row's sums in
// one chain of float32 vectors (its bits do not depend on the rows beside it).
template <int MR>
void dot_row(float* out, long N, const uint8_t* w, const int8_t* qx, const int32_t* xc,
             const float* dx, long K) {
  const long nb = K / QK;
  long b = 0;
  float tail[MR] = {};
#if defined(MX_512)
  __m512 acc[MR];
  for (int m = 0; m < MR; m++) acc[m] = _mm512_setzero_ps();
  for (; b + 2 <= nb; b += 2) {
    const uint8_t* blk = w + b * BLOCK;
    const __m512i u = pair_u(blk);
    const float d0 = half_scale(blk[0]), d1 = half_scale(blk[BLOCK]);
    for (int m = 0; m < MR; m++) {
      const __m512i xv = _mm512_loadu_si512(qx + m * K + b * QK);
      const __m512i c = _mm512_loadu_si512(xc + (m * nb + b) * 8);
      const __m512i dot = _mm512_dpbusd_epi32(c, u, xv);
      const __m512 s = _mm512_insertf32x8(_mm512_set1_ps(d0 * dx[m * nb + b]),
                                          _mm256_set1_ps(d1 * dx[m * nb + b + 1]), 1);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[m]);
    }
  }
  typedef float v16 __attribute__((vector_size(64)));
  for (int m = 0; m < MR; m++) tail[m] = hsum_v((v16)acc[m]);
#endif
  __m256 acc8[MR];
  for (int m = 0; m < MR; m++) acc8[m] = _mm256_setzero_ps();
  for (; b < nb; b++) {  // (AVX-512: an odd count's last block)
    const uint8_t* blk = w + b * BLOCK;
    const __m256i u = block_u(blk + 1);
    const float d = half_scale(blk[0]);
    for (int m = 0; m < MR; m++) {
      const __m256i dot = block_dot(u, qx + m * K + b * QK, xc + (m * nb + b) * 8);
      acc8[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * dx[m * nb + b]),
                                acc8[m]);
    }
  }
  for (int m = 0; m < MR; m++) out[m * N] = tail[m] + hsum(acc8[m]);
}
#elif defined(__ARM_NEON)
// Sixteen int8 products added into four int32 lanes (vdotq_s32 with ARMv8.2's dot products).
inline int32x4_t dot16(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(acc, a, b);
#else
  acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b)));
  return vpadalq_s16(acc, vmull_high_s8(a, b));
#endif
}

template <int MR>
void dot_row(float* out, long N, const uint8_t* w, const int8_t* qx, const int32_t*,
             const float* dx, long K) {
  const long nb = K / QK;
  const int8x16_t table = vld1q_s8(KV);
  float32x4_t acc[MR];
  for (int m = 0; m < MR; m++) acc[m] = vdupq_n_f32(0.0f);
  for (long b = 0; b < nb; b++) {
    const uint8_t* blk = w + b * BLOCK;
    const uint8x16_t v = vld1q_u8(blk + 1);
    const int8x16_t lo = vqtbl1q_s8(table, vandq_u8(v, vdupq_n_u8(15)));
    const int8x16_t hi = vqtbl1q_s8(table, vshrq_n_u8(v, 4));
    const float d = half_scale(blk[0]);
    for (int m = 0; m < MR; m++) {
      const int8_t* xb = qx + m * K + b * QK;
      const int32x4_t dot = dot16(dot16(vdupq_n_s32(0), lo, vld1q_s8(xb)), hi, vld1q_s8(xb + 16));
      acc[m] = vfmaq_n_f32(acc[m], vcvtq_f32_s32(dot), d * dx[m * nb + b]);
    }
  }
  for (int m = 0; m < MR; m++) out[m * N] = vaddvq_f32(acc[m]);
}
#else
// The portable code: a block's codes unpacked once for all MR rows, then loops the compiler
// vectorizes.
template <int MR>
void dot_row(float* out, long N, const uint8_t* w, const int8_t* qx, const int32_t*,
             const float* dx, long K) {
  const long nb = K / QK;
  float acc[MR] = {};
  for (long b = 0; b < nb; b++) {
    int8_t v[QK];
    unpack(w + b * BLOCK, v);
    const float d = half_scale(w[b * BLOCK]);
    for (int m = 0; m < MR; m++) {
      const int8_t* xb = qx + m * K + b * QK;
      int32_t dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int i = 0; i < QK; i++) dot += v[i] * xb[i];
      acc[m] += (float)dot * (d * dx[m * nb + b]);
    }
  }
  for (int m = 0; m < MR; m++) out[m * N] = acc[m];
}
#endif

// dot_row for r (1..MR) rows of x.
template <int MR = GROUP>
void dot_rows(long r, float* out, long N, const uint8_t* w, const int8_t* qx, const int32_t* xc,
              const float* dx, long K) {
  if constexpr (MR > 1) {
    if (r < MR) return dot_rows<MR - 1>(r, out, N, w, qx, xc, dx, K);
  }
  dot_row<MR>(out, N, w, qx, xc, dx, K);
}

// out (M, N) with the integer dots, W's rows split over nt threads; each W row against the rows
// of x GROUP at a time (its bytes stay in L1 from one group to the next).
void gemv(float* out, const int8_t* qx, const int32_t* xc, const float* dx, const uint8_t* w,
          long M, long K, long N, int nt) {
  const long per = (N + nt - 1) / nt, nb = K / QK, row = nb * BLOCK;
  on_threads(nt, [&](int t) {
    for (long n = t * per; n < std::min(N, (t + 1) * per); n++)
      for (long m = 0; m < M; m += GROUP)
        dot_rows(std::min<long>(GROUP, M - m), out + m * N + n, N, w + n * row, qx + m * K,
                 xc + m * nb * 8, dx + m * nb, K);
  });
}

// One W row (K values) as float32: KV[code] 2^(e - 128), exact.
void dequant_row(float* out, const uint8_t* w, long K) {
  for (long b = 0; b < K / QK; b++) {
    int8_t v[QK];
    unpack(w + b * BLOCK, v);
    const float d = half_scale(w[b * BLOCK]);
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
  lane_sums(xc.get(), qx.get(), M, K);
#endif
  const int nt = (int)std::min<long>(work < GEMV_WORK ? 1 : threads, N);
  gemv(out, qx.get(), xc.get(), dx.get(), w, M, K, N, nt);
  return 0;
}
