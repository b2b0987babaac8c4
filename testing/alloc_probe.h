// AllocProbe: the largest single operator-new request since the probe was made, so a test can
// assert that parsing a hostile file never asks for a block its size cannot justify. The test
// binary replaces the global operator new (alloc_probe.cc) to count; one probe at a time.
#pragma once

#include <cstddef>

namespace expertd::test {

size_t largest_alloc_bytes();
void reset_largest_alloc();

class AllocProbe {
 public:
  AllocProbe() { reset_largest_alloc(); }
  size_t largest() const { return largest_alloc_bytes(); }
};

}  // namespace expertd::test
