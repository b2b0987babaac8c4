// The CPU reference forward of qwen3moe, one token at a time over a KV cache.
//
// Per layer: RMSNorm → q/k/v projections → per-head q/k RMSNorm → NEOX RoPE → causal GQA attention
// over the cache → output projection → residual; RMSNorm → router (softmax over the experts, top-k,
// renormalised) → SwiGLU experts from the ExpertSource, weighted → residual. Then the output norm
// and head give the logits. Weights are used in their GGUF encoding (dequantised row by row);
// arithmetic is float with double accumulation.
//
// Router-driven prefetch: once layer L's attention is done, the routers of layers L+1..L+depth are
// applied to the residual stream (each through its own ffn_norm) and the top `width` experts of
// each, not yet hinted for this token, are sent to the source as hints with their probabilities.
// The cursor (token position, layer) is published at the start of every layer.
//
// Owns the KV cache and every scratch buffer, sized at create(); decode() allocates nothing
// unless a routing log is attached. Not thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "engine/expert_source.h"
#include "engine/model.h"

namespace expertd::engine {

struct EngineOptions {
  uint32_t max_context = 0;     // positions the KV cache holds (required)
  uint32_t prefetch_depth = 0;  // layers ahead to predict; 0 sends no hints
  uint32_t prefetch_width = 0;  // candidates per predicted layer; 0 = the model's top-k
};

// One routing decision, in the canonical trace's terms (experts by descending probability).
struct RoutingRecord {
  uint32_t token = 0;  // position in the sequence
  uint32_t layer = 0;
  std::vector<uint32_t> experts;
  std::vector<float> weights;
};

struct EngineStats {
  uint64_t tokens = 0;
  uint64_t experts_used = 0;     // experts acquired and computed
  uint64_t stall_ns = 0;         // time inside ExpertSource::get(): waiting for experts
  uint64_t decode_ns = 0;        // time inside decode(), stall included
  uint64_t hints_sent = 0;       // prefetch hints (distinct per token, layer and expert)
  uint64_t hinted_routed = 0;    // hints whose expert the layer then routed to
  uint64_t routed_hintable = 0;  // routed experts of layers >= 1 (hintable from an earlier layer)
  uint64_t hint_errors = 0;      // prefetch / set_cursor calls the source refused

  // Hinted experts later routed / hints; routed experts that were hinted / routed experts of
  // layers >= 1. Zero when nothing was hinted.
  double prefetch_precision() const {
    return hints_sent == 0 ? 0.0 : static_cast<double>(hinted_routed) / hints_sent;
  }
  double prefetch_recall() const {
    return routed_hintable == 0 ? 0.0 : static_cast<double>(hinted_routed) / routed_hintable;
  }
};

class CpuEngine {
 public:
  // `model` and `source` must outlive the engine.
  static Result<std::unique_ptr<CpuEngine>> create(const DenseModel& model, ExpertSource& source,
                                                   const EngineOptions& options);

  // Feeds `token` at the next position and writes the next token's logits (n_vocab floats).
  // Errors: a token outside the vocabulary, a full KV cache, an expert the source cannot give.
  Status decode(uint32_t token, std::span<float> logits);

  // Forgets the sequence (the KV cache is reused from position 0).
  void reset() { pos_ = 0; }
  uint32_t position() const { return pos_; }
  const EngineStats& stats() const { return stats_; }
  const ModelParams& params() const { return p_; }
  // Appends every routing decision to `log` (nullptr: stop). Allocates per decision.
  void set_routing_log(std::vector<RoutingRecord>* log) { routing_log_ = log; }

 private:
  CpuEngine(const DenseModel& model, ExpertSource& source, const EngineOptions& options);

  void attention(uint32_t layer);
  void route(uint32_t layer);
  void send_hints(uint32_t layer);
  Status moe(uint32_t layer);
  uint64_t kv_index(uint32_t layer, uint32_t pos) const {
    return (uint64_t{layer} * opts_.max_context + pos) * kv_dim_;
  }

  const DenseModel& model_;
  ExpertSource& source_;
  const ModelParams& p_;
  EngineOptions opts_;
  uint32_t pos_ = 0;
  uint64_t kv_dim_ = 0;
  EngineStats stats_;
  std::vector<RoutingRecord>* routing_log_ = nullptr;

  std::vector<float> k_cache_;  // [layer][pos][kv head][head_dim]
  std::vector<float> v_cache_;
  std::vector<float> x_;         // residual stream, n_embd
  std::vector<float> xn_;        // normalised input of the current block, n_embd
  std::vector<float> q_;         // n_head * head_dim
  std::vector<float> k_;         // n_head_kv * head_dim
  std::vector<float> v_;         // n_head_kv * head_dim
  std::vector<float> att_;       // attention output, n_head * head_dim
  std::vector<float> tmp_;       // n_embd
  std::vector<float> row_;       // one dequantised weight row (the widest)
  std::vector<double> scores_;   // attention scores, max_context
  std::vector<double> acc_;      // head output / MoE combine accumulator (max of n_embd, head_dim)
  std::vector<float> router_;    // router logits, n_expert
  std::vector<double> probs_;    // router probabilities, n_expert
  std::vector<uint32_t> order_;  // expert indices sorted by probability
  std::vector<uint32_t> selected_;  // routed experts of the current layer, top-k
  std::vector<float> weights_;      // their renormalised weights
  std::vector<float> gate_;         // n_ff
  std::vector<float> up_;           // n_ff
  std::vector<ExpertView> views_;   // top-k held experts
  std::vector<float> pxn_;          // prefetch: normalised residual, n_embd
  std::vector<uint8_t> hinted_;     // [layer][expert] hinted for the current token
  std::vector<ExpertHint> hints_;   // depth * width
};

}  // namespace expertd::engine
