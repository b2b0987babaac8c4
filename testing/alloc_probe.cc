#include "testing/alloc_probe.h"

#include <atomic>
#include <cstdlib>
#include <new>

namespace {
std::atomic<size_t> g_largest{0};
}  // namespace

namespace expertd::test {
size_t largest_alloc_bytes() { return g_largest.load(std::memory_order_relaxed); }
void reset_largest_alloc() { g_largest.store(0, std::memory_order_relaxed); }
}  // namespace expertd::test

// The replaceable global allocation functions; new[] and the nothrow forms call these.
void* operator new(size_t n) {
  size_t seen = g_largest.load(std::memory_order_relaxed);
  while (n > seen && !g_largest.compare_exchange_weak(seen, n, std::memory_order_relaxed)) {
  }
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
