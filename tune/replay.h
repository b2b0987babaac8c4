// Replaying a routing trace against a running expertd, as the GPU engine would drive it: for each
// (token, layer) record, set the session's cursor, send the predictor's hints for the next d
// layers, acquire the layer's experts, hold them for the compute time, release. `expert-tune
// replay` runs it once; `expert-tune sweep` once per setting.
//
// Trace layers and experts are folded onto the model's MoE layers and experts (a trace of another
// shape still replays its locality; a trace of the model's own shape maps one to one).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "expertd/client.h"
#include "expertd/result.h"
#include "storage/expert_key.h"
#include "trace/trace.h"

namespace expertd::tune {

// Trace (layer, expert) → the model's (block layer, expert).
class TraceMapping {
 public:
  // Errors when the model has no MoE layer.
  static Result<TraceMapping> make(const client::ModelLayout& layout);
  ExpertKey key(uint32_t trace_layer, uint32_t trace_expert) const {
    return ExpertKey{moe_layers_[trace_layer % moe_layers_.size()], trace_expert % experts_};
  }
  uint32_t moe_layers() const { return static_cast<uint32_t>(moe_layers_.size()); }
  uint32_t experts() const { return experts_; }

 private:
  std::vector<uint32_t> moe_layers_;  // block index of each MoE layer
  uint32_t experts_ = 0;
};

// A trace with an index from (token, layer) to its record.
class IndexedTrace {
 public:
  explicit IndexedTrace(Trace trace);
  const Trace& trace() const { return trace_; }
  const std::vector<TraceRecord>& records() const { return trace_.records; }
  // The record `ahead` layers after record `i` (the trace's layer count wraps to the next
  // token), or -1 when the trace has none there.
  int64_t ahead(size_t i, uint32_t ahead) const;
  // Records [0, end) hold the first `tokens` tokens (0: all).
  size_t end_of_tokens(uint32_t tokens) const;

 private:
  Trace trace_;
  std::vector<uint64_t> keys_;  // (token << 32 | layer) of each record, ascending
};

// What a router lookahead predicts for a record from `depth` layers earlier (trace expert ids).
struct Prediction {
  uint32_t expert = 0;
  float score = 0;  // in [0, 1]
};

class Predictor {
 public:
  virtual ~Predictor() = default;
  virtual std::string name() const = 0;
  // Appends the predictions for record `target` made `depth` (>= 1) layers before it. The same
  // arguments always give the same predictions (every sweep setting sees the same hints).
  virtual void predict(size_t target, uint32_t depth, std::vector<Prediction>& out) const = 0;
};

// "oracle" (the record's own experts and weights), "noisy:RECALL" (each true expert kept with
// probability RECALL, the rest filled with random wrong ones, seeded by `seed`) or "recorded" (the
// trace's "predicted" lists; an error naming `trace_path` when it has none).
Result<std::unique_ptr<Predictor>> make_predictor(std::string_view spec, const IndexedTrace& trace,
                                                  const std::string& trace_path, uint64_t seed);

struct ReplayOptions {
  uint32_t depth = 0;                 // layers ahead to hint (0: no hints)
  uint64_t compute_ns_per_layer = 0;  // how long each layer's experts are held
  uint32_t max_tokens = 0;            // 0: the whole trace
  const Predictor* predictor = nullptr;
};

struct ReplayResult {
  uint32_t tokens = 0;
  uint64_t records = 0;
  uint64_t wall_ns = 0;
  std::vector<uint64_t> stall_ns;  // per token: time spent waiting in acquire
};

// Called every record with (tokens done, tokens in all); may print progress.
using ReplayProgress = std::function<void(uint32_t, uint32_t)>;

Result<ReplayResult> replay_trace(client::Session& session, const IndexedTrace& trace,
                                  const TraceMapping& mapping, const ReplayOptions& options,
                                  const ReplayProgress& progress = {});

// The q-quantile (0..1) of `values` (nearest rank); 0 for none.
double quantile(std::vector<uint64_t> values, double q);

}  // namespace expertd::tune
