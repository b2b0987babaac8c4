// How many sequences one decode step takes (issue 25, docs/ENGINE.md "Sequences decoded together:
// the step's width"). Two rules, the narrower wins:
//
// The tiers' capacity. Rows sharing a step share its reads only while the step's distinct experts
// stay resident until the next step wants them again. Past the tiers' capacity (the VRAM tier's
// slots plus the daemon's, EngineStats::tiers_capacity) the step evicts its own experts and every
// step reads them again: on the H200 the Mixtral-8x7B shape at 16 GiB (138 cache slots + a 32-slot
// VRAM tier) read 246 MB a token with 2 random-id streams (114 distinct experts a step) and 916 MB
// with 4 (175 a step), and 4 streams were 2.3x slower than 2. So this cap narrows by one after a
// step whose distinct experts fill more than kFill of the capacity, and widens by one after a
// full-width step whose working set grown by one more row's share (the linear bound) would still
// fit.
//
// Measured throughput. A step's distinct experts underestimate a stream's working set over several
// tokens (the same Mixtral run: 4 streams held to 2 by the cap still read 569 MB a token against
// one stream's 58), and whether sharing reads beats each stream's own locality depends on the
// routing (docs/PERFORMANCE.md "Real routing, offline"). So the step's time is measured too: per
// width, the rows per second of windows of kWindow steps at that width (waits included). First
// the widths most, most/2, ..., 1 are measured a window each, and the best becomes the width; from
// then on, after each window a neighbour measured lately and faster by more than kMargin takes
// over, else a neighbour not measured for kStale windows is tried for a window, else the width
// stays. It settles on one row a step where batching loses (the Mixtral shape above) and on
// all of them where it wins (the Qwen3 shape: 1.62x at 8 streams).
//
// The sequences left out of a step wait for a later one (the oldest run first), so all of them
// finish, at the pace of the best width found.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace expertd::engine {

class BatchWidth {
 public:
  static constexpr double kFill = 0.85;
  static constexpr uint32_t kWindow = 4;  // steps per measurement
  static constexpr uint32_t kStale = 16;  // windows after which a neighbour is measured again
  static constexpr double kMargin = 1.05;
  static constexpr double kKeep = 0.5;  // weight of the old estimate in a new window's

  explicit BatchWidth(uint32_t most)
      : most_(std::max(most, 1u)),
        cap_(most_),
        choice_(most_),
        rate_(most_ + 1, 0.0),
        age_(most_ + 1, 0),
        acc_(most_ + 1) {
    for (uint32_t w = most_; w >= 1; w /= 2) explore_.push_back(w);
    if (explore_.back() != 1) explore_.push_back(1);
  }

  // Rows the next step may take.
  uint32_t width() const { return std::min(cap_, choice_); }

  // The capacity rule: a step of `rows` rows acquired `experts` distinct experts from tiers of
  // `capacity` experts (0: not known, no limit).
  void observe(uint32_t rows, uint64_t experts, uint32_t capacity) {
    if (capacity == 0 || rows == 0) return;
    const double fits = kFill * capacity;
    if (static_cast<double>(experts) > fits && rows > 1) {
      cap_ = std::min(cap_, rows - 1);
    } else if (rows >= cap_ && cap_ < most_ &&
               static_cast<double>(experts) * (rows + 1) / rows <= fits) {
      cap_ = rows + 1;
    }
  }

  // The throughput rule: a step of `rows` rows took `ns` nanoseconds. Steps narrower than the
  // width (fewer sequences had a token) count for their own width and decide nothing.
  void observe_time(uint32_t rows, uint64_t ns) {
    if (rows == 0 || rows > most_ || ns == 0) return;
    Window& a = acc_[rows];
    a.rows += rows;
    a.ns += ns;
    ++a.steps;
    if (a.steps < kWindow) return;
    const double rate = static_cast<double>(a.rows) * 1e9 / static_cast<double>(a.ns);
    rate_[rows] = rate_[rows] > 0 ? kKeep * rate_[rows] + (1 - kKeep) * rate : rate;
    a = Window{};
    for (uint32_t w = 1; w <= most_; ++w) ++age_[w];
    age_[rows] = 0;
    if (rows != width()) return;
    if (explored_ + 1 < explore_.size()) {  // the first pass: most, most/2, ..., 1
      choice_ = explore_[++explored_];
      return;
    }
    if (explored_ + 1 == explore_.size()) {  // its end: the best of them
      ++explored_;
      uint32_t best = explore_.front();
      for (const uint32_t w : explore_)
        if (rate_[w] > rate_[best]) best = w;
      choice_ = best;
      return;
    }
    // A neighbour measured lately and faster by more than kMargin takes over; else a neighbour not
    // measured lately is tried (and given back after its window if slower); else this width stays.
    const uint32_t lo = rows > 1 ? rows - 1 : rows;
    const uint32_t hi = std::min(rows + 1, std::min(cap_, most_));
    auto fresh = [&](uint32_t c) { return rate_[c] > 0 && age_[c] <= kStale; };
    uint32_t best = rows;
    for (const uint32_t c : {lo, hi}) {
      if (c != rows && fresh(c) && rate_[c] > kMargin * rate_[best]) best = c;
    }
    if (best == rows) {
      for (const uint32_t c : {lo, hi}) {
        if (c != rows && !fresh(c)) {
          best = c;
          break;
        }
      }
    }
    choice_ = best;
  }

  // Rows per second measured at `rows` a step (0: not yet).
  double rate(uint32_t rows) const { return rows <= most_ ? rate_[rows] : 0.0; }

 private:
  struct Window {
    uint64_t rows = 0;
    uint64_t ns = 0;
    uint32_t steps = 0;
  };
  uint32_t most_;
  uint32_t cap_;     // the capacity rule's width
  uint32_t choice_;  // the throughput rule's
  std::vector<double> rate_;
  std::vector<uint32_t> age_;  // windows since the width was last measured
  std::vector<Window> acc_;
  std::vector<uint32_t> explore_;  // the first pass's widths
  size_t explored_ = 0;            // its position
};

}  // namespace expertd::engine
