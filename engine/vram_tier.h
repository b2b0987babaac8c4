// The bookkeeping of the GPU engine's VRAM expert tier: which (layer, expert) each device slot
// holds, in least-recently-used order, and which slots the current layer pins. Pure host code
// (the GPU engine owns the device memory and the CUDA events that order copies and reads); tested
// on machines without a GPU.
//
// A slot is pinned while the layer being computed uses it, so the victim of an insert is never
// an expert that layer reads. Slots remember whether they were filled by a prefetch and not yet
// used, to count useful VRAM prefetches.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace expertd::engine {

class VramTier {
 public:
  static constexpr uint32_t kNone = UINT32_MAX;

  struct Entry {
    uint32_t layer = kNone;  // kNone: empty
    uint32_t expert = kNone;
    uint32_t pins = 0;
    bool prefetched = false;  // filled ahead of its layer and not used since
  };

  VramTier(uint32_t slots, uint32_t layers, uint32_t experts);

  uint32_t capacity() const { return static_cast<uint32_t>(entries_.size()); }
  uint32_t size() const { return used_; }
  const Entry& entry(uint32_t slot) const { return entries_[slot]; }

  // The slot holding (layer, expert), made the most recently used; kNone when absent.
  uint32_t find(uint32_t layer, uint32_t expert);
  // Whether (layer, expert) is present, without touching the LRU order.
  bool contains(uint32_t layer, uint32_t expert) const;
  // A slot for (layer, expert), which must be absent: an empty slot, else the least recently
  // used unpinned one (whose expert is forgotten; *evicted gets it when given). The slot becomes
  // the most recently used. kNone when every slot is pinned.
  uint32_t insert(uint32_t layer, uint32_t expert, bool prefetched, Entry* evicted = nullptr);
  // Forgets the expert in `slot` (a copy that failed); the slot becomes the next victim.
  void erase(uint32_t slot);

  void pin(uint32_t slot) { ++entries_[slot].pins; }
  void unpin(uint32_t slot) {
    if (entries_[slot].pins > 0) --entries_[slot].pins;
  }
  // Clears `prefetched` on first use; true if it was set.
  bool take_prefetched(uint32_t slot);

  uint64_t evictions() const { return evictions_; }

 private:
  uint64_t key(uint32_t layer, uint32_t expert) const {
    return uint64_t{layer} * experts_ + expert;
  }
  void unlink(uint32_t slot);
  void push_front(uint32_t slot);  // most recently used
  void push_back(uint32_t slot);   // next victim

  uint32_t layers_;
  uint32_t experts_;
  std::vector<Entry> entries_;
  std::vector<uint32_t> where_;  // [layer][expert] -> slot or kNone
  std::vector<uint32_t> prev_;   // LRU list: head_ most recent, tail_ least
  std::vector<uint32_t> next_;
  uint32_t head_ = kNone;
  uint32_t tail_ = kNone;
  uint32_t used_ = 0;
  uint64_t evictions_ = 0;
};

}  // namespace expertd::engine
