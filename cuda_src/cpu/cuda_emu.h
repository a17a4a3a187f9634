// cuda_emu.h: the CUDA subset our kernels use, for g++ on x86-64 Linux.
//
// g++ -std=c++17 -include cuda_src/cpu/cuda_emu.h -I cuda_src/cpu/shim -x c++ kernel.cu
// compiles a kernel file unchanged into a shared library; engine/kernels/emulator.py launches
// its kernels through the exported emu_launch_<name>() with CuPy's (grid, block, args,
// shared_mem).
//
// Model: every CUDA thread is a fiber with its own stack (a hand-written context switch, no
// syscall). One block runs at a time; its threads run one after another and switch only at
// __syncthreads() and at warp operations (__shfl_*_sync, __ballot_sync, __syncwarp), so a
// barrier-free kernel runs thread by thread. Blocks run one after another.
//
// What it catches (the launch fails with a message naming the file and line):
//   - deadlock: every unfinished thread waits and nothing can release it;
//   - a barrier reached by only part of the block (others exited or wait elsewhere);
//   - a warp operation reached by only part of its mask, or masks/sites that disagree,
//     or a mask naming lanes that do not exist (a partial last warp);
//   - reads of uninitialised shared memory: static and dynamic shared memory are filled with
//     0xFF bytes (NaN for float/half/bfloat16, -1 for integers) before every block;
//   - missing barriers: emu_set_order() runs threads (and blocks) forward, reversed or
//     shuffled, so a read that needs another thread's earlier write sees NaN in some order;
//   - out-of-bounds accesses: build with -fsanitize=address (fibers are annotated for ASan).
// A counting build (-DEMU_COUNT_BYTES, emu_traffic.h) counts each array argument's global
// memory traffic instead.
// What it cannot model: see docs/kernels.md (weak memory ordering, spin-waits between threads,
// tensor cores, warp-synchronous code without *_sync, timing).
#pragma once

#if !defined(__x86_64__) || !defined(__linux__)
#error "cuda_emu.h needs x86-64 Linux (hand-written context switch)"
#endif

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <sys/mman.h>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(EMU_COUNT_BYTES)
#include "emu_traffic.h"  // a counting build: -fsanitize=kernel-address hooks, not ASan
#define EMU_ASAN 0
#elif defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#else
#define EMU_ASAN 0
#endif

#define CUDA_EMU 1

// ---- CUDA keywords --------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// Static __shared__ variables live in one section that is refilled before every block.
#define __shared__ static __attribute__((section("emu_shared")))
// Dynamic shared memory (CUDA: extern __shared__ T name[]), sized by the launch's shared_mem.
#define DYNAMIC_SHARED(T, name) T* name = reinterpret_cast<T*>(::emu::g_launch->dyn_smem)

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
constexpr int warpSize = 32;

// CUDA's vector types, with their alignment (a float4 or uint4 access is one 16-byte load).
struct __attribute__((aligned(8))) float2 { float x, y; };
struct __attribute__((aligned(16))) float4 { float x, y, z, w; };
struct __attribute__((aligned(8))) int2 { int x, y; };
struct __attribute__((aligned(16))) int4 { int x, y, z, w; };
struct __attribute__((aligned(8))) uint2 { unsigned x, y; };
struct __attribute__((aligned(16))) uint4 { unsigned x, y, z, w; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

namespace emu {

enum class Wait : uint8_t { Ready, Barrier, Warp, Done };
enum WarpOp : int { kShflIdx, kShflUp, kShflDown, kShflXor, kBallot, kSyncWarp };

struct Thread {
  void* sp;  // saved stack pointer while switched out
  uint3 idx;
  int linear;
  Wait wait;
  const char* file;  // where it waits
  int line;
  uint64_t value, result;  // warp-op operand and result (raw bits)
  int op, param, width;
  void* fake_stack;  // ASan bookkeeping
};

// A warp operation some lanes of `mask` wait in. Lanes with disjoint masks may have one each.
struct WarpGroup {
  unsigned arrived, mask;
  const char* file;
  int line;
};

struct WarpState {
  WarpGroup groups[32];
  int count;
};

struct Launch {
  dim3 grid, block;
  uint3 block_idx;
  int nthreads = 0, ndone = 0;
  std::vector<Thread> threads;
  std::vector<WarpState> warps;
  std::vector<int> queue;  // runnable threads, taken from `head`
  size_t head = 0;
  void (*body)(void*) = nullptr;
  void* ctx = nullptr;
  unsigned char* dyn_smem = nullptr;
  size_t dyn_smem_bytes = 0;
  bool failed = false;
  std::string error;
};

inline Launch* g_launch = nullptr;
inline Thread* g_cur = nullptr;
inline void* g_sched_sp = nullptr;
inline void* g_sched_fake_stack = nullptr;
inline const void* g_sched_stack_bottom = nullptr;
inline size_t g_sched_stack_size = 0;
inline int g_order = 0;  // 0 forward, 1 reversed, 2 shuffled
inline uint64_t g_rng = 0x9E3779B97F4A7C15ull;
inline std::string g_last_error;

// Stacks: one mmap'd region reused by every launch, a PROT_NONE guard page under each stack.
constexpr size_t kStackBytes = EMU_ASAN ? (256u << 10) : (64u << 10);
constexpr size_t kGuardBytes = 4096;
inline unsigned char* g_stacks = nullptr;
inline size_t g_stack_count = 0;

}  // namespace emu

extern "C" __attribute__((visibility("hidden"))) void emu_switch_context(void** save, void* load);

// Save the callee-saved registers on this stack, store rsp to *save, load rsp, restore, return.
asm(R"(
  .text
  .p2align 4
  .globl emu_switch_context
  .hidden emu_switch_context
  .type emu_switch_context, @function
emu_switch_context:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size emu_switch_context, .-emu_switch_context
)");

extern char __start_emu_shared[] __attribute__((weak, visibility("hidden")));
extern char __stop_emu_shared[] __attribute__((weak, visibility("hidden")));

namespace emu {

inline uint64_t next_random() {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return g_rng;
}

// Reorder ids by the launch's thread order policy.
inline void apply_order(int* ids, int n) {
  if (g_order == 1) {
    for (int i = 0, j = n - 1; i < j; ++i, --j) std::swap(ids[i], ids[j]);
  } else if (g_order == 2) {
    for (int i = n - 1; i > 0; --i) std::swap(ids[i], ids[next_random() % (i + 1)]);
  }
}

inline std::string where(const char* file, int line) {
  return std::string(file ? file : "?") + ":" + std::to_string(line);
}

inline void switch_to_thread(Thread* t) {
  g_cur = t;
#if EMU_ASAN
  __sanitizer_start_switch_fiber(&g_sched_fake_stack, g_stacks + kGuardBytes +
                                 size_t(t->linear) * (kStackBytes + kGuardBytes), kStackBytes);
#endif
  emu_switch_context(&g_sched_sp, t->sp);
#if EMU_ASAN
  __sanitizer_finish_switch_fiber(g_sched_fake_stack, nullptr, nullptr);
#endif
}

// Back to the scheduler; `finished` threads never come back (ASan frees their fake stack).
inline void yield_to_scheduler(bool finished = false) {
  Thread* t = g_cur;
#if EMU_ASAN
  __sanitizer_start_switch_fiber(finished ? nullptr : &t->fake_stack, g_sched_stack_bottom,
                                 g_sched_stack_size);
#endif
  emu_switch_context(&t->sp, g_sched_sp);
#if EMU_ASAN
  __sanitizer_finish_switch_fiber(t->fake_stack, nullptr, nullptr);
#endif
  (void)finished;
}

// Fail the launch from inside a thread: record the message and never resume this block.
[[noreturn]] inline void fail(const std::string& msg) {
  Launch& L = *g_launch;
  if (!L.failed) {
    L.failed = true;
    uint3 b = L.block_idx, i = g_cur ? g_cur->idx : uint3{0, 0, 0};
    char buf[96];
    snprintf(buf, sizeof buf, " [block (%u,%u,%u) thread (%u,%u,%u)]", b.x, b.y, b.z, i.x, i.y,
             i.z);
    L.error = msg + buf;
  }
  yield_to_scheduler(true);
  __builtin_unreachable();
}

extern "C" inline void emu_fiber_entry() {
#if EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &g_sched_stack_bottom, &g_sched_stack_size);
#endif
  g_launch->body(g_launch->ctx);
  g_cur->wait = Wait::Done;
  g_launch->ndone++;
  yield_to_scheduler(true);
  __builtin_unreachable();
}

inline bool reserve_stacks(int n, std::string& err) {
  if (size_t(n) <= g_stack_count) return true;
  if (g_stacks) munmap(g_stacks, g_stack_count * (kStackBytes + kGuardBytes));
  size_t bytes = size_t(n) * (kStackBytes + kGuardBytes);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    err = "cannot map fiber stacks";
    g_stacks = nullptr, g_stack_count = 0;
    return false;
  }
  g_stacks = static_cast<unsigned char*>(p);
  g_stack_count = size_t(n);
  for (int i = 0; i < n; ++i) mprotect(g_stacks + size_t(i) * (kStackBytes + kGuardBytes),
                                       kGuardBytes, PROT_NONE);
  return true;
}

// A fresh stack whose first switch "returns" into emu_fiber_entry with an ABI-aligned rsp.
inline void* initial_sp(int i) {
  unsigned char* top = g_stacks + size_t(i + 1) * (kStackBytes + kGuardBytes);
  void** sp = reinterpret_cast<void**>(top - 64);
  for (int r = 0; r < 6; ++r) sp[r] = nullptr;  // r15 r14 r13 r12 rbx rbp
  sp[6] = reinterpret_cast<void*>(&emu_fiber_entry);
  sp[7] = nullptr;  // entry's (never used) return address
  return sp;
}

__attribute__((no_sanitize_address)) inline void poison_shared(Launch& L) {
  for (char* p = __start_emu_shared; p < __stop_emu_shared; ++p) *p = char(0xFF);
  for (size_t i = 0; i < L.dyn_smem_bytes; ++i) L.dyn_smem[i] = 0xFF;
}

inline void enqueue(Launch& L, int* ids, int n) {
  apply_order(ids, n);
  L.queue.insert(L.queue.end(), ids, ids + n);
}

inline std::string lanes_text(unsigned m) {
  char buf[16];
  snprintf(buf, sizeof buf, "0x%08x", m);
  return buf;
}

inline WarpGroup* find_group(WarpState& w, int lane) {
  for (int g = 0; g < w.count; ++g)
    if ((w.groups[g].mask >> lane) & 1) return &w.groups[g];
  return nullptr;
}

// Every unfinished thread waits: release a complete barrier or explain the deadlock.
inline bool resolve_stall(Launch& L) {
  const Thread* first_bar = nullptr;
  int at_barrier = 0;
  for (const Thread& t : L.threads) {
    if (t.wait == Wait::Warp) {
      const WarpGroup& w = *find_group(L.warps[t.linear / 32], t.linear % 32);
      std::string msg = "deadlock: warp operation at " + where(w.file, w.line) + " with mask " +
                        lanes_text(w.mask) + " reached only by lanes " + lanes_text(w.arrived);
      for (int lane = 0; lane < 32; ++lane) {
        int j = (t.linear / 32) * 32 + lane;
        if (!((w.mask >> lane) & 1) || ((w.arrived >> lane) & 1) || j >= L.nthreads) continue;
        const Thread& o = L.threads[j];
        msg += o.wait == Wait::Done ? "; lane " + std::to_string(lane) + " has exited"
                                    : "; lane " + std::to_string(lane) + " waits at " +
                                          where(o.file, o.line);
        break;
      }
      L.error = msg;
      return false;
    }
    if (t.wait == Wait::Barrier) {
      if (first_bar && (first_bar->line != t.line ||
                        (first_bar->file != t.file && strcmp(first_bar->file, t.file) != 0))) {
        L.error = "divergent __syncthreads: threads wait at " +
                  where(first_bar->file, first_bar->line) + " and at " + where(t.file, t.line);
        return false;
      }
      first_bar = first_bar ? first_bar : &t;
      ++at_barrier;
    }
  }
  if (L.ndone > 0) {
    L.error = "__syncthreads at " + where(first_bar->file, first_bar->line) + " reached by " +
              std::to_string(at_barrier) + " of " + std::to_string(L.nthreads) +
              " threads; the others had exited";
    return false;
  }
  std::vector<int> ids(L.nthreads);
  for (int i = 0; i < L.nthreads; ++i) L.threads[i].wait = Wait::Ready, ids[i] = i;
  L.queue.clear(), L.head = 0;
  enqueue(L, ids.data(), L.nthreads);
  return true;
}

inline bool run_block(Launch& L) {
  poison_shared(L);
  L.ndone = 0;
  std::vector<int> ids(L.nthreads);
  for (int i = 0; i < L.nthreads; ++i) {
    Thread& t = L.threads[i];
    t.sp = initial_sp(i), t.wait = Wait::Ready, t.fake_stack = nullptr;
    ids[i] = i;
  }
  for (WarpState& w : L.warps) w.count = 0;
  L.queue.clear(), L.head = 0;
  enqueue(L, ids.data(), L.nthreads);
  for (;;) {
    while (L.head < L.queue.size()) {
      switch_to_thread(&L.threads[L.queue[L.head++]]);
      if (L.failed) return false;
    }
    if (L.ndone == L.nthreads) return true;
    if (!resolve_stall(L)) return false;
  }
}

inline void setup_threads(Launch& L) {
  L.nthreads = int(L.block.x * L.block.y * L.block.z);
  L.threads.assign(L.nthreads, Thread{});
  L.warps.assign((L.nthreads + 31) / 32, WarpState{});
  for (int i = 0; i < L.nthreads; ++i) {
    Thread& t = L.threads[i];
    t.linear = i;
    t.idx = uint3{i % L.block.x, (i / L.block.x) % L.block.y, i / (L.block.x * L.block.y)};
  }
}

inline std::vector<uint3> block_order(dim3 g) {
  std::vector<uint3> order;
  order.reserve(size_t(g.x) * g.y * g.z);
  for (unsigned z = 0; z < g.z; ++z)
    for (unsigned y = 0; y < g.y; ++y)
      for (unsigned x = 0; x < g.x; ++x) order.push_back(uint3{x, y, z});
  if (g_order == 1) {
    for (size_t i = 0, j = order.size() - 1; order.size() > 1 && i < j; ++i, --j)
      std::swap(order[i], order[j]);
  } else if (g_order == 2) {
    for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[next_random() % i]);
  }
  return order;
}

inline bool valid_config(dim3 grid, dim3 block, std::string& err) {
  unsigned n = block.x * block.y * block.z;
  if (n == 0 || n > 1024 || block.z > 64) err = "invalid block size (1..1024 threads)";
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535)
    err = "invalid grid size";
  return err.empty();
}

// Run body(ctx) once per thread of every block. Returns 0, or 1 with emu_last_error() set.
inline int launch(dim3 grid, dim3 block, size_t shared_mem, void (*body)(void*), void* ctx) {
  Launch L;
  std::string err;
  L.grid = grid, L.block = block, L.body = body, L.ctx = ctx;
  if (!valid_config(grid, block, err) || !reserve_stacks(int(block.x * block.y * block.z), err)) {
    g_last_error = err;
    return 1;
  }
  setup_threads(L);
  L.dyn_smem = shared_mem ? static_cast<unsigned char*>(malloc(shared_mem)) : nullptr;
  L.dyn_smem_bytes = shared_mem;
  g_launch = &L;
  bool ok = true;
  for (uint3 b : block_order(grid)) {
    L.block_idx = b;
    if (!(ok = run_block(L))) break;
  }
  free(L.dyn_smem);
  g_launch = nullptr, g_cur = nullptr;
  if (ok) return 0;
  char buf[64];
  snprintf(buf, sizeof buf, " [block (%u,%u,%u)]", L.block_idx.x, L.block_idx.y, L.block_idx.z);
  g_last_error = L.error.find("[block") == std::string::npos ? L.error + buf : L.error;
  return 1;
}

// ---- warp operations ------------------------------------------------------------------------

inline unsigned existing_lanes(int warp) {
  int n = g_launch->nthreads - warp * 32;
  return n >= 32 ? 0xFFFFFFFFu : ((1u << n) - 1u);
}

inline int source_lane(const Thread& t, int lane) {
  int w = t.width, base = lane & ~(w - 1);
  switch (t.op) {
    case kShflIdx: return base + (t.param & (w - 1));
    case kShflUp: return (lane - base) >= t.param ? lane - t.param : lane;
    case kShflDown: return (lane - base) + t.param < w ? lane + t.param : lane;
    case kShflXor: {
      int src = lane ^ t.param;
      return src < base + w ? src : lane;
    }
    default: return lane;
  }
}

// The last lane to arrive computes every lane's result, then all of them continue.
inline void complete_warp_op(Launch& L, int warp, unsigned mask) {
  Thread* lanes = &L.threads[warp * 32];
  unsigned ballot = 0;
  for (int lane = 0; lane < 32; ++lane)
    if ((mask >> lane) & 1) ballot |= (lanes[lane].value != 0 ? 1u : 0u) << lane;
  int ids[32], n = 0;
  for (int lane = 0; lane < 32; ++lane) {
    if (!((mask >> lane) & 1)) continue;
    Thread& t = lanes[lane];
    int src = source_lane(t, lane);
    bool active = src >= 0 && src < 32 && ((mask >> src) & 1);
    t.result = t.op == kBallot ? ballot : active ? lanes[src].value : ~uint64_t(0);
    t.wait = Wait::Ready;
    ids[n++] = warp * 32 + lane;
  }
  WarpState& w = L.warps[warp];
  for (int g = 0; g < w.count; ++g) {
    if (w.groups[g].mask == mask) {
      w.groups[g] = w.groups[--w.count];
      break;
    }
  }
  enqueue(L, ids, n);
}

inline uint64_t warp_op(unsigned mask, uint64_t value, int op, int param, int width,
                        const char* file, int line) {
  Launch& L = *g_launch;
  Thread& t = *g_cur;
  int warp = t.linear / 32, lane = t.linear % 32;
  if (!((mask >> lane) & 1)) fail("warp operation at " + where(file, line) +
                                  ": calling lane not in mask " + lanes_text(mask));
  if (mask & ~existing_lanes(warp))
    fail("warp operation at " + where(file, line) + ": mask " + lanes_text(mask) +
         " names lanes that do not exist (block of " + std::to_string(L.nthreads) +
         " threads)");
  if (width <= 0 || width > 32 || (width & (width - 1)))
    fail("warp operation at " + where(file, line) + ": width must be a power of 2 <= 32");
  WarpState& ws = L.warps[warp];
  WarpGroup* w = nullptr;
  for (int g = 0; g < ws.count; ++g) {
    WarpGroup& o = ws.groups[g];
    if (!(o.mask & mask)) continue;
    if (o.mask != mask || o.line != line || (o.file != file && strcmp(o.file, file) != 0))
      fail("warp operation at " + where(file, line) + " mask " + lanes_text(mask) +
           " while other lanes wait at " + where(o.file, o.line) + " mask " + lanes_text(o.mask));
    w = &o;
  }
  if (!w) w = &(ws.groups[ws.count++] = WarpGroup{0, mask, file, line});
  t.value = value, t.op = op, t.param = param, t.width = width;
  t.wait = Wait::Warp, t.file = file, t.line = line;
  w->arrived |= 1u << lane;
  if (w->arrived == mask) complete_warp_op(L, warp, mask);
  yield_to_scheduler();
  return t.result;
}

template <typename T>
inline T shfl(unsigned mask, T v, int op, int param, int width, const char* file, int line) {
  static_assert(sizeof(T) <= 8, "shuffle of a type over 8 bytes");
  uint64_t bits = 0;
  memcpy(&bits, &v, sizeof(T));
  uint64_t r = warp_op(mask, bits, op, param, width, file, line);
  T out;
  memcpy(&out, &r, sizeof(T));
  return out;
}

inline void syncthreads(const char* file, int line) {
  g_cur->wait = Wait::Barrier, g_cur->file = file, g_cur->line = line;
  yield_to_scheduler();
}

// ---- exports for engine/kernels/emulator.py ------------------------------------------------

template <typename... A>
struct Invoke {
  void (*fn)(A...);
  void** args;
};

template <typename... A, size_t... I>
inline void call_with(void (*fn)(A...), void** args, std::index_sequence<I...>) {
  fn(*static_cast<std::remove_reference_t<A>*>(args[I])...);
}

template <typename... A>
inline void run_invoke(void* p) {
  auto* inv = static_cast<Invoke<A...>*>(p);
  call_with(inv->fn, inv->args, std::index_sequence_for<A...>{});
}

template <typename... A>
inline int launch_kernel(void (*fn)(A...), const unsigned* cfg, void** args) {
  Invoke<A...> inv{fn, args};
  return launch(dim3(cfg[0], cfg[1], cfg[2]), dim3(cfg[3], cfg[4], cfg[5]), cfg[6],
                &run_invoke<A...>, &inv);
}

// One letter per parameter: p pointer, i int32, u uint32, l int64, L uint64, f float, d double.
template <typename T>
constexpr char type_code() {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_pointer_v<U>) return 'p';
  else if constexpr (std::is_same_v<U, float>) return 'f';
  else if constexpr (std::is_same_v<U, double>) return 'd';
  else if constexpr (std::is_integral_v<U> && sizeof(U) == 4) return std::is_signed_v<U> ? 'i' : 'u';
  else if constexpr (std::is_integral_v<U> && sizeof(U) == 8) return std::is_signed_v<U> ? 'l' : 'L';
  else return '?';
}

template <typename... A>
inline const char* signature(void (*)(A...)) {
  static const char sig[] = {type_code<A>()..., '\0'};
  return sig;
}

}  // namespace emu

#define EMU_EXPORT(fn)                                                                       \
  extern "C" __attribute__((visibility("default"))) int emu_launch_##fn(const unsigned* cfg,  \
                                                                        void** args) {       \
    return ::emu::launch_kernel(&fn, cfg, args);                                             \
  }                                                                                          \
  extern "C" __attribute__((visibility("default"))) const char* emu_signature_##fn() {       \
    return ::emu::signature(&fn);                                                            \
  }

extern "C" __attribute__((visibility("default"))) const char* emu_last_error() {
  return ::emu::g_last_error.c_str();
}
extern "C" __attribute__((visibility("default"))) void emu_set_order(int order,
                                                                              uint64_t seed) {
  ::emu::g_order = order;
  ::emu::g_rng = seed | 1u;
}

// ---- built-in variables ----------------------------------------------------------------------
#define threadIdx (::emu::g_cur->idx)
#define blockIdx (::emu::g_launch->block_idx)
#define blockDim (::emu::g_launch->block)
#define gridDim (::emu::g_launch->grid)

// ---- synchronisation and warp intrinsics ----------------------------------------------------
#define __syncthreads() ::emu::syncthreads(__FILE__, __LINE__)
#define __syncwarp(...) \
  ((void)::emu::warp_op(::emu::syncwarp_mask(__VA_ARGS__), 0, ::emu::kSyncWarp, 0, 32, __FILE__, __LINE__))
#define __shfl_sync(m, v, src, ...) \
  ::emu::shfl(m, v, ::emu::kShflIdx, src, ::emu::width_arg(__VA_ARGS__), __FILE__, __LINE__)
#define __shfl_up_sync(m, v, d, ...) \
  ::emu::shfl(m, v, ::emu::kShflUp, d, ::emu::width_arg(__VA_ARGS__), __FILE__, __LINE__)
#define __shfl_down_sync(m, v, d, ...) \
  ::emu::shfl(m, v, ::emu::kShflDown, d, ::emu::width_arg(__VA_ARGS__), __FILE__, __LINE__)
#define __shfl_xor_sync(m, v, x, ...) \
  ::emu::shfl(m, v, ::emu::kShflXor, x, ::emu::width_arg(__VA_ARGS__), __FILE__, __LINE__)
#define __ballot_sync(m, pred) \
  unsigned(::emu::warp_op(m, (pred) ? 1 : 0, ::emu::kBallot, 0, 32, __FILE__, __LINE__))
#define __any_sync(m, pred) (__ballot_sync(m, pred) != 0)
#define __all_sync(m, pred) (__ballot_sync(m, pred) == unsigned(m))

namespace emu {
inline int width_arg() { return 32; }
inline int width_arg(int w) { return w; }
inline unsigned syncwarp_mask() { return 0xFFFFFFFFu; }
inline unsigned syncwarp_mask(unsigned m) { return m; }
}  // namespace emu

// ---- atomics (one OS thread runs every CUDA thread: plain read-modify-write is atomic) -------
template <typename T>
inline T atomicAdd(T* p, T v) { T old = *p; *p = old + v; return old; }
template <typename T>
inline T atomicSub(T* p, T v) { T old = *p; *p = old - v; return old; }
template <typename T>
inline T atomicMax(T* p, T v) { T old = *p; *p = old > v ? old : v; return old; }
template <typename T>
inline T atomicMin(T* p, T v) { T old = *p; *p = old < v ? old : v; return old; }
template <typename T>
inline T atomicExch(T* p, T v) { T old = *p; *p = v; return old; }
template <typename T>
inline T atomicCAS(T* p, T cmp, T v) { T old = *p; if (old == cmp) *p = v; return old; }
inline void __threadfence() {}
template <typename T>
inline T __ldg(const T* p) { return *p; }
inline void __threadfence_block() {}

// ---- math intrinsics ---------------------------------------------------------------------------
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
inline unsigned __umulhi(unsigned a, unsigned b) { return unsigned((uint64_t(a) * b) >> 32); }
inline unsigned __float_as_uint(float x) { unsigned u; memcpy(&u, &x, 4); return u; }
inline float __uint_as_float(unsigned u) { float x; memcpy(&x, &u, 4); return x; }
inline int __float_as_int(float x) { int u; memcpy(&u, &x, 4); return u; }
inline float __int_as_float(int u) { float x; memcpy(&x, &u, 4); return x; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(unsigned(x)); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }

// ---- 16-bit floats: storage only, converted to float for arithmetic (round to nearest even) ---
struct __half {
  uint16_t bits;
};
struct __nv_bfloat16 {
  uint16_t bits;
};

inline float __half2float(__half h) {
  _Float16 v;
  memcpy(&v, &h.bits, 2);
  return float(v);
}
inline __half __float2half(float f) {
  _Float16 v = _Float16(f);
  __half h;
  memcpy(&h.bits, &v, 2);
  return h;
}
inline __half __float2half_rn(float f) { return __float2half(f); }
inline float __bfloat162float(__nv_bfloat16 b) { return __uint_as_float(unsigned(b.bits) << 16); }
inline __nv_bfloat16 __float2bfloat16(float f) {
  unsigned u = __float_as_uint(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return __nv_bfloat16{uint16_t((u >> 16) | 0x40u)};
  u += 0x7FFFu + ((u >> 16) & 1u);
  return __nv_bfloat16{uint16_t(u >> 16)};
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __float2bfloat16(f); }
