// emu_traffic.h: count the bytes a kernel loads from and stores to global memory.
//
// A counting build (engine/kernels/build.py COUNTING_KINDS) compiles the kernel with
// -fsanitize=kernel-address and outline instrumentation: g++ then calls
// __asan_load<n>_noabort(addr) before every load of n bytes and __asan_store<n>_noabort(addr)
// before every store, and this file defines those hooks. Loads and stores are counted by two
// builds ("reads", "writes"): g++ drops a check that an earlier check of the same address
// covers, and a load's check would hide the store after it (x[i] += 1). The emulator runs
// both on the same inputs (engine/kernels/emulator.py CountingKernel). Before a launch the emulator
// registers the address range of each array argument (emu_traffic_set); a hook adds n to the
// range's read or written count when addr falls inside it. Shared memory, locals and the
// emulator's own data lie outside every range and are not counted.
//
// What is counted is what the compiled code loads: a value kept in a register and reused is
// read once, a 16-byte vector load counts 16 bytes. GPU caches are not modelled, so the count
// is the traffic the kernel asks of global memory.
#pragma once

#include <cstdint>

namespace emu_traffic {

constexpr int kMaxRanges = 32;

struct Range {
  uintptr_t begin, end;
  uint64_t read, written;
};

inline Range g_ranges[kMaxRanges];
inline int g_count = 0;

__attribute__((no_sanitize_address)) inline void add(const void* p, uint64_t n, bool store) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  for (int i = 0; i < g_count; ++i) {
    Range& r = g_ranges[i];
    if (a >= r.begin && a < r.end) {
      (store ? r.written : r.read) += n;
      return;
    }
  }
}

}  // namespace emu_traffic

#define EMU_TRAFFIC_HOOKS(n)                                                                  \
  extern "C" __attribute__((visibility("hidden"), no_sanitize_address)) void                  \
      __asan_load##n##_noabort(void* p) {                                                     \
    emu_traffic::add(p, n, false);                                                            \
  }                                                                                           \
  extern "C" __attribute__((visibility("hidden"), no_sanitize_address)) void                  \
      __asan_store##n##_noabort(void* p) {                                                    \
    emu_traffic::add(p, n, true);                                                             \
  }
EMU_TRAFFIC_HOOKS(1)
EMU_TRAFFIC_HOOKS(2)
EMU_TRAFFIC_HOOKS(4)
EMU_TRAFFIC_HOOKS(8)
EMU_TRAFFIC_HOOKS(16)
#undef EMU_TRAFFIC_HOOKS

extern "C" __attribute__((visibility("hidden"), no_sanitize_address)) void
__asan_loadN_noabort(void* p, long n) {
  emu_traffic::add(p, uint64_t(n), false);
}
extern "C" __attribute__((visibility("hidden"), no_sanitize_address)) void
__asan_storeN_noabort(void* p, long n) {
  emu_traffic::add(p, uint64_t(n), true);
}
// The rest of the instrumentation's interface: nothing to do.
extern "C" __attribute__((visibility("hidden"))) void __asan_handle_no_return() {}
extern "C" __attribute__((visibility("hidden"))) void __asan_before_dynamic_init(const char*) {}
extern "C" __attribute__((visibility("hidden"))) void __asan_after_dynamic_init() {}

// Register n ranges [begin[i], end[i]) and zero their counts (ranges must not overlap).
extern "C" __attribute__((visibility("default"))) int emu_traffic_set(int n,
                                                                      const uint64_t* begin,
                                                                      const uint64_t* end) {
  if (n < 0 || n > emu_traffic::kMaxRanges) return 1;
  for (int i = 0; i < n; ++i) emu_traffic::g_ranges[i] = {begin[i], end[i], 0, 0};
  emu_traffic::g_count = n;
  return 0;
}

// Copy out each range's counts: read[i], written[i] in bytes.
extern "C" __attribute__((visibility("default"))) void emu_traffic_get(uint64_t* read,
                                                                       uint64_t* written) {
  for (int i = 0; i < emu_traffic::g_count; ++i) {
    read[i] = emu_traffic::g_ranges[i].read;
    written[i] = emu_traffic::g_ranges[i].written;
  }
}
