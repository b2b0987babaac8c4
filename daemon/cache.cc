#include "daemon/cache.h"

#include <cassert>

namespace expertd {

ExpertCache::ExpertCache(uint32_t first_slot, uint32_t slot_count, uint32_t layers,
                         uint32_t experts, std::unique_ptr<ReplacementPolicy> policy,
                         abi::SlotEntry* table)
    : first_slot_(first_slot),
      layers_(layers),
      experts_(experts),
      policy_(std::move(policy)),
      table_(table),
      slots_(slot_count),
      key_to_slot_(static_cast<size_t>(layers) * experts, -1) {
  free_list_.reserve(slot_count);
  for (uint32_t i = slot_count; i-- > 0;) free_list_.push_back(i);
  free_count_ = slot_count;
  for (uint32_t i = 0; i < slot_count; ++i) publish(first_slot_ + i);
}

void ExpertCache::set_policy(std::unique_ptr<ReplacementPolicy> policy) {
  policy_ = std::move(policy);
  for (uint32_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].state != SlotState::Ready) continue;
    policy_->on_insert(i, slots_[i].key);
    update_evictable(first_slot_ + i);
  }
}

int32_t ExpertCache::lookup(ExpertKey key) const {
  if (key.layer >= layers_ || key.expert >= experts_) return -1;
  const int32_t local = key_to_slot_[key_index(key)];
  return local < 0 ? -1 : static_cast<int32_t>(first_slot_) + local;
}

void ExpertCache::publish(uint32_t slot) {
  if (table_ == nullptr) return;
  const Slot& s = at(slot);
  abi::SlotEntry& e = table_[slot];
  e.generation = s.generation;
  e.layer = s.key.layer;
  e.expert = s.key.expert;
  const uint32_t st = s.state == SlotState::Ready     ? abi::kSlotReady
                      : s.state == SlotState::Loading ? abi::kSlotLoading
                                                      : abi::kSlotFree;
  // Release: a reader that sees the new state also sees generation/layer/expert above.
  e.state.store(st, std::memory_order_release);
}

void ExpertCache::update_evictable(uint32_t slot) {
  const Slot& s = at(slot);
  policy_->on_evictable(slot - first_slot_,
                        s.state == SlotState::Ready && s.refs == 0 && !s.pinned);
}

void ExpertCache::make_free(uint32_t slot) {
  Slot& s = at(slot);
  assert(s.state != SlotState::Free && s.refs == 0);
  key_to_slot_[key_index(s.key)] = -1;
  if (s.state == SlotState::Ready) --ready_count_;
  if (s.state == SlotState::Loading) --loading_count_;
  s.state = SlotState::Free;
  s.pinned = false;
  policy_->on_remove(slot - first_slot_);
  free_list_.push_back(slot - first_slot_);
  ++free_count_;
  publish(slot);
}

std::optional<uint32_t> ExpertCache::reserve(ExpertKey key, std::optional<ExpertKey>* evicted,
                                             bool force) {
  assert(key.layer < layers_ && key.expert < experts_);
  assert(lookup(key) < 0);
  if (free_list_.empty()) {
    const auto victim = policy_->victim(key, force);
    if (!victim) return std::nullopt;
    const uint32_t slot = first_slot_ + *victim;
    const Slot& v = at(slot);
    // The policy only names slots it was told are evictable.
    assert(v.state == SlotState::Ready && v.refs == 0 && !v.pinned);
    if (evicted != nullptr) *evicted = v.key;
    make_free(slot);
  }
  const uint32_t local = free_list_.back();
  free_list_.pop_back();
  --free_count_;
  Slot& s = slots_[local];
  assert(s.state == SlotState::Free);
  s.state = SlotState::Loading;
  s.key = key;
  s.refs = 0;
  ++s.generation;
  ++loading_count_;
  key_to_slot_[key_index(key)] = static_cast<int32_t>(local);
  publish(first_slot_ + local);
  return first_slot_ + local;
}

void ExpertCache::loaded(uint32_t slot) {
  Slot& s = at(slot);
  assert(s.state == SlotState::Loading);
  s.state = SlotState::Ready;
  --loading_count_;
  ++ready_count_;
  policy_->on_insert(slot - first_slot_, s.key);
  publish(slot);
  update_evictable(slot);
}

void ExpertCache::failed(uint32_t slot) {
  assert(at(slot).state == SlotState::Loading);
  make_free(slot);
}

void ExpertCache::hold(uint32_t slot) {
  Slot& s = at(slot);
  assert(s.state == SlotState::Ready);
  if (s.refs++ == 0) update_evictable(slot);
}

void ExpertCache::unhold(uint32_t slot) {
  Slot& s = at(slot);
  assert(s.state == SlotState::Ready && s.refs > 0);
  if (--s.refs == 0) update_evictable(slot);
}

bool ExpertCache::evict(ExpertKey key) {
  const int32_t slot = lookup(key);
  if (slot < 0) return false;
  const Slot& s = at(static_cast<uint32_t>(slot));
  if (s.state != SlotState::Ready || s.refs != 0 || s.pinned) return false;
  make_free(static_cast<uint32_t>(slot));
  return true;
}

bool ExpertCache::set_pinned(ExpertKey key, bool pinned) {
  const int32_t slot = lookup(key);
  if (slot < 0 || at(static_cast<uint32_t>(slot)).state != SlotState::Ready) return false;
  at(static_cast<uint32_t>(slot)).pinned = pinned;
  update_evictable(static_cast<uint32_t>(slot));
  return true;
}

}  // namespace expertd
