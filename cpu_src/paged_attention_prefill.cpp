// Paged prefill attention: causal attention for runs of query rows over paged K/V (the rows'
// own K/V already written), tiled. A run may start part-way into its sequence (chunked
// prefill, a cached prefix): its rows are the last q_len of the sequence's context.
// Threads: one task per (sequence, KV head, tile of QTILE query rows). A task holds the
// scores of its rows for all `group` query heads that share the KV head, walks its keys a
// tile of KTILE at a time (each K/V row converted once per task), scores only the keys a row
// may see (not later keys; with a window W, not keys at or before p - W; the others are -inf),
// four keys at a time, keeps an online softmax, and adds the seen keys' values 64 dims at a
// time with their sums in registers.
#include <vector>

#include "common.h"

namespace {

const int QTILE = 16;  // query rows per task
const int KTILE = 64;  // keys per tile
const int MAX_HD = 256;

// s[j] = q . k_j * scale for n keys (rows of k, hd apart), four keys at a time (four sums in
// flight, reduced together).
inline void row_scores(float* s, const float* q, const float* k, int n, float scale, int hd) {
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    const float *k0 = k + (long)j * hd, *k1 = k0 + hd, *k2 = k1 + hd, *k3 = k2 + hd;
    v8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (int d = 0; d < hd; d += 8) {
      const v8 qd = load8(q + d);
      a0 += qd * load8(k0 + d);
      a1 += qd * load8(k1 + d);
      a2 += qd * load8(k2 + d);
      a3 += qd * load8(k3 + d);
    }
    const v4 dots = hsum8x4(a0, a1, a2, a3) * scale;
    std::memcpy(s + j, &dots, sizeof dots);
  }
  for (; j < n; j++) s[j] = dot_f32(q, k + (long)j * hd, hd) * scale;
}

// a = a * corr + sum_{jlo <= j < jhi} p_j v_j (v: the tile's rows, hd apart), 64 dims at a
// time with their sums in registers.
inline void row_values(float* a, const float* p, const float* v, int jlo, int jhi, float corr,
                       int hd) {
  for (int c = 0; c < hd; c += 64) {
    const int nv = std::min(64, hd - c) / 8;
    v8 acc[8];
    for (int i = 0; i < nv; i++) acc[i] = load8(a + c + 8 * i) * corr;
    if (nv == 8) {
      for (int j = jlo; j < jhi; j++)
        for (int i = 0; i < 8; i++) acc[i] += p[j] * load8(v + (long)j * hd + c + 8 * i);
    } else {
      for (int j = jlo; j < jhi; j++)
        for (int i = 0; i < nv; i++) acc[i] += p[j] * load8(v + (long)j * hd + c + 8 * i);
    }
    for (int i = 0; i < nv; i++) store8(a + c + 8 * i, acc[i]);
  }
}

template <typename T>
void prefill_task(const float* q, const T* k_cache, const T* v_cache, const int32_t* table,
                  int p0, int nq, int bs, int H, int hkv, int hd, float scale, int window,
                  int kvh, float* out) {
  // q, out: rows p0..p0+nq-1 (positions), row r's heads at q + r*H*hd; R = nq*group rows
  const int group = H / hkv, R = nq * group;
  const long row_stride = (long)hkv * hd;
  std::vector<float> acc((size_t)R * hd, 0.0f), s((size_t)R * KTILE), kt((size_t)KTILE * hd),
      vt((size_t)KTILE * hd), m(R, -INFINITY), l(R, 0.0f);
  const int last = p0 + nq - 1;  // the last row's position: no row sees a later key
  const int first = window > 0 ? std::max(0, p0 - window + 1) : 0;
  for (int t0 = first; t0 <= last; t0 += KTILE) {
    const int nt = std::min(KTILE, last + 1 - t0);
    for (int j = 0; j < nt; j++) {  // the tile's K and V rows as float32
      const int t = t0 + j;
      const long at = ((long)table[t / bs] * bs + t % bs) * row_stride + (long)kvh * hd;
      for (int d = 0; d < hd; d++) {
        kt[(size_t)j * hd + d] = to_f32(k_cache[at + d]);
        vt[(size_t)j * hd + d] = to_f32(v_cache[at + d]);
      }
    }
    for (int i = 0; i < nq; i++) {
      const int p = p0 + i;  // this row's position: it sees keys lo_key..p
      const int lo_key = window > 0 ? p - window + 1 : 0;
      // the tile's keys this row sees: jlo..jhi-1
      const int jlo = std::min(nt, std::max(0, lo_key - t0));
      const int jhi = std::max(jlo, std::min(nt, p - t0 + 1));
      for (int g = 0; g < group; g++) {
        const int r = i * group + g;
        const float* qr = q + (long)i * H * hd + (long)(kvh * group + g) * hd;
        float* sr = s.data() + (size_t)r * KTILE;
        std::fill(sr, sr + jlo, -INFINITY);
        row_scores(sr + jlo, qr, kt.data() + (size_t)jlo * hd, jhi - jlo, scale, hd);
        std::fill(sr + jhi, sr + nt, -INFINITY);
        const float corr = softmax_tile(sr, nt, m[r], l[r]);
        if (m[r] == -INFINITY) continue;  // nothing visible to this row yet
        row_values(acc.data() + (size_t)r * hd, sr, vt.data(), jlo, jhi, corr, hd);
      }
    }
  }
  for (int i = 0; i < nq; i++) {
    for (int g = 0; g < group; g++) {
      const int r = i * group + g;
      const float inv = 1.0f / l[r];
      float* o = out + (long)i * H * hd + (long)(kvh * group + g) * hd;
      for (int d = 0; d < hd; d++) o[d] = acc[(size_t)r * hd + d] * inv;
    }
  }
}

template <typename T>
void prefill(float* out, const float* q, const T* k_cache, const T* v_cache,
             const int32_t* block_tables, const int32_t* query_start_loc,
             const int32_t* context_lens, int B, int max_blocks, int H, int hkv, int hd, int bs,
             float scale, int window, int threads) {
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
                 hkv, hd, scale, window, kvh, out + at);
  }
}

}  // namespace

// out, q: (T, H, hd) float32; k_cache, v_cache: (N, bs, Hkv, hd) of `dtype`;
// block_tables: (B, max_blocks); query_start_loc: (B + 1,); context_lens: (B,), all int32.
// Returns 0, or 1 for shapes beyond the kernel's limits.
extern "C" int paged_attention_prefill(float* out, const float* q, const void* k_cache,
                                       const void* v_cache, int dtype,
                                       const int32_t* block_tables,
                                       const int32_t* query_start_loc,
                                       const int32_t* context_lens, int B, int max_blocks, int H,
                                       int hkv, int hd, int bs, float scale, int window,
                                       int threads) {
  if (H % hkv || hd > MAX_HD || hd % 8) return 1;
  DISPATCH_CACHE(dtype, prefill<T>(out, q, (const T*)k_cache, (const T*)v_cache, block_tables,
                                   query_start_loc, context_lens, B, max_blocks, H, hkv, hd, bs,
                                   scale, window, threads));
  return 0;
}
