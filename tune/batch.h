// Sequences decoded together, offline (issue 25): how many expert reads batching saves on a
// routing trace, with no daemon and no GPU. N streams of the trace's tokens are decoded in
// lockstep, one token of each per step; each step's layer needs the union of its rows' experts
// (one read serves every row that routes to an expert, as GpuEngine/CpuEngine::decode_batch acquire
// it), and those unions go through one cache of C experts run by a replacement policy
// (policy/policy.h's simulate_policy, the daemon's own policies) and through Belady's optimum.
// Misses per generated token is what a disk-bound decoder pays per token, so misses per token with
// one stream over misses per token with N is the most batching can speed up decode that waits on
// the disk (its "read factor").
//
// Streams: the trace's tokens, in order (several traces one after another), cut into N consecutive
// segments of floor(T / N) tokens, each decoded from its own start, so every stream keeps the
// trace's own locality from token to token; the tokens left over are dropped. N = 1 decodes
// floor(T / 1) = T tokens, N = 4 four segments of T / 4: the same tokens in all, batched or not.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "expertd/result.h"
#include "trace/trace.h"

namespace expertd::tune {

struct BatchSimResult {
  uint32_t streams = 0;
  uint32_t capacity = 0;       // cache size in experts
  uint64_t steps = 0;          // tokens per stream
  uint64_t tokens = 0;         // steps x streams
  uint64_t routed = 0;         // expert uses, every row's (what N unbatched decoders acquire)
  uint64_t accesses = 0;       // distinct (layer, expert) per step, summed (what a batch acquires)
  uint64_t misses = 0;         // of those, reads through the policy's cache
  uint64_t belady_misses = 0;  // the fewest reads any policy of this capacity could make
  uint32_t layers = 0;
  double distinct_per_layer() const {
    return steps && layers ? static_cast<double>(accesses) / (steps * layers) : 0.0;
  }
  double misses_per_token() const { return tokens ? static_cast<double>(misses) / tokens : 0.0; }
  double belady_misses_per_token() const {
    return tokens ? static_cast<double>(belady_misses) / tokens : 0.0;
  }
};

// One result per (streams, capacity), streams-major. Errors: no trace or no token, a stream count
// of 0 or more than the tokens, a capacity of 0, an unknown policy (policy_names() lists them).
Result<std::vector<BatchSimResult>> simulate_batches(std::span<const Trace> traces,
                                                     std::span<const uint32_t> streams,
                                                     std::span<const uint32_t> capacities,
                                                     std::string_view policy);

}  // namespace expertd::tune
