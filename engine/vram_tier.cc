#include "engine/vram_tier.h"

#include <fmt/format.h>

#include <algorithm>

namespace expertd::engine {

Result<std::unique_ptr<VramTier>> VramTier::create(uint32_t slots, uint32_t layers,
                                                   uint32_t experts, std::string_view policy) {
  if (slots == 0 || layers == 0 || experts == 0) {
    return make_error(EINVAL,
                      fmt::format("a VRAM tier needs slots, layers and experts ({}, {}, {})", slots,
                                  layers, experts));
  }
  std::unique_ptr<ReplacementPolicy> p;
  EXPERTD_TRY_ASSIGN(p, make_policy(policy, PolicyShape{slots, layers, experts}));
  return std::unique_ptr<VramTier>(new VramTier(slots, layers, experts, std::move(p)));
}

VramTier::VramTier(uint32_t slots, uint32_t layers, uint32_t experts,
                   std::unique_ptr<ReplacementPolicy> policy)
    : layers_(layers),
      experts_(experts),
      policy_(std::move(policy)),
      entries_(slots),
      where_(uint64_t{layers} * experts, kNone) {
  free_.reserve(slots);
  for (uint32_t s = slots; s-- > 0;) free_.push_back(s);
}

uint32_t VramTier::find(uint32_t layer, uint32_t expert) {
  if (layer >= layers_ || expert >= experts_) return kNone;
  const uint32_t slot = where_[key(layer, expert)];
  policy_->on_access(ExpertKey{layer, expert}, slot == kNone ? -1 : static_cast<int32_t>(slot));
  return slot;
}

bool VramTier::contains(uint32_t layer, uint32_t expert) const {
  return layer < layers_ && expert < experts_ && where_[key(layer, expert)] != kNone;
}

uint32_t VramTier::insert(uint32_t layer, uint32_t expert, bool prefetched, bool force,
                          Entry* evicted) {
  if (layer >= layers_ || expert >= experts_ || where_[key(layer, expert)] != kNone) return kNone;
  const ExpertKey incoming{layer, expert};
  uint32_t slot = kNone;
  if (!free_.empty()) {
    // Room costs nothing: admitted without asking.
    slot = free_.back();
    free_.pop_back();
    ++used_;
    if (evicted != nullptr) *evicted = Entry{};
  } else {
    std::optional<uint32_t> v = policy_->victim(incoming, force);
    if (!v && force && sweeping_) {
      // Only held slots left: the sweep's hold gives way to an expert that must be in VRAM.
      end_sweep();
      v = policy_->victim(incoming, force);
    }
    if (!v) {
      // Every slot pinned, or not worth a slot: the caller streams it.
      if (!force) ++refusals_;
      return kNone;
    }
    slot = *v;
    Entry& old = entries_[slot];
    if (evicted != nullptr) *evicted = old;
    where_[key(old.layer, old.expert)] = kNone;
    policy_->on_remove(slot);
    ++evictions_;
  }
  entries_[slot] = Entry{layer, expert, 0, prefetched};
  where_[key(layer, expert)] = slot;
  policy_->on_insert(slot, incoming);
  policy_->on_evictable(slot, !held(entries_[slot]));
  return slot;
}

void VramTier::erase(uint32_t slot) {
  Entry& e = entries_[slot];
  if (e.layer == kNone) return;
  where_[key(e.layer, e.expert)] = kNone;
  e = Entry{};
  --used_;
  policy_->on_remove(slot);
  free_.push_back(slot);
}

void VramTier::pin(uint32_t slot) {
  Entry& e = entries_[slot];
  if (e.pins++ == 0 && e.layer != kNone && !held(e)) policy_->on_evictable(slot, false);
}

void VramTier::unpin(uint32_t slot) {
  Entry& e = entries_[slot];
  if (e.pins == 0) return;
  if (--e.pins == 0 && e.layer != kNone && !held(e)) policy_->on_evictable(slot, true);
}

void VramTier::begin_sweep() {
  if (sweeping_) end_sweep();
  sweeping_ = true;
  swept_ = 0;
  // Every resident is held now; the pinned ones are already not evictable.
  for (uint32_t s = 0; s < entries_.size(); ++s) {
    const Entry& e = entries_[s];
    if (e.layer != kNone && e.pins == 0) policy_->on_evictable(s, false);
  }
}

void VramTier::sweep_to(uint32_t layer) {
  if (!sweeping_) return;
  const uint32_t upto = std::min(layer, layers_);
  for (; swept_ < upto; ++swept_) {  // layer swept_ is passed: its unpinned residents evictable
    for (uint32_t x = 0; x < experts_; ++x) {
      const uint32_t slot = where_[key(swept_, x)];
      if (slot != kNone && entries_[slot].pins == 0) policy_->on_evictable(slot, true);
    }
  }
}

void VramTier::end_sweep() {
  if (!sweeping_) return;
  for (uint32_t s = 0; s < entries_.size(); ++s) {
    const Entry& e = entries_[s];
    if (held(e) && e.pins == 0) policy_->on_evictable(s, true);
  }
  sweeping_ = false;
}

uint32_t VramTier::distinct_with(std::span<const uint8_t> host) const {
  uint32_t n = 0;
  for (const uint8_t h : host) n += h != 0;
  for (const Entry& e : entries_) {
    if (e.layer == kNone) continue;
    const uint64_t i = key(e.layer, e.expert);
    if (i >= host.size() || host[i] == 0) ++n;
  }
  return n;
}

bool VramTier::take_prefetched(uint32_t slot) {
  const bool was = entries_[slot].prefetched;
  entries_[slot].prefetched = false;
  return was;
}

}  // namespace expertd::engine
