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

}  // namespace
}  // namespace expertd::engine
