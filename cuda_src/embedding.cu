// embedding.cu: out[t] = table[token_ids[t]], one token per block; an id outside [0, V)
// writes zeros (the Python wrapper rejects such ids before launching).
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void embedding_row(T* __restrict__ out,                // (T, D)
                                              const int* __restrict__ token_ids,  // (T,)
                                              const T* __restrict__ table,        // (V, D)
                                              int vocab, int dim) {
  const int id = token_ids[blockIdx.x];
  const bool valid = id >= 0 && id < vocab;
  const T* src = table + size_t(valid ? id : 0) * dim;
  T* dst = out + size_t(blockIdx.x) * dim;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = valid ? src[i] : from_float<T>(0.f);
}

// Grid: (T,)  Block: (any, e.g. 256)
extern "C" __global__ void embedding_f32(float* __restrict__ out, const int* __restrict__ token_ids,
                                         const float* __restrict__ table, int vocab, int dim) {
  embedding_row(out, token_ids, table, vocab, dim);
}

// Grid: (T,)  Block: (any, e.g. 256)
extern "C" __global__ void embedding_f16(__half* __restrict__ out,
                                         const int* __restrict__ token_ids,
                                         const __half* __restrict__ table, int vocab, int dim) {
  embedding_row(out, token_ids, table, vocab, dim);
}

// Grid: (T,)  Block: (any, e.g. 256)
extern "C" __global__ void embedding_bf16(__nv_bfloat16* __restrict__ out,
                                          const int* __restrict__ token_ids,
                                          const __nv_bfloat16* __restrict__ table, int vocab,
                                          int dim) {
  embedding_row(out, token_ids, table, vocab, dim);
}
