// A weight matrix as the native step sees it (engine/backends/cpu_ops.py, Matrix and KINDS):
// decode_layers.cpp and moe_experts.cpp read the same structure.
#pragma once
#include <cstdint>

// W_BLOCKS + 0, 1, 2: Q8_0, Q4_0, Q4_1; W_RAW + 0..4: a GGUF file's Q4_K, Q5_K, Q6_K, Q5_0,
// Q5_1 bytes; W_PARTS: a matrix whose columns come in parts of different kinds; W_Q4Z: a 4-bit
// checkpoint's zero-point blocks (matmul_blocks' format 3); W_FP8: an FP8 checkpoint's e4m3
// bytes and float32 scales, `pad` of them a row (matmul_fp8.cpp); W_MXFP4: MXFP4 blocks as a
// GGUF file stores them (matmul_mxfp4.cpp); W_IQ4_NL, W_IQ4_XS: IQ4_NL and IQ4_XS blocks as a
// GGUF file stores them (matmul_iq4.cpp); W_Q2_K, W_Q3_K: Q2_K and Q3_K bytes, multiplied by
// matmul_kquants.cpp as W_RAW + 0..2 are
enum {
  W_F32 = 0, W_BF16 = 1, W_INT8 = 2, W_BLOCKS = 3, W_PANELS = 6, W_BF16_PANELS = 7,
  W_INT8_PANELS = 8, W_RAW = 9, W_PARTS = 14, W_Q4Z = 15,
  W_FP8 = 16, W_MXFP4 = 17, W_IQ4_NL = 18, W_IQ4_XS = 19, W_Q2_K = 20, W_Q3_K = 21
};

// matmul_kquants' format of a kind (0..2 Q4_K, Q5_K, Q6_K; 3, 4 Q2_K, Q3_K), -1 for the others.
inline int kquant_format(int kind) {
  if (kind >= W_RAW && kind < W_RAW + 3) return kind - W_RAW;
  return kind == W_Q2_K || kind == W_Q3_K ? 3 + kind - W_Q2_K : -1;
}

// A weight matrix (K, N) as cpu_ops.matmul sees it: its kind, data and scales (int8: (N,)
// float32; the block formats: per output channel, as matmul_blocks.cpp lays them out; panels:
// (N/16, K, 16) float32 or int8 (+ scales (N,)), as matmul_panels.cpp reads them; bf16
// panels: (N/16, K/2, 16, 2) bf16, as matmul_panels_bf16.cpp reads them; W_RAW: (N, bytes of
// a row), as matmul_kquants.cpp and matmul_q5.cpp read them (W_MXFP4, W_IQ4_*, W_Q2_K, W_Q3_K:
// the same);
// W_PARTS: data the `pad` parts (Matrix), scales their widths (int64), the columns of each one
// after another).
struct Matrix {
  int32_t kind;
  int32_t pad;
  const void* data;
  const void* scales;
};
