// DiskBusyMeter: the fraction of active time a scheduler had reads in flight, as a running
// estimate (docs/CACHE.md "Prefetch admission and automatic depth").
//
// While nothing is read ahead, a decode alternates between reading a layer's missing experts and
// computing with them, so this fraction is read / (read + compute) = 1 / (1 + g), with g the
// compute a prefetch can hide behind per unit of read time: the precision a prefetch needs to pay
// on a disk that is the bottleneck. Automatic depth uses it as its bar.
//
// Time counts as active while reads are in flight, and between events (reads starting or ending,
// acquires) closer than kIdleGapNs: a longer quiet spell is no client at all, not compute, and
// would make the disk look idle. Samples of at least kMinSampleNs of active time fold into the
// estimate with weight kSampleWeight. Nothing here allocates; single-threaded (the reactor).
#pragma once

#include <cstdint>

namespace expertd {

class DiskBusyMeter {
 public:
  static constexpr uint64_t kIdleGapNs = 1'000'000'000;
  static constexpr uint64_t kMinSampleNs = 50'000'000;
  static constexpr double kSampleWeight = 0.25;

  // Reads in flight went from none to some (busy) or back, at now_ns.
  void set_busy(bool busy, uint64_t now_ns) {
    advance(now_ns);
    busy_ = busy;
  }
  // A client asked for something at now_ns: time since the last event was compute.
  void activity(uint64_t now_ns) { advance(now_ns); }
  // Folds the active time since the last sample into the estimate, when there is enough of it.
  void sample(uint64_t now_ns) {
    advance(now_ns);
    if (active_ns_ < kMinSampleNs) return;
    const double f = static_cast<double>(busy_ns_) / static_cast<double>(active_ns_);
    fraction_ = measured_ ? fraction_ + kSampleWeight * (f - fraction_) : f;
    measured_ = true;
    active_ns_ = 0;
    busy_ns_ = 0;
  }
  // Forgets the samples (after a reset of the estimates), keeping the current busy state.
  void reset() {
    measured_ = false;
    fraction_ = 0;
    active_ns_ = 0;
    busy_ns_ = 0;
  }
  bool measured() const { return measured_; }
  // The estimate in [0, 1]; 0 until measured().
  double fraction() const { return fraction_; }

 private:
  void advance(uint64_t now_ns) {
    if (started_ && now_ns > last_ns_) {
      const uint64_t dt = now_ns - last_ns_;
      if (busy_ || dt <= kIdleGapNs) {
        active_ns_ += dt;
        if (busy_) busy_ns_ += dt;
      }
    }
    if (!started_ || now_ns > last_ns_) last_ns_ = now_ns;
    started_ = true;
  }

  bool started_ = false;
  bool busy_ = false;
  bool measured_ = false;
  uint64_t last_ns_ = 0;
  uint64_t active_ns_ = 0;  // since the last sample
  uint64_t busy_ns_ = 0;    // of which reads were in flight
  double fraction_ = 0;
};

}  // namespace expertd
