#include "daemon/cache.h"

#include <gtest/gtest.h>

#include <vector>

namespace expertd {
namespace {

// A cache of `slots` over a 4-layer x 8-expert model, with its slot table.
struct Fixture {
  explicit Fixture(uint32_t slots, const char* policy = "lru")
      : table(slots + 1),
        cache(0, slots, 4, 8, make_policy(policy, {slots, 4, 8}).value(), table.data()) {}
  std::vector<abi::SlotEntry> table;
  ExpertCache cache;
};

uint32_t load(ExpertCache& c, ExpertKey k) {
  const auto s = c.reserve(k);
  EXPECT_TRUE(s.has_value());
  c.loaded(*s);
  return *s;
}

TEST(ExpertCache, StateMachineAndSlotTable) {
  Fixture f(2);
  const auto s = f.cache.reserve({1, 3});
  ASSERT_TRUE(s);
  EXPECT_EQ(f.cache.state(*s), SlotState::Loading);
  EXPECT_EQ(f.table[*s].state.load(), abi::kSlotLoading);
  EXPECT_EQ(f.cache.lookup({1, 3}), static_cast<int32_t>(*s));
  f.cache.loaded(*s);
  EXPECT_EQ(f.cache.state(*s), SlotState::Ready);
  EXPECT_EQ(f.table[*s].state.load(), abi::kSlotReady);
  EXPECT_EQ(f.table[*s].layer, 1u);
  EXPECT_EQ(f.table[*s].expert, 3u);
  EXPECT_EQ(f.table[*s].generation, 1u);
  EXPECT_EQ(f.cache.ready_count(), 1u);
}

TEST(ExpertCache, FailedLoadFreesTheSlot) {
  Fixture f(1);
  const auto s = f.cache.reserve({0, 0});
  f.cache.failed(*s);
  EXPECT_EQ(f.cache.lookup({0, 0}), -1);
  EXPECT_EQ(f.cache.free_count(), 1u);
  EXPECT_EQ(f.table[*s].state.load(), abi::kSlotFree);
}

TEST(ExpertCache, LoadingSlotsAreNeverReused) {
  Fixture f(2);
  ASSERT_TRUE(f.cache.reserve({0, 0}));
  ASSERT_TRUE(f.cache.reserve({0, 1}));
  // Both slots loading: nothing to evict.
  EXPECT_FALSE(f.cache.reserve({0, 2}));
}

TEST(ExpertCache, HeldSlotsAreNeverEvicted) {
  Fixture f(2);
  const uint32_t a = load(f.cache, {0, 0});
  const uint32_t b = load(f.cache, {0, 1});
  f.cache.hold(a);
  f.cache.hold(b);
  EXPECT_FALSE(f.cache.reserve({0, 2})) << "every slot held";
  EXPECT_FALSE(f.cache.evict({0, 0}));
  f.cache.unhold(b);
  std::optional<ExpertKey> evicted;
  const auto c = f.cache.reserve({0, 2}, &evicted);
  ASSERT_TRUE(c);
  EXPECT_EQ(*c, b);
  ASSERT_TRUE(evicted);
  EXPECT_EQ(*evicted, (ExpertKey{0, 1}));
  EXPECT_EQ(f.cache.lookup({0, 0}), static_cast<int32_t>(a));
  EXPECT_EQ(f.table[b].generation, 2u) << "a reused slot gets a new generation";
}

TEST(ExpertCache, PinsSurviveEvictionUntilUnpinned) {
  Fixture f(1);
  const uint32_t a = load(f.cache, {2, 5});
  ASSERT_TRUE(f.cache.set_pinned({2, 5}, true));
  EXPECT_FALSE(f.cache.reserve({0, 0}));
  EXPECT_FALSE(f.cache.evict({2, 5}));
  ASSERT_TRUE(f.cache.set_pinned({2, 5}, false));
  EXPECT_TRUE(f.cache.evict({2, 5}));
  EXPECT_EQ(f.cache.state(a), SlotState::Free);
  EXPECT_FALSE(f.cache.set_pinned({3, 3}, true)) << "absent experts cannot be pinned";
}

TEST(ExpertCache, LruEvictsTheLeastRecentlyAccessed) {
  Fixture f(3);
  load(f.cache, {0, 0});
  load(f.cache, {0, 1});
  load(f.cache, {0, 2});
  f.cache.access({0, 0});  // 0,0 becomes most recent: 0,1 is now the oldest
  std::optional<ExpertKey> evicted;
  ASSERT_TRUE(f.cache.reserve({1, 0}, &evicted));
  EXPECT_EQ(*evicted, (ExpertKey{0, 1}));
}

TEST(ExpertCache, SwitchingPolicyKeepsReadySlots) {
  Fixture f(2, "lru");
  load(f.cache, {0, 0});
  load(f.cache, {1, 1});
  f.cache.set_policy(make_policy("fifo", {2, 4, 8}).value());
  std::optional<ExpertKey> evicted;
  ASSERT_TRUE(f.cache.reserve({2, 2}, &evicted));
  EXPECT_TRUE(f.cache.lookup({0, 0}) >= 0 || f.cache.lookup({1, 1}) >= 0);
}

TEST(Policy, UnknownNameIsAClearError) {
  const auto p = make_policy("mru", {4, 4, 8});
  ASSERT_FALSE(p);
  EXPECT_NE(p.error().message.find("unknown cache policy 'mru'"), std::string::npos);
  EXPECT_NE(p.error().message.find("cyclic"), std::string::npos);
}

}  // namespace
}  // namespace expertd
