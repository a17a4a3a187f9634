// Greedy sampling: each row's first maximum, NaN never winning; -1 for a row with nothing
// above -inf (as numpy_backend.greedy_ids and the GPU's sample_greedy kernel).
// Threads: one task per row. A row is read twice: its maximum on eight lanes, then the first
// index holding it (the row is in cache by then).
#include "common.h"

// ids: (B,) int32; logits: (B, V) float32.
extern "C" void argmax_rows(int32_t* ids, const float* logits, int B, long V, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads_for((long)B * V, threads))
  for (int b = 0; b < B; b++) {
    const float* x = logits + (long)b * V;
    v8 m8 = v8{} - INFINITY;
    long i = 0;
    for (; i + 8 <= V; i += 8) {
      const v8 v = load8(x + i);
      m8 = v > m8 ? v : m8;  // a NaN lane compares false: never taken
    }
    float m = -INFINITY;
    for (int l = 0; l < 8; l++) m = m8[l] > m ? m8[l] : m;
    for (; i < V; i++) m = x[i] > m ? x[i] : m;
    int32_t id = -1;
    if (m > -INFINITY)
      for (long j = 0; j < V; j++)
        if (x[j] == m) {
          id = (int32_t)j;
          break;
        }
    ids[b] = id;
  }
}
