// The CPU reference forward of DeepSeek-V3 / Kimi-K2 (llama.cpp's `deepseek2`), one token at a
// time, matching transformers (models/deepseek_v3/modeling_deepseek_v3.py):
//
// - Multi-head latent attention in the absorbed form llama.cpp's deepseek2 graph uses: q from the
//   q LoRA (attn_q_a, q_a_norm, attn_q_b) split per head into [nope | rope]; one latent per
//   position, c = kv_a_norm(attn_kv_a_mqa · x)[0, kv_lora_rank), and one shared rope key, the
//   rest of that projection. A head scores position t as (wk_bᵀ q_nope) · c_t + q_rope · k_rope_t,
//   so keys are never decompressed; its output is wv_b · Σ_t p_t c_t. The KV cache holds only
//   c_t and k_rope_t (kv_lora_rank + n_rot floats per position and layer).
// - RoPE on adjacent pairs (the checkpoint's interleaved layout), with YaRN frequencies when the
//   file has them, and the score scale 1/sqrt(head_dim) × mscale², mscale = 1 + yarn_log_mul ·
//   ln(factor) (transformers' yarn_get_mscale(factor, mscale_all_dim)).
// - The first leading_dense_block_count layers have a dense SwiGLU MLP. The others route:
//   sigmoid (or softmax) scores; selection on scores + e_score_correction_bias restricted to the
//   expert_group_used_count groups whose two best corrected scores sum highest; weights are the
//   chosen scores, renormalised (expert_weights_norm) × expert_weights_scale; plus the shared
//   experts, which are dense weights.
//
// Router lookahead as qwen3moe's: the next MoE layers' routers on the current residual stream.
// truncate() cuts the KV cache anywhere.
//
// prefill() runs a prompt in chunks of EngineOptions::prefill_chunk positions, layer by layer over
// the chunk: attention, the dense MLP, routing and the shared experts position by position (as
// decode() computes them), the routed experts grouped by expert as qwen3moe's prefill does (each
// expert a chunk's layer routed to acquired once, at most top-k held at a time, applied to all its
// positions). Each position sums its experts in decode()'s order, so the logits are decode()'s to
// the bit.
//
// Sequences (EngineOptions::sequences, at most CpuEngine::kMaxSequences), as CpuEngine's: each
// has its own latent cache of max_context positions; decode_batch() runs one step of several as a
// prefill chunk whose rows belong to different sequences at their own positions (each row's
// attention over its own sequence's cache, every routed expert the step needs acquired once and
// applied to all the rows that route to it), so each row's logits are decode()'s of its sequence
// alone, to the bit.
//
// Owns the latent caches (sized by max_context and the sequences at create()) and every scratch
// buffer (the prefill ones sized by the chunk, at least the sequences); decode(), prefill() and
// decode_batch() allocate nothing unless a routing log is attached. Not thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "engine/cpu_ops.h"
#include "engine/engine.h"
#include "engine/expert_source.h"
#include "engine/model.h"

namespace expertd::engine {

// What both DeepSeek-V3 engines check at create(): a deepseek2 model, the options (at most
// `max_sequences` sequences), KV caches that are not absurd.
Status check_ds3_engine(const DenseModel& model, const EngineOptions& options,
                        uint32_t max_sequences = 1);

class Ds3CpuEngine final : public Engine {
 public:
  // `model` (a deepseek2 model) and `source` must outlive the engine.
  static Result<std::unique_ptr<Ds3CpuEngine>> create(const DenseModel& model, ExpertSource& source,
                                                      const EngineOptions& options);

  Status decode(uint32_t token, std::span<float> logits) override;
  // Forgets the selected sequence.
  void reset() override { pos_ = 0; }
  uint32_t sequences() const override { return opts_.sequences; }
  Status select_sequence(uint32_t sequence) override;
  uint32_t selected_sequence() const override { return cur_; }
  Status decode_batch(std::span<const BatchRow> rows, std::span<float> logits) override;
  // The cache holds positions independently: any prefix can be kept.
  bool truncate(uint32_t n) override;
  uint32_t position() const override { return pos_; }
  const EngineStats& stats() const override { return stats_; }
  const ModelParams& params() const override { return p_; }
  const EngineOptions& options() const override { return opts_; }
  void set_routing_log(std::vector<RoutingRecord>* log) override { routing_log_ = log; }
  std::string name() const override { return "cpu"; }
  std::string description() const override;

 private:
  EngineStats& mutable_stats() override { return stats_; }
  Ds3CpuEngine(const DenseModel& model, ExpertSource& source, const EngineOptions& options);

  // Sequence `seq`'s position `pos`: its attention on xn_ into out_ (its latent and rope key into
  // the sequence's cache).
  void attention(uint32_t seq, uint32_t layer, uint32_t pos);
  // Index of (seq, layer, pos) in the caches, in positions (× kv_lora_rank or × n_rot).
  uint64_t cache_pos(uint32_t seq, uint32_t layer, uint32_t pos) const {
    return (uint64_t{seq} * p_.n_layer + layer) * opts_.max_context + pos;
  }
  // The next layers' candidates from position `pos`'s residual `x` (hints are sent by flush).
  void add_lookahead(uint32_t layer, uint32_t pos, const float* x);
  void flush_hints();
  // Position `pos`'s routing from xn_ into sel / wts (k each), logged.
  void route(uint32_t layer, uint32_t pos, std::span<uint32_t> sel, std::span<float> wts);
  Status moe(uint32_t layer);
  uint32_t prefill_chunk_size() const override { return chunk_; }
  Status prefill_chunk(std::span<const uint32_t> tokens, std::span<float> logits) override;
  // The layers over the n rows of cx_ (rseq_/rpos_ say each row's sequence and position); the
  // daemon's cursor names `last`, the pass's last position.
  Status rows_forward(uint32_t n, uint32_t last);
  Status prefill_moe(uint32_t layer, uint32_t n);
  // SwiGLU MLP of xn_ into out_ (+= when `add`).
  void mlp(const WeightView& gate, const WeightView& up, const WeightView& down, bool add);

  const DenseModel& model_;
  ExpertSource& source_;
  const ModelParams& p_;
  const Ds3Params& d_;
  const Ds3Weights& w_;
  EngineOptions opts_;
  uint32_t pos_ = 0;               // the selected sequence's position
  uint32_t cur_ = 0;               // the selected sequence
  std::vector<uint32_t> seq_pos_;  // every sequence's position (cur_'s is pos_ while selected)
  uint32_t cursor_ = 0;            // rows_forward()'s last position
  EngineStats stats_;
  std::vector<RoutingRecord>* routing_log_ = nullptr;

  std::vector<double> inv_freq_;  // n_rot / 2
  double kq_scale_ = 1.0;
  std::vector<float> latent_;  // [sequence][layer][max_context][kv_lora_rank]
  std::vector<float> krope_;   // [sequence][layer][max_context][n_rot]

  std::vector<float> x_;        // residual, n_embd
  std::vector<float> xn_;       // normalised sublayer input, n_embd
  std::vector<float> qa_;       // q LoRA, q_lora_rank
  std::vector<float> q_;        // n_head * head_dim
  std::vector<float> kva_;      // kv_lora_rank + n_rot
  std::vector<float> qabs_;     // one head's query in the latent space, kv_lora_rank
  std::vector<float> olat_;     // one head's attention output in the latent space, kv_lora_rank
  std::vector<double> oacc_;    // its accumulator
  std::vector<float> att_;      // n_head * v_head_dim
  std::vector<double> scores_;  // max_context
  std::vector<float> out_;      // sublayer output, n_embd
  std::vector<double> acc_;     // n_embd
  std::vector<float> row_;      // one dequantised weight row (the widest)
  std::vector<float> router_;   // n_expert
  std::vector<double> probs_;   // n_expert
  std::vector<double> sel_;     // n_expert
  std::vector<uint32_t> order_;
  std::vector<uint32_t> selected_;
  std::vector<float> weights_;
  std::vector<float> gate_, up_, tmp_;  // max(n_ff, n_ff_exp * max(1, n_shared)), n_embd
  std::vector<ExpertView> views_;
  HintPlanner planner_;

  // prefill(): chunk_ = min(prefill_chunk, max_context) positions; the buffers below hold
  // C = max(chunk_, sequences) rows (a decode_batch() step has a row per sequence).
  uint32_t chunk_ = 0;
  std::vector<uint32_t> rseq_;     // each row's sequence, [C]
  std::vector<uint32_t> rpos_;     // each row's position, [C]
  std::vector<float> cx_;          // residuals, [C][n_embd]
  std::vector<float> cxn_;         // normalised MoE inputs, [C][n_embd]
  std::vector<uint32_t> csel_;     // routes, [C][k]
  std::vector<float> cweights_;    // [C][k]
  std::vector<float> cout_;        // each route slot's expert output, [C][k][n_embd]
  ExpertGroups groups_;            // the chunk's layer's route slots by expert
  std::vector<ExpertHint> exact_;  // n_expert
  std::vector<float> cgx_;         // one expert's inputs, [C][n_embd]
  std::vector<float> cgate_;       // [C][n_ff_exp]
  std::vector<float> cup_;         // [C][n_ff_exp]
  std::vector<float> cdown_;       // [C][n_embd]
};

// The host side of the deepseek2 forward, shared by the CPU and CUDA engines (the routing also by
// CpuEngine's glm4moe, whose MoE block is DeepSeek-V3's).

// The inverse rope frequencies (YaRN when the file has it) and the attention score scale.
std::vector<double> ds3_inv_freq(const ModelParams& p);
double ds3_kq_scale(const ModelParams& p);

}  // namespace expertd::engine
