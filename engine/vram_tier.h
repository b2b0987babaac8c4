// The bookkeeping of the GPU engine's VRAM expert tier: which (layer, expert) each device slot
// holds, which slots the current layer pins, and the replacement policy that picks victims. Pure
// host code (the GPU engine owns the device memory and the CUDA events that order copies and
// reads); tested on machines without a GPU.
//
// Replacement is the daemon's (policy/policy.h), by name, kDefaultPolicy unless told otherwise: a
// global LRU smaller than one token's working set (top-k x MoE layers) evicts on layer-cyclic
// access exactly the expert wanted soonest and keeps nothing useful; the daemon's policies model
// the layer cycle. The policy sees demand accesses (find()), inserts, removals and which slots are
// evictable (filled and unpinned). It may refuse admission: insert() then returns kNone and the
// caller uses the expert from host memory for this use only, displacing nothing.
//
// A slot is pinned while the layer being computed uses it, so the victim of an insert is never an
// expert that layer reads. Slots remember whether they were filled by a prefetch and not yet
// used, to count useful VRAM prefetches. Invariants: where_ and entries_ agree; a slot is on the
// free list iff it is empty; the policy is told a slot is evictable iff it is filled, unpinned and
// not held by a sweep.
//
// A prefill chunk sweeps the layers once with many rows, which between them want most of every
// layer's resident experts (a 512-row chunk of the Mixtral shape routes to 70% of them, of the
// DeepSeek-V3 slice to all). So while a sweep runs (begin_sweep() .. end_sweep()), the residents of
// the layers the chunk has not reached yet (after the one sweep_to() last named) are held: not
// victims. Without this, a chunk's misses evict the experts its later layers would have found in
// VRAM (those preloaded at start, or the last chunk's) and read them again from the daemon. The
// layer being computed stays held too, so one group's misses do not evict a resident the layer's
// next group wants. Decode does not sweep: one row wants only top-k of a later layer's residents,
// which the policy weighs.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "expertd/result.h"
#include "policy/policy.h"

namespace expertd::engine {

class VramTier {
 public:
  static constexpr uint32_t kNone = UINT32_MAX;
  // The one place the tier's default policy is named (the daemon's default may differ in time:
  // both come from policy/policy.h).
  static constexpr std::string_view kDefaultPolicy = "default";  // the daemon's default

  struct Entry {
    uint32_t layer = kNone;  // kNone: empty
    uint32_t expert = kNone;
    uint32_t pins = 0;
    bool prefetched = false;  // filled ahead of its layer and not used since
  };

  // A tier of `slots` over a model of `layers` x `experts` with the named policy (an Error naming
  // an unknown policy or an empty shape).
  static Result<std::unique_ptr<VramTier>> create(uint32_t slots, uint32_t layers, uint32_t experts,
                                                  std::string_view policy = kDefaultPolicy);

  uint32_t capacity() const { return static_cast<uint32_t>(entries_.size()); }
  uint32_t size() const { return used_; }
  const Entry& entry(uint32_t slot) const { return entries_[slot]; }
  std::string_view policy_name() const { return policy_->name(); }

  // A demand access to (layer, expert), told to the policy: the slot holding it, or kNone.
  uint32_t find(uint32_t layer, uint32_t expert);
  // Whether (layer, expert) is present; not an access.
  bool contains(uint32_t layer, uint32_t expert) const;
  // A slot for (layer, expert), which must be absent: an empty slot, else the policy's victim
  // among the unpinned ones not held by a sweep (whose expert is forgotten; *evicted gets it when
  // given). kNone when every slot is pinned or held, or the policy refuses to admit it (never with
  // `force` while a slot is unpinned). The slot is left unpinned.
  uint32_t insert(uint32_t layer, uint32_t expert, bool prefetched, bool force = false,
                  Entry* evicted = nullptr);
  // Forgets the expert in `slot` (a copy that failed); the slot is used first again.
  void erase(uint32_t slot);

  // A prefill chunk's sweep of the layers (see the top of this file). begin_sweep() holds every
  // resident; sweep_to(layer) releases the layers before `layer` (the one now computed; a lower
  // one than before changes nothing); end_sweep() releases the rest. An insert during a sweep is
  // held unless its layer is one the sweep has passed. A forced insert that finds only held slots
  // ends the sweep rather than fail.
  void begin_sweep();
  void sweep_to(uint32_t layer);
  void end_sweep();
  bool sweeping() const { return sweeping_; }

  void pin(uint32_t slot);
  void unpin(uint32_t slot);  // extra unpins are harmless
  // Clears `prefetched` on first use; true if it was set.
  bool take_prefetched(uint32_t slot);

  // Experts held across this tier and host memory: those marked in `host` ([layer][expert], as
  // ExpertSource::host_resident fills it) plus those in VRAM that host memory lacks.
  uint32_t distinct_with(std::span<const uint8_t> host) const;

  uint64_t evictions() const { return evictions_; }
  uint64_t refusals() const { return refusals_; }  // inserts the policy refused

 private:
  VramTier(uint32_t slots, uint32_t layers, uint32_t experts,
           std::unique_ptr<ReplacementPolicy> policy);
  uint64_t key(uint32_t layer, uint32_t expert) const {
    return uint64_t{layer} * experts_ + expert;
  }
  // Held by the sweep: filled, of the layer being computed or a later one.
  bool held(const Entry& e) const { return sweeping_ && e.layer != kNone && e.layer >= swept_; }

  uint32_t layers_;
  uint32_t experts_;
  std::unique_ptr<ReplacementPolicy> policy_;
  std::vector<Entry> entries_;
  std::vector<uint32_t> where_;  // [layer][expert] -> slot or kNone
  std::vector<uint32_t> free_;   // empty slots, a stack (the next one used is at the back)
  uint32_t used_ = 0;
  uint64_t evictions_ = 0;
  uint64_t refusals_ = 0;
  bool sweeping_ = false;
  uint32_t swept_ = 0;  // layers [0, swept_) are passed (released) during a sweep
};

}  // namespace expertd::engine
