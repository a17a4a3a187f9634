// rotary_cache.cu: one token's q, k, v rows out of the QKV product, in one pass: q rotated into
// the (T, H, hd) q buffer the attention kernels read, k rotated and v copied into the paged
// cache at the token's slot, k_cache[slot // bs, slot % bs] (the flat offset slot * Hkv * hd).
// A slot < 0 (padding) or past the cache writes no K/V (and reads none). Rotary in Hugging
// Face's rotate-half layout, element i paired with i + hd/2:
//   x[i]      <- x[i] * cos - x[i + hd/2] * sin
//   x[i+hd/2] <- x[i + hd/2] * cos + x[i] * sin
// cos_sin[p] holds cos(p * f_j) for j < hd/2, then sin(p * f_j), with f_j = theta^(-2j/hd),
// computed once on the host in float64 (float32 angles lose ~1e-4 at positions in the 1000s);
// any RoPE scaling (frequencies, an attention factor) is baked into the table by the host.
// A position outside [0, max_positions) leaves its token unrotated (the wrapper rejects it).
//
// Two optional steps before the rotation, chosen by `flags` for the whole launch:
//   kRotaryBias  the row q | k | v += bias (Qwen2's projection bias; v gets its part too);
//   kRotaryNorm  each q head x <- x * rsqrt(mean(x^2) + eps) * q_norm, each k head likewise
//                with k_norm (Qwen3's per-head RMSNorm); v is not normed.
// All arithmetic float32; each output element is rounded once, at its store.
//
// One warp per token. Lane 0 reads the position and slot; the warp stages the token's cos/sin
// row (and, with kRotaryNorm, the norm weights) in shared memory. A head's hd/2/W items (item
// c: elements c..c+W-1 and c+hd/2..) go to a group of G lanes, G the power of two >= the items
// (at most 32; a lane of a wider head takes several), 32/G heads a pass, so a head's sum of
// squares is an xor-shuffle reduction within its group. Every input byte is read once: qkv's q
// and k parts, the v part when the slot is valid, one cos/sin row per token; bias and norm
// weights once per token.
#include "common.cuh"

constexpr int kRotaryWarps = 4;           // tokens per block
constexpr int kRotaryMaxHeadDim = 256;    // the staged cos/sin row
constexpr int kRotaryBias = 1;            // flags (engine/kernels/launch.py)
constexpr int kRotaryNorm = 2;

// One lane's share of a head: items j, j + G, ... (at most kItems: hd <= 256, G <= 32 lanes),
// x the first half's W elements, y the second half's, as float.
template <int W>
struct HeadShare {
  static constexpr int kItems = W >= 4 ? 1 : 4 / W;
  float x[kItems][W], y[kItems][W];
};

// The lanes that share a head of `items` items: a power of two, at most a warp.
__device__ __forceinline__ int head_lanes(int items) {
  int g = 1;
  while (g < items && g < kWarpSize) g *= 2;
  return g;
}

// One head (q or k) of a token: src -> (+ bias) -> (normed with norm_w) -> rotated -> dst.
// Every lane of the warp calls it (the norm's reduction); lanes with live false load nothing.
// j: the lane's first item, G: lanes per head; norm_w: the head's hd weights (shared memory).
template <typename T, int W>
__device__ __forceinline__ void rotate_head(T* __restrict__ dst, const T* __restrict__ src,
                                            const T* __restrict__ bias,
                                            const float* __restrict__ cs,
                                            const float* __restrict__ norm_w, int head_dim,
                                            int j, int G, bool live, int flags, float eps) {
  using S = HeadShare<W>;
  const int half = head_dim / 2;
  S h;
  float squares = 0.0f;
#pragma unroll
  for (int i = 0; i < S::kItems; ++i) {
    const int c = (j + i * G) * W;
    if (!live || c >= half) continue;
    const Vec<T, W> a = load_vec<W>(src + c), b = load_vec<W>(src + half + c);
#pragma unroll
    for (int e = 0; e < W; ++e) h.x[i][e] = to_float(a.v[e]), h.y[i][e] = to_float(b.v[e]);
    if (flags & kRotaryBias) {
      const Vec<T, W> ba = load_vec<W>(bias + c), bb = load_vec<W>(bias + half + c);
#pragma unroll
      for (int e = 0; e < W; ++e) h.x[i][e] += to_float(ba.v[e]), h.y[i][e] += to_float(bb.v[e]);
    }
#pragma unroll
    for (int e = 0; e < W; ++e) squares += h.x[i][e] * h.x[i][e] + h.y[i][e] * h.y[i][e];
  }
  float inv_rms = 1.0f;
  if (flags & kRotaryNorm) inv_rms = rsqrtf(row_sum(squares, G) / float(head_dim) + eps);
#pragma unroll
  for (int i = 0; i < S::kItems; ++i) {
    const int c = (j + i * G) * W;
    if (!live || c >= half) continue;
    Vec<T, W> lo, hi;
#pragma unroll
    for (int e = 0; e < W; ++e) {
      float x = h.x[i][e], y = h.y[i][e];
      if (flags & kRotaryNorm) {
        x = x * inv_rms * norm_w[c + e];
        y = y * inv_rms * norm_w[half + c + e];
      }
      const float cosv = cs[c + e], sinv = cs[half + c + e];
      lo.v[e] = from_float<T>(x * cosv - y * sinv);
      hi.v[e] = from_float<T>(y * cosv + x * sinv);
    }
    store_vec<W>(dst + c, lo);
    store_vec<W>(dst + half + c, hi);
  }
}

// Dynamic shared memory: 4 * 2 * hd floats with kRotaryNorm (each warp's q_norm | k_norm).
// Grid: (cdiv(T, 4),)  Block: (128,): warp w of block b is token 4b + w
template <typename T>
__device__ __forceinline__ void rotary_cache(T* __restrict__ q,                  // (T, H, hd)
                                             T* __restrict__ k_cache,  // (N, bs, Hkv, hd)
                                             T* __restrict__ v_cache,  // (N, bs, Hkv, hd)
                                             const T* __restrict__ qkv,  // (T, (H+2Hkv)*hd)
                                             const int* __restrict__ positions,     // (T,)
                                             const int* __restrict__ slot_mapping,  // (T,)
                                             const float* __restrict__ cos_sin,     // (P, hd)
                                             const T* __restrict__ bias,  // ((H+2Hkv)*hd,)
                                             const T* __restrict__ q_norm,  // (hd,)
                                             const T* __restrict__ k_norm,  // (hd,)
                                             int rows, int num_heads, int num_kv_heads,
                                             int head_dim, int max_positions,
                                             long long num_slots, int flags, float eps) {
  __shared__ float table[kRotaryWarps][kRotaryMaxHeadDim];
  DYNAMIC_SHARED(float, norm_weights);  // (4, 2, hd) with kRotaryNorm
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int t = blockIdx.x * kRotaryWarps + warp;
  if (t >= rows) return;  // the whole warp
  int pos = lane == 0 ? positions[t] : 0, slot_in = lane == 0 ? slot_mapping[t] : 0;
  pos = __shfl_sync(kFullMask, pos, 0);
  const long long slot = __shfl_sync(kFullMask, slot_in, 0);
  const bool rotate = pos >= 0 && pos < max_positions, cached = slot >= 0 && slot < num_slots;
  const int half = head_dim / 2, q_row = num_heads * head_dim, kv_row = num_kv_heads * head_dim;
  float* cs = table[warp];
  float* nw = norm_weights + warp * 2 * head_dim;  // q_norm, then k_norm
  for (int i = lane; i < head_dim; i += kWarpSize) {
    cs[i] = rotate ? cos_sin[size_t(pos) * head_dim + i] : (i < half ? 1.0f : 0.0f);
    if (flags & kRotaryNorm) {
      nw[i] = to_float(q_norm[i]);
      if (cached) nw[head_dim + i] = to_float(k_norm[i]);
    }
  }
  __syncwarp();
  const T* src = qkv + size_t(t) * (q_row + 2 * kv_row);
  T* k_dst = k_cache + size_t(cached ? slot : 0) * kv_row;
  const int heads = num_heads + (cached ? num_kv_heads : 0);  // k heads only when cached
  with_vec_width<T>(vec_width<T>(half, qkv, q, k_cache, bias), [&](auto vec) {
    constexpr int W = decltype(vec)::value;
    const int G = head_lanes(half / W), per_pass = kWarpSize / G;
    for (int h0 = 0; h0 < heads; h0 += per_pass) {  // the same passes for the whole warp
      const int head = h0 + lane / G, is_k = head >= num_heads;
      T* dst = is_k ? k_dst + (head - num_heads) * head_dim
                    : q + (size_t(t) * num_heads + head) * head_dim;
      rotate_head<T, W>(dst, src + head * head_dim, bias + head * head_dim, cs,
                        nw + is_k * head_dim, head_dim, lane % G, G, head < heads, flags, eps);
    }
  });
  if (!cached) return;
  const T* v_src = src + (q_row + kv_row);
  const T* v_bias = flags & kRotaryBias ? bias + (q_row + kv_row) : v_src;
  T* v_dst = v_cache + size_t(slot) * kv_row;
  with_vec_width<T>(vec_width<T>(kv_row, v_src, v_cache, v_bias), [&](auto vec) {
    constexpr int W = decltype(vec)::value;
    for (int i = lane; i < kv_row / W; i += kWarpSize) {
      Vec<T, W> v = load_vec<W>(v_src + i * W);
      if (flags & kRotaryBias) {
        const Vec<T, W> b = load_vec<W>(v_bias + i * W);
#pragma unroll
        for (int e = 0; e < W; ++e) v.v[e] = from_float<T>(to_float(v.v[e]) + to_float(b.v[e]));
      }
      store_vec<W>(v_dst + i * W, v);
    }
  });
}

DTYPE_ENTRY_POINTS(rotary_cache, 18)
