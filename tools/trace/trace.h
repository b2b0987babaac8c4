// Routing traces: which experts each (token, layer) was routed to, in time order.
//
// Canonical form: JSON Lines, one record per (token, layer), token-major with layers ascending:
//   {"token": 12, "layer": 3, "experts": [5, 2], "weights": [0.71, 0.29]}
// (an optional "predicted" object is accepted and ignored here). Errors name the file and line.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "daemon/policy.h"
#include "storage/result.h"

namespace expertd {

struct TraceRecord {
  uint32_t token = 0;
  uint32_t layer = 0;
  std::vector<uint32_t> experts;
  std::vector<float> weights;
};

struct Trace {
  std::vector<TraceRecord> records;
  uint32_t layers = 0;   // 1 + the largest layer seen
  uint32_t experts = 0;  // 1 + the largest expert id seen
  uint32_t tokens = 0;   // distinct tokens
  // Every routed expert of every record, in file order and listed order.
  std::vector<ExpertKey> accesses() const;
};

Result<Trace> load_trace_jsonl(const std::string& path);

// A generated trace with locality like a real one, for machines without ../shared/traces: each
// layer routes by a skewed (Zipf-like) popularity over its experts, and each expert chosen for
// the previous token is kept with probability `reuse` (OLMoE and Mixtral keep about 40%).
Trace make_synthetic_trace(uint32_t tokens, uint32_t layers, uint32_t experts, uint32_t top_k,
                           uint64_t seed, double reuse = 0.4);

}  // namespace expertd
