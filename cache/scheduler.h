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
//  - progress (docs/CACHE.md "Reservations: no acquire waits for ever"): each session reserves
//    slots at attach (reserve_session: its top-k), and the reservations together never exceed
//    capacity() (the cache limit plus the staging ring, less pins). Each acquire charges its
//    session one slot until released (a hit, a joined load or a new one; holds of one slot by two
//    acquires count twice, which only errs on the safe side). A session under its reservation is
//    always admitted; above it, only while the charges above reservations fit in the slots nobody
//    reserved. So the slots held or being read for acquires never exceed capacity() minus what
//    the sessions under their reservation still may take, and an acquire within a reservation
//    finds a slot that is free, evictable or finishing a prefetch read: no cycle of waits. A
//    session at reservation + unreserved slots is refused at once (-EBUSY); an acquire that waits
//    for a slot longer than acquire_timeout_ns completes with -ETIMEDOUT (expire()).
//  - a read out longer than read_timeout_ns (a stalled device or file system) fails its load with
//    -ETIME: the acquires waiting on it complete at once, the backend is asked to cancel the read,
//    and the slot stays with the load until the read comes back (the kernel may still write it).
//    Meanwhile an acquire of that expert gets -ETIME at once rather than joining the failed load;
//    once the read is back the slot frees and the next acquire reads afresh.
//  - bytes in flight are bounded: at most `queue_depth` chunk reads, and prefetch loads only for
//    layers within `prefetch_depth` of the cursor. Demand reads go first, and while one is in
//    flight at most one prefetch read is beside it (a prefetch never takes the disk's bandwidth
//    from an expert a client waits for; the prefetches go back to full depth after).
//  - each expert's slices are read widened to the DIO alignment, in chunks of `chunk_bytes`
//    (0 = whole slice). A short read is requeued for the rest (through the buffered fd when the
//    remainder is unaligned, so it always progresses), -EAGAIN is retried at once, -EIO and an
//    early end of file are retried up to `read_retries` times with a doubling backoff (the chunk
//    waits in deferred_ and is resubmitted by a later pump(): nothing sleeps), and any other error,
//    or the last retry's, fails that expert only. Each failed load is recorded (file, offset,
//    length, errno) in a small ring the owner reads to log it; retries and failures are counted
//    per shard.
//  - a model whose file changed (set_unavailable): every acquire fails at once with that error,
//    waiting and queued ones too, loads in flight end failed and hints are dropped, so nothing
//    read from the old file is handed out again.
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
#include "cache/disk_busy.h"
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
// Auto mode's bar: it reads a depth ahead only when that depth's hints are right more often than
// the disk was busy while nothing was read ahead (DiskBusyMeter). On a saturated disk a right
// prefetch saves at most the compute it overlaps, g = compute / read time per token, while a
// wrong one costs its whole read: break-even is p = 1 / (1 + g), which is that busy fraction.
// The bar is kept within [0.5, 0.95] (below 0.5 a read is never worth it; above 0.95 no real
// predictor would ever qualify), and is 0.9 until the disk has been measured.
inline constexpr double kPrefetchAutoMinProbability = 0.5;
inline constexpr double kPrefetchAutoMaxProbability = 0.95;
inline constexpr double kPrefetchAutoUnmeasuredProbability = 0.9;
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
  // An acquire waiting for a slot completes with -ETIMEDOUT after this long (expire()).
  uint64_t acquire_timeout_ns = 10'000'000'000;
  // A read that fails with EIO (or ends before its slice) is tried again this many times, the
  // first after retry_backoff_ns, each later one after twice the previous wait.
  uint32_t read_retries = 3;
  uint64_t retry_backoff_ns = 2'000'000;
  // A read the backend has not given back after this long fails its load with -ETIME (its
  // waiting acquires at once) and is asked to cancel; 0: no deadline (expire_reads()).
  uint64_t read_timeout_ns = 30'000'000'000;
};

// One load that failed on a read: where, and why (for the owner's log).
struct LoadFailure {
  ExpertKey key;
  uint32_t shard = 0;
  uint32_t file = 0;  // the backend's file index
  uint64_t offset = 0;
  uint32_t len = 0;
  int32_t error = 0;     // -errno
  uint32_t retries = 0;  // tries after the first
};

// What a finished acquire reports. slot >= 0: READY and held for the session (release it);
// else -errno (EIO: the read failed; ECANCELED: the session went away; EBUSY: the session holds
// the most slots it may, or the wait queue is full; ETIMEDOUT: no slot within the deadline; ETIME:
// the expert's read did not come back within read_timeout_ns).
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
  // Hints that `session` will want `key` soon; score in [0, 1] from the router. `exact`: the
  // session will acquire `key` at its cursor's token before the cursor passes key.layer (a prefill
  // chunk's routing, known, not predicted): read whatever the automatic depth and at probability 1,
  // unless prefetch is off (a fixed depth of 0), and kept out of the precision estimate.
  int prefetch(uint32_t session, ExpertKey key, float score, bool exact = false);
  // Drops one hold of `session` on `slot` (taken by a completed acquire).
  int release(uint32_t session, uint32_t slot);
  // Reserves `slots` for `session` (attach): false, with nothing changed, when capacity() less
  // what the other sessions reserved cannot hold them.
  bool reserve_session(uint32_t session, uint32_t slots);
  // Slots acquires may hold at once: the cache's limit and the staging ring, less pinned slots.
  uint32_t capacity() const;
  uint32_t reserved() const { return reserved_total_; }
  // The most slots `session` may hold now: its reservation and the slots nobody reserved.
  uint32_t session_bound(uint32_t session) const;
  // Acquires waiting for a slot since before now_ns - acquire_timeout_ns complete with -ETIMEDOUT,
  // and reads out since before now_ns - read_timeout_ns fail their loads (expire_reads()).
  void expire(uint64_t now_ns);
  // The session's engine is at (token, layer): prefetches for layers it has passed are dropped.
  void set_cursor(uint32_t session, uint32_t token, uint32_t layer);
  // The session is gone: its waiting acquires are unlinked, its queued hints go and its prefetch
  // loads nobody waits for are cancelled, and its reservation is given back. (Its holds are the
  // caller's to release: the session layer tracks them; they no longer count as its charges.)
  void drop_session(uint32_t session);

  // Feeds a finished read (an IoEvent::Kind::Read from the backend).
  void on_read(ReadOp* op);
  // Starts queued work within the budgets and hands new reads to the backend.
  void pump();
  // No load in progress and nothing queued.
  bool idle() const;
  // Work is left only on reads past their deadline (their loads failed; they may never come back):
  // a shutdown need not wait for them.
  bool only_stalled_reads_left() const;
  // When the earliest deferred retry is due (monotonic ns), or 0 when none waits.
  uint64_t next_retry_ns() const;

  // The model's file changed (docs/STORAGE.md): from now on every acquire completes with
  // `-error`; waiting acquires and loads in flight end with it too. Not undone.
  void set_unavailable(int error);
  int unavailable() const { return unavailable_; }
  // Failed loads so far, and the last kFailureRing of them: failure(i) for i in
  // [max(0, failures() - kFailureRing), failures()).
  static constexpr uint32_t kFailureRing = 16;
  uint64_t failures() const { return failures_; }
  const LoadFailure& failure(uint64_t i) const { return failure_ring_[i % kFailureRing]; }
  std::span<const uint64_t> shard_loads_failed() const { return shard_failed_; }
  std::span<const uint64_t> shard_read_retries() const { return shard_retries_; }

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
  // Checks every load against these checksums (a ChecksumManifest's table, per key_index) before
  // the expert becomes READY; a mismatch fails the load with EBADMSG. Empty: no check. The table
  // must outlive the scheduler.
  void set_checksums(std::span<const uint64_t> table) { checksums_ = table; }
  bool has_checksums() const { return !checksums_.empty(); }
  // Whether `data` (a slot's bytes) holds `key`'s expert by the checksum table; true without one.
  bool checksum_matches(ExpertKey key, const uint8_t* data) const;
  // An expert copied in by a warm restart that failed its checksum (ExpertStore::adopt).
  void count_checksum_mismatch() { ++stats_.checksum_mismatches; }
  LoadObserver* observer() const { return observer_; }
  void set_queue_depth(uint32_t depth);
  const SchedulerOptions& options() const { return options_; }
  const SchedulerStats& stats() const { return stats_; }
  // The prefetch telemetry by depth: the model's, and one session's.
  const PrefetchDepths& depths() const { return depths_; }
  // The prefetch telemetry of one session (zero for a session id not in use).
  const PrefetchDepths& session_depths(uint32_t session) const { return session_depths_[session]; }
  uint32_t reads_in_flight() const { return ops_in_flight_; }
  uint32_t prefetch_reads_in_flight() const { return prefetch_ops_in_flight_; }
  // Time spent with exactly i reads in flight, for i = 0 .. the most there have been, up to
  // now_ns (the interval still open counted too): a client's window of it, the difference of two
  // calls, gives the disk's busy fraction, the mean queue depth and its peak over that window.
  std::vector<uint64_t> read_depth_ns(uint64_t now_ns) const;
  // The fraction of active time reads were in flight while nothing was read ahead (-1 before it
  // is measured), and the precision auto mode asks of a depth's hints because of it.
  double disk_busy() const { return busy_.measured() ? busy_.fraction() : -1.0; }
  double prefetch_auto_need() const;
  uint64_t slot_bytes() const { return layouts_.slot_bytes(); }
  uint8_t* slot_data(uint32_t slot) const { return arena_ + slot * layouts_.slot_bytes(); }

 private:
  // The one comparison of an expert's bytes, placed as `place` says, with its manifest checksum
  // (a finished load and a warm restart's adoption both use it).
  bool checksum_matches(ExpertKey key, const uint8_t* data, std::span<const ExpertSlice> slices,
                        std::span<const SlicePlacement> place) const;
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
    uint32_t error_shard = kNil;  // the shard whose read failed it (kNil: not a read error)
    uint32_t waiters = kNil;      // list head
    uint32_t waiters_tail = kNil;
    uint32_t slice_count = 0;
    std::array<ExpertSlice, 3> slices{};
    std::array<SlicePlacement, 3> place{};
    uint32_t next_slice = 0;  // next chunk to submit: slice index and byte offset in its read
    uint64_t next_offset = 0;
    uint32_t ops = 0;  // chunk reads in flight
    uint32_t prefetch_session = 0;
    uint32_t prefetch_bucket = 0;  // depth bucket of the hint that started it
    bool prefetch_exact = false;   // started by an exact hint (counted apart from the depths)
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
    uint32_t shard = 0;
    uint32_t retries = 0;       // EIO / early-EOF retries so far
    uint64_t retry_at_ns = 0;   // while deferred: when to resubmit
    uint64_t submitted_ns = 0;  // when the backend last took it (the read deadline's start)
    bool in_flight = false;     // with the backend now
    bool timed_out = false;     // out past read_timeout_ns (counted and cancelled once)
    bool prefetch = false;      // in flight for a load nobody waited for when it was submitted
  };
  struct Hint {
    uint32_t session = 0;
    ExpertKey key;
    float score = 0;
    uint64_t target = 0;  // (token << 32 | layer)
    uint32_t bucket = 0;  // depth bucket when the (nearest) hint arrived
    bool live = false;
    bool exact = false;  // known, not predicted (prefetch(), `exact`)
  };
  // The depths at which an expert was hinted for one target token (recall telemetry), and whether
  // the first hint for that target found it absent (neither cached nor loading): only such hints,
  // which would need a read, enter the precision estimate.
  struct HintMark {
    uint32_t token = 0;
    uint16_t session = kNoSession;
    uint8_t buckets = 0;  // bit b: hinted at depth bucket b
    bool cold = false;
  };
  // A READY slot filled by a prefetch and not yet acquired: who hinted it, how deep, its bytes.
  struct PrefetchedSlot {
    bool pending = false;
    uint16_t session = kNoSession;
    uint8_t bucket = 0;
    bool exact = false;
    uint64_t bytes = 0;
  };

  bool valid(ExpertKey key) const;
  uint32_t unreserved() const;
  bool may_charge(uint32_t session) const;
  void charge(uint32_t session);
  void uncharge(uint32_t session);
  int32_t find_slot(ExpertKey key, ExpertCache** owner);
  ExpertCache& owner_of(uint32_t slot) { return cache_.owns(slot) ? cache_ : staging_; }
  uint32_t start_load(ExpertKey key, bool to_staging, bool demand);
  bool serve(uint32_t session, ExpertKey key, uint64_t tag);
  bool add_waiter(uint32_t load, uint32_t session, uint64_t tag);
  void finish_load(uint32_t load);
  bool submit_next_chunk();
  bool submit_chunk_of(uint32_t load);
  void requeue(uint32_t chunk);
  // A chunk whose read is over (done, failed or given up): frees it, finishes its load when last.
  void chunk_done(uint32_t chunk);
  // EIO or an early end of file: defers the chunk for a retry, or fails its load. True when
  // deferred.
  bool retry_later(uint32_t chunk, int32_t error);
  // Moves deferred chunks whose time has come to requeued_ (or ends them when their load has
  // failed or was cancelled meanwhile).
  void promote_due_retries();
  // Puts the chunk's failing read in the failure ring.
  void record_failure(uint32_t chunk);
  // Fails, once, the loads of reads out past read_timeout_ns (a scan every kReadCheckNs at most).
  void expire_reads(uint64_t now_ns);
  // Completes the load's waiting acquires with `error` now and empties its waiter list.
  void fail_waiters(Load& l, int32_t error);
  // Chunk c is with the backend from now (the read deadline starts).
  void submitted(uint32_t chunk);
  void start_prefetches();
  bool hint_passed(const Hint& h) const;
  uint64_t hint_distance(const Hint& h) const;
  // Whether prefetch is on at `depth` (prefetch_depth_now()): a fixed depth of 0 is off, the
  // automatic 0 still reads exact hints.
  bool prefetch_on(uint32_t depth) const;
  // Whether start_prefetches() may read `h` at `depth`: live, prefetch on, and exact or within
  // the depth.
  bool readable_now(const Hint& h, uint32_t depth) const;
  void cancel_passed_prefetch_loads();
  void retry_pending_demands();
  // The (token, layer) a hint of `session` for `layer` is for: the cursor's token for a layer
  // after the cursor's (or the cursor's own, when `exact`), else the next token's.
  uint64_t target_of(uint32_t session, uint32_t layer, bool exact) const;
  uint32_t depth_bucket(uint32_t session, uint64_t target) const;
  void cancel_load(uint32_t load);
  // Returns false when `key` was already hinted at this bucket for this target.
  // `resident`: the expert is cached or loading (a new mark for this target is cold otherwise).
  bool mark_hinted(uint32_t session, ExpertKey key, uint64_t target, uint32_t bucket,
                   bool resident);
  // The estimator: hints and matched acquires per (session, target token mod kTokenRing, bucket)
  // until that token is passed, then folded into the decayed per-bucket sums.
  void count_estimate_hint(uint32_t session, uint32_t token, uint32_t bucket);
  void count_estimate_hit(uint32_t session, uint32_t token, uint32_t bucket);
  void fold_passed_tokens(uint32_t session);
  void fold(uint32_t session, uint32_t ring);
  void choose_auto_depth();
  void op_started();
  void op_finished();
  void count_depth(uint64_t now_ns);  // adds the time since the last change to depth_ns_
  // The probability a prefetch read at this depth pays: the hint must be right and the read must
  // survive until its acquire (the staging ring or the policy may push it out first), so the
  // lower of the hint precision and the measured read precision.
  double hint_probability(uint32_t bucket) const;
  uint32_t depth_of(uint32_t session, uint64_t target) const;
  void count_recall(uint32_t session, ExpertKey key);
  // A prefetch read's outcome, by its hint's depth; an exact hint's only in the exact counters.
  void count_outcome(uint32_t session, uint32_t bucket, bool exact, uint64_t bytes, bool useful);
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
  std::vector<uint32_t> requeued_;       // chunks to resubmit first (short reads, EAGAIN)
  std::vector<uint32_t> deferred_;       // chunks waiting out a retry backoff (EIO)
  std::vector<uint64_t> shard_failed_;   // per shard: loads failed on a read error
  std::vector<uint64_t> shard_retries_;  // per shard: EIO / early-EOF retries
  std::array<LoadFailure, kFailureRing> failure_ring_{};
  uint64_t failures_ = 0;
  int unavailable_ = 0;  // errno every acquire gets, once the model's file changed
  std::span<const uint64_t> checksums_;
  std::vector<uint32_t> demand_queue_;    // loads with demand and chunks left to submit (FIFO)
  std::vector<uint32_t> prefetch_queue_;  // prefetch loads with chunks left to submit
  std::vector<Hint> hints_;               // queued prefetch hints (fixed capacity)
  uint32_t hint_count_ = 0;
  struct PendingDemand {
    uint32_t session;
    uint64_t tag;
    ExpertKey key;
    uint64_t since_ns;  // when it started waiting (the deadline's start)
  };
  std::vector<PendingDemand> pending_;  // acquires waiting for any slot to free up
  std::vector<Cursor> cursors_;
  // Per session: slots reserved at attach, and acquires charged (held, or waiting on a load).
  // over_total_ is the sum of charges above reservations; charges of a dropped session (gone_)
  // are forgotten at once, so its holds' releases do not count again.
  std::vector<uint32_t> reservation_;
  std::vector<uint32_t> charges_;
  std::vector<uint8_t> gone_;
  uint32_t reserved_total_ = 0;
  uint32_t over_total_ = 0;
  std::vector<PrefetchedSlot> prefetched_;  // per slot
  std::vector<HintMark> hinted_;            // per (block layer, expert)
  std::vector<PrefetchDepths> session_depths_;
  uint32_t ops_in_flight_ = 0;
  // Of ops_in_flight_, reads submitted for prefetch loads (Chunk::prefetch). While a demand read
  // is in flight, at most one of these is (submit_next_chunk()): a prefetch must not take the
  // disk's bandwidth from a read a client is waiting for.
  uint32_t prefetch_ops_in_flight_ = 0;
  // read_depth_ns(): [i] the time with i reads in flight (one entry per chunk, and one for none:
  // sized at start), since the last change at depth_change_ns_; depth_peak_ the most ever.
  std::vector<uint64_t> depth_ns_;
  uint64_t depth_change_ns_ = 0;
  uint32_t depth_peak_ = 0;
  uint64_t next_read_check_ns_ = 0;     // expire_reads(): when to scan the chunks next
  DiskBusyMeter busy_;                  // fed by op_started/op_finished and acquires
  uint32_t prefetch_loads_active_ = 0;  // active loads nobody waits for (demand == false)
};

}  // namespace expertd
