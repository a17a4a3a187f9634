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
// Up to INT_MAX_ROWS rows of x (decodes, batches, short prompts): each W row read once and
// dotted with every row of x, 16 rows at a time (Q4_K 2048 x 5632 on one thread: 64 rows 18 ms
// against 28 through the tiles; at 128, 37 against 41). x86 (AVX2): a super-block's scales
// decoded once (the 6-bit ones four at a time in 32-bit words) into 16 int16 that one byte
// shuffle per 32 values spreads, its q unpacked in registers for each row of x (from L1),
// vpmaddubsw (q unsigned <= 63, qx signed: a pair's sum fits int16) then vpmaddwd against the
// scales (VNNI's vpdpbusd would need a vpmulld by the scales after it: slower); the mins one
// vpmaddwd of bs; two float32 vector sums per row. Other CPUs: each
// super-block unpacked once into bytes (Unpacked) for all rows, plain loops (the integer sums
// are exact either way).
// More rows (prefill): NB W rows dequantized into a float32 tile, multiplied by the BLAS's
// sgemm with x's quantized values (the same function again).
// Threads: one task per run of W's rows. (The unpacking loops carry no `omp simd`: with it GCC
// 12 at -O3 -fopenmp left the float32 tiles unwritten; GCC vectorizes them as they are.)
#include <memory>
#include <vector>

#include "blas.h"
#include "common.h"
#include "dequant_tiles.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

const long QK = 256;          // values per super-block
const long NB = 64;           // W rows per float32 tile
const long INT_MAX_ROWS = 64;  // rows of x up to which the integer dots run
const long GROUP = 16;         // rows of x a W row meets at once (dot_row's sums in registers)
const long GEMV_WORK = 1L << 19;

enum { Q4_K = 0, Q5_K = 1, Q6_K = 2 };
const long BLOCK_BYTES[3] = {144, 176, 210};

struct Unpacked {
  alignas(32) uint8_t q[QK];     // the 256 values' q, unsigned
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

// sum_j mn[j] bs[j] (exact int32).
inline int32_t dot_mins(const int16_t* mn, const int16_t* bs) {
  int32_t s = 0;
  for (int j = 0; j < 16; j++) s += (int32_t)mn[j] * bs[j];
  return s;
}

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// A super-block's 16 scales (one per 16 values) as int16, in the two forms scaled_dot reads:
// lo: scales 0-7 in both 128-bit lanes, hi: scales 8-15 in both.
struct Scales {
  __m256i lo, hi;
};

inline Scales spread(__m256i s16) {
  return {_mm256_permute2x128_si256(s16, s16, 0x00), _mm256_permute2x128_si256(s16, s16, 0x11)};
}

// For the 32 values of chunk k: scale 2k in the low lane's 8 int16, 2k + 1 in the high lane's
// (what vpmaddubsw's 16 pair sums of the chunk meet): one in-lane byte shuffle of lo or hi.
inline __m256i chunk_scales(const Scales& s, int k) {
  const int p = 2 * (k % 4);  // scale 2k's place within its lane
  const __m256i pick = _mm256_setr_epi8(
      2 * p, 2 * p + 1, 2 * p, 2 * p + 1, 2 * p, 2 * p + 1, 2 * p, 2 * p + 1, 2 * p, 2 * p + 1,
      2 * p, 2 * p + 1, 2 * p, 2 * p + 1, 2 * p, 2 * p + 1, 2 * p + 2, 2 * p + 3, 2 * p + 2,
      2 * p + 3, 2 * p + 2, 2 * p + 3, 2 * p + 2, 2 * p + 3, 2 * p + 2, 2 * p + 3, 2 * p + 2,
      2 * p + 3, 2 * p + 2, 2 * p + 3, 2 * p + 2, 2 * p + 3);
  return _mm256_shuffle_epi8(k < 4 ? s.lo : s.hi, pick);
}

// acc += chunk k's two 16-value halves' scales times their q . x: q 32 unsigned bytes (<= 63),
// x 32 int8; vpmaddubsw (pairs to int16: 2 x 63 x 127 fits) then vpmaddwd against the scales.
inline __m256i scaled_dot(__m256i acc, __m256i q, const int8_t* x, const Scales& s, int k) {
  const __m256i xv = _mm256_loadu_si256((const __m256i*)x);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), chunk_scales(s, k)));
}

// One super-block's sum_j sc[j] sum_i q qx (8 int32 lanes) straight from its bytes, q
// unpacked in registers; s: its 16 scales (Scales).
template <int F> inline __m256i block_dot(const uint8_t* b, const Scales& s, const int8_t* x) {
  const __m256i low = _mm256_set1_epi8(15);
  __m256i acc = _mm256_setzero_si256();
  if constexpr (F == Q6_K) {
    const __m256i two = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
      const __m256i l0 = _mm256_loadu_si256((const __m256i*)(b + 64 * h));
      const __m256i l1 = _mm256_loadu_si256((const __m256i*)(b + 64 * h + 32));
      const __m256i qh = _mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h));
      const __m256i nib[4] = {_mm256_and_si256(l0, low), _mm256_and_si256(l1, low),
                              _mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                              _mm256_and_si256(_mm256_srli_epi16(l1, 4), low)};
      for (int j = 0; j < 4; j++) {
        const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), two);
        const __m256i q = _mm256_or_si256(nib[j], _mm256_slli_epi16(hb, 4));
        acc = scaled_dot(acc, q, x + 128 * h + 32 * j, s, 4 * h + j);
      }
    }
  } else {
    const uint8_t* qs = b + (F == Q4_K ? 16 : 48);
    const __m256i qh = _mm256_loadu_si256((const __m256i*)(b + 16));  // Q5_K's fifth bits
    for (int c = 0; c < 4; c++) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
      __m256i q[2] = {_mm256_and_si256(v, low), _mm256_and_si256(_mm256_srli_epi16(v, 4), low)};
      for (int g = 0; g < 2; g++) {
        if constexpr (F == Q5_K) {
          const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + g), _mm256_set1_epi8(1));
          q[g] = _mm256_or_si256(q[g], _mm256_slli_epi16(bit, 4));
        }
        acc = scaled_dot(acc, q[g], x + 64 * c + 32 * g, s, 2 * c + g);
      }
    }
  }
  return acc;
}

// Q4_K/Q5_K's 12 bytes -> sc[0..7], m[0..7] as bytes, four at a time in 32-bit words.
inline void scales_mins_words(const uint8_t* s, uint32_t* sc, uint32_t* m) {
  uint32_t w[3];
  std::memcpy(w, s, 12);
  sc[0] = w[0] & 0x3f3f3f3f;
  m[0] = w[1] & 0x3f3f3f3f;
  sc[1] = (w[2] & 0x0f0f0f0f) | ((w[0] >> 6) & 0x03030303) << 4;
  m[1] = ((w[2] >> 4) & 0x0f0f0f0f) | ((w[1] >> 6) & 0x03030303) << 4;
}

// The 16 scales (one per 16 values) as int16: Q4_K/Q5_K's 8 group scales each twice, Q6_K's
// 16 int8 scales.
template <int F> inline __m256i block_scales(const void* sc) {
  if constexpr (F == Q6_K) return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)sc));
  const __m128i v = _mm_loadl_epi64((const __m128i*)sc);
  return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(v, v));
}

// The mins' sum_j mn[j] bs[j] as 8 int32 lanes: Q4_K/Q5_K's group mins m (8 bytes) against
// each 32's pair of bs; Q6_K's 16 scales (mn = 32 sc: the 32 goes in the float factor).
template <int F> inline __m256i mins_dot(const void* mn, const int16_t* bs) {
  const __m256i b = _mm256_loadu_si256((const __m256i*)bs);  // (16,) int16
  if constexpr (F == Q6_K) {
    const __m128i s = _mm_loadu_si128((const __m128i*)mn);
    return _mm256_madd_epi16(b, _mm256_cvtepi8_epi16(s));
  } else {
    const __m128i v = _mm_loadl_epi64((const __m128i*)mn);
    return _mm256_madd_epi16(b, _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(v, v)));
  }
}

// out[m * N] for the M rows of x: one W row (its nb super-blocks at w) against each; a row's
// sums in two float32 vector chains (scaled dots, mins), whatever M: its bits do not depend on
// the rows beside it.
template <int F>
void dot_row(float* out, long N, const uint8_t* w, const int8_t* qx, const float* dx,
             const int16_t* bs, long M, long K, Unpacked&, float*) {
  const long nb = K / QK;
  __m256 vacc[GROUP], vmin[GROUP];
  for (long m = 0; m < M; m++) vacc[m] = vmin[m] = _mm256_setzero_ps();
  for (long b = 0; b < nb; b++) {
    const uint8_t* blk = w + b * BLOCK_BYTES[F];
    uint32_t sc[4], mn[2];  // Q4_K/Q5_K: bytes of sc (8), m (8); Q6_K: its 16 int8 scales
    float d, c;
    if constexpr (F == Q6_K) {
      std::memcpy(sc, blk + 192, 16);
      d = half(blk + 208);
      c = 32.0f * d;
    } else {
      scales_mins_words(blk + 4, sc, mn);
      d = half(blk);
      c = half(blk + 2);
    }
    const void* mins = F == Q6_K ? (const void*)sc : (const void*)mn;
    const Scales s = spread(block_scales<F>(sc));
    for (long m = 0; m < M; m++) {
      const __m256i is = block_dot<F>(blk, s, qx + m * K + b * QK);
      const __m256i im = mins_dot<F>(mins, bs + (m * K + b * QK) / 16);
      const float e = dx[m * nb + b];
      vacc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_set1_ps(d * e), vacc[m]);
      vmin[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(im), _mm256_set1_ps(c * e), vmin[m]);
    }
  }
  for (long m = 0; m < M; m++) out[m * N] = hsum(vacc[m]) - hsum(vmin[m]);
}
#else
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

// out[m * N] for the M rows of x: one W row (its nb super-blocks at w) against each, each
// super-block unpacked once for all M.
template <int F>
void dot_row(float* out, long N, const uint8_t* w, const int8_t* qx, const float* dx,
             const int16_t* bs, long M, long K, Unpacked& u, float* acc) {
  const long nb = K / QK;
  for (long m = 0; m < M; m++) acc[m] = 0.0f;
  for (long b = 0; b < nb; b++) {
    unpack<F>(w + b * BLOCK_BYTES[F], u);
    for (long m = 0; m < M; m++) {
      const int32_t is = dot_scaled(u, qx + m * K + b * QK);
      const int32_t im = dot_mins(u.mn, bs + (m * K + b * QK) / 16);
      acc[m] += dx[m * nb + b] * (u.d * (float)is - u.c * (float)im);
    }
  }
  for (long m = 0; m < M; m++) out[m * N] = acc[m];
}
#endif

// out (M, N) with the integer dots, W's rows split over nt threads; each W row against the rows
// of x GROUP at a time (its bytes stay in L1 from one group to the next).
template <int F>
void gemv(float* out, const int8_t* qx, const float* dx, const int16_t* bs, const uint8_t* w,
          long M, long K, long N, int nt) {
  const long per = (N + nt - 1) / nt, row = K / QK * BLOCK_BYTES[F], nb = K / QK;
  on_threads(nt, [&](int t) {
    Unpacked u;
    float acc[GROUP];
    for (long n = t * per; n < std::min(N, (t + 1) * per); n++)
      for (long m = 0; m < M; m += GROUP)
        dot_row<F>(out + m * N + n, N, w + n * row, qx + m * K, dx + m * nb, bs + m * K / 16,
                   std::min(GROUP, M - m), K, u, acc);
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
  gemm_dequant_tiles<QK>(out, qx, dx, M, K, N, nt,
                         [&](float* r, long n) { dequant_row<F>(r, w + n * row, K); });
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
