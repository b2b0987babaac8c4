// The VRAM tier's bookkeeping (pure host code, so CI checks it without a GPU): LRU order, pins
// that protect the layer being computed, erase, and the prefetched-then-used accounting.
#include "engine/vram_tier.h"

#include <gtest/gtest.h>

#include <list>
#include <map>
#include <random>

namespace expertd::engine {
namespace {

TEST(VramTier, FillsEmptySlotsThenEvictsTheLeastRecentlyUsed) {
  VramTier t(3, 2, 4);
  EXPECT_EQ(t.find(0, 0), VramTier::kNone);
  const uint32_t a = t.insert(0, 0, false);
  const uint32_t b = t.insert(0, 1, false);
  const uint32_t c = t.insert(1, 2, false);
  EXPECT_NE(a, b);
  EXPECT_NE(b, c);
  EXPECT_EQ(t.size(), 3u);
  EXPECT_EQ(t.find(0, 0), a);  // (0,1) is now the least recently used
  VramTier::Entry evicted;
  const uint32_t d = t.insert(1, 3, false, &evicted);
  EXPECT_EQ(d, b);
  EXPECT_EQ(evicted.layer, 0u);
  EXPECT_EQ(evicted.expert, 1u);
  EXPECT_FALSE(t.contains(0, 1));
  EXPECT_TRUE(t.contains(1, 3));
  EXPECT_EQ(t.evictions(), 1u);
  EXPECT_EQ(t.insert(1, 3, false), VramTier::kNone) << "already present";
  EXPECT_EQ(t.insert(2, 0, false), VramTier::kNone) << "layer out of range";
}

TEST(VramTier, PinnedSlotsAreNeverVictims) {
  VramTier t(2, 1, 8);
  const uint32_t a = t.insert(0, 0, false);
  const uint32_t b = t.insert(0, 1, false);
  t.pin(a);
  t.pin(b);
  EXPECT_EQ(t.insert(0, 2, false), VramTier::kNone);
  t.unpin(a);
  EXPECT_EQ(t.insert(0, 2, false), a);
  t.unpin(b);
  t.unpin(b);  // extra unpins are harmless
  EXPECT_EQ(t.insert(0, 3, false), b);
}

TEST(VramTier, EraseMakesTheSlotTheNextVictim) {
  VramTier t(3, 1, 8);
  t.insert(0, 0, false);
  const uint32_t b = t.insert(0, 1, false);
  t.insert(0, 2, false);
  t.erase(b);
  EXPECT_FALSE(t.contains(0, 1));
  EXPECT_EQ(t.size(), 2u);
  EXPECT_EQ(t.insert(0, 5, false), b);
  EXPECT_EQ(t.evictions(), 0u);
}

TEST(VramTier, PrefetchedIsCountedOnceWhenUsed) {
  VramTier t(2, 1, 4);
  const uint32_t a = t.insert(0, 3, true);
  EXPECT_TRUE(t.take_prefetched(t.find(0, 3)));
  EXPECT_FALSE(t.take_prefetched(a));
}

// Against an independent LRU (std::list) on a random access stream with random pins.
TEST(VramTier, MatchesAReferenceLru) {
  const uint32_t slots = 7;
  VramTier t(slots, 4, 16);
  std::list<std::pair<uint32_t, uint32_t>> ref;  // front = most recent
  std::mt19937 rng(42);
  uint64_t hits = 0;
  for (int i = 0; i < 20000; ++i) {
    const uint32_t layer = rng() % 4;
    const uint32_t expert = rng() % 16;
    const auto key = std::pair{layer, expert};
    const bool hit_ref = std::find(ref.begin(), ref.end(), key) != ref.end();
    const uint32_t slot = t.find(layer, expert);
    ASSERT_EQ(slot != VramTier::kNone, hit_ref) << i;
    if (hit_ref) {
      ++hits;
      ref.remove(key);
      ref.push_front(key);
      continue;
    }
    if (ref.size() == slots) ref.pop_back();
    ref.push_front(key);
    ASSERT_NE(t.insert(layer, expert, false), VramTier::kNone);
  }
  EXPECT_GT(hits, 1000u);
}

}  // namespace
}  // namespace expertd::engine
