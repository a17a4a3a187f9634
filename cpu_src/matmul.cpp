// Matrix products on the kernels' own threads: out (M, N) = x (M, K) @ w (K, N), float32, by
// the BLAS that NumPy ships (OpenBLAS's cblas_sgemm, found by cpu_native.py), each thread
// computing a slice of the columns with the BLAS's own single-threaded kernel. One pool of
// threads runs the products and the kernels between them, so no other pool spins beside it.
// One row goes through the BLAS's sgemv; 2 to 8 rows through matmul_quant.cpp's GEMV, which
// reads W once for every row (sgemm packs all of W for each call: 50-70 ms a SmolLM2 step for
// 2-8 rows against 20-51 ms through the GEMV, measured).
// Threads: one task per slice of COLS columns (the last slice shorter).
#include <vector>

#include "blas.h"
#include "common.h"

sgemm_fn sgemm = nullptr;
sgemv_fn sgemv = nullptr;
set_threads_fn set_local_threads = nullptr;

namespace {

const long COLS = 64;  // columns per task at least
const long MATVEC_WORK = 1L << 19;

}  // namespace

// The BLAS's cblas_sgemm and cblas_sgemv (64-bit integers) and
// openblas_set_num_threads_local.
extern "C" void matmul_init(void* sgemm_ptr, void* sgemv_ptr, void* set_local_ptr) {
  sgemm = (sgemm_fn)sgemm_ptr;
  sgemv = (sgemv_fn)sgemv_ptr;
  set_local_threads = (set_threads_fn)set_local_ptr;
}

// One row, y = x W: each thread takes a run of W's rows (whole rows stream from memory
// best), into its own partial sum; the partial sums are added at the end.
static void matvec(float* out, const float* x, const float* w, long K, long N, int nt) {
  std::vector<float> parts((size_t)(nt - 1) * N);
  const long per = (K + nt - 1) / nt;
  on_threads(nt, [&](int t) {
    const long k0 = t * per, k1 = std::min(K, k0 + per);
    float* y = t == 0 ? out : parts.data() + (size_t)(t - 1) * N;
    if (k1 > k0)
      sgemv(ROW_MAJOR, TRANS, k1 - k0, N, 1.0f, w + k0 * N, N, x + k0, 1, 0.0f, y, 1);
    else
      std::fill(y, y + N, 0.0f);
  });
  for (int t = 1; t < nt; t++) {
    const float* y = parts.data() + (size_t)(t - 1) * N;
#pragma omp simd
    for (long n = 0; n < N; n++) out[n] += y[n];
  }
}

// out: (M, N), x: (M, K), w: (K, N), all float32 and row-major contiguous.
// A matrix-vector product below MATVEC_WORK flops runs on one thread.
extern "C" void matmul_f32(float* out, const float* x, const float* w, long M, long K, long N,
                           int threads) {
  const long work = M * K * N * 2;
  if (M == 1) {
    matvec(out, x, w, K, N, work < MATVEC_WORK ? 1 : threads);
    return;
  }
  if (M <= GEMV_MAX_ROWS) {  // a few rows: the GEMV reads W once; sgemm would pack all of it
    matmul_f32_rows(out, x, w, M, K, N, threads);
    return;
  }
  const int nt = (int)std::min<long>(threads_for(work, threads), std::max(1L, N / COLS));
  const long per = (N + nt - 1) / nt;
  on_threads(nt, [&](int t) {
    const long n0 = t * per, n1 = std::min(N, n0 + per);
    if (n1 > n0)
      sgemm(ROW_MAJOR, NO_TRANS, NO_TRANS, M, n1 - n0, K, 1.0f, x, K, w + n0, N, 0.0f, out + n0,
            N);
  });
}
