// reshape_and_cache.cu: write each new token's K and V rows into its cache slot,
// k_cache[slot // bs, slot % bs] = k[t] (the same flat offset: slot * Hkv * hd). A negative
// slot (padding) or one past the cache is skipped.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void cache_token(T* __restrict__ k_cache,  // (N, bs, Hkv, hd)
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

// Grid: (T,)  Block: (any, e.g. 128)
extern "C" __global__ void reshape_and_cache_f32(float* __restrict__ k_cache,
                                                 float* __restrict__ v_cache,
                                                 const float* __restrict__ k,
                                                 const float* __restrict__ v,
                                                 const int* __restrict__ slot_mapping,
                                                 int row_elems, long long num_slots) {
  cache_token(k_cache, v_cache, k, v, slot_mapping, row_elems, num_slots);
}

// Grid: (T,)  Block: (any, e.g. 128)
extern "C" __global__ void reshape_and_cache_f16(__half* __restrict__ k_cache,
                                                 __half* __restrict__ v_cache,
                                                 const __half* __restrict__ k,
                                                 const __half* __restrict__ v,
                                                 const int* __restrict__ slot_mapping,
                                                 int row_elems, long long num_slots) {
  cache_token(k_cache, v_cache, k, v, slot_mapping, row_elems, num_slots);
}

// Grid: (T,)  Block: (any, e.g. 128)
extern "C" __global__ void reshape_and_cache_bf16(__nv_bfloat16* __restrict__ k_cache,
                                                  __nv_bfloat16* __restrict__ v_cache,
                                                  const __nv_bfloat16* __restrict__ k,
                                                  const __nv_bfloat16* __restrict__ v,
                                                  const int* __restrict__ slot_mapping,
                                                  int row_elems, long long num_slots) {
  cache_token(k_cache, v_cache, k, v, slot_mapping, row_elems, num_slots);
}
