// gguf.cuh: GGUF's block formats as the device reads them (gguf_matvec.cu, gguf_dequantize.cu),
// written from the formats' definitions (model_loader/kquants.py lays them out; Q8_0 and Q4_0
// as engine/backends/quant.py). A row of a matrix is a run of blocks of kValues values and
// kBytes bytes; a block is cut into kUnits units of kValues / kUnits values, one lane's share:
//   header(block)        the words every unit of the block needs (the float16 factors; Q4_K's
//                        packed scales and mins, Q6_K's scales, Q5_0's fifth bits), loaded
//                        once per block
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

// Four bytes at an even address, as two 16-bit loads. The CPU build's g++ would merge the two
// into one 4-byte load and still count one of them in the traffic counting builds; a compiler
// barrier between them (the emulator's only) keeps them apart.
__device__ __forceinline__ unsigned load_u32_halves(const unsigned char* p) {
  const unsigned lo = load_u16(p);
#if defined(CUDA_EMU)
  asm volatile("" ::: "memory");
#endif
  return lo | load_u16(p + 2) << 16;
}

struct GgufHeader {
  unsigned w[5];  // a format's words (unused ones 0)
};

// Units are strided through a block, so that the lanes of a warp, one unit each, read
// neighbouring bytes of the block and neighbouring values of x at every step.

struct GgufQ8_0 {  // d (float16), 32 int8: w = d q. Unit u: value u.
  static constexpr int kValues = 32, kBytes = 34, kUnits = 32, kWords = 1;
  __device__ static GgufHeader header(const unsigned char* b) { return {{load_u16(b)}}; }
  template <typename F>
  __device__ static void unit(const unsigned char* b, int u, const GgufHeader& h, F&& f) {
    f(u, half_bits_to_float(h.w[0]) * float(static_cast<signed char>(b[2 + u])));
  }
};

// d, 16 bytes: byte j holds q_j (low nibble), q_{j+16} (high): w = d (q - 8). Unit u: byte u.
struct GgufQ4_0 {
  static constexpr int kValues = 32, kBytes = 18, kUnits = 16, kWords = 1;
  __device__ static GgufHeader header(const unsigned char* b) { return {{load_u16(b)}}; }
  template <typename F>
  __device__ static void unit(const unsigned char* b, int u, const GgufHeader& h, F&& f) {
    const float d = half_bits_to_float(h.w[0]);
    const int q = b[2 + u];
    f(u, d * float((q & 15) - 8));
    f(u + 16, d * float((q >> 4) - 8));
  }
};

// d, qh (uint32: bit i the fifth bit of q_i), nibbles as Q4_0: w = d (q - 16). Unit u: byte u.
struct GgufQ5_0 {
  static constexpr int kValues = 32, kBytes = 22, kUnits = 16, kWords = 2;
  __device__ static GgufHeader header(const unsigned char* b) {
    return {{load_u16(b), load_u32_halves(b + 2)}};
  }
  template <typename F>
  __device__ static void unit(const unsigned char* b, int u, const GgufHeader& h, F&& f) {
    const float d = half_bits_to_float(h.w[0]);
    const unsigned qh = h.w[1];
    const int q = b[6 + u];
    f(u, d * float(((q & 15) | int((qh >> u) & 1u) << 4) - 16));
    f(u + 16, d * float(((q >> 4) | int((qh >> (u + 16)) & 1u) << 4) - 16));
  }
};

// Q4_K: d, dmin (float16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles; values in
// 8 groups of 32, w = (d sc_g) q - (dmin m_g). Unit l (0..31): nibble bytes 32c + l (c 0..3),
// whose low nibble is value 64c + l (group 2c), high nibble value 64c + 32 + l (group 2c + 1).
struct GgufQ4_K {
  static constexpr int kValues = 256, kBytes = 144, kUnits = 32, kWords = 4;
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
  __device__ static void unit(const unsigned char* b, int l, const GgufHeader& h, F&& f) {
    const float d = half_bits_to_float(h.w[0] & 0xFFFFu), dmin = half_bits_to_float(h.w[0] >> 16);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      int sc0, m0, sc1, m1;
      scale_min(h, 2 * c, sc0, m0);
      scale_min(h, 2 * c + 1, sc1, m1);
      const int q = b[16 + 32 * c + l];
      f(64 * c + l, d * float(sc0) * float(q & 15) - dmin * float(m0));
      f(64 * c + 32 + l, d * float(sc1) * float(q >> 4) - dmin * float(m1));
    }
  }
};

// Q6_K: ql (128 bytes of nibbles), qh (64 bytes of 2-bit pairs), 16 int8 scales, d; the header
// holds d and the scales. Value 128h + 32j + l (half h, j 0..3) takes ql[64h + l] (j 0, 2: low,
// high nibble) or ql[64h + 32 + l] (j 1, 3) and bits 2j of qh[32h + l]: w = (d sc) (q - 32),
// sc = scales[8h + 2j + l / 16]. Unit l (0..31): the eight values of its l.
struct GgufQ6_K {
  static constexpr int kValues = 256, kBytes = 210, kUnits = 32, kWords = 5;
  __device__ static GgufHeader header(const unsigned char* b) {
    GgufHeader h;
#pragma unroll
    for (int i = 0; i < 4; ++i) h.w[i] = load_u32_halves(b + 192 + 4 * i);
    h.w[4] = load_u16(b + 208);
    return h;
  }
  template <typename F>
  __device__ static void unit(const unsigned char* b, int l, const GgufHeader& h, F&& f) {
    const float d = half_bits_to_float(h.w[4]);
    const int e = l / 16;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int a = b[64 * hh + l], c = b[64 * hh + 32 + l], hq = b[128 + 32 * hh + l];
      const int q[4] = {(a & 15) | (hq & 3) << 4, (c & 15) | ((hq >> 2) & 3) << 4,
                        (a >> 4) | ((hq >> 4) & 3) << 4, (c >> 4) | ((hq >> 6) & 3) << 4};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int at = 8 * hh + 2 * j + e;  // the scale's byte
        const int sc = static_cast<signed char>((h.w[at / 4] >> (8 * (at % 4))) & 255u);
        f(128 * hh + 32 * j + l, d * float(sc) * float(q[j] - 32));
      }
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
