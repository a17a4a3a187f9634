// Every layer of a decode step (or a step of short runs: speculative verifies, short prompts)
// in one call: the same kernels, in the same order, on the same arrays as the Python loop of
// CpuBackend._run_layers (norm, QKV product, rotary + cache write, decode attention, O
// product, add + norm, gate/up product, SiLU-and-mul, down product), without a Python round
// trip and a ctypes call per kernel (about 100 us a layer at batch 1). The arithmetic is the
// kernels': the hidden states come out with the same bits. With LoRA rows, each product adds
// their adapters' updates (lora_add) as the loop does. A layer of experts (no shared expert,
// no biases) routes here (experts_step) and runs moe_experts as the loop does; the routing's
// float32 sums and exp are this file's, not NumPy's, so its weights may differ in the last bit.
// Gemma 2 and 3: the sandwich norms, the attention's soft-capping, Gemma 3's local RoPE on its
// sliding layers, and the GELU MLP (act_and_mul_rows: the tanh form's tanh is the C library's,
// not NumPy's, so it too may differ in the last bit).
// Threads: each kernel's own.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"
#include "matrix.h"

extern "C" {
void fused_add_rms_norm(float* out, const float* x, float* residual, const float* weight,
                        float eps, int n_rows, int D, int threads);
void silu_and_mul(float* out, const float* gate_up, int n_rows, int F, int threads);
void matmul_f32(float* out, const float* x, const float* w, long M, long K, long N, int threads);
void matmul_panels_f32(float* out, const float* x, const float* w, long M, long K, long N,
                       int threads);
void matmul_panels_int8(float* out, const float* x, const int8_t* w, const float* scale, long M,
                        long K, long N, int threads);
void matmul_panels_bf16(float* out, const float* x, const uint16_t* w, long M, long K, long N,
                        int threads);
void matmul_bf16(float* out, const float* x, const uint16_t* w, long M, long K, long N,
                 int threads);
void matmul_int8(float* out, const float* x, const int8_t* w, const float* scale, long M, long K,
                 long N, int threads);
int matmul_blocks(float* out, const float* x, const uint8_t* w, const f16* scales,
                  int format, long M, long K, long N, int threads);
int matmul_kquants(float* out, const float* x, const uint8_t* w, int format, long M, long K,
                   long N, int threads);
int matmul_q5(float* out, const float* x, const uint8_t* w, int format, long M, long K, long N,
              int threads);
int matmul_fp8(float* out, const float* x, const uint8_t* w, const float* scales, long nbk,
               long M, long K, long N, int threads);
int matmul_mxfp4(float* out, const float* x, const uint8_t* w, long M, long K, long N,
                 int threads);
int matmul_iq4(float* out, const float* x, const uint8_t* w, int format, long M, long K, long N,
               int threads);
int rotary_cache(float* q_out, void* k_cache, void* v_cache, int dtype, const float* qkv,
                 const float* bias, const float* cos, const float* sin, const int32_t* slots,
                 const float* q_norm, const float* k_norm, float eps, int n_tok, int H, int hkv,
                 int hd, int threads);
int act_and_mul_rows(float* out, const float* gate_up, long T, long F, int act_kind);
int moe_experts(float* out, const float* h, long T, long D, long F, int E, const Matrix* gate_up,
                const Matrix* down, const int64_t* offsets, const int32_t* tokens,
                const float* weights, int act_kind, const float* gu_bias, const float* dn_bias,
                float alpha, float limit, int threads);
int paged_attention_decode(float* out, const float* q, const void* k_cache, const void* v_cache,
                           int dtype, const int32_t* block_tables, const int32_t* context_lens,
                           int B, int max_blocks, int H, int hkv, int hd, int bs, float scale,
                           int window, float softcap, const float* sinks, int threads);
}

namespace {

// One layer's pointers (engine/backends/cpu_backend.py, LayerPointers: the same fields).
// A layer of experts (engine/backends/cpu_experts.py): the router (D, E) float32 and each
// expert's matrices, as moe_experts takes them; `chosen` (E,) counts the rows routed to each.
struct Experts {
  const float* router;       // (D, E)
  const Matrix* gate_up;     // (E,) each (D, 2F)
  const Matrix* down;        // (E,) each (F, D)
  int64_t* chosen;           // (E,)
  int32_t E, top_k, F, renormalize, act;
  float alpha, limit;
};

struct Layer {
  const float* attn_norm;  // (D,)
  const float* mlp_norm;   // (D,)
  const float* b_qkv;      // (qkv,) or NULL
  const float* q_norm;     // (hd,) or NULL, with k_norm
  const float* k_norm;
  void* k_cache;  // (N, bs, Hkv, hd) of the cache dtype
  void* v_cache;
  int64_t window;  // 0: none
  int64_t group;   // its KV group: 0 the step's slots and block_tables, g > 0 the group's
  Matrix qkv, o, gate_up, down;  // gate_up and down unused in a layer of experts
  const Experts* experts;        // NULL: the dense MLP
  const float* post_attn_norm;   // (D,) or NULL: the attention's output normed (Gemma 2, 3)
  const float* post_mlp_norm;    // (D,) or NULL: the MLP's
  int64_t local_rope;            // 1: the step's local cos/sin (Gemma 3's sliding layers)
};

// LoRA (engine/backends/cpu_backend.py, the _Lora* structures). One module's B: the adapter's
// rows take columns r0..r1 of t = x @ A through b (r1 - r0, n) float32, row-major, into output
// columns c0..c0 + n.
struct LoraPart {
  int32_t r0, r1, c0, n;
  const float* b;
};

// One adapter (its slot) on one matrix: a (K, R), its modules' A side by side, packed as the
// weights are, and its modules' B.
struct LoraAdapter {
  Matrix a;
  int32_t slot, R, n_parts, pad;
  const LoraPart* parts;
};

// The step's adapters that change one matrix (n may be 0).
struct LoraMatrix {
  int32_t n, pad;
  const LoraAdapter* adapters;
};

struct LoraLayer {
  LoraMatrix qkv, o, gate_up, down;
};

// A step's sizes and arrays (engine/backends/cpu_backend.py, StepArgs).
struct Step {
  int32_t T, D, H, hkv, hd, F, bs, max_blocks, cache_dtype, threads;
  float eps, scale;
  float* x;         // (T, D): in, the embeddings; out, the last layer's output
  float* residual;  // (T, D): out, the residual stream
  float* h;         // (T, D) scratch: normed hidden states
  float* qkv;       // (T, (H + 2 Hkv) hd)
  float* q;         // (T, H, hd)
  float* attn;      // (T, H, hd)
  float* gate_up;   // (T, 2F)
  float* act_out;   // (T, F)
  const float* cos;  // (T, hd)
  const float* sin;
  const int32_t* slots;         // (T,)
  const int32_t* block_tables;  // (T, max_blocks)
  const int32_t* context_lens;  // (T,)
  const LoraLayer* lora;        // (n_layers,) or NULL: no row runs an adapter
  const int32_t* lora_slots;    // (T,) each row's adapter slot, -1 the base model
  float* lora_x;                // (T, the widest K) scratch: an adapter's rows of x
  float* lora_t;                // (T, the widest R) scratch: their x @ A
  int32_t* lora_rows;           // (T,) scratch: an adapter's rows
  const int32_t* const* group_slots;   // (G - 1,) each later KV group's (T,) slots, or NULL
  const int32_t* const* group_tables;  // (G - 1,) each later KV group's (T, max_blocks)
  const float* cos_local;  // (T, hd) Gemma 3's sliding layers' RoPE, or NULL
  const float* sin_local;
  float* branch;  // (T, D) scratch: a branch's output before its norm (sandwich norms)
  float softcap;  // > 0: attention scores soft-capped (Gemma 2)
  int32_t act;    // the MLP's activation: 0 SiLU, 1 GELU (tanh), 2 GELU (erf)
};

int matmul(float* out, const float* x, const Matrix& w, long M, long K, long N, int threads);

// out (M, N) = x @ the parts' columns side by side: each part's product into its own (M, n)
// scratch, then into its columns.
int matmul_parts(float* out, const float* x, const Matrix& w, long M, long K, long N,
                 int threads) {
  const Matrix* parts = (const Matrix*)w.data;
  const int64_t* widths = (const int64_t*)w.scales;
  std::vector<float> tmp;
  long c0 = 0;
  for (int i = 0; i < w.pad; i++) {
    const long n = widths[i];
    tmp.resize(M * n);
    if (matmul(tmp.data(), x, parts[i], M, K, n, threads)) return 1;
    for (long m = 0; m < M; m++) std::memcpy(out + m * N + c0, tmp.data() + m * n, n * 4);
    c0 += n;
  }
  return c0 == N ? 0 : 1;
}

int matmul(float* out, const float* x, const Matrix& w, long M, long K, long N, int threads) {
  const int8_t* q = (const int8_t*)w.data;
  const uint8_t* raw = (const uint8_t*)w.data;
  if (kquant_format(w.kind) >= 0)
    return matmul_kquants(out, x, raw, kquant_format(w.kind), M, K, N, threads);
  if (w.kind >= W_RAW + 3 && w.kind < W_PARTS)
    return matmul_q5(out, x, raw, w.kind - W_RAW - 3, M, K, N, threads);
  if (w.kind == W_PARTS) return matmul_parts(out, x, w, M, K, N, threads);
  if (w.kind == W_Q4Z)
    return matmul_blocks(out, x, raw, (const f16*)w.scales, 3, M, K, N, threads);
  if (w.kind == W_FP8)
    return matmul_fp8(out, x, raw, (const float*)w.scales, w.pad, M, K, N, threads);
  if (w.kind == W_MXFP4) return matmul_mxfp4(out, x, raw, M, K, N, threads);
  if (w.kind == W_IQ4_NL || w.kind == W_IQ4_XS)
    return matmul_iq4(out, x, raw, w.kind - W_IQ4_NL, M, K, N, threads);
  switch (w.kind) {
    case W_BF16: matmul_bf16(out, x, (const uint16_t*)w.data, M, K, N, threads); break;
    case W_INT8: matmul_int8(out, x, q, (const float*)w.scales, M, K, N, threads); break;
    case W_F32: matmul_f32(out, x, (const float*)w.data, M, K, N, threads); break;
    case W_PANELS: matmul_panels_f32(out, x, (const float*)w.data, M, K, N, threads); break;
    case W_INT8_PANELS:
      matmul_panels_int8(out, x, q, (const float*)w.scales, M, K, N, threads);
      break;
    case W_BF16_PANELS:
      matmul_panels_bf16(out, x, (const uint16_t*)w.data, M, K, N, threads);
      break;
    default:
      return matmul_blocks(out, x, (const uint8_t*)w.data, (const f16*)w.scales,
                           w.kind - W_BLOCKS, M, K, N, threads);
  }
  return 0;
}

}  // namespace

// y (T, N) += each LoRA row's update: for each adapter of m, its rows (slots[i] == its slot)
// gathered into xs (all of x when every row is its), ts = xs @ A (the packed product), then each
// module's B adds t's columns r0..r1 into the rows' output columns c0.., one rank at a time in
// float32 (the segmented products of Punica and S-LoRA, an adapter's rows together). Rows of
// no adapter (the base model's, slot -1) are not touched. The cpu backend's layer loop and
// decode_layers both come here, so their bits agree. Returns 0, or the product's status.
extern "C" int lora_add(float* y, const float* x, const LoraMatrix* m, const int32_t* slots,
                        float* xs, float* ts, int32_t* rows, long T, long K, long N, int threads) {
  for (int a = 0; a < m->n; a++) {
    const LoraAdapter& ad = m->adapters[a];
    long n = 0;
    for (long i = 0; i < T; i++)
      if (slots[i] == ad.slot) rows[n++] = (int32_t)i;
    if (n == 0) continue;
    const float* src = x;
    if (n < T) {
      for (long r = 0; r < n; r++) std::memcpy(xs + r * K, x + rows[r] * K, sizeof(float) * K);
      src = xs;
    }
    const int status = matmul(ts, src, ad.a, n, K, ad.R, threads);
    if (status) return status;
    long work = 0;
    for (int p = 0; p < ad.n_parts; p++) work += (long)(ad.parts[p].r1 - ad.parts[p].r0) * ad.parts[p].n;
#pragma omp parallel for schedule(static) num_threads(threads_for(n * work * 2, threads))
    for (long r = 0; r < n; r++) {
      for (int p = 0; p < ad.n_parts; p++) {
        const LoraPart& part = ad.parts[p];
        float* out = y + rows[r] * N + part.c0;
        const float* t = ts + r * ad.R + part.r0;
        for (int j = 0; j < part.r1 - part.r0; j++) {
          const float v = t[j];
          const float* b = part.b + (long)j * part.n;
#pragma omp simd
          for (int c = 0; c < part.n; c++) out[c] += v * b[c];
        }
      }
    }
  }
  return 0;
}

namespace {

// out (T, N) = x @ w, then each LoRA row's update when the step has any.
int product(float* out, const float* x, const Matrix& w, const LoraMatrix* lora, const Step* s,
            long K, long N) {
  const int status = matmul(out, x, w, s->T, K, N, s->threads);
  if (status || lora == nullptr || lora->n == 0) return status;
  return lora_add(out, x, lora, s->lora_slots, s->lora_x, s->lora_t, s->lora_rows, s->T, K, N,
                  s->threads);
}

}  // namespace

// Seconds a call of out (M, N) = x (M, K) @ w takes, the mean of `reps` calls after one to
// warm up: the products timed as a native decode step runs them, without a ctypes call each
// (engine/backends/cpu_tuning.py). Returns a negative time for a shape the kernel refuses.
extern "C" double matmul_seconds(float* out, const float* x, const Matrix* w, long M, long K,
                                 long N, int reps, int threads) {
  if (matmul(out, x, *w, M, K, N, threads)) return -1.0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; i++) matmul(out, x, *w, M, K, N, threads);
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - t0;
  return took.count() / reps;
}

// x (T, D) embeddings of T tokens through every layer, each token's attention a decode over
// its own row of block_tables and context_lens (a decoding sequence's token, or one of a
// sequence's short run: its sequence's table and its position + 1; rotary_cache writes every
// token's K and V before the attention reads them): x becomes the last layer's output and
// residual the residual stream (the head adds them). Returns 0, or the failing kernel's status.
// out (T, D) = each row of h's top k experts, as engine/backends/moe.py routes them: logits
// h . router in float32, softmax, the k largest (equal ones: the lower expert), renormalized
// where the family says; the (T*k) pairs grouped by expert in token order (a counting sort),
// then moe_experts.
int experts_step(float* out, const float* h, const Experts& ex, long T, long D, int threads) {
  const int E = ex.E, k = ex.top_k;
  std::vector<float> p(E), w(T * k);
  std::vector<int32_t> ids(T * k), tokens(T * k);
  std::vector<int64_t> offsets(E + 1, 0);
  float* __restrict__ logits = p.data();
  for (long t = 0; t < T; t++) {
    const float* x = h + t * D;
    for (int e = 0; e < E; e++) logits[e] = 0.0f;
    for (long d = 0; d < D; d++) {  // (1, D) @ (D, E): the router's rows in order, E wide
      const float xd = x[d];
      const float* __restrict__ r = ex.router + d * E;
      for (int e = 0; e < E; e++) logits[e] += xd * r[e];
    }
    float m = p[0], sum = 0.0f, picked = 0.0f;
    for (int e = 1; e < E; e++) m = p[e] > m ? p[e] : m;
    for (int e = 0; e < E; e++) sum += (p[e] = std::exp(p[e] - m));
    for (int e = 0; e < E; e++) p[e] /= sum;
    for (int j = 0; j < k; j++) {
      int best = -1;
      for (int e = 0; e < E; e++)
        if (p[e] >= 0.0f && (best < 0 || p[e] > p[best])) best = e;
      ids[t * k + j] = best;
      picked += (w[t * k + j] = p[best]);
      p[best] = -1.0f;
      offsets[best + 1]++;
    }
    if (ex.renormalize)
      for (int j = 0; j < k; j++) w[t * k + j] /= picked;
  }
  for (int e = 0; e < E; e++) {
    ex.chosen[e] += offsets[e + 1];
    offsets[e + 1] += offsets[e];
  }
  std::vector<int64_t> next(offsets.begin(), offsets.end() - 1);
  std::vector<float> pair_w(T * k);
  for (long i = 0; i < T * k; i++) {  // pair t*k + j in order: stable within an expert
    const int64_t at = next[ids[i]]++;
    tokens[at] = (int32_t)(i / k);
    pair_w[at] = w[i];
  }
  std::memset(out, 0, sizeof(float) * T * D);
  return moe_experts(out, h, T, D, ex.F, E, ex.gate_up, ex.down, offsets.data(), tokens.data(),
                     pair_w.data(), ex.act, nullptr, nullptr, ex.alpha, ex.limit, threads);
}

extern "C" int decode_layers(const Layer* layers, int n_layers, const Step* s) {
  const int T = s->T, D = s->D, nt = s->threads;
  const long q_dim = (long)s->H * s->hd, qkv_dim = q_dim + 2L * s->hkv * s->hd;
  std::memcpy(s->residual, s->x, sizeof(float) * T * D);
  for (int i = 0; i < n_layers; i++) {
    const Layer& L = layers[i];
    const LoraLayer* A = s->lora ? s->lora + i : nullptr;
    const int32_t* slots = L.group ? s->group_slots[L.group - 1] : s->slots;  // its KV group's
    const int32_t* tables = L.group ? s->group_tables[L.group - 1] : s->block_tables;
    if (i == 0)  // residual = x; h = rms_norm(x)
      fused_add_rms_norm(s->h, s->residual, nullptr, L.attn_norm, s->eps, T, D, nt);
    else  // residual += x; h = rms_norm(residual)
      fused_add_rms_norm(s->h, s->x, s->residual, L.attn_norm, s->eps, T, D, nt);
    int status = product(s->qkv, s->h, L.qkv, A ? &A->qkv : nullptr, s, D, qkv_dim);
    const bool local = L.local_rope && s->cos_local;
    status = status ? status
                    : rotary_cache(s->q, L.k_cache, L.v_cache, s->cache_dtype, s->qkv, L.b_qkv,
                                   local ? s->cos_local : s->cos, local ? s->sin_local : s->sin,
                                   slots, L.q_norm, L.k_norm, s->eps, T, s->H, s->hkv, s->hd,
                                   nt);
    status = status ? status
                    : paged_attention_decode(s->attn, s->q, L.k_cache, L.v_cache,
                                             s->cache_dtype, tables, s->context_lens,
                                             T, s->max_blocks, s->H, s->hkv, s->hd, s->bs,
                                             s->scale, (int)L.window, s->softcap, nullptr, nt);
    float* out = L.post_attn_norm ? s->branch : s->x;  // sandwich: the output, then its norm
    status = status ? status : product(out, s->attn, L.o, A ? &A->o : nullptr, s, q_dim, D);
    if (status) return status;
    if (L.post_attn_norm)
      fused_add_rms_norm(s->x, s->branch, nullptr, L.post_attn_norm, s->eps, T, D, nt);
    fused_add_rms_norm(s->h, s->x, s->residual, L.mlp_norm, s->eps, T, D, nt);
    out = L.post_mlp_norm ? s->branch : s->x;
    if (L.experts) {  // a layer of experts in place of the MLP
      status = experts_step(out, s->h, *L.experts, T, D, nt);
    } else {
      status = product(s->gate_up, s->h, L.gate_up, A ? &A->gate_up : nullptr, s, D, 2L * s->F);
      if (status) return status;
      if (s->act == 0)
        silu_and_mul(s->act_out, s->gate_up, T, s->F, nt);
      else
        status = act_and_mul_rows(s->act_out, s->gate_up, T, s->F, s->act);
      status = status ? status
                      : product(out, s->act_out, L.down, A ? &A->down : nullptr, s, s->F, D);
    }
    if (status) return status;
    if (L.post_mlp_norm)
      fused_add_rms_norm(s->x, s->branch, nullptr, L.post_mlp_norm, s->eps, T, D, nt);
  }
  return 0;
}

// out (M, N) = x (M, K) @ w, any kind (cpu_ops.matmul's way to the GGUF kinds and parts).
// Returns nonzero for a shape its kernel refuses.
extern "C" int matmul_matrix(float* out, const float* x, const Matrix* w, long M, long K, long N,
                             int threads) {
  return matmul(out, x, *w, M, K, N, threads);
}
