// Paged decode attention: one query row per sequence over its paged K/V.
// Threads: one task per sequence, or per (sequence, KV head) when there are too few sequences
// to keep every thread busy; a thread claims its next task as it starts the last chunk of one.
//
// A task walks its keys in chunks of CHUNK, each in two passes, with an online softmax across
// chunks (running max and sum per query head, the accumulators rescaled once per chunk). The
// query heads that share a KV head go through its rows together in parties of up to four,
// so each row is loaded and widened to float32 once per party. Pass 1, the scores, W keys at
// a time (W, the float lanes of a vector: 16 with AVX-512 when the head dims are a multiple of
// 32, else 8): each key's products summed in a vector per query head, and the W vectors of a
// tile reduced together by a transpose-and-add tree (45 shuffles and adds for 16 dot
// products, instead of four or five per product). Then the chunk's softmax, plain vector
// loops. Pass 2, the values: the party's accumulators stay in registers over the chunk (a
// head-dim slice at a time where they do not fit).
//
// Memory: while a chunk is worked on, the next chunk's K and V rows (this task's, or the
// next task's first) are asked for (prefetched into L2) a few cache lines every four keys,
// and the chunk's own rows AHEAD keys before they are used: a sequence's blocks are scattered
// over the pool, so the hardware prefetcher cannot guess them, and asking for many lines at
// once stalls the core.
//
// A bfloat16 pair of dims widens with a shift (the even dim) and a mask (the odd one): the
// even dims of 2W land in one vector, the odd ones in the next, so q and the accumulators
// are kept in that lane order and put back in the head's order at the end.
// float16 and the 8-bit floats (e4m3, e5m2) widen through vcvtph2ps, in the head's order.
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <type_traits>
#include <vector>

#include "common.h"

namespace {

const int PARTY = 4;    // query heads at most that go through a KV head's rows together
const int MAX_HD = 256;
const int CHUNK = 256;  // keys at a time (SmolLM2, bf16: 192 KB of K and V, in L2)
const int AHEAD = 8;    // keys between the row asked for and the row worked on

#if defined(__AVX512F__)
typedef float v16 __attribute__((vector_size(64)));  // only where it is a register
#endif

template <typename V> constexpr int lanes() { return sizeof(V) / sizeof(float); }

// 2W values of a cache row as two float32 vectors, and where dim i of the 2W lands in them.
template <typename V, typename T> struct Row;
template <typename V> struct Row<V, float> {
  static constexpr float gain = 1.0f;
  static inline void load(const float* p, V& a, V& b) {
    std::memcpy(&a, p, sizeof a);
    std::memcpy(&b, p + lanes<V>(), sizeof b);
  }
  static int lane(int i) { return i; }
};
// W float16 values at p as float32 (F16C's conversion: GCC 12 converts a _Float16 vector one
// lane at a time).
template <typename V> static inline V widen_halves(const void* p);
#if defined(__F16C__)
template <> inline v8 widen_halves<v8>(const void* p) {
  return (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
}
#else  // lane by lane (aarch64: the conversions are NEON's fcvtl)
template <> inline v8 widen_halves<v8>(const void* p) {
  f16 h[8];
  std::memcpy(h, p, sizeof h);
  v8 v;
  for (int i = 0; i < 8; i++) v[i] = (float)h[i];
  return v;
}
#endif
#if defined(__AVX512F__)
template <> inline v16 widen_halves<v16>(const void* p) {
  const __m256i h = _mm256_loadu_si256((const __m256i*)p);  // (the masked form: GCC 12 warns
  return (v16)_mm512_mask_cvtph_ps(_mm512_setzero_ps(), (__mmask16)-1, h);  // on the plain one)
}
#endif
template <typename V> struct Row<V, f16> {
  static constexpr float gain = 1.0f;
  static inline void load(const f16* p, V& a, V& b) {
    a = widen_halves<V>(p);
    b = widen_halves<V>(p + lanes<V>());
  }
  static int lane(int i) { return i; }
};
template <typename V> struct Row<V, bf16> {  // 32-bit word j holds dims 2j (low half), 2j + 1
  static constexpr float gain = 1.0f;
  typedef uint32_t words __attribute__((vector_size(sizeof(V))));
  static inline void load(const bf16* p, V& a, V& b) {
    words x;
    std::memcpy(&x, p, sizeof x);
    a = (V)(x << 16);
    b = (V)(x & 0xffff0000u);
  }
  static int lane(int i) { return i % 2 ? lanes<V>() + i / 2 : i / 2; }
};
// The 8-bit floats through float16 bits (one widening, a shift, then the float16 conversion):
// e5m2 is a float16's top byte; e4m3's sign-extended byte shifted left by 7 is float16's bits
// with the sign copied into the exponent's top bit (masked off) and the value / 256, which the
// kernel multiplies back once (`gain`: into the scores' scale and the output).
// (GCC 12 refuses __builtin_convertvector on integer vector types declared in a template, so
// the 2W bytes and 2W shorts of each width are declared here.)
template <typename V> struct Bytes;
template <> struct Bytes<v8> {
  typedef int8_t octets __attribute__((vector_size(16)));
  typedef int16_t shorts __attribute__((vector_size(32)));
};
#if defined(__AVX512F__)
template <> struct Bytes<v16> {
  typedef int8_t octets __attribute__((vector_size(32)));
  typedef int16_t shorts __attribute__((vector_size(64)));
};
#endif
template <typename V, typename T> struct Row8 {
  typedef typename Bytes<V>::octets octets;
  typedef typename Bytes<V>::shorts shorts;
  static inline void load(const T* p, V& a, V& b) {
    octets x;
    std::memcpy(&x, p, sizeof x);
    shorts h = __builtin_convertvector(x, shorts);
    if constexpr (std::is_same<T, e5m2>::value) {
      h = h << 8;
    } else {
      const shorts nan = (h & 0x7f) == 0x7f;  // e4m3's NaN -> a float16 NaN
      h = ((h << 7) & (short)0xbfff) | (nan & (short)0x7e00);
    }
    a = widen_halves<V>(&h);
    b = widen_halves<V>((const char*)&h + sizeof h / 2);
  }
  static int lane(int i) { return i; }
};
template <typename V> struct Row<V, e4m3> : Row8<V, e4m3> {
  static constexpr float gain = 256.0f;
};
template <typename V> struct Row<V, e5m2> : Row8<V, e5m2> {
  static constexpr float gain = 1.0f;
};

// The transpose-and-add tree. pair(a, b): in each 128-bit lane, (a's 0+2, b's 0+2, a's 1+3,
// b's 1+3). quad(u, v) of two pairs (a, b) and (c, d): in each 128-bit lane, one partial sum
// of a, b, c, d. halves(x, y): x's even 128-bit lanes + its odd ones, then y's.
template <typename V> struct Tree;
template <> struct Tree<v8> {
  typedef int32_t m __attribute__((vector_size(32)));
  static inline v8 pair(v8 a, v8 b) {
    return __builtin_shuffle(a, b, m{0, 8, 1, 9, 4, 12, 5, 13}) +
           __builtin_shuffle(a, b, m{2, 10, 3, 11, 6, 14, 7, 15});
  }
  static inline v8 quad(v8 u, v8 v) {
    return __builtin_shuffle(u, v, m{0, 1, 8, 9, 4, 5, 12, 13}) +
           __builtin_shuffle(u, v, m{2, 3, 10, 11, 6, 7, 14, 15});
  }
  static inline v8 halves(v8 x, v8 y) {
    return __builtin_shuffle(x, y, m{0, 1, 2, 3, 8, 9, 10, 11}) +
           __builtin_shuffle(x, y, m{4, 5, 6, 7, 12, 13, 14, 15});
  }
  // q: the quads of keys 0-3, 4-7 -> one vector of the 8 keys' sums
  static inline v8 sums(const v8* q) { return halves(q[0], q[1]); }
};
#if defined(__AVX512F__)
template <> struct Tree<v16> {
  typedef int32_t m __attribute__((vector_size(64)));
  static inline v16 pair(v16 a, v16 b) {
    return __builtin_shuffle(a, b, m{0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29}) +
           __builtin_shuffle(a, b, m{2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31});
  }
  static inline v16 quad(v16 u, v16 v) {
    return __builtin_shuffle(u, v, m{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}) +
           __builtin_shuffle(u, v, m{2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31});
  }
  static inline v16 halves(v16 x, v16 y) {
    return __builtin_shuffle(x, y, m{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}) +
           __builtin_shuffle(x, y, m{4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31});
  }
  static inline v16 sums(const v16* q) { return halves(halves(q[0], q[1]), halves(q[2], q[3])); }
};
#endif

// Keys lo..n-1 of a sequence and where their rows are: at[j], the offset of key lo+j's row in
// the cache (elements; K and V share it), the block table read once per block.
void key_rows(std::vector<long>& at, const int32_t* table, int lo, int n, int bs, long row) {
  at.resize(n - lo);
  int blk = lo / bs, off = lo % bs;
  long base = (long)table[blk] * bs * row;
  for (int j = 0; j < n - lo; j++) {
    at[j] = base + off * row;
    if (++off == bs && j + 1 < n - lo) off = 0, base = (long)table[++blk] * bs * row;
  }
}

// The next chunk's rows, asked for (prefetched) `per_step` cache lines at a time: the K and V
// rows at[j] of its keys j..n-1, `bytes` of each from `first` bytes in (its KV heads).
struct Ahead {
  const char* k = nullptr;
  const char* v = nullptr;
  const long* at = nullptr;
  long esize = 0, first = 0, per_step = 0;  // lines a step
  int n = 0, j = 0, bytes = 0, off = 0;
  inline void step() {
    for (long i = 0; i < per_step && j < n; i++) {
      const long p = at[j] * esize + first + off;
      __builtin_prefetch(k + p, 0, 1);
      __builtin_prefetch(v + p, 0, 1);
      if ((off += 64) >= bytes) off = 0, j++;
    }
  }
};

// What a party's passes over a chunk share: the KV head's rows (key j's row at base + at[j]),
// the chunk's n keys, and the rows asked for as they go.
template <typename T> struct Keys {
  const T* base;
  const long* at;
  int n;
  Ahead* ahead;  // the next chunk's rows
  const T* fetch;  // the chunk's first party: where the task's rows start, else null
  int bytes;       // of each row to ask for
  inline const T* row(int j) const { return base + at[j]; }
  inline void ask(int j) const {  // this chunk's row j, a few keys ahead
    if (!fetch || j >= n) return;
    const char* p = (const char*)(fetch + at[j]);
    for (int o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 1);
  }
};

// Pass 1: s[g][j] = q_g . k_j * scale for the party's G heads and keys j < n (s: G rows of
// `stride` floats; the lanes past n get the last key's scores). q: (G, hd) in lane order.
template <typename V, int HD, int G, typename T>
void party_scores(float* s, long stride, const float* q, const Keys<T>& keys, float scale,
                  int hd_rt) {
  constexpr int W = lanes<V>();
  const int hd = HD ? HD : hd_rt;
  for (int t0 = 0; t0 < keys.n; t0 += W) {
    V quads[G][W / 4];  // the tree's third level, four keys each
    for (int j0 = 0; j0 < W; j0 += 4) {
      keys.ahead->step();
      V dots[G][4];
      for (int r = 0; r < 4; r++) {
        keys.ask(t0 + j0 + r + AHEAD);
        const T* k = keys.row(std::min(t0 + j0 + r, keys.n - 1));
        V acc[G] = {};
        for (int c = 0; c < hd; c += 2 * W) {
          V a, b;
          Row<V, T>::load(k + c, a, b);
          for (int g = 0; g < G; g++) {
            V qa, qb;
            std::memcpy(&qa, q + g * hd + c, sizeof qa);
            std::memcpy(&qb, q + g * hd + c + W, sizeof qb);
            acc[g] += qa * a;
            acc[g] += qb * b;
          }
        }
        for (int g = 0; g < G; g++) dots[g][r] = acc[g];
      }
      for (int g = 0; g < G; g++)
        quads[g][j0 / 4] = Tree<V>::quad(Tree<V>::pair(dots[g][0], dots[g][1]),
                                         Tree<V>::pair(dots[g][2], dots[g][3]));
    }
    for (int g = 0; g < G; g++) {
      const V d = Tree<V>::sums(quads[g]) * scale;
      std::memcpy(s + g * stride + t0, &d, sizeof d);
    }
  }
}

// Pass 2: acc[g] = acc[g] * corr[g] + sum_j p[g][j] v_j for the party, CP pairs of vectors
// (2W dims each) of the head at a time. acc: (G, hd) in lane order.
template <typename V, int HD, int G, typename T>
void party_values(float* acc, const float* corr, const float* p, long stride,
                  const Keys<T>& keys, int hd_rt) {
  constexpr int W = lanes<V>();
  constexpr int REGS = sizeof(V) == 64 ? 16 : 8;  // accumulators kept in registers
  constexpr int CP = std::max(1, REGS / (2 * G));
  const int hd = HD ? HD : hd_rt;
  for (int c0 = 0; c0 < hd; c0 += 2 * W * CP) {
    const int cp = std::min(CP, (hd - c0) / (2 * W));
    V a[G][2 * CP] = {};
    for (int g = 0; g < G; g++)
      for (int c = 0; c < 2 * cp; c++) {
        std::memcpy(&a[g][c], acc + g * hd + c0 + W * c, sizeof(V));
        a[g][c] *= corr[g];
      }
    for (int j = 0; j < keys.n; j++) {
      if (c0 == 0) {
        if (j % 4 == 0) keys.ahead->step();
        keys.ask(j + AHEAD);
      }
      const T* v = keys.row(j) + c0;
      for (int c = 0; c < CP; c++) {
        if (c >= cp) break;
        V x, y;
        Row<V, T>::load(v + 2 * W * c, x, y);
        for (int g = 0; g < G; g++) {
          const float w = p[g * stride + j];
          a[g][2 * c] += w * x;
          a[g][2 * c + 1] += w * y;
        }
      }
    }
    for (int g = 0; g < G; g++)
      for (int c = 0; c < 2 * cp; c++) std::memcpy(acc + g * hd + c0 + W * c, &a[g][c], sizeof(V));
  }
}

// One party (G query heads of one KV head) over one chunk of keys: scores, softmax, values.
// q, acc: (G, hd) in lane order; m, l: the party's running max and sum.
// softcap > 0: each score s becomes tanh(s / softcap) * softcap (Gemma 2).
template <typename V, int HD, int G, typename T>
void party_chunk(float* acc, float* m, float* l, const float* q, const Keys<T>& k,
                 const Keys<T>& v, float scale, float softcap, int hd, float* s) {
  const long stride = CHUNK;
  float corr[G];
  party_scores<V, HD, G>(s, stride, q, k, scale, hd);
  if (softcap > 0.0f)
    for (int g = 0; g < G; g++)
      for (int j = 0; j < k.n; j++) {
        float& x = s[g * stride + j];
        x = std::tanh(x / softcap) * softcap;
      }
  for (int j = 0; j < AHEAD; j++) v.ask(j);  // the first values' rows
  for (int g = 0; g < G; g++) corr[g] = softmax_tile<V>(s + g * stride, k.n, m[g], l[g]);
  party_values<V, HD, G>(acc, corr, s, stride, v, hd);
}

// A task: one sequence's keys lo..n-1 and KV heads h0..h1-1.
struct Task {
  long b;
  const int32_t* table;
  int lo, n, h0, h1;
};

// A task's running state: per query head (in the task), q and the accumulator in lane order,
// the running max and sum.
struct State {
  std::vector<float> q, acc, m, l;
};

template <typename V, typename T>
void begin_task(State& st, const Task& t, const float* q, int hd, int group) {
  constexpr int W = lanes<V>();
  const int nh = (t.h1 - t.h0) * group;
  st.q.resize((size_t)nh * hd), st.acc.assign((size_t)nh * hd, 0.0f);
  st.m.assign(nh, -INFINITY), st.l.assign(nh, 0.0f);
  for (int r = 0; r < nh; r++)
    for (int d = 0; d < hd; d++)
      st.q[(size_t)r * hd + d / (2 * W) * (2 * W) + Row<V, T>::lane(d % (2 * W))] =
          q[(long)r * hd + d];
}

// sinks (the task's first head's, or null): each head's softmax has one more logit, whose
// share of the sum is dropped (gpt-oss): sum' = l e^(m - m') + e^(sink - m'), m' the larger.
template <typename V, typename T>
void end_task(const State& st, int nh, int hd, float* out, const float* sinks) {
  constexpr int W = lanes<V>();
  for (int r = 0; r < nh; r++) {
    float inv = Row<V, T>::gain / st.l[r];  // the values' gain with the softmax's sum
    if (sinks) {
      const float top = std::max(st.m[r], sinks[r]), keep = std::exp(st.m[r] - top);
      inv = Row<V, T>::gain * keep / (st.l[r] * keep + std::exp(sinks[r] - top));
    }
    for (int d = 0; d < hd; d++)
      out[(long)r * hd + d] =
          st.acc[(size_t)r * hd + d / (2 * W) * (2 * W) + Row<V, T>::lane(d % (2 * W))] * inv;
  }
}

template <typename V, int HD, typename T>
void work_chunk(State& st, const T* k_cache, const T* v_cache, const Task& t, const long* at,
                int len, int hd, int group, float scale, float softcap, Ahead& ahead, float* s) {
  const int parties = (group + PARTY - 1) / PARTY, bytes = (t.h1 - t.h0) * hd * sizeof(T);
  const T* k0 = k_cache + (long)t.h0 * hd;
  const T* v0 = v_cache + (long)t.h0 * hd;
  for (int h = t.h0; h < t.h1; h++) {
    for (int p = 0, g0 = 0; p < parties; p++) {  // the group split into parties of <= 4
      const bool first = h == t.h0 && p == 0;
      const Keys<T> k{k_cache + (long)h * hd, at, len, &ahead, first ? k0 : nullptr, bytes};
      const Keys<T> v{v_cache + (long)h * hd, at, len, &ahead, first ? v0 : nullptr, bytes};
      const int size = (group - g0) / (parties - p);
      const int r = (h - t.h0) * group + g0;  // the party's first query head in the task
      float* acc = st.acc.data() + (size_t)r * hd;
      const float* q = st.q.data() + (size_t)r * hd;
      float *m = st.m.data() + r, *l = st.l.data() + r;
      switch (size) {
        case 4: party_chunk<V, HD, 4>(acc, m, l, q, k, v, scale, softcap, hd, s); break;
        case 3: party_chunk<V, HD, 3>(acc, m, l, q, k, v, scale, softcap, hd, s); break;
        case 2: party_chunk<V, HD, 2>(acc, m, l, q, k, v, scale, softcap, hd, s); break;
        default: party_chunk<V, HD, 1>(acc, m, l, q, k, v, scale, softcap, hd, s); break;
      }
      g0 += size;
    }
  }
}

template <typename V, int HD, typename T>
void decode(float* out, const float* q, const T* k_cache, const T* v_cache,
            const int32_t* block_tables, const int32_t* context_lens, int B, int max_blocks,
            int H, int hkv, int hd, int bs, float scale, int window, float softcap,
            const float* sinks, int threads) {
  const int group = H / hkv, parties = (group + PARTY - 1) / PARTY;
  long work = 0;
  for (int b = 0; b < B; b++) work += (long)context_lens[b] * H * hd * 4;
  const int nt = threads_for(work, threads);
  const int per_seq = B >= 2 * nt ? 1 : hkv;  // tasks per sequence
  const long tasks = (long)B * per_seq, row = (long)hkv * hd;
  auto task = [&](long i) {
    const long b = i / per_seq;
    const int part = (int)(i % per_seq), n = context_lens[b];
    const int lo = window > 0 ? std::max(0, n - window) : 0;
    const int h0 = per_seq == 1 ? 0 : part, h1 = per_seq == 1 ? hkv : part + 1;
    return Task{b, block_tables + b * max_blocks, lo, n, h0, h1};
  };
  long claimed = 0;  // tasks handed out
#pragma omp parallel num_threads(nt)
  {
    thread_local std::vector<long> at[2];  // this chunk's key rows, the next one's
    thread_local State st;
    alignas(64) float s[PARTY * CHUNK];
    Ahead ahead;
    long cur;
#pragma omp atomic capture
    cur = claimed++;
    if (cur < tasks) {
      Task t = task(cur);
      int c0 = t.lo, c = 0;
      key_rows(at[c], t.table, c0, std::min(t.n, c0 + CHUNK), bs, row);
      while (true) {
        const long o = (t.b * H + t.h0 * group) * hd;  // the task's query rows in q and out
        if (c0 == t.lo) begin_task<V, T>(st, t, q + o, hd, group);
        const int c1 = std::min(t.n, c0 + CHUNK);
        Task u = t;  // the next chunk: this task's, or the next one's first
        int u0 = c1;
        if (c1 >= t.n) {
          long nxt;
#pragma omp atomic capture
          nxt = claimed++;
          if (nxt < tasks) u = task(nxt), u0 = u.lo;
          else u0 = -1;
        }
        ahead.j = ahead.n = 0;
        if (u0 >= 0) {
          const int u1 = std::min(u.n, u0 + CHUNK);
          key_rows(at[c ^ 1], u.table, u0, u1, bs, row);
          ahead.k = (const char*)k_cache, ahead.v = (const char*)v_cache;
          ahead.at = at[c ^ 1].data(), ahead.esize = sizeof(T), ahead.off = 0;
          ahead.first = (long)u.h0 * hd * sizeof(T), ahead.bytes = (u.h1 - u.h0) * hd * sizeof(T);
          ahead.n = u1 - u0;
          const long lines = (long)ahead.n * ((ahead.bytes + 63) / 64);
          const long steps = 2L * (t.h1 - t.h0) * parties * ((c1 - c0 + 3) / 4);
          ahead.per_step = (lines + steps - 1) / steps;
        }
        work_chunk<V, HD>(st, k_cache, v_cache, t, at[c].data(), c1 - c0, hd, group,
                          scale * Row<V, T>::gain, softcap, ahead, s);
        if (c1 >= t.n) {
          end_task<V, T>(st, (t.h1 - t.h0) * group, hd, out + o,
                         sinks ? sinks + t.h0 * group : nullptr);
          if (u0 < 0) break;
          t = u;
        }
        c0 = u0, c ^= 1;
      }
    }
  }
}

template <typename V, typename T>
void decode_hd(float* out, const float* q, const T* k, const T* v, const int32_t* tables,
               const int32_t* lens, int B, int M, int H, int hkv, int hd, int bs, float scale,
               int window, float cap, const float* sinks, int threads) {
  if (hd == 64)
    decode<V, 64>(out, q, k, v, tables, lens, B, M, H, hkv, hd, bs, scale, window, cap, sinks,
                  threads);
  else if (hd == 128)
    decode<V, 128>(out, q, k, v, tables, lens, B, M, H, hkv, hd, bs, scale, window, cap, sinks,
                   threads);
  else
    decode<V, 0>(out, q, k, v, tables, lens, B, M, H, hkv, hd, bs, scale, window, cap, sinks,
                 threads);
}

template <typename T>
void decode_any(float* out, const float* q, const T* k, const T* v, const int32_t* tables,
                const int32_t* lens, int B, int M, int H, int hkv, int hd, int bs, float scale,
                int window, float cap, const float* sinks, int threads) {
#if defined(__AVX512F__)
  if (hd % 32 == 0)
    return decode_hd<v16>(out, q, k, v, tables, lens, B, M, H, hkv, hd, bs, scale, window, cap,
                          sinks, threads);
#endif
  decode_hd<v8>(out, q, k, v, tables, lens, B, M, H, hkv, hd, bs, scale, window, cap, sinks,
                threads);
}

}  // namespace

// out, q: (B, H, hd) float32; k_cache, v_cache: (N, bs, Hkv, hd) of `dtype`;
// block_tables: (B, max_blocks) int32; context_lens: (B,) int32, each >= 1; softcap > 0:
// scores soft-capped, tanh(s / softcap) * softcap; sinks: (H,) float32 sink logits, or null.
// Returns 0, or 1 for shapes beyond the kernel's limits (the caller checks them first).
extern "C" int paged_attention_decode(float* out, const float* q, const void* k_cache,
                                      const void* v_cache, int dtype,
                                      const int32_t* block_tables,
                                      const int32_t* context_lens, int B, int max_blocks, int H,
                                      int hkv, int hd, int bs, float scale, int window,
                                      float softcap, const float* sinks, int threads) {
  if (H % hkv || hd > MAX_HD || hd % 16) return 1;
  DISPATCH_CACHE(dtype, decode_any<T>(out, q, (const T*)k_cache, (const T*)v_cache,
                                      block_tables, context_lens, B, max_blocks, H, hkv, hd, bs,
                                      scale, window, softcap, sinks, threads));
  return 0;
}
