// Rotary embedding fused with the cache write: each token's q | k | v row (+ bias; q and k
// heads RMS-normed first where the model has per-head norms), q and k rotated ("rotate
// half": element i pairs with i + hd/2), q written out, k and v rounded once into their
// cache slot (a slot < 0 is skipped).
// Threads: one task per token.
#include "common.h"

namespace {

const int MAX_HD = 256;

inline void head_norm(float* x, const float* w, float eps, int hd) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int d = 0; d < hd; d++) ss += x[d] * x[d];
  const float inv = 1.0f / std::sqrt(ss * (1.0f / hd) + eps);
  for (int d = 0; d < hd; d++) x[d] = x[d] * inv * w[d];
}

inline void rotate(float* x, const float* cos, const float* sin, int hd) {
  const int half = hd / 2;
  for (int d = 0; d < half; d++) {
    const float a = x[d], b = x[d + half];
    x[d] = a * cos[d] - b * sin[d];
    x[d + half] = b * cos[d + half] + a * sin[d + half];
  }
}

template <typename T>
void rotary_cache_rows(float* q_out, T* k_cache, T* v_cache, const float* qkv, const float* bias,
                       const float* cos, const float* sin, const int32_t* slots,
                       const float* q_norm, const float* k_norm, float eps, int n_tok, int H,
                       int hkv, int hd, int threads) {
  const int width = (H + 2 * hkv) * hd;
#pragma omp parallel for schedule(static) num_threads(threads_for((long)n_tok * width * 8, threads))
  for (int t = 0; t < n_tok; t++) {
    alignas(64) float head[MAX_HD];
    const float* row = qkv + (long)t * width;
    const float* c = cos + (long)t * hd;
    const float* s = sin + (long)t * hd;
    for (int h = 0; h < H + hkv; h++) {  // q heads, then k heads
      for (int d = 0; d < hd; d++) head[d] = row[h * hd + d] + (bias ? bias[h * hd + d] : 0.0f);
      if (q_norm) head_norm(head, h < H ? q_norm : k_norm, eps, hd);
      rotate(head, c, s, hd);
      if (h < H) {
        std::memcpy(q_out + ((long)t * H + h) * hd, head, hd * sizeof(float));
      } else if (slots[t] >= 0) {
        T* dst = k_cache + ((long)slots[t] * hkv + (h - H)) * hd;
        for (int d = 0; d < hd; d++) dst[d] = from_f32<T>(head[d]);
      }
    }
    if (slots[t] < 0) continue;
    for (int h = 0; h < hkv; h++) {
      const int at = (H + hkv + h) * hd;
      T* dst = v_cache + ((long)slots[t] * hkv + h) * hd;
      for (int d = 0; d < hd; d++) dst[d] = from_f32<T>(row[at + d] + (bias ? bias[at + d] : 0.0f));
    }
  }
}

}  // namespace

// q_out: (T, H, hd) float32; k_cache, v_cache: (N, bs, Hkv, hd) of `dtype` (slot s is row s
// of the flattened (N*bs, Hkv, hd)); qkv: (T, (H + 2 Hkv) hd) float32; bias: its row or NULL;
// cos, sin: (T, hd) float32 at each token's position; slots: (T,) int32; q_norm, k_norm:
// (hd,) or both NULL. Returns 0, or 1 for shapes beyond the kernel's limits.
extern "C" int rotary_cache(float* q_out, void* k_cache, void* v_cache, int dtype,
                            const float* qkv, const float* bias, const float* cos,
                            const float* sin, const int32_t* slots, const float* q_norm,
                            const float* k_norm, float eps, int n_tok, int H, int hkv, int hd,
                            int threads) {
  if (hd > MAX_HD || hd % 2 || (q_norm == nullptr) != (k_norm == nullptr)) return 1;
  DISPATCH_CACHE(dtype, rotary_cache_rows<T>(q_out, (T*)k_cache, (T*)v_cache, qkv, bias, cos,
                                             sin, slots, q_norm, k_norm, eps, n_tok, H, hkv, hd,
                                             threads));
  return 0;
}
