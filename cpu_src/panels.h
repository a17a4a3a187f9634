// The walk the panel products share (matmul_panels.cpp, matmul_panels_bf16.cpp): W's panels in
// groups of NV, the groups split over the threads in runs; x's rows in blocks of MC (one pass
// over the thread's panels per block) and tiles of MR rows.
#pragma once
#include "blas.h"
#include "common.h"

// tile(r, rows, p, V): out rows r..r+rows-1 (rows <= MR) over panels p..p+V-1 (V <= NV).
// M rows, N columns (N / 16 panels); work: the product's flops, for threads_for.
template <int MR, int NV, typename Tile>
void walk_panels(long M, long N, long MC, long work, int threads, Tile tile) {
  const long panels = N / 16, groups = (panels + NV - 1) / NV;
  const int nt = (int)std::min<long>(threads_for(work, threads), groups);
  const long per = (groups + nt - 1) / nt;
  on_threads(nt, [&](int t) {
    const long g0 = t * per, g1 = std::min(groups, g0 + per);
    for (long m0 = 0; m0 < M; m0 += MC) {
      const long m1 = std::min(M, m0 + MC);
      for (long g = g0; g < g1; g++) {
        const long p = g * NV;
        for (long r = m0; r < m1; r += MR)
          tile(r, (int)std::min<long>(MR, m1 - r), p, (int)std::min<long>(NV, panels - p));
      }
    }
  });
}
