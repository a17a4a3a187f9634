// Shared by the native CPU kernels (engine/backends/cpu_ops.py calls them through ctypes):
// the cache's element types, an exp the compiler can vectorize, and the thread rule.
//
// Activations are float32; a KV cache is float32, float16, bfloat16 or one of the two 8-bit
// floats (DT_* below), read as float32 and written with one rounding to nearest even, as
// NumPy's assignment into it rounds (the 8-bit ones saturate at their largest finite value).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

enum { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2, DT_E4M3 = 3, DT_E5M2 = 4 };

struct bf16 {
  uint16_t bits;
};
// float16: _Float16 on x86-64; GCC 12's C++ has it nowhere else, and aarch64's __fp16 (a storage
// type: arithmetic on it is float's) converts the same way, to nearest even.
#if defined(__aarch64__)
typedef __fp16 f16;
#else
typedef _Float16 f16;
#endif
// 8-bit floats, sign | exponent | mantissa: e4m3 (bias 7, no infinities, 0x7f/0xff NaN,
// largest 448) and e5m2 (bias 15, the top byte of a float16, largest finite 57344)
struct e4m3 {
  uint8_t bits;
};
struct e5m2 {
  uint8_t bits;
};

static inline float to_f32(float x) { return x; }
static inline float to_f32(f16 x) { return (float)x; }
static inline float to_f32(bf16 x) {
  uint32_t u = (uint32_t)x.bits << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The 256 values of an 8-bit float of E exponent bits (bias 2^(E-1) - 1) and M mantissa bits,
// computed at compile time; NaN where `is_nan(byte)`, +-inf where `is_inf(byte)`. One load
// a value (the scalar readers: prefill's tiles; decode widens whole vectors itself).
template <int E, int M> struct Fp8Table {
  float v[256];
  template <typename Nan, typename Inf> constexpr Fp8Table(Nan is_nan, Inf is_inf) : v() {
    constexpr int BIAS = (1 << (E - 1)) - 1;
    for (int b = 0; b < 256; b++) {
      const int e = (b >> M) & ((1 << E) - 1), m = b & ((1 << M) - 1);
      float x = (float)(e ? (1 << M) + m : m);  // in units of 2^(max(e, 1) - BIAS - M)
      for (int i = 0; i < BIAS + M - (e ? e : 1); i++) x *= 0.5f;
      for (int i = 0; i < (e ? e : 1) - BIAS - M; i++) x *= 2.0f;
      if (is_inf(b)) x = __builtin_inff();
      if (is_nan(b)) x = __builtin_nanf("");
      v[b] = b & 0x80 ? -x : x;
    }
  }
};
// e4m3: no infinities, 0x7f and 0xff NaN; e5m2: float16's exponent, so IEEE's rules
static constexpr Fp8Table<4, 3> E4M3_VALUES{[](int b) { return (b & 0x7f) == 0x7f; },
                                            [](int) { return false; }};
static constexpr Fp8Table<5, 2> E5M2_VALUES{[](int b) { return (b & 0x7f) > 0x7c; },
                                            [](int b) { return (b & 0x7f) == 0x7c; }};
static inline float to_f32(e4m3 x) { return E4M3_VALUES.v[x.bits]; }
static inline float to_f32(e5m2 x) { return E5M2_VALUES.v[x.bits]; }

// n values v -> q (n,) int8 as every integer-dot kernel quantizes x: d = absmax / 127,
// q = round(v / d), ties to even (a block of zeros: d = 0, q = 0). Returns d.
template <long n> static inline float quantize_block(int8_t* q, const float* v) {
  float amax = 0.0f;
#pragma omp simd reduction(max : amax)
  for (long i = 0; i < n; i++) amax = std::max(amax, std::fabs(v[i]));
  const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
#pragma omp simd
  for (long i = 0; i < n; i++) q[i] = (int8_t)std::nearbyint(v[i] * id);
  return d;
}

// x rounded to nearest even in a float of E exponent bits (bias 2^(E-1) - 1) and M mantissa
// bits, saturated at `top` (its largest finite value: infinities too); NaN -> `nan`.
template <int E, int M> static inline uint8_t to_fp8(float x, float top, uint8_t nan) {
  constexpr int BIAS = (1 << (E - 1)) - 1;
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
  if ((u & 0x7fffffffu) > 0x7f800000u) return sign | nan;
  const float a = std::min(std::fabs(x), top);
  if (a < std::ldexp(1.0f, 1 - BIAS))  // below the smallest normal: multiples of 2^(1-BIAS-M)
    return sign | (uint8_t)std::nearbyint(a * std::ldexp(1.0f, BIAS - 1 + M));  // 2^M: normal
  std::memcpy(&u, &a, 4);
  u += (1u << (22 - M)) - 1 + ((u >> (23 - M)) & 1u);  // round off 23 - M bits, ties to even
  const uint32_t e = (u >> 23) - 127 + BIAS;
  return sign | (uint8_t)((e << M) | ((u >> (23 - M)) & ((1u << M) - 1)));
}

template <typename T> static inline T from_f32(float x);
template <> inline float from_f32<float>(float x) { return x; }
template <> inline f16 from_f32<f16>(float x) { return (f16)x; }
template <> inline bf16 from_f32<bf16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{(uint16_t)((u >> 16) | 0x40)};  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return bf16{(uint16_t)(u >> 16)};
}
template <> inline e4m3 from_f32<e4m3>(float x) { return e4m3{to_fp8<4, 3>(x, 448.0f, 0x7f)}; }
template <> inline e5m2 from_f32<e5m2>(float x) { return e5m2{to_fp8<5, 2>(x, 57344.0f, 0x7e)}; }

// e^x in float32 (Cephes' polynomial after x = n ln2 + r), within 2 ulp; -inf and anything
// below -87.3 give 0, NaN stays NaN. Branch-free, so a loop over it vectorizes.
static inline float exp_f32(float x) {
  const float xc = std::min(std::max(x, -87.3f), 88.3f);
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  float r = xc - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  const float e = y * scale;
  return x != x ? x : (x < -87.3f ? 0.0f : e);
}

// Eight float32 lanes (GCC's vector extension: AVX2 or AVX-512 registers under -march=native,
// plain code elsewhere); load8/store8 need no alignment. Head dims are multiples of 8.
typedef float v8 __attribute__((vector_size(32)));
static inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
static inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }

// The lane sums of four vectors at once, as four lanes, each added in the order
// ((v0 + v4) + (v1 + v5)) + ((v2 + v6) + (v3 + v7)).
typedef float v4 __attribute__((vector_size(16)));
typedef int i4 __attribute__((vector_size(16)));
static inline v4 half_sum(v8 v) {  // lanes i + lanes i+4
  v4 lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, (const char*)&v + sizeof lo, sizeof hi);
  return lo + hi;
}
static inline v4 hsum8x4(v8 a, v8 b, v8 c, v8 d) {
  const v4 ha = half_sum(a), hb = half_sum(b), hc = half_sum(c), hd = half_sum(d);
  // (a0 + a1, b0 + b1, a2 + a3, b2 + b3) and the same of c, d
  const i4 even = {0, 4, 2, 6}, odd = {1, 5, 3, 7};
  const v4 ab = __builtin_shuffle(ha, hb, even) + __builtin_shuffle(ha, hb, odd);
  const v4 cd = __builtin_shuffle(hc, hd, even) + __builtin_shuffle(hc, hd, odd);
  return __builtin_shuffle(ab, cd, i4{0, 1, 4, 5}) + __builtin_shuffle(ab, cd, i4{2, 3, 6, 7});
}

static inline float dot_f32(const float* a, const float* b, int n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < n; i++) s += a[i] * b[i];
  return s;
}

// e^x on every lane of a float32 vector V (VI: its int32 twin): exp_f32's arithmetic, written
// on vectors so it needs no vectorizer.
template <typename V, typename VI> static inline V exp_v(V x) {
  const V lo = x < -87.3f ? V{} - 87.3f : x;
  const V xc = x == x ? (lo > 88.3f ? V{} + 88.3f : lo) : V{};  // NaN: any value, then x
  const V y = xc * 1.44269504088896341f + 0.5f;
  const V t = __builtin_convertvector(__builtin_convertvector(y, VI), V);  // toward 0
  const V n = t > y ? t - 1.0f : t;  // floor(y)
  V r = xc - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const V e = (p * r * r + r + 1.0f) * (V)((__builtin_convertvector(n, VI) + 127) << 23);
  return x != x ? x : (x < -87.3f ? V{} : e);
}
static inline float hsum8(v8 v) {
  const v4 h = half_sum(v);
  return (h[0] + h[2]) + (h[1] + h[3]);
}

// The lane sum of a float32 vector of 8 lanes (hsum8's order) or 16 (its halves added first).
template <typename V> static inline float hsum_v(V v) {
  if constexpr (sizeof(V) == sizeof(v8)) {
    return hsum8(v);
  } else {
    v8 lo, hi;
    std::memcpy(&lo, &v, sizeof lo);
    std::memcpy(&hi, (const char*)&v + sizeof lo, sizeof hi);
    return hsum8(lo + hi);
  }
}

// One tile of an online softmax on vectors V: the scores s[0..nt) become e^(s - max), with max
// the running maximum m updated by the tile; the running sum l is rescaled and adds the tile's.
// Returns the factor the accumulator must be rescaled by (e^(old m - new m)). A tile with
// nothing visible (every score -inf, the running max still -inf) changes nothing: its weights
// are 0, factor 1. s has room for nt rounded up to V's lanes (the lanes past nt are
// overwritten). NaN in, NaN out.
template <typename V = v8> static inline float softmax_tile(float* s, int nt, float& m, float& l) {
  typedef int32_t VI __attribute__((vector_size(sizeof(V))));
  constexpr int W = sizeof(V) / sizeof(float);
  const int nv = (nt + W - 1) / W;
  for (int j = nt; j < W * nv; j++) s[j] = -INFINITY;
  V mxv = V{} + m, x, sum = {};
  for (int i = 0; i < nv; i++) {
    std::memcpy(&x, s + W * i, sizeof x);
    mxv = x > mxv ? x : mxv;
  }
  float mx = mxv[0];
  for (int i = 1; i < W; i++) mx = std::max(mx, mxv[i]);
  if (mx == -INFINITY) {
    for (int j = 0; j < nt; j++) s[j] = 0.0f;
    return 1.0f;
  }
  const float corr = exp_f32(m - mx);
  for (int i = 0; i < nv; i++) {
    std::memcpy(&x, s + W * i, sizeof x);
    x = exp_v<V, VI>(x - mx);
    std::memcpy(s + W * i, &x, sizeof x);
    sum += x;
  }
  m = mx;
  l = l * corr + hsum_v(sum);
  return corr;
}

// Threads: a kernel runs on `threads` OpenMP threads only when it has at least this many
// float operations' worth of work; below it, waking the threads costs more than they save.
static const long PARALLEL_WORK = 1L << 15;
static inline int threads_for(long work, int threads) {
  return work >= PARALLEL_WORK ? threads : 1;
}

#define DISPATCH_CACHE(dtype, CALL)          \
  switch (dtype) {                           \
    case DT_F32: { typedef float T; CALL; } break; \
    case DT_F16: { typedef f16 T; CALL; } break;   \
    case DT_E4M3: { typedef e4m3 T; CALL; } break; \
    case DT_E5M2: { typedef e5m2 T; CALL; } break; \
    default: { typedef bf16 T; CALL; } break;      \
  }
