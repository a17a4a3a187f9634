// Matrix products with bf16 weights in panels and bf16 inputs: out (M, N) float32 = bf16(x)
// (M, K) @ W (K, N), W bf16 kept as N/16 panels whose rows go in pairs, (N/16, K/2, 16, 2):
// for each pair of rows k, k+1, the panel's 16 columns, each column's two values side by side
// (engine/backends/quant.py, to_bf16_panels). x is rounded to bf16 (to nearest even) once per
// call, its values paired the same way, and the sums are float32.
//
// That is the layout of AVX512-BF16's vdpbf16ps, which adds 16 sums of two products a pair of
// rows at a time (twice float32 FMA's multiply-adds per instruction): with it, a tile of 12
// rows x 2 panels keeps its 24 sums in registers as matmul_panels.cpp does, each pair of x's
// values broadcast as one 32-bit word. Without it the tile (12 x 2 with AVX-512, 4 x 1 with
// AVX2 and NEON, 2 x 1 with SSE2, each sized to its registers: 4-lane vectors without AVX2,
// where GCC splits an 8-lane one and spilled to the stack) widens a pair's 16 words into the even row's values (the low halves, shifted up) and
// the odd row's (the high halves, masked) and does two float32 FMAs with x's two rounded values
// as float32: the same products (a product of two bf16 values is exact in float32), summed in
// another order.
// Threads: x's rows split for the rounding; then one run of whole panel groups each, all rows
// (panels.h).
#include <vector>

#include "panels.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

// Registers of float32 lanes and of 32-bit words (a column's pair of bf16 values), and how many
// hold a panel's row (GCC splits wider vector types into memory operations, not registers).
#if defined(__AVX512F__)
typedef float vf __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
const int MR = 12, NV = 2;
#elif defined(__AVX2__)
typedef float vf __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(32)));
const int MR = 4, NV = 1;  // 8 of AVX2's 16 registers for the sums, 4 for a pair's values
#else  // 4-lane registers, a panel's row in four: NEON's 32 hold 4 rows' sums, SSE2's 16 two
typedef float vf __attribute__((vector_size(16)));
typedef uint32_t vu __attribute__((vector_size(16)));
#if defined(__aarch64__)
const int MR = 4, NV = 1;
#else
const int MR = 2, NV = 1;
#endif
#endif
const long PANEL_COLS = 16;
const int LANES = sizeof(vf) / 4, H = PANEL_COLS / LANES;
const long MC = 96;  // rows of x per pass over W (a multiple of MR)
#if defined(__AVX512BF16__)
const long PAIR_WORDS = 1;  // x's pair of values as one word of two bf16
#else
const long PAIR_WORDS = 2;  // as two float32
#endif

// x (M, K) float32 -> xw (M, K/2) words: bf16(x[m, 2j]) in the low half, bf16(x[m, 2j+1])
// in the high half; rounded to nearest even, a NaN kept a NaN (common.h's from_f32<bf16>).
// Without AVX512-BF16: (M, K) float32 of those values instead (ldx counts pairs either way).
void round_pairs(uint32_t* xw, const float* x, long M, long K, int threads) {
  const int nt = threads_for(M * K * 8, threads);
  const long per = (M + nt - 1) / nt;
  on_threads(nt, [&](int t) {
    const long n0 = t * per * K, n1 = std::min(M, (t + 1) * per) * K;
    for (long i = n0; i < n1; i += 2) {
      uint32_t h[2];
      for (int j = 0; j < 2; j++) {
        uint32_t u;
        std::memcpy(&u, x + i + j, 4);
        const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        h[j] = (u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : r;
      }
#if defined(__AVX512BF16__)
      xw[i / 2] = h[0] | h[1] << 16;
#else  // the two values as float32, for the FMAs to broadcast
      xw[i] = h[0] << 16;
      xw[i + 1] = h[1] << 16;
#endif
    }
  });
}

// out[r, v*16 : v*16+16] = sum over row pairs j of the tile's products, r < R, v < V.
// xw: R rows of J words at stride ldx; w: V panels of (J, 16) words, one after another.
template <int R, int V>
void tile(float* out, long ldo, const uint32_t* xw, long ldx, const uint32_t* w, long J) {
#if defined(__AVX512BF16__)
  __m512 acc[R][V];
#pragma GCC unroll 16
  for (int r = 0; r < R; r++)
#pragma GCC unroll 4
    for (int v = 0; v < V; v++) acc[r][v] = _mm512_setzero_ps();
  for (long j = 0; j < J; j++) {
    __m512bh b[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; v++) b[v] = (__m512bh)_mm512_loadu_si512(w + (v * J + j) * PANEL_COLS);
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32((int)xw[r * ldx + j]);
#pragma GCC unroll 4
      for (int v = 0; v < V; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; r++)
#pragma GCC unroll 4
    for (int v = 0; v < V; v++) std::memcpy(out + r * ldo + v * PANEL_COLS, &acc[r][v], 64);
#else
  vf acc[R][V * H];
#pragma GCC unroll 16
  for (int r = 0; r < R; r++)
#pragma GCC unroll 4
    for (int c = 0; c < V * H; c++) acc[r][c] = vf{};
  for (long j = 0; j < J; j++) {
    vf even[V * H], odd[V * H];
#pragma GCC unroll 4
    for (int c = 0; c < V * H; c++) {
      vu words;
      std::memcpy(&words, w + ((c / H) * J + j) * PANEL_COLS + (c % H) * LANES, sizeof(vu));
      even[c] = (vf)(words << 16);
      odd[c] = (vf)(words & 0xffff0000u);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
      const float* xf = (const float*)xw + (r * ldx + j) * PAIR_WORDS;
      const float a0 = xf[0], a1 = xf[1];
#pragma GCC unroll 4
      for (int c = 0; c < V * H; c++) acc[r][c] += a1 * odd[c] + a0 * even[c];
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; r++)
#pragma GCC unroll 4
    for (int c = 0; c < V * H; c++)
      std::memcpy(out + r * ldo + c * LANES, &acc[r][c], sizeof(vf));
#endif
}

}  // namespace

// out: (M, N); x: (M, K) row-major float32; w: (N/16, K/2, 16, 2) bf16 bits; K even, N a
// multiple of 16.
extern "C" void matmul_panels_bf16(float* out, const float* x, const uint16_t* w, long M, long K,
                                   long N, int threads) {
  static thread_local std::vector<uint32_t> pairs;  // x's pairs as words (or floats: twice)
  if ((long)pairs.size() < M * K) pairs.resize(M * K);
  uint32_t* xw = pairs.data();
  round_pairs(xw, x, M, K, threads);
  const long J = K / 2;
  const uint32_t* ww = (const uint32_t*)w;
  walk_panels<MR, NV>(M, N, MC, M * K * N * 2, threads, [&](long r, auto R, long p, auto V) {
    tile<decltype(R)::value, decltype(V)::value>(out + r * N + p * PANEL_COLS, N,
                                                 xw + r * J * PAIR_WORDS, J,
                                                 ww + p * J * PANEL_COLS, J);
  });
}

// Whether the bf16 panels multiply with AVX512-BF16's dot products (1) or float32 FMAs (0).
extern "C" int matmul_panels_bf16_dot() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}
