// LogLimit: lets at most kBurst log lines through per window of kWindowNs, and counts the rest, so
// that a peer reconnecting in a loop or a disk failing every read cannot flood the journal. The
// next line let through says how many were left out (suppressed_note()). Owns nothing but its
// counters; one owner thread (not thread-safe).
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "base/clock.h"

namespace expertd {

class LogLimit {
 public:
  static constexpr uint32_t kBurst = 5;
  static constexpr uint64_t kWindowNs = 10'000'000'000;

  // True when this line may be logged now; false counts it as left out.
  bool allow() {
    const uint64_t now = monotonic_ns();
    if (now - window_start_ >= kWindowNs) {
      window_start_ = now;
      in_window_ = 0;
    }
    if (in_window_ < kBurst) {
      ++in_window_;
      return true;
    }
    ++suppressed_;
    return false;
  }
  // Counts `n` lines left out without asking (they were lost before they could be offered).
  void skip(uint64_t n) { suppressed_ += n; }
  // " (N more WHAT not logged)" once after some were left out, else "". `what` names them in the
  // plural; one left out is named by `one`.
  std::string suppressed_note(std::string_view one, std::string_view what) {
    if (suppressed_ == 0) return {};
    const uint64_t n = std::exchange(suppressed_, 0);
    return fmt::format(" ({} more {} not logged)", n, n == 1 ? one : what);
  }

 private:
  uint64_t window_start_ = 0;
  uint32_t in_window_ = 0;
  uint64_t suppressed_ = 0;
};

}  // namespace expertd
