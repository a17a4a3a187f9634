// SiLU-and-mul: out = silu(gate) * up = gate / (1 + e^-gate) * up, the gate and up halves of
// each row of the fused gate|up product.
// Threads: one task per row.
#include "common.h"

// out: (T, F) float32; gate_up: (T, 2F) float32, gate columns first.
extern "C" void silu_and_mul(float* out, const float* gate_up, int n_rows, int F, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads_for((long)n_rows * F * 8, threads))
  for (int t = 0; t < n_rows; t++) {
    const float* g = gate_up + (long)t * 2 * F;
    const float* u = g + F;
    float* o = out + (long)t * F;
#pragma omp simd
    for (int f = 0; f < F; f++) o[f] = g[f] / (1.0f + exp_f32(-g[f])) * u[f];
  }
}
