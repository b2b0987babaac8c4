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

#include "daemon/cache.h"
#include "daemon/policy.h"
#include "daemon/scheduler.h"
#include "daemon/shm.h"
#include "storage/gguf.h"
#include "storage/reader.h"
#include "storage/slice_map.h"
#include "storage/slot_layout.h"

namespace expertd {

struct StoreOptions {
  uint64_t cache_bytes = 1ull << 30;  // expert cache; 0 = stream everything through staging
  uint32_t staging_slots = 8;
  std::string policy = "cyclic";
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

// Checks every slot an ExpertStore fills against expert-forge's content function (verify mode).
// Counts failures; the first few are described for the log.
class ForgeVerifier final : public LoadObserver {
 public:
  // Errors when `model` is not a forged model.
  static Result<std::unique_ptr<ForgeVerifier>> create(const GgufModel& model, const SliceMap& map,
                                                       const SlotLayouts& layouts);
  void loaded(ExpertKey key, uint32_t slot, const uint8_t* slot_data, uint64_t latency_ns) override;
  void failed(ExpertKey key, int error) override;

  uint64_t verified() const { return verified_; }
  uint64_t failures() const { return failures_; }
  uint64_t load_errors() const { return load_errors_; }
  const std::vector<std::string>& messages() const { return messages_; }
  // Latencies (read start → READY) of every load seen, in ns, in completion order (bounded).
  const std::vector<uint64_t>& latencies_ns() const { return latencies_; }
  // A load observer to forward to (e.g. a stats collector), or nullptr.
  void chain(LoadObserver* next) { next_ = next; }

 private:
  const GgufModel* model_ = nullptr;
  const SliceMap* map_ = nullptr;
  const SlotLayouts* layouts_ = nullptr;
  uint64_t seed_ = 0;
  std::vector<uint8_t> expected_;
  uint64_t verified_ = 0;
  uint64_t failures_ = 0;
  uint64_t load_errors_ = 0;
  std::vector<std::string> messages_;
  std::vector<uint64_t> latencies_;
  LoadObserver* next_ = nullptr;
};

// Runs stores over their shared backend on the calling thread.
class StoreReactor {
 public:
  explicit StoreReactor(ReadBackend& io) : io_(io) {}
  void add(ExpertStore* store, uint32_t first_file, uint32_t file_count);
  // Pumps every store, waits up to timeout_ms for events, dispatches reads to their stores and
  // returns the fd events (doorbells) for the caller. Returns the number of fd events or -errno.
  int run_once(int timeout_ms, std::span<IoEvent> fd_events);
  // Runs until every store is idle (or the deadline passes); false on timeout.
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
