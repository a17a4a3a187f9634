// Matrix products with block-quantized weights, llama.cpp's and GGUF's formats, as a GGUF
// file stores them: W transposed, (N, K), each output's row cut into blocks of 32 inputs with
// float16 scales. Q8_0: 32 int8 q and d (w = q * d; 34 bytes a block). Q4_0: 16 bytes of
// nibbles (byte j: q[j] low, q[j + 16] high) and d (w = (q - 8) * d; 18 bytes). Q4_1: the
// nibbles, d and m (w = q * d + m; 20 bytes). Q4_Z (a 4-bit checkpoint's zero-point groups,
// model_loader/int4_checkpoint.py): Q4_1's layout with the zero z (an integer 0..16, exact in
// float16) in m's place (w = (q - z) * d; bias c = d (8 - z), exact in float32, where Q4_1's
// m = -d z would round in float16). x is quantized as it comes in, per row, blocks
// of 32, one float32 scale each (dx = absmax / 127, qx = round(x / dx), ties to even), so a
// block's product is a 32-term integer dot and scales:
//   Q8_0: d dx sum(q qx)   Q4_0: d dx sum((q - 8) qx)   Q4_1: d dx sum((q - 8) qx) + (m + 8 d) sx
//   Q4_Z: d dx sum((q - 8) qx) + d (8 - z) sx
// with sx = dx sum(qx), x's block sum as quantized. (Q4_1 centred on 8 so that the two terms
// do not nearly cancel: with d sum(q qx) + m sx the float32 sum lost about 1e-5 of the
// product, enough to flip later roundings of x.) Every batch size computes this same
// function (of x quantized), in float32.
// M <= GEMV_MAX_ROWS (decode at small batch, bound by memory): each W row is read once and
// dotted with every row of x. AVX2: 32 int8 pairs through vpmaddubsw (unsigned times signed,
// pairs summed to int16: 2 * 127 * 127 fits) and vpmaddwd against ones (int32), then one float
// FMA per block. Q8_0's signed q goes in as |q| with x given q's sign (vpsignb), llama.cpp's
// trick. Q4 takes blocks in pairs: one 32-byte load holds two blocks' nibbles, whose low and
// high halves are already unsigned; x is laid out to match (pair_blocks) and the -8 enters as
// an int32 per lane, -8 times the lane's x sum, so the lanes hold sum((q - 8) qx) exactly.
// AVX512-VNNI: vpdpbusd for the two instructions; Q8_0's x comes as x + 128 (unsigned), so q
// goes in as stored, and each block's -128 sum(q) (one vpdpbusd, shared by every row of x)
// starts the sums: one instruction a row and block, not three, and W's next rows prefetched
// (at 8 rows 1.4x faster: the integer work no longer hid the loads' latency). Other CPUs: the
// same sums in a plain loop (the integer sums are exact either way; only the float additions'
// order differs).
// 9 to INT_MAX_ROWS (64) rows (batches, speculative verifies, short prompts): the same integer
// dots, W's rows in chunks that every group of 8 rows of x passes over while they are in the
// caches (gemm_int), so W is read from memory once.
// More rows (prefill), with AVX512-VNNI (gemm_vnni): W's rows 16 at a time copied per call so
// that one 64-byte vpdpbusd does 4 inputs of 16 rows against x's 4 inputs broadcast, 64
// multiply-adds an instruction and no horizontal sums. Without VNNI: x's quantized values and
// a tile of NB W rows are expanded to float32 and multiplied by the BLAS's sgemm, since there
// the integer dot does no more multiply-adds per instruction than a float32 FMA, and sgemm
// keeps more of them in flight.
// Threads: one task per run of W's rows (the GEMV, gemm_int, gemm_vnni's runs of 16), per
// slice of NB rows (the tiles).
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
const bool PAIRED = true;  // Q4's x in pair_blocks' order for the integer dots
#else
const bool PAIRED = false;
#endif
#if defined(__ARM_NEON)
#include <arm_neon.h>
#endif
#include "int8_dots.h"  // hsum, dot2, dot16

namespace {

const long QK = 32;     // weights per block
const long NB = 128;    // W rows per float32 tile
const long GEMV_WORK = 1L << 19;
// Rows up to which the integer dots beat the float32 tiles (TinyLlama's four layer matrices,
// 2 threads, both x86 builds: 16 rows 2.2x faster, 64 rows 1.1-1.2x, 96 rows 0.9-1.05x).
const long INT_MAX_ROWS = 64;

enum { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, Q4_Z = 3 };

// The formats with a per-block bias term c sx (Q4_1's m + 8 d, Q4_Z's d (8 - z)).
template <int F> constexpr bool BIASED = F == Q4_1 || F == Q4_Z;

// Rows from which gemm_vnni takes over, with AVX512-VNNI: past 64, so that up to 64 rows (a
// batch's decodes) each row has the bits it has alone. (Its per-call copy of W costs about
// seven GEMV passes; it is ahead from about 32 rows for Q8_0, 48 for Q4_0: TinyLlama's four
// layer matrices, 4 layers, Q8_0 at 64 rows 108 -> 67 ms, Q4_0 at 48 rows 92 -> 71 ms.)
const long VNNI_GEMM_ROWS = 65;

// A format's layout: bytes of q per block, float16 scales per block.
template <int F> struct Format;
template <> struct Format<Q8_0> { static const long QB = 32, NS = 1; };
template <> struct Format<Q4_0> { static const long QB = 16, NS = 1; };
template <> struct Format<Q4_1> { static const long QB = 16, NS = 2; };
template <> struct Format<Q4_Z> { static const long QB = 16, NS = 2; };

// x (M, K) -> qx (M, K) int8, dx, sx (M, K / QK) float32: d = absmax / 127, q = round(x / d)
// (ties to even), a block of zeros d = 0, q = 0; sx = d * sum(q).
void quantize_rows(int8_t* qx, float* dx, float* sx, const float* x, long M, long K) {
  for (long m = 0; m < M; m++)
    for (long b = 0; b < K / QK; b++) {
      int8_t* q = qx + m * K + b * QK;
      const float d = quantize_block<QK>(q, x + m * K + b * QK);
      int sum = 0;
#pragma omp simd reduction(+ : sum)
      for (int i = 0; i < QK; i++) sum += q[i];
      dx[m * (K / QK) + b] = d;
      sx[m * (K / QK) + b] = d * (float)sum;
    }
}

// Q4's x for the AVX2 integer dots: each pair of blocks' 64 values reordered to [b0[0..15],
// b1[0..15], b0[16..31], b1[16..31]], the order of one 32-byte load of the two blocks' nibbles
// (low nibbles, then high), so dot_row takes both blocks at once with the q as stored (0..15,
// unsigned for vpmaddubsw; no sign trick). xc (M, nb / 2, 8): -8 times the sum of each of the
// eight 32-bit lanes' x values, added to the lanes' integer sums of q x: (q - 8) x, the same
// integers. An odd count's last block keeps its own order.
void pair_blocks(int8_t* qx, int32_t* xc, long M, long K) {
  const long np = K / QK / 2;
  for (long m = 0; m < M; m++)
    for (long p = 0; p < np; p++) {
      int8_t* v = qx + m * K + p * 64;
      int8_t t[64];
      for (int h = 0; h < 4; h++) std::memcpy(t + h * 16, v + (h % 2 * 2 + h / 2) * 16, 16);
      std::memcpy(v, t, 64);
      for (int l = 0; l < 8; l++) {
        int sum = 0;
        for (int i = 0; i < 4; i++) sum += t[4 * l + i] + t[32 + 4 * l + i];
        xc[(m * np + p) * 8 + l] = -8 * sum;
      }
    }
}

// qx -> qx + 128 as unsigned bytes (the sign bit flipped), in place: Q8_0's x for vpdpbusd.
inline void flip_sign(int8_t* qx, long n) {
#pragma omp simd
  for (long i = 0; i < n; i++) qx[i] = (int8_t)(qx[i] ^ 0x80);
}

// A block's 32 q as the integer dots take them, signed: Q8_0's as stored (returned in place),
// Q4's q - 8 (low nibbles first) written to u.
template <int F> inline const int8_t* signed_q(const uint8_t* qb, int8_t* u) {
  if constexpr (F == Q8_0) {
    return (const int8_t*)qb;
  } else {
#pragma omp simd
    for (int i = 0; i < 16; i++) {
      u[i] = (int8_t)((qb[i] & 15) - 8);
      u[i + 16] = (int8_t)((qb[i] >> 4) - 8);
    }
    return u;
  }
}

// A block's bias factor c (the term c * sx: Q4_1's m + 8 d, Q4_Z's d (8 - z), none for the
// others).
template <int F> inline float bias(const f16* s) {
  if constexpr (F == Q4_Z) return (float)s[0] * (8.0f - (float)s[1]);
  return F == Q4_1 ? (float)s[1] + 8.0f * (float)s[0] : 0.0f;
}

#if defined(__AVX2__) && defined(__FMA__)
// A block's 32 q as the unsigned operand of vpmaddubsw (Q8_0: |q|; Q4: |q - 8|, the low
// nibbles first) and the signs x must take (Q8_0: q; Q4: q - 8).
template <int F> inline __m256i load_q(const uint8_t* q, __m256i& sign) {
  if constexpr (F == Q8_0) {
    sign = _mm256_loadu_si256((const __m256i*)q);
    return _mm256_sign_epi8(sign, sign);
  } else {
    // the 16 bytes in both halves, the high half shifted by a nibble: q[0..15] | q[16..31]
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)q));
    const __m256i n = _mm256_srlv_epi64(b, _mm256_set_epi64x(4, 4, 0, 0));
    sign = _mm256_sub_epi8(_mm256_and_si256(n, _mm256_set1_epi8(15)), _mm256_set1_epi8(8));
    return _mm256_sign_epi8(sign, sign);
  }
}

// Eight int32 partial sums of q . qx over the block, as float32. With AVX512-VNNI, vpdpbusd
// adds each four products into an int32 at once (the same integers: vpmaddubsw's int16 pairs
// never saturate here).
template <int F> inline __m256 block_dot(__m256i uq, __m256i sign, const int8_t* x) {
  const __m256i xv = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)x), sign);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), uq, xv));
#else
  const __m256i p16 = _mm256_maddubs_epi16(uq, xv);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
#endif
}

// Eight blocks' d (and Q4_1's c = m + 8 d) of a row, from their float16 scales at s.
template <int F> inline __m256 scales8(const f16* s, __m256& c) {
  if constexpr (!BIASED<F>) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)s));
  } else {  // (d, m) (Q4_Z: (d, z)) pairs: d0 m0 .. d3 m3 | d4 m4 .. d7 m7, split and put back in order
    const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)s));
    const __m256 e = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + 8)));
    const auto order = [](__m256 v) {  // 64-bit pairs (0, 2, 1, 3)
      return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(v), 0xD8));
    };
    const __m256 d = order(_mm256_shuffle_ps(a, e, 0x88)), m = order(_mm256_shuffle_ps(a, e, 0xDD));
    if constexpr (F == Q4_Z)
      c = _mm256_mul_ps(d, _mm256_sub_ps(_mm256_set1_ps(8.0f), m));
    else
      c = _mm256_fmadd_ps(_mm256_set1_ps(8.0f), d, m);
    return d;
  }
}

// A row's per-block factors, ahead of its dot products: ds[m * nb + b] = d_b dx[m, b], and
// (Q4_1) tail[m] = sum over b of (m_b + 8 d_b) sx[m, b]. Eight blocks a step, the scales'
// float16 converted eight at a time; per block in the dot loop that was a scalar convert, a
// multiply and a broadcast.
template <int F, int MR>
void row_scales(float* ds, float* tail, const f16* s, const float* dx, const float* sx, long nb) {
  __m256 tv[MR];
  for (int m = 0; m < MR; m++) tv[m] = _mm256_setzero_ps();
  long b = 0;
  for (; b + 8 <= nb; b += 8) {
    __m256 c;
    const __m256 d = scales8<F>(s + b * Format<F>::NS, c);
    for (int m = 0; m < MR; m++) {
      _mm256_storeu_ps(ds + m * nb + b, _mm256_mul_ps(d, _mm256_loadu_ps(dx + m * nb + b)));
      if constexpr (BIASED<F>) tv[m] = _mm256_fmadd_ps(c, _mm256_loadu_ps(sx + m * nb + b), tv[m]);
    }
  }
  for (int m = 0; m < MR; m++) tail[m] = BIASED<F> ? hsum(tv[m]) : 0.0f;
  for (; b < nb; b++) {
    const f16* sb = s + b * Format<F>::NS;
    const float d = (float)sb[0], c = bias<F>(sb);
    for (int m = 0; m < MR; m++) {
      ds[m * nb + b] = d * dx[m * nb + b];
      if constexpr (BIASED<F>) tail[m] += c * sx[m * nb + b];
    }
  }
}

// out[m * N] for the MR rows of x: W row (q, s) dotted with each; ds: room for (MR, nb).
// (Two W rows at a time, sharing x's loads, measured slower: two streams per thread, and
// spills at 8 rows.)
template <int F, int MR>
void dot_row(float* out, long N, const uint8_t* q, const f16* s, const int8_t* qx,
             const int32_t* xc, const float* dx, const float* sx, long K, float* ds) {
  const long nb = K / QK;
  float tail[MR];
  row_scales<F, MR>(ds, tail, s, dx, sx, nb);
  // one chain of sums per row, whatever MR: a row's bits do not depend on the rows beside it
  __m256 acc[MR];
  for (int m = 0; m < MR; m++) acc[m] = _mm256_setzero_ps();
  long b = 0;
  if constexpr (F != Q8_0) {  // Q4: two blocks a step, x in pair_blocks' order
    const long np = nb / 2;
    const __m256i nibble = _mm256_set1_epi8(15);
    const __m256i halves = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0);  // lanes 4-7: block 2p+1
    for (long p = 0; p < np; p++) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(q + p * 32));
      const __m256i lo = _mm256_and_si256(v, nibble);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
      for (int m = 0; m < MR; m++) {
        const int8_t* xa = qx + m * K + p * 64;
        const __m256i c = _mm256_loadu_si256((const __m256i*)(xc + (m * np + p) * 8));
        // q <= 15: a pair of products fits int16 with room for two (2 * 2 * 15 * 127)
        const __m256i dot = dot2(c, lo, xa, hi, xa + 32);
        const __m256 d2 = _mm256_permutevar_ps(
            _mm256_castpd_ps(_mm256_broadcast_sd((const double*)(ds + m * nb + 2 * p))), halves);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), d2, acc[m]);
      }
    }
    b = 2 * np;  // an odd count's last block: below, in its own order
  }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  if constexpr (F == Q8_0) {  // x comes as x + 128 (flip_sign): unsigned, so q needs no sign
    const __m256i zero = _mm256_setzero_si256(), bias = _mm256_set1_epi8((char)0x80);
    for (; b < nb; b++) {
      const __m256i qv = _mm256_loadu_si256((const __m256i*)(q + b * QK));
      if (b % 2 == 0) __builtin_prefetch(q + 2 * K + b * QK);
      // -128 sum(q) per lane: sum((x + 128) q) - 128 sum(q) = sum(x q), the same integers
      const __m256i corr = _mm256_sub_epi32(zero, _mm256_dpbusd_epi32(zero, bias, qv));
      for (int m = 0; m < MR; m++) {
        const __m256i xv = _mm256_loadu_si256((const __m256i*)(qx + m * K + b * QK));
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(corr, xv, qv));
        acc[m] = _mm256_fmadd_ps(dot, _mm256_broadcast_ss(ds + m * nb + b), acc[m]);
      }
    }
  }
#endif
  for (; b < nb; b++) {  // Q8_0's blocks; Q4's last when their count is odd
    __m256i sign;
    const __m256i uq = load_q<F>(q + b * Format<F>::QB, sign);
    for (int m = 0; m < MR; m++) {
      const __m256 dot = block_dot<F>(uq, sign, qx + m * K + b * QK);
      acc[m] = _mm256_fmadd_ps(dot, _mm256_broadcast_ss(ds + m * nb + b), acc[m]);
    }
  }
  for (int m = 0; m < MR; m++) out[m * N] = hsum(acc[m]) + tail[m];
}
#elif defined(__ARM_NEON)
// A block's 32 q as the integer dot takes them (Q8_0: q; Q4: q - 8, the low nibbles first).
template <int F> inline void load_q(const uint8_t* q, int8x16_t& lo, int8x16_t& hi) {
  if constexpr (F == Q8_0) {
    lo = vld1q_s8((const int8_t*)q);
    hi = vld1q_s8((const int8_t*)q + 16);
  } else {
    const uint8x16_t v = vld1q_u8(q);
    lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(15))), vdupq_n_s8(8));
    hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(v, 4)), vdupq_n_s8(8));
  }
}

template <int F, int MR>
void dot_row(float* out, long N, const uint8_t* q, const f16* s, const int8_t* qx,
             const int32_t*, const float* dx, const float* sx, long K, float* ds) {
  const long nb = K / QK;
  float tail[MR];
  for (int m = 0; m < MR; m++) tail[m] = 0.0f;
  for (long b = 0; b < nb; b++) {  // the row's d dx per block, ahead of the dots
    const f16* sb = s + b * Format<F>::NS;
    const float d = (float)sb[0], c = bias<F>(sb);
    for (int m = 0; m < MR; m++) {
      ds[m * nb + b] = d * dx[m * nb + b];
      if constexpr (BIASED<F>) tail[m] += c * sx[m * nb + b];
    }
  }
  float32x4_t acc[MR];  // one chain of sums per row, whatever MR
  for (int m = 0; m < MR; m++) acc[m] = vdupq_n_f32(0.0f);
  for (long b = 0; b < nb; b++) {
    int8x16_t lo, hi;
    load_q<F>(q + b * Format<F>::QB, lo, hi);
    for (int m = 0; m < MR; m++) {
      const int8_t* xb = qx + m * K + b * QK;
      const int32x4_t dot = dot16(dot16(vdupq_n_s32(0), lo, vld1q_s8(xb)), hi, vld1q_s8(xb + 16));
      acc[m] = vfmaq_n_f32(acc[m], vcvtq_f32_s32(dot), ds[m * nb + b]);
    }
  }
  for (int m = 0; m < MR; m++) out[m * N] = vaddvq_f32(acc[m]) + tail[m];
}
#else
// The portable code: a block's q expanded once to int8 for all MR rows, then loops the
// compiler vectorizes (SSE2's pmaddwd on x86-64's baseline).
template <int F, int MR>
void dot_row(float* out, long N, const uint8_t* q, const f16* s, const int8_t* qx,
             const int32_t*, const float* dx, const float* sx, long K, float*) {
  const long nb = K / QK;
  float acc[MR], tail[MR];
  for (int m = 0; m < MR; m++) acc[m] = tail[m] = 0.0f;
  for (long b = 0; b < nb; b++) {
    const uint8_t* qb = q + b * Format<F>::QB;
    const f16* sb = s + b * Format<F>::NS;
    int8_t u[QK];
    const int8_t* t = signed_q<F>(qb, u);
    const float d = (float)sb[0], c = bias<F>(sb);
    for (int m = 0; m < MR; m++) {
      const int8_t* xb = qx + m * K + b * QK;
      int32_t dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int i = 0; i < QK; i++) dot += t[i] * xb[i];
      acc[m] += (float)dot * (d * dx[m * nb + b]);
      tail[m] += c * sx[m * nb + b];
    }
  }
  for (int m = 0; m < MR; m++) out[m * N] = acc[m] + tail[m];
}
#endif

// out (MR, N): every W row dotted with the MR quantized rows of x, the rows split over nt.
template <int F, int MR>
void gemv(float* out, const int8_t* qx, const int32_t* xc, const float* dx, const float* sx,
          const uint8_t* w, const f16* s, long K, long N, int nt) {
  const long per = (N + nt - 1) / nt, nb = K / QK;
  const long row_q = nb * Format<F>::QB, row_s = nb * Format<F>::NS;
  on_threads(nt, [&](int t) {
    std::vector<float> ds(MR * nb);  // (MR, nb): a row's d dx
    for (long n = t * per; n < std::min(N, (t + 1) * per); n++)
      dot_row<F, MR>(out + n, N, w + n * row_q, s + n * row_s, qx, xc, dx, sx, K, ds.data());
  });
}

// The integer dot of dot_row for R (1..8, at run time) rows of x.
template <int F>
void dot_rows(int R, float* out, long N, const uint8_t* q, const f16* s, const int8_t* qx,
              const int32_t* xc, const float* dx, const float* sx, long K, float* ds) {
  switch (R) {
#define ROWS(r) \
  case r: dot_row<F, r>(out, N, q, s, qx, xc, dx, sx, K, ds); break;
    ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
  }
}

// out[m * ldo + n] for W's rows n0..n1, any M: the W rows in chunks of NC (a few KB each, kept
// in L1/L2) that every group of 8 rows of x passes over, so W streams from memory once and x's
// quantized rows (M x K bytes) from the caches.
template <int F>
void cols(float* out, long ldo, const int8_t* qx, const int32_t* xc, const float* dx,
          const float* sx, const uint8_t* w, const f16* s, long M, long K, long n0, long n1) {
  const long nb = K / QK, row_q = nb * Format<F>::QB, row_s = nb * Format<F>::NS, NC = 16;
  std::vector<float> ds(8 * nb);  // (8, nb): a row's d dx
  for (long c = n0; c < n1; c += NC)
    for (long m = 0; m < M; m += 8) {
      const int R = (int)std::min(8L, M - m);
      for (long n = c; n < std::min(n1, c + NC); n++)
        dot_rows<F>(R, out + m * ldo + n, ldo, w + n * row_q, s + n * row_s, qx + m * K,
                    xc + m * (nb / 2) * 8, dx + m * nb, sx + m * nb, K, ds.data());
    }
}

// out (M, N) for any M, each thread a run of W's rows.
template <int F>
void gemm_int(float* out, const int8_t* qx, const int32_t* xc, const float* dx, const float* sx,
              const uint8_t* w, const f16* s, long M, long K, long N, int nt) {
  const long per = (N + nt - 1) / nt;
  on_threads(nt, [&](int t) {
    const long n0 = std::min(N, t * per);
    cols<F>(out, N, qx, xc, dx, sx, w, s, M, K, n0, std::min(N, n0 + per));
  });
}

#if defined(__AVX512VNNI__)
// Prefill with AVX512-VNNI (gemm_vnni): W's rows 16 at a time copied, per call, into a
// thread's buffer so that one 64-byte register holds 4 consecutive inputs of each of the 16
// rows (Chunk16::q (K/32, 8, 16, 4) int8: block b, group g of 4 inputs, row r), their q as
// signed bytes (signed_q). One vpdpbusd then adds, in each of 16 lanes, 4 products of one row
// of W with x's 4 inputs broadcast to every lane (x as x + 128, unsigned; each row's block
// starts from -128 sum(q), as in dot_row): 8 of them finish a block's 16 integer dots, with no
// horizontal sums, and a block costs one convert, one multiply (d dx) and one FMA per 16
// outputs. That is 64 multiply-adds an instruction against sgemm's 16 (float32 FMA on a
// 64-byte register).
struct Chunk16 {
  std::vector<int8_t> q;     // (nb, 8, 16, 4): the rows' q in vpdpbusd's order
  std::vector<int32_t> c;    // (nb, 16): -128 sum(q) per row and block
  std::vector<float> d, e;   // (nb, 16): d per row and block; the bias c (Q4_1, Q4_Z)
};

// W's rows n0 .. n0 + 15 (those past N as zeros: their outputs are not written) into ch.
template <int F>
void pack16(Chunk16& ch, const uint8_t* w, const f16* s, long n0, long N, long K) {
  const long nb = K / QK, row_q = nb * Format<F>::QB, row_s = nb * Format<F>::NS;
  ch.q.assign(nb * 512, 0);
  ch.c.assign(nb * 16, 0);
  ch.d.assign(nb * 16, 0.0f);
  ch.e.assign(nb * 16, 0.0f);
  for (long r = 0; r < 16 && n0 + r < N; r++) {
    const uint8_t* q = w + (n0 + r) * row_q;
    const f16* sr = s + (n0 + r) * row_s;
    for (long b = 0; b < nb; b++) {
      int8_t u[QK];
      const int8_t* v = signed_q<F>(q + b * Format<F>::QB, u);
      int sum = 0;
      for (int i = 0; i < QK; i++) sum += v[i];
      for (int g = 0; g < 8; g++) std::memcpy(&ch.q[((b * 8 + g) * 16 + r) * 4], v + 4 * g, 4);
      const f16* sb = sr + b * Format<F>::NS;
      ch.c[b * 16 + r] = -128 * sum;
      ch.d[b * 16 + r] = (float)sb[0];
      ch.e[b * 16 + r] = bias<F>(sb);
    }
  }
}

// out[m, n0 .. n0 + 15] for the R rows of x from m: xu (R rows at stride K) x + 128; dx, sx
// (R rows at stride nb). Only `cols` columns are written.
template <int F, int R>
void tile16(float* out, long N, const uint8_t* xu, const float* dx, const float* sx, long K,
            const Chunk16& ch, int cols) {
  const long nb = K / QK;
  __m512 acc[R];
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  for (long b = 0; b < nb; b++) {
    const __m512i c = _mm512_loadu_si512(&ch.c[b * 16]);
    __m512i dot[R];
    for (int r = 0; r < R; r++) dot[r] = c;
    const int8_t* qb = &ch.q[b * 512];
    for (int g = 0; g < 8; g++) {
      const __m512i wv = _mm512_loadu_si512(qb + g * 64);
      for (int r = 0; r < R; r++) {
        int32_t x4;
        std::memcpy(&x4, xu + r * K + b * QK + 4 * g, 4);
        dot[r] = _mm512_dpbusd_epi32(dot[r], _mm512_set1_epi32(x4), wv);
      }
    }
    const __m512 d = _mm512_loadu_ps(&ch.d[b * 16]);
    for (int r = 0; r < R; r++) {
      const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(dx[r * nb + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), ds, acc[r]);
      if constexpr (BIASED<F>)
        acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(&ch.e[b * 16]), _mm512_set1_ps(sx[r * nb + b]),
                                 acc[r]);
    }
  }
  const __mmask16 keep = (__mmask16)((1u << cols) - 1);
  for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(out + r * N, keep, acc[r]);
}

// out (M, N) for any M: each thread's runs of 16 W rows packed (pack16), then every group of
// up to 8 rows of x over them. qx: x quantized, its sign bits flipped (x + 128).
template <int F>
void gemm_vnni(float* out, const int8_t* qx, const float* dx, const float* sx, const uint8_t* w,
               const f16* s, long M, long K, long N, int nt) {
  const long nb = K / QK, chunks = (N + 15) / 16, per = (chunks + nt - 1) / nt;
  const uint8_t* xu = (const uint8_t*)qx;
  on_threads(nt, [&](int t) {
    Chunk16 ch;
    for (long j = t * per; j < std::min(chunks, (t + 1) * per); j++) {
      const long n0 = j * 16;
      const int cols = (int)std::min(16L, N - n0);
      pack16<F>(ch, w, s, n0, N, K);
      for (long m = 0; m < M; m += 8) {
        float* o = out + m * N + n0;
        const uint8_t* xm = xu + m * K;
        const float *dm = dx + m * nb, *sm = sx + m * nb;
        switch (std::min(8L, M - m)) {
#define ROWS(r) \
  case r: tile16<F, r>(o, N, xm, dm, sm, K, ch, cols); break;
          ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
        }
      }
    }
  });
}
#endif

// W row (q, s) as K float32 values.
template <int F> void dequant_row(float* out, const uint8_t* q, const f16* s, long K) {
  for (long b = 0; b < K / QK; b++) {
    const uint8_t* qb = q + b * Format<F>::QB;
    const f16* sb = s + b * Format<F>::NS;
    const float d = (float)sb[0];
    float* o = out + b * QK;
    if constexpr (F == Q8_0) {
#pragma omp simd
      for (int i = 0; i < QK; i++) o[i] = (float)(int8_t)qb[i] * d;
    } else {  // Q4_0: (q - 8) d; Q4_1: q d + m; Q4_Z: q d - z d (both terms and the sum exact)
      const float m = F == Q4_1 ? (float)sb[1] : -(F == Q4_Z ? (float)sb[1] : 8.0f) * d;
#pragma omp simd
      for (int i = 0; i < 16; i++) {
        o[i] = (float)(qb[i] & 15) * d + m;
        o[i + 16] = (float)(qb[i] >> 4) * d + m;
      }
    }
  }
}

template <int F>
void gemm_tiles(float* out, const int8_t* qx, const float* dx, const uint8_t* w, const f16* s,
                long M, long K, long N, int nt) {
  const long nb = K / QK, row_q = nb * Format<F>::QB, row_s = nb * Format<F>::NS;
  gemm_dequant_tiles<QK>(out, qx, dx, M, K, N, nt, [&](float* r, long n) {
    dequant_row<F>(r, w + n * row_q, s + n * row_s, K);
  });
}

template <int F>
void matmul_f(float* out, const float* x, const uint8_t* w, const f16* s, long M, long K, long N,
              int threads) {
  std::unique_ptr<int8_t[]> qx(new int8_t[M * K]);
  std::unique_ptr<float[]> dx(new float[M * K / QK]), sx(new float[M * K / QK]);
  quantize_rows(qx.get(), dx.get(), sx.get(), x, M, K);
  const long work = 2 * M * K * N;
#if defined(__AVX512VNNI__)
  if (M >= VNNI_GEMM_ROWS) {
    flip_sign(qx.get(), M * K);
    const int nt = std::min<long>(threads_for(work, threads), (N + 15) / 16);
    gemm_vnni<F>(out, qx.get(), dx.get(), sx.get(), w, s, M, K, N, nt);
    return;
  }
#endif
  if (M > INT_MAX_ROWS) {
    const long nt = std::min<long>(threads_for(work, threads), std::max(1L, N / NB));
    gemm_tiles<F>(out, qx.get(), dx.get(), w, s, M, K, N, (int)nt);
    return;
  }
  std::unique_ptr<int32_t[]> xc(new int32_t[M * (K / QK / 2) * 8]);
  if (F != Q8_0 && PAIRED) pair_blocks(qx.get(), xc.get(), M, K);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  if (F == Q8_0) flip_sign(qx.get(), M * K);
#endif
  if (M > GEMV_MAX_ROWS) {
    gemm_int<F>(out, qx.get(), xc.get(), dx.get(), sx.get(), w, s, M, K, N,
                threads_for(work, threads));
    return;
  }
  const int nt = (int)std::min<long>(work < GEMV_WORK ? 1 : threads, N);
  const int8_t* q = qx.get();
  const int32_t* c = xc.get();
  const float *d = dx.get(), *sm = sx.get();
  switch (M) {
    case 1: gemv<F, 1>(out, q, c, d, sm, w, s, K, N, nt); break;
    case 2: gemv<F, 2>(out, q, c, d, sm, w, s, K, N, nt); break;
    case 3: gemv<F, 3>(out, q, c, d, sm, w, s, K, N, nt); break;
    case 4: gemv<F, 4>(out, q, c, d, sm, w, s, K, N, nt); break;
    case 5: gemv<F, 5>(out, q, c, d, sm, w, s, K, N, nt); break;
    case 6: gemv<F, 6>(out, q, c, d, sm, w, s, K, N, nt); break;
    case 7: gemv<F, 7>(out, q, c, d, sm, w, s, K, N, nt); break;
    default: gemv<F, 8>(out, q, c, d, sm, w, s, K, N, nt); break;
  }
}

}  // namespace

// out: (M, N) float32; x: (M, K) float32; w: (N, K / 32, bytes of a block's q) uint8;
// scales: (N, K / 32, scales of a block) float16 bits; format: 0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q4_Z;
// K a multiple of 32; all row-major contiguous. Returns 1 (nothing done) for a K that is not,
// or an unknown format.
extern "C" int matmul_blocks(float* out, const float* x, const uint8_t* w, const f16* scales,
                             int format, long M, long K, long N, int threads) {
  if (K % QK || format < Q8_0 || format > Q4_Z) return 1;
  if (M == 0) return 0;
  switch (format) {
    case Q8_0: matmul_f<Q8_0>(out, x, w, scales, M, K, N, threads); break;
    case Q4_0: matmul_f<Q4_0>(out, x, w, scales, M, K, N, threads); break;
    case Q4_1: matmul_f<Q4_1>(out, x, w, scales, M, K, N, threads); break;
    default: matmul_f<Q4_Z>(out, x, w, scales, M, K, N, threads); break;
  }
  return 0;
}

// The fused expert step's pieces (moe_experts.cpp), matmul_blocks taken apart: x (M, K)
// quantized and laid out as matmul_blocks does for up to 64 rows (qx (M, K), xc (M, K/64, 8),
// dx and sx (M, K/32)), and out[m * ldo + n] for W's rows n0..n1 from it: the integer dots
// matmul_blocks runs for M up to 64 rows, groups of 8 rows (the same bits). Returns 1 (nothing
// done) for a K, format or M beyond them.
extern "C" void blocks_quantize(int8_t* qx, int32_t* xc, float* dx, float* sx, const float* x,
                                int format, long M, long K) {
  quantize_rows(qx, dx, sx, x, M, K);
  if (format != Q8_0 && PAIRED) pair_blocks(qx, xc, M, K);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  if (format == Q8_0) flip_sign(qx, M * K);
#endif
}

extern "C" int blocks_cols(float* out, long ldo, const int8_t* qx, const int32_t* xc,
                           const float* dx, const float* sx, const uint8_t* w, const f16* scales,
                           int format, long M, long K, long n0, long n1) {
  if (K % QK || format < Q8_0 || format > Q4_Z || M > INT_MAX_ROWS) return 1;
  switch (format) {
    case Q8_0: cols<Q8_0>(out, ldo, qx, xc, dx, sx, w, scales, M, K, n0, n1); break;
    case Q4_0: cols<Q4_0>(out, ldo, qx, xc, dx, sx, w, scales, M, K, n0, n1); break;
    case Q4_1: cols<Q4_1>(out, ldo, qx, xc, dx, sx, w, scales, M, K, n0, n1); break;
    default: cols<Q4_Z>(out, ldo, qx, xc, dx, sx, w, scales, M, K, n0, n1); break;
  }
  return 0;
}
