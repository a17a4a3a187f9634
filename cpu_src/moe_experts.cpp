// The experts of a mixture-of-experts layer in one call (engine/backends/moe.py's loop over
// the chosen experts, without a Python round trip and three ctypes calls per expert): for each
// expert with rows, its tokens' rows of h, the gate|up product, act(gate) * up, the down
// product, scaled by each pair's routing weight and added into its token's row, the experts in
// increasing order (the loop's order: the sums come out with its bits).
// The products are the kernels' own (matmul_kquants.cpp, matmul_blocks.cpp's integer dots, the
// panels, the rest through matmul_matrix). For the k-quants and the 32-value blocks each row of
// h is quantized once for every expert it goes to, each activation row once; an expert of more
// rows than their integer dots take (the k-quants' kquants_dot_rows: 63 with VNNI, else 128;
// 64 for the blocks) runs the whole kernel on all threads, as the loop does.
// Threads: one parallel region for the layer. Each product's columns (its stored rows) are cut
// into one run per thread, and every thread does its run of every expert, so the threads share
// each expert whatever its rows; a kind whose columns are not contiguous (plain float32, bf16,
// int8, FP8, parts) goes whole, expert i on thread i mod threads.
#include <omp.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "blas.h"
#include "common.h"
#include "matrix.h"

extern "C" {
int matmul_matrix(float* out, const float* x, const Matrix* w, long M, long K, long N,
                  int threads);
void silu_and_mul(float* out, const float* gate_up, int n_rows, int F, int threads);
void kquants_quantize(int8_t* qx, float* dx, int16_t* bs, const float* x, long M, long K);
long kquants_dot_rows();
int kquants_cols(float* out, long ldo, const int8_t* qx, const float* dx, const int16_t* bs,
                 const uint8_t* w, int format, long M, long K, long n0, long n1);
void blocks_quantize(int8_t* qx, int32_t* xc, float* dx, float* sx, const float* x, int format,
                     long M, long K);
int blocks_cols(float* out, long ldo, const int8_t* qx, const int32_t* xc, const float* dx,
                const float* sx, const uint8_t* w, const f16* scales, int format, long M, long K,
                long n0, long n1);
}

namespace {

enum { ACT_SILU = 0, ACT_GELU_TANH = 1, ACT_GELU = 2, ACT_SWIGLU_CLAMP = 3 };

// The activation: its kind, and the clamped SwiGLU's (gpt-oss) alpha and limit.
struct Act {
  int kind;
  float alpha, limit;
};

// Activation values (pairs x F) up to which every thread computes all of them, rather than
// waiting at a barrier for its share.
const long OWN_ACT = 1L << 15;

// n values of scratch, left uninitialized (every value is written before it is read): the
// step's buffers run to tens of MB in a prefill, where zero-filling them cost as much as a
// product.
template <class T> struct Buf {
  std::unique_ptr<T[]> p;
  explicit Buf(long n = 0) : p(new T[n]) {}
  T& operator[](long i) const { return p[i]; }
  T* data() const { return p.get(); }
};

// How a product's columns are cut: from x quantized once per row (KQ: the k-quants Q2_K to
// Q6_K, BLK: the 32-value blocks), as a column range of the stored matrix through its kind's
// kernel on one thread (SLICE: the panels, Q5_0/Q5_1, MXFP4, IQ4_NL/IQ4_XS), or not at all
// (WHOLE).
enum Way { KQ, BLK, SLICE, WHOLE };

Way way_of(int kind) {
  if (kquant_format(kind) >= 0) return KQ;
  if ((kind >= W_BLOCKS && kind < W_BLOCKS + 3) || kind == W_Q4Z) return BLK;
  if (kind == W_PANELS || kind == W_BF16_PANELS || kind == W_INT8_PANELS) return SLICE;
  if (kind == W_MXFP4 || kind == W_IQ4_NL || kind == W_IQ4_XS) return SLICE;
  return kind >= W_RAW + 3 && kind < W_PARTS ? SLICE : WHOLE;
}

// x's rows as one product's integer dots take them (KQ: Q8_K; BLK: blocks of 32), row r's
// pieces at r times each one's length.
struct Quantized {
  Way way = WHOLE;
  int fmt = 0;
  long K = 0, nd = 0, nb = 0, nc = 0;  // a row's dx (and sx), bs, xc
  Buf<int8_t> qx;
  Buf<float> dx, sx;
  Buf<int16_t> bs;
  Buf<int32_t> xc;

  Quantized(const Matrix& w, long rows, long k) : way(way_of(w.kind)), K(k) {
    if (way == KQ) {
      fmt = kquant_format(w.kind), nd = K / 256, nb = K / 16;
    } else if (way == BLK) {
      fmt = w.kind == W_Q4Z ? 3 : w.kind - W_BLOCKS, nd = K / 32, nc = K / 64 * 8;
    } else {
      return;
    }
    qx = Buf<int8_t>(rows * K), dx = Buf<float>(rows * nd), sx = Buf<float>(rows * nd);
    bs = Buf<int16_t>(rows * nb), xc = Buf<int32_t>(rows * nc);
  }
  bool used() const { return way == KQ || way == BLK; }

  void quantize(long r, const float* x) {  // row r from x (K,)
    if (way == KQ) kquants_quantize(&qx[r * K], &dx[r * nd], &bs[r * nb], x, 1, K);
    if (way == BLK) blocks_quantize(&qx[r * K], &xc[r * nc], &dx[r * nd], &sx[r * nd], x, fmt, 1, K);
  }
  void copy_row(long r, const Quantized& src, long s) {  // row r = src's row s
    std::memcpy(&qx[r * K], &src.qx[s * K], K);
    std::memcpy(&dx[r * nd], &src.dx[s * nd], 4 * nd);
    std::memcpy(&sx[r * nd], &src.sx[s * nd], 4 * nd);
    std::memcpy(&bs[r * nb], &src.bs[s * nb], 2 * nb);
    std::memcpy(&xc[r * nc], &src.xc[s * nc], 4 * nc);
  }
  // out[m * N + n] for n in n0..n1 and the M rows from row lo, with W's integer dots
  int cols(float* out, long N, const Matrix& w, long lo, long M, long n0, long n1) const {
    const uint8_t* q = (const uint8_t*)w.data;
    if (way == KQ)
      return kquants_cols(out, N, &qx[lo * K], &dx[lo * nd], &bs[lo * nb], q, fmt, M, K, n0, n1);
    return blocks_cols(out, N, &qx[lo * K], &xc[lo * nc], &dx[lo * nd], &sx[lo * nd], q,
                       (const f16*)w.scales, fmt, M, K, n0, n1);
  }
  long max_rows() const { return way == KQ ? kquants_dot_rows() : way == BLK ? 64 : 1L << 40; }
};

// Columns n0..n1 of a panels, Q5, MXFP4 or IQ4 matrix (K, N) as a matrix of its own (n0 a
// multiple of 16).
Matrix columns(const Matrix& w, long K, long n0) {
  Matrix s = w;
  if (w.kind == W_PANELS) s.data = (const float*)w.data + n0 * K;
  if (w.kind == W_BF16_PANELS) s.data = (const uint16_t*)w.data + n0 * K;
  if (w.kind == W_INT8_PANELS) {
    s.data = (const int8_t*)w.data + n0 * K;
    s.scales = (const float*)w.scales + n0;
  }
  if (w.kind == W_RAW + 3 || w.kind == W_RAW + 4)  // Q5_0 22 bytes, Q5_1 24 a block of 32
    s.data = (const uint8_t*)w.data + n0 * (K / 32) * (w.kind == W_RAW + 3 ? 22 : 24);
  if (w.kind == W_MXFP4)  // 17 bytes a block of 32
    s.data = (const uint8_t*)w.data + n0 * (K / 32) * 17;
  if (w.kind == W_IQ4_NL)  // 18 bytes a block of 32
    s.data = (const uint8_t*)w.data + n0 * (K / 32) * 18;
  if (w.kind == W_IQ4_XS)  // 136 bytes a block of 256
    s.data = (const uint8_t*)w.data + n0 * (K / 256) * 136;
  return s;
}

// One product of the step: x (P, K) float32 and quantized, out (P, N), the experts' matrices.
struct Product {
  const Matrix* w;  // (E,)
  const float* x;
  const Quantized* q;
  float* out;
  long K, N;
  const float* bias;  // (E, N) each expert's bias (gpt-oss), or null
};

// Rows lo..lo + M, columns n0..n1 of a product's out += expert e's bias.
void add_bias(const Product& p, int e, long lo, long M, long n0, long n1) {
  if (!p.bias) return;
  const float* b = p.bias + (long)e * p.N;
  for (long m = 0; m < M; m++)
    for (long n = n0; n < n1; n++) p.out[(lo + m) * p.N + n] += b[n];
}

// Thread t's run of nt of a product's N columns (whole panels: multiples of 16).
void run(long N, int t, int nt, long& n0, long& n1) {
  const long per = ((N + nt - 1) / nt + 15) / 16 * 16;
  n0 = std::min(N, t * per), n1 = std::min(N, n0 + per);
}

// Thread t's share of expert e's product over its rows lo..lo + M: its run of the columns, or
// the whole product if the kind has no runs and e is t's; the expert's bias added, then each
// row times scale[row] if given. Returns a kernel's status.
int share(const Product& p, int e, long lo, long M, int t, int nt, std::vector<float>& tmp,
          const float* scale = nullptr) {
  const Matrix& w = p.w[e];
  const Way way = way_of(w.kind);
  long n0 = 0, n1 = p.N;
  int status = 0;
  if (way == WHOLE) {
    if (e % nt != t) return 0;
    status = matmul_matrix(p.out + lo * p.N, p.x + lo * p.K, &w, M, p.K, p.N, 1);
  } else {
    run(p.N, t, nt, n0, n1);
    if (n0 == n1) return 0;
    if (way != SLICE) {
      status = p.q->cols(p.out + lo * p.N, p.N, w, lo, M, n0, n1);
    } else {
      const Matrix part = columns(w, p.K, n0);
      tmp.resize(M * (n1 - n0));
      status = matmul_matrix(tmp.data(), p.x + lo * p.K, &part, M, p.K, n1 - n0, 1);
      for (long m = 0; m < M; m++)
        std::memcpy(p.out + (lo + m) * p.N + n0, &tmp[m * (n1 - n0)], 4 * (n1 - n0));
    }
  }
  add_bias(p, e, lo, M, n0, n1);
  for (long m = 0; scale && m < M; m++)
    for (long n = n0; n < n1; n++) p.out[(lo + m) * p.N + n] *= scale[lo + m];
  return status;
}

// out[tokens[i], n0:n1] += y[i, n0:n1] for the pairs in order (the loop's additions).
void scatter(float* out, const float* y, const int32_t* tokens, long P, long D, long n0,
             long n1) {
  for (long i = 0; i < P; i++) {
    float* o = out + (long)tokens[i] * D;
    for (long c = n0; c < n1; c++) o[c] += y[i * D + c];
  }
}

// Each pair's row of h where a product takes x as float32 (xs (P, D): the big experts', every
// pair's for a kind without integer dots); for one with them, each row of h quantized once (qh)
// and copied to each of its pairs (qg). On nt threads.
void gather(const Buf<float>& xs, Quantized& qh, Quantized& qg, const float* h, long T, long D,
            long P, const int32_t* tokens, const std::vector<char>& big, int nt) {
#pragma omp parallel num_threads(nt)
  {
#pragma omp for schedule(static)
    for (long i = 0; i < P; i++)
      if (big[i] || !qg.used()) std::memcpy(&xs[i * D], h + (long)tokens[i] * D, 4 * D);
    if (qh.used()) {
#pragma omp for schedule(static)
      for (long r = 0; r < T; r++) qh.quantize(r, h + r * D);
#pragma omp for schedule(static)
      for (long i = 0; i < P; i++) qg.copy_row(i, qh, tokens[i]);
    }
  }
}

// The GELUs of one float32 value as fast_ops computes them (reference/model.py): erf in
// float64 of the float64 x / sqrt 2, the rest float32; the tanh form all in float32. No fused
// multiply-adds (NumPy rounds each operation).
__attribute__((optimize("fp-contract=off"))) float gelu(float x, int act) {
  if (act == ACT_GELU)
    return 0.5f * x * (1.0f + (float)std::erf((double)x / std::sqrt(2.0)));
  const float c = (float)std::sqrt(2.0 / M_PI);
  return 0.5f * x * (1.0f + std::tanh(c * (x + 0.044715f * x * x * x)));
}

// gpt-oss's clamped SwiGLU of one gate and up value as engine/backends/moe.py computes it:
// gate <= limit, -limit <= up <= limit, (up + 1) * (gate / (1 + e^(-alpha gate))), float32.
__attribute__((optimize("fp-contract=off"))) float swiglu_clamp(float g, float u, const Act& act) {
  g = std::min(g, act.limit), u = std::min(std::max(u, -act.limit), act.limit);
  return (u + 1.0f) * (g / (1.0f + std::exp(-act.alpha * g)));
}

// a (F,) = act(gate) * up of one row gu (2F,): SiLU through silu_and_mul (the loop's kernel),
// the GELUs as fast_ops computes them, the clamped SwiGLU as moe.py does.
void act_row(float* a, const float* gu, long F, const Act& act) {
  if (act.kind == ACT_SILU) return silu_and_mul(a, gu, 1, (int)F, 1);
  if (act.kind == ACT_SWIGLU_CLAMP) {
    for (long f = 0; f < F; f++) a[f] = swiglu_clamp(gu[f], gu[F + f], act);
    return;
  }
  for (long f = 0; f < F; f++) a[f] = gelu(gu[f], act.kind) * gu[F + f];
}

// act_row into a, then a quantized as row r of q (when its kind takes x so).
void act_and_quantize(float* a, Quantized& q, long r, const float* gu, long F, const Act& act) {
  act_row(a, gu, F, act);
  if (q.used()) q.quantize(r, a);
}

}  // namespace

// out (T, F) = act(gate) * up of each row of gate_up (T, 2F), act 0 SiLU, 1 GELU (tanh), 2 GELU
// (erf), as act_row computes them (decode_layers.cpp's MLP of a GELU model). Returns 1 for an
// activation it does not know.
extern "C" int act_and_mul_rows(float* out, const float* gate_up, long T, long F, int act_kind) {
  if (act_kind < ACT_SILU || act_kind > ACT_GELU) return 1;
  const Act act{act_kind, 0.0f, 0.0f};
  for (long t = 0; t < T; t++) act_row(out + t * F, gate_up + t * 2 * F, F, act);
  return 0;
}

// out (T, D) += the experts' outputs for h (T, D) normed: the P = T * k (token, expert) pairs
// sorted by expert (stable), expert e's pairs offsets[e]..offsets[e + 1] (offsets (E + 1,)),
// tokens (P,) each pair's row of h, weights (P,) its routing weight; gate_up (E,) matrices
// (D, 2F), down (E,) matrices (F, D); act 0 SiLU, 1 GELU (tanh), 2 GELU (erf), 3 gpt-oss's
// clamped SwiGLU with alpha and limit; gu_bias (E, 2F) and dn_bias (E, D) each expert's
// product biases (gpt-oss), or null. Returns 0, 1 for an activation it does not know, or a
// kernel's status (its shape refused).
extern "C" int moe_experts(float* out, const float* h, long T, long D, long F, int E,
                           const Matrix* gate_up, const Matrix* down, const int64_t* offsets,
                           const int32_t* tokens, const float* weights, int act_kind,
                           const float* gu_bias, const float* dn_bias, float alpha, float limit,
                           int threads) {
  if (act_kind < ACT_SILU || act_kind > ACT_SWIGLU_CLAMP) return 1;
  const Act act{act_kind, alpha, limit};
  const long P = offsets[E];
  if (P == 0) return 0;
  int first = 0;
  while (offsets[first + 1] == offsets[first]) first++;  // an expert with rows: their kinds
  Buf<float> xs(P * D), gu(P * 2 * F), a(P * F), y(P * D);
  Quantized qh(gate_up[first], T, D), qg(gate_up[first], P, D), qa(down[first], P, F);
  const Product up{gate_up, xs.data(), &qg, gu.data(), D, 2 * F, gu_bias};
  std::vector<char> big(P, 0);  // pairs of experts of more rows than the integer dots take
  for (int e = 0; e < E; e++)
    if (offsets[e + 1] - offsets[e] > std::min(qg.max_rows(), qa.max_rows()))
      std::memset(&big[offsets[e]], 1, offsets[e + 1] - offsets[e]);
  gather(xs, qh, qg, h, T, D, P, tokens, big, threads_for(P * D, threads));
  int status = 0;
  const Product big_dn{down, a.data(), &qa, y.data(), F, D, dn_bias};  // the big experts' down
  for (int e = 0; e < E; e++) {  // the big experts first: each kernel on every thread
    const long lo = offsets[e], M = offsets[e + 1] - lo;
    if (M == 0 || !big[lo]) continue;
    status |= matmul_matrix(&gu[lo * 2 * F], &xs[lo * D], &gate_up[e], M, D, 2 * F, threads);
    add_bias(up, e, lo, M, 0, 2 * F);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long i = lo; i < lo + M; i++) act_row(&a[i * F], &gu[i * 2 * F], F, act);
    status |= matmul_matrix(&y[lo * D], &a[lo * F], &down[e], M, F, D, threads);
    add_bias(big_dn, e, lo, M, 0, D);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long i = lo; i < lo + M; i++)
      for (long c = 0; c < D; c++) y[i * D + c] *= weights[i];
  }
  const int nt = threads_for(2 * P * D * F * 3, threads);
  // few activations: each thread computes all of them (no barrier), into its own rows
  const bool own_act = P * F <= OWN_ACT, whole = way_of(down[first].kind) == WHOLE;
  std::atomic<int> failed{status};
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num(), prev = set_local_threads(1);
    std::vector<float> tmp;
    Buf<float> mine(own_act ? P * F : 0);
    Quantized qmine(down[first], own_act ? P : 0, F);
    for (int e = 0; e < E; e++) {
      const long lo = offsets[e], M = offsets[e + 1] - lo;
      if (M && !big[lo]) failed |= share(up, e, lo, M, t, nt, tmp);
    }
#pragma omp barrier
    float* act_rows = own_act ? mine.data() : a.data();
    Quantized& qact = own_act ? qmine : qa;
    if (own_act) {
      for (long i = 0; i < P; i++)
        if (!big[i]) act_and_quantize(&mine[i * F], qmine, i, &gu[i * 2 * F], F, act);
    } else {
#pragma omp for schedule(static)
      for (long i = 0; i < P; i++)
        if (!big[i]) act_and_quantize(&a[i * F], qa, i, &gu[i * 2 * F], F, act);
    }
    const Product dn{down, act_rows, &qact, y.data(), F, D, dn_bias};
    for (int e = 0; e < E; e++) {
      const long lo = offsets[e], M = offsets[e + 1] - lo;
      if (M && !big[lo]) failed |= share(dn, e, lo, M, t, nt, tmp, weights);
    }
    // the sums: each thread its own columns of y (none computed by another), or, with whole
    // products, a run of the columns after they are all done
    long n0, n1;
    run(D, t, nt, n0, n1);
    if (whole) {
#pragma omp barrier
    }
    scatter(out, y.data(), tokens, P, D, n0, n1);
    set_local_threads(prev);
  }
  return failed;
}
