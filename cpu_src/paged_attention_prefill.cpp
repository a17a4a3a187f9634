// Paged prefill attention: causal attention for runs of query rows over paged K/V (the rows'
// own K/V already written), tiled. A run may start part-way into its sequence (chunked
// prefill, a cached prefix): its rows are the last q_len of the sequence's context.
// Threads: one task per (sequence, KV head, tile of QTILE query rows). A task's rows are its
// positions times the `group` query heads that share the KV head (R = QTILE x group at most),
// packed once, scaled, into a block Q (R, hd). It walks its keys a tile of KTILE at a time (each
// K/V row converted to float32 once per task, K transposed), and does the tile as two small
// matrix products in registers: the scores S = Q K^T (R, KTILE), then, after an online softmax
// of each row (the keys a row may not see, later keys and with a window W those at or before
// p - W, are -inf: weight 0; with softcap > 0 the scores first become tanh(s / softcap) *
// softcap, Gemma 2's soft-capping), O = O * corr + P V (R, hd). A product's micro-tile is MR rows x
// 16 columns whose sums stay in registers over the whole inner dimension (as the panel
// products do, matmul_panels.cpp): each step loads one row of 16 columns and broadcasts one
// value per row into it. A micro-tile of rows computes only the keys one of its rows sees.
// Head dims are padded to a multiple of 16 with zeros in the packed blocks.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "common.h"

namespace {

const int QTILE = 32;  // query positions per task (64 measured the same, with half the tasks)
const int KTILE = 64;  // keys per tile
const int CW = 16;     // columns of a micro-tile
// A score sums its dims in runs of DK, the runs' sums then added pairwise: a long dot product
// rounded as sixteen-term runs are, not as one run of hd terms (an 8-bit cache's scores reach
// thousands, and one run of 128 had three times the error)
const int DK = 16;
const int MAX_HD = 256;

// A register of float32 lanes and the rows of a micro-tile: its MR x 16 sums take most of the
// registers (AVX-512: 12 x 1 of 32; AVX2: 6 x 2 of 16; NEON: 6 x 4 of 32; SSE2: 3 x 4 of 16).
#if defined(__AVX512F__)
typedef float vf __attribute__((vector_size(64)));
const int MR = 12;
#elif defined(__AVX2__)
typedef float vf __attribute__((vector_size(32)));
const int MR = 6;
#elif defined(__aarch64__)
typedef float vf __attribute__((vector_size(16)));
const int MR = 6;
#else
typedef float vf __attribute__((vector_size(16)));
const int MR = 3;
#endif
const int LANES = sizeof(vf) / 4, NH = CW / LANES;
// the online softmax's vectors: the widest register, at least 8 lanes (softmax_tile's sums)
typedef std::conditional_t<(sizeof(vf) >= 32), vf, v8> vs;

// out[r, 0:16] = start + sum_{k < K} a[r, k] * b[k, 0:16] for r < R, where start is 0, or
// out[r, 0:16] * corr[r] where corr is given: a's rows lda apart, b's rows ldb apart, out's ldo
// apart.
template <int R>
inline void micro(float* out, long ldo, const float* a, long lda, const float* b, long ldb, int K,
                  const float* corr) {
  vf acc[R][NH];
#pragma GCC unroll 16
  for (int r = 0; r < R; r++)
#pragma GCC unroll 4
    for (int h = 0; h < NH; h++) {
      acc[r][h] = vf{};
      if (corr) {
        std::memcpy(&acc[r][h], out + r * ldo + h * LANES, sizeof(vf));
        acc[r][h] *= corr[r];
      }
    }
  for (int k = 0; k < K; k++) {
    vf bv[NH];
#pragma GCC unroll 4
    for (int h = 0; h < NH; h++) std::memcpy(&bv[h], b + k * ldb + h * LANES, sizeof(vf));
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
      const float x = a[r * lda + k];
#pragma GCC unroll 4
      for (int h = 0; h < NH; h++) acc[r][h] += x * bv[h];
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; r++)
#pragma GCC unroll 4
    for (int h = 0; h < NH; h++) std::memcpy(out + r * ldo + h * LANES, &acc[r][h], sizeof(vf));
}

// S[r, 0:16] = q[r, :] . kt[:, 0:16] for r < R over K dims (a multiple of DK): each run of DK
// dims summed in registers, the runs' sums added pairwise.
template <int R>
inline void scores(float* out, long ldo, const float* q, long ldq, const float* kt, long ldk,
                   int K) {
  vf part[MAX_HD / DK][R][NH];
  const int runs = K / DK;
  for (int u = 0; u < runs; u++)
    micro<R>(&part[u][0][0][0], NH * LANES, q + u * DK, ldq, kt + u * DK * ldk, ldk, DK, nullptr);
  for (int w = 1; w < runs; w *= 2)
    for (int u = 0; u + w < runs; u += 2 * w)
#pragma GCC unroll 16
      for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int h = 0; h < NH; h++) part[u][r][h] += part[u + w][r][h];
#pragma GCC unroll 16
  for (int r = 0; r < R; r++)
#pragma GCC unroll 4
    for (int h = 0; h < NH; h++) std::memcpy(out + r * ldo + h * LANES, &part[0][r][h], sizeof(vf));
}

// f<rows>() for a runtime rows in 1..MR.
template <typename F>
inline void with_rows(int rows, F f) {
  switch (rows) {
#define ROWS(n) \
  case n: if constexpr (n <= MR) f(std::integral_constant<int, n>{}); break;
    ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6)
    ROWS(7) ROWS(8) ROWS(9) ROWS(10) ROWS(11) ROWS(12)
#undef ROWS
  }
}

template <typename T>
void prefill_task(const float* q, const T* k_cache, const T* v_cache, const int32_t* table,
                  int p0, int nq, int bs, int H, int hkv, int hd, float scale, int window,
                  float softcap, const float* sinks, int kvh, float* out) {
  // q, out: rows p0..p0+nq-1 (positions), row i's heads at q + i*H*hd; block row r = i*group+g
  const int group = H / hkv, R = nq * group, hdp = (hd + CW - 1) / CW * CW;
  const long row_stride = (long)hkv * hd;
  std::vector<float> qb((size_t)R * hdp, 0.0f), o((size_t)R * hdp, 0.0f), s((size_t)R * KTILE),
      kt((size_t)hdp * KTILE, 0.0f), vt((size_t)KTILE * hdp, 0.0f), m(R, -INFINITY), l(R, 0.0f),
      corr(R);
  std::vector<int> lo(R), hi(R);  // each row's visible keys in the tile: lo..hi-1
  for (int r = 0; r < R; r++) {
    const float* qr = q + (long)(r / group) * H * hd + (long)(kvh * group + r % group) * hd;
    for (int d = 0; d < hd; d++) qb[(size_t)r * hdp + d] = qr[d] * scale;
  }
  const int last = p0 + nq - 1;  // the last row's position: no row sees a later key
  const int first = window > 0 ? std::max(0, p0 - window + 1) : 0;
  for (int t0 = first; t0 <= last; t0 += KTILE) {
    const int nt = std::min(KTILE, last + 1 - t0);
    for (int j = 0; j < nt; j++) {  // the tile's K (transposed) and V rows as float32
      const int t = t0 + j;
      const long at = ((long)table[t / bs] * bs + t % bs) * row_stride + (long)kvh * hd;
      for (int d = 0; d < hd; d++) {
        kt[(size_t)d * KTILE + j] = to_f32(k_cache[at + d]);
        vt[(size_t)j * hdp + d] = to_f32(v_cache[at + d]);
      }
    }
    for (int r = 0; r < R; r++) {
      const int p = p0 + r / group;  // this row's position: it sees keys lo_key..p
      const int lo_key = window > 0 ? p - window + 1 : 0;
      lo[r] = std::min(nt, std::max(0, lo_key - t0));
      hi[r] = std::max(lo[r], std::min(nt, p - t0 + 1));
    }
    for (int r0 = 0; r0 < R; r0 += MR) {  // S = Q K^T where a row of the micro-tile looks
      const int rows = std::min(MR, R - r0);
      const int jhi = *std::max_element(hi.begin() + r0, hi.begin() + r0 + rows);
      for (int j0 = 0; j0 < jhi; j0 += CW)
        with_rows(rows, [&](auto n) {
          scores<decltype(n)::value>(s.data() + (size_t)r0 * KTILE + j0, KTILE,
                                     qb.data() + (size_t)r0 * hdp, hdp, kt.data() + j0, KTILE, hdp);
        });
    }
    for (int r = 0; r < R; r++) {
      float* sr = s.data() + (size_t)r * KTILE;
      if (softcap > 0.0f)
        for (int j = lo[r]; j < hi[r]; j++) sr[j] = std::tanh(sr[j] / softcap) * softcap;
      std::fill(sr, sr + lo[r], -INFINITY);
      std::fill(sr + hi[r], sr + nt, -INFINITY);
      corr[r] = softmax_tile<vs>(sr, nt, m[r], l[r]);  // P, and the factor O is rescaled by
    }
    for (int r0 = 0; r0 < R; r0 += MR) {  // O = O * corr + P V over the micro-tile's keys
      const int rows = std::min(MR, R - r0);
      const int jlo = *std::min_element(lo.begin() + r0, lo.begin() + r0 + rows);
      const int jhi = *std::max_element(hi.begin() + r0, hi.begin() + r0 + rows);
      if (jhi <= jlo) continue;  // no row sees a key here: each corr is 1
      for (int c0 = 0; c0 < hdp; c0 += CW)
        with_rows(rows, [&](auto n) {
          micro<decltype(n)::value>(o.data() + (size_t)r0 * hdp + c0, hdp,
                                    s.data() + (size_t)r0 * KTILE + jlo, KTILE,
                                    vt.data() + (size_t)jlo * hdp + c0, hdp, jhi - jlo,
                                    corr.data() + r0);
        });
    }
  }
  for (int r = 0; r < R; r++) {
    float inv = 1.0f / l[r];
    if (sinks) {  // the head's sink logit in the sum (gpt-oss): its share dropped
      const float sink = sinks[kvh * group + r % group];
      const float top = std::max(m[r], sink), keep = std::exp(m[r] - top);
      inv = keep / (l[r] * keep + std::exp(sink - top));
    }
    float* dst = out + (long)(r / group) * H * hd + (long)(kvh * group + r % group) * hd;
    for (int d = 0; d < hd; d++) dst[d] = o[(size_t)r * hdp + d] * inv;
  }
}

template <typename T>
void prefill(float* out, const float* q, const T* k_cache, const T* v_cache,
             const int32_t* block_tables, const int32_t* query_start_loc,
             const int32_t* context_lens, int B, int max_blocks, int H, int hkv, int hd, int bs,
             float scale, int window, float softcap, const float* sinks, int threads) {
  std::vector<int> task_seq, task_row;  // (sequence, first row of the tile) per task
  long work = 0;
  for (int b = 0; b < B; b++) {
    const int lo = query_start_loc[b], hi = query_start_loc[b + 1];
    for (int r = lo; r < hi; r += QTILE) task_seq.push_back(b), task_row.push_back(r);
    work += (long)(hi - lo) * context_lens[b] * H * hd * 4;
  }
  const long n_tasks = (long)task_seq.size() * hkv;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads_for(work, threads))
  for (long task = 0; task < n_tasks; task++) {
    const int b = task_seq[task / hkv], r0 = task_row[task / hkv], kvh = (int)(task % hkv);
    const int lo = query_start_loc[b], hi = query_start_loc[b + 1];
    const int nq = std::min(QTILE, hi - r0);
    const int p0 = context_lens[b] - (hi - lo) + (r0 - lo);  // position of row r0
    const long at = (long)r0 * H * hd;
    prefill_task(q + at, k_cache, v_cache, block_tables + (long)b * max_blocks, p0, nq, bs, H,
                 hkv, hd, scale, window, softcap, sinks, kvh, out + at);
  }
}

}  // namespace

// out, q: (T, H, hd) float32; k_cache, v_cache: (N, bs, Hkv, hd) of `dtype`;
// block_tables: (B, max_blocks); query_start_loc: (B + 1,); context_lens: (B,), all int32.
// sinks: (H,) float32 sink logits (gpt-oss), or null. Returns 0, or 1 for shapes beyond the
// kernel's limits.
extern "C" int paged_attention_prefill(float* out, const float* q, const void* k_cache,
                                       const void* v_cache, int dtype,
                                       const int32_t* block_tables,
                                       const int32_t* query_start_loc,
                                       const int32_t* context_lens, int B, int max_blocks, int H,
                                       int hkv, int hd, int bs, float scale, int window,
                                       float softcap, const float* sinks, int threads) {
  if (H % hkv || hd > MAX_HD || hd % 8) return 1;
  DISPATCH_CACHE(dtype, prefill<T>(out, q, (const T*)k_cache, (const T*)v_cache, block_tables,
                                   query_start_loc, context_lens, B, max_blocks, H, hkv, hd, bs,
                                   scale, window, softcap, sinks, threads));
  return 0;
}
