// The CPU reference forward of qwen3moe, Mixtral (`llama` with experts: no q/k norms, NORM
// RoPE), gpt-oss (no q/k norms; biases on q/k/v/o, router and experts; attention sinks; a
// sliding window on even layers; softmax over the top-k router logits; the clamped SwiGLU; YaRN)
// and GLM-4.5 (`glm4moe`: q/k/v biases, optional q/k norms, NEOX RoPE on the first n_rot
// dimensions only, leading dense layers, DeepSeek-V3's routing (ds3_route) and a shared expert;
// the MTP blocks are not run), one token at a time over a KV cache.
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
// prefill() runs a prompt in chunks of EngineOptions::prefill_chunk positions, layer by layer over
// the whole chunk: the projections are matrix-matrix products (each weight row dequantised once
// for every position), attention is causal per position over the cache, and the MoE is grouped by
// expert: every expert the chunk's layer routed to is hinted, then acquired once (in groups of at
// most top-k, so a small daemon cache never has to hold the whole layer) and applied to all its
// positions. Each position's output is combined in its route's order, as decode() does, so the
// logits are decode()'s to the bit.
//
// Sequences (EngineOptions::sequences, at most kMaxSequences): each has its own KV cache of
// max_context positions; decode_batch() runs one step of several as a prefill chunk whose rows
// belong to different sequences at their own positions: the projections are matrix products over
// the rows, each row attends over its own sequence's cache, and every routed expert the step
// needs is acquired once and applied to all the rows that route to it. Each row's logits are
// decode()'s of its sequence alone, to the bit.
//
// Owns the KV caches and every scratch buffer (the prefill ones sized by the chunk, at least the
// sequences), sized at create(); decode(), prefill() and decode_batch() allocate nothing unless a
// routing log is attached. Not thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "engine/cpu_ops.h"
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
  // The batched forward of the prompt (see above). After an error the positions of the failed
  // chunk are not kept; earlier chunks are.
  // The KV cache is per position, so any prefix can be kept.
  bool truncate(uint32_t n) override;

  // Forgets the selected sequence (its KV cache is reused from position 0).
  void reset() override { pos_ = 0; }
  static constexpr uint32_t kMaxSequences = 256;
  uint32_t sequences() const override { return opts_.sequences; }
  Status select_sequence(uint32_t sequence) override;
  uint32_t selected_sequence() const override { return cur_; }
  Status decode_batch(std::span<const BatchRow> rows, std::span<float> logits) override;
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
  // Per-head q/k norms and RoPE at `pos`, then k and v into sequence `seq`'s cache.
  void place_qkv(uint32_t seq, uint32_t layer, uint32_t pos, float* q, float* k, const float* v);
  // Causal attention of `q` at `pos` over sequence `seq`'s cache[0..pos] into `att`
  // (n_head * head_dim).
  void attend(uint32_t seq, uint32_t layer, uint32_t pos, const float* q, float* att);
  // RoPE of one head at `pos` (YaRN's frequencies when the model has them).
  void rotate(float* v, uint32_t pos) const;
  void route(uint32_t layer);
  // Top-k of layer w's router logits (n_expert) into selected/weights (k each), renormalised as
  // configured (glm4moe: DeepSeek-V3's ds3_route).
  void select(const LayerWeights& w, const float* logits, uint32_t* selected, float* weights);
  // probs_ = the lookahead's ranking of layer w's experts from its router logits.
  void hint_probs(const LayerWeights& w, const float* logits);
  // SwiGLU MLP (glm4moe's dense layers and shared expert) of n rows of x ([n][n_embd]) into out
  // ([n][n_embd]); g and u hold [n][gate.rows].
  void mlp(const Matrix& gate, const Matrix& up, const Matrix& down, const float* x, uint32_t n,
           float* g, float* u, float* out);
  void send_hints(uint32_t layer);
  Status moe(uint32_t layer);
  // prefill() of one chunk (n <= prefill chunk positions from pos_); logits only when non-empty.
  uint32_t prefill_chunk_size() const override { return chunk_; }
  Status prefill_chunk(std::span<const uint32_t> tokens, std::span<float> logits) override;
  // The layers over the n rows of cx_ (rseq_/rpos_ say each row's sequence and position); the
  // cursor names `last`, the pass's last position.
  Status rows_forward(uint32_t n, uint32_t last);
  void prefill_attention(uint32_t layer, uint32_t n);
  void prefill_hints(uint32_t layer, uint32_t n);
  void prefill_route(uint32_t layer, uint32_t n);
  Status prefill_moe(uint32_t layer, uint32_t n);
  uint64_t kv_index(uint32_t seq, uint32_t layer, uint32_t pos) const {
    return ((uint64_t{seq} * p_.n_layer + layer) * opts_.max_context + pos) * kv_dim_;
  }

  const DenseModel& model_;
  ExpertSource& source_;
  const ModelParams& p_;
  EngineOptions opts_;
  uint32_t pos_ = 0;               // the selected sequence's position
  uint32_t cur_ = 0;               // the selected sequence
  std::vector<uint32_t> seq_pos_;  // every sequence's position (cur_'s is pos_ while selected)
  uint64_t kv_dim_ = 0;
  EngineStats stats_;
  std::vector<RoutingRecord>* routing_log_ = nullptr;

  std::vector<float> k_cache_;  // [sequence][layer][pos][kv head][head_dim]
  std::vector<float> v_cache_;
  std::vector<float> x_;         // residual stream, n_embd
  std::vector<float> xn_;        // normalised input of the current block, n_embd
  std::vector<float> q_;         // n_head * head_dim
  std::vector<float> k_;         // n_head_kv * head_dim
  std::vector<float> v_;         // n_head_kv * head_dim
  std::vector<float> att_;       // attention output, n_head * head_dim
  std::vector<float> tmp_;       // n_embd
  std::vector<float> row_;       // one dequantised weight row (the widest)
  std::vector<double> scores_;   // attention scores, max_context + 1 (a sink)
  std::vector<double> acc_;      // head output / MoE combine accumulator (max of n_embd, head_dim)
  std::vector<float> router_;    // router logits, n_expert
  std::vector<double> probs_;    // router probabilities, n_expert
  std::vector<double> sel_;      // glm4moe: the selection scores (probs + bias), n_expert
  std::vector<uint32_t> order_;  // expert indices sorted by probability
  std::vector<uint32_t> selected_;  // routed experts of the current layer, top-k
  std::vector<float> weights_;      // their renormalised weights
  std::vector<float> gate_;         // the widest MLP (n_ff_exp; glm4moe's dense or shared one)
  std::vector<float> up_;           // as gate_
  std::vector<ExpertView> views_;   // top-k held experts
  std::vector<float> pxn_;          // prefetch: normalised residual, n_embd
  HintPlanner planner_;

  // prefill(): C = min(prefill_chunk, max_context) positions.
  uint32_t chunk_ = 0;             // C
  std::vector<uint32_t> rseq_;     // each row's sequence, [C]
  std::vector<uint32_t> rpos_;     // and position, [C]
  uint32_t cursor_ = 0;            // rows_forward()'s last position (the cursor's)
  std::vector<float> cx_;          // residual streams, [C][n_embd]
  std::vector<float> cxn_;         // normalised block inputs, [C][n_embd]
  std::vector<float> cq_;          // [C][n_head * head_dim]
  std::vector<float> ck_;          // [C][kv_dim]
  std::vector<float> cv_;          // [C][kv_dim]
  std::vector<float> catt_;        // [C][n_head * head_dim]
  std::vector<float> ctmp_;        // [C][n_embd]
  std::vector<float> clogits_;     // router logits, [C][n_expert]
  std::vector<uint32_t> csel_;     // routes, [C][k]
  std::vector<float> cweights_;    // [C][k]
  std::vector<float> cout_;        // each route slot's expert output, [C][k][n_embd]
  ExpertGroups groups_;            // the chunk's layer's route slots by expert
  std::vector<ExpertHint> exact_;  // their hints
  std::vector<float> cgx_;         // one expert's inputs, [C][n_embd]
  std::vector<float> cgate_;       // [C][the widest MLP]
  std::vector<float> cup_;         // [C][the widest MLP]
  std::vector<float> cdown_;       // [C][n_embd]
  std::vector<double> topk_;       // gpt-oss: the selected router logits, k
  std::vector<double> inv_freq_;   // YaRN's rope frequencies (empty: plain RoPE)
  double mscale_ = 1.0;            // YaRN's attention factor
};

// prefill() on the CPU: the routed-expert half of a chunk's MoE layer, shared by the CPU engines
// whose experts are a SwiGLU (plain, or gpt-oss's clamped one with biases). Every expert `groups`
// needs is hinted first when there are more than k, then acquired k at a time (a cache sized for
// decode never has to hold a layer) and applied to all its positions: route slot s (position s / k)
// gets down(silu(gate x) * up x) at out + s * n_embd, x the position's row of `x`
// ([position][n_embd]). The matmuls give each output the double-accumulated dot decode()'s matvec
// computes, so the results are decode()'s.
struct ChunkExperts {
  std::span<ExpertView> views;  // k
  std::span<ExpertHint> exact;  // n_expert
  float* gx = nullptr;          // [C][n_embd]: one expert's inputs
  float* gate = nullptr;        // [C][n_ff]
  float* up = nullptr;          // [C][n_ff]
  float* down = nullptr;        // [C][n_embd]
  float* row = nullptr;         // one dequantised weight row (max of n_embd, n_ff)
  // gpt-oss: the layer whose expert biases and clamped SwiGLU apply (null: plain SwiGLU).
  const LayerWeights* gptoss = nullptr;
};
Status run_chunk_experts(ExpertSource& source, uint32_t layer, const ExpertGroups& groups,
                         uint32_t k, uint32_t last_pos, const float* x, uint64_t n_embd,
                         uint64_t n_ff, float* out, const ChunkExperts& scratch,
                         EngineStats& stats);

// The output norm and head of one residual row `x` (n_embd) into `logits` (n_vocab): the last step
// of CpuEngine's and Ds3CpuEngine's decode, prefill and batch steps. `xn` (n_embd) and `row` (a
// dequantised weight row) are scratch.
void cpu_head(const DenseModel& model, const float* x, float* xn, float* logits, float* row);

// decode_batch() of the CPU engines that run a step as one pass over rows (CpuEngine,
// Ds3CpuEngine), around their `forward(n, last)`: the rows checked (each sequence's cache has
// room), each row's embedding into rows.cx ([n][n_embd]) and its sequence and position into
// rows.seq / rows.pos, the pass, each row's head into logits ([n][n_vocab]), every row's sequence
// moved on in `seq_pos` (the selected sequence `cur`'s position `pos` stored there first, and
// read back after), and the step counted (its acquires as the batch's, not prefill's).
struct RowsStep {
  uint32_t* seq = nullptr;  // [n]
  uint32_t* pos = nullptr;  // [n]
  float* cx = nullptr;      // [n][n_embd]
  float* xn = nullptr;      // n_embd
  float* row = nullptr;     // a dequantised weight row
};
Status cpu_batch_step(const Engine& engine, const DenseModel& model, uint32_t max_context,
                      std::span<const BatchRow> rows, std::span<float> logits,
                      std::span<uint32_t> seq_pos, uint32_t cur, uint32_t& pos,
                      const RowsStep& step, EngineStats& stats,
                      const std::function<Status(uint32_t n, uint32_t last)>& forward);
// prefill_chunk() of those engines: the tokens of sequence `cur` at positions [pos, pos + n) as the
// rows of one pass, the last row's head into logits (when non-empty), pos moved on, the routing
// records from `log`'s end put in token order and the chunk counted.
Status cpu_prefill_rows(const DenseModel& model, std::span<const uint32_t> tokens,
                        std::span<float> logits, uint32_t cur, uint32_t& pos, const RowsStep& step,
                        std::vector<RoutingRecord>* log, EngineStats& stats,
                        const std::function<Status(uint32_t n, uint32_t last)>& forward);
// select_sequence() of those engines, after Engine's check: the selected sequence `cur`'s
// position `pos` stored in seq_pos, `sequence` selected and its position loaded.
void switch_sequence(std::span<uint32_t> seq_pos, uint32_t& cur, uint32_t& pos, uint32_t sequence);

// The CPU engine for `model`'s architecture: CpuEngine (qwen3moe, llama, gpt-oss, glm4moe),
// Ds4CpuEngine (deepseek4) or Ds3CpuEngine (deepseek2).
Result<std::unique_ptr<Engine>> create_cpu_engine(const DenseModel& model, ExpertSource& source,
                                                  const EngineOptions& options);

}  // namespace expertd::engine
