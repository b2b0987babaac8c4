// The CPU reference forward of DeepSeek-V4 (`deepseek4`), one token at a time, in transformers'
// order of operations (models/deepseek_v4/modeling_deepseek_v4.py):
//
// - mHC: the residual is `hc` streams. Before each sublayer a HyperConnection mixes them:
//   pre/post/comb from fn·rmsnorm(streams) with base and scale, comb projected by Sinkhorn-Knopp;
//   the sublayer runs on Σ pre_i·stream_i, and the streams become post_i·out + Σ_j
//   comb_ji·stream_j. The final HyperHead collapses the streams before the output norm.
// - Attention: q LoRA (wq_a, q_a_norm, wq_b, a weightless per-head RMSNorm), one shared K=V head
//   (wkv, kv_norm), interleaved RoPE on the trailing rope dims (main base on sliding layers, the
//   compress base with YaRN on compressed layers), a per-head sink in the softmax, keys = the last
//   `window` positions plus compressed entries, the inverse RoPE on the output, then the grouped
//   output projection (wo_a per group, wo_b).
//   CSA layers: a compressor emits one entry per `ratio` tokens over overlapping windows (the
//   previous window's first half with this window's second half), and the Lightning Indexer (its
//   own compressor, q from the LoRA residual, Σ_h w_h·relu(q_h·k)) picks the top-k entries.
//   HCA layers: non-overlapping windows, every entry attended.
// - MoE: sqrtsoftplus scores; hash layers take tid2eid[token], learned layers the top-k of
//   scores + e_score_correction_bias; weights renormalised × routed_scaling_factor; SwiGLU with
//   the clamp; plus the shared expert.
//
// Hash layers' experts are known from the token alone: decode() hints them all to the source
// before layer 0 (EngineOptions::hash_hints). Learned layers get router lookahead as qwen3moe
// does (the next layers' routers on the current collapsed stream).
//
// prefill() runs a prompt in chunks of EngineOptions::prefill_chunk positions, layer by layer over
// the chunk, keeping every position's mHC streams. The attention sublayer runs position by position
// in order (its sliding window, compressors and indexer are running state, fed one position at a
// time); the MoE is grouped by expert as qwen3moe's prefill does: every expert a chunk's layer
// routed to is hinted, then acquired once in groups of at most top-k and applied to all its
// positions, and the shared expert is one matrix-matrix product over the chunk. The chunk's hash
// layers are hinted exactly before layer 0. Each position combines its experts in decode()'s
// order, so the logits are decode()'s to the bit.
//
// truncate(n) works for any n (prefix reuse): the sliding window and the compressors' running
// windows cannot be cut back, so the engine keeps checkpoints of that state (kCheckpoints of them:
// at the end of every prefill chunk and every kCheckpointEvery decoded positions), restores the
// last one at or before n and feeds the positions from there to n again through prefill (bit-exact
// to what decode() or prefill() computed the first time). The emitted compressed entries are
// append-only and need only their count. The ids fed so far are kept for that.
//
// Sequences (EngineOptions::sequences, at most CpuEngine::kMaxSequences), as CpuEngine's: each
// has its own running attention state (window, compressors, entries), fed ids and checkpoints;
// decode(), prefill(), truncate(), reset() and position() act on the selected one. decode_batch()
// is the prefill's own pass over rows whose sequences and positions differ: each row's attention
// runs on its sequence's state, the MoE is grouped across the rows (each routed expert of the step
// acquired once for all its rows), so each row's logits are its sequence's decode() to the bit.
//
// Owns every cache (sliding window, compressor buffers and entries) and scratch buffer (the
// prefill ones sized by the chunk or the sequences, whichever is more), sized at create();
// decode() and prefill() allocate nothing unless a routing log is attached. Not thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "engine/cpu_ops.h"
#include "engine/engine.h"
#include "engine/expert_source.h"
#include "engine/model.h"

namespace expertd::engine {

// What both DeepSeek-V4 engines check at create(): a deepseek4 model, the options (at most
// `max_sequences` sequences), a context whose caches are not absurd.
Status check_ds4_engine(const DenseModel& model, const EngineOptions& options,
                        uint32_t max_sequences = 1);

// truncate()'s bookkeeping for both DeepSeek-V4 engines (each keeps the copies, on the host or the
// device): which position each of kCount checkpoint slots holds, where the next one goes and which
// one a cut restores. One policy, so the CPU and CUDA engines feed the same positions again.
class Ds4CheckpointSlots {
 public:
  static constexpr uint32_t kCount = 4;
  static constexpr uint32_t kEvery = 64;  // decoded positions between two checkpoints
  // The slot to copy the state at position `at` into: a free one, else the one of the earliest
  // position (a continued conversation cuts near its end); -1 when one holds `at` already.
  // hold() it once the copy is made.
  int pick(uint32_t at) const;
  void hold(int slot, uint32_t at);
  // For truncate(n): forgets the slots after n (those positions are about to be fed anew) and
  // returns the one of the latest position at or before n; -1 when none (feed from position 0).
  int latest_at_or_before(uint32_t n);
  uint32_t pos(int slot) const { return pos_[slot]; }
  void clear() { valid_.fill(0); }

 private:
  std::array<uint8_t, kCount> valid_{};
  std::array<uint32_t, kCount> pos_{};
};

class Ds4CpuEngine final : public Engine {
 public:
  // `model` (a deepseek4 model) and `source` must outlive the engine.
  static Result<std::unique_ptr<Ds4CpuEngine>> create(const DenseModel& model, ExpertSource& source,
                                                      const EngineOptions& options);

  Status decode(uint32_t token, std::span<float> logits) override;
  // Any n <= position(): restores a checkpoint and feeds the rest (see above). False, with the
  // engine reset, when feeding fails (an expert read error); false, unchanged, for n > position().
  bool truncate(uint32_t n) override;
  // Checkpoints kept, and the decode positions between two.
  static constexpr uint32_t kCheckpoints = Ds4CheckpointSlots::kCount;
  static constexpr uint32_t kCheckpointEvery = Ds4CheckpointSlots::kEvery;
  // Positions truncate() fed again (for tests and the run summary).
  uint64_t refed_positions() const { return refed_; }
  // The batched forward of the prompt (see above). After an error, reset().
  void reset() override;
  uint32_t position() const override { return pos_; }
  const EngineStats& stats() const override { return stats_; }
  const ModelParams& params() const override { return p_; }
  const EngineOptions& options() const override { return opts_; }
  void set_routing_log(std::vector<RoutingRecord>* log) override { routing_log_ = log; }
  uint32_t sequences() const override { return opts_.sequences; }
  Status select_sequence(uint32_t sequence) override;
  uint32_t selected_sequence() const override { return cur_; }
  Status decode_batch(std::span<const BatchRow> rows, std::span<float> logits) override;
  std::string name() const override { return "cpu"; }
  std::string description() const override;

 private:
  EngineStats& mutable_stats() override { return stats_; }
  // One compressor's running state: the current window's projections, the previous window's
  // first half (overlapping windows), and the entries emitted so far.
  struct CompState {
    uint32_t coff = 0;
    uint32_t dim = 0;
    std::vector<float> kv;         // [ratio][coff * dim] this window
    std::vector<float> gate;       // [ratio][coff * dim] (position bias added)
    std::vector<float> prev_kv;    // [ratio][dim] the previous window's first half
    std::vector<float> prev_gate;  // [ratio][dim]
    bool has_prev = false;
    std::vector<float> entries;  // [max entries][dim]
    uint32_t count = 0;          // entries emitted
  };
  struct LayerState {
    std::vector<float> window;  // [window][head_dim]: K=V of the last positions (ring)
    CompState comp;
    CompState index;
  };
  // The running state of a compressor at a checkpoint (its entries are append-only: the count).
  struct CompCheckpoint {
    std::vector<float> kv, gate, prev_kv, prev_gate;
    bool has_prev = false;
    uint32_t count = 0;
  };
  struct LayerCheckpoint {
    std::vector<float> window;
    CompCheckpoint comp;
    CompCheckpoint index;
  };
  struct Checkpoint {
    std::vector<LayerCheckpoint> layers;
  };
  // What a sequence carries from one position to the next, besides its position.
  struct Sequence {
    std::vector<LayerState> layers;
    std::vector<uint32_t> fed;            // [max_context]: the id at each position
    std::vector<Checkpoint> checkpoints;  // [kCheckpoints], by slot
    Ds4CheckpointSlots saved;             // which position each checkpoint holds
  };
  // Saves the state of s_ at pos_ into the slot its `saved` picks (nothing when one holds pos_
  // already).
  void save_checkpoint();
  void restore_checkpoint(int slot);

  Ds4CpuEngine(const DenseModel& model, ExpertSource& source, const EngineOptions& options);

  // HyperConnection of one site: fills pre_/post_/comb_ and collapsed_ (n_embd).
  void hc_mix(const Matrix& fn, const std::vector<float>& base, const std::vector<float>& scale);
  // streams = post ⊗ out + combᵀ · streams.
  void hc_expand(const float* out);
  void attention(uint32_t layer);
  // Feeds position pos_'s normalised input to a compressor; emits an entry when a window closes.
  void compress(const Ds4Compressor& w, CompState& s, uint32_t ratio);
  // Both of a layer's compressors (the attention's and, on CSA layers, the indexer's).
  void compress_into(uint32_t layer, uint32_t ratio);
  void select_entries(uint32_t layer);
  void send_hints(uint32_t layer);
  // send_hints() in two steps: the candidates of position pos_, then sending what was added.
  void add_lookahead(uint32_t layer);
  void flush_hints();
  void hint_hash_layers(uint32_t token);
  void route(uint32_t layer, uint32_t token);
  // route() without the planner: selected_/weights_ and the routing log.
  void route_position(uint32_t layer, uint32_t token);
  Status moe(uint32_t layer);
  // Token `token`'s embedding into every one of a position's hc streams ([hc][n_embd]).
  void embed(uint32_t token, float* streams) const;
  // HyperHead, output norm and head on streams_.
  void head(std::span<float> logits);
  uint32_t prefill_chunk_size() const override { return chunk_; }
  Status prefill_chunk(std::span<const uint32_t> tokens, std::span<float> logits) override;
  // One pass over the layers for n rows whose mHC streams are in cstreams_: row i is tokens[i] of
  // sequence rseq_[i] at position rpos_[i] (`last`: the latest of them, for the daemon's cursor).
  // The prefill chunk and the batch step. Leaves s_ and pos_ at the selected sequence's.
  Status forward_rows(std::span<const uint32_t> tokens, uint32_t last);
  Status prefill_moe(uint32_t layer, uint32_t n, uint32_t last);
  // Interleaved RoPE on the trailing n_rot of a `dim`-long head at `pos` (the compress base and
  // YaRN when `compress`; the conjugate rotation when `inverse`).
  void rope(float* v, uint32_t dim, uint32_t pos, bool compress, bool inverse) const;

  const DenseModel& model_;
  ExpertSource& source_;
  const ModelParams& p_;
  const Ds4Params& d_;
  const Ds4Weights& w_;
  EngineOptions opts_;
  // The position the per-position code works at: the selected sequence's between calls (the
  // others' are in seq_pos_), a row's during a pass over rows.
  uint32_t pos_ = 0;
  EngineStats stats_;
  std::vector<Sequence> seqs_;     // [sequences]
  std::vector<uint32_t> seq_pos_;  // [sequences]: positions (the selected one's is pos_)
  uint32_t cur_ = 0;               // the selected sequence
  Sequence* s_ = nullptr;          // the state the per-position code works on (as pos_)
  bool replaying_ = false;         // truncate() is feeding positions again
  uint64_t refed_ = 0;
  std::vector<RoutingRecord>* routing_log_ = nullptr;

  std::vector<double> inv_freq_main_;      // n_rot / 2
  std::vector<double> inv_freq_compress_;  // n_rot / 2 (YaRN when the file has it)

  std::vector<float> streams_;             // [hc][n_embd]
  std::vector<float> flat_;                // hc * n_embd, normalised
  std::vector<float> mixes_;               // (2 + hc) * hc
  std::vector<double> pre_, post_, comb_;  // hc, hc, hc * hc
  std::vector<float> collapsed_;           // n_embd
  std::vector<float> xn_;                  // normalised sublayer input, n_embd
  std::vector<float> qr_;                  // q LoRA residual, q_lora_rank
  std::vector<float> q_;                   // n_head * head_dim
  std::vector<float> kv_;                  // head_dim
  std::vector<float> att_;                 // n_head * head_dim
  std::vector<float> grouped_;             // o_groups * o_lora_rank
  std::vector<float> out_;                 // n_embd
  std::vector<float> proj_;                // compressor projections, 2 * max(head_dim, index_dim)
  std::vector<float> entry_;               // one compressed entry, max(head_dim, index_dim)
  std::vector<double> slots_;              // softmax over 2 * ratio slots
  std::vector<float> iq_;                  // indexer queries, index_heads * index_dim
  std::vector<float> iw_;                  // indexer head weights, index_heads
  std::vector<double> iscore_;             // indexer scores, max entries
  std::vector<uint32_t> iorder_;           // entry indices by score
  std::vector<uint32_t> chosen_;           // compressed entries attended this layer
  std::vector<double> scores_;             // attention logits (window + entries)
  std::vector<double> acc_;                // accumulators, max(n_embd, head_dim)
  std::vector<float> row_;                 // one dequantised weight row (the widest)
  std::vector<float> router_;              // n_expert
  std::vector<double> probs_;              // scores (+ bias for selection), n_expert
  std::vector<double> sel_;                // n_expert
  std::vector<uint32_t> order_;
  std::vector<uint32_t> selected_;
  std::vector<float> weights_;
  std::vector<uint8_t> ready_;
  std::vector<float> gate_, up_, tmp_;  // n_ff (shared: n_ff * n_shared), n_embd
  std::vector<ExpertView> views_;
  std::vector<ExpertHint> hash_hints_;
  HintPlanner planner_;

  // prefill(): C = min(prefill_chunk, max_context) positions; the buffers below hold
  // max(C, sequences) rows (a batch step's rows).
  uint32_t chunk_ = 0;
  std::vector<uint32_t> rseq_;      // each row's sequence
  std::vector<uint32_t> rpos_;      // and position
  std::vector<uint32_t> rtok_;      // a batch step's tokens
  std::vector<float> cstreams_;     // every position's mHC streams, [C][hc][n_embd]
  std::vector<double> cpost_;       // the FFN site's post mix per position, [C][hc]
  std::vector<double> ccomb_;       // and comb, [C][hc][hc]
  std::vector<float> cxn_;          // normalised MoE inputs, [C][n_embd]
  std::vector<uint32_t> csel_;      // routes, [C][k]
  std::vector<float> cweights_;     // [C][k]
  std::vector<float> cout_;         // each route slot's expert output, [C][k][n_embd]
  std::vector<float> cmoe_;         // each position's MoE output (routed + shared), [C][n_embd]
  ExpertGroups groups_;             // the chunk's layer's route slots by expert
  std::vector<ExpertHint> exact_;   // their hints, n_expert
  std::vector<uint8_t> hash_mark_;  // [expert]: hinted for this chunk's hash layer
  std::vector<float> cgx_;          // one expert's inputs, [C][n_embd]
  std::vector<float> cgate_;        // [C][n_ff (shared: n_ff * n_shared)]
  std::vector<float> cup_;          // [C][n_ff (shared: n_ff * n_shared)]
  std::vector<float> cdown_;        // [C][n_embd]
};

// The host side of the deepseek4 forward, shared by Ds4CpuEngine and Ds4GpuEngine.

// Inverse frequencies of the rope pairs: base^(-2i/dim), or YaRN's blend of interpolated and
// extrapolated frequencies when `yarn` has a factor (dim / 2 values).
std::vector<double> ds4_inv_freq(uint32_t dim, double base, const Ds4Params* yarn);

}  // namespace expertd::engine
