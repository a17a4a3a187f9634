// copy_blocks.cu: for each pair (s, d), dst[l, kv, d] = src[l, kv, s] for every layer l and
// kv in {K, V}. src and dst may be different pools (swap out / in, with their own block
// counts) or the same one (copy-on-write). A block id outside its pool is skipped.
#include "common.cuh"

// Grid: (P, L * 2)  Block: (any, e.g. 256)
template <typename T>
__device__ __forceinline__ void copy_blocks(T* __restrict__ dst,          // (L, 2, Nd, bs, Hkv, hd)
                                            const T* __restrict__ src,    // (L, 2, Ns, bs, Hkv, hd)
                                            const int* __restrict__ pairs,  // (P, 2) (src, dst)
                                            int src_blocks, int dst_blocks, int block_elems) {
  const int s = pairs[2 * blockIdx.x], d = pairs[2 * blockIdx.x + 1];
  if (s < 0 || s >= src_blocks || d < 0 || d >= dst_blocks) return;
  const size_t plane = blockIdx.y;  // layer * 2 + (0: K, 1: V)
  const T* from = src + (plane * src_blocks + s) * size_t(block_elems);
  T* to = dst + (plane * dst_blocks + d) * size_t(block_elems);
  for (int e = threadIdx.x; e < block_elems; e += blockDim.x) to[e] = from[e];
}

DTYPE_ENTRY_POINTS(copy_blocks, 6)
