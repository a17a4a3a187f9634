// Paged decode attention: one query row per sequence over its paged K/V.
// Threads: one task per sequence, or per (sequence, KV head) when there are too few sequences
// to keep every thread busy; tasks go to the threads as they free up. A task walks the block
// table once, a tile of keys at a time, with an online softmax (running max and sum per query
// head, the accumulator rescaled once per tile), and asks for the next tile's rows a few cache
// lines at a time while it works on this one.
//
// The query heads that share a KV head go through its rows together, up to three at a time
// (a "party"): each K and V row is loaded and widened to float32 in registers once per party,
// never stored. Scores are taken four keys at a time (a party's 4 x 3 sums in flight, reduced
// together); values are accumulated 16 head dims at a time over the whole tile, the party's
// accumulators in registers. A bfloat16 row widens with a shift and a mask per 16 values: the
// even dims land in one vector, the odd ones in another, so q and the accumulators are kept
// in that order too and put back in the head's order at the end.
#include <vector>

#include "common.h"

namespace {

const int TILE = 16;   // keys per tile (SmolLM2, bf16: this tile's K and V and the next's, 24 KB)
const int PARTY = 3;   // query heads at most that go through a KV head's rows together
const int MAX_HD = 256;

typedef uint32_t u8x8 __attribute__((vector_size(32)));
typedef _Float16 h8 __attribute__((vector_size(16)));

// 16 values of a cache row (16 head dims) as two float32 vectors, and where dim i of the
// chunk lands in them (lanes 0-7 of the first, then the second).
template <typename T> struct Chunk;
template <> struct Chunk<float> {
  static inline void load(const float* p, v8& a, v8& b) {
    a = load8(p);
    b = load8(p + 8);
  }
  static int lane(int i) { return i; }
};
template <> struct Chunk<f16> {
  static inline void load(const f16* p, v8& a, v8& b) {
    h8 x, y;
    std::memcpy(&x, p, sizeof x);
    std::memcpy(&y, p + 8, sizeof y);
    a = __builtin_convertvector(x, v8);
    b = __builtin_convertvector(y, v8);
  }
  static int lane(int i) { return i; }
};
template <> struct Chunk<bf16> {  // 32-bit word j holds dims 2j (low half) and 2j + 1
  static inline void load(const bf16* p, v8& a, v8& b) {
    u8x8 x;
    std::memcpy(&x, p, sizeof x);
    a = (v8)(x << 16);
    b = (v8)(x & 0xffff0000u);
  }
  static int lane(int i) { return i % 2 ? 8 + i / 2 : i / 2; }
};

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

// Asks for the next tile's K and V rows (KV heads h0..h1-1) a few cache lines at a time while
// the current tile is worked on: a sequence's blocks are scattered over the pool, so the
// hardware prefetcher cannot guess the next one, and a whole tile asked for at once stalls
// the core until most of it has arrived.
struct Ahead {
  const char* k = nullptr;
  const char* v = nullptr;
  const long* at = nullptr;  // the next tile's key offsets (elements)
  int nt = 0, j = 0;         // keys in the next tile, the key being asked for
  long esize = 0, first = 0, bytes = 0, off = 0, per_call = 0;

  template <typename T>
  void start(const T* k_cache, const T* v_cache, const long* slots, int n, int h0, int h1,
             int hd, int calls) {
    k = (const char*)k_cache;
    v = (const char*)v_cache;
    at = slots, nt = n, j = 0, off = 0;
    esize = sizeof(T), first = (long)h0 * hd * sizeof(T), bytes = (long)(h1 - h0) * hd * sizeof(T);
    const long lines = (long)n * ((bytes + 63) / 64);
    per_call = calls > 0 ? (lines + calls - 1) / calls : lines;
  }
  inline void step() {
    for (long i = 0; i < per_call && j < nt; i++) {
      const long p = at[j] * esize + first + off;
      __builtin_prefetch(k + p);
      __builtin_prefetch(v + p);
      if ((off += 64) >= bytes) off = 0, j++;
    }
  }
  void rest() {
    while (j < nt) step();
  }
};

// A party of G query heads over one tile's keys of their KV head: s[g][j] = q_g . k_j * scale.
// q: (G, hd) in the chunks' lane order; k: the tile's rows of the KV head; rows past nt are
// the last one again (their scores are not used).
template <int HD, int G, typename T>
inline void party_scores(float (*s)[TILE], const float* q, const T* const* k, int nt,
                         float scale, int hd_rt, Ahead& ahead) {
  const int hd = HD ? HD : hd_rt;
  for (int j = 0; j < nt; j += 4) {
    ahead.step();
    const T* rows[4];
    for (int r = 0; r < 4; r++) rows[r] = k[std::min(j + r, nt - 1)];
    v8 acc[G][4] = {};
    for (int c = 0; c < hd; c += 16) {
      for (int r = 0; r < 4; r++) {
        v8 a, b;
        Chunk<T>::load(rows[r] + c, a, b);
        for (int g = 0; g < G; g++) {
          acc[g][r] += load8(q + g * hd + c) * a;
          acc[g][r] += load8(q + g * hd + c + 8) * b;
        }
      }
    }
    for (int g = 0; g < G; g++) {
      const v4 d = hsum8x4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]) * scale;
      std::memcpy(&s[g][j], &d, sizeof d);
    }
  }
}

// acc_g = acc_g * corr_g + sum_j p_g[j] v_j for a party, 16 head dims at a time (the
// accumulators of those dims stay in registers over the tile).
template <int HD, int G, typename T>
inline void party_values(float* acc, const float (*p)[TILE], const T* const* v, int nt,
                         const float* corr, int hd_rt) {
  const int hd = HD ? HD : hd_rt;
  for (int c = 0; c < hd; c += 16) {
    v8 a[G][2];
    for (int g = 0; g < G; g++)
      for (int i = 0; i < 2; i++) a[g][i] = load8(acc + g * hd + c + 8 * i) * corr[g];
    for (int j = 0; j < nt; j++) {
      v8 x, y;
      Chunk<T>::load(v[j] + c, x, y);
      for (int g = 0; g < G; g++) {
        a[g][0] += p[g][j] * x;
        a[g][1] += p[g][j] * y;
      }
    }
    for (int g = 0; g < G; g++)
      for (int i = 0; i < 2; i++) store8(acc + g * hd + c + 8 * i, a[g][i]);
  }
}

// One party (G query heads of one KV head) over one tile: scores, softmax, values.
// q, acc: (G, hd) in lane order; m, l: the party's running max and sum.
template <int HD, int G, typename T>
void party_tile(float* acc, float* m, float* l, const float* q, const T* const* k,
                const T* const* v, int nt, float scale, int hd, Ahead& ahead) {
  float s[G][TILE], corr[G];
  party_scores<HD, G>(s, q, k, nt, scale, hd, ahead);
  for (int g = 0; g < G; g++) corr[g] = softmax_tile(s[g], nt, m[g], l[g]);
  party_values<HD, G>(acc, s, v, nt, corr, hd);
}

template <int HD, typename T>
void decode_task(const float* q, const T* k_cache, const T* v_cache, const int32_t* table,
                 int lo, int n, int bs, int hkv, int hd, int group, float scale, int h0, int h1,
                 float* out) {
  // q, out: (H, hd) rows of one sequence; this task: KV heads h0..h1-1, keys lo..n-1
  const int nh = (h1 - h0) * group;  // query heads of the task
  std::vector<float> m(nh, -INFINITY), l(nh, 0.0f), acc((size_t)nh * hd, 0.0f), qp(acc.size());
  const float* qt = q + (long)h0 * group * hd;  // the task's query heads
  for (int r = 0; r < nh; r++)  // in the chunks' lane order
    for (int d = 0; d < hd; d++)
      qp[(size_t)r * hd + d / 16 * 16 + Chunk<T>::lane(d % 16)] = qt[(long)r * hd + d];
  const int parties = (group + PARTY - 1) / PARTY;
  const T* krows[TILE];
  const T* vrows[TILE];
  long slots[2][TILE];  // this tile's key offsets and the next one's
  const long row = (long)hkv * hd;
  Ahead ahead;
  tile_slots(slots[0], table, lo, std::min(TILE, n - lo), bs, row);
  ahead.start(k_cache, v_cache, slots[0], std::min(TILE, n - lo), h0, h1, hd, 0);
  ahead.rest();  // the first tile: nothing to overlap its wait with
  for (int t0 = lo, cur = 0; t0 < n; t0 += TILE, cur ^= 1) {
    const int nt = std::min(TILE, n - t0);
    const long* at = slots[cur];
    const int next = t0 + TILE < n ? std::min(TILE, n - t0 - TILE) : 0;
    if (next) tile_slots(slots[cur ^ 1], table, t0 + TILE, next, bs, row);
    // ahead.step() runs once per four keys of each party
    ahead.start(k_cache, v_cache, slots[cur ^ 1], next, h0, h1, hd,
                (h1 - h0) * parties * ((nt + 3) / 4));
    for (int h = h0; h < h1; h++) {
      for (int j = 0; j < nt; j++) {
        krows[j] = k_cache + at[j] + (long)h * hd;
        vrows[j] = v_cache + at[j] + (long)h * hd;
      }
      for (int p = 0, g0 = 0; p < parties; p++) {  // the group split into parties of <= 3
        const int size = (group - g0) / (parties - p);
        const int r = (h - h0) * group + g0;  // the party's first query head in the task
        float* a = acc.data() + (size_t)r * hd;
        const float* qr = qp.data() + (size_t)r * hd;
        if (size == 3)
          party_tile<HD, 3>(a, &m[r], &l[r], qr, krows, vrows, nt, scale, hd, ahead);
        else if (size == 2)
          party_tile<HD, 2>(a, &m[r], &l[r], qr, krows, vrows, nt, scale, hd, ahead);
        else
          party_tile<HD, 1>(a, &m[r], &l[r], qr, krows, vrows, nt, scale, hd, ahead);
        g0 += size;
      }
    }
    ahead.rest();
  }
  float* o = out + (long)h0 * group * hd;
  for (int r = 0; r < nh; r++) {
    const float inv = 1.0f / l[r];
    for (int d = 0; d < hd; d++)
      o[(long)r * hd + d] = acc[(size_t)r * hd + d / 16 * 16 + Chunk<T>::lane(d % 16)] * inv;
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
  if (H % hkv || hd > MAX_HD || hd % 16) return 1;
  DISPATCH_CACHE(dtype, decode_any<T>(out, q, (const T*)k_cache, (const T*)v_cache,
                                      block_tables, context_lens, B, max_blocks, H, hkv, hd, bs,
                                      scale, window, threads));
  return 0;
}
