// The BLAS that NumPy ships (OpenBLAS's cblas_sgemm and cblas_sgemv, 64-bit integers), set by
// matmul_init (matmul.cpp) from the pointers cpu_native.py finds, and the rule every product
// follows: the BLAS single-threaded on each of the kernels' own threads.
#pragma once
#include <algorithm>

typedef void (*sgemm_fn)(int order, int transa, int transb, long m, long n, long k, float alpha,
                         const float* a, long lda, const float* b, long ldb, float beta, float* c,
                         long ldc);
typedef void (*sgemv_fn)(int order, int trans, long m, long n, float alpha, const float* a,
                         long lda, const float* x, long incx, float beta, float* y, long incy);
typedef int (*set_threads_fn)(int);

extern sgemm_fn sgemm;
extern sgemv_fn sgemv;
extern set_threads_fn set_local_threads;

const int ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112;

// task(t) for t in 0..nt-1 on nt threads, the BLAS single-threaded on each of them.
template <typename Task> void on_threads(int nt, Task task) {
#pragma omp parallel num_threads(nt)
  {
    const int prev = set_local_threads(1);
#pragma omp for schedule(static)
    for (int t = 0; t < nt; t++) task(t);
    set_local_threads(prev);
  }
}

// Rows of x that matmul_quant.cpp's GEMV takes (W read once for every row); more go through
// sgemm (float32) or dequantized tiles (bf16, int8).
const long GEMV_MAX_ROWS = 8;

// out (M, N) = x (M, K) @ w (K, N) float32 for 2 <= M <= GEMV_MAX_ROWS (matmul_quant.cpp).
void matmul_f32_rows(float* out, const float* x, const float* w, long M, long K, long N,
                     int threads);
