// RMSNorm, with the residual add fused in front of it: residual += x (in place), then
// out = residual / sqrt(mean(residual^2) + eps) * weight, row by row; without a residual,
// out = rms_norm(x).
// Threads: one task per row.
#include "common.h"

// out, x: (T, D) float32; residual: (T, D) float32 updated in place, or NULL; weight: (D,).
extern "C" void fused_add_rms_norm(float* out, const float* x, float* residual,
                                   const float* weight, float eps, int n_rows, int D,
                                   int threads) {
#pragma omp parallel for schedule(static) num_threads(threads_for((long)n_rows * D * 4, threads))
  for (int t = 0; t < n_rows; t++) {
    const float* xr = x + (long)t * D;
    float* o = out + (long)t * D;
    const float* src = xr;
    if (residual) {
      float* r = residual + (long)t * D;
#pragma omp simd
      for (int d = 0; d < D; d++) r[d] = r[d] + xr[d];
      src = r;
    }
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int d = 0; d < D; d++) ss += src[d] * src[d];
    const float inv = 1.0f / std::sqrt(ss * (1.0f / D) + eps);
#pragma omp simd
    for (int d = 0; d < D; d++) o[d] = src[d] * inv * weight[d];
  }
}
