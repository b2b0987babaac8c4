#include "engine/vram_tier.h"

namespace expertd::engine {

VramTier::VramTier(uint32_t slots, uint32_t layers, uint32_t experts)
    : layers_(layers),
      experts_(experts),
      entries_(slots),
      where_(uint64_t{layers} * experts, kNone),
      prev_(slots, kNone),
      next_(slots, kNone) {
  for (uint32_t s = 0; s < slots; ++s) push_back(s);
}

void VramTier::unlink(uint32_t slot) {
  const uint32_t p = prev_[slot];
  const uint32_t n = next_[slot];
  (p == kNone ? head_ : next_[p]) = n;
  (n == kNone ? tail_ : prev_[n]) = p;
  prev_[slot] = next_[slot] = kNone;
}

void VramTier::push_front(uint32_t slot) {
  prev_[slot] = kNone;
  next_[slot] = head_;
  (head_ == kNone ? tail_ : prev_[head_]) = slot;
  head_ = slot;
}

void VramTier::push_back(uint32_t slot) {
  next_[slot] = kNone;
  prev_[slot] = tail_;
  (tail_ == kNone ? head_ : next_[tail_]) = slot;
  tail_ = slot;
}

uint32_t VramTier::find(uint32_t layer, uint32_t expert) {
  if (layer >= layers_ || expert >= experts_) return kNone;
  const uint32_t slot = where_[key(layer, expert)];
  if (slot == kNone) return kNone;
  unlink(slot);
  push_front(slot);
  return slot;
}

bool VramTier::contains(uint32_t layer, uint32_t expert) const {
  return layer < layers_ && expert < experts_ && where_[key(layer, expert)] != kNone;
}

uint32_t VramTier::insert(uint32_t layer, uint32_t expert, bool prefetched, Entry* evicted) {
  if (layer >= layers_ || expert >= experts_ || where_[key(layer, expert)] != kNone) return kNone;
  uint32_t slot = tail_;
  while (slot != kNone && entries_[slot].pins > 0) slot = prev_[slot];
  if (slot == kNone) return kNone;
  Entry& e = entries_[slot];
  if (evicted != nullptr) *evicted = e;
  if (e.layer != kNone) {
    where_[key(e.layer, e.expert)] = kNone;
    ++evictions_;
  } else {
    ++used_;
  }
  e = Entry{layer, expert, 0, prefetched};
  where_[key(layer, expert)] = slot;
  unlink(slot);
  push_front(slot);
  return slot;
}

void VramTier::erase(uint32_t slot) {
  Entry& e = entries_[slot];
  if (e.layer == kNone) return;
  where_[key(e.layer, e.expert)] = kNone;
  e = Entry{};
  --used_;
  unlink(slot);
  push_back(slot);
}

bool VramTier::take_prefetched(uint32_t slot) {
  const bool was = entries_[slot].prefetched;
  entries_[slot].prefetched = false;
  return was;
}

}  // namespace expertd::engine
