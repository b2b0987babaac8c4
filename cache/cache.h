// ExpertCache: the slot directory of one partition of the arena (the expert cache proper, or the
// staging ring), over a ReplacementPolicy.
//
// It owns the daemon-side state of its slots and mirrors it into the shared slot table. Slot state
// machine (asserted on every transition):
//
//   FREE ──reserve──► LOADING ──loaded──► READY(refs=0, evictable) ◄──unhold── READY(refs>0)
//    ▲                   │                      │  └──────────────hold──────────────►
//    └──────failed───────┘                      │
//    └────────────── evict / reserve (victim) ──┘   (never while refs>0, pinned or LOADING)
//
// Invariants: a LOADING slot is never reused (its read is in flight); a held (refs>0) or pinned
// slot is never evicted; every READY slot holds exactly one key and the key map points back at it.
// Client copies: a READY slot a client released saying it keeps its own copy (its VRAM tier) is
// taken before the policy's victim while it is evictable, so the two tiers hold different
// experts; an acquire of the slot (a client wants it from host memory again) undoes that.
// At most limit() slots are in use (LOADING or READY) once reserve() has made room: a lowered
// limit evicts what it can at once, and reserve() evicts toward it while held slots keep it above.
// Single-threaded: only the storage reactor calls it. Nothing allocates after construction.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "client/include/expertd/protocol.h"
#include "policy/policy.h"

namespace expertd {

enum class SlotState : uint8_t { Free, Loading, Ready };

// Told of every READY slot the cache evicts (a victim of reserve(), evict(), evict_all(), a
// lowered limit) just before the slot becomes FREE. Must not call back into the cache.
class EvictionListener {
 public:
  virtual ~EvictionListener() = default;
  virtual void evicted(uint32_t slot, ExpertKey key) = 0;
};

class ExpertCache {
 public:
  // Slots [first_slot, first_slot + slot_count) of `table` (global slot indices).
  ExpertCache(uint32_t first_slot, uint32_t slot_count, uint32_t layers, uint32_t experts,
              std::unique_ptr<ReplacementPolicy> policy, abi::SlotEntry* table);

  uint32_t first_slot() const { return first_slot_; }
  uint32_t slot_count() const { return static_cast<uint32_t>(slots_.size()); }
  bool owns(uint32_t slot) const { return slot - first_slot_ < slots_.size(); }
  ReplacementPolicy& policy() { return *policy_; }
  void set_policy(std::unique_ptr<ReplacementPolicy> policy);  // re-announces READY slots
  void set_eviction_listener(EvictionListener* listener) { listener_ = listener; }

  // The slot holding or loading `key`, or -1.
  int32_t lookup(ExpertKey key) const;
  SlotState state(uint32_t slot) const { return at(slot).state; }
  uint32_t refs(uint32_t slot) const { return at(slot).refs; }
  bool pinned(uint32_t slot) const { return at(slot).pinned; }
  ExpertKey key(uint32_t slot) const { return at(slot).key; }
  uint32_t generation(uint32_t slot) const { return at(slot).generation; }

  // Tells the policy a client wants `key` now.
  void access(ExpertKey key) { policy_->on_access(key, lookup(key)); }

  // FREE → LOADING for `key` (absent from the cache): a free slot, else the policy's victim
  // (READY → FREE → LOADING). nullopt when every slot is loading, held or pinned, or the policy
  // refuses to admit `key` (unless `force`). `evicted` receives the key evicted, if any.
  std::optional<uint32_t> reserve(ExpertKey key, std::optional<ExpertKey>* evicted = nullptr,
                                  bool force = false);
  void loaded(uint32_t slot);  // LOADING → READY(refs=0)
  void failed(uint32_t slot);  // LOADING → FREE
  void hold(uint32_t slot);    // READY: refs+1
  void unhold(uint32_t slot);  // READY: refs-1
  // READY(refs=0, unpinned) → FREE. False (nothing changes) when absent, loading, held or pinned.
  bool evict(ExpertKey key);
  // Every READY slot that is neither held nor pinned → FREE. Returns how many.
  uint32_t evict_all();
  // Pins keep a READY slot from eviction; false when `key` is not READY here.
  bool set_pinned(ExpertKey key, bool pinned);
  // A client keeps its own copy of the expert in READY `slot`: the slot is the first victim once
  // evictable, until the next hold(). No-op for a slot that is not READY.
  void set_client_copy(uint32_t slot);
  // The client dropped its own copy of `key`: its slot, if READY here, is ordinary again.
  void clear_client_copy(ExpertKey key);
  bool client_copy(uint32_t slot) const { return at(slot).client_copy; }

  // Caps the slots in use at `slots` (0 or more than slot_count(): every slot), evicting what it
  // can at once. Returns the number evicted.
  uint32_t set_limit(uint32_t slots);
  uint32_t limit() const { return limit_; }

  uint32_t free_count() const { return free_count_; }
  uint32_t ready_count() const { return ready_count_; }
  uint32_t loading_count() const { return loading_count_; }
  // READY slots kept from eviction by a pin (a pinned slot is never freed while pinned).
  uint32_t pinned_count() const { return pinned_count_; }

 private:
  struct Slot {
    SlotState state = SlotState::Free;
    ExpertKey key;
    uint32_t refs = 0;
    uint32_t generation = 0;
    bool pinned = false;
    bool client_copy = false;  // see set_client_copy()
    bool listed = false;       // in client_copies_
  };
  Slot& at(uint32_t slot) { return slots_[slot - first_slot_]; }
  const Slot& at(uint32_t slot) const { return slots_[slot - first_slot_]; }
  size_t key_index(ExpertKey k) const { return static_cast<size_t>(k.layer) * experts_ + k.expert; }
  void publish(uint32_t slot);  // mirror into the shared slot table
  void update_evictable(uint32_t slot);
  void make_free(uint32_t slot);
  void evict_slot(uint32_t slot);  // READY(refs=0, unpinned) → FREE, telling the listener
  uint32_t used() const { return slot_count() - free_count_; }
  // An evictable client-copy slot (local index), forgetting stale entries on the way.
  std::optional<uint32_t> client_copy_victim();

  uint32_t first_slot_;
  uint32_t layers_;
  uint32_t experts_;
  std::unique_ptr<ReplacementPolicy> policy_;
  abi::SlotEntry* table_;
  std::vector<Slot> slots_;
  std::vector<int32_t> key_to_slot_;     // layers*experts, -1 when absent
  std::vector<uint32_t> free_list_;      // a stack of free slots (local indices)
  std::vector<uint32_t> client_copies_;  // local indices with `listed`; some may be stale
  uint32_t free_count_ = 0;
  uint32_t ready_count_ = 0;
  uint32_t loading_count_ = 0;
  uint32_t pinned_count_ = 0;
  uint32_t limit_ = 0;  // slots that may be in use; slot_count() unless lowered
  EvictionListener* listener_ = nullptr;
};

}  // namespace expertd
