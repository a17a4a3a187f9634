// Matrix products with the weights stored in fewer bytes: out (M, N) float32 = x (M, K) float32
// @ W (K, N), W bf16 (the high half of a float32: same values, half the bytes) or int8 with one
// float32 scale per column (W = q * scale[n], a quarter of the bytes). Accumulation is float32.
// M <= GEMV_MAX_ROWS (decode at small batch, bound by memory): a GEMV that streams W's bytes
// once (float32 weights take it too for 2 to GEMV_MAX_ROWS rows: matmul_f32_rows), each weight
// converted once and used for every row of x. More rows: the columns split over
// the threads, each dequantizing blocks of NB columns into its own float32 tile and multiplying
// it with the BLAS's single-threaded sgemm (the tile's conversion is K * NB, the product
// M * K * NB). AVX2 + FMA builds convert 8 weights with one widening load and a shift (bf16)
// or a convert (int8); other CPUs get a plain loop. The rest is GCC's vectorization.
// Threads: the GEMV splits W's rows (whole rows stream best), partial sums added per column
// slice after a barrier; the tiled product one task per slice of columns.
#include <memory>
#include <vector>

#include "blas.h"
#include "common.h"

namespace {

const long NB = 256;       // columns per dequantized tile
const long PANEL = 8;      // W rows the GEMV walks together
const long GEMV_WORK = 1L << 19;

inline float wf(uint16_t b) { return __builtin_bit_cast(float, (uint32_t)b << 16); }  // bf16
inline float wf(int8_t q) { return (float)q; }  // int8: the column's scale comes after
inline float wf(float w) { return w; }           // float32: the few-rows product below

// Eight weights as eight float32 lanes (v8, common.h). AVX2: one widening load and a shift
// (bf16) or a convert (int8); elsewhere a plain loop.
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
inline v8 load_w8(const uint16_t* p) {  // bf16: zero-extend, shift into the high half
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
  return (v8)_mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
inline v8 load_w8(const int8_t* p) {  // int8: sign-extend, convert
  return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
inline v8 load_w8(const float* p) { return load8(p); }
#else
template <typename W> inline v8 load_w8(const W* p) {
  v8 v;
  for (int i = 0; i < 8; i++) v[i] = wf(p[i]);
  return v;
}
#endif

// acc (MR, N) += x[:, k0:k1) @ W[k0:k1, :] for the MR rows of x (row stride K). PANEL rows of
// W at a time, walked together across blocks of 8 * NV columns: the block's MR x NV vectors of
// sums stay in registers over the panel's rows, each weight converted once for all MR rows.
template <typename W, int MR>
void gemv_rows(float* acc, const float* x, long K, const W* w, long N, long k0, long k1) {
  constexpr int NV = 8 / MR;
  constexpr long CB = 8 * NV;
  const long full = N / CB * CB;
  for (long k = k0; k < k1; k += PANEL) {
    const long p = std::min(PANEL, k1 - k);
    for (long c = 0; c < full; c += CB) {
      v8 sum[MR][NV];
      for (int m = 0; m < MR; m++)
        for (int v = 0; v < NV; v++) sum[m][v] = load8(acc + m * N + c + 8 * v);
      for (long r = 0; r < p; r++) {
        const W* wr = w + (k + r) * N + c;
        v8 wv[NV];
        for (int v = 0; v < NV; v++) wv[v] = load_w8(wr + 8 * v);
        for (int m = 0; m < MR; m++) {
          const float a = x[m * K + k + r];
          for (int v = 0; v < NV; v++) sum[m][v] += a * wv[v];
        }
      }
      for (int m = 0; m < MR; m++)
        for (int v = 0; v < NV; v++) store8(acc + m * N + c + 8 * v, sum[m][v]);
    }
    for (long r = 0; r < p; r++)  // the last N - full columns
      for (int m = 0; m < MR; m++)
        for (long n = full; n < N; n++) acc[m * N + n] += x[m * K + k + r] * wf(w[(k + r) * N + n]);
  }
}

// out (MR, N) = x (MR, K) @ W, times scale[n] when given. Each thread sums a run of W's rows
// into its own (MR, N) partial; after the barrier each adds up a slice of the columns.
template <typename W, int MR>
void gemv(float* out, const float* x, const W* w, const float* scale, long K, long N, int nt) {
  std::vector<float> parts((size_t)nt * MR * N, 0.0f);
  const long per = ((K + nt - 1) / nt + PANEL - 1) / PANEL * PANEL;
#pragma omp parallel num_threads(nt)
  {
#pragma omp for schedule(static)
    for (int t = 0; t < nt; t++)
      gemv_rows<W, MR>(parts.data() + (size_t)t * MR * N, x, K, w, N, std::min(K, t * per),
                       std::min(K, (t + 1) * per));
#pragma omp for schedule(static)
    for (long n = 0; n < N; n++)
      for (int m = 0; m < MR; m++) {
        float s = 0.0f;
        for (int t = 0; t < nt; t++) s += parts[((size_t)t * MR + m) * N + n];
        out[m * N + n] = scale ? s * scale[n] : s;
      }
  }
}

// tile (K, nb) float32 = W[:, b0:b0+nb) dequantized.
template <typename W>
void dequant_tile(float* tile, const W* w, const float* scale, long K, long N, long b0, long nb) {
  for (long k = 0; k < K; k++) {
    const W* row = w + k * N + b0;
    float* t = tile + k * nb;
    if (scale) {
#pragma omp simd
      for (long j = 0; j < nb; j++) t[j] = wf(row[j]) * scale[b0 + j];
    } else {
#pragma omp simd
      for (long j = 0; j < nb; j++) t[j] = wf(row[j]);
    }
  }
}

// out (M, N) = x (M, K) @ W: per thread a slice of columns, NB at a time through a float32 tile.
template <typename W>
void gemm_tiles(float* out, const float* x, const W* w, const float* scale, long M, long K, long N,
                int nt) {
  const long per = ((N + nt - 1) / nt + 7) / 8 * 8;
  on_threads(nt, [&](int t) {
    const long n0 = t * per, n1 = std::min(N, n0 + per);
    std::unique_ptr<float[]> tile(new float[K * NB]);  // (K, NB)
    for (long b0 = n0; b0 < n1; b0 += NB) {
      const long nb = std::min(NB, n1 - b0);
      dequant_tile(tile.get(), w, scale, K, N, b0, nb);
      sgemm(ROW_MAJOR, NO_TRANS, NO_TRANS, M, nb, K, 1.0f, x, K, tile.get(), nb, 0.0f, out + b0,
            N);
    }
  });
}

template <typename W>
void matmul_w(float* out, const float* x, const W* w, const float* scale, long M, long K, long N,
              int threads) {
  const long work = 2 * M * K * N;
  if (M > GEMV_MAX_ROWS) {
    const long nt = std::min<long>(threads_for(work, threads), std::max(1L, N / NB));
    gemm_tiles(out, x, w, scale, M, K, N, (int)nt);
    return;
  }
  const int nt = (int)std::min<long>(work < GEMV_WORK ? 1 : threads, std::max(1L, K / PANEL));
  switch (M) {
    case 1: gemv<W, 1>(out, x, w, scale, K, N, nt); break;
    case 2: gemv<W, 2>(out, x, w, scale, K, N, nt); break;
    case 3: gemv<W, 3>(out, x, w, scale, K, N, nt); break;
    case 4: gemv<W, 4>(out, x, w, scale, K, N, nt); break;
    case 5: gemv<W, 5>(out, x, w, scale, K, N, nt); break;
    case 6: gemv<W, 6>(out, x, w, scale, K, N, nt); break;
    case 7: gemv<W, 7>(out, x, w, scale, K, N, nt); break;
    case 8: gemv<W, 8>(out, x, w, scale, K, N, nt); break;
    default: break;  // M == 0
  }
}

}  // namespace

// out: (M, N) float32; x: (M, K) float32; w: (K, N) bf16 bits; all row-major contiguous.
extern "C" void matmul_bf16(float* out, const float* x, const uint16_t* w, long M, long K, long N,
                            int threads) {
  matmul_w(out, x, w, nullptr, M, K, N, threads);
}

// out: (M, N) float32; x: (M, K) float32; w: (K, N) int8; scale: (N,) float32.
extern "C" void matmul_int8(float* out, const float* x, const int8_t* w, const float* scale,
                            long M, long K, long N, int threads) {
  matmul_w(out, x, w, scale, M, K, N, threads);
}

// out (M, N) = x (M, K) @ w (K, N), all float32, for 2 <= M <= GEMV_MAX_ROWS (matmul.cpp's
// few-rows case): the GEMV above reads W once for every row, where the BLAS's sgemm packs all
// of W for each call (3-4x the time of one row, measured, for 2-8 rows).
void matmul_f32_rows(float* out, const float* x, const float* w, long M, long K, long N,
                     int threads) {
  matmul_w(out, x, w, nullptr, M, K, N, threads);
}

// The vector instructions the loops above were compiled for.
extern "C" const char* matmul_quant_isa() {
#if defined(__AVX512F__)
  return "AVX-512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "AVX2+FMA";
#else
  return "portable (no AVX2+FMA)";
#endif
}
