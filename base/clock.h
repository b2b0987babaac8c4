// The one clock of expertd: CLOCK_MONOTONIC in nanoseconds. Every duration, deadline and
// timestamp the daemon, the client, the engine and the tools compute comes from here.
#pragma once

#include <time.h>

#include <cstdint>

namespace expertd {

inline uint64_t monotonic_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000ull + static_cast<uint64_t>(ts.tv_nsec);
}

inline uint64_t monotonic_ms() { return monotonic_ns() / 1'000'000ull; }

}  // namespace expertd
