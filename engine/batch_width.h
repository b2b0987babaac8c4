// How many sequences one decode step takes when the routed experts come from tiers that hold
// `capacity` experts (the VRAM tier's slots plus the daemon's, EngineStats::tiers_capacity;
// issue 25, docs/ENGINE.md "Sequences decoded together").
//
// Rows sharing a step share its reads only while the step's distinct experts stay resident until
// the next step wants them again. Past the tiers' capacity the step evicts its own experts and
// every step reads them again: on the H200 the Mixtral-8x7B shape at 16 GiB (138 cache slots + a
// 32-slot VRAM tier) read 246 MB a token with 2 random-id streams (114 distinct experts a step)
// and 916 MB with 4 (175 a step), and 4 streams were 2.3x slower than 2. So the width follows the
// step's working set: it narrows by one after a step whose distinct experts fill more than
// kFill of the capacity, and widens by one after a full-width step whose working set grown by
// one more row's share (the linear bound) would still fit. The sequences left out wait for a
// later step (the oldest run first), so all of them finish, at the cache's pace.
#pragma once

#include <algorithm>
#include <cstdint>

namespace expertd::engine {

class BatchWidth {
 public:
  static constexpr double kFill = 0.85;

  explicit BatchWidth(uint32_t most) : most_(std::max(most, 1u)), width_(most_) {}

  // Rows the next step may take.
  uint32_t width() const { return width_; }

  // A step of `rows` rows acquired `experts` distinct experts from tiers of `capacity` experts
  // (0: not known, no limit).
  void observe(uint32_t rows, uint64_t experts, uint32_t capacity) {
    if (capacity == 0 || rows == 0) return;
    const double fits = kFill * capacity;
    if (static_cast<double>(experts) > fits && rows > 1) {
      width_ = std::min(width_, rows - 1);
    } else if (rows >= width_ && width_ < most_ &&
               static_cast<double>(experts) * (rows + 1) / rows <= fits) {
      width_ = rows + 1;
    }
  }

 private:
  uint32_t most_;
  uint32_t width_;
};

}  // namespace expertd::engine
