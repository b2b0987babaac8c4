#include "testing/alloc_probe.h"

#include <execinfo.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <new>

namespace {

std::atomic<size_t> g_largest{0};

// Counting mode. t_watched is constant-initialised, so reading it in operator new needs no TLS
// initialisation (which could itself allocate).
thread_local bool t_watched = false;
thread_local bool t_recording = false;  // backtrace() below must not count itself
std::atomic<bool> g_armed{false};
std::atomic<uint64_t> g_count{0};
size_t g_first_bytes = 0;
std::array<void*, 32> g_first_frames{};
int g_first_depth = 0;

void note(size_t n) {
  size_t seen = g_largest.load(std::memory_order_relaxed);
  while (n > seen && !g_largest.compare_exchange_weak(seen, n, std::memory_order_relaxed)) {
  }
  if (t_watched && !t_recording && g_armed.load(std::memory_order_relaxed)) {
    if (g_count.fetch_add(1, std::memory_order_relaxed) == 0) {
      t_recording = true;
      g_first_bytes = n;
      // backtrace() uses malloc, never operator new.
      g_first_depth = ::backtrace(g_first_frames.data(), static_cast<int>(g_first_frames.size()));
      t_recording = false;
    }
  }
}

}  // namespace

namespace expertd::test {

size_t largest_alloc_bytes() { return g_largest.load(std::memory_order_relaxed); }
void reset_largest_alloc() { g_largest.store(0, std::memory_order_relaxed); }

void watch_allocations_on_this_thread() { t_watched = true; }

void arm_allocation_count() {
  g_first_depth = 0;
  g_count.store(0, std::memory_order_relaxed);
  g_armed.store(true, std::memory_order_seq_cst);
}

uint64_t disarm_allocation_count() {
  g_armed.store(false, std::memory_order_seq_cst);
  return g_count.load(std::memory_order_seq_cst);
}

std::string first_counted_allocation() {
  if (g_count.load(std::memory_order_relaxed) == 0 || g_first_depth == 0) return "";
  std::string out = std::to_string(g_first_bytes) + " bytes at:";
  char** names = ::backtrace_symbols(g_first_frames.data(), g_first_depth);
  for (int i = 0; i < g_first_depth; ++i) {
    out += "\n  ";
    out += names != nullptr ? names[i] : "?";
  }
  std::free(names);
  return out;
}

}  // namespace expertd::test

// The replaceable global allocation functions; new[] and the nothrow forms call these.
void* operator new(size_t n) {
  note(n);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }

// The over-aligned forms, so that they are counted too.
void* operator new(size_t n, std::align_val_t al) {
  note(n);
  const auto a = static_cast<size_t>(al);
  if (void* p = std::aligned_alloc(a, (n + a - 1) / a * a == 0 ? a : (n + a - 1) / a * a)) {
    return p;
  }
  throw std::bad_alloc();
}
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, size_t, std::align_val_t) noexcept { std::free(p); }
