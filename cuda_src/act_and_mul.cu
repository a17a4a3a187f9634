// act_and_mul.cu: out = act(gate) * up, where gate_up = [gate | up] along the last axis and act
// is the gated MLP's activation, a kernel argument (the same for the whole launch):
//   0 silu       x / (1 + exp(-x))                                   (Llama, Qwen, Mistral)
//   1 gelu_tanh  0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))     (Gemma; PyTorch's tanh gelu)
//   2 gelu       0.5 x (1 + erf(x / sqrt(2)))                         (exact)
//   3 clamped SwiGLU (gpt-oss): gate g clamped to <= limit, up u to [-limit, limit], then
//                (u + 1) * (g / (1 + exp(-alpha g)))  (alpha and limit: arguments, else unused)
// Rows split as in rms_norm.cu, in vectors of up to 16 bytes. All arithmetic float32.
#include "common.cuh"

constexpr int kSilu = 0, kGeluTanh = 1, kGelu = 2, kClampedSwiglu = 3;  // engine/kernels/launch.py ACTIVATIONS

template <int A>
struct ActivationId {
  static constexpr int value = A;
};

template <int A>
__device__ __forceinline__ float activate(float x) {
  if constexpr (A == kGeluTanh) {
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
  } else if constexpr (A == kGelu) {
    return 0.5f * x * (1.0f + erff(x * 0.7071067811865476f));
  } else {
    return x / (1.0f + expf(-x));
  }
}

// f(ActivationId<a>()): one instantiation of f per activation; an unknown id runs silu.
template <typename F>
__device__ __forceinline__ void with_activation(int a, F&& f) {
  if (a == kClampedSwiglu) return f(ActivationId<kClampedSwiglu>());
  if (a == kGeluTanh) return f(ActivationId<kGeluTanh>());
  if (a == kGelu) return f(ActivationId<kGelu>());
  f(ActivationId<kSilu>());
}

// Grid: (cdiv(T, R),)  Block: (R * row_threads,), as rms_norm
template <typename T>
__device__ __forceinline__ void act_and_mul(T* __restrict__ out,            // (T, F)
                                            const T* __restrict__ gate_up,  // (T, 2F)
                                            int rows, int width, int row_threads,
                                            int activation, float alpha, float limit) {
  const int row = blockIdx.x * (blockDim.x / row_threads) + threadIdx.x / row_threads;
  if (row >= rows) return;
  const T* gate = gate_up + size_t(row) * 2 * width;
  const T* up = gate + width;
  T* dst = out + size_t(row) * width;
  with_vec_width<T>(vec_width<T>(width, gate, up, dst), [&](auto vec) {
    constexpr int W = decltype(vec)::value;
    with_activation(activation, [&](auto act) {
      constexpr int A = decltype(act)::value;
      for (int i = threadIdx.x % row_threads; i < width / W; i += row_threads) {
        const Vec<T, W> g = load_vec<W>(gate + i * W), u = load_vec<W>(up + i * W);
        Vec<T, W> r;
#pragma unroll
        for (int e = 0; e < W; ++e) {
          if constexpr (A == kClampedSwiglu) {
            const float gate = fminf(to_float(g.v[e]), limit);
            const float up = fminf(fmaxf(to_float(u.v[e]), -limit), limit);
            r.v[e] = from_float<T>((up + 1.0f) * (gate / (1.0f + expf(-alpha * gate))));
          } else {
            r.v[e] = from_float<T>(activate<A>(to_float(g.v[e])) * to_float(u.v[e]));
          }
        }
        store_vec<W>(dst + i * W, r);
      }
    });
  });
}

DTYPE_ENTRY_POINTS(act_and_mul, 8)
