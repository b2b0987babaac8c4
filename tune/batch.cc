#include "tune/batch.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>

#include "policy/policy.h"

namespace expertd::tune {
namespace {

// Every token's routing: [token][layer] -> experts (empty where the trace has no record).
using Token = std::vector<std::vector<uint32_t>>;

std::vector<Token> tokens_of(std::span<const Trace> traces, uint32_t layers) {
  std::vector<Token> out;
  for (const Trace& t : traces) {
    bool first = true;
    uint32_t current = 0;
    for (const TraceRecord& r : t.records) {
      if (first || r.token != current) {
        out.emplace_back(layers);
        current = r.token;
        first = false;
      }
      out.back()[r.layer] = r.experts;
    }
  }
  return out;
}

}  // namespace

Result<std::vector<BatchSimResult>> simulate_batches(std::span<const Trace> traces,
                                                     std::span<const uint32_t> streams,
                                                     std::span<const uint32_t> capacities,
                                                     std::string_view policy) {
  uint32_t layers = 0;
  uint32_t experts = 0;
  for (const Trace& t : traces) {
    layers = std::max(layers, t.layers);
    experts = std::max(experts, t.experts);
  }
  const std::vector<Token> tokens = tokens_of(traces, layers);
  if (tokens.empty()) return make_error(EINVAL, "the traces hold no token");
  std::vector<BatchSimResult> out;
  for (const uint32_t n : streams) {
    if (n == 0 || n > tokens.size()) {
      return make_error(EINVAL, fmt::format("{} streams of {} tokens: give 1 to {} streams", n,
                                            tokens.size(), tokens.size()));
    }
    const uint64_t steps = tokens.size() / n;
    // A step's layer: the union of its rows' experts, ascending, one visit.
    std::vector<ExpertKey> acc;
    uint64_t routed = 0;
    std::vector<uint32_t> seen;
    for (uint64_t t = 0; t < steps; ++t) {
      for (uint32_t l = 0; l < layers; ++l) {
        seen.clear();
        for (uint32_t s = 0; s < n; ++s) {
          const std::vector<uint32_t>& e = tokens[s * steps + t][l];
          routed += e.size();
          seen.insert(seen.end(), e.begin(), e.end());
        }
        std::sort(seen.begin(), seen.end());
        seen.erase(std::unique(seen.begin(), seen.end()), seen.end());
        for (const uint32_t e : seen) acc.push_back(ExpertKey{l, e});
      }
    }
    for (const uint32_t c : capacities) {
      if (c == 0) return make_error(EINVAL, "a cache of 0 experts");
      auto r = simulate_policy(policy, PolicyShape{c, layers, experts}, acc);
      if (!r) return r.error();
      const SimResult b = simulate_belady(c, acc);
      BatchSimResult x;
      x.streams = n;
      x.capacity = c;
      x.steps = steps;
      x.tokens = steps * n;
      x.routed = routed;
      x.accesses = acc.size();
      x.misses = r->accesses - r->hits;
      x.belady_misses = b.accesses - b.hits;
      x.layers = layers;
      out.push_back(x);
    }
  }
  return out;
}

}  // namespace expertd::tune
