// GGUF's k-quant super-blocks as the file stores them (model_loader/kquants.py lays them out),
// 256 values each:
//   Q4_K (144 bytes): d, dmin, 12 bytes of 6-bit sc and m for 8 groups of 32, 128 bytes of
//     nibbles (byte 32 c + l: value 64 c + l low, 64 c + 32 + l high): w = (d sc_g) q - dmin m_g;
//   Q5_K (176 bytes): d, dmin, the scales, 32 bytes of fifth bits (value 32 g + l: bit g of
//     byte l), the nibbles: the same with q 5 bits;
//   Q6_K (210 bytes): 128 bytes of low nibbles, 64 of high pairs, 16 int8 sc, d: value
//     128 h + 32 j + l from ql[64 h + 32 (j % 2) + l] (low nibble for j < 2) and bits 2 j of
//     qh[32 h + l]; w = (d sc_j) (q - 32), 16 groups of 16;
//   Q2_K (84 bytes): 16 bytes of 4-bit sc (low nibble) and m (high) per 16 values, 64 bytes of
//     2-bit q (value 128 h + 32 j + l: bits 2 j of qs[32 h + l]), d, dmin: w = (d sc_j) q -
//     dmin m_j;
//   Q3_K (110 bytes): 32 bytes of third bits (value 128 h + 32 j + l: bit 4 h + j of hmask[l]),
//     64 bytes of low pairs (as Q2_K's), 12 bytes of 16 6-bit scales s_j, d: w = d (s_j - 32)
//     (low + 4 high - 4), i.e. with u = low + 4 high in [0, 7] and sc = s_j - 32 (signed):
//     w = (d sc_j) u - d (4 sc_j).
// The portable unpacking (Unpacked: q as bytes, a scale and a min factor per 16 values) and the
// scale decoding the vector paths share. Included by matmul_kquants.cpp only.
#pragma once
#include <cstdint>
#include <cstring>

#include "common.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kq {

const long QK = 256;  // values per super-block

enum { Q4_K = 0, Q5_K = 1, Q6_K = 2, Q2_K = 3, Q3_K = 4 };
const long BLOCK_BYTES[5] = {144, 176, 210, 84, 110};

// One super-block unpacked: w[16 j + i] = d sc[j] q[16 j + i] - c mn[j] (Q4_K/Q5_K: sc, mn =
// the group's sc, m, c = dmin; Q6_K: mn = 32 sc, c = d; Q2_K: sc, mn = the 4-bit sc, m, c =
// dmin; Q3_K: sc = s - 32, mn = 4 sc, c = d).
struct Unpacked {
  alignas(32) uint8_t q[QK];   // the 256 values' q, unsigned
  alignas(32) int16_t mn[16];  // the min factor per 16 values
  int16_t sc[16];              // the scale per 16 values
  float d, c;
};

inline float half(const uint8_t* p) {
  f16 h;
  std::memcpy(&h, p, 2);
  return (float)h;
}

// Q4_K/Q5_K's 12 bytes -> the 8 groups' 6-bit scales and mins.
inline void scales_mins(const uint8_t* s, uint8_t* sc, uint8_t* m) {
  for (int j = 0; j < 4; j++) {
    sc[j] = s[j] & 63;
    m[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 6) << 4);
    m[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

// The same, four at a time in 32-bit words: the 8 scales' bytes in sc, the 8 mins' in m.
inline void scales_mins_words(const uint8_t* s, uint64_t& sc, uint64_t& m) {
  uint32_t w0, w1, w2;
  std::memcpy(&w0, s, 4);
  std::memcpy(&w1, s + 4, 4);
  std::memcpy(&w2, s + 8, 4);
  const uint32_t sc_hi = (w2 & 0x0f0f0f0f) | ((w0 >> 6) & 0x03030303) << 4;
  const uint32_t m_hi = ((w2 >> 4) & 0x0f0f0f0f) | ((w1 >> 6) & 0x03030303) << 4;
  sc = (w0 & 0x3f3f3f3f) | (uint64_t)sc_hi << 32;
  m = (w1 & 0x3f3f3f3f) | (uint64_t)m_hi << 32;
}

// Q3_K's 12 bytes -> its 16 scales less 32 (signed): scale i's low 4 bits are byte i % 8's low
// (i < 8) or high nibble, its top 2 bits bits 2 (i / 4), + 1 of byte 8 + i % 4; four at a time
// in 32-bit words.
inline void q3_scales(const uint8_t* s, int8_t* sc) {
  uint32_t w[3], out[4];
  std::memcpy(w, s, 12);
  for (int k = 0; k < 4; k++) {
    const uint32_t low = (w[k % 2] >> (4 * (k / 2))) & 0x0f0f0f0f;
    const uint32_t top = (w[2] >> (2 * k)) & 0x03030303;
    out[k] = low | top << 4;
  }
  uint8_t b[16];
  std::memcpy(b, out, 16);
  for (int i = 0; i < 16; i++) sc[i] = (int8_t)(b[i] - 32);
}

#if defined(__AVX2__)
// q3_scales in a register, for the vector paths: the 16 scales less 32 as int8 (the 12 bytes
// read as 8 + 4, never past the block).
inline __m128i q3_scales_vec(const uint8_t* s) {
  uint32_t top;
  std::memcpy(&top, s + 8, 4);
  const __m128i v = _mm_loadl_epi64((const __m128i*)s), nib = _mm_set1_epi8(15);
  const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(v, nib),
                                         _mm_and_si128(_mm_srli_epi16(v, 4), nib));
  const __m128i hi = _mm_and_si128(
      _mm_srlv_epi32(_mm_set1_epi32((int)top), _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3));
  return _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi32(hi, 4)), _mm_set1_epi8(32));
}
#endif

template <int F> void unpack(const uint8_t* b, Unpacked& u) {
  if constexpr (F == Q6_K) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t* sc = (const int8_t*)(b + 192);
    for (int h = 0; h < 2; h++)
      for (int j = 0; j < 4; j++)
        for (int l = 0; l < 32; l++) {
          const uint8_t lo = (ql[64 * h + 32 * (j % 2) + l] >> (4 * (j / 2))) & 15;
          u.q[128 * h + 32 * j + l] = lo | (((qh[32 * h + l] >> (2 * j)) & 3) << 4);
        }
    for (int j = 0; j < 16; j++) u.sc[j] = sc[j], u.mn[j] = (int16_t)(32 * sc[j]);
    u.d = u.c = half(b + 208);
  } else if constexpr (F == Q2_K || F == Q3_K) {
    const uint8_t* qs = b + (F == Q2_K ? 16 : 32);
    for (int h = 0; h < 2; h++)
      for (int j = 0; j < 4; j++)
        for (int l = 0; l < 32; l++) u.q[128 * h + 32 * j + l] = (qs[32 * h + l] >> (2 * j)) & 3;
    if constexpr (F == Q2_K) {
      for (int j = 0; j < 16; j++) u.sc[j] = b[j] & 15, u.mn[j] = b[j] >> 4;
      u.d = half(b + 80);
      u.c = half(b + 82);
    } else {
      for (int k = 0; k < 8; k++)
        for (int l = 0; l < 32; l++) u.q[32 * k + l] |= ((b[l] >> k) & 1) << 2;
      int8_t sc[16];
      q3_scales(b + 96, sc);
      for (int j = 0; j < 16; j++) u.sc[j] = sc[j], u.mn[j] = (int16_t)(4 * sc[j]);
      u.d = u.c = half(b + 108);
    }
  } else {
    uint8_t sc[8], m[8];
    scales_mins(b + 4, sc, m);
    const uint8_t* qs = b + (F == Q4_K ? 16 : 48);
    for (int c = 0; c < 4; c++)
      for (int l = 0; l < 32; l++) {
        u.q[64 * c + l] = qs[32 * c + l] & 15;
        u.q[64 * c + 32 + l] = qs[32 * c + l] >> 4;
      }
    if constexpr (F == Q5_K) {
      const uint8_t* qh = b + 16;
      for (int g = 0; g < 8; g++)
        for (int l = 0; l < 32; l++) u.q[32 * g + l] |= ((qh[l] >> g) & 1) << 4;
    }
    for (int j = 0; j < 16; j++) u.sc[j] = sc[j / 2], u.mn[j] = m[j / 2];
    u.d = half(b);
    u.c = half(b + 2);
  }
}

// Bytes ahead of the super-block being read that the dots ask the caches for: a W row's
// blocks and the next rows' are one stream, which the hardware's prefetchers alone followed at
// half the speed on a shared machine (Q6_K one thread, 7 against 15 GB/s; 1 KiB ahead: 10-13).
const long PREFETCH = 2048;

// Asks for the cache lines PREFETCH bytes past super-block b of format F.
template <int F> inline void prefetch_ahead(const uint8_t* b) {
  for (long o = 0; o < BLOCK_BYTES[F]; o += 64) __builtin_prefetch(b + PREFETCH + o);
}

// A super-block's float factors of the scaled dot (d) and of the mins' dot (c) for the vector
// paths, whose mins for Q6_K and Q3_K are their 16 scales themselves (mn = 32 sc, 4 sc: the 32
// or 4 goes in c).
template <int F> inline void factors(const uint8_t* b, float& d, float& c) {
  if constexpr (F == Q6_K) {
    d = half(b + 208);
    c = 32.0f * d;
  } else if constexpr (F == Q2_K) {
    d = half(b + 80);
    c = half(b + 82);
  } else if constexpr (F == Q3_K) {
    d = half(b + 108);
    c = 4.0f * d;
  } else {
    d = half(b);
    c = half(b + 2);
  }
}

}  // namespace kq
