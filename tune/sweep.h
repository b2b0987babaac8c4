// `expert-tune sweep`: replays a routing trace against a running expertd once per setting of
// (prefetch depth × queue depth × cache size), with real reads, and reports per setting the stall
// per token (p50, p99), tokens/s, hit rate, bytes read per token, the prefetch's useful and wasted
// bytes (the daemon's telemetry by depth) and the bandwidth bound; marks the best setting and
// prints the flags and expertd.toml lines that apply it; optionally plots it all as SVG.
//
// Every setting starts from an empty cache (evict_all, policy history reset) so they compare. The
// daemon's tuning (prefetch depth, queue depth, cache limit) is restored afterwards; the cache is
// left empty.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace expertd::tune {

// A --depths entry for expertd's automatic depth (the daemon's default): the replay hints
// kSweepAutoHintDepth layers ahead and the daemon chooses how deep to read from its measured hint
// precision; the report shows the depth it chose and its admission counts.
inline constexpr uint32_t kSweepAutoDepth = 0xffffffffu;
inline constexpr uint32_t kSweepAutoHintDepth = 2;  // cache/scheduler.h kPrefetchAutoMaxDepth

struct SweepOptions {
  std::string socket;
  std::string model;
  std::string trace;
  std::vector<uint32_t> depths{0, 1, 2, 3, kSweepAutoDepth};
  std::vector<uint32_t> queue_depths;  // empty: the daemon's
  std::vector<std::string> caches;     // sizes (expertd's syntax); empty: the daemon's whole cache
  double compute_us_per_layer = 100;
  std::string predictor = "oracle";
  uint64_t seed = 1;
  uint32_t max_tokens = 0;  // 0: the whole trace
  uint32_t repeat = 1;      // rounds over all settings; each reports its median run
  double disk_gbps = 0;     // 0: measure it through the daemon first
  std::string plot;         // SVG path, or empty
  bool json = false;
};

// Runs the sweep; returns the exit status (0, 1 for a failure, 2 for bad arguments) after printing
// the result on stdout and any error as one line on stderr.
int run_sweep(const SweepOptions& options);

}  // namespace expertd::tune
