// The k-quant dots with AVX2: a super-block's scales decoded once (the 6-bit ones four at a
// time in 32-bit words) into 16 int16 that one byte shuffle per 32 values spreads, its q
// unpacked in registers for each row of x (from L1), vpmaddubsw (q unsigned <= 63, qx signed:
// a pair's sum fits int16) then vpmaddwd against the scales; the mins one vpmaddwd of bs.
// Included by matmul_kquants.cpp only.
#pragma once
#include <immintrin.h>

#include "kquant_format.h"

namespace kq {

// A super-block's 16 scales (one per 16 values) as int16, in the two forms scaled_dot reads:
// lo: scales 0-7 in both 128-bit lanes, hi: scales 8-15 in both.
struct Scales {
  __m256i lo, hi;
};

inline Scales spread(__m256i s16) {
  return {_mm256_permute2x128_si256(s16, s16, 0x00), _mm256_permute2x128_si256(s16, s16, 0x11)};
}

// For the 32 values of chunk k: scale 2k in the low lane's 8 int16, 2k + 1 in the high lane's
// (what vpmaddubsw's 16 pair sums of the chunk meet): one in-lane byte shuffle of lo or hi.
inline __m256i chunk_scales(const Scales& s, int k) {
  const int p = 2 * (k % 4);  // scale 2k's place within its lane
  const __m256i pick = _mm256_setr_epi8(
      2 * p, 2 * p + 1, 2 * p, 2 * p + 1, 2 * p, 2 * p + 1, 2 * p, 2 * p + 1, 2 * p, 2 * p + 1,
      2 * p, 2 * p + 1, 2 * p, 2 * p + 1, 2 * p, 2 * p + 1, 2 * p + 2, 2 * p + 3, 2 * p + 2,
      2 * p + 3, 2 * p + 2, 2 * p + 3, 2 * p + 2, 2 * p + 3, 2 * p + 2, 2 * p + 3, 2 * p + 2,
      2 * p + 3, 2 * p + 2, 2 * p + 3, 2 * p + 2, 2 * p + 3);
  return _mm256_shuffle_epi8(k < 4 ? s.lo : s.hi, pick);
}

// acc += chunk k's two 16-value halves' scales times their q . x: q 32 unsigned bytes (<= 63),
// x 32 int8; vpmaddubsw (pairs to int16: 2 x 63 x 127 fits) then vpmaddwd against the scales.
inline __m256i scaled_dot(__m256i acc, __m256i q, const int8_t* x, const Scales& s, int k) {
  const __m256i xv = _mm256_loadu_si256((const __m256i*)x);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), chunk_scales(s, k)));
}

// One super-block's sum_j sc[j] sum_i q qx (8 int32 lanes) straight from its bytes, q
// unpacked in registers; s: its 16 scales (Scales).
template <int F> inline __m256i block_dot(const uint8_t* b, const Scales& s, const int8_t* x) {
  const __m256i low = _mm256_set1_epi8(15);
  __m256i acc = _mm256_setzero_si256();
  if constexpr (F == Q6_K) {
    const __m256i top = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; h++) {
      const __m256i l0 = _mm256_loadu_si256((const __m256i*)(b + 64 * h));
      const __m256i l1 = _mm256_loadu_si256((const __m256i*)(b + 64 * h + 32));
      const __m256i qh = _mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h));
      const __m256i nib[4] = {_mm256_and_si256(l0, low), _mm256_and_si256(l1, low),
                              _mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                              _mm256_and_si256(_mm256_srli_epi16(l1, 4), low)};
      for (int j = 0; j < 4; j++) {
        // bits 2 j, 2 j + 1 of qh moved to bits 4, 5 (within each byte: the mask drops the
        // bits a 16-bit shift brings in from the other byte)
        const __m256i at4 = j < 3 ? _mm256_slli_epi16(qh, 4 - 2 * j) : _mm256_srli_epi16(qh, 2);
        const __m256i q = _mm256_or_si256(nib[j], _mm256_and_si256(at4, top));
        acc = scaled_dot(acc, q, x + 128 * h + 32 * j, s, 4 * h + j);
      }
    }
  } else if constexpr (F == Q2_K || F == Q3_K) {
    // chunk k = 4 h + j: bits 2 j, 2 j + 1 of qs[32 h + l]; Q3_K's third bit: bit k of hmask[l]
    const __m256i pair = _mm256_set1_epi8(3), bit = _mm256_set1_epi8(4);
    const uint8_t* qs = b + (F == Q2_K ? 16 : 32);
    const __m256i hm = _mm256_loadu_si256((const __m256i*)b);
    for (int h = 0; h < 2; h++) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * h));
      for (int j = 0; j < 4; j++) {
        __m256i q = _mm256_and_si256(_mm256_srli_epi16(v, 2 * j), pair);
        if constexpr (F == Q3_K) {
          const int k = 4 * h + j;
          const __m256i at2 = k < 2 ? _mm256_slli_epi16(hm, 2 - k) : _mm256_srli_epi16(hm, k - 2);
          q = _mm256_or_si256(q, _mm256_and_si256(at2, bit));
        }
        acc = scaled_dot(acc, q, x + 128 * h + 32 * j, s, 4 * h + j);
      }
    }
  } else {
    const uint8_t* qs = b + (F == Q4_K ? 16 : 48);
    const __m256i qh = _mm256_loadu_si256((const __m256i*)(b + 16));  // Q5_K's fifth bits
    for (int c = 0; c < 4; c++) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
      __m256i q[2] = {_mm256_and_si256(v, low), _mm256_and_si256(_mm256_srli_epi16(v, 4), low)};
      for (int g = 0; g < 2; g++) {
        if constexpr (F == Q5_K) {
          const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + g), _mm256_set1_epi8(1));
          q[g] = _mm256_or_si256(q[g], _mm256_slli_epi16(bit, 4));
        }
        acc = scaled_dot(acc, q[g], x + 64 * c + 32 * g, s, 2 * c + g);
      }
    }
  }
  return acc;
}

// A super-block's 16 scales (one per 16 values) and 16 min factors as int16: Q4_K/Q5_K's 8
// group scales and mins each twice, Q6_K's 16 int8 scales for both (mn = 32 sc: the 32 goes in
// the float factor), Q2_K's 4-bit scales and mins, Q3_K's 16 scales less 32 for both (mn = 4 sc).
template <int F> inline void block_scales(const uint8_t* b, __m256i& s16, __m256i& mn16) {
  if constexpr (F == Q6_K) {
    s16 = mn16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b + 192)));
  } else if constexpr (F == Q2_K) {
    const __m128i v = _mm_loadu_si128((const __m128i*)b), nib = _mm_set1_epi8(15);
    s16 = _mm256_cvtepu8_epi16(_mm_and_si128(v, nib));
    mn16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), nib));
  } else if constexpr (F == Q3_K) {
    s16 = mn16 = _mm256_cvtepi8_epi16(q3_scales_vec(b + 96));
  } else {
    uint64_t sc, mn;
    scales_mins_words(b + 4, sc, mn);
    const __m128i v = _mm_cvtsi64_si128((long long)sc), m = _mm_cvtsi64_si128((long long)mn);
    s16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(v, v));
    mn16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m));
  }
}

// out[m * N] for the MR rows of x: one W row (its super-blocks at w) against each; a row's sums
// in two float32 vector chains (scaled dots, mins).
template <int F, int MR>
void dot_rows(float* out, long N, const uint8_t* w, const int8_t* qx, const float* dx,
              const int16_t* bs, long K) {
  const long nb = K / QK;
  __m256 vacc[MR], vmin[MR];
  for (int m = 0; m < MR; m++) vacc[m] = vmin[m] = _mm256_setzero_ps();
  for (long b = 0; b < nb; b++) {
    const uint8_t* blk = w + b * BLOCK_BYTES[F];
    prefetch_ahead<F>(blk);
    __m256i s16, mn16;
    block_scales<F>(blk, s16, mn16);
    float d, c;
    factors<F>(blk, d, c);
    const Scales s = spread(s16);
    for (int m = 0; m < MR; m++) {
      const __m256i is = block_dot<F>(blk, s, qx + m * K + b * QK);
      const __m256i b16 = _mm256_loadu_si256((const __m256i*)(bs + (m * K + b * QK) / 16));
      const __m256i im = _mm256_madd_epi16(b16, mn16);
      const float e = dx[m * nb + b];
      vacc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_set1_ps(d * e), vacc[m]);
      vmin[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(im), _mm256_set1_ps(c * e), vmin[m]);
    }
  }
  for (int m = 0; m < MR; m++) out[m * N] = hsum8((v8)vacc[m]) - hsum8((v8)vmin[m]);
}

// out[0] and out[1]: two W rows (their super-blocks at w0 and w1) against one row of x, each
// row's sums exactly as dot_rows<F, 1> makes them; the two rows' chains interleaved, so a
// decode's one row of x keeps the vector units busy (each chain alone waits on its loads).
template <int F>
void dot_two_rows(float* out, const uint8_t* w0, const uint8_t* w1, const int8_t* qx,
                  const float* dx, const int16_t* bs, long K) {
  const long nb = K / QK;
  __m256 vacc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, vmin[2] = {vacc[0], vacc[1]};
  const uint8_t* rows[2] = {w0, w1};
  for (long b = 0; b < nb; b++) {
    const __m256i b16 = _mm256_loadu_si256((const __m256i*)(bs + b * QK / 16));
    const float e = dx[b];
    for (int r = 0; r < 2; r++) {
      const uint8_t* blk = rows[r] + b * BLOCK_BYTES[F];
      prefetch_ahead<F>(blk);
      __m256i s16, mn16;
      block_scales<F>(blk, s16, mn16);
      float d, c;
      factors<F>(blk, d, c);
      const __m256i is = block_dot<F>(blk, spread(s16), qx + b * QK);
      const __m256i im = _mm256_madd_epi16(b16, mn16);
      vacc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_set1_ps(d * e), vacc[r]);
      vmin[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(im), _mm256_set1_ps(c * e), vmin[r]);
    }
  }
  for (int r = 0; r < 2; r++) out[r] = hsum8((v8)vacc[r]) - hsum8((v8)vmin[r]);
}

}  // namespace kq
