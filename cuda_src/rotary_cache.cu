// rotary_cache.cu: one token's q, k, v rows out of the QKV product, in one pass: q rotated into
// the (T, H, hd) q buffer the attention kernels read, k rotated and v copied into the paged
// cache at the token's slot, k_cache[slot // bs, slot % bs] (the flat offset slot * Hkv * hd).
// A slot < 0 (padding) or past the cache writes no K/V (and reads none). Rotary in Hugging
// Face's rotate-half layout, element i paired with i + hd/2:
//   x[i]      <- x[i] * cos - x[i + hd/2] * sin
//   x[i+hd/2] <- x[i + hd/2] * cos + x[i] * sin
// cos_sin[p] holds cos(p * f_j) for j < hd/2, then sin(p * f_j), with f_j = theta^(-2j/hd),
// computed once on the host in float64 (float32 angles lose ~1e-4 at positions in the 1000s).
// A position outside [0, max_positions) leaves its token unrotated (the wrapper rejects it).
//
// One warp per token. Lane 0 reads the position and slot; the warp stages the token's cos/sin
// row in shared memory, then each lane rotates vectors of up to 16 bytes: item e of the
// (H + Hkv) * (hd/2) / W items is head e / (hd/2/W), elements c..c+W-1 and c+hd/2.. of it.
// So every input byte is read at most once: qkv's q and k parts, the v part when the slot is
// valid, one cos/sin row per token.
#include "common.cuh"

constexpr int kRotaryWarps = 4;           // tokens per block
constexpr int kRotaryMaxHeadDim = 256;    // the staged cos/sin row

template <typename T, int W>
__device__ __forceinline__ void rotate_pair(T* __restrict__ dst, const T* __restrict__ src,
                                            const float* __restrict__ cs, int c, int half) {
  const Vec<T, W> a = load_vec<W>(src + c), b = load_vec<W>(src + half + c);
  Vec<T, W> lo, hi;
#pragma unroll
  for (int e = 0; e < W; ++e) {
    const float x = to_float(a.v[e]), y = to_float(b.v[e]);
    const float cosv = cs[c + e], sinv = cs[half + c + e];
    lo.v[e] = from_float<T>(x * cosv - y * sinv);
    hi.v[e] = from_float<T>(y * cosv + x * sinv);
  }
  store_vec<W>(dst + c, lo);
  store_vec<W>(dst + half + c, hi);
}

// Grid: (cdiv(T, 4),)  Block: (128,): warp w of block b is token 4b + w
template <typename T>
__device__ __forceinline__ void rotary_cache(T* __restrict__ q,                  // (T, H, hd)
                                             T* __restrict__ k_cache,  // (N, bs, Hkv, hd)
                                             T* __restrict__ v_cache,  // (N, bs, Hkv, hd)
                                             const T* __restrict__ qkv,  // (T, (H+2Hkv)*hd)
                                             const int* __restrict__ positions,     // (T,)
                                             const int* __restrict__ slot_mapping,  // (T,)
                                             const float* __restrict__ cos_sin,     // (P, hd)
                                             int rows, int num_heads, int num_kv_heads,
                                             int head_dim, int max_positions,
                                             long long num_slots) {
  __shared__ float table[kRotaryWarps][kRotaryMaxHeadDim];
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int t = blockIdx.x * kRotaryWarps + warp;
  if (t >= rows) return;  // the whole warp
  int pos = lane == 0 ? positions[t] : 0, slot_in = lane == 0 ? slot_mapping[t] : 0;
  pos = __shfl_sync(kFullMask, pos, 0);
  const long long slot = __shfl_sync(kFullMask, slot_in, 0);
  const bool rotate = pos >= 0 && pos < max_positions, cached = slot >= 0 && slot < num_slots;
  const int half = head_dim / 2, kv_row = num_kv_heads * head_dim;
  float* cs = table[warp];
  for (int i = lane; i < head_dim; i += kWarpSize) {
    cs[i] = rotate ? cos_sin[size_t(pos) * head_dim + i] : (i < half ? 1.0f : 0.0f);
  }
  __syncwarp();
  const T* src = qkv + size_t(t) * (num_heads * head_dim + 2 * kv_row);
  T* k_dst = k_cache + size_t(cached ? slot : 0) * kv_row;
  const int heads = num_heads + (cached ? num_kv_heads : 0);  // k heads only when cached
  with_vec_width<T>(vec_width<T>(half, qkv, q, k_cache), [&](auto vec) {
    constexpr int W = decltype(vec)::value;
    const int per_head = half / W;
    for (int e = lane; e < heads * per_head; e += kWarpSize) {
      const int head = e / per_head, c = (e % per_head) * W;
      T* dst = head < num_heads ? q + (size_t(t) * num_heads + head) * head_dim
                                : k_dst + (head - num_heads) * head_dim;
      rotate_pair<T, W>(dst, src + head * head_dim, cs, c, half);
    }
  });
  if (!cached) return;
  const T* v_src = src + (num_heads * head_dim + kv_row);
  T* v_dst = v_cache + size_t(slot) * kv_row;
  with_vec_width<T>(vec_width<T>(kv_row, v_src, v_cache), [&](auto vec) {
    constexpr int W = decltype(vec)::value;
    for (int i = lane; i < kv_row / W; i += kWarpSize) {
      store_vec<W>(v_dst + i * W, load_vec<W>(v_src + i * W));
    }
  });
}

DTYPE_ENTRY_POINTS(rotary_cache, 13)
