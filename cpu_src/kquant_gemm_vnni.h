// Prompts (more rows of x than the integer dots take) with k-quant weights on AVX-512 VNNI
// builds: an integer GEMM whose vector lanes are 16 rows of x. W's rows are unpacked once per
// panel into their q bytes (unsigned) and 16-value scales; x's quantized rows are regrouped once
// per product, 16 rows a group, four values of each row side by side in each 32-bit lane. One
// vpdpbusd then multiplies a broadcast run of four of a W row's q by those four of all 16 rows
// (64 multiply-adds); four of them make a 16-value group's sums, times its scale by one
// vpmulld, exact in int32 over a super-block; per super-block each W row's 16 sums go to float32
// times d and the 16 rows' dx, one vector operation for all 16. The mins' term (c mn_j against
// x's 16-value sums bs_j) is one float32 product of (M, K/16) by (K/16, N) through sgemm
// afterwards. The function is the integer dots' (of x quantized), in another float32 order.
// Included by matmul_kquants.cpp only.
#pragma once
#include <immintrin.h>

#include <cstring>
#include <memory>

#include "blas.h"
#include "kquant_format.h"

namespace kq {

const long XG = 16;         // rows of x in a group: one a lane
const long WSET = 8;        // W rows a register set
const long WPANEL = 128;    // W rows unpacked at a time (q bytes: 0.25-0.7 MB, in L2)

// Row n of W (K values in super-blocks at w) -> q (K,) unsigned bytes, sc (K/16,) the 16-value
// scales, d (nb,), and the mins' row cm (K/16,) = c mn_j as float32.
template <int F>
void unpack_row8(uint8_t* q, int32_t* sc, float* d, float* cm, const uint8_t* w, long K) {
  Unpacked u;
  for (long b = 0; b < K / QK; b++) {
    unpack<F>(w + b * BLOCK_BYTES[F], u);
    std::memcpy(q + b * QK, u.q, QK);
    for (int j = 0; j < 16; j++) {
      sc[b * 16 + j] = u.sc[j];
      cm[b * 16 + j] = u.c * (float)u.mn[j];
    }
    d[b] = u.d;
  }
}

// x's group g of 16 rows: xg (K/4, 16, 4) int8, lane l of quad p holding row 16 g + l's values
// 4 p .. 4 p + 3; dxg (nb, 16). Rows past M are zeros.
inline void group_rows(int8_t* xg, float* dxg, const int8_t* qx, const float* dx, long g, long M,
                       long K) {
  const long nb = K / QK;
  for (long l = 0; l < XG; l++) {
    const long m = g * XG + l;
    for (long k = 0; k < K; k++) xg[(k / 4 * XG + l) * 4 + k % 4] = m < M ? qx[m * K + k] : 0;
    for (long b = 0; b < nb; b++) dxg[b * XG + l] = m < M ? dx[m * nb + b] : 0.0f;
  }
}

// o (WSET, 16): the scaled dots (no mins) of WSET W rows (w16 stride K, d stride nb) with a
// group of x (xg, dxg).
inline void set_by_group(float* o, const uint8_t* wq, const int32_t* sc, const float* d,
                         const int8_t* xg, const float* dxg, long K) {
  const long nb = K / QK, ns = K / 16;
  __m512 f[WSET];
  for (int t = 0; t < WSET; t++) f[t] = _mm512_setzero_ps();
  for (long b = 0; b < nb; b++) {
    __m512i a[WSET];
    for (int t = 0; t < WSET; t++) a[t] = _mm512_setzero_si512();
    for (long j = b * 16; j < (b + 1) * 16; j++) {  // 16 values a scale
      __m512i g[WSET];
      for (int t = 0; t < WSET; t++) g[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (long k = 16 * j; k < 16 * j + 16; k += 4) {
        const __m512i xv = _mm512_loadu_si512(xg + k * XG);
        for (int t = 0; t < WSET; t++) {
          int32_t quad;
          std::memcpy(&quad, wq + t * K + k, 4);
          g[t] = _mm512_dpbusd_epi32(g[t], _mm512_set1_epi32(quad), xv);
        }
      }
      for (int t = 0; t < WSET; t++)
        a[t] = _mm512_add_epi32(a[t], _mm512_mullo_epi32(g[t], _mm512_set1_epi32(sc[t * ns + j])));
    }
    const __m512 e = _mm512_loadu_ps(dxg + b * XG);
    for (int t = 0; t < WSET; t++)
      f[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[t]),
                             _mm512_mul_ps(_mm512_set1_ps(d[t * nb + b]), e), f[t]);
  }
  for (int t = 0; t < WSET; t++) _mm512_storeu_ps(o + t * XG, f[t]);
}

// out[m * N + n] for W's rows n0..n1 (this thread's) and every row of x (groups xg, dxg), and
// the mins' rows cm of those W rows.
template <int F>
void gemm_rows(float* out, const int8_t* xg, const float* dxg, const uint8_t* w, float* cm,
               long M, long K, long N, long n0, long n1) {
  const long nb = K / QK, ns = K / 16, row = nb * BLOCK_BYTES[F], groups = (M + XG - 1) / XG;
  const long most = (WPANEL + WSET - 1) / WSET * WSET;  // a panel's rows, padded to whole sets
  std::unique_ptr<uint8_t[]> wq(new uint8_t[most * K]);
  std::unique_ptr<int32_t[]> sc(new int32_t[most * ns]);
  std::unique_ptr<float[]> d(new float[most * nb]);
  alignas(64) float o[WSET * XG];
  for (long p0 = n0; p0 < n1; p0 += WPANEL) {
    const long rows = std::min(WPANEL, n1 - p0), padded = (rows + WSET - 1) / WSET * WSET;
    for (long r = 0; r < rows; r++)
      unpack_row8<F>(&wq[r * K], &sc[r * ns], &d[r * nb], cm + (p0 + r) * ns, w + (p0 + r) * row,
                     K);
    std::fill(&wq[rows * K], &wq[padded * K], 0);
    std::fill(&sc[rows * ns], &sc[padded * ns], 0);
    std::fill(&d[rows * nb], &d[padded * nb], 0.0f);
    for (long g = 0; g < groups; g++)
      for (long t0 = 0; t0 < padded; t0 += WSET) {
        set_by_group(o, &wq[t0 * K], &sc[t0 * ns], &d[t0 * nb], xg + g * K * XG,
                     dxg + g * nb * XG, K);
        for (long t = 0; t < std::min(WSET, rows - t0); t++)
          for (long l = 0; l < std::min(XG, M - g * XG); l++)
            out[(g * XG + l) * N + p0 + t0 + t] = o[t * XG + l];
      }
  }
}

// out (M, N) for M above the integer dots' rows: the scaled dots on nt threads, then out -= the
// mins' product, (M, K/16) x's sums bs dx by (N, K/16) cm transposed, one sgemm per thread.
template <int F>
void gemm_vnni(float* out, const int8_t* qx, const float* dx, const int16_t* bs, const uint8_t* w,
               long M, long K, long N, int nt) {
  const long nb = K / QK, ns = K / 16, groups = (M + XG - 1) / XG;
  std::unique_ptr<int8_t[]> xg(new int8_t[groups * XG * K]);  // (groups, K/4, 16, 4)
  std::unique_ptr<float[]> dxg(new float[groups * nb * XG]);    // (groups, nb, 16)
  std::unique_ptr<float[]> xs(new float[M * ns]);               // (M, K/16): bs dx
  std::unique_ptr<float[]> cm(new float[N * ns]);               // (N, K/16): c mn
  on_threads(nt, [&](int t) {
    for (long g = t; g < groups; g += nt)
      group_rows(&xg[g * XG * K], &dxg[g * nb * XG], qx, dx, g, M, K);
    for (long i = t * M / nt; i < (t + 1) * M / nt; i++)
      for (long j = 0; j < ns; j++) xs[i * ns + j] = (float)bs[i * ns + j] * dx[i * nb + j / 16];
  });
  const long per = ((N + nt - 1) / nt + WSET - 1) / WSET * WSET;
  on_threads(nt, [&](int t) {
    const long n0 = std::min(N, t * per), n1 = std::min(N, n0 + per);
    if (n0 == n1) return;
    gemm_rows<F>(out, xg.get(), dxg.get(), w, cm.get(), M, K, N, n0, n1);
    sgemm(ROW_MAJOR, NO_TRANS, TRANS, M, n1 - n0, ns, -1.0f, xs.get(), ns, cm.get() + n0 * ns, ns,
          1.0f, out + n0, N);
  });
}

}  // namespace kq
