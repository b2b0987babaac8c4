// DiskBusyMeter: the busy fraction automatic prefetch depth takes as its bar, on scripted
// timelines (the meter takes the time as an argument, so these are exact).
#include "cache/disk_busy.h"

#include <gtest/gtest.h>

namespace expertd {
namespace {

constexpr uint64_t kMs = 1'000'000;

// A decode at depth 0: each layer reads for `read_ms`, then computes for `compute_ms` (the next
// acquire comes after the compute).
void decode(DiskBusyMeter& m, uint64_t& t, int layers, uint64_t read_ms, uint64_t compute_ms) {
  for (int l = 0; l < layers; ++l) {
    m.activity(t);
    m.set_busy(true, t);
    t += read_ms * kMs;
    m.set_busy(false, t);
    t += compute_ms * kMs;
  }
}

TEST(DiskBusyMeter, IsReadOverReadPlusComputeAtDepthZero) {
  DiskBusyMeter m;
  uint64_t t = 1000 * kMs;
  EXPECT_FALSE(m.measured());
  decode(m, t, 20, 3, 1);  // g = 1/3: break-even 1 / (1 + g) = 0.75
  m.sample(t);
  ASSERT_TRUE(m.measured());
  EXPECT_NEAR(m.fraction(), 0.75, 1e-9);
}

TEST(DiskBusyMeter, ASampleNeedsFiftyMillisecondsOfActiveTime) {
  DiskBusyMeter m;
  uint64_t t = 0;
  decode(m, t, 4, 5, 5);  // 40 ms
  m.sample(t);
  EXPECT_FALSE(m.measured()) << "40 ms is not a sample yet";
  decode(m, t, 2, 5, 5);
  m.sample(t);
  ASSERT_TRUE(m.measured());
  EXPECT_NEAR(m.fraction(), 0.5, 1e-9);
}

TEST(DiskBusyMeter, AQuietSpellLongerThanASecondIsNoClientNotCompute) {
  DiskBusyMeter m;
  uint64_t t = 0;
  decode(m, t, 10, 9, 1);
  t += 30'000 * kMs;  // nobody asked for 30 s
  decode(m, t, 10, 9, 1);
  m.sample(t);
  // The spell swallows the first run's last compute: 180 ms busy of 199 active.
  EXPECT_NEAR(m.fraction(), 180.0 / 199.0, 1e-9);
}

TEST(DiskBusyMeter, ALongReadIsBusyTimeHoweverLong) {
  DiskBusyMeter m;
  uint64_t t = 0;
  m.activity(t);
  m.set_busy(true, t);
  t += 5000 * kMs;  // a read held up for 5 s (a slow disk is the case that matters most)
  m.set_busy(false, t);
  t += 500 * kMs;
  m.activity(t);
  m.sample(t);
  EXPECT_NEAR(m.fraction(), 5000.0 / 5500.0, 1e-9);
}

TEST(DiskBusyMeter, SamplesFoldWithAQuarterWeightAndResetForgets) {
  DiskBusyMeter m;
  uint64_t t = 0;
  decode(m, t, 10, 10, 0);  // busy all the time
  m.sample(t);
  EXPECT_NEAR(m.fraction(), 1.0, 1e-9);
  decode(m, t, 10, 0, 10);  // never busy
  m.sample(t);
  EXPECT_NEAR(m.fraction(), 0.75, 1e-9);
  m.reset();
  EXPECT_FALSE(m.measured());
  decode(m, t, 10, 1, 9);
  m.sample(t);
  EXPECT_NEAR(m.fraction(), 0.1, 1e-9);
}

}  // namespace
}  // namespace expertd
