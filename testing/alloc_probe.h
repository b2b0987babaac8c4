// The allocation probe: the test binary replaces the global operator new (alloc_probe.cc) to
// watch allocations. Two modes:
//
// - AllocProbe: the largest single operator-new request since the probe was made, so a test can
//   assert that parsing a hostile file never asks for a block its size cannot justify. One probe
//   at a time.
// - Counting: the operator-new calls one thread makes while the count is armed, so a test can
//   assert that a loop (the daemon's reactor in steady state) allocates nothing. The thread marks
//   itself with watch_allocations_on_this_thread() (a test posts that to it); arming and
//   disarming happen on any thread. The first counted allocation's size and call stack are kept
//   for the failure message.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace expertd::test {

size_t largest_alloc_bytes();
void reset_largest_alloc();

class AllocProbe {
 public:
  AllocProbe() { reset_largest_alloc(); }
  size_t largest() const { return largest_alloc_bytes(); }
};

// Marks the calling thread as the one whose allocations are counted (one thread at a time: a
// later call on another thread adds it; threads are never unmarked).
void watch_allocations_on_this_thread();
// Zeroes the count and starts counting.
void arm_allocation_count();
// Stops counting and returns the count since arm_allocation_count().
uint64_t disarm_allocation_count();
// "N bytes at: <frames>" for the first allocation counted since the last arm, or "" if none.
std::string first_counted_allocation();

}  // namespace expertd::test
