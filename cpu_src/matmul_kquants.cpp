// Matrix products with GGUF's k-quant weights as the file stores them: W transposed, (N, K),
// each row a run of super-blocks of 256 values (kquant_format.h: the layouts). x is quantized
// once per product as llama.cpp's Q8_K: per row and 256 values, dx = absmax / 127, qx =
// round(x / dx) (ties to even), and bs[j] = the sum of each 16 qx. With a super-block's values
// w[16 j + i] = d sc[j] q - c mn[j] (Q4_K/Q5_K: the group's 6-bit scale and min, c = dmin;
// Q6_K: mn = 32 sc, c = d; Q2_K: the 4-bit scale and min, c = dmin; Q3_K: sc = s - 32 signed,
// q = its 3 bits + 4 unsigned, mn = 4 sc, c = d) its product is integers and two float terms:
//   dx (d sum_j sc[j] sum_i q qx - c sum_j mn[j] bs[j])
// the mins costing one multiply per 16 values. Every batch size computes this same function
// (of x quantized), in float32.
// Up to INT_MAX_ROWS rows of x (decodes, batches, short prompts): each W row read once for
// every X_ROWS rows of x and dotted with them ROWS at a time (dot_rows: AVX-512 in
// kquant_dot_avx512.h, AVX2 in kquant_dot_avx2.h, elsewhere each super-block unpacked into
// bytes (Unpacked) and plain loops; the integer sums are exact either way, only the float
// additions' order differs). One row of
// x (a decode) takes W's rows two at a time on AVX2 and AVX-512 (dot_two_rows: two independent
// chains, each row's sums as dot_rows makes them; the AVX2 LM head of a Qwen3-MoE-shaped Q4_K_M
// file, Q6_K 49,152 x 1,024, went from 2.49 to 1.07 ms a token).
// More rows (prefill): with AVX512-VNNI from GEMM_MIN_ROWS rows an integer GEMM whose lanes are
// 16 rows of x (kquant_gemm_vnni.h); otherwise past INT_MAX_ROWS, TILE W rows dequantized into a
// float32 tile, multiplied by the BLAS's sgemm with x's quantized values (the same function
// again, each in its own float32 order).
// Threads: one task per run of W's rows. (The unpacking loops carry no `omp simd`: with it GCC
// 12 at -O3 -fopenmp left the float32 tiles unwritten; GCC vectorizes them as they are.)
#include <memory>
#include <vector>

#include "blas.h"
#include "common.h"
#include "dequant_tiles.h"
#include "kquant_format.h"

#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define KQ_AVX512 1
#include "kquant_dot_avx512.h"
#if defined(__AVX512VNNI__)
#define KQ_GEMM 1
#include "kquant_gemm_vnni.h"
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include "kquant_dot_avx2.h"
#endif

namespace {

using namespace kq;

const long NB = 64;  // W rows per thread at least, in the tiles' product
// W rows per float32 tile: each sgemm call packs all of x anew, so fewer, larger calls (Q6_K
// 2048 x 5632 at 512 rows, one thread: 64 rows 147 ms, 128 132, 256 122)
const long TILE = 256;
// Rows of x up to which the integer dots run: they read x's rows again for each W row, from the
// caches while they fit (Q4_K one thread, integer dots against tiles: 2048 x 5632 at 128 rows
// 32 against 44 ms, at 256 60 against 69; 5632 x 2048 at 256 75 against 74, at 512 302
// against 138)
const long INT_MAX_ROWS = 128;
// Rows of x a super-block meets at once: AVX-512 keeps the unpacked block and 4 rows' sums in
// its 32 registers; AVX2 unpacks q for each row anyway, and 16 rows share a block's scales
// (x86-64-v3 build, Q6_K 2048 x 5632, 16 rows, one thread: 4 at a time 6.8 ms, 16 at a time 6.0)
#if defined(KQ_AVX512) || !(defined(__AVX2__) && defined(__FMA__))
const int ROWS = 4;
#else
const int ROWS = 16;
#endif
const long GEMV_WORK = 1L << 19;
#if defined(KQ_GEMM)
// Rows of x from which the VNNI GEMM (kquant_gemm_vnni.h) takes over from the integer dots (one
// thread, TinyLlama's Q4_K gate|up 2048 x 11264: 32 rows 11.1 against 13.1 ms, 64 rows 13.6
// against 26.7, 128 rows 26.1 against 54.1; at 512 rows 93.5 against the float32 tiles' 190).
// Not lower: an expert of the fused step that many rows goes whole, on its own.
const long GEMM_MIN_ROWS = 64;
#endif
// Rows of x up to which the integer dots run; more go through the VNNI GEMM where the build has
// it, else the float32 tiles (matmul_k, and kquants_dot_rows for the fused expert step)
#if defined(KQ_GEMM)
const long DOT_ROWS = std::min(INT_MAX_ROWS, GEMM_MIN_ROWS - 1);
#else
const long DOT_ROWS = INT_MAX_ROWS;
#endif
// Rows of x that meet every W row of a run before the next X_ROWS do (a multiple of ROWS): their
// quantized values stay in L1 while W's rows come from L2, instead of all M rows coming again
// for each W row
const long X_ROWS = 32;

// x (M, K) -> qx (M, K) int8, dx (M, K/256), bs (M, K/16) int16: Q8_K.
void quantize_rows(int8_t* qx, float* dx, int16_t* bs, const float* x, long M, long K) {
  for (long m = 0; m < M; m++)
    for (long b = 0; b < K / QK; b++) {
      int8_t* q = qx + m * K + b * QK;
      const float d = quantize_block<QK>(q, x + m * K + b * QK);
      for (int j = 0; j < 16; j++) {
        int s = 0;
        for (int i = 0; i < 16; i++) s += q[16 * j + i];
        bs[(m * K + b * QK) / 16 + j] = (int16_t)s;
      }
      dx[m * (K / QK) + b] = d;
    }
}

#if !defined(KQ_AVX512) && !(defined(__AVX2__) && defined(__FMA__))
// sum_j sc[j] sum_i q qx over the super-block (exact int32), from its unpacked q.
inline int32_t dot_scaled(const Unpacked& u, const int8_t* qx) {
  int32_t total = 0;
  for (int j = 0; j < 16; j++) {
    int32_t s = 0;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < 16; i++) s += (int32_t)u.q[16 * j + i] * qx[16 * j + i];
    total += u.sc[j] * s;
  }
  return total;
}

// sum_j mn[j] bs[j] (exact int32).
inline int32_t dot_mins(const int16_t* mn, const int16_t* bs) {
  int32_t s = 0;
  for (int j = 0; j < 16; j++) s += (int32_t)mn[j] * bs[j];
  return s;
}

// out[m * N] for the MR rows of x: one W row (its super-blocks at w) against each, each
// super-block unpacked once for all of them.
template <int F, int MR>
void dot_rows(float* out, long N, const uint8_t* w, const int8_t* qx, const float* dx,
              const int16_t* bs, long K) {
  const long nb = K / QK;
  Unpacked u;
  float acc[MR] = {};
  for (long b = 0; b < nb; b++) {
    prefetch_ahead<F>(w + b * BLOCK_BYTES[F]);
    unpack<F>(w + b * BLOCK_BYTES[F], u);
    for (int m = 0; m < MR; m++) {
      const int32_t is = dot_scaled(u, qx + m * K + b * QK);
      const int32_t im = dot_mins(u.mn, bs + (m * K + b * QK) / 16);
      acc[m] += dx[m * nb + b] * (u.d * (float)is - u.c * (float)im);
    }
  }
  for (int m = 0; m < MR; m++) out[m * N] = acc[m];
}
#endif

// dot_rows for r (1..MR) rows of x.
template <int F, int MR = ROWS>
void dot_some_rows(long r, float* out, long N, const uint8_t* w, const int8_t* qx,
                   const float* dx, const int16_t* bs, long K) {
  if constexpr (MR > 1) {
    if (r < MR) return dot_some_rows<F, MR - 1>(r, out, N, w, qx, dx, bs, K);
  }
  dot_rows<F, MR>(out, N, w, qx, dx, bs, K);
}

// out[m * ldo + n] for W's rows n0..n1 against the M rows of x, ROWS at a time (each W row's
// bytes stay in L1 from one group to the next).
template <int F>
void cols(float* out, long ldo, const int8_t* qx, const float* dx, const int16_t* bs,
          const uint8_t* w, long M, long K, long n0, long n1) {
  const long row = K / QK * BLOCK_BYTES[F], nb = K / QK;
#if defined(KQ_AVX512) || (defined(__AVX2__) && defined(__FMA__))
  if (M == 1) {  // a decode: W's rows two at a time (dot_two_rows), the same sums
    float pair[2];
    for (; n0 + 1 < n1; n0 += 2) {
      dot_two_rows<F>(pair, w + n0 * row, w + (n0 + 1) * row, qx, dx, bs, K);
      out[n0] = pair[0], out[n0 + 1] = pair[1];
    }
  }
#endif
  for (long m0 = 0; m0 < M; m0 += X_ROWS)
    for (long n = n0; n < n1; n++)
      for (long m = m0; m < std::min(M, m0 + X_ROWS); m += ROWS)
        dot_some_rows<F>(std::min<long>(ROWS, M - m), out + m * ldo + n, ldo, w + n * row,
                         qx + m * K, dx + m * nb, bs + m * K / 16, K);
}

// out (M, N) with the integer dots, W's rows split over nt threads.
template <int F>
void gemv(float* out, const int8_t* qx, const float* dx, const int16_t* bs, const uint8_t* w,
          long M, long K, long N, int nt) {
  const long per = (N + nt - 1) / nt;
  on_threads(nt, [&](int t) {
    cols<F>(out, N, qx, dx, bs, w, M, K, std::min(N, t * per), std::min(N, (t + 1) * per));
  });
}

// One W row (K values) as float32: d sc q - c mn, per 16 values.
template <int F> void dequant_row(float* out, const uint8_t* w, long K) {
  Unpacked u;
  for (long b = 0; b < K / QK; b++) {
    unpack<F>(w + b * BLOCK_BYTES[F], u);
    for (int j = 0; j < 16; j++) {
      const float s = u.d * u.sc[j], c = u.c * u.mn[j];
      for (int i = 0; i < 16; i++) out[b * QK + 16 * j + i] = s * u.q[16 * j + i] - c;
    }
  }
}

template <int F>
void gemm_tiles(float* out, const int8_t* qx, const float* dx, const uint8_t* w, long M, long K,
                long N, int nt) {
  const long row = K / QK * BLOCK_BYTES[F];
  gemm_dequant_tiles<QK>(
      out, qx, dx, M, K, N, nt, [&](float* r, long n) { dequant_row<F>(r, w + n * row, K); }, TILE);
}

template <int F>
void matmul_k(float* out, const float* x, const uint8_t* w, long M, long K, long N, int threads) {
  std::unique_ptr<int8_t[]> qx(new int8_t[M * K]);
  std::unique_ptr<float[]> dx(new float[M * K / QK]);
  std::unique_ptr<int16_t[]> bs(new int16_t[M * K / 16]);
  quantize_rows(qx.get(), dx.get(), bs.get(), x, M, K);
  const long work = 2 * M * K * N;
  if (M > DOT_ROWS) {
    const int nt = (int)std::min<long>(threads_for(work, threads), std::max(1L, N / NB));
#if defined(KQ_GEMM)
    gemm_vnni<F>(out, qx.get(), dx.get(), bs.get(), w, M, K, N, nt);
#else
    gemm_tiles<F>(out, qx.get(), dx.get(), w, M, K, N, nt);
#endif
    return;
  }
  const int nt = (int)std::min<long>(work < GEMV_WORK ? 1 : threads, N);
  gemv<F>(out, qx.get(), dx.get(), bs.get(), w, M, K, N, nt);
}

}  // namespace

// out: (M, N) float32; x: (M, K) float32; w: (N, K / 256 super-blocks of the format) bytes;
// format: 0 Q4_K, 1 Q5_K, 2 Q6_K, 3 Q2_K, 4 Q3_K; all row-major contiguous. Returns 1 (nothing
// done) for a K that is not a multiple of 256, or an unknown format.
extern "C" int matmul_kquants(float* out, const float* x, const uint8_t* w, int format, long M,
                              long K, long N, int threads) {
  if (K % QK || format < Q4_K || format > Q3_K) return 1;
  if (M == 0) return 0;
  switch (format) {
    case Q4_K: matmul_k<Q4_K>(out, x, w, M, K, N, threads); break;
    case Q5_K: matmul_k<Q5_K>(out, x, w, M, K, N, threads); break;
    case Q2_K: matmul_k<Q2_K>(out, x, w, M, K, N, threads); break;
    case Q3_K: matmul_k<Q3_K>(out, x, w, M, K, N, threads); break;
    default: matmul_k<Q6_K>(out, x, w, M, K, N, threads); break;
  }
  return 0;
}

// The fused expert step's pieces (moe_experts.cpp), the products above taken apart: x (M, K)
// quantized as matmul_kquants quantizes it (qx (M, K), dx (M, K/256), bs (M, K/16)), and
// out[m * ldo + n] for W's rows n0..n1 from x quantized, the dots matmul_kquants runs for M up
// to 128 rows (the same bits). Returns 1 (nothing done) for a K, format or M beyond them.
// Rows of x up to which matmul_kquants runs the integer dots that kquants_cols runs (more go
// through the VNNI GEMM or the float32 tiles, in another float32 order): the fused expert step
// takes an expert of more rows whole, so that its sums keep the loop's bits.
extern "C" long kquants_dot_rows() { return DOT_ROWS; }

extern "C" void kquants_quantize(int8_t* qx, float* dx, int16_t* bs, const float* x, long M,
                                 long K) {
  quantize_rows(qx, dx, bs, x, M, K);
}

extern "C" int kquants_cols(float* out, long ldo, const int8_t* qx, const float* dx,
                            const int16_t* bs, const uint8_t* w, int format, long M, long K,
                            long n0, long n1) {
  if (K % QK || format < Q4_K || format > Q3_K || M > INT_MAX_ROWS) return 1;
  switch (format) {
    case Q4_K: cols<Q4_K>(out, ldo, qx, dx, bs, w, M, K, n0, n1); break;
    case Q5_K: cols<Q5_K>(out, ldo, qx, dx, bs, w, M, K, n0, n1); break;
    case Q2_K: cols<Q2_K>(out, ldo, qx, dx, bs, w, M, K, n0, n1); break;
    case Q3_K: cols<Q3_K>(out, ldo, qx, dx, bs, w, M, K, n0, n1); break;
    default: cols<Q6_K>(out, ldo, qx, dx, bs, w, M, K, n0, n1); break;
  }
  return 0;
}
