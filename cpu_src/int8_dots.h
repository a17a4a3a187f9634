// Vector helpers the block-format products share (matmul_blocks.cpp, matmul_q5.cpp,
// matmul_mxfp4.cpp): a float32 vector's lane sum, the integer dots of unsigned codes with int8 x
// (AVX2, or AVX512-VNNI's vpdpbusd where present), and NEON's sixteen-product dot.
#pragma once

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// The lane sum of 8 floats: ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)).
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// c + the products of unsigned ua with the 32 int8 x at xa and of ub with the 32 at xb, summed
// per 32-bit lane. Without VNNI the caller's codes must be small enough that two pairs of
// products fit int16 (vpmaddubsw, then the two added before vpmaddwd).
static inline __m256i dot2(__m256i c, __m256i ua, const int8_t* xa, __m256i ub, const int8_t* xb) {
  const __m256i va = _mm256_loadu_si256((const __m256i*)xa);
  const __m256i vb = _mm256_loadu_si256((const __m256i*)xb);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(c, ua, va), ub, vb);
#else
  const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(ua, va), _mm256_maddubs_epi16(ub, vb));
  return _mm256_add_epi32(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)), c);
#endif
}
#elif defined(__ARM_NEON)
#include <arm_neon.h>

// Sixteen int8 products added into four int32 lanes: vdotq_s32 where the CPU has ARMv8.2's
// dot product instructions (-march=native on Graviton 2 and later, Apple M1 and later), else
// vmull_s8 to int16 and pairwise adds into int32 (exact for every int8, -128 included).
static inline int32x4_t dot16(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(acc, a, b);
#else
  acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b)));
  return vpadalq_s16(acc, vmull_high_s8(a, b));
#endif
}
#endif
