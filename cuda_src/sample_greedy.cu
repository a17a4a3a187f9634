// sample_greedy.cu: out_ids[b] = argmax(logits[b]), the lowest index on ties (numpy's argmax).
// Values below kNegLarge (-inf) and NaN count as kNegLarge; a row with no value above it (all
// -inf or NaN: nothing to pick) gives -1, which the engine reports as a failed sample.
#include "common.cuh"

// Grid: (B,)  Block: (multiple of 32, <= 1024)
template <typename T>
__device__ __forceinline__ void sample_greedy(int* __restrict__ out_ids,     // (B,)
                                              const T* __restrict__ logits,  // (B, V)
                                              int vocab) {
  const T* row = logits + size_t(blockIdx.x) * vocab;
  float best = kNegLarge;
  int index = 0x7FFFFFFF;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float x = to_float(row[i]);
    argmax_merge(best, index, x > kNegLarge ? x : kNegLarge, i);  // ascending i: first max kept
  }
  const int winner = block_argmax(best, index);
  if (threadIdx.x == 0) out_ids[blockIdx.x] = to_float(row[winner]) > kNegLarge ? winner : -1;
}

DTYPE_ENTRY_POINTS(sample_greedy, 3)
