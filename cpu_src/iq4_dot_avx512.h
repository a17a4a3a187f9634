// The IQ4 dots with AVX-512 (BW, VL; VNNI's vpdpbusd and vpdpwssd where the build has them),
// 64 values a register. IQ4_XS: a super-block's 128 index bytes in two loads of 64, each one
// register of low nibbles and one of high (no shuffling of W), x reordered to match once per
// product (xs_order); each 16-bit word's run scale ls - 32 spread by one vpermw per 128 values.
// IQ4_NL: blocks two at a time, their 16 index bytes spread to [low, high] 128-bit lanes by
// vpermq and a shift, x in its own order. Indices go through vpshufb into |KV| and a mask of the
// negative levels (index < 8); per row of x and 64 values qx is negated under the mask (a masked
// vpsubb: AVX-512 has no vpsignb), then |KV| times it: vpdpbusd (IQ4_NL), or vpmaddubsw (a
// pair's sum fits int16) and vpdpwssd against the run scales (IQ4_XS; vpmaddwd + vpaddd
// without VNNI). Included by matmul_iq4.cpp only, inside its namespace, after KV, half, the
// formats and its AVX2 levels and dot32 (an odd IQ4_NL count's last block).
#pragma once
// GCC 12 takes the AVX-512 intrinsics' deliberately undefined operand for an uninitialized one
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

namespace iq4 {

// 32 index bytes (two runs of 16, at p and q) -> the 64 indices in value order, p's run first.
inline __m512i indices2(const uint8_t* p, const uint8_t* q) {
  const __m256i v = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)p)),
      _mm_loadu_si128((const __m128i*)q), 1);
  const __m512i spread = _mm512_set_epi64(3, 2, 3, 2, 1, 0, 1, 0);  // lanes p, p, q, q
  const __m512i s = _mm512_permutexvar_epi64(spread, _mm512_castsi256_si512(v));
  const __m512i n = _mm512_srlv_epi64(s, _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0));
  return _mm512_and_si512(n, _mm512_set1_epi8(15));
}

// |KV| times qx at x, its sign from the mask, as 32 int16 pair sums (|sum| <= 2 127 127).
inline __m512i pairs16(__m512i ukv, __mmask64 neg, const int8_t* x) {
  const __m512i v = _mm512_loadu_si512(x);
  return _mm512_maddubs_epi16(ukv, _mm512_mask_sub_epi8(v, neg, _mm512_setzero_si512(), v));
}

// acc + the products of the 64 levels with qx at x summed per 32-bit lane (lanes 0-7 the first
// run's), IQ4_XS's each times its run's scale (ls16: the scale in each 16-bit word).
template <int F>
inline __m512i dot64(__m512i acc, __m512i ukv, __mmask64 neg, const int8_t* x, __m512i ls16) {
#if defined(__AVX512VNNI__)
  if constexpr (F == IQ4_NL) {
    const __m512i v = _mm512_loadu_si512(x);
    return _mm512_dpbusd_epi32(acc, ukv, _mm512_mask_sub_epi8(v, neg, _mm512_setzero_si512(), v));
  }
  return _mm512_dpwssd_epi32(acc, pairs16(ukv, neg, x), ls16);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs16(ukv, neg, x), ls16));
#endif
}

// An IQ4_XS super-block's 8 run scales ls - 32 as int32 lanes.
inline __m256i xs_scales(const uint8_t* b) {
  uint32_t low;
  std::memcpy(&low, b + 4, 4);
  const int high = b[2] | b[3] << 8;
  const __m256i l = _mm256_srlv_epi32(_mm256_set1_epi32((int)low),
                                      _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
  const __m256i h = _mm256_srlv_epi32(_mm256_set1_epi32(high),
                                      _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
  const __m256i h2 = _mm256_and_si256(h, _mm256_set1_epi32(3));
  const __m256i ls = _mm256_or_si256(_mm256_and_si256(l, _mm256_set1_epi32(15)),
                                     _mm256_slli_epi32(h2, 4));
  return _mm256_sub_epi32(ls, _mm256_set1_epi32(32));
}

// x for dot_row_xs: each 128 values' qx (four runs of 32) as the low nibbles of their 64 index
// bytes meet them, then as the high ones: [run r's 0..15 for r = 0..3], [run r's 16..31].
inline void xs_order(int8_t* qx, long M, long K) {
  for (long c = 0; c < M * K; c += 128) {
    int8_t t[128];
    for (int r = 0; r < 4; r++) {
      std::memcpy(t + 16 * r, qx + c + 32 * r, 16);
      std::memcpy(t + 64 + 16 * r, qx + c + 32 * r + 16, 16);
    }
    std::memcpy(qx + c, t, 128);
  }
}

// out[m * N] for the MR rows of x (in xs_order) against one IQ4_XS W row: per super-block, two
// halves of 128 values, each one load of 64 index bytes whose low nibbles and high ones are a
// register of 64 levels each (16-bit word w's scale: run 4 h + w / 8's), each row's integer
// sum in one vector, then one float32 factor d dx.
template <int MR>
void dot_row_xs(float* out, long N, const uint8_t* w, const int8_t* qx, const float* dx, long K) {
  const long nb = K / 256;
  const __m512i table = _mm512_abs_epi8(
      _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)KV)));
  const __m512i low = _mm512_set1_epi8(15), eight = _mm512_set1_epi8(8);
  __m512i pick[2];  // word w of half h: the low word of ls's lane 4 h + w / 8
  for (int h = 0; h < 2; h++) {
    alignas(64) int16_t idx[32];
    for (int k = 0; k < 32; k++) idx[k] = (int16_t)(2 * (4 * h + k / 8));
    pick[h] = _mm512_load_si512(idx);
  }
  __m512 acc[MR];
  for (int m = 0; m < MR; m++) acc[m] = _mm512_setzero_ps();
  for (long b = 0; b < nb; b++) {
    const uint8_t* blk = w + b * 136;
    const __m512i ls = _mm512_castsi256_si512(xs_scales(blk));
    const float d = half(blk);
    __m512i isum[MR];
    for (int m = 0; m < MR; m++) isum[m] = _mm512_setzero_si512();
    for (int h = 0; h < 2; h++) {
      const __m512i v = _mm512_loadu_si512(blk + 8 + 64 * h);
      const __m512i lo = _mm512_and_si512(v, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      const __m512i ulo = _mm512_shuffle_epi8(table, lo), uhi = _mm512_shuffle_epi8(table, hi);
      const __mmask64 nlo = _mm512_cmplt_epu8_mask(lo, eight);
      const __mmask64 nhi = _mm512_cmplt_epu8_mask(hi, eight);
      const __m512i ls16 = _mm512_permutexvar_epi16(pick[h], ls);
      for (int m = 0; m < MR; m++) {
        const int8_t* x = qx + m * K + b * 256 + 128 * h;
        isum[m] = dot64<IQ4_XS>(isum[m], ulo, nlo, x, ls16);
        isum[m] = dot64<IQ4_XS>(isum[m], uhi, nhi, x + 64, ls16);
      }
    }
    for (int m = 0; m < MR; m++)
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m]), _mm512_set1_ps(d * dx[m * nb + b]),
                               acc[m]);
  }
  for (int m = 0; m < MR; m++) out[m * N] = _mm512_reduce_add_ps(acc[m]);
}

// out[m * N] for the MR rows of x against one IQ4_NL W row: blocks two at a time, each pair's
// sums times [d dx of b x 8, of b + 1 x 8]; an odd count's last block as the AVX2 code takes it
// (levels, dot32).
template <int MR>
void dot_row_nl(float* out, long N, const uint8_t* w, const int8_t* qx, const float* dx, long K) {
  const long nb = K / 32;
  const __m512i table = _mm512_abs_epi8(
      _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)KV)));
  const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i one = _mm512_set1_epi16(1);
  __m512 acc[MR];
  for (int m = 0; m < MR; m++) acc[m] = _mm512_setzero_ps();
  long b = 0;
  for (; b + 2 <= nb; b += 2) {
    const uint8_t* blk = w + b * 18;
    const float d0 = half(blk), d1 = half(blk + 18);
    const __m512i idx = indices2(blk + 2, blk + 20);
    const __m512i ukv = _mm512_shuffle_epi8(table, idx);
    const __mmask64 neg = _mm512_cmplt_epu8_mask(idx, _mm512_set1_epi8(8));
    for (int m = 0; m < MR; m++) {
      const float* s = dx + m * nb + b;
      const __m512 f = _mm512_permutexvar_ps(
          halves, _mm512_castps128_ps512(_mm_setr_ps(d0 * s[0], d1 * s[1], 0.0f, 0.0f)));
      const __m512i dot =
          dot64<IQ4_NL>(_mm512_setzero_si512(), ukv, neg, qx + m * K + b * 32, one);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), f, acc[m]);
    }
  }
  if (b < nb) {
    const uint8_t* blk = w + b * 18;
    const float d = half(blk);
    const __m256i kv = levels(blk + 2), ukv = _mm256_abs_epi8(kv);
    for (int m = 0; m < MR; m++) {
      const __m256i dot = dot32<IQ4_NL>(_mm256_setzero_si256(), kv, ukv, qx + m * K + b * 32, 1);
      const __m512 v = _mm512_castps256_ps512(_mm256_cvtepi32_ps(dot));
      acc[m] = _mm512_mask3_fmadd_ps(v, _mm512_set1_ps(d * dx[m * nb + b]), acc[m], 0x00FF);
    }
  }
  for (int m = 0; m < MR; m++) out[m * N] = _mm512_reduce_add_ps(acc[m]);
}

}  // namespace iq4
