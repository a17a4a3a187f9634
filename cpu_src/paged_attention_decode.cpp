// Paged decode attention: one query row per sequence over its paged K/V.
// Threads: one task per sequence, or per (sequence, KV head) when there are too few sequences
// to keep every thread busy; tasks go to the threads as they free up. A task walks the block
// table once, a tile of keys at a time; each K and V row is read once for all the query heads
// that share it (converted to float32 once, for a 16-bit cache), with an online softmax
// (running max and sum per query head, the accumulator rescaled once per tile). A query head's
// scores are four dot products at a time (four sums in flight, reduced together); its
// accumulator stays in registers while it runs over the tile's values.
#include <vector>

#include "common.h"

namespace {

const int TILE = 32;  // keys per tile
const int MAX_HD = 256;

// Where the keys t0..t0+nt-1 sit: at[j], the offset of key t0+j's row in the cache (in
// elements; K and V share it). The block table is read once per block, with no division per key.
void tile_slots(long* at, const int32_t* table, int t0, int nt, int bs, long row) {
  int blk = t0 / bs, off = t0 % bs;
  long base = (long)table[blk] * bs * row;
  for (int j = 0; j < nt; j++) {
    at[j] = base + off * row;
    if (++off == bs && j + 1 < nt) {
      off = 0;
      base = (long)table[++blk] * bs * row;
    }
  }
}

// The tile's key (or value) rows of KV head h as float32: (nt, hd) at rows (pointers into
// the cache for a float32 one, else converted into buf).
template <typename T>
void tile_rows(const float** rows, float* buf, const T* cache, const long* at, int nt, int h,
               int hd) {
  for (int j = 0; j < nt; j++)
    rows[j] = row_f32(cache + at[j] + (long)h * hd, buf + (long)j * hd, hd);
}

// Ask for a tile's rows of KV heads h0..h1-1 ahead of use: a sequence's blocks are scattered
// over the pool, so the hardware prefetcher cannot guess the next one.
template <typename T>
void prefetch_tile(const T* cache, const long* at, int nt, int h0, int h1, int hd) {
  const long bytes = (long)(h1 - h0) * hd * sizeof(T);
  for (int j = 0; j < nt; j++) {
    const char* p = (const char*)(cache + at[j] + (long)h0 * hd);
    for (long off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
  }
}

// q . k over hd for four keys at once (four independent sums in flight, one reduction).
template <int HD>
inline v4 dot4(const float* q, const float* k0, const float* k1, const float* k2,
               const float* k3, int hd) {
  v8 a0 = load8(q) * load8(k0), a1 = load8(q) * load8(k1);
  v8 a2 = load8(q) * load8(k2), a3 = load8(q) * load8(k3);
  for (int i = 8; i < (HD ? HD : hd); i += 8) {
    const v8 qi = load8(q + i);
    a0 += qi * load8(k0 + i);
    a1 += qi * load8(k1 + i);
    a2 += qi * load8(k2 + i);
    a3 += qi * load8(k3 + i);
  }
  return hsum8x4(a0, a1, a2, a3);
}

// One query head over one tile: scores s[j] = q . k_j * scale. HD: the head dim, or 0 for hd.
template <int HD>
inline void scores(float* s, const float* q, const float* const* k, int nt, float scale,
                   int hd_rt) {
  int j = 0;
  for (; j + 4 <= nt; j += 4) {
    const v4 d = dot4<HD>(q, k[j], k[j + 1], k[j + 2], k[j + 3], hd_rt) * scale;
    std::memcpy(s + j, &d, sizeof d);
  }
  if (j < nt) {  // the last 1-3 keys, the last one repeated to make four
    const int last = nt - 1;
    const v4 d = dot4<HD>(q, k[j], k[std::min(j + 1, last)], k[std::min(j + 2, last)], k[last],
                          hd_rt) * scale;
    for (int r = 0; j + r < nt; r++) s[j + r] = d[r];
  }
}

// acc = acc * corr + sum_j p_j v_j for one query head.
template <int HD>
inline void accumulate(float* acc, const float* p, const float* const* v, int nt, float corr,
                       int hd_rt) {
  const int hd = HD ? HD : hd_rt;
  v8 a[MAX_HD / 8];
  for (int i = 0; i < hd / 8; i++) a[i] = load8(acc + 8 * i) * corr;
  for (int j = 0; j < nt; j++)
    for (int i = 0; i < hd / 8; i++) a[i] += p[j] * load8(v[j] + 8 * i);
  for (int i = 0; i < hd / 8; i++) store8(acc + 8 * i, a[i]);
}

template <int HD, typename T>
void decode_task(const float* q, const T* k_cache, const T* v_cache, const int32_t* table,
                 int lo, int n, int bs, int hkv, int hd, int group, float scale, int h0, int h1,
                 float* out) {
  // q, out: (H, hd) rows of one sequence; this task: KV heads h0..h1-1, keys lo..n-1
  const int nh = (h1 - h0) * group;  // query heads of the task
  std::vector<float> m(nh, -INFINITY), l(nh, 0.0f), acc((size_t)nh * hd, 0.0f);
  std::vector<float> kbuf(sizeof(T) == 4 ? 0 : (size_t)TILE * hd), vbuf(kbuf.size());
  const float* krows[TILE];
  const float* vrows[TILE];
  float s[TILE];
  long slots[2][TILE];  // this tile's key offsets and the next one's
  const long row = (long)hkv * hd;
  tile_slots(slots[0], table, lo, std::min(TILE, n - lo), bs, row);
  for (int t0 = lo, cur = 0; t0 < n; t0 += TILE, cur ^= 1) {
    const int nt = std::min(TILE, n - t0);
    const long* at = slots[cur];
    if (t0 + TILE < n) {
      const int next = std::min(TILE, n - t0 - TILE);
      tile_slots(slots[cur ^ 1], table, t0 + TILE, next, bs, row);
      prefetch_tile(k_cache, slots[cur ^ 1], next, h0, h1, hd);
      prefetch_tile(v_cache, slots[cur ^ 1], next, h0, h1, hd);
    }
    for (int h = h0; h < h1; h++) {
      tile_rows(krows, kbuf.data(), k_cache, at, nt, h, hd);
      tile_rows(vrows, vbuf.data(), v_cache, at, nt, h, hd);
      for (int g = 0; g < group; g++) {
        const int r = (h - h0) * group + g;  // the task's query head
        scores<HD>(s, q + (long)(h * group + g) * hd, krows, nt, scale, hd);
        const float corr = softmax_tile(s, nt, m[r], l[r]);
        accumulate<HD>(acc.data() + (size_t)r * hd, s, vrows, nt, corr, hd);
      }
    }
  }
  float* o = out + (long)h0 * group * hd;
  for (int r = 0; r < nh; r++) {
    const float inv = 1.0f / l[r];
    for (int d = 0; d < hd; d++) o[(long)r * hd + d] = acc[(size_t)r * hd + d] * inv;
  }
}

template <int HD, typename T>
void decode(float* out, const float* q, const T* k_cache, const T* v_cache,
            const int32_t* block_tables, const int32_t* context_lens, int B, int max_blocks,
            int H, int hkv, int hd, int bs, float scale, int window, int threads) {
  const int group = H / hkv;
  long work = 0;
  for (int b = 0; b < B; b++) work += (long)context_lens[b] * H * hd * 4;
  const int nt = threads_for(work, threads);
  const int per_seq = B >= 2 * nt ? 1 : hkv;  // tasks per sequence
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
  for (long task = 0; task < (long)B * per_seq; task++) {
    const int b = (int)(task / per_seq), part = (int)(task % per_seq);
    const int h0 = per_seq == 1 ? 0 : part, h1 = per_seq == 1 ? hkv : part + 1;
    const int n = context_lens[b];
    const int lo = window > 0 ? std::max(0, n - window) : 0;
    const long at = (long)b * H * hd;
    decode_task<HD>(q + at, k_cache, v_cache, block_tables + (long)b * max_blocks, lo, n, bs,
                    hkv, hd, group, scale, h0, h1, out + at);
  }
}

template <typename T>
void decode_any(float* out, const float* q, const T* k, const T* v, const int32_t* tables,
                const int32_t* lens, int B, int M, int H, int hkv, int hd, int bs, float scale,
                int window, int threads) {
  if (hd == 64)
    decode<64>(out, q, k, v, tables, lens, B, M, H, hkv, hd, bs, scale, window, threads);
  else if (hd == 128)
    decode<128>(out, q, k, v, tables, lens, B, M, H, hkv, hd, bs, scale, window, threads);
  else
    decode<0>(out, q, k, v, tables, lens, B, M, H, hkv, hd, bs, scale, window, threads);
}

}  // namespace

// out, q: (B, H, hd) float32; k_cache, v_cache: (N, bs, Hkv, hd) of `dtype`;
// block_tables: (B, max_blocks) int32; context_lens: (B,) int32, each >= 1.
// Returns 0, or 1 for shapes beyond the kernel's limits (the caller checks them first).
extern "C" int paged_attention_decode(float* out, const float* q, const void* k_cache,
                                      const void* v_cache, int dtype,
                                      const int32_t* block_tables,
                                      const int32_t* context_lens, int B, int max_blocks, int H,
                                      int hkv, int hd, int bs, float scale, int window,
                                      int threads) {
  if (H % hkv || hd > MAX_HD || hd % 8) return 1;
  DISPATCH_CACHE(dtype, decode_any<T>(out, q, (const T*)k_cache, (const T*)v_cache,
                                      block_tables, context_lens, B, max_blocks, H, hkv, hd, bs,
                                      scale, window, threads));
  return 0;
}
