// ExpertStore: the storage engine of one model — its slice map, its arena (cache slots, then
// staging slots) and slot table in sealed shared memory, the two ExpertCaches and the Scheduler —
// over a ReadBackend it shares with the other models of the daemon.
//
// StoreReactor drives one or more stores on one thread: it waits in the backend (io_uring) for read
// completions and watched fds, feeds reads to their stores and pumps new work. The daemon runs it
// on the storage reactor thread; benchmarks and tests run it inline.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cache/cache.h"
#include "cache/scheduler.h"
#include "cache/shm.h"
#include "policy/policy.h"
#include "storage/gguf.h"
#include "storage/reader.h"
#include "storage/slice_map.h"
#include "storage/slot_layout.h"

namespace expertd {

struct StoreOptions {
  uint64_t cache_bytes = 1ull << 30;  // expert cache; 0 = stream everything through staging
  uint32_t staging_slots = 8;
  std::string policy{kDefaultPolicy};
  bool lock_memory = true;  // mlock the arena
  SchedulerOptions scheduler;
};

class ExpertStore {
 public:
  // `files[s]` is the backend's file index of shard s of `model` (already opened).
  static Result<std::unique_ptr<ExpertStore>> create(
      std::string name, GgufModel model, ReadBackend& io, std::span<const uint32_t> files,
      const StoreOptions& options, CompletionSink& sink, LoadObserver* observer = nullptr);

  const std::string& name() const { return name_; }
  const GgufModel& model() const { return model_; }
  const SliceMap& slice_map() const { return map_; }
  const SlotLayouts& layouts() const { return *layouts_; }
  Scheduler& scheduler() { return *scheduler_; }
  ExpertCache& cache() { return *cache_; }
  ExpertCache& staging() { return *staging_; }
  const SharedRegion& arena() const { return arena_; }
  const SharedRegion& slot_table() const { return table_; }
  uint32_t slot_count() const { return cache_->slot_count() + staging_->slot_count(); }
  const uint8_t* slot_data(uint32_t slot) const { return scheduler_->slot_data(slot); }
  // Replaces the cache policy (runtime tuning); READY slots stay cached.
  Status set_policy(const std::string& name);
  // Drops every cached and staged expert nobody holds or pinned, and starts the policy afresh
  // (no history), as after a restart: tuning sweeps start each setting from here. Returns how
  // many experts were dropped.
  uint32_t evict_all();
  // Warm restart (daemon/warm.h): puts `key` into a free cache slot as READY, copying the
  // slot_bytes() bytes at `slot_bytes_from`, an earlier daemon's slot of the same layout. Copied,
  // not adopted: the earlier arena is sealed against new writable mappings. False, changing
  // nothing, when the key has no routed expert, is cached already, or no cache slot is free; and,
  // with the scheduler's checksum table set, when the bytes fail their checksum (counted).
  // Before the reactor starts only.
  bool adopt(ExpertKey key, const uint8_t* slot_bytes_from);
  std::string describe() const;

 private:
  ExpertStore() = default;
  std::string name_;
  GgufModel model_;
  SliceMap map_;
  std::unique_ptr<SlotLayouts> layouts_;
  SharedRegion arena_;
  SharedRegion table_;
  std::unique_ptr<ExpertCache> cache_;
  std::unique_ptr<ExpertCache> staging_;
  std::unique_ptr<Scheduler> scheduler_;
  std::string policy_;
};

// A load observer that checks what each load put in its slot (verify mode: the daemon's main()
// wires expert-forge's verifier in, so this library does not depend on the forge). The daemon
// logs its counts and first messages.
class LoadChecker : public LoadObserver {
 public:
  virtual uint64_t verified() const = 0;
  virtual uint64_t failures() const = 0;
  // The first few failures, described (bounded).
  virtual const std::vector<std::string>& messages() const = 0;
};

// Runs stores over their shared backend on the calling thread.
class StoreReactor {
 public:
  explicit StoreReactor(ReadBackend& io) : io_(io) {}
  void add(ExpertStore* store, uint32_t first_file, uint32_t file_count);
  // Pumps every store, waits up to timeout_ms for events, dispatches reads to their stores and
  // returns the fd events (doorbells) for the caller. Returns the number of fd events or -errno.
  int run_once(int timeout_ms, std::span<IoEvent> fd_events);
  // Runs until every store is idle, or has work left only on reads past their deadline (which may
  // never come back), or the deadline passes; false on timeout.
  bool drain(uint64_t timeout_ms);

 private:
  struct Entry {
    ExpertStore* store;
    uint32_t first_file;
    uint32_t file_count;
  };
  ExpertStore* store_of(const ReadOp& op);
  ReadBackend& io_;
  std::vector<Entry> stores_;
  std::array<IoEvent, 256> events_{};
};

}  // namespace expertd
