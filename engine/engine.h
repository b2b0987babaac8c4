// What every decode engine shares: options, statistics, routing records, the scripted routing of
// the benchmark mode, and the prefetch-hint bookkeeping. CpuEngine (engine/cpu_engine.h) and
// GpuEngine (engine/gpu_engine.h) implement Engine.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/clock.h"
#include "engine/expert_source.h"
#include "engine/model.h"
#include "expertd/result.h"

namespace expertd::engine {

// One (token, layer) of a recorded routing trace, as the benchmark mode replays it.
struct ScriptedRoute {
  std::vector<uint32_t> experts;  // the model's top-k, by descending weight
  std::vector<float> weights;     // one per expert
  // Lookahead depth -> the experts a router predicted for this record from that many layers
  // earlier (the trace's "predicted"); empty when the trace carries none.
  std::map<uint32_t, std::vector<uint32_t>> predicted;
};

// A recorded trace's expert choices, to be used in place of the computed router (expert-run
// --routing-trace): realistic locality with generated weights. Position p of the sequence uses
// the trace's p-th token. A (token, layer) the trace lacks falls back to the computed router.
class RoutingScript {
 public:
  RoutingScript(uint32_t tokens, uint32_t layers)
      : tokens_(tokens),
        layers_(layers),
        routes_(uint64_t{tokens} * layers),
        present_(routes_.size()) {}
  // Sets position `pos`'s route for `layer`. Errors name the position and layer: wrong expert
  // count, an expert outside the model, weights that do not match the experts.
  Status set(uint32_t pos, uint32_t layer, ScriptedRoute route, const ModelParams& p);
  const ScriptedRoute* find(uint32_t pos, uint32_t layer) const {
    if (pos >= tokens_ || layer >= layers_) return nullptr;
    const uint64_t i = uint64_t{pos} * layers_ + layer;
    return present_[i] ? &routes_[i] : nullptr;
  }
  uint32_t tokens() const { return tokens_; }
  uint32_t layers() const { return layers_; }
  bool has_predictions() const { return has_predictions_; }

 private:
  uint32_t tokens_;
  uint32_t layers_;
  std::vector<ScriptedRoute> routes_;
  std::vector<uint8_t> present_;
  bool has_predictions_ = false;
};

// Where prefetch hints come from.
enum class HintSource {
  Router,  // the next layers' routers applied to the current residual stream (the product path)
  Script,  // benchmark mode: the script's "predicted" lists, else its own future routes (oracle)
};

struct EngineOptions {
  uint32_t max_context = 0;               // positions the KV cache holds (required)
  uint32_t prefetch_depth = 0;            // layers ahead to predict; 0 sends no hints
  uint32_t prefetch_width = 0;            // candidates per predicted layer; 0 = the model's top-k
  const RoutingScript* script = nullptr;  // benchmark mode: routes replayed from a trace
  HintSource hints = HintSource::Router;
  // deepseek4: hint every hash layer's experts (tid2eid[token]) as soon as the token is known,
  // before layer 0 runs: exact prefetch.
  bool hash_hints = true;
  // prefill(): prompt positions processed together (attention as one GEMM per chunk, each routed
  // expert acquired once per chunk and applied to all its tokens).
  uint32_t prefill_chunk = 512;
  // Sequences the engine holds at once (decode_batch), each with its own KV cache of max_context
  // positions. An engine that runs one at a time refuses more (create() fails naming it).
  uint32_t sequences = 1;
};

// One row of a batched decode step: a token fed to a sequence at its next position.
struct BatchRow {
  uint32_t sequence = 0;
  uint32_t token = 0;
};

// One routing decision, in the canonical trace's terms (experts by descending probability).
struct RoutingRecord {
  uint32_t token = 0;  // position in the sequence
  uint32_t layer = 0;
  std::vector<uint32_t> experts;
  std::vector<float> weights;
  std::map<uint32_t, std::vector<uint32_t>> predicted;  // depth -> experts hinted for this record
};

// How well the predictions made d layers ahead matched, counted per lookahead depth d (every
// prediction, whether or not an earlier, deeper one already sent the same hint).
struct DepthStats {
  uint64_t predicted = 0;  // (layer, expert) predictions made d layers ahead
  uint64_t correct = 0;    // of those, experts the layer then routed to
  uint64_t routed = 0;     // routed experts of layers >= d (predictable from d layers back)
  double precision() const {
    return predicted == 0 ? 0.0 : static_cast<double>(correct) / predicted;
  }
  double recall() const { return routed == 0 ? 0.0 : static_cast<double>(correct) / routed; }
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
  uint64_t scripted_routes = 0;  // routing decisions taken from a RoutingScript
  // The GPU engine's VRAM tier (zero on the CPU engine and in the in-place mode).
  uint64_t vram_hits = 0;           // routed experts found in VRAM
  uint64_t vram_misses = 0;         // routed experts acquired from the daemon and copied
  uint64_t vram_prefetches = 0;     // host-ready hinted experts copied ahead of their layer
  uint64_t vram_prefetch_used = 0;  // of those, routed to before eviction
  // Routed experts the tier's policy did not admit (or found every slot pinned for): read in
  // place from the daemon's registered arena for that use, displacing nothing.
  uint64_t vram_streamed = 0;
  // The tier filled when the engine was made (GpuOptions::preload): experts, bytes, time.
  uint64_t vram_preloaded = 0;
  uint64_t vram_preload_bytes = 0;
  uint64_t vram_preload_ns = 0;
  // Both tiers after each decoded token: distinct experts held in VRAM or host memory (the
  // daemon's READY slots), summed over `tiers_samples`, and the sum of the tiers' capacities.
  uint64_t tiers_distinct_sum = 0;
  uint64_t tiers_samples = 0;
  uint32_t tiers_distinct = 0;     // the last sample
  uint32_t tiers_capacity = 0;     // VRAM slots + the daemon's arena slots (0: not measured)
  uint64_t copy_bytes = 0;         // host -> VRAM expert bytes copied (demand and prefetch)
  uint64_t demand_copy_bytes = 0;  // of those, the copies a layer waited for
  uint64_t copy_ns = 0;            // copy-stream time of the demand copies (CUDA events)
  // The CUDA engines: time the host waited in cudaStreamSynchronize for the compute stream (its
  // kernels, and the copies and in-place PCIe reads they wait on), and the routed experts' bytes
  // read in place over PCIe from the daemon's arena (vram_streamed, and every expert without a
  // tier). decode time - stall - sync_ns is the host's own work: launches, routing, hints, IPC.
  uint64_t sync_ns = 0;
  uint64_t streamed_bytes = 0;
  // deepseek4: routed experts of hash layers (routed by tid2eid[token]) and of learned layers,
  // how many were ready in host memory when the layer asked (ExpertSource::host_ready), and the
  // time spent waiting for them.
  uint64_t hash_hints = 0;  // exact hints sent for hash layers
  uint64_t hash_experts = 0;
  uint64_t hash_ready = 0;
  uint64_t hash_stall_ns = 0;
  uint64_t learned_experts = 0;
  uint64_t learned_ready = 0;
  uint64_t learned_stall_ns = 0;

  // prefill(): prompt positions fed, chunks, experts acquired (each distinct (layer, expert) of a
  // chunk once) and time spent, stall included. The positions count in `tokens` too.
  uint64_t prefill_tokens = 0;
  uint64_t prefill_chunks = 0;
  uint64_t prefill_experts = 0;
  uint64_t prefill_ns = 0;
  // Exact hints prefill sends for a chunk's layer once its routing is known, before acquiring its
  // experts in groups of top-k (not in hints_sent: they are not predictions).
  uint64_t prefill_hints = 0;
  // The next layer's experts a chunk's rows will route to, hinted while this layer computes (its
  // router on this layer's residual, as decode's lookahead; the GPU engine's chunked prefill), and
  // hints held back because the daemon's free slots could not keep them until their acquire.
  uint64_t prefill_lookahead_hints = 0;
  uint64_t prefill_hints_held = 0;
  // Prefill's expert GEMMs ran in bf16 on tensor cores (GpuOptions::PrefillGemm::Bf16).
  uint64_t prefill_bf16_gemms = 0;
  // decode_batch(): steps, rows (sequences fed; they count in `tokens` too) and routed experts
  // acquired (each distinct (layer, expert) of a step once; rows sharing one share the read).
  uint64_t batch_steps = 0;
  uint64_t batch_rows = 0;
  uint64_t batch_experts = 0;

  std::vector<DepthStats> by_depth;  // [d - 1] for lookahead depth d = 1..prefetch depth

  double prefetch_precision() const {
    return hints_sent == 0 ? 0.0 : static_cast<double>(hinted_routed) / hints_sent;
  }
  double prefetch_recall() const {
    return routed_hintable == 0 ? 0.0 : static_cast<double>(hinted_routed) / routed_hintable;
  }
};

class Engine {
 public:
  virtual ~Engine() = default;
  // Feeds `token` at the next position and writes the next token's logits (n_vocab floats).
  // Errors: a token outside the vocabulary, a full KV cache, an expert the source cannot give.
  virtual Status decode(uint32_t token, std::span<float> logits) = 0;
  // Feeds `tokens` (at least one) at the next positions, in chunks of prefill_chunk_size()
  // (one prefill_chunk() call each), and writes the logits of the last one (n_vocab floats): the
  // same logits as decode() of each token in turn, up to rounding. Errors as decode(); a prompt
  // that does not fit the KV cache is refused before anything runs. Counts prefill_ns.
  Status prefill(std::span<const uint32_t> tokens, std::span<float> logits);
  // Forgets the sequence (the KV cache is reused from position 0).
  virtual void reset() = 0;
  // Keeps the first n positions (n <= position()) and forgets the rest, so a sequence that shares
  // that prefix continues from there without feeding it again. Returns false, changing nothing,
  // when the engine cannot cut its state at n (the caller then resets and feeds the prefix).
  // The default supports only n == 0 and n == position().
  virtual bool truncate(uint32_t n);
  virtual uint32_t position() const = 0;
  virtual const EngineStats& stats() const = 0;
  virtual const ModelParams& params() const = 0;
  // The options the engine was created with (prefill_chunk and prefetch_width filled in).
  virtual const EngineOptions& options() const = 0;
  // The engine's sequences (EngineOptions::sequences): decode(), prefill(), truncate(), reset()
  // and position() act on the selected one (0 at first). select_sequence() fails for a sequence
  // the engine does not have.
  virtual uint32_t sequences() const { return 1; }
  virtual Status select_sequence(uint32_t sequence);
  virtual uint32_t selected_sequence() const { return 0; }
  // One decode step of several distinct sequences: rows[i]'s token at its sequence's next
  // position, its logits at logits[i * n_vocab]. Each row's logits are those decode() gives the
  // sequence alone (to the bit on the CPU engine). An engine that batches acquires each routed
  // expert once per step for every row that routes to it; this default decodes the rows in turn.
  // The selected sequence is unchanged. After an error, reset the rows' sequences.
  virtual Status decode_batch(std::span<const BatchRow> rows, std::span<float> logits);
  // Appends every routing decision to `log` (nullptr: stop). Allocates per decision.
  virtual void set_routing_log(std::vector<RoutingRecord>* log) = 0;
  // "cpu" or "gpu", and a line describing the engine (device, tier) for the run summary.
  virtual std::string name() const = 0;
  virtual std::string description() const = 0;

 protected:
  virtual EngineStats& mutable_stats() = 0;
  // Positions one prefill_chunk() call takes: EngineOptions::prefill_chunk bounded by what the
  // engine sized its scratch for. The default takes the whole prompt at once.
  virtual uint32_t prefill_chunk_size() const { return UINT32_MAX; }
  // One chunk at position(), already checked by prefill(); writes the last position's logits when
  // `logits` is not empty (the last chunk) and counts prefill_tokens and prefill_chunks. This
  // default decodes one token at a time; engines override it with a batched forward that acquires
  // each routed expert once per chunk.
  virtual Status prefill_chunk(std::span<const uint32_t> tokens, std::span<float> logits);
};

// Chooses and tracks prefetch hints for one token at a time: at most `width` candidates per
// predicted layer, each (layer, expert) hinted once per token, and the precision/recall counters
// of EngineStats. Used identically by both engines.
class HintPlanner {
 public:
  HintPlanner(const ModelParams& p, const EngineOptions& o);
  uint32_t depth() const { return depth_; }
  uint32_t width() const { return width_; }
  void begin_token();
  // Hints made from here on are made at `layer` (depth = hinted layer - layer).
  void from_layer(uint32_t layer) { current_ = layer; }
  // Candidates for layer `next` ranked by probability (n_expert values): the top `width`.
  void add_ranked(uint32_t next, std::span<const double> probs);
  void add_ranked(uint32_t next, std::span<const float> probs);
  // Candidates for layer `next` given as a list (a script's prediction), each with `score`.
  void add_listed(uint32_t next, std::span<const uint32_t> experts, float score);
  // Hints added since the last routed() or begin_token() (which clear them; the span stays valid
  // until then), and counts them as sent: call it once per layer.
  std::span<const ExpertHint> take(EngineStats& stats);
  // Layer `layer` routed to `experts`: counts hinted ones and fills rec->predicted if given.
  void routed(uint32_t layer, std::span<const uint32_t> experts, EngineStats& stats,
              RoutingRecord* rec);

 private:
  void add(uint32_t next, uint32_t expert, float score);

  uint32_t n_layer_;
  uint32_t n_expert_;
  uint32_t depth_;
  uint32_t width_;
  uint32_t current_ = 0;            // the layer whose attention just finished (hints come from it)
  std::vector<uint8_t> hinted_;     // [layer][expert]: depth (1..) it was hinted at, 0 = not
  std::vector<uint8_t> predicted_;  // [depth - 1][layer][expert]: predicted from depth back
  std::vector<uint64_t> predicted_counts_;  // [depth - 1]: predictions not yet in the stats
  std::vector<ExpertHint> pending_;
  std::vector<uint32_t> pending_at_;  // [layer][expert]: 1 + its index in pending_ when added
  std::vector<uint32_t> order_;
};

// Script-driven hints for layer `next` made at layer `from` of position `pos`: the script's
// "predicted" list for that depth when the script has predictions, else the route itself (an
// oracle: an upper bound on what router lookahead can give).
void add_scripted_hints(const RoutingScript& script, uint32_t pos, uint32_t from, uint32_t next,
                        HintPlanner& planner);

// Benchmark mode: when the script has a route for (pos, layer), copies it into selected/weights,
// counts it and returns true.
bool take_scripted_route(const EngineOptions& o, uint32_t pos, uint32_t layer,
                         std::span<uint32_t> selected, std::span<float> weights,
                         EngineStats& stats);
// The start of a prefill chunk, one pass over the layers whose last position is `last`: the
// daemon's cursor at the position before's last layer, so hints for any layer of the pass target
// this pass. Each layer then moves the cursor to (last, layer) once the layer's exact hints are
// out, never before: a hint for the cursor's own layer (or an earlier one) is for the next token,
// which no prefetch depth reaches, and the daemon would not read it ahead. (Nothing for a first
// chunk of one position: before any cursor the daemon counts layer 0 as one layer ahead.)
void start_prefill_cursor(ExpertSource& source, uint32_t last, uint32_t n_layer,
                          EngineStats& stats);
// The end of a prefill chunk of n positions: the records it logged layer by layer from `first`
// on put in decode()'s token-major order (stable: a position's layers stay ascending; nothing
// when log is null), and the positions counted (tokens, prefill_tokens, prefill_chunks).
void finish_prefill_chunk(std::vector<RoutingRecord>* log, size_t first, uint32_t n,
                          EngineStats& stats);
// The same for an engine whose chunk may fail after writing (the CUDA layer-by-layer prefills):
// `done` failed, the chunk is undone -- the records from `first` dropped, `pos` back at pos0 (the
// positions written past it are overwritten by whatever is fed next) -- and `done` returned;
// else `pos` = pos0 + n and finish_prefill_chunk().
Status end_prefill_chunk(Status done, std::vector<RoutingRecord>* log, size_t first, uint32_t n,
                         uint32_t pos0, uint32_t& pos, EngineStats& stats);
// Appends a routing decision to `log` (nothing when log is null); returns the new record.
RoutingRecord* log_route(std::vector<RoutingRecord>* log, uint32_t pos, uint32_t layer,
                         std::span<const uint32_t> experts, std::span<const float> weights);

// prefill(): layer `layer` of a chunk routed to the distinct `experts`, and logged one record per
// position at log[first, log->size()) (nothing when log is null). Precision and recall count each
// (layer, expert) once per chunk, as the chunk's hints are sent; every record gets the chunk's
// predictions.
void routed_chunk(HintPlanner& planner, uint32_t layer, std::span<const uint32_t> experts,
                  EngineStats& stats, std::vector<RoutingRecord>* log, size_t first);

// prefill(): hints every expert of `layer` that a chunk needs (score 1: certain), so the source
// loads the later groups while the first ones compute; counted in stats.prefill_hints. `scratch`
// holds at least needed.size() hints.
void hint_needed(ExpertSource& source, uint32_t layer, std::span<const uint32_t> needed,
                 std::span<ExpertHint> scratch, EngineStats& stats);

// deepseek4 prefill(): hints hash layer `layer`'s experts for every token of a chunk (exact:
// tid2eid[token]), each once, and counts them in stats.hash_hints. A chunk hints one hash layer
// ahead of the one computing, not all of them at its start: a long chunk's hash layers together
// need more experts than a cache holds, and hints evicted before use are read twice. `mark` holds
// n_expert bytes; `out` is reused.
void hint_hash_layer(ExpertSource& source, const Ds4Weights& w, uint32_t layer, uint32_t k,
                     std::span<const uint32_t> tokens, std::vector<uint8_t>& mark,
                     std::vector<ExpertHint>& out, EngineStats& stats);

// The checks both engines make: options at create() (a KV cache of at least one position, a
// prefetch width within the experts), and each decode() call's token, position and logits room.
// `max_sequences`: the sequences the engine can hold (EngineOptions::sequences above it fails).
Status check_engine_options(const ModelParams& p, const EngineOptions& o,
                            uint32_t max_sequences = 1);
// decode_batch()'s checks: rows, each a distinct sequence of the engine with a token inside the
// vocabulary, and room for their logits.
Status check_batch(const Engine& engine, std::span<const BatchRow> rows, size_t logits);
// And that each row's sequence, at `position(sequence)`, has room for one more position: else an
// error naming the sequence, before the step runs anything.
Status check_batch_room(std::span<const BatchRow> rows, uint32_t max_context,
                        const std::function<uint32_t(uint32_t sequence)>& position);
// A decode_batch() step of `rows` rows done, begun at `t0` (monotonic_ns): its rows counted as
// tokens and batch rows, the step and its time.
void count_batch_step(EngineStats& stats, uint32_t rows, uint64_t t0);
// The CPU engines' check of the model: its dense weights in memory (not DenseLoad::Deferred).
Status check_cpu_model(const DenseModel& model);
Status check_decode(const ModelParams& p, const EngineOptions& o, uint32_t pos, uint32_t token,
                    size_t logits);
// prefill()'s checks before anything runs: a non-empty prompt that fits the KV cache from `pos`,
// every token inside the vocabulary, room for the logits, and a prefill chunk of at least 1.
Status check_prefill(const ModelParams& p, const EngineOptions& o, uint32_t pos,
                     std::span<const uint32_t> tokens, size_t logits);

// The canonical trace form of routing records (JSON Lines; "predicted" when hints were sent).
Status write_routing_jsonl(const std::string& path, const std::vector<RoutingRecord>& log);

}  // namespace expertd::engine
