#include "cache/cache.h"

#include <algorithm>

#include "base/check.h"

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
  client_copies_.reserve(slot_count);
  for (uint32_t i = slot_count; i-- > 0;) free_list_.push_back(i);
  free_count_ = slot_count;
  limit_ = slot_count;
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
  EXPERTD_CHECK_NE(s.state, SlotState::Free);
  EXPERTD_CHECK_EQ(s.refs, 0);
  key_to_slot_[key_index(s.key)] = -1;
  if (s.state == SlotState::Ready) --ready_count_;
  if (s.state == SlotState::Loading) --loading_count_;
  s.state = SlotState::Free;
  if (s.pinned) --pinned_count_;
  s.pinned = false;
  s.client_copy = false;
  policy_->on_remove(slot - first_slot_);
  free_list_.push_back(slot - first_slot_);
  ++free_count_;
  publish(slot);
}

void ExpertCache::evict_slot(uint32_t slot) {
  const Slot& v = at(slot);
  EXPERTD_CHECK_EQ(v.state, SlotState::Ready);
  EXPERTD_CHECK_EQ(v.refs, 0);
  EXPERTD_CHECK(!v.pinned);
  if (listener_ != nullptr) listener_->evicted(slot, v.key);
  make_free(slot);
}

std::optional<uint32_t> ExpertCache::reserve(ExpertKey key, std::optional<ExpertKey>* evicted,
                                             bool force) {
  EXPERTD_CHECK_LT(key.layer, layers_);
  EXPERTD_CHECK_LT(key.expert, experts_);
  EXPERTD_CHECK_LT(lookup(key), 0);
  // Room under the limit: one victim normally; more while held slots kept a lowered limit from
  // taking effect (bounded by the slot count).
  while (free_list_.empty() || used() >= limit_) {
    if (limit_ == 0) return std::nullopt;
    // A copy a client also keeps (in VRAM) is worth less than any the policy weighs.
    std::optional<uint32_t> victim = client_copy_victim();
    if (!victim) victim = policy_->victim(key, force);
    if (!victim) return std::nullopt;
    // The policy only names slots it was told are evictable (evict_slot() asserts it).
    const uint32_t slot = first_slot_ + *victim;
    if (evicted != nullptr) *evicted = at(slot).key;
    evict_slot(slot);
  }
  const uint32_t local = free_list_.back();
  free_list_.pop_back();
  --free_count_;
  Slot& s = slots_[local];
  EXPERTD_CHECK_EQ(s.state, SlotState::Free);
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
  EXPERTD_CHECK_EQ(s.state, SlotState::Loading);
  s.state = SlotState::Ready;
  --loading_count_;
  ++ready_count_;
  policy_->on_insert(slot - first_slot_, s.key);
  publish(slot);
  update_evictable(slot);
}

void ExpertCache::failed(uint32_t slot) {
  EXPERTD_CHECK_EQ(at(slot).state, SlotState::Loading);
  make_free(slot);
}

void ExpertCache::hold(uint32_t slot) {
  Slot& s = at(slot);
  EXPERTD_CHECK_EQ(s.state, SlotState::Ready);
  s.client_copy = false;  // someone wants it from host memory after all
  if (s.refs++ == 0) update_evictable(slot);
}

void ExpertCache::unhold(uint32_t slot) {
  Slot& s = at(slot);
  EXPERTD_CHECK_EQ(s.state, SlotState::Ready);
  EXPERTD_CHECK_GT(s.refs, 0);
  if (--s.refs == 0) update_evictable(slot);
}

bool ExpertCache::evict(ExpertKey key) {
  const int32_t slot = lookup(key);
  if (slot < 0) return false;
  const Slot& s = at(static_cast<uint32_t>(slot));
  if (s.state != SlotState::Ready || s.refs != 0 || s.pinned) return false;
  evict_slot(static_cast<uint32_t>(slot));
  return true;
}

uint32_t ExpertCache::evict_all() {
  uint32_t n = 0;
  for (uint32_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = slots_[i];
    if (s.state != SlotState::Ready || s.refs != 0 || s.pinned) continue;
    evict_slot(first_slot_ + i);
    ++n;
  }
  return n;
}

uint32_t ExpertCache::set_limit(uint32_t slots) {
  limit_ = slots == 0 ? slot_count() : std::min(slots, slot_count());
  uint32_t n = 0;
  while (used() > limit_) {
    const auto victim = policy_->victim(ExpertKey{}, true);
    if (!victim) break;  // the rest is held, pinned or loading: reserve() goes on later
    evict_slot(first_slot_ + *victim);
    ++n;
  }
  return n;
}

bool ExpertCache::set_pinned(ExpertKey key, bool pinned) {
  const int32_t slot = lookup(key);
  if (slot < 0 || at(static_cast<uint32_t>(slot)).state != SlotState::Ready) return false;
  Slot& s = at(static_cast<uint32_t>(slot));
  if (s.pinned != pinned) pinned ? ++pinned_count_ : --pinned_count_;
  s.pinned = pinned;
  update_evictable(static_cast<uint32_t>(slot));
  return true;
}

void ExpertCache::set_client_copy(uint32_t slot) {
  Slot& s = at(slot);
  if (s.state != SlotState::Ready) return;
  s.client_copy = true;
  if (!s.listed) {
    s.listed = true;
    client_copies_.push_back(slot - first_slot_);
  }
}

void ExpertCache::clear_client_copy(ExpertKey key) {
  const int32_t slot = lookup(key);
  // The list entry goes at the next victim search, as for a hold.
  if (slot >= 0) at(static_cast<uint32_t>(slot)).client_copy = false;
}

std::optional<uint32_t> ExpertCache::client_copy_victim() {
  for (size_t i = 0; i < client_copies_.size();) {
    const uint32_t local = client_copies_[i];
    Slot& s = slots_[local];
    if (!s.client_copy) {
      // Acquired again or freed since: no longer a client copy.
      s.listed = false;
      client_copies_[i] = client_copies_.back();
      client_copies_.pop_back();
      continue;
    }
    if (s.state == SlotState::Ready && s.refs == 0 && !s.pinned) return local;
    ++i;  // held or pinned for now
  }
  return std::nullopt;
}

}  // namespace expertd
