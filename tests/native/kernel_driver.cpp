// The native kernels of cpu_src/ behind a pipe, for a build that cannot be loaded into this
// Python: the aarch64 build, run under qemu-user (tests/native/remote.py, test_cpu_kernels.py).
// Each request on stdin names a kernel and gives its arguments in order, split by kind:
//   u32 name length, the name; u32 n, then n buffers (i64 bytes, -1 for a null pointer, then
//   the bytes); u32 n, n int64 integers; u32 n, n float32 values.
// The reply on stdout: i64 the kernel's status (0 for a void kernel), then every non-null
// buffer's bytes again, as the kernel left them. The BLAS the products call for a plain
// float32 matrix is the plain loops below.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "../../cpu_src/common.h"

extern "C" {
void matmul_init(void* sgemm, void* sgemv, void* set_threads);
void matmul_f32(float*, const float*, const float*, long, long, long, int);
void matmul_panels_f32(float*, const float*, const float*, long, long, long, int);
void matmul_panels_int8(float*, const float*, const int8_t*, const float*, long, long, long,
                        int);
void matmul_panels_bf16(float*, const float*, const uint16_t*, long, long, long, int);
void matmul_bf16(float*, const float*, const uint16_t*, long, long, long, int);
void matmul_int8(float*, const float*, const int8_t*, const float*, long, long, long, int);
int matmul_blocks(float*, const float*, const uint8_t*, const f16*, int, long, long, long, int);
int matmul_kquants(float*, const float*, const uint8_t*, int, long, long, long, int);
int matmul_fp8(float*, const float*, const uint8_t*, const float*, long, long, long, long, int);
int matmul_q5(float*, const float*, const uint8_t*, int, long, long, long, int);
int matmul_mxfp4(float*, const float*, const uint8_t*, long, long, long, int);
int matmul_iq4(float*, const float*, const uint8_t*, int, long, long, long, int);
int paged_attention_decode(float*, const float*, const void*, const void*, int, const int32_t*,
                           const int32_t*, int, int, int, int, int, int, float, int, float,
                           const float*, int);
int paged_attention_prefill(float*, const float*, const void*, const void*, int,
                            const int32_t*, const int32_t*, const int32_t*, int, int, int, int,
                            int, int, float, int, float, const float*, int);
int rotary_cache(float*, void*, void*, int, const float*, const float*, const float*,
                 const float*, const int32_t*, const float*, const float*, float, int, int, int,
                 int, int);
void fused_add_rms_norm(float*, const float*, float*, const float*, float, int, int, int);
void silu_and_mul(float*, const float*, int, int, int);
void argmax_rows(int32_t*, const float*, int, long, int);
}

namespace {

// cblas_sgemm for row-major A and B, either transposed: c = alpha op(a) op(b) + beta c
void sgemm(int, int ta, int tb, long m, long n, long k, float alpha, const float* a, long lda,
           const float* b, long ldb, float beta, float* c, long ldc) {
  for (long i = 0; i < m; i++)
    for (long j = 0; j < n; j++) {
      float s = 0.0f;
      for (long p = 0; p < k; p++)
        s += (ta == 112 ? a[p * lda + i] : a[i * lda + p]) *  // 112: CblasTrans
             (tb == 112 ? b[j * ldb + p] : b[p * ldb + j]);
      c[i * ldc + j] = alpha * s + (beta == 0.0f ? 0.0f : beta * c[i * ldc + j]);
    }
}
// cblas_sgemv for a row-major A (m, n) transposed: y = alpha A^T x + beta y
void sgemv(int, int, long m, long n, float alpha, const float* a, long lda, const float* x,
           long, float beta, float* y, long) {
  for (long j = 0; j < n; j++) {
    float s = 0.0f;
    for (long i = 0; i < m; i++) s += a[i * lda + j] * x[i];
    y[j] = alpha * s + (beta == 0.0f ? 0.0f : beta * y[j]);
  }
}
int set_threads(int) { return 1; }

bool read(void* p, size_t n) { return std::fread(p, 1, n, stdin) == n; }
void write(const void* p, size_t n) { std::fwrite(p, 1, n, stdout); }

struct Call {
  std::string name;
  std::vector<std::vector<char>> bufs;
  std::vector<bool> null;
  std::vector<int64_t> ints;
  std::vector<float> floats;
  void* p(int i) { return null[i] ? nullptr : bufs[i].data(); }
  float* f(int i) { return (float*)p(i); }
  int32_t* i32(int i) { return (int32_t*)p(i); }
  long l(int i) { return (long)ints[i]; }
  int n(int i) { return (int)ints[i]; }
};

bool read_call(Call& c) {
  uint32_t len;
  if (!read(&len, 4)) return false;
  c.name.resize(len);
  if (!read(&c.name[0], len)) return false;
  uint32_t n;
  if (!read(&n, 4)) return false;
  c.bufs.assign(n, {});
  c.null.assign(n, false);
  for (uint32_t i = 0; i < n; i++) {
    int64_t bytes;
    if (!read(&bytes, 8)) return false;
    c.null[i] = bytes < 0;
    c.bufs[i].resize(bytes < 0 ? 0 : (size_t)bytes + 64);  // + 64: kernels may read a vector
    if (bytes > 0 && !read(c.bufs[i].data(), (size_t)bytes)) return false;
    if (bytes >= 0) c.bufs[i].resize((size_t)bytes + 64);
  }
  if (!read(&n, 4)) return false;
  c.ints.resize(n);
  if (n && !read(c.ints.data(), 8 * n)) return false;
  if (!read(&n, 4)) return false;
  c.floats.resize(n);
  return !n || read(c.floats.data(), 4 * n);
}

// The kernel's status, or -1000 for a name this driver does not know.
int64_t run(Call& c) {
  const std::string& k = c.name;
  if (k == "matmul_f32") matmul_f32(c.f(0), c.f(1), c.f(2), c.l(0), c.l(1), c.l(2), c.n(3));
  else if (k == "matmul_panels_f32")
    matmul_panels_f32(c.f(0), c.f(1), c.f(2), c.l(0), c.l(1), c.l(2), c.n(3));
  else if (k == "matmul_panels_int8")
    matmul_panels_int8(c.f(0), c.f(1), (int8_t*)c.p(2), c.f(3), c.l(0), c.l(1), c.l(2), c.n(3));
  else if (k == "matmul_panels_bf16")
    matmul_panels_bf16(c.f(0), c.f(1), (uint16_t*)c.p(2), c.l(0), c.l(1), c.l(2), c.n(3));
  else if (k == "matmul_bf16")
    matmul_bf16(c.f(0), c.f(1), (uint16_t*)c.p(2), c.l(0), c.l(1), c.l(2), c.n(3));
  else if (k == "matmul_int8")
    matmul_int8(c.f(0), c.f(1), (int8_t*)c.p(2), c.f(3), c.l(0), c.l(1), c.l(2), c.n(3));
  else if (k == "matmul_blocks")
    return matmul_blocks(c.f(0), c.f(1), (uint8_t*)c.p(2), (f16*)c.p(3), c.n(0), c.l(1), c.l(2),
                         c.l(3), c.n(4));
  else if (k == "matmul_fp8")
    return matmul_fp8(c.f(0), c.f(1), (uint8_t*)c.p(2), c.f(3), c.l(0), c.l(1), c.l(2), c.l(3),
                      c.n(4));
  else if (k == "matmul_kquants")
    return matmul_kquants(c.f(0), c.f(1), (uint8_t*)c.p(2), c.n(0), c.l(1), c.l(2), c.l(3), c.n(4));
  else if (k == "matmul_q5")
    return matmul_q5(c.f(0), c.f(1), (uint8_t*)c.p(2), c.n(0), c.l(1), c.l(2), c.l(3), c.n(4));
  else if (k == "matmul_mxfp4")
    return matmul_mxfp4(c.f(0), c.f(1), (uint8_t*)c.p(2), c.l(0), c.l(1), c.l(2), c.n(3));
  else if (k == "matmul_iq4")
    return matmul_iq4(c.f(0), c.f(1), (uint8_t*)c.p(2), c.n(0), c.l(1), c.l(2), c.l(3), c.n(4));
  else if (k == "paged_attention_decode")
    return paged_attention_decode(c.f(0), c.f(1), c.p(2), c.p(3), c.n(0), c.i32(4), c.i32(5),
                                  c.n(1), c.n(2), c.n(3), c.n(4), c.n(5), c.n(6), c.floats[0],
                                  c.n(7), c.floats[1], c.f(6), c.n(8));
  else if (k == "paged_attention_prefill")
    return paged_attention_prefill(c.f(0), c.f(1), c.p(2), c.p(3), c.n(0), c.i32(4), c.i32(5),
                                   c.i32(6), c.n(1), c.n(2), c.n(3), c.n(4), c.n(5), c.n(6),
                                   c.floats[0], c.n(7), c.floats[1], c.f(7), c.n(8));
  else if (k == "rotary_cache")
    return rotary_cache(c.f(0), c.p(1), c.p(2), c.n(0), c.f(3), c.f(4), c.f(5), c.f(6),
                        c.i32(7), c.f(8), c.f(9), c.floats[0], c.n(1), c.n(2), c.n(3), c.n(4),
                        c.n(5));
  else if (k == "fused_add_rms_norm")
    fused_add_rms_norm(c.f(0), c.f(1), c.f(2), c.f(3), c.floats[0], c.n(0), c.n(1), c.n(2));
  else if (k == "silu_and_mul") silu_and_mul(c.f(0), c.f(1), c.n(0), c.n(1), c.n(2));
  else if (k == "argmax_rows") argmax_rows(c.i32(0), c.f(1), c.n(0), c.l(1), c.n(2));
  else return -1000;
  return 0;
}

}  // namespace

int main() {
  matmul_init((void*)sgemm, (void*)sgemv, (void*)set_threads);
  Call c;
  while (read_call(c)) {
    const int64_t status = run(c);
    write(&status, 8);
    for (size_t i = 0; i < c.bufs.size(); i++)
      if (!c.null[i]) write(c.bufs[i].data(), c.bufs[i].size() - 64);
    std::fflush(stdout);
  }
  return 0;
}
