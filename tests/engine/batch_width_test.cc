// engine/batch_width.h: the rows a decode step takes follow the step's distinct experts against
// the tiers' capacity, with the figures of the H200 run that motivated it (docs/ENGINE.md
// "Sequences decoded together").
#include "engine/batch_width.h"

#include <gtest/gtest.h>

namespace expertd::engine {
namespace {

TEST(BatchWidth, NarrowsWhenAStepOutgrowsTheTiersAndWidensWhenOneMoreRowFits) {
  // Mixtral-8x7B shape, 16 GiB: 138 cache slots + 32 VRAM slots. Four random-id streams touched
  // 175 distinct experts a step: past 0.85 x 170, so the next step takes three.
  BatchWidth w(4);
  EXPECT_EQ(w.width(), 4u);
  w.observe(4, 175, 170);
  EXPECT_EQ(w.width(), 3u);
  w.observe(3, 150, 170);  // 150 > 144.5: two
  EXPECT_EQ(w.width(), 2u);
  w.observe(2, 114, 170);  // 114 fits, 171 would not: stays
  EXPECT_EQ(w.width(), 2u);
  w.observe(2, 60, 170);  // routing narrowed: 90 fits, so three
  EXPECT_EQ(w.width(), 3u);
  w.observe(3, 90, 170);  // 120 fits: back to four, never more
  EXPECT_EQ(w.width(), 4u);
  w.observe(4, 100, 170);
  EXPECT_EQ(w.width(), 4u);
  // A step narrower than the width (fewer sequences had a token) says nothing about widening.
  w.observe(4, 175, 170);
  w.observe(1, 10, 170);
  EXPECT_EQ(w.width(), 3u);
  // Never below one; no capacity known (the CPU engine): no limit.
  BatchWidth one(2);
  one.observe(2, 500, 10);
  one.observe(1, 500, 10);
  EXPECT_EQ(one.width(), 1u);
  BatchWidth unknown(8);
  unknown.observe(8, 100000, 0);
  EXPECT_EQ(unknown.width(), 8u);
  // Qwen3-30B-A3B shape, 16 GiB: 8 streams, 2,498 experts a step of ~5,300: all eight.
  BatchWidth qwen(8);
  qwen.observe(8, 2498, 5300);
  EXPECT_EQ(qwen.width(), 8u);
}

// The throughput rule against a model of rows per second by width: decoded for 600 steps with
// every sequence always waiting, the width it spends most of the last 300 steps at (two thirds of
// them at least: the probes of its neighbours take the rest).
uint32_t settled_width(uint32_t most, const std::vector<double>& rate_by_width) {
  BatchWidth w(most);
  std::vector<uint32_t> at(most + 1, 0);
  for (int step = 0; step < 600; ++step) {
    const uint32_t rows = w.width();
    // A step's time: its rows at the model's rate, with a +-10% wobble (disk noise).
    const double wobble = 1.0 + 0.1 * ((step * 7919) % 21 - 10) / 10.0;
    const double ns = 1e9 * rows / rate_by_width[rows] * wobble;
    w.observe_time(rows, static_cast<uint64_t>(ns));
    if (step >= 300) ++at[rows];
  }
  uint32_t mode = 1;
  for (uint32_t r = 1; r <= most; ++r)
    if (at[r] > at[mode]) mode = r;
  EXPECT_GE(at[mode], 200u) << "the width wandered";
  return mode;
}

TEST(BatchWidth, SettlesOnTheWidthThatDecodesFastest) {
  // The H200 Mixtral-8x7B run at 16 GiB (tokens/s of all streams at 1, 2 and 4 a step, 3 between):
  // batching loses, one row a step.
  EXPECT_EQ(settled_width(4, {0, 8.12, 4.05, 3.0, 2.43}), 1u);
  // The Qwen3-30B-A3B run (1, 2, 4, 8; the rest between): batching wins; within kMargin of all
  // eight (seven is 4% slower).
  const std::vector<double> qwen{0, 25.0, 29.1, 31.5, 33.8, 35.5, 37.2, 38.9, 40.6};
  EXPECT_GE(qwen[settled_width(8, qwen)], 40.6 / BatchWidth::kMargin);
  // A peak in the middle: three.
  EXPECT_EQ(settled_width(4, {0, 10.0, 14.0, 18.0, 12.0}), 3u);
  EXPECT_EQ(settled_width(8, {0, 10.0, 12.0, 14.0, 16.0, 20.0, 15.0, 12.0, 11.0}), 5u);
  // One sequence: nothing to choose.
  EXPECT_EQ(settled_width(1, {0, 5.0}), 1u);
}

TEST(BatchWidth, TheNarrowerRuleWins) {
  // Throughput favours four, the tiers allow two: two.
  BatchWidth w(4);
  w.observe(4, 175, 170);
  w.observe(3, 150, 170);
  EXPECT_EQ(w.width(), 2u);
  for (int i = 0; i < 100; ++i) w.observe_time(w.width(), 1000000);
  EXPECT_LE(w.width(), 2u);
  EXPECT_GT(w.rate(2), 0.0);
  // Steps narrower than the width, or of no time, decide nothing and break nothing.
  BatchWidth x(4);
  x.observe_time(0, 5);
  x.observe_time(9, 5);
  x.observe_time(2, 0);
  EXPECT_EQ(x.width(), 4u);
  EXPECT_EQ(x.rate(9), 0.0);
}

}  // namespace
}  // namespace expertd::engine
