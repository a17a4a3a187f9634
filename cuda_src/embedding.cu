// embedding.cu: out[t] = table[token_ids[t]], one token per block; an id outside [0, V)
// writes zeros (the Python wrapper rejects such ids before launching).
#include "common.cuh"

// Grid: (T,)  Block: (any, e.g. 256)
template <typename T>
__device__ __forceinline__ void embedding(T* __restrict__ out,                // (T, D)
                                          const int* __restrict__ token_ids,  // (T,)
                                          const T* __restrict__ table,        // (V, D)
                                          int vocab, int dim) {
  const int id = token_ids[blockIdx.x];
  const bool valid = id >= 0 && id < vocab;
  const T* src = table + size_t(valid ? id : 0) * dim;
  T* dst = out + size_t(blockIdx.x) * dim;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = valid ? src[i] : from_float<T>(0.f);
}

DTYPE_ENTRY_POINTS(embedding, 5)
