// Matrix products over weights packed at load in panels: out (M, N) = x (M, K) @ W (K, N) with
// W kept as N/16 panels of (K, 16), a panel's 16 columns of one row side by side and its K rows
// one after another (engine/backends/quant.py, to_panels), float32, or int8 with a float32
// scale per column applied to the finished sums (to_int8_panels). The products read W in exactly
// the order they use it, so nothing is packed per call: OpenBLAS's sgemm copies all of W into
// its own panels on every call, which at 64 rows took a third of its time here.
//
// A tile of R rows of x and V panels keeps its R x V sums of 16 columns in registers over the
// whole of K: each step loads V rows of W's panels, and each of the R values of x (one per row)
// is broadcast and multiplied into them. With AVX-512 (32 registers, a panel's row in one) a
// tile is 12 rows x 2 panels (24 sums); with AVX2 (16 registers, a panel's row in two) 6 x 1.
// One or two rows keep up to four sets of sums that take turns over k, as many as the
// registers hold (AVX2's two rows: three; four spilled to the stack). W's panels stream from memory
// once per block of MC rows; x's rows and the tile's panels stay in L1/L2.
// Threads: one run of whole panel groups (V panels) each, all rows (panels.h).
#include "panels.h"
#if defined(__AVX2__)
// GCC 12 takes the AVX-512 intrinsics' deliberately undefined operand for an uninitialized one
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#endif

namespace {

// A register of float32 lanes, and how many of them hold a panel's row (GCC splits wider
// vector types into memory operations, not registers).
#if defined(__AVX512F__)
typedef float vf __attribute__((vector_size(64)));
const int MR = 12, NV = 2, REGS = 32;
#elif defined(__AVX2__)
typedef float vf __attribute__((vector_size(32)));
const int MR = 6, NV = 1, REGS = 16;
#elif defined(__aarch64__)  // NEON: 32 registers of 4 floats, a panel's row in four
typedef float vf __attribute__((vector_size(16)));
const int MR = 6, NV = 1, REGS = 32;
#else  // SSE2: 16 registers of 4 floats (a 32-byte vector there is two, and 6 rows spill)
typedef float vf __attribute__((vector_size(16)));
const int MR = 3, NV = 1, REGS = 16;
#endif
const long PANEL_COLS = 16;
const int LANES = sizeof(vf) / 4, H = PANEL_COLS / LANES;
// Rows of a panel ahead that a tile asks for (prefetches) while it works, where it does 6 or more
// FMAs per 64 bytes of W (AVX2: 3+ rows; AVX-512: 6+): there the hardware's prefetcher fell
// behind (AVX2 at 5 rows 1.36x faster, AVX-512 at 8 rows 1.17x); with less work per byte the
// extra instructions cost more than they gave (AVX-512 at 3-5 rows: 6% slower).
const long PREFETCH = 24;
const long MC = 96;  // rows of x per pass over W (a multiple of MR; 24-516 measured the same)

// A panel's row of 16 weights as H float32 vectors: float32 as is; int8 sign-extended and
// converted (the column's scale comes after the sum).
// (A vector at a time: one 64-byte memcpy into two ymm registers is four 16-byte stores and
// two 32-byte reloads on AVX2, each reload stalled on store forwarding: 8x slower, measured.)
inline void load_row(vf* b, const float* p) {
#pragma GCC unroll 4
  for (int h = 0; h < H; h++) std::memcpy(&b[h], p + h * LANES, sizeof(vf));
}
inline void load_row(vf* b, const int8_t* p) {
#if defined(__AVX512F__)  // GCC's vector conversions compile this to scalar code
  b[0] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#elif defined(__AVX2__)
  for (int h = 0; h < H; h++)
    b[h] = (vf)_mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8 * h))));
#else
  for (int h = 0; h < H; h++) {
    vf v = {};
    for (int l = 0; l < LANES; l++) v[l] = (float)p[h * LANES + l];
    b[h] = v;
  }
#endif
}

// out[r, v*16 : v*16+16] = sum_k x[r, k] * w[v][k, :] (* scale[v*16 : v*16+16] for int8)
// for r < R, v < V. x: rows at stride ldx; w: V panels of (K, 16), one after another; out:
// rows at stride ldo.
template <int R, int V, typename W>
void tile(float* out, long ldo, const float* x, long ldx, const W* w, const float* scale,
          long K) {
  // One or two rows have too few sums to hide an FMA's latency: U sets of them (up to 4, as
  // many as the registers left beside a panel row and x's value hold) take turns over k and
  // are added at the end.
  constexpr int FREE = REGS - V * H - 2, SETS = FREE / (R * V * H);
  constexpr int U = R > 2 ? 1 : SETS > 4 ? 4 : SETS < 1 ? 1 : SETS;
  vf acc[U][R][V * H];
#pragma GCC unroll 4
  for (int u = 0; u < U; u++)
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
      for (int c = 0; c < V * H; c++) acc[u][r][c] = vf{};
  long k = 0;
  auto step = [&](int u) {
    vf b[V * H];
#pragma GCC unroll 4
    for (int v = 0; v < V; v++) {
      if constexpr (R * H >= 6) __builtin_prefetch(w + (v * K + k + PREFETCH) * PANEL_COLS);
      load_row(b + v * H, w + (v * K + k) * PANEL_COLS);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
      const float a = x[r * ldx + k];
#pragma GCC unroll 4
      for (int c = 0; c < V * H; c++) acc[u][r][c] += a * b[c];
    }
    k++;
  };
  while (k + U <= K)
#pragma GCC unroll 4
    for (int u = 0; u < U; u++) step(u);
  while (k < K) step(0);
  vf s[V * H];
#pragma GCC unroll 4
  for (int c = 0; c < V * H; c++) {
    if constexpr (sizeof(W) == 1)
      std::memcpy(&s[c], scale + c * LANES, sizeof(vf));
    else
      s[c] = vf{} + 1.0f;
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; r++)
#pragma GCC unroll 4
    for (int c = 0; c < V * H; c++) {
      vf y = acc[0][r][c];
#pragma GCC unroll 4
      for (int u = 1; u < U; u++) y += acc[u][r][c];
      if constexpr (sizeof(W) == 1) y *= s[c];
      std::memcpy(out + r * ldo + c * LANES, &y, sizeof(vf));
    }
}

// out (M, N) = x (M, K) @ the panels w (N/16, K, 16) (times scale (N,) for int8).
template <typename W>
void product(float* out, const float* x, const W* w, const float* scale, long M, long K, long N,
             int threads) {
  walk_panels<MR, NV>(M, N, MC, M * K * N * 2, threads, [&](long r, auto R, long p, auto V) {
    tile<decltype(R)::value, decltype(V)::value>(out + r * N + p * PANEL_COLS, N, x + r * K, K,
                                                 w + p * K * PANEL_COLS, scale + p * PANEL_COLS,
                                                 K);
  });
}

}  // namespace

// out: (M, N); x: (M, K) row-major; w: (N/16, K, 16) float32 panels; N a multiple of 16.
extern "C" void matmul_panels_f32(float* out, const float* x, const float* w, long M, long K,
                                  long N, int threads) {
  product(out, x, w, (const float*)nullptr, M, K, N, threads);
}

// The same with w int8 panels and one float32 scale per column: out = (x @ q) * scale.
extern "C" void matmul_panels_int8(float* out, const float* x, const int8_t* w,
                                   const float* scale, long M, long K, long N, int threads) {
  product(out, x, w, scale, M, K, N, threads);
}
