// gguf.cuh: GGUF's block formats as the device reads them (gguf_matvec.cu, gguf_dequantize.cu),
// written from the formats' definitions (model_loader/kquants.py lays them out; Q8_0 and Q4_0
// as engine/backends/quant.py). A row of a matrix is a run of blocks of kValues values and
// kBytes bytes; a block is cut into kUnits units of kValues / kUnits values, one lane's share:
//   header(block)        the words every unit of the block needs (the float16 factors; Q4_K's
//                        packed scales), loaded once per block
//   unit(block, u, h, f) f(i, w) for each value i of unit u (i: the index within the block),
//                        w its float32 value, as the NumPy dequantizers compute it; each byte
//                        of the block outside the header is read by exactly one unit
// Format ids are engine/kernels/launch.py GGUF_KINDS'.
#pragma once

#include "common.cuh"

constexpr int kGgufQ8_0 = 0, kGgufQ4_0 = 1, kGgufQ5_0 = 2, kGgufQ4_K = 3, kGgufQ6_K = 4;

// float16 bits -> float32, exact (normal, subnormal, inf, NaN), without __half intrinsics.
__device__ __forceinline__ float half_bits_to_float(unsigned h) {
  const unsigned sign = (h & 0x8000u) << 16, exp = (h >> 10) & 31u, mant = h & 0x3FFu;
  if (exp == 0) {
    const float v = float(mant) * 5.9604644775390625e-8f;  // mant * 2^-24
    return sign ? -v : v;
  }
  const unsigned bits = exp == 31 ? 0x7F800000u | (mant << 13) : ((exp + 112u) << 23) | (mant << 13);
  return __uint_as_float(sign | bits);
}

// Two bytes at an even address (every format's float16 factors and Q5_0's qh halves are: the
// blocks' sizes are even and the matrix starts on an even address), in one 16-bit load.
__device__ __forceinline__ unsigned load_u16(const unsigned char* p) {
  return *reinterpret_cast<const unsigned short*>(p);
}

struct GgufHeader {
  unsigned w[4];  // a format's words (unused ones 0)
};

struct GgufQ8_0 {  // d (float16), 32 int8: w = d q
  static constexpr int kValues = 32, kBytes = 34, kUnits = 1, kWords = 1;
  __device__ static GgufHeader header(const unsigned char* b) { return {{load_u16(b), 0, 0, 0}}; }
  template <typename F>
  __device__ static void unit(const unsigned char* b, int, const GgufHeader& h, F&& f) {
    const float d = half_bits_to_float(h.w[0]);
#pragma unroll 8
    for (int i = 0; i < 32; ++i) f(i, d * float(static_cast<signed char>(b[2 + i])));
  }
};

struct GgufQ4_0 {  // d, 16 bytes: byte j holds q_j (low nibble), q_{j+16} (high): w = d (q - 8)
  static constexpr int kValues = 32, kBytes = 18, kUnits = 1, kWords = 1;
  __device__ static GgufHeader header(const unsigned char* b) { return {{load_u16(b), 0, 0, 0}}; }
  template <typename F>
  __device__ static void unit(const unsigned char* b, int, const GgufHeader& h, F&& f) {
    const float d = half_bits_to_float(h.w[0]);
#pragma unroll 4
    for (int j = 0; j < 16; ++j) {
      const int q = b[2 + j];
      f(j, d * float((q & 15) - 8));
      f(j + 16, d * float((q >> 4) - 8));
    }
  }
};

struct GgufQ5_0 {  // d, qh (uint32: bit i the fifth bit of q_i), nibbles as Q4_0: w = d (q - 16)
  static constexpr int kValues = 32, kBytes = 22, kUnits = 1, kWords = 1;
  __device__ static GgufHeader header(const unsigned char* b) { return {{load_u16(b), 0, 0, 0}}; }
  template <typename F>
  __device__ static void unit(const unsigned char* b, int, const GgufHeader& h, F&& f) {
    const float d = half_bits_to_float(h.w[0]);
    const unsigned qh = load_u16(b + 2) | load_u16(b + 4) << 16;
#pragma unroll 4
    for (int j = 0; j < 16; ++j) {
      const int q = b[6 + j];
      const int lo = (q & 15) | int((qh >> j) & 1u) << 4, hi = (q >> 4) | int((qh >> (j + 16)) & 1u) << 4;
      f(j, d * float(lo - 16));
      f(j + 16, d * float(hi - 16));
    }
  }
};

// Q4_K: d, dmin (float16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles. Unit c
// (0..3) reads nibble bytes 32c..32c+31: groups 2c (low nibbles) and 2c + 1 (high), values
// 64c + l and 64c + 32 + l: w = (d sc_g) q - (dmin m_g).
struct GgufQ4_K {
  static constexpr int kValues = 256, kBytes = 144, kUnits = 4, kWords = 4;
  __device__ static GgufHeader header(const unsigned char* b) {
    const unsigned* w = reinterpret_cast<const unsigned*>(b);  // blocks 4-byte aligned (144 B)
    return {{w[0], w[1], w[2], w[3]}};
  }
  __device__ static void scale_min(const GgufHeader& h, int j, int& sc, int& m) {
    auto s = [&](int i) { return int((h.w[1 + i / 4] >> (8 * (i % 4))) & 255u); };
    if (j < 4) {
      sc = s(j) & 63, m = s(j + 4) & 63;
    } else {
      sc = (s(j + 4) & 15) | (s(j - 4) >> 6) << 4, m = (s(j + 4) >> 4) | (s(j) >> 6) << 4;
    }
  }
  template <typename F>
  __device__ static void unit(const unsigned char* b, int c, const GgufHeader& h, F&& f) {
    const float d = half_bits_to_float(h.w[0] & 0xFFFFu), dmin = half_bits_to_float(h.w[0] >> 16);
    int sc0, m0, sc1, m1;
    scale_min(h, 2 * c, sc0, m0);
    scale_min(h, 2 * c + 1, sc1, m1);
    const float d0 = d * float(sc0), n0 = dmin * float(m0), d1 = d * float(sc1), n1 = dmin * float(m1);
    const unsigned char* qs = b + 16 + 32 * c;
#pragma unroll 4
    for (int l = 0; l < 32; ++l) {
      const int q = qs[l];
      f(64 * c + l, d0 * float(q & 15) - n0);
      f(64 * c + 32 + l, d1 * float(q >> 4) - n1);
    }
  }
};

// Q6_K: ql (128 bytes of nibbles), qh (64 bytes of 2-bit pairs), 16 int8 scales, d. Unit
// u = 2h + e (0..3) takes half h, l in 16e..16e+15: values 128h + 32j + l (j = 0..3) from
// ql[64h + l] (j 0, 2: low, high nibble), ql[64h + 32 + l] (j 1, 3), bits 2j of qh[32h + l],
// scale 8h + 2j + e: w = (d sc) (q - 32).
struct GgufQ6_K {
  static constexpr int kValues = 256, kBytes = 210, kUnits = 4, kWords = 1;
  __device__ static GgufHeader header(const unsigned char* b) { return {{load_u16(b + 208), 0, 0, 0}}; }
  template <typename F>
  __device__ static void unit(const unsigned char* b, int u, const GgufHeader& h, F&& f) {
    const float d = half_bits_to_float(h.w[0]);
    const int hh = u >> 1, e = u & 1;
    float ds[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) ds[j] = d * float(static_cast<signed char>(b[192 + 8 * hh + 2 * j + e]));
    const unsigned char* ql = b + 64 * hh + 16 * e;
    const unsigned char* qh = b + 128 + 32 * hh + 16 * e;
    const int base = 128 * hh + 16 * e;
#pragma unroll 2
    for (int l = 0; l < 16; ++l) {
      const int a = ql[l], c = ql[32 + l], hq = qh[l];
      f(base + l, ds[0] * float(((a & 15) | (hq & 3) << 4) - 32));
      f(base + 32 + l, ds[1] * float(((c & 15) | ((hq >> 2) & 3) << 4) - 32));
      f(base + 64 + l, ds[2] * float(((a >> 4) | ((hq >> 4) & 3) << 4) - 32));
      f(base + 96 + l, ds[3] * float(((c >> 4) | ((hq >> 6) & 3) << 4) - 32));
    }
  }
};

// f(Format()): one instantiation of f per GGUF format id; an unknown id runs nothing.
template <typename F>
__device__ __forceinline__ void with_gguf_format(int kind, F&& f) {
  if (kind == kGgufQ8_0) return f(GgufQ8_0());
  if (kind == kGgufQ4_0) return f(GgufQ4_0());
  if (kind == kGgufQ5_0) return f(GgufQ5_0());
  if (kind == kGgufQ4_K) return f(GgufQ4_K());
  if (kind == kGgufQ6_K) return f(GgufQ6_K());
}
