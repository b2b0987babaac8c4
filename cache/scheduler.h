// Scheduler: turns expert requests into reads, over the cache, the staging ring and a ReadBackend.
//
//  - acquire (demand): a READY expert completes at once; one LOADING joins that load (requests for
//    the same expert coalesce into one read); otherwise a slot is reserved (cache, or staging when
//    the cache refuses or has size 0) and a load starts. Demand loads are read before prefetches.
//  - prefetch (hint): queued by (layers ahead of the session's cursor, router score). A queued
//    prefetch whose layer the cursor has passed is dropped; a submitted one nobody waits for is
//    cancelled. A hint is for the cursor's token when its layer is after the cursor's, else for
//    the next token (the engine sets the cursor to layer L, then hints L+1..L+d, then acquires L).
//  - prefetch admission (docs/CACHE.md "Prefetch admission and automatic depth"): a hint's
//    probability is the model's running estimate of hint precision at its depth (calibrated, not
//    the router's score), told to the policy (on_hint) before any slot is reserved. A hint below
//    break-even (kPrefetchMinProbability) is not read; one takes a free cache slot, or one that
//    needs an eviction when its distance-discounted worth clears kPrefetchEvictWorth and the
//    policy admits it (never forced); otherwise it streams through the staging ring, which evicts
//    only staged experts.
//  - automatic depth (prefetch_depth == kPrefetchDepthAuto): the deepest depth, up to
//    kPrefetchAutoMaxDepth, at which every nearer depth's estimate clears break-even. The estimate
//    is passive (hints and the acquires that matched them), so depths not loaded are measured too.
//  - telemetry by prefetch depth (docs/CACHE.md): each hint's depth is how many layers ahead of
//    the cursor it is; hints, the loads they start and those loads' outcome (useful: acquired
//    before eviction; wasted: evicted, cancelled or dropped unacquired) are counted per depth, and
//    so are acquires of experts that were hinted at that depth for that (token, layer).
//  - bytes in flight are bounded: at most `queue_depth` chunk reads, and prefetch loads only for
//    layers within `prefetch_depth` of the cursor.
//  - each expert's slices are read widened to the DIO alignment, in chunks of `chunk_bytes`
//    (0 = whole slice). A short read is requeued for the rest (through the buffered fd when the
//    remainder is unaligned, so it always progresses), -EAGAIN is retried, and any other error
//    fails that expert only.
//
// Single-threaded (the storage reactor). Every queue and pool has a fixed size from construction;
// nothing on the request or completion path allocates.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "base/clock.h"
#include "cache/cache.h"
#include "client/include/expertd/control_types.h"
#include "storage/reader.h"
#include "storage/slice_map.h"
#include "storage/slot_layout.h"

namespace expertd {

// prefetch_depth for "choose it from the measured hint precision".
inline constexpr uint32_t kPrefetchDepthAuto = client::kPrefetchDepthAuto;
// The admission rule's constants (docs/CACHE.md "Prefetch admission and automatic depth").
// A prefetch read is worth its disk time when p > 1 - p: a right one saves a demand read, a wrong
// one delays demand reads by as much on a saturated disk.
inline constexpr double kPrefetchMinProbability = 0.5;
// The scheduler's own floor for evicting a cached expert: (2p - 1) / distance, the net saving per
// layer the slot is held, must beat this guess of a victim's worth (the policy, told the hint,
// compares with the real victim).
inline constexpr double kPrefetchEvictWorth = 0.25;
inline constexpr uint32_t kPrefetchAutoMaxDepth = 2;
// Auto mode reads ahead only when hints are right more often than this. On a saturated disk a
// right prefetch saves at most the compute it overlaps, g = compute / read time per token, while a
// wrong one costs its whole read: break-even is p = 1 / (1 + g), 0.5 only when compute hides every
// read. The daemon does not measure g; 0.9 covers g down to 0.11 (a token's reads nine times its
// compute), and it leaves a depth again below 0.85.
inline constexpr double kPrefetchAutoMinProbability = 0.9;
// The estimate forgets with a window of this many hints per depth, and counts a depth only after
// this much (decayed) evidence.
inline constexpr double kPrecisionWindow = 512;
inline constexpr double kPrecisionMinEvidence = 32;

struct SchedulerOptions {
  uint32_t queue_depth = 32;       // chunk reads in flight
  uint64_t chunk_bytes = 1 << 20;  // widened reads are split into chunks of this size; 0 = whole
  uint32_t prefetch_depth = kPrefetchDepthAuto;  // layers ahead prefetches may cover, or auto
  // Prefetch hints whose calibrated probability is below this stream through staging even when
  // a cache slot is free (0: staging only for those that would evict and may not).
  double staging_probability = 0.0;
  uint32_t max_loads = 512;        // loads in progress at once
  uint32_t max_waiters = 8192;     // acquires waiting on loads
  uint32_t max_prefetches = 2048;  // queued prefetch hints
  uint32_t max_sessions = 64;
};

// What a finished acquire reports. slot >= 0: READY and held for the session (release it);
// else -errno (EIO: the read failed; ECANCELED: the session went away; EBUSY: no capacity).
struct Completion {
  uint32_t session = 0;
  uint64_t tag = 0;
  int32_t slot = 0;
  uint32_t generation = 0;
  ExpertKey key;
};

// Receives completions. complete() must not call back into the Scheduler (queue the completion
// and act on it after the Scheduler call returns).
class CompletionSink {
 public:
  virtual ~CompletionSink() = default;
  virtual void complete(const Completion& c) = 0;
};

// Optional: told when an expert becomes READY (verify mode, tests) or a load fails.
class LoadObserver {
 public:
  virtual ~LoadObserver() = default;
  virtual void loaded(ExpertKey key, uint32_t slot, const uint8_t* slot_data,
                      uint64_t latency_ns) = 0;
  virtual void failed(ExpertKey key, int error) = 0;
};

// Depth buckets of the prefetch telemetry: bucket i holds depth i + 1, the last one depth 8 or
// more.
inline constexpr uint32_t kPrefetchDepthBuckets = 8;

// The counters (one definition, shared with the control plane: client/expertd.capnp lists them).
using SchedulerStats = client::SchedulerStats;
using PrefetchDepthStats = client::PrefetchDepthStats;  // outcomes for one depth (docs/CACHE.md)
using PrefetchDepths = std::array<PrefetchDepthStats, kPrefetchDepthBuckets>;

// Zero counters for every bucket, each labelled with its depth (1..8).
constexpr PrefetchDepths empty_prefetch_depths() {
  PrefetchDepths d{};
  for (uint32_t i = 0; i < kPrefetchDepthBuckets; ++i) d[i].depth = i + 1;
  return d;
}

class Scheduler final : private EvictionListener {
 public:
  // `files[s]` is the backend file index of shard s. `arena` holds every slot, cache then staging.
  Scheduler(ReadBackend& io, const SliceMap& map, const SlotLayouts& layouts,
            std::span<const uint32_t> files, ExpertCache& cache, ExpertCache& staging,
            uint8_t* arena, const SchedulerOptions& options, CompletionSink& sink,
            LoadObserver* observer = nullptr);

  // Returns 0 (the completion follows, maybe at once) or -EINVAL for an expert outside the model.
  int acquire(uint32_t session, ExpertKey key, uint64_t tag);
  // Hints that `session` will want `key` soon; score in [0, 1] from the router.
  int prefetch(uint32_t session, ExpertKey key, float score);
  // Drops one hold of `session` on `slot` (taken by a completed acquire).
  int release(uint32_t session, uint32_t slot);
  // The session's engine is at (token, layer): prefetches for layers it has passed are dropped.
  void set_cursor(uint32_t session, uint32_t token, uint32_t layer);
  // The session is gone: its waiting acquires are unlinked, its queued hints go and its prefetch
  // loads nobody waits for are cancelled. (Its holds are the caller's to release: the session
  // layer tracks them.)
  void drop_session(uint32_t session);

  // Feeds a finished read (an IoEvent::Kind::Read from the backend).
  void on_read(ReadOp* op);
  // Starts queued work within the budgets and hands new reads to the backend.
  void pump();
  // No load in progress and nothing queued.
  bool idle() const;

  // A depth or kPrefetchDepthAuto.
  void set_prefetch_depth(uint32_t depth);
  // The depth prefetches may cover now (auto: the one chosen from the estimates).
  uint32_t prefetch_depth_now() const;
  bool prefetch_depth_auto() const { return options_.prefetch_depth == kPrefetchDepthAuto; }
  // The running estimate of hint precision at depth bucket b (the probability a hint made that
  // far ahead is acquired at its target), and how much (decayed) evidence it rests on.
  double precision_estimate(uint32_t bucket) const;
  double precision_evidence(uint32_t bucket) const { return est_hints_[bucket]; }
  // useful / (useful + wasted) of recent prefetch reads, with bucket b's hint precision as the
  // prior (worth 64 reads).
  double read_precision(uint32_t bucket) const;
  // Forgets the estimates (a sweep's settings start equal; evict_all restarts a model's history).
  void reset_estimates();
  void set_observer(LoadObserver* observer) { observer_ = observer; }
  LoadObserver* observer() const { return observer_; }
  void set_queue_depth(uint32_t depth);
  const SchedulerOptions& options() const { return options_; }
  const SchedulerStats& stats() const { return stats_; }
  // The prefetch telemetry by depth: the model's, and one session's.
  const PrefetchDepths& depths() const { return depths_; }
  // The prefetch telemetry of one session (zero for a session id not in use).
  const PrefetchDepths& session_depths(uint32_t session) const { return session_depths_[session]; }
  uint32_t reads_in_flight() const { return ops_in_flight_; }
  uint64_t slot_bytes() const { return layouts_.slot_bytes(); }
  uint8_t* slot_data(uint32_t slot) const { return arena_ + slot * layouts_.slot_bytes(); }

 private:
  static constexpr uint32_t kNil = UINT32_MAX;
  static constexpr uint16_t kNoSession = UINT16_MAX;

  struct Cursor {
    uint32_t token = 0;
    uint32_t layer = 0;
    bool set = false;
  };
  struct Waiter {
    uint32_t session = 0;
    uint64_t tag = 0;
    uint32_t next = kNil;
  };
  struct Load {
    ExpertKey key;
    uint32_t slot = 0;
    bool active = false;
    bool demand = false;      // someone waits: read before prefetches
    bool prefetched = false;  // started by a hint
    bool cancelled = false;
    int32_t error = 0;
    uint32_t waiters = kNil;  // list head
    uint32_t waiters_tail = kNil;
    uint32_t slice_count = 0;
    std::array<ExpertSlice, 3> slices{};
    std::array<SlicePlacement, 3> place{};
    uint32_t next_slice = 0;  // next chunk to submit: slice index and byte offset in its read
    uint64_t next_offset = 0;
    uint32_t ops = 0;  // chunk reads in flight
    uint32_t prefetch_session = 0;
    uint32_t prefetch_bucket = 0;  // depth bucket of the hint that started it
    uint64_t prefetch_target = 0;  // (token << 32 | layer) the prefetch is for
    uint64_t bytes_planned = 0;    // widened bytes of all its reads
    uint64_t bytes_done = 0;       // bytes its reads delivered
    uint64_t start_ns = 0;         // when its first read was submitted (latency excludes queueing)
    uint32_t queue_next = kNil;    // in the demand or prefetch load queue
  };
  struct Chunk {
    ReadOp op;
    uint32_t load = kNil;  // kNil while free
    uint32_t needed = 0;   // bytes of this read that hold slice data (the rest is widening)
    uint32_t next_free = kNil;
  };
  struct Hint {
    uint32_t session = 0;
    ExpertKey key;
    float score = 0;
    uint64_t target = 0;  // (token << 32 | layer)
    uint32_t bucket = 0;  // depth bucket when the (nearest) hint arrived
    bool live = false;
  };
  // The depths at which an expert was hinted for one target token (recall telemetry).
  struct HintMark {
    uint32_t token = 0;
    uint16_t session = kNoSession;
    uint8_t buckets = 0;  // bit b: hinted at depth bucket b
  };
  // A READY slot filled by a prefetch and not yet acquired: who hinted it, how deep, its bytes.
  struct PrefetchedSlot {
    bool pending = false;
    uint16_t session = kNoSession;
    uint8_t bucket = 0;
    uint64_t bytes = 0;
  };

  bool valid(ExpertKey key) const;
  int32_t find_slot(ExpertKey key, ExpertCache** owner);
  ExpertCache& owner_of(uint32_t slot) { return cache_.owns(slot) ? cache_ : staging_; }
  uint32_t start_load(ExpertKey key, bool to_staging, bool demand);
  bool serve(uint32_t session, ExpertKey key, uint64_t tag);
  bool add_waiter(uint32_t load, uint32_t session, uint64_t tag);
  void finish_load(uint32_t load);
  bool submit_next_chunk();
  bool submit_chunk_of(uint32_t load);
  void requeue(uint32_t chunk);
  void start_prefetches();
  bool hint_passed(const Hint& h) const;
  uint64_t hint_distance(const Hint& h) const;
  void cancel_passed_prefetch_loads();
  void retry_pending_demands();
  uint64_t target_of(uint32_t session, uint32_t layer) const;
  uint32_t depth_bucket(uint32_t session, uint64_t target) const;
  void cancel_load(uint32_t load);
  // Returns false when `key` was already hinted at this bucket for this target.
  bool mark_hinted(uint32_t session, ExpertKey key, uint64_t target, uint32_t bucket);
  // The estimator: hints and matched acquires per (session, target token mod kTokenRing, bucket)
  // until that token is passed, then folded into the decayed per-bucket sums.
  void count_estimate_hint(uint32_t session, uint32_t token, uint32_t bucket);
  void count_estimate_hit(uint32_t session, uint32_t token, uint32_t bucket);
  void fold_passed_tokens(uint32_t session);
  void fold(uint32_t session, uint32_t ring);
  void choose_auto_depth();
  // The probability a prefetch read at this depth pays: the hint must be right and the read must
  // survive until its acquire (the staging ring or the policy may push it out first), so the
  // lower of the hint precision and the measured read precision.
  double hint_probability(uint32_t bucket) const;
  uint32_t depth_of(uint32_t session, uint64_t target) const;
  void count_recall(uint32_t session, ExpertKey key);
  void count_outcome(uint32_t session, uint32_t bucket, uint64_t bytes, bool useful);
  void evicted(uint32_t slot, ExpertKey key) override;
  size_t key_index(ExpertKey key) const {
    return static_cast<size_t>(key.layer) * map_.expert_count() + key.expert;
  }

  ReadBackend& io_;
  const SliceMap& map_;
  const SlotLayouts& layouts_;
  std::vector<uint32_t> files_;
  ExpertCache& cache_;
  ExpertCache& staging_;
  uint8_t* arena_;
  SchedulerOptions options_;
  CompletionSink& sink_;
  LoadObserver* observer_;
  SchedulerStats stats_;
  PrefetchDepths depths_ = empty_prefetch_depths();
  std::array<double, kPrefetchDepthBuckets> est_hints_{};  // decayed hints per bucket
  std::array<double, kPrefetchDepthBuckets> est_hits_{};   // decayed matched acquires
  // Decayed outcomes of prefetch reads (useful, wasted), all depths together: a load counts at
  // the depth of its first hint, and a predictor's errors differ by depth, so per depth they
  // would be a biased sample. They fade every token, so once nothing is read the estimate drifts
  // back to the hint precision and auto mode tries again.
  double read_useful_ = 0;
  double read_wasted_ = 0;
  uint32_t auto_depth_ = 0;                  // the depth auto mode chose
  static constexpr uint32_t kTokenRing = 4;  // target tokens open per session
  struct PendingEstimate {
    uint32_t token = 0;
    bool open = false;
    std::array<uint32_t, kPrefetchDepthBuckets> hints{};
    std::array<uint32_t, kPrefetchDepthBuckets> hits{};
  };
  std::vector<std::array<PendingEstimate, kTokenRing>> pending_estimates_;  // per session

  std::vector<Load> loads_;
  std::vector<uint32_t> free_loads_;
  std::vector<int32_t> slot_load_;  // slot -> load reading into it, -1
  std::vector<Waiter> waiters_;
  uint32_t free_waiter_ = kNil;
  std::vector<Chunk> chunks_;
  uint32_t free_chunk_ = kNil;
  std::vector<uint32_t> requeued_;        // chunks to resubmit first (short reads, EAGAIN)
  std::vector<uint32_t> demand_queue_;    // loads with demand and chunks left to submit (FIFO)
  std::vector<uint32_t> prefetch_queue_;  // prefetch loads with chunks left to submit
  std::vector<Hint> hints_;               // queued prefetch hints (fixed capacity)
  uint32_t hint_count_ = 0;
  struct PendingDemand {
    uint32_t session;
    uint64_t tag;
    ExpertKey key;
  };
  std::vector<PendingDemand> pending_;  // acquires waiting for any slot to free up
  std::vector<Cursor> cursors_;
  std::vector<PrefetchedSlot> prefetched_;  // per slot
  std::vector<HintMark> hinted_;            // per (block layer, expert)
  std::vector<PrefetchDepths> session_depths_;
  uint32_t ops_in_flight_ = 0;
  uint32_t prefetch_loads_active_ = 0;  // active loads nobody waits for (demand == false)
};

}  // namespace expertd
