// The walk the panel products share (matmul_panels.cpp, matmul_panels_bf16.cpp): W's panels in
// groups of NV, the groups split over the threads in runs; x's rows in blocks of MC (one pass
// over the thread's panels per block) and tiles of MR rows.
#pragma once
#include <type_traits>

#include "blas.h"
#include "common.h"

// tile(r, R, p, V): out rows r..r+R-1 over panels p..p+V-1, with R (1..MR; fewer for the last
// rows of a block) and V (NV, or 1 for the last group) as std::integral_constant, so the tile
// can be a template on them. M rows, N columns (N / 16 panels); work: the product's flops, for
// threads_for.
template <int MR, int NV, typename Tile>
void walk_panels(long M, long N, long MC, long work, int threads, Tile tile) {
  static_assert(MR <= 12 && (NV == 1 || NV == 2), "tiles of up to 12 rows and 2 panels");
  const long panels = N / 16, groups = (panels + NV - 1) / NV;
  const int nt = (int)std::min<long>(threads_for(work, threads), groups);
  const long per = (groups + nt - 1) / nt;
  auto shaped = [&](long r, int rows, long p, auto V) {
    switch (rows) {
#define ROWS(n) \
  case n: if constexpr (n <= MR) tile(r, std::integral_constant<int, n>{}, p, V); break;
      ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6)
      ROWS(7) ROWS(8) ROWS(9) ROWS(10) ROWS(11) ROWS(12)
#undef ROWS
    }
  };
  on_threads(nt, [&](int t) {
    const long g0 = t * per, g1 = std::min(groups, g0 + per);
    for (long m0 = 0; m0 < M; m0 += MC) {
      const long m1 = std::min(M, m0 + MC);
      for (long g = g0; g < g1; g++) {
        const long p = g * NV;
        for (long r = m0; r < m1; r += MR) {
          const int rows = (int)std::min<long>(MR, m1 - r);
          if (p + NV <= panels)
            shaped(r, rows, p, std::integral_constant<int, NV>{});
          else if constexpr (NV > 1)
            shaped(r, rows, p, std::integral_constant<int, 1>{});
        }
      }
    }
  });
}
