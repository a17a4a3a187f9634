// Matrix products with GGUF's k-quant weights as the file stores them: W transposed, (N, K),
// each row a run of super-blocks of 256 values (model_loader/kquants.py lays them out):
//   Q4_K (144 bytes): w = (d sc_g) q - dmin m_g, q 4 bits, 8 groups of 32, 6-bit sc and m;
//   Q5_K (176 bytes): the same with q 5 bits;
//   Q6_K (210 bytes): w = (d sc_j) (q - 32), q 6 bits, 16 groups of 16, int8 sc.
// Every format is first unpacked per super-block into one shape (Unpacked): q[256] as unsigned
// bytes, an int16 scale sc[j] and "min" mn[j] per 16 values, and two float factors d, c, so
// that w[16 j + i] = d sc[j] q - c mn[j] (Q4_K/Q5_K: sc, mn = the group's sc, m, c = dmin;
// Q6_K: mn = 32 sc, c = d). x is quantized once per product as llama.cpp's Q8_K: per row and
// 256 values, dx = absmax / 127, qx = round(x / dx) (ties to even), and bs[j] = the sum of
// each 16 qx. A super-block's product is then integers and two float terms:
//   dx (d sum_j sc[j] sum_i q qx - c sum_j mn[j] bs[j])
// the mins costing one multiply per 16 values. Every batch size computes this same function
// (of x quantized), in float32.
// Up to INT_MAX_ROWS rows of x (decode, small batches): each W row's super-blocks unpacked
// once and dotted with every row. AVX2: vpmaddubsw (q unsigned <= 63, qx signed: a pair's sum
// fits int16) and vpmaddwd against the 16-value scales; with AVX512-VNNI, vpdpbusd and one
// int32 multiply by the scales. Other CPUs: plain loops (the integer sums are exact either way).
// More rows (prefill): NB W rows dequantized into a float32 tile, multiplied by the BLAS's
// sgemm with x's quantized values (the same function again).
// Threads: one task per run of W's rows. (The unpacking loops carry no `omp simd`: with it GCC
// 12 at -O3 -fopenmp left the float32 tiles unwritten; GCC vectorizes them as they are.)
#include <memory>
#include <vector>

#include "blas.h"
#include "common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

const long QK = 256;          // values per super-block
const long NB = 64;           // W rows per float32 tile
const long INT_MAX_ROWS = 16;  // rows of x up to which the integer dots run
const long GEMV_WORK = 1L << 19;

enum { Q4_K = 0, Q5_K = 1, Q6_K = 2 };
const long BLOCK_BYTES[3] = {144, 176, 210};

struct Unpacked {
  alignas(32) uint8_t q[QK];     // the 256 values' q, unsigned
  alignas(32) int16_t sc8[8][16];  // sc of the 16 values of each half of the 8 chunks of 32
  alignas(32) int32_t sc4[8][8];   // the same, per four values (vpdpbusd's lanes)
  alignas(32) int16_t mn[16];    // the min factor per 16 values
  int16_t sc[16];                // the scale per 16 values
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
  for (int c = 0; c < 8; c++)
    for (int i = 0; i < 16; i++) {
      u.sc8[c][i] = u.sc[2 * c + i / 8];
      if (i < 8) u.sc4[c][i] = u.sc[2 * c + i / 4];
    }
}

// x (M, K) -> qx (M, K) int8, dx (M, K/256), bs (M, K/16) int16: Q8_K.
void quantize_rows(int8_t* qx, float* dx, int16_t* bs, const float* x, long M, long K) {
  for (long m = 0; m < M; m++)
    for (long b = 0; b < K / QK; b++) {
      const float* v = x + m * K + b * QK;
      float amax = 0.0f;
#pragma omp simd reduction(max : amax)
      for (int i = 0; i < QK; i++) amax = std::max(amax, std::fabs(v[i]));
      const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
      int8_t* q = qx + m * K + b * QK;
#pragma omp simd
      for (int i = 0; i < QK; i++) q[i] = (int8_t)std::nearbyint(v[i] * id);
      for (int j = 0; j < 16; j++) {
        int s = 0;
        for (int i = 0; i < 16; i++) s += q[16 * j + i];
        bs[(m * K + b * QK) / 16 + j] = (int16_t)s;
      }
      dx[m * (K / QK) + b] = d;
    }
}

// sum_j sc[j] sum_i q qx over the super-block (exact int32).
inline int32_t dot_scaled(const Unpacked& u, const int8_t* qx) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256i acc = _mm256_setzero_si256();
  for (int c = 0; c < 8; c++) {
    const __m256i q = _mm256_load_si256((const __m256i*)(u.q + 32 * c));
    const __m256i x = _mm256_loadu_si256((const __m256i*)(qx + 32 * c));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x);
    acc = _mm256_add_epi32(acc, _mm256_mullo_epi32(p, _mm256_load_si256((const __m256i*)u.sc4[c])));
#else
    const __m256i p16 = _mm256_maddubs_epi16(q, x);
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p16, _mm256_load_si256((const __m256i*)u.sc8[c])));
#endif
  }
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
#else
  int32_t total = 0;
  for (int j = 0; j < 16; j++) {
    int32_t s = 0;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < 16; i++) s += (int32_t)u.q[16 * j + i] * qx[16 * j + i];
    total += u.sc[j] * s;
  }
  return total;
#endif
}

// sum_j mn[j] bs[j] (exact int32).
inline int32_t dot_mins(const Unpacked& u, const int16_t* bs) {
  int32_t s = 0;
#pragma omp simd reduction(+ : s)
  for (int j = 0; j < 16; j++) s += (int32_t)u.mn[j] * bs[j];
  return s;
}

// out[m * N] for the M rows of x: one W row (its nb super-blocks at w) against each.
template <int F>
void dot_row(float* out, long N, const uint8_t* w, const int8_t* qx, const float* dx,
             const int16_t* bs, long M, long K, Unpacked& u, float* acc) {
  const long nb = K / QK;
  for (long m = 0; m < M; m++) acc[m] = 0.0f;
  for (long b = 0; b < nb; b++) {
    unpack<F>(w + b * BLOCK_BYTES[F], u);
    for (long m = 0; m < M; m++) {
      const int32_t is = dot_scaled(u, qx + m * K + b * QK);
      const int32_t im = dot_mins(u, bs + (m * K + b * QK) / 16);
      acc[m] += dx[m * nb + b] * (u.d * (float)is - u.c * (float)im);
    }
  }
  for (long m = 0; m < M; m++) out[m * N] = acc[m];
}

// out (M, N) with the integer dots, W's rows split over nt threads.
template <int F>
void gemv(float* out, const int8_t* qx, const float* dx, const int16_t* bs, const uint8_t* w,
          long M, long K, long N, int nt) {
  const long per = (N + nt - 1) / nt, row = K / QK * BLOCK_BYTES[F];
  on_threads(nt, [&](int t) {
    Unpacked u;
    std::vector<float> acc(M);
    for (long n = t * per; n < std::min(N, (t + 1) * per); n++)
      dot_row<F>(out + n, N, w + n * row, qx, dx, bs, M, K, u, acc.data());
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

// out (M, N) = x~ (M, K) @ W^T through float32 tiles of NB W rows and sgemm.
template <int F>
void gemm_tiles(float* out, const int8_t* qx, const float* dx, const uint8_t* w, long M, long K,
                long N, int nt) {
  const long row = K / QK * BLOCK_BYTES[F];
  std::unique_ptr<float[]> xf(new float[M * K]);  // (M, K): x's quantized values
  for (long i = 0; i < M * K; i++) xf[i] = qx[i] * dx[i / QK];
  const long per = ((N + nt - 1) / nt + 7) / 8 * 8;
  on_threads(nt, [&](int t) {
    const long n0 = std::min(N, t * per), n1 = std::min(N, n0 + per);
    std::unique_ptr<float[]> tile(new float[NB * K]);  // (NB, K)
    for (long r0 = n0; r0 < n1; r0 += NB) {
      const long rows = std::min(NB, n1 - r0);
      for (long r = 0; r < rows; r++) dequant_row<F>(tile.get() + r * K, w + (r0 + r) * row, K);
      sgemm(ROW_MAJOR, NO_TRANS, TRANS, M, rows, K, 1.0f, xf.get(), K, tile.get(), K, 0.0f,
            out + r0, N);
    }
  });
}

template <int F>
void matmul_k(float* out, const float* x, const uint8_t* w, long M, long K, long N, int threads) {
  std::unique_ptr<int8_t[]> qx(new int8_t[M * K]);
  std::unique_ptr<float[]> dx(new float[M * K / QK]);
  std::unique_ptr<int16_t[]> bs(new int16_t[M * K / 16]);
  quantize_rows(qx.get(), dx.get(), bs.get(), x, M, K);
  const long work = 2 * M * K * N;
  if (M > INT_MAX_ROWS) {
    const long nt = std::min<long>(threads_for(work, threads), std::max(1L, N / NB));
    gemm_tiles<F>(out, qx.get(), dx.get(), w, M, K, N, (int)nt);
    return;
  }
  const int nt = (int)std::min<long>(work < GEMV_WORK ? 1 : threads, N);
  gemv<F>(out, qx.get(), dx.get(), bs.get(), w, M, K, N, nt);
}

}  // namespace

// out: (M, N) float32; x: (M, K) float32; w: (N, K / 256 super-blocks of the format) bytes;
// format: 0 Q4_K, 1 Q5_K, 2 Q6_K; all row-major contiguous. Returns 1 (nothing done) for a K
// that is not a multiple of 256, or an unknown format.
extern "C" int matmul_kquants(float* out, const float* x, const uint8_t* w, int format, long M,
                              long K, long N, int threads) {
  if (K % QK || format < Q4_K || format > Q6_K) return 1;
  if (M == 0) return 0;
  switch (format) {
    case Q4_K: matmul_k<Q4_K>(out, x, w, M, K, N, threads); break;
    case Q5_K: matmul_k<Q5_K>(out, x, w, M, K, N, threads); break;
    default: matmul_k<Q6_K>(out, x, w, M, K, N, threads); break;
  }
  return 0;
}
