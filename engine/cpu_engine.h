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

#include "engine/engine.h"
#include "engine/expert_source.h"
#include "engine/model.h"

namespace expertd::engine {

class CpuEngine final : public Engine {
 public:
  // `model` and `source` must outlive the engine.
  static Result<std::unique_ptr<CpuEngine>> create(const DenseModel& model, ExpertSource& source,
                                                   const EngineOptions& options);

  // Feeds `token` at the next position and writes the next token's logits (n_vocab floats).
  // Errors: a token outside the vocabulary, a full KV cache, an expert the source cannot give.
  Status decode(uint32_t token, std::span<float> logits) override;

  // Forgets the sequence (the KV cache is reused from position 0).
  void reset() override { pos_ = 0; }
  uint32_t position() const override { return pos_; }
  const EngineStats& stats() const override { return stats_; }
  const ModelParams& params() const override { return p_; }
  const EngineOptions& options() const override { return opts_; }
  // Appends every routing decision to `log` (nullptr: stop). Allocates per decision.
  void set_routing_log(std::vector<RoutingRecord>* log) override { routing_log_ = log; }
  std::string name() const override { return "cpu"; }
  std::string description() const override;

 private:
  CpuEngine(const DenseModel& model, ExpertSource& source, const EngineOptions& options);
  EngineStats& mutable_stats() override { return stats_; }

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
  HintPlanner planner_;
};

// The CPU engine for `model`'s architecture: CpuEngine (qwen3moe) or Ds4CpuEngine (deepseek4).
Result<std::unique_ptr<Engine>> create_cpu_engine(const DenseModel& model, ExpertSource& source,
                                                  const EngineOptions& options);

}  // namespace expertd::engine
