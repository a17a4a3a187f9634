// reshape_and_cache.cu: write each new token's K and V rows into its cache slot,
// k_cache[slot // bs, slot % bs] = k[t] (the same flat offset: slot * Hkv * hd). A negative
// slot (padding) or one past the cache is skipped.
#include "common.cuh"

// Grid: (T,)  Block: (any, e.g. 128)
template <typename T>
__device__ __forceinline__ void reshape_and_cache(T* __restrict__ k_cache,  // (N, bs, Hkv, hd)
                                                  T* __restrict__ v_cache,  // (N, bs, Hkv, hd)
                                                  const T* __restrict__ k,  // (T, Hkv, hd)
                                                  const T* __restrict__ v,  // (T, Hkv, hd)
                                                  const int* __restrict__ slot_mapping,  // (T,)
                                                  int row_elems, long long num_slots) {
  const long long slot = slot_mapping[blockIdx.x];
  if (slot < 0 || slot >= num_slots) return;
  const size_t src = size_t(blockIdx.x) * row_elems, dst = size_t(slot) * row_elems;
  for (int e = threadIdx.x; e < row_elems; e += blockDim.x) {
    k_cache[dst + e] = k[src + e];
    v_cache[dst + e] = v[src + e];
  }
}

DTYPE_ENTRY_POINTS(reshape_and_cache, 7)
