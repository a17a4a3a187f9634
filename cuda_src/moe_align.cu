// moe_align.cu: a step's (token, expert) pairs bucketed by expert, in one block. ids (P,) are the
// router's picks, pair p = t * k + j; counts by shared-memory atomics, the offsets their running
// sum (offsets[e]..offsets[e + 1] is expert e's range), then each pair placed in its expert's
// range: sorted[pos] = p and inverse[p] = pos. The order inside a range is whatever the atomics
// give; nothing depends on it (each row of an expert product is computed alone, and the combine
// sums a token's k pairs in j order through inverse). totals (E,) += the pairs of tokens whose
// KV slot is >= 0: the rows each expert got so far (what /metrics shows), not a graph's padding
// rows or a profile step's, which write no KV.
#include "common.cuh"

// T is the step's activations' dtype, which no argument has: the three entry points are the
// same code (engine/kernels/moe_launch.py launches moe_align_f32).
// Grid: (1,)  Block: (256,)  Shared: 3 E ints
template <typename T>
__device__ __forceinline__ void moe_align(int* __restrict__ sorted,                 // (P,)
                                          int* __restrict__ inverse,                // (P,)
                                          int* __restrict__ offsets,                // (E + 1,)
                                          unsigned long long* __restrict__ totals,  // (E,)
                                          const int* __restrict__ ids,              // (P,)
                                          const int* __restrict__ slots,            // (P / k,)
                                          int P, int E, int k) {
  DYNAMIC_SHARED(int, counts);  // (E,), then each range's next free position, then real pairs
  int* cursor = counts + E;
  int* real = counts + 2 * E;
  for (int e = threadIdx.x; e < E; e += blockDim.x) counts[e] = 0, real[e] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    atomicAdd(&counts[ids[p]], 1);
    if (slots[p / k] >= 0) atomicAdd(&real[ids[p]], 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int run = 0;
    offsets[0] = 0;
    for (int e = 0; e < E; ++e) {
      cursor[e] = run;
      run += counts[e];
      offsets[e + 1] = run;
      totals[e] += (unsigned long long)real[e];
    }
  }
  __syncthreads();
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    const int pos = atomicAdd(&cursor[ids[p]], 1);
    sorted[pos] = p;
    inverse[p] = pos;
  }
}

DTYPE_ENTRY_POINTS(moe_align, 9)
