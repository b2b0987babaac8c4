#include "cache/store.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "base/check.h"

namespace expertd {

Result<std::unique_ptr<ExpertStore>> ExpertStore::create(
    std::string name, GgufModel model, ReadBackend& io, std::span<const uint32_t> files,
    const StoreOptions& options, CompletionSink& sink, LoadObserver* observer) {
  std::unique_ptr<ExpertStore> s(new ExpertStore());
  s->name_ = std::move(name);
  s->model_ = std::move(model);
  EXPERTD_TRY_ASSIGN(s->map_, SliceMap::build(s->model_));
  if (s->map_.layers().empty()) {
    return make_error(EINVAL, fmt::format("model '{}' ({}): no routed expert tensors", s->name_,
                                          s->model_.meta().path()));
  }
  if (files.size() != s->model_.shards().size()) {
    return make_error(EINVAL, fmt::format("model '{}': {} backend files for {} shards", s->name_,
                                          files.size(), s->model_.shards().size()));
  }
  uint32_t alignment = 512;
  for (const uint32_t f : files) alignment = std::max(alignment, io.file(f).dio_alignment);
  s->layouts_ = std::make_unique<SlotLayouts>(s->map_, alignment, page_bytes());
  const uint64_t slot_bytes = s->layouts_->slot_bytes();
  const uint64_t cache_slots64 = options.cache_bytes / slot_bytes;
  // Never more slots than experts: a larger cache would sit empty.
  const uint64_t experts = static_cast<uint64_t>(s->map_.layers().size()) * s->map_.expert_count();
  const auto cache_slots = static_cast<uint32_t>(std::min(cache_slots64, experts));
  const uint32_t staging_slots = std::max<uint32_t>(options.staging_slots, cache_slots ? 0 : 1);
  const uint32_t slots = cache_slots + staging_slots;

  EXPERTD_TRY_ASSIGN(s->arena_, SharedRegion::create("expertd-arena-" + s->name_,
                                                     slot_bytes * slots, options.lock_memory));
  EXPERTD_TRY_ASSIGN(s->table_, SharedRegion::create("expertd-slots-" + s->name_,
                                                     abi::slot_table_bytes(slots), false));
  auto* header = reinterpret_cast<abi::SlotTableHeader*>(s->table_.data());
  header->magic = abi::kSlotTableMagic;
  header->version = abi::kProtocolVersion;
  header->slot_count = slots;
  header->slot_bytes = slot_bytes;
  header->arena_bytes = s->arena_.size();
  auto* entries = reinterpret_cast<abi::SlotEntry*>(s->table_.data() + sizeof(*header));

  const uint32_t layers = s->map_.block_count();
  const uint32_t n_experts = s->map_.expert_count();
  std::unique_ptr<ReplacementPolicy> policy;
  EXPERTD_TRY_ASSIGN(policy, make_policy(options.policy, {cache_slots, layers, n_experts}));
  std::unique_ptr<ReplacementPolicy> fifo;
  EXPERTD_TRY_ASSIGN(fifo, make_policy("fifo", {staging_slots, layers, n_experts}));
  s->policy_ = options.policy;
  s->cache_ =
      std::make_unique<ExpertCache>(0, cache_slots, layers, n_experts, std::move(policy), entries);
  s->staging_ = std::make_unique<ExpertCache>(cache_slots, staging_slots, layers, n_experts,
                                              std::move(fifo), entries);
  s->scheduler_ =
      std::make_unique<Scheduler>(io, s->map_, *s->layouts_, files, *s->cache_, *s->staging_,
                                  s->arena_.data(), options.scheduler, sink, observer);
  return s;
}

Status ExpertStore::set_policy(const std::string& name) {
  std::unique_ptr<ReplacementPolicy> p;
  EXPERTD_TRY_ASSIGN(
      p, make_policy(name, {cache_->slot_count(), map_.block_count(), map_.expert_count()}));
  cache_->set_policy(std::move(p));
  policy_ = name;
  return Ok{};
}

uint32_t ExpertStore::evict_all() {
  const uint32_t n = cache_->evict_all() + staging_->evict_all();
  // The same policy, without the history of what was evicted; it cannot fail for a name in use.
  const Status st = set_policy(policy_);
  EXPERTD_CHECK(st);
  (void)st;
  return n;
}

bool ExpertStore::adopt(ExpertKey key, const uint8_t* slot_bytes_from) {
  if (map_.find_layer(key.layer) == nullptr || key.expert >= map_.expert_count()) return false;
  if (cache_->lookup(key) >= 0 || cache_->free_count() == 0) return false;
  // A free slot under the limit exists, so reserve() evicts nothing.
  const auto slot = cache_->reserve(key, nullptr, true);
  if (!slot) return false;
  std::memcpy(arena_.data() + static_cast<uint64_t>(*slot) * layouts_->slot_bytes(),
              slot_bytes_from, layouts_->slot_bytes());
  // With the checksum manifest on, an expert taken over is checked as a read one is.
  if (!scheduler_->checksum_matches(key, slot_data(*slot))) {
    scheduler_->count_checksum_mismatch();
    cache_->failed(*slot);
    return false;
  }
  cache_->loaded(*slot);
  // Verify mode checks what a restart brought in as it checks what a read did.
  if (LoadObserver* o = scheduler_->observer()) o->loaded(key, *slot, slot_data(*slot), 0);
  return true;
}

std::string ExpertStore::describe() const {
  return fmt::format(
      "model '{}': {} MoE layers x {} experts, slot {} KiB (DIO alignment {}), cache {} slots "
      "({} MiB, policy {}), staging {} slots, arena {}",
      name_, map_.layers().size(), map_.expert_count(), layouts_->slot_bytes() / 1024,
      layouts_->alignment(), cache_->slot_count(),
      cache_->slot_count() * layouts_->slot_bytes() >> 20, policy_, staging_->slot_count(),
      arena_.locked() ? "mlocked" : "not locked (" + arena_.lock_error() + ")");
}

// ---------------------------------------------------------------------------------------------

void StoreReactor::add(ExpertStore* store, uint32_t first_file, uint32_t file_count) {
  stores_.push_back(Entry{store, first_file, file_count});
}

ExpertStore* StoreReactor::store_of(const ReadOp& op) {
  for (const Entry& e : stores_) {
    if (op.file - e.first_file < e.file_count) return e.store;
  }
  return nullptr;
}

int StoreReactor::run_once(int timeout_ms, std::span<IoEvent> fd_events) {
  uint64_t retry_ns = 0;
  for (const Entry& e : stores_) {
    e.store->scheduler().pump();
    const uint64_t t = e.store->scheduler().next_retry_ns();
    if (t != 0 && (retry_ns == 0 || t < retry_ns)) retry_ns = t;
  }
  if (retry_ns != 0) {
    // A read waiting out its backoff is resubmitted by the pump after the wait: wake in time.
    const uint64_t now = monotonic_ns();
    const int due_ms =
        retry_ns <= now ? 0 : static_cast<int>((retry_ns - now + 999'999) / 1'000'000);
    if (timeout_ms < 0 || due_ms < timeout_ms) timeout_ms = due_ms;
  }
  const int n = io_.wait(events_, timeout_ms);
  if (n < 0) return n;
  int fds = 0;
  for (int i = 0; i < n; ++i) {
    const IoEvent& ev = events_[static_cast<size_t>(i)];
    if (ev.kind == IoEvent::Kind::Read) {
      ExpertStore* s = store_of(*ev.op);
      if (s != nullptr) s->scheduler().on_read(ev.op);
    } else if (static_cast<size_t>(fds) < fd_events.size()) {
      fd_events[static_cast<size_t>(fds++)] = ev;
    }
  }
  for (const Entry& e : stores_) e.store->scheduler().pump();
  return fds;
}

bool StoreReactor::drain(uint64_t timeout_ms) {
  const uint64_t deadline = monotonic_ns() + timeout_ms * 1'000'000ull;
  while (true) {
    bool idle = true;
    for (const Entry& e : stores_) {
      const Scheduler& s = e.store->scheduler();
      idle = idle && (s.idle() || s.only_stalled_reads_left());
    }
    if (idle) return true;
    if (monotonic_ns() > deadline) return false;
    if (run_once(10, {}) < 0) return false;
  }
}

}  // namespace expertd
