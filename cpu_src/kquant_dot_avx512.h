// The k-quant dots with AVX-512 (BW; VNNI's vpdpwssd where the build has it): each super-block
// unpacked once into registers, 64 values a register in x's own order, then dotted with each
// row of x from there. Per 64 values and row: one vpmaddubsw (q unsigned <= 63 times qx
// signed: a pair's sum fits int16) and one vpdpwssd against the scales (vpmaddwd + vpaddd
// without VNNI). Included by matmul_kquants.cpp only.
#pragma once
// GCC 12 takes the AVX-512 intrinsics' deliberately undefined operand for an uninitialized one
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "kquant_format.h"

namespace kq {

// A super-block in registers: q[k] values 64 k .. 64 k + 63 as unsigned bytes; s[k] the int16
// scale of each of vpmaddubsw's 32 pair sums of q[k]; mn the 16 min factors (one per 16 values).
struct Regs512 {
  __m512i q[4], s[4];
  __m256i mn;
  float d, c;
};

// The four 64-value chunks' scales from the 16 per-16-value scales s16: pair sum i of chunk k
// is values 64 k + 2 i, + 1, whose scale is s16[4 k + i / 8].
inline void spread512(__m256i s16, __m512i* s) {
  const __m512i z = _mm512_castsi256_si512(s16);
  const __m512i eighth = _mm512_srli_epi16(
      _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13,
                       12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      3);  // i / 8
  for (int k = 0; k < 4; k++)
    s[k] = _mm512_permutexvar_epi16(_mm512_add_epi16(eighth, _mm512_set1_epi16(4 * k)), z);
}

// 32 bytes in both halves of a register.
inline __m512i both_halves(const uint8_t* p) {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)p));
}

template <int F> inline Regs512 load512(const uint8_t* b) {
  Regs512 r;
  const __m512i low = _mm512_set1_epi8(15);
  __m256i s16;
  if constexpr (F == Q6_K) {
    // q[2 h]: ql's low nibbles with qh's bits 0-1 (values 128 h + 0..31) and 2-3 (+ 32..63);
    // q[2 h + 1]: the high nibbles with bits 4-5 and 6-7. Bitwise selects (vpternlog 0xE4:
    // C ? A : B) join the nibbles and the pairs moved beside them.
    const __m512i pairs = _mm512_set1_epi8(0x33), shift = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0);
    for (int h = 0; h < 2; h++) {
      const __m512i l = _mm512_loadu_si512(b + 64 * h);
      const __m512i hi = _mm512_and_si512(_mm512_srlv_epi64(both_halves(b + 128 + 32 * h), shift),
                                          pairs);
      r.q[2 * h] = _mm512_ternarylogic_epi64(l, _mm512_slli_epi64(hi, 4), low, 0xE4);
      r.q[2 * h + 1] = _mm512_ternarylogic_epi64(_mm512_srli_epi64(l, 4), hi, low, 0xE4);
    }
    s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b + 192)));
    r.mn = s16;
  } else if constexpr (F == Q2_K || F == Q3_K) {
    // q[2 h + g]: bits 4 g, + 1 of qs[32 h + l] in the low 256 bits (value 128 h + 64 g + l),
    // bits 4 g + 2, + 3 in the high 256 (+ 32). Q3_K: value 32 k + l's third bit is bit k of
    // hmask[l], moved to bit 2 (k = 2 (2 h + g) + half).
    const __m512i pair = _mm512_set1_epi8(3), two = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0);
    const uint8_t* qs = b + (F == Q2_K ? 16 : 32);
    for (int h = 0; h < 2; h++) {
      const __m512i v = _mm512_srlv_epi64(both_halves(qs + 32 * h), two);
      r.q[2 * h] = _mm512_and_si512(v, pair);
      r.q[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi64(v, 4), pair);
    }
    if constexpr (F == Q2_K) {
      const __m128i v = _mm_loadu_si128((const __m128i*)b), nib = _mm_set1_epi8(15);
      s16 = _mm256_cvtepu8_epi16(_mm_and_si128(v, nib));
      r.mn = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), nib));
    } else {
      const __m512i bit = _mm512_set1_epi8(4), one = _mm512_set_epi64(1, 1, 1, 1, 0, 0, 0, 0);
      const __m512i h = _mm512_srlv_epi64(both_halves(b), one);  // bit 2 k: chunk k's half
      const __m512i at2[4] = {_mm512_slli_epi64(h, 2), h, _mm512_srli_epi64(h, 2),
                              _mm512_srli_epi64(h, 4)};
      for (int k = 0; k < 4; k++) r.q[k] = _mm512_ternarylogic_epi64(r.q[k], at2[k], bit, 0xF8);
      s16 = _mm256_cvtepi8_epi16(q3_scales_vec(b + 96));
      r.mn = s16;
    }
  } else {
    // q[c]: nibble byte 32 c + l's low half in the low 256 bits (value 64 c + l), its high half
    // in the high 256 (64 c + 32 + l). Q5_K: value 32 g + l's fifth bit is bit g of qh[l].
    const uint8_t* qs = b + (F == Q4_K ? 16 : 48);
    const __m512i shift = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
    for (int c = 0; c < 4; c++)
      r.q[c] = _mm512_and_si512(_mm512_srlv_epi64(both_halves(qs + 32 * c), shift), low);
    if constexpr (F == Q5_K) {
      const __m512i bit = _mm512_set1_epi8(16), one = _mm512_set_epi64(1, 1, 1, 1, 0, 0, 0, 0);
      const __m512i h = _mm512_srlv_epi64(both_halves(b + 16), one);  // bit 2 c: group 2 c + half
      const __m512i at4[4] = {_mm512_slli_epi64(h, 4), _mm512_slli_epi64(h, 2), h,
                              _mm512_srli_epi64(h, 2)};
      for (int c = 0; c < 4; c++) r.q[c] = _mm512_ternarylogic_epi64(r.q[c], at4[c], bit, 0xF8);
    }
    uint64_t sc, mn;
    scales_mins_words(b + 4, sc, mn);
    const __m128i v = _mm_cvtsi64_si128((long long)sc), m = _mm_cvtsi64_si128((long long)mn);
    s16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(v, v));  // each group's scale twice
    r.mn = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m));
  }
  spread512(s16, r.s);
  factors<F>(b, r.d, r.c);
  return r;
}

// sum_j sc[j] sum_i q qx over the super-block, as 16 int32 lanes; x its 256 qx.
inline __m512i dot512(const Regs512& r, const int8_t* x) {
  __m512i acc[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
  for (int k = 0; k < 4; k++) {
    const __m512i p = _mm512_maddubs_epi16(r.q[k], _mm512_loadu_si512(x + 64 * k));
#if defined(__AVX512VNNI__)
    acc[k % 2] = _mm512_dpwssd_epi32(acc[k % 2], p, r.s[k]);
#else
    acc[k % 2] = _mm512_add_epi32(acc[k % 2], _mm512_madd_epi16(p, r.s[k]));
#endif
  }
  return _mm512_add_epi32(acc[0], acc[1]);
}

// out[m * N] for the MR rows of x: one W row (its super-blocks at w) against each, every
// super-block unpacked once; per row a float32 vector of the scaled dots and one of the mins.
template <int F, int MR>
void dot_rows(float* out, long N, const uint8_t* w, const int8_t* qx, const float* dx,
              const int16_t* bs, long K) {
  const long nb = K / QK;
  __m512 vacc[MR];
  __m256 vmin[MR];
  for (int m = 0; m < MR; m++) vacc[m] = _mm512_setzero_ps(), vmin[m] = _mm256_setzero_ps();
  for (long b = 0; b < nb; b++) {
    const uint8_t* blk = w + b * BLOCK_BYTES[F];
    prefetch_ahead<F>(blk);
    const Regs512 r = load512<F>(blk);
    for (int m = 0; m < MR; m++) {
      const __m512i is = dot512(r, qx + m * K + b * QK);
      const __m256i b16 = _mm256_loadu_si256((const __m256i*)(bs + (m * K + b * QK) / 16));
      const __m256i im = _mm256_madd_epi16(b16, r.mn);
      const float e = dx[m * nb + b];
      vacc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_set1_ps(r.d * e), vacc[m]);
      vmin[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(im), _mm256_set1_ps(r.c * e), vmin[m]);
    }
  }
  for (int m = 0; m < MR; m++) {
    typedef float v16 __attribute__((vector_size(64)));
    out[m * N] = hsum_v((v16)vacc[m]) - hsum8((v8)vmin[m]);
  }
}

// out[0] and out[1]: two W rows (at w0 and w1) against one row of x, each row's sums exactly as
// dot_rows<F, 1> makes them; the two chains interleaved (a decode's one row of x alone leaves
// each chain waiting on its loads).
template <int F>
void dot_two_rows(float* out, const uint8_t* w0, const uint8_t* w1, const int8_t* qx,
                  const float* dx, const int16_t* bs, long K) {
  const long nb = K / QK;
  __m512 vacc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  __m256 vmin[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  const uint8_t* rows[2] = {w0, w1};
  for (long b = 0; b < nb; b++) {
    const __m256i b16 = _mm256_loadu_si256((const __m256i*)(bs + b * QK / 16));
    const float e = dx[b];
    for (int r = 0; r < 2; r++) {
      const uint8_t* blk = rows[r] + b * BLOCK_BYTES[F];
      prefetch_ahead<F>(blk);
      const Regs512 g = load512<F>(blk);
      const __m512i is = dot512(g, qx + b * QK);
      const __m256i im = _mm256_madd_epi16(b16, g.mn);
      vacc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_set1_ps(g.d * e), vacc[r]);
      vmin[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(im), _mm256_set1_ps(g.c * e), vmin[r]);
    }
  }
  typedef float v16 __attribute__((vector_size(64)));
  for (int r = 0; r < 2; r++) out[r] = hsum_v((v16)vacc[r]) - hsum8((v8)vmin[r]);
}

}  // namespace kq
