// Replacement policies of the expert cache, behind one small interface so the daemon, the
// simulator (`expert-tune simulate`) and the tests compare them on equal terms.
//
// A policy sees slots (0..capacity-1) and the expert each holds; the cache tells it which slots are
// evictable (READY with no holds and not pinned) and asks it for a victim when it needs a slot.
// A policy may refuse admission (victim() returns nullopt although evictable slots exist): the
// expert is then streamed through the staging ring instead of displacing a more valuable one.
//
// Policies:
//  - "lru":    global least-recently-used. A global LRU smaller than one token's working set gets
//              no hits on layer-cyclic access: it always evicts the expert needed soonest.
//  - "fifo":   insertion order (the staging ring's policy).
//  - "cyclic": models the layer cycle of decoding: expert (l, e) is next wanted when the cursor
//              comes back to layer l, d(l) layers from now, with a probability p estimated from
//              recency (was it used in the last tokens?) and frequency (its share of layer l's
//              routing so far). It evicts the slot with the lowest p / d, a greedy approximation
//              of Belady's MIN for cyclic access, and refuses admission to an incoming expert
//              worth less than every candidate.
//  - "cyclic-hint": the default ("default" names it). cyclic, knowing that an expert of the
//              current layer not yet wanted in this visit may still be wanted now, and using router
//              hints (on_hint): a hinted expert is valued probability / distance, the unhinted
//              experts of a hinted visit share what the hints leave of its top-k. See
//              docs/CACHE.md for both, and every policy tried against Belady.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "expertd/result.h"
#include "storage/expert_key.h"

namespace expertd {

class ReplacementPolicy {
 public:
  virtual ~ReplacementPolicy() = default;
  virtual std::string_view name() const = 0;

  // A client wanted `key` now (a demand access); `slot` holds it on a hit, -1 on a miss.
  virtual void on_access(ExpertKey key, int32_t slot) = 0;
  // `slot` now holds `key` (its load finished).
  virtual void on_insert(uint32_t slot, ExpertKey key) = 0;
  // `slot` no longer holds anything.
  virtual void on_remove(uint32_t slot) = 0;
  // `slot` became evictable (true) or not (false: held, pinned or loading).
  virtual void on_evictable(uint32_t slot, bool evictable) = 0;
  // A router hint: `key` is expected to be wanted `distance` layers from the cursor (1 = the next
  // layer; a hint for the next token counts the layers to it), with `probability` the daemon's
  // calibrated estimate that the hint is right. A policy may use it to value `key` (for admission
  // in victim() and to protect or demote residents); the default ignores hints.
  virtual void on_hint(ExpertKey /*key*/, uint32_t /*distance*/, double /*probability*/) {}
  // The slot to evict so `incoming` can be cached, or nullopt (nothing evictable, or the policy
  // refuses to admit `incoming`; with `force` it never refuses while a slot is evictable).
  virtual std::optional<uint32_t> victim(ExpertKey incoming, bool force) = 0;
};

struct PolicyShape {
  uint32_t capacity = 0;  // slots
  uint32_t layers = 0;    // block count (the length of the layer cycle)
  uint32_t experts = 0;   // experts per layer
};

// The policy "default" names.
inline constexpr std::string_view kDefaultPolicy = "cyclic-hint";

// "cyclic-hint", "cyclic", "lru", "fifo", or "default" (kDefaultPolicy); an Error naming the
// unknown policy otherwise.
Result<std::unique_ptr<ReplacementPolicy>> make_policy(std::string_view name,
                                                       const PolicyShape& shape);
// The policy names make_policy accepts besides "default", the default first.
std::span<const std::string_view> policy_names();

// Offline cache simulation (the model of `expert-tune simulate`): one global capacity, each
// access in order, demand only (no prefetch loads), every miss fills a slot unless the policy
// refuses admission. A layer visit (a run of accesses to one layer) is held until it ends, as the
// engine holds a layer's experts while it computes, so none of them evicts another. A hit is an
// expert resident when wanted, so no policy, hinted or not, can beat simulate_belady().
struct SimResult {
  uint64_t accesses = 0;
  uint64_t hits = 0;
  double hit_rate() const { return accesses ? static_cast<double>(hits) / accesses : 0.0; }
};
// Router hints fed to the policy (on_hint) before each visit, for the next `depth` visits (0:
// none), as the daemon gets them: each routed expert of those visits, or with recall < 1 each one
// replaced with probability 1 - recall by an expert of the layer that was not routed (drawn
// deterministically from `seed`), with probability = recall (calibrated).
struct SimHints {
  uint32_t depth = 0;
  double recall = 1.0;
  uint64_t seed = 1;
};
// "none", "oracle:D" or "noisy:R:D".
Result<SimHints> parse_sim_hints(std::string_view spec);
Result<SimResult> simulate_policy(std::string_view policy, const PolicyShape& shape,
                                  std::span<const ExpertKey> accesses, const SimHints& hints = {});
// The hindsight-optimal fixed set: the `capacity` most used experts of the whole trace, kept for
// all of it (first uses missed, as for every policy). What frequency alone can reach.
struct StaticBound {
  uint32_t capacity = 0;
  SimResult result;
};
std::vector<StaticBound> static_hindsight(std::span<const uint32_t> capacities,
                                          std::span<const ExpertKey> accesses);
// Belady's MIN (evict the expert whose next use is farthest): the optimum for any policy.
SimResult simulate_belady(uint32_t capacity, std::span<const ExpertKey> accesses);

}  // namespace expertd
