#include "cache/scheduler.h"

#include <time.h>

#include <algorithm>
#include <cerrno>
#include <cmath>

#include "base/check.h"
#include "cache/checksums.h"

namespace expertd {

namespace {
constexpr uint64_t pack_target(uint32_t token, uint32_t layer) {
  return (static_cast<uint64_t>(token) << 32) | layer;
}
// Before any evidence a depth's hints count as right this often, with the weight of this many
// hints: a fixed depth prefetches from the first token (as it did before the estimate existed),
// and a few tokens of evidence overrule it.
constexpr double kPriorProbability = 0.8;
constexpr double kPriorWeight = 4;
// Auto mode keeps a depth until its estimate falls this much below the threshold to climb to it,
// so a predictor near the threshold does not flap token by token.
constexpr double kAutoHysteresis = 0.05;
// Read outcomes keep this much of their weight per token passed (a memory of ~30 tokens), and
// weigh against the hint precision as a prior of this many reads: the first few loads of a cold
// cache decide nothing alone.
constexpr double kReadFade = 0.97;
constexpr double kReadPriorWeight = 64;
}  // namespace

Scheduler::Scheduler(ReadBackend& io, const SliceMap& map, const SlotLayouts& layouts,
                     std::span<const uint32_t> files, ExpertCache& cache, ExpertCache& staging,
                     uint8_t* arena, const SchedulerOptions& options, CompletionSink& sink,
                     LoadObserver* observer)
    : io_(io),
      map_(map),
      layouts_(layouts),
      files_(files.begin(), files.end()),
      cache_(cache),
      staging_(staging),
      arena_(arena),
      options_(options),
      sink_(sink),
      observer_(observer) {
  const uint32_t slots = cache.slot_count() + staging.slot_count();
  loads_.resize(options_.max_loads);
  free_loads_.reserve(options_.max_loads);
  for (uint32_t i = options_.max_loads; i-- > 0;) free_loads_.push_back(i);
  slot_load_.assign(slots, -1);
  prefetched_.assign(slots, PrefetchedSlot{});
  hinted_.assign(static_cast<size_t>(map.block_count()) * map.expert_count(), HintMark{});
  waiters_.resize(options_.max_waiters);
  for (uint32_t i = 0; i < options_.max_waiters; ++i) {
    waiters_[i].next = i + 1 < options_.max_waiters ? i + 1 : kNil;
  }
  free_waiter_ = options_.max_waiters ? 0 : kNil;
  // Chunks: queue_depth in flight at most, but the depth is tunable at runtime up to this bound.
  const uint32_t max_chunks = std::max<uint32_t>(options_.queue_depth, 256);
  chunks_.resize(max_chunks);
  for (uint32_t i = 0; i < max_chunks; ++i)
    chunks_[i].next_free = i + 1 < max_chunks ? i + 1 : kNil;
  free_chunk_ = 0;
  depth_ns_.assign(max_chunks + 1, 0);
  depth_change_ns_ = monotonic_ns();
  requeued_.reserve(max_chunks);
  deferred_.reserve(max_chunks);
  shard_failed_.assign(files_.size(), 0);
  shard_retries_.assign(files_.size(), 0);
  // A load enters the prefetch queue once and the demand queue at most once more (when someone
  // starts waiting for it): twice max_loads bounds both, so pushes never reallocate.
  demand_queue_.reserve(2 * options_.max_loads);
  prefetch_queue_.reserve(2 * options_.max_loads);
  hints_.resize(options_.max_prefetches);
  pending_.reserve(options_.max_waiters);
  cursors_.resize(options_.max_sessions);
  reservation_.assign(options_.max_sessions, 0);
  charges_.assign(options_.max_sessions, 0);
  gone_.assign(options_.max_sessions, 0);
  session_depths_.assign(options_.max_sessions, empty_prefetch_depths());
  pending_estimates_.resize(options_.max_sessions);
  EXPERTD_CHECK_LE(options_.max_sessions, kNoSession);
  cache_.set_eviction_listener(this);
  staging_.set_eviction_listener(this);
  choose_auto_depth();
}

void Scheduler::set_prefetch_depth(uint32_t depth) {
  options_.prefetch_depth = depth;
  choose_auto_depth();
}

uint32_t Scheduler::prefetch_depth_now() const {
  return prefetch_depth_auto() ? auto_depth_ : options_.prefetch_depth;
}

double Scheduler::precision_estimate(uint32_t bucket) const {
  return (est_hits_[bucket] + kPriorWeight * kPriorProbability) /
         (est_hints_[bucket] + kPriorWeight);
}

double Scheduler::read_precision(uint32_t bucket) const {
  const double u = read_useful_;
  const double w = read_wasted_;
  return (u + kReadPriorWeight * precision_estimate(bucket)) / (u + w + kReadPriorWeight);
}

double Scheduler::hint_probability(uint32_t bucket) const {
  return std::min(precision_estimate(bucket), read_precision(bucket));
}

void Scheduler::reset_estimates() {
  est_hints_.fill(0);
  est_hits_.fill(0);
  read_useful_ = 0;
  read_wasted_ = 0;
  for (auto& ring : pending_estimates_) ring.fill(PendingEstimate{});
  busy_.reset();
  choose_auto_depth();
}

void Scheduler::count_estimate_hint(uint32_t session, uint32_t token, uint32_t bucket) {
  const uint32_t r = token % kTokenRing;
  PendingEstimate& e = pending_estimates_[session][r];
  if (!e.open || e.token != token) {
    // Hints more than kTokenRing tokens ahead: the oldest open token is settled early.
    if (e.open) fold(session, r);
    e.open = true;
    e.token = token;
  }
  ++e.hints[bucket];
}

void Scheduler::count_estimate_hit(uint32_t session, uint32_t token, uint32_t bucket) {
  PendingEstimate& e = pending_estimates_[session][token % kTokenRing];
  if (e.open && e.token == token && e.hits[bucket] < e.hints[bucket]) ++e.hits[bucket];
}

void Scheduler::fold_passed_tokens(uint32_t session) {
  const Cursor& c = cursors_[session];
  for (uint32_t r = 0; r < kTokenRing; ++r) {
    const PendingEstimate& e = pending_estimates_[session][r];
    if (e.open && e.token < c.token) fold(session, r);
  }
}

// A token the cursor has passed: each of its hints was right (acquired at its target) or not.
// Exponential forgetting per hint, so the estimate follows a predictor whose quality drifts.
void Scheduler::fold(uint32_t session, uint32_t r) {
  PendingEstimate& e = pending_estimates_[session][r];
  for (uint32_t b = 0; b < kPrefetchDepthBuckets; ++b) {
    if (e.hints[b] == 0) continue;
    const double keep = std::pow(1.0 - 1.0 / kPrecisionWindow, static_cast<double>(e.hints[b]));
    est_hints_[b] = est_hints_[b] * keep + e.hints[b];
    est_hits_[b] = est_hits_[b] * keep + e.hits[b];
  }
  read_useful_ *= kReadFade;
  read_wasted_ *= kReadFade;
  e = PendingEstimate{};
  choose_auto_depth();
}

// The deepest depth whose hints, and every nearer depth's, are worth reading (docs/CACHE.md).
// A depth without enough evidence stops the climb: auto mode starts at 0 and earns each layer.
void Scheduler::choose_auto_depth() {
  // The disk is measured only while nothing is read ahead: reads ahead overlap compute and add
  // wrong reads, so the busy fraction they leave is not the break-even of the next depth.
  if (prefetch_depth_now() == 0) busy_.sample(monotonic_ns());
  const double bar = prefetch_auto_need();
  uint32_t d = 0;
  while (d < kPrefetchAutoMaxDepth && est_hints_[d] >= kPrecisionMinEvidence) {
    const double need = bar - (d < auto_depth_ ? kAutoHysteresis : 0.0);
    if (!(hint_probability(d) > need)) break;
    ++d;
  }
  auto_depth_ = d;
}

double Scheduler::prefetch_auto_need() const {
  if (!busy_.measured()) return kPrefetchAutoUnmeasuredProbability;
  return std::clamp(busy_.fraction(), kPrefetchAutoMinProbability, kPrefetchAutoMaxProbability);
}

void Scheduler::op_started() {
  const uint64_t now = monotonic_ns();
  count_depth(now);
  if (ops_in_flight_++ == 0) busy_.set_busy(true, now);
  depth_peak_ = std::max(depth_peak_, ops_in_flight_);
}

void Scheduler::op_finished() {
  const uint64_t now = monotonic_ns();
  count_depth(now);
  if (--ops_in_flight_ == 0) busy_.set_busy(false, now);
}

void Scheduler::count_depth(uint64_t now_ns) {
  // One op per chunk, so the depth never passes the chunks the table was sized for.
  EXPERTD_CHECK(ops_in_flight_ < depth_ns_.size());
  if (now_ns > depth_change_ns_) depth_ns_[ops_in_flight_] += now_ns - depth_change_ns_;
  depth_change_ns_ = std::max(depth_change_ns_, now_ns);
}

std::vector<uint64_t> Scheduler::read_depth_ns(uint64_t now_ns) const {
  std::vector<uint64_t> out(depth_ns_.begin(), depth_ns_.begin() + depth_peak_ + 1);
  if (now_ns > depth_change_ns_) out[ops_in_flight_] += now_ns - depth_change_ns_;
  return out;
}

void Scheduler::set_queue_depth(uint32_t depth) {
  options_.queue_depth = std::clamp<uint32_t>(depth, 1, static_cast<uint32_t>(chunks_.size()));
}

bool Scheduler::valid(ExpertKey key) const {
  return key.expert < map_.expert_count() && map_.find_layer(key.layer) != nullptr;
}

int32_t Scheduler::find_slot(ExpertKey key, ExpertCache** owner) {
  int32_t s = cache_.lookup(key);
  if (s >= 0) {
    *owner = &cache_;
    return s;
  }
  s = staging_.lookup(key);
  *owner = &staging_;
  return s;
}

bool Scheduler::add_waiter(uint32_t load, uint32_t session, uint64_t tag) {
  if (free_waiter_ == kNil) return false;
  const uint32_t w = free_waiter_;
  free_waiter_ = waiters_[w].next;
  waiters_[w] = Waiter{session, tag, kNil};
  Load& l = loads_[load];
  if (l.waiters_tail == kNil) {
    l.waiters = w;
  } else {
    waiters_[l.waiters_tail].next = w;
  }
  l.waiters_tail = w;
  if (!l.demand) {
    l.demand = true;
    --prefetch_loads_active_;
    // A prefetch someone now waits for jumps ahead of the other prefetches.
    if (l.next_slice < l.slice_count) demand_queue_.push_back(load);
  }
  return true;
}

int Scheduler::acquire(uint32_t session, ExpertKey key, uint64_t tag) {
  if (!valid(key) || session >= cursors_.size()) return -EINVAL;
  busy_.activity(monotonic_ns());
  ++stats_.acquires;
  if (unavailable_ != 0) {
    sink_.complete(Completion{session, tag, -unavailable_, 0, key});
    return 0;
  }
  count_recall(session, key);
  cache_.access(key);
  // At its bound a session could wait only for its own releases, which it cannot make while it
  // waits: refused at once.
  if (charges_[session] >= session_bound(session)) {
    ++stats_.busy;
    sink_.complete(Completion{session, tag, -EBUSY, 0, key});
    return 0;
  }
  if (serve(session, key, tag)) return 0;
  if (pending_.size() >= options_.max_waiters) {
    ++stats_.busy;
    sink_.complete(Completion{session, tag, -EBUSY, 0, key});
    return 0;
  }
  pending_.push_back(PendingDemand{session, tag, key, monotonic_ns()});
  return 0;
}

uint32_t Scheduler::capacity() const {
  const uint32_t slots = cache_.limit() + staging_.slot_count();
  const uint32_t pinned = cache_.pinned_count() + staging_.pinned_count();
  return slots > pinned ? slots - pinned : 0;
}

uint32_t Scheduler::unreserved() const {
  const uint32_t cap = capacity();
  return cap > reserved_total_ ? cap - reserved_total_ : 0;
}

uint32_t Scheduler::session_bound(uint32_t session) const {
  return reservation_[session] + unreserved();
}

bool Scheduler::reserve_session(uint32_t session, uint32_t slots) {
  if (session >= reservation_.size() || uint64_t{reserved_total_} + slots > capacity()) {
    return false;
  }
  EXPERTD_CHECK_EQ(reservation_[session], 0);  // drop_session() gave back the previous one
  EXPERTD_CHECK_EQ(charges_[session], 0);
  reservation_[session] = slots;
  reserved_total_ += slots;
  gone_[session] = 0;
  return true;
}

bool Scheduler::may_charge(uint32_t session) const {
  return charges_[session] < reservation_[session] || over_total_ < unreserved();
}

void Scheduler::charge(uint32_t session) {
  if (gone_[session] != 0) return;  // an acquire racing its session's end: released at once
  if (charges_[session] >= reservation_[session]) ++over_total_;
  ++charges_[session];
}

void Scheduler::uncharge(uint32_t session) {
  if (session >= charges_.size() || gone_[session] != 0 || charges_[session] == 0) return;
  --charges_[session];
  if (charges_[session] >= reservation_[session]) --over_total_;
}

void Scheduler::expire(uint64_t now_ns) {
  expire_reads(now_ns);
  if (pending_.empty()) return;
  // Compacted in place (no allocation); completions do not call back into the scheduler.
  size_t kept = 0;
  for (size_t i = 0; i < pending_.size(); ++i) {
    const PendingDemand p = pending_[i];
    if (now_ns - p.since_ns >= options_.acquire_timeout_ns) {
      ++stats_.acquire_timeouts;
      sink_.complete(Completion{p.session, p.tag, -ETIMEDOUT, 0, p.key});
    } else {
      pending_[kept++] = p;
    }
  }
  pending_.resize(kept);
}

// How often expire_reads() looks at the chunks: a deadline of seconds needs no finer check, and the
// reactor may loop many thousand times a second.
inline constexpr uint64_t kReadCheckNs = 100'000'000;

void Scheduler::expire_reads(uint64_t now_ns) {
  if (ops_in_flight_ == 0 || options_.read_timeout_ns == 0 || now_ns < next_read_check_ns_) return;
  next_read_check_ns_ = now_ns + kReadCheckNs;
  for (uint32_t c = 0; c < chunks_.size(); ++c) {
    Chunk& ch = chunks_[c];
    if (!ch.in_flight || ch.timed_out || now_ns - ch.submitted_ns < options_.read_timeout_ns) {
      continue;
    }
    ch.timed_out = true;
    ++stats_.reads_timed_out;
    Load& l = loads_[ch.load];
    if (!l.cancelled && l.error == 0) {
      l.error = -ETIME;
      l.error_shard = ch.shard;
      record_failure(c);
      fail_waiters(l, -ETIME);
    }
    // It still comes back exactly once (cancelled, or with its result); until then the load keeps
    // the slot, which the read may yet write.
    io_.cancel(&ch.op);
  }
}

void Scheduler::fail_waiters(Load& l, int32_t error) {
  for (uint32_t w = l.waiters; w != kNil;) {
    const Waiter wt = waiters_[w];
    uncharge(wt.session);
    sink_.complete(Completion{wt.session, wt.tag, error, 0, l.key});
    waiters_[w].next = free_waiter_;
    free_waiter_ = w;
    w = wt.next;
  }
  l.waiters = kNil;
  l.waiters_tail = kNil;
}

void Scheduler::submitted(uint32_t c) {
  Chunk& ch = chunks_[c];
  ch.submitted_ns = monotonic_ns();
  ch.in_flight = true;
  ch.timed_out = false;
  ch.prefetch = !loads_[ch.load].demand;
  if (ch.prefetch) ++prefetch_ops_in_flight_;
}

bool Scheduler::serve(uint32_t session, ExpertKey key, uint64_t tag) {
  if (!may_charge(session)) return false;  // the unreserved slots are taken: wait for a release
  ExpertCache* owner = nullptr;
  const int32_t slot = find_slot(key, &owner);
  if (slot >= 0 && owner->state(static_cast<uint32_t>(slot)) == SlotState::Ready) {
    ++stats_.hits;
    const auto s = static_cast<uint32_t>(slot);
    if (prefetched_[s].pending) {
      const PrefetchedSlot p = prefetched_[s];
      prefetched_[s] = PrefetchedSlot{};
      ++stats_.prefetch_useful;
      count_outcome(p.session, p.bucket, p.exact, p.bytes, true);
    }
    owner->hold(s);
    charge(session);
    sink_.complete(Completion{session, tag, slot, owner->generation(s), key});
    return true;
  }
  uint32_t load = kNil;
  if (slot >= 0) {
    load = static_cast<uint32_t>(slot_load_[static_cast<uint32_t>(slot)]);
    // A cancelled prefetch owns the slot until its reads return: wait for it to free.
    if (loads_[load].cancelled) return false;
    if (loads_[load].error != 0) {
      // A failed load whose reads are not all back (one past its deadline, say): joining it would
      // wait for them, for ever on a stalled device. Its error now; once its reads are back the
      // slot frees and the next acquire reads afresh.
      sink_.complete(Completion{session, tag, loads_[load].error, 0, key});
      return true;
    }
    ++stats_.coalesced;
    const Load& l = loads_[load];
    if (l.prefetched && !l.demand) {
      ++stats_.prefetch_useful;
      count_outcome(l.prefetch_session, l.prefetch_bucket, l.prefetch_exact, l.bytes_planned, true);
    }
  } else {
    load = start_load(key, false, true);
    if (load == kNil) return false;
    ++stats_.misses;
  }
  if (!add_waiter(load, session, tag)) {
    ++stats_.busy;
    sink_.complete(Completion{session, tag, -EBUSY, 0, key});
    return true;
  }
  charge(session);
  return true;
}

uint32_t Scheduler::start_load(ExpertKey key, bool to_staging, bool demand) {
  if (free_loads_.empty()) return kNil;
  std::optional<ExpertKey> evicted;
  std::optional<uint32_t> slot;
  bool staged = to_staging || cache_.slot_count() == 0;
  if (!staged) {
    slot = cache_.reserve(key, &evicted);
    if (!slot) staged = true;
  }
  if (!slot && staging_.slot_count() > 0) slot = staging_.reserve(key, &evicted);
  if (!slot && demand && cache_.slot_count() > 0) {
    // Someone waits and staging is full of held slots: admit despite the policy.
    slot = cache_.reserve(key, &evicted, true);
    staged = false;
  }
  if (!slot) return kNil;
  if (staged) ++stats_.staged_loads;
  const uint32_t id = free_loads_.back();
  free_loads_.pop_back();
  Load& l = loads_[id];
  l = Load{};
  l.key = key;
  l.slot = *slot;
  l.active = true;
  l.demand = demand;
  l.slice_count = layouts_.place(key.layer, key.expert, l.slices, l.place);
  for (uint32_t i = 0; i < l.slice_count; ++i) l.bytes_planned += l.place[i].read_bytes;
  EXPERTD_CHECK(!prefetched_[*slot].pending);  // evicted() settled it when the slot was freed
  slot_load_[*slot] = static_cast<int32_t>(id);
  (demand ? demand_queue_ : prefetch_queue_).push_back(id);
  return id;
}

bool Scheduler::submit_chunk_of(uint32_t load) {
  Load& l = loads_[load];
  if (l.next_slice >= l.slice_count || free_chunk_ == kNil) return false;
  const uint32_t c = free_chunk_;
  free_chunk_ = chunks_[c].next_free;
  const ExpertSlice& s = l.slices[l.next_slice];
  const SlicePlacement& p = l.place[l.next_slice];
  const uint64_t a = layouts_.alignment();
  const uint64_t aligned_start = s.offset / a * a;
  const uint64_t chunk = options_.chunk_bytes == 0
                             ? p.read_bytes
                             : std::max<uint64_t>(options_.chunk_bytes / a * a, a);
  const uint64_t len = std::min(chunk, p.read_bytes - l.next_offset);
  // Bytes of this chunk up to the slice's last data byte must arrive; the widened tail may not
  // exist when the slice ends at the end of the file.
  const uint64_t data_end = (s.offset - aligned_start) + s.bytes;
  const uint64_t needed = std::min(len, data_end - std::min(data_end, l.next_offset));

  Chunk& ch = chunks_[c];
  ch.load = load;
  ch.needed = static_cast<uint32_t>(needed);
  ch.shard = s.shard;
  ch.retries = 0;
  ch.op = ReadOp{};
  ch.op.file = files_[s.shard];
  ch.op.direct = true;
  ch.op.offset = aligned_start + l.next_offset;
  ch.op.len = static_cast<uint32_t>(len);
  ch.op.dst = slot_data(l.slot) + p.read_slot_offset + l.next_offset;
  ch.op.cookie = c;
  EXPERTD_CHECK_EQ(ch.op.offset % a, 0);
  EXPERTD_CHECK_EQ(ch.op.len % a, 0);
  EXPERTD_CHECK_EQ(reinterpret_cast<uintptr_t>(ch.op.dst) % a, 0);

  if (!io_.submit(&ch.op)) {
    ch.load = kNil;
    ch.next_free = free_chunk_;
    free_chunk_ = c;
    return false;
  }
  if (l.next_slice == 0 && l.next_offset == 0) l.start_ns = monotonic_ns();  // first read
  submitted(c);
  ++l.ops;
  op_started();
  ++stats_.reads;
  l.next_offset += len;
  if (l.next_offset == p.read_bytes) {
    ++l.next_slice;
    l.next_offset = 0;
  }
  return true;
}

bool Scheduler::submit_next_chunk() {
  if (ops_in_flight_ >= options_.queue_depth) return false;
  if (!requeued_.empty()) {
    const uint32_t c = requeued_.back();
    if (!io_.submit(&chunks_[c].op)) return false;
    requeued_.pop_back();
    submitted(c);
    op_started();
    ++stats_.reads;
    return true;
  }
  for (auto* queue : {&demand_queue_, &prefetch_queue_}) {
    // A demand read is in flight: one prefetch read at most beside it, so that the disk's
    // bandwidth goes to what a client waits for (the prefetches resume at full depth after).
    if (queue == &prefetch_queue_ && prefetch_ops_in_flight_ > 0 &&
        ops_in_flight_ > prefetch_ops_in_flight_) {
      return false;
    }
    while (!queue->empty()) {
      const uint32_t id = queue->front();
      Load& l = loads_[id];
      const bool stale = !l.active || l.cancelled || l.error != 0 ||
                         l.next_slice >= l.slice_count || (queue == &prefetch_queue_ && l.demand);
      if (stale) {
        queue->erase(queue->begin());  // bounded by max_loads; cheap at these sizes
        continue;
      }
      return submit_chunk_of(id);
    }
  }
  return false;
}

void Scheduler::requeue(uint32_t chunk) {
  op_finished();
  requeued_.push_back(chunk);
}

void Scheduler::on_read(ReadOp* op) {
  const auto c = static_cast<uint32_t>(op->cookie);
  EXPERTD_CHECK_LT(c, chunks_.size());
  EXPERTD_CHECK_EQ(&chunks_[c].op, op);
  Chunk& ch = chunks_[c];
  ch.in_flight = false;
  if (ch.prefetch) {
    EXPERTD_CHECK_GT(prefetch_ops_in_flight_, 0);
    --prefetch_ops_in_flight_;
    ch.prefetch = false;
  }
  Load& l = loads_[ch.load];
  const int32_t res = op->result;
  if (res > 0) {
    stats_.bytes_read += static_cast<uint64_t>(res);
    if (!l.prefetched) stats_.demand_bytes += static_cast<uint64_t>(res);
    l.bytes_done += static_cast<uint64_t>(res);
  }

  bool done = true;
  if (l.cancelled || l.error != 0) {
    // Nothing more to do for a cancelled or failed load; let the read go.
  } else if (res == -EAGAIN) {
    ++stats_.eagain_retries;
    done = false;
  } else if (res == -EIO || (res == 0 && ch.needed > 0)) {
    // A media error may be transient (a retried sector, a path failover), and a read that finds
    // the end of file early may race a writer: both are worth a few tries before the expert fails.
    op_finished();
    if (retry_later(c, res < 0 ? res : -EIO)) return;
    op_started();  // not retried: op_finished() below counts it out
  } else if (res < 0) {
    l.error = res;
    l.error_shard = ch.shard;
    record_failure(c);
  } else if (static_cast<uint32_t>(res) < ch.needed) {
    ++stats_.short_reads;
    op->offset += static_cast<uint32_t>(res);
    op->dst += res;
    op->len -= static_cast<uint32_t>(res);
    ch.needed -= static_cast<uint32_t>(res);
    const uint64_t a = layouts_.alignment();
    if (op->direct && (op->offset % a != 0 || op->len % a != 0)) {
      // O_DIRECT cannot resume mid-block: read exactly the rest through the buffered fd.
      op->direct = false;
      op->len = ch.needed;
      ++stats_.buffered_requeues;
    }
    done = false;
  }
  if (!done) {
    requeue(c);
    return;
  }
  op_finished();
  chunk_done(c);
}

void Scheduler::chunk_done(uint32_t c) {
  Chunk& ch = chunks_[c];
  const uint32_t load = ch.load;
  Load& l = loads_[load];
  --l.ops;
  ch.load = kNil;
  ch.next_free = free_chunk_;
  free_chunk_ = c;
  const bool all_submitted = l.next_slice >= l.slice_count || l.error != 0 || l.cancelled;
  if (l.ops == 0 && all_submitted) finish_load(load);
}

void Scheduler::record_failure(uint32_t c) {
  const Chunk& ch = chunks_[c];
  const Load& l = loads_[ch.load];
  failure_ring_[failures_ % kFailureRing] =
      LoadFailure{l.key, ch.shard, ch.op.file, ch.op.offset, ch.op.len, l.error, ch.retries};
  ++failures_;
}

bool Scheduler::retry_later(uint32_t c, int32_t error) {
  Chunk& ch = chunks_[c];
  Load& l = loads_[ch.load];
  if (ch.retries < options_.read_retries && unavailable_ == 0) {
    ++ch.retries;
    ++stats_.read_retries;
    ++shard_retries_[ch.shard];
    // 1, 2, 4... times the backoff: a device that recovers gets time to, one that does not
    // costs the acquire a bounded wait (2 + 4 + 8 ms by default).
    ch.retry_at_ns = monotonic_ns() + (options_.retry_backoff_ns << (ch.retries - 1));
    ch.op.result = 0;
    deferred_.push_back(c);
    return true;
  }
  l.error = error;
  l.error_shard = ch.shard;
  record_failure(c);
  return false;
}

void Scheduler::promote_due_retries() {
  if (deferred_.empty()) return;
  const uint64_t now = monotonic_ns();
  for (size_t i = 0; i < deferred_.size();) {
    const uint32_t c = deferred_[i];
    const Load& l = loads_[chunks_[c].load];
    const bool over = l.cancelled || l.error != 0;
    if (!over && chunks_[c].retry_at_ns > now) {
      ++i;
      continue;
    }
    deferred_[i] = deferred_.back();  // order among retries does not matter
    deferred_.pop_back();
    if (over) {
      chunk_done(c);
    } else {
      requeued_.push_back(c);
    }
  }
}

uint64_t Scheduler::next_retry_ns() const {
  uint64_t next = 0;
  for (const uint32_t c : deferred_) {
    if (next == 0 || chunks_[c].retry_at_ns < next) next = chunks_[c].retry_at_ns;
  }
  return next;
}

void Scheduler::set_unavailable(int error) {
  EXPERTD_CHECK_GT(error, 0);
  unavailable_ = error;
  for (const PendingDemand& p : pending_) {
    sink_.complete(Completion{p.session, p.tag, -error, 0, p.key});
  }
  pending_.clear();
  for (Hint& h : hints_) h.live = false;
  hint_count_ = 0;
  for (uint32_t id = 0; id < loads_.size(); ++id) {
    Load& l = loads_[id];
    if (!l.active || l.cancelled || l.error != 0) continue;
    l.error = -error;
    // A load with no read in flight (queued, or all its chunks deferred) ends now; one with reads
    // in flight ends when they come back.
    if (l.ops == 0) finish_load(id);
  }
  promote_due_retries();  // deferred chunks of the loads failed above end now
}

bool Scheduler::checksum_matches(ExpertKey key, const uint8_t* data) const {
  if (checksums_.empty()) return true;
  std::array<ExpertSlice, 3> slices{};
  std::array<SlicePlacement, 3> place{};
  const uint32_t n = layouts_.place(key.layer, key.expert, slices, place);
  return checksum_matches(key, data, {slices.data(), n}, {place.data(), n});
}

bool Scheduler::checksum_matches(ExpertKey key, const uint8_t* data,
                                 std::span<const ExpertSlice> slices,
                                 std::span<const SlicePlacement> place) const {
  return expert_checksum(data, slices, place) == checksums_[key_index(key)];
}

void Scheduler::finish_load(uint32_t id) {
  Load& l = loads_[id];
  ExpertCache& owner = owner_of(l.slot);
  int err = l.cancelled ? -ECANCELED : l.error;
  if (err == 0 && !checksums_.empty()) {
    if (!checksum_matches(l.key, slot_data(l.slot), {l.slices.data(), l.slice_count},
                          {l.place.data(), l.slice_count})) {
      // The bytes arrived but are not the expert's: a disk or file system that returned wrong
      // data, or a file changed in place without a new mtime.
      err = -EBADMSG;
      l.error = err;
      l.error_shard = l.slices[0].shard;
      ++stats_.checksum_mismatches;
      failure_ring_[failures_ % kFailureRing] = LoadFailure{l.key,
                                                            l.slices[0].shard,
                                                            files_[l.slices[0].shard],
                                                            l.slices[0].offset,
                                                            static_cast<uint32_t>(l.bytes_planned),
                                                            err,
                                                            0};
      ++failures_;
    }
  }
  slot_load_[l.slot] = -1;
  if (err != 0) {
    owner.failed(l.slot);
    if (!l.cancelled) ++stats_.loads_failed;
    if (!l.cancelled && l.error_shard != kNil) ++shard_failed_[l.error_shard];
    // A cancelled prefetch is never one somebody waits for (cancel_load() skips those).
    if (l.cancelled && l.prefetched) {
      count_outcome(l.prefetch_session, l.prefetch_bucket, l.prefetch_exact, l.bytes_done, false);
    }
    if (observer_ != nullptr && !l.cancelled) observer_->failed(l.key, err);
  } else {
    owner.loaded(l.slot);
    ++stats_.loads_done;
    if (l.prefetched && !l.demand) {
      prefetched_[l.slot] =
          PrefetchedSlot{true, static_cast<uint16_t>(l.prefetch_session),
                         static_cast<uint8_t>(l.prefetch_bucket), l.prefetch_exact, l.bytes_done};
    }
    if (observer_ != nullptr) {
      observer_->loaded(l.key, l.slot, slot_data(l.slot), monotonic_ns() - l.start_ns);
    }
  }
  if (err != 0) {
    fail_waiters(l, err);
  } else {
    for (uint32_t w = l.waiters; w != kNil;) {
      const Waiter wt = waiters_[w];
      owner.hold(l.slot);
      sink_.complete(Completion{wt.session, wt.tag, static_cast<int32_t>(l.slot),
                                owner.generation(l.slot), l.key});
      waiters_[w].next = free_waiter_;
      free_waiter_ = w;
      w = wt.next;
    }
  }
  if (!l.demand) --prefetch_loads_active_;
  l.active = false;
  free_loads_.push_back(id);
  retry_pending_demands();
}

int Scheduler::release(uint32_t session, uint32_t slot) {
  // Ownership of holds is checked by the session layer.
  if (slot >= slot_load_.size()) return -EINVAL;
  ExpertCache& owner = owner_of(slot);
  if (owner.state(slot) != SlotState::Ready || owner.refs(slot) == 0) return -EINVAL;
  owner.unhold(slot);
  uncharge(session);
  // A slot nobody holds can be taken, and a charge given back lets a session above its
  // reservation take one.
  if (!pending_.empty()) retry_pending_demands();
  return 0;
}

void Scheduler::retry_pending_demands() {
  // Oldest first; one that still finds no slot stays (later ones may be hits). Bounded by the
  // number pending.
  for (size_t i = 0; i < pending_.size();) {
    const PendingDemand p = pending_[i];
    if (serve(p.session, p.key, p.tag)) {
      pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      ++i;
    }
  }
}

uint64_t Scheduler::target_of(uint32_t session, uint32_t layer, bool exact) const {
  const Cursor& c = cursors_[session];
  // An exact hint for the cursor's own layer is for this token: the engine has not acquired the
  // layer's experts yet (a prefill layer's top-ups).
  if (!c.set || layer > c.layer || (exact && layer == c.layer)) return pack_target(c.token, layer);
  return pack_target(c.token + 1, layer);  // the cursor's layer or an earlier one: the next token's
}

uint32_t Scheduler::depth_of(uint32_t session, uint64_t target) const {
  const Cursor& c = cursors_[session];
  const uint64_t layers = map_.block_count();
  const uint64_t now = c.set ? static_cast<uint64_t>(c.token) * layers + c.layer : 0;
  const uint64_t then = (target >> 32) * layers + (target & 0xffffffffu);
  const uint64_t depth = then > now ? then - now : 1;  // before any cursor, layer 0 counts as 1
  return static_cast<uint32_t>(std::min<uint64_t>(depth, UINT32_MAX));
}

uint32_t Scheduler::depth_bucket(uint32_t session, uint64_t target) const {
  return std::min<uint32_t>(depth_of(session, target), kPrefetchDepthBuckets) - 1;
}

bool Scheduler::mark_hinted(uint32_t session, ExpertKey key, uint64_t target, uint32_t bucket,
                            bool resident) {
  HintMark& m = hinted_[key_index(key)];
  const auto token = static_cast<uint32_t>(target >> 32);
  const auto bit = static_cast<uint8_t>(1u << bucket);
  if (m.buckets != 0 && m.session == session && m.token == token) {
    const bool fresh = (m.buckets & bit) == 0;
    m.buckets |= bit;
    return fresh;
  }
  // A mark for an earlier token this session has not reached yet stays: a hint a whole layer
  // cycle ahead must not hide the nearer ones. Anything else (passed, or another session's) goes.
  // (The far hint then goes uncounted by the estimate: its acquire could not be matched.)
  if (m.buckets != 0 && m.session == session && m.token < token) {
    const Cursor& c = cursors_[session];
    if (pack_target(m.token, key.layer) >= pack_target(c.token, c.layer)) return false;
  }
  m = HintMark{token, static_cast<uint16_t>(session), bit, !resident};
  return true;
}

void Scheduler::count_recall(uint32_t session, ExpertKey key) {
  const Cursor& c = cursors_[session];
  const HintMark& m = hinted_[key_index(key)];
  if (!c.set || m.buckets == 0 || m.session != session || m.token != c.token) return;
  for (uint32_t b = 0; b < kPrefetchDepthBuckets; ++b) {
    if ((m.buckets >> b & 1u) == 0) continue;
    ++depths_[b].hinted_acquires;
    ++session_depths_[session][b].hinted_acquires;
    if (m.cold) count_estimate_hit(session, c.token, b);
  }
}

void Scheduler::count_outcome(uint32_t session, uint32_t bucket, bool exact, uint64_t bytes,
                              bool useful) {
  // An exact hint is not a prediction: its reads say nothing of the depths' precision.
  if (exact) {
    if (!useful) ++stats_.exact_wasted;
    return;
  }
  auto add = [&](PrefetchDepthStats& c) {
    if (useful) {
      ++c.useful;
      c.useful_bytes += bytes;
    } else {
      ++c.wasted;
      c.wasted_bytes += bytes;
    }
  };
  add(depths_[bucket]);
  if (session < session_depths_.size()) add(session_depths_[session][bucket]);
  (useful ? read_useful_ : read_wasted_) += 1;
}

void Scheduler::evicted(uint32_t slot, ExpertKey) {
  ++stats_.evictions;
  PrefetchedSlot& p = prefetched_[slot];
  if (!p.pending) return;
  count_outcome(p.session, p.bucket, p.exact, p.bytes, false);
  p = PrefetchedSlot{};
}

bool Scheduler::hint_passed(const Hint& h) const {
  const Cursor& c = cursors_[h.session];
  return c.set && h.target < pack_target(c.token, c.layer);
}

bool Scheduler::prefetch_on(uint32_t depth) const {
  // A fixed depth of 0 is prefetch off: not even a hint for the cursor's own layer (about to be
  // acquired, and a wasted read when it is wrong) is read. Automatic depth 0 still reads exact
  // hints: they are known, not predicted, so no estimate has to earn them.
  return depth > 0 || prefetch_depth_auto();
}

bool Scheduler::readable_now(const Hint& h, uint32_t depth) const {
  if (!h.live || !prefetch_on(depth)) return false;
  // A predicted hint needs a depth earned (automatic) or set: at 0, even the cursor's own layer
  // (distance 0) waits.
  return h.exact || (depth > 0 && hint_distance(h) <= depth);
}

uint64_t Scheduler::hint_distance(const Hint& h) const {
  const Cursor& c = cursors_[h.session];
  const uint64_t tt = h.target >> 32;
  const uint64_t tl = h.target & 0xffffffffu;
  const uint64_t now = static_cast<uint64_t>(c.token) * map_.block_count() + c.layer;
  const uint64_t then = tt * map_.block_count() + tl;
  return then >= now ? then - now : 0;
}

int Scheduler::prefetch(uint32_t session, ExpertKey key, float score, bool exact) {
  if (!valid(key) || session >= cursors_.size() || !(score >= 0.0f && score <= 1.0f)) {
    return -EINVAL;
  }
  if (unavailable_ != 0) return 0;
  ++stats_.prefetch_hints;
  const uint64_t target = target_of(session, key.layer, exact);
  const uint32_t bucket = depth_bucket(session, target);
  ExpertCache* owner = nullptr;
  const bool resident = find_slot(key, &owner) >= 0;  // cached or loading
  if (exact) {
    // Known, not predicted: no depth's telemetry or estimate counts it, and it is worth its read.
    ++stats_.exact_hints;
    cache_.policy().on_hint(key, depth_of(session, target), 1.0);
  } else {
    ++depths_[bucket].hints;
    ++session_depths_[session][bucket].hints;
    // The estimate counts only hints for experts absent when their target was first hinted: a
    // hint for a resident expert reads nothing, and counting those (right nearly always) made the
    // estimate clear the bar while the reads it let through were mostly wrong (docs/CACHE.md).
    if (mark_hinted(session, key, target, bucket, resident) && hinted_[key_index(key)].cold) {
      count_estimate_hint(session, static_cast<uint32_t>(target >> 32), bucket);
    }
    // Every hint, resident or not: a policy may protect a resident expert the router wants soon.
    cache_.policy().on_hint(key, depth_of(session, target), hint_probability(bucket));
  }
  if (resident) return 0;
  // Merge with a queued hint for the same expert, else take a free entry, else replace the
  // farthest queued hint if this one is nearer.
  uint32_t free_entry = kNil;
  uint32_t farthest = kNil;
  for (uint32_t i = 0; i < hints_.size(); ++i) {
    Hint& h = hints_[i];
    if (!h.live) {
      if (free_entry == kNil) free_entry = i;
      continue;
    }
    if (h.key == key) {
      h.score = std::max(h.score, score);
      h.exact = h.exact || exact;
      if (target < h.target) {
        h.target = target;
        h.session = session;
        h.bucket = bucket;
      }
      return 0;
    }
    if (farthest == kNil || h.target > hints_[farthest].target) farthest = i;
  }
  uint32_t entry = free_entry;
  if (entry == kNil) {
    if (farthest == kNil || hints_[farthest].target <= target) {
      ++stats_.prefetch_dropped;
      return 0;
    }
    ++stats_.prefetch_dropped;
    entry = farthest;
  } else {
    ++hint_count_;
  }
  hints_[entry] = Hint{session, key, score, target, bucket, true, exact};
  return 0;
}

void Scheduler::set_cursor(uint32_t session, uint32_t token, uint32_t layer) {
  if (session >= cursors_.size()) return;
  cursors_[session] = Cursor{token, layer, true};
  fold_passed_tokens(session);
  for (Hint& h : hints_) {
    if (h.live && h.session == session && hint_passed(h)) {
      h.live = false;
      --hint_count_;
      ++stats_.prefetch_dropped;
    }
  }
  cancel_passed_prefetch_loads();
}

void Scheduler::cancel_passed_prefetch_loads() {
  for (uint32_t id = 0; id < loads_.size(); ++id) {
    const Load& l = loads_[id];
    if (!l.active || l.demand || l.cancelled || !l.prefetched) continue;
    const Cursor& c = cursors_[l.prefetch_session];
    if (!c.set || l.prefetch_target >= pack_target(c.token, c.layer)) continue;
    cancel_load(id);
  }
}

void Scheduler::cancel_load(uint32_t id) {
  Load& l = loads_[id];
  EXPERTD_CHECK(l.active);
  EXPERTD_CHECK(!l.demand);
  EXPERTD_CHECK(!l.cancelled);
  EXPERTD_CHECK(l.prefetched);
  l.cancelled = true;
  ++stats_.prefetch_cancelled;
  if (l.ops == 0) {
    finish_load(id);
    return;
  }
  for (Chunk& ch : chunks_) {
    if (ch.load == id) io_.cancel(&ch.op);  // free chunks have load == kNil
  }
}

void Scheduler::start_prefetches() {
  const uint32_t depth = prefetch_depth_now();
  if (!prefetch_on(depth)) return;  // no hint is readable: skip the scan
  while (hint_count_ > 0 && !free_loads_.empty() && prefetch_loads_active_ < options_.queue_depth) {
    uint32_t best = kNil;
    for (uint32_t i = 0; i < hints_.size(); ++i) {
      const Hint& h = hints_[i];
      if (!readable_now(h, depth)) continue;
      if (best == kNil) {
        best = i;
        continue;
      }
      const Hint& b = hints_[best];
      const uint64_t dh = hint_distance(h);
      const uint64_t db = hint_distance(b);
      if (dh < db || (dh == db && h.score > b.score)) best = i;
    }
    if (best == kNil) return;
    Hint h = hints_[best];
    ExpertCache* owner = nullptr;
    if (find_slot(h.key, &owner) >= 0) {
      hints_[best].live = false;
      --hint_count_;
      continue;
    }
    // The admission rule (docs/CACHE.md "Prefetch admission and automatic depth").
    const double p = h.exact ? 1.0 : hint_probability(h.bucket);
    if (!(p > kPrefetchMinProbability)) {
      hints_[best].live = false;
      --hint_count_;
      ++stats_.prefetch_skipped;
      continue;
    }
    const auto distance = static_cast<uint32_t>(std::max<uint64_t>(hint_distance(h), 1));
    cache_.policy().on_hint(h.key, distance, p);
    const bool room =
        cache_.free_count() > 0 && cache_.slot_count() - cache_.free_count() < cache_.limit();
    const bool may_evict = (2 * p - 1) / distance > kPrefetchEvictWorth;
    const bool refused = !room && !may_evict && p >= options_.staging_probability;
    // (staging_probability: a floor below which even a free slot is left to demand reads.)
    const bool to_staging = p < options_.staging_probability || refused;
    if (to_staging && staging_.slot_count() == 0) {
      hints_[best].live = false;  // nowhere to stream it without evicting: not read
      --hint_count_;
      ++stats_.prefetch_skipped;
      if (refused) ++stats_.prefetch_refused;
      continue;
    }
    const uint32_t load = start_load(h.key, to_staging, false);
    if (load == kNil) return;  // no slot now; try again after something frees
    hints_[best].live = false;
    --hint_count_;
    Load& l = loads_[load];
    if (!cache_.owns(l.slot)) {
      ++stats_.prefetch_staged;
      // The cache was asked and its policy declined the eviction.
      if (refused || !to_staging) ++stats_.prefetch_refused;
    }
    l.prefetched = true;
    l.prefetch_session = h.session;
    l.prefetch_bucket = h.bucket;
    l.prefetch_exact = h.exact;
    l.prefetch_target = h.target;
    ++stats_.prefetch_loads;
    if (h.exact) {
      ++stats_.exact_loads;
    } else {
      ++depths_[h.bucket].loads;
      ++session_depths_[h.session][h.bucket].loads;
    }
    ++prefetch_loads_active_;
  }
}

void Scheduler::drop_session(uint32_t session) {
  // Waiting acquires: unlink them so no hold is ever taken for a dead session.
  for (Load& l : loads_) {
    if (!l.active) continue;
    uint32_t prev = kNil;
    for (uint32_t w = l.waiters; w != kNil;) {
      const uint32_t next = waiters_[w].next;
      if (waiters_[w].session == session) {
        if (prev == kNil) {
          l.waiters = next;
        } else {
          waiters_[prev].next = next;
        }
        if (l.waiters_tail == w) l.waiters_tail = prev;
        waiters_[w].next = free_waiter_;
        free_waiter_ = w;
      } else {
        prev = w;
      }
      w = next;
    }
  }
  std::erase_if(pending_, [&](const PendingDemand& p) { return p.session == session; });
  if (session < charges_.size()) {
    // Its charges go with it (the caller's releases of its holds then change nothing), and its
    // reservation returns to the others.
    if (charges_[session] > reservation_[session]) {
      over_total_ -= charges_[session] - reservation_[session];
    }
    reserved_total_ -= reservation_[session];
    charges_[session] = 0;
    reservation_[session] = 0;
    gone_[session] = 1;
  }
  for (Hint& h : hints_) {
    if (h.live && h.session == session) {
      h.live = false;
      --hint_count_;
    }
  }
  if (session >= cursors_.size()) return;
  // Its prefetches nobody waits for are wasted now; their outcome no longer counts for the session
  // (a new session may get its id).
  for (uint32_t id = 0; id < loads_.size(); ++id) {
    Load& l = loads_[id];
    if (!l.active || !l.prefetched || l.prefetch_session != session) continue;
    const bool cancel = !l.demand && !l.cancelled;
    l.prefetch_session = kNoSession;
    if (cancel) cancel_load(id);
  }
  for (PrefetchedSlot& p : prefetched_) {
    if (p.session == session) p.session = kNoSession;
  }
  for (HintMark& m : hinted_) {
    if (m.session == session) m = HintMark{};
  }
  session_depths_[session] = empty_prefetch_depths();
  // Its open tokens never finish: their hints are neither right nor wrong.
  pending_estimates_[session].fill(PendingEstimate{});
  cursors_[session] = Cursor{};
  if (!pending_.empty()) retry_pending_demands();
}

void Scheduler::pump() {
  promote_due_retries();
  if (unavailable_ == 0) start_prefetches();
  while (submit_next_chunk()) {
  }
  io_.flush();
}

bool Scheduler::only_stalled_reads_left() const {
  if (ops_in_flight_ == 0 || !requeued_.empty() || !deferred_.empty() || !pending_.empty()) {
    return false;
  }
  uint32_t stalled = 0;
  for (const Chunk& ch : chunks_) stalled += ch.in_flight && ch.timed_out ? 1 : 0;
  if (stalled != ops_in_flight_) return false;
  for (const Load& l : loads_) {
    if (l.active && l.error == 0 && !l.cancelled) return false;
  }
  return true;
}

bool Scheduler::idle() const {
  if (ops_in_flight_ != 0 || !requeued_.empty() || !deferred_.empty() ||
      free_loads_.size() != loads_.size() || !pending_.empty()) {
    return false;
  }
  // Hints beyond the prefetch depth wait for the cursor; they are not work to do now.
  const uint32_t depth = prefetch_depth_now();
  for (const Hint& h : hints_) {
    if (readable_now(h, depth)) return false;
  }
  return true;
}

}  // namespace expertd
