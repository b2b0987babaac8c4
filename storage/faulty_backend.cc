// The fault-injecting wrapper (tests only, but held to the same contract: every op comes back
// exactly once). Faults are decided at submit from splitmix64(seed, n) for the n-th accepted op,
// so the decisions do not depend on timing or on how often the queue was full.
//
// Where an op is while the wrapper owns it:
//   injected_  failed here (EIO/EAGAIN), never given to inner; returned at the next wait();
//   tracked_   given to inner with a fault to apply when it completes (short read or delay);
//   held_      completed by inner, delayed for some wait()s;
//   hung_      in the hang range: never given to inner, back only when cancelled (if at all);
//   ready_     events to hand out (out may be smaller than what is ready).
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "base/check.h"
#include "storage/reader.h"

namespace expertd {
namespace {

constexpr size_t kScratchEvents = 256;

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A stream of uniform numbers for one op: draw k of op n is splitmix64(seed, n, k).
class OpRandom {
 public:
  OpRandom(uint64_t seed, uint64_t n) : state_(splitmix64(seed ^ splitmix64(n))) {}
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  uint64_t next() { return splitmix64(state_++); }

 private:
  uint64_t state_;
};

enum class Fault : uint8_t { None, Eio, Eagain, Short, Delay, Hang };

struct Tracked {
  ReadOp* op = nullptr;
  Fault fault = Fault::None;
  double cut = 0;  // Short: where in [1, result - 1] to cut
  bool cut_aligned = false;
  uint32_t waits = 0;  // Delay: wait()s to hold the op back
};

struct Held {
  ReadOp* op = nullptr;
  uint32_t waits_left = 0;
};

class FaultyBackendImpl final : public FaultyBackend {
 public:
  FaultyBackendImpl(std::unique_ptr<ReadBackend> inner, const FaultOptions& options)
      : inner_(std::move(inner)),
        options_(options),
        name_(fmt::format("faulty({})", inner_->name())),
        shuffle_rng_(splitmix64(options.seed + 1)),
        scratch_(kScratchEvents) {
    const uint32_t qd = inner_->queue_depth();
    tracked_.reserve(qd);
    injected_.reserve(qd);
    held_.reserve(qd);
    hung_.reserve(qd);
    ready_.reserve(2 * qd + kScratchEvents);
  }

  std::string_view name() const override { return name_; }
  std::string describe() const override {
    return fmt::format(
        "{}: seed {}, eio {}, eagain {}, short {}, delay {}, reorder {}, hang {} bytes{}; over {}",
        name_, options_.seed, options_.eio_rate, options_.eagain_rate, options_.short_rate,
        options_.delay_rate, options_.reorder, options_.hang_bytes,
        options_.hang_ignores_cancel ? " (ignoring cancel)" : "", inner_->describe());
  }
  Status open_files(std::span<const std::string> paths) override {
    return inner_->open_files(paths);
  }
  const FileInfo& file(uint32_t index) const override { return inner_->file(index); }
  Status register_buffers(std::span<const iovec> buffers) override {
    return inner_->register_buffers(buffers);
  }
  bool submit(ReadOp* op) override;
  int flush() override { return inner_->flush(); }
  void cancel(ReadOp* op) override;
  Status watch(int fd, uint64_t tag) override { return inner_->watch(fd, tag); }
  Status unwatch(int fd) override { return inner_->unwatch(fd); }
  int wait(std::span<IoEvent> out, int timeout_ms) override;
  uint32_t queue_depth() const override { return inner_->queue_depth(); }
  BackendStats stats() const override {
    BackendStats s = stats_;
    s.fixed_reads = inner_->stats().fixed_reads;
    s.in_flight = owned_;
    return s;
  }
  FaultStats fault_stats() const override { return faults_; }

 private:
  Tracked decide(ReadOp* op);
  bool eio_applies(const ReadOp& op) const;
  bool hangs(const ReadOp& op) const;
  void apply(const IoEvent& event);
  void cut_short(ReadOp* op, const Tracked& t);
  void tick_held();
  void release_soonest();
  void shuffle_ready();
  size_t hand_out(std::span<IoEvent> out);

  std::unique_ptr<ReadBackend> inner_;
  const FaultOptions options_;
  const std::string name_;
  uint64_t decided_ = 0;  // ops accepted so far: the index of the next decision
  std::mt19937_64 shuffle_rng_;
  std::vector<Tracked> tracked_;
  std::vector<Tracked> injected_;
  std::vector<Held> held_;
  std::vector<ReadOp*> hung_;
  std::vector<IoEvent> ready_;
  std::vector<IoEvent> scratch_;
  uint32_t owned_ = 0;
  BackendStats stats_;
  FaultStats faults_;
};

bool FaultyBackendImpl::eio_applies(const ReadOp& op) const {
  if (options_.eio_bytes == 0) return true;
  return op.file == options_.eio_file && op.offset < options_.eio_offset + options_.eio_bytes &&
         options_.eio_offset < op.offset + op.len;
}

bool FaultyBackendImpl::hangs(const ReadOp& op) const {
  return options_.hang_bytes != 0 && op.file == options_.hang_file &&
         op.offset < options_.hang_offset + options_.hang_bytes &&
         options_.hang_offset < op.offset + op.len;
}

// Always draws the same numbers, whatever the outcome, so decision n depends on (seed, n) only.
Tracked FaultyBackendImpl::decide(ReadOp* op) {
  OpRandom rng(options_.seed, decided_);
  const double u_eio = rng.uniform(), u_eagain = rng.uniform(), u_short = rng.uniform();
  const double u_delay = rng.uniform(), cut = rng.uniform();
  const bool cut_aligned = (rng.next() & 1) != 0;
  const auto waits = static_cast<uint32_t>(1 + rng.next() % std::max(1u, options_.max_delay_waits));
  Tracked t{op, Fault::None, cut, cut_aligned, waits};
  if (hangs(*op)) {
    t.fault = Fault::Hang;
  } else if (u_eio < options_.eio_rate && eio_applies(*op)) {
    t.fault = Fault::Eio;
  } else if (u_eagain < options_.eagain_rate) {
    t.fault = Fault::Eagain;
  } else if (u_short < options_.short_rate) {
    t.fault = Fault::Short;
  } else if (u_delay < options_.delay_rate) {
    t.fault = Fault::Delay;
  }
  return t;
}

bool FaultyBackendImpl::submit(ReadOp* op) {
  EXPERTD_CHECK_NE(op->result, kReadPending);  // op submitted twice
  if (owned_ >= inner_->queue_depth()) return false;
  const Tracked t = decide(op);
  if (t.fault == Fault::Eio || t.fault == Fault::Eagain) {
    op->result = kReadPending;
    injected_.push_back(t);
    ++(t.fault == Fault::Eio ? faults_.eio : faults_.eagain);
  } else if (t.fault == Fault::Hang) {
    op->result = kReadPending;
    hung_.push_back(op);
    ++faults_.hung;
  } else if (!inner_->submit(op)) {
    return false;  // the decision is not consumed: decided_ is unchanged
  } else if (t.fault != Fault::None) {
    EXPERTD_CHECK_LT(tracked_.size(), tracked_.capacity());
    tracked_.push_back(t);
  }
  ++decided_;
  ++owned_;
  ++stats_.reads_submitted;
  return true;
}

void FaultyBackendImpl::cancel(ReadOp* op) {
  // Injected and held ops have their result already; they come back as they are.
  for (const Tracked& t : injected_) {
    if (t.op == op) return;
  }
  for (const Held& h : held_) {
    if (h.op == op) return;
  }
  auto hung = std::find(hung_.begin(), hung_.end(), op);
  if (hung != hung_.end()) {
    if (options_.hang_ignores_cancel) return;
    (*hung)->result = -ECANCELED;
    ready_.push_back(IoEvent{IoEvent::Kind::Read, *hung, 0});
    hung_.erase(hung);
    return;
  }
  inner_->cancel(op);
}

void FaultyBackendImpl::cut_short(ReadOp* op, const Tracked& t) {
  if (op->result <= 1) return;  // nothing to cut (an error, EOF or one byte)
  const auto full = static_cast<uint32_t>(op->result);
  auto cut = static_cast<uint32_t>(1 + t.cut * (full - 1));
  cut = std::min(cut, full - 1);
  const uint32_t align = inner_->file(op->file).dio_alignment;
  if (t.cut_aligned && cut >= align) cut -= cut % align;
  op->result = static_cast<int32_t>(cut);
  ++faults_.short_reads;
}

// An event from inner: pass it on, or apply the fault decided at submit.
void FaultyBackendImpl::apply(const IoEvent& event) {
  if (event.kind == IoEvent::Kind::Fd) {
    ready_.push_back(event);
    return;
  }
  auto it = std::find_if(tracked_.begin(), tracked_.end(),
                         [&](const Tracked& t) { return t.op == event.op; });
  if (it == tracked_.end()) {
    ready_.push_back(event);
    return;
  }
  const Tracked t = *it;
  tracked_.erase(it);
  if (t.fault == Fault::Short) {
    cut_short(event.op, t);
    ready_.push_back(event);
  } else {
    EXPERTD_CHECK_EQ(t.fault, Fault::Delay);
    held_.push_back({event.op, t.waits});
    ++faults_.delayed;
  }
}

void FaultyBackendImpl::tick_held() {
  for (size_t i = 0; i < held_.size();) {
    if (--held_[i].waits_left > 0) {
      ++i;
      continue;
    }
    ready_.push_back(IoEvent{IoEvent::Kind::Read, held_[i].op, 0});
    held_.erase(held_.begin() + static_cast<ptrdiff_t>(i));
  }
}

// Called when a wait() would return nothing: the delays end early rather than block the owner.
void FaultyBackendImpl::release_soonest() {
  uint32_t soonest = UINT32_MAX;
  for (const Held& h : held_) soonest = std::min(soonest, h.waits_left);
  for (Held& h : held_) h.waits_left = h.waits_left - soonest + 1;
  tick_held();
}

// Fisher-Yates, counting the batches whose order it changed.
void FaultyBackendImpl::shuffle_ready() {
  bool moved = false;
  for (size_t i = ready_.size(); i > 1; --i) {
    const size_t j = shuffle_rng_() % i;
    if (j == i - 1) continue;
    std::swap(ready_[i - 1], ready_[j]);
    moved = true;
  }
  if (moved) ++faults_.reordered_batches;
}

size_t FaultyBackendImpl::hand_out(std::span<IoEvent> out) {
  const size_t n = std::min(out.size(), ready_.size());
  for (size_t i = 0; i < n; ++i) {
    out[i] = ready_[i];
    if (out[i].kind != IoEvent::Kind::Read) continue;
    const ReadOp& op = *out[i].op;
    EXPERTD_CHECK_NE(op.result, kReadPending);
    EXPERTD_CHECK_GT(owned_, 0);
    --owned_;
    if (op.result >= 0) {
      stats_.bytes_read += static_cast<uint64_t>(op.result);
    } else {
      ++stats_.errors;
    }
  }
  ready_.erase(ready_.begin(), ready_.begin() + static_cast<ptrdiff_t>(n));
  return n;
}

int FaultyBackendImpl::wait(std::span<IoEvent> out, int timeout_ms) {
  EXPERTD_CHECK(!out.empty());
  tick_held();
  for (const Tracked& t : injected_) {
    t.op->result = t.fault == Fault::Eio ? -EIO : -EAGAIN;
    ready_.push_back(IoEvent{IoEvent::Kind::Read, t.op, 0});
  }
  injected_.clear();
  const bool have_work = !ready_.empty() || !held_.empty();
  const int rc = inner_->wait(scratch_, have_work ? 0 : timeout_ms);
  if (rc < 0) return rc;
  for (int i = 0; i < rc; ++i) apply(scratch_[static_cast<size_t>(i)]);
  if (ready_.empty() && !held_.empty()) release_soonest();
  if (options_.reorder) shuffle_ready();
  return static_cast<int>(hand_out(out));
}

}  // namespace

std::unique_ptr<FaultyBackend> make_faulty_backend(std::unique_ptr<ReadBackend> inner,
                                                   const FaultOptions& options) {
  EXPERTD_CHECK_NE(inner, nullptr);
  return std::make_unique<FaultyBackendImpl>(std::move(inner), options);
}

}  // namespace expertd
