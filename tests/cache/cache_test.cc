#include "cache/cache.h"

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

// A slot a client released as its own copy (kReleaseClientCopy: the engine keeps it in VRAM) is
// taken before the policy's victim, but only while nobody holds it, and not after an acquire
// wanted it from host memory again.
TEST(ExpertCache, ClientCopiesAreTheFirstVictims) {
  Fixture f(3);
  const uint32_t a = load(f.cache, {0, 0});
  const uint32_t b = load(f.cache, {0, 1});
  load(f.cache, {0, 2});
  f.cache.hold(b);
  f.cache.set_client_copy(b);  // marked while the engine still holds it, as the daemon does
  // LRU would take (0, 0); b is held, so it is too.
  std::optional<ExpertKey> evicted;
  ASSERT_TRUE(f.cache.reserve({1, 0}, &evicted));
  EXPECT_EQ(evicted->expert, 0u);
  EXPECT_EQ(f.cache.lookup({0, 0}), -1);
  f.cache.unhold(b);
  EXPECT_TRUE(f.cache.client_copy(b));
  f.cache.loaded(static_cast<uint32_t>(f.cache.lookup({1, 0})));
  ASSERT_TRUE(f.cache.reserve({1, 1}, &evicted));
  EXPECT_EQ(evicted->layer, 0u);
  EXPECT_EQ(evicted->expert, 1u) << "the client copy, not LRU's (0, 2)";
  f.cache.loaded(static_cast<uint32_t>(f.cache.lookup({1, 1})));
  // Acquired again: an ordinary slot, and LRU's oldest, (0, 2), goes first.
  const uint32_t c = static_cast<uint32_t>(f.cache.lookup({1, 0}));
  f.cache.set_client_copy(c);
  f.cache.hold(c);
  f.cache.unhold(c);
  EXPECT_FALSE(f.cache.client_copy(c));
  ASSERT_TRUE(f.cache.reserve({1, 2}, &evicted));
  EXPECT_EQ(evicted->layer, 0u);
  EXPECT_EQ(evicted->expert, 2u);
  EXPECT_EQ(f.cache.lookup({1, 0}), static_cast<int32_t>(c));
  EXPECT_EQ(c, a) << "(1, 0) took (0, 0)'s slot";
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

struct EvictionLog final : EvictionListener {
  void evicted(uint32_t slot, ExpertKey key) override { seen.push_back({slot, key}); }
  std::vector<std::pair<uint32_t, ExpertKey>> seen;
};

TEST(ExpertCache, ALoweredLimitEvictsDownToItAndReserveStaysUnderIt) {
  Fixture f(8);
  EvictionLog log;
  f.cache.set_eviction_listener(&log);
  std::vector<uint32_t> slots;
  for (uint32_t e = 0; e < 8; ++e) slots.push_back(load(f.cache, {0, e}));
  f.cache.hold(slots[0]);
  ASSERT_TRUE(f.cache.set_pinned({0, 1}, true));
  EXPECT_EQ(f.cache.limit(), 8u);

  // Down to 3: five of the six evictable experts go; the held and the pinned one stay.
  EXPECT_EQ(f.cache.set_limit(3), 5u);
  EXPECT_EQ(f.cache.limit(), 3u);
  EXPECT_EQ(f.cache.ready_count(), 3u);
  EXPECT_EQ(log.seen.size(), 5u);
  EXPECT_GE(f.cache.lookup({0, 0}), 0) << "held";
  EXPECT_GE(f.cache.lookup({0, 1}), 0) << "pinned";
  for (const auto& [slot, key] : log.seen) {
    EXPECT_EQ(f.cache.state(slot), SlotState::Free);
    EXPECT_EQ(f.cache.lookup(key), -1);
  }

  // Free slots exist, but a new expert still takes the place of an evictable one.
  load(f.cache, {1, 0});
  EXPECT_EQ(f.cache.ready_count(), 3u);
  EXPECT_EQ(log.seen.size(), 6u);

  // Held and pinned experts keep the cache above a limit below them; reserve() then has nothing to
  // evict and refuses, rather than exceed it.
  EXPECT_EQ(f.cache.set_limit(1), 1u);
  EXPECT_EQ(f.cache.ready_count(), 2u);
  EXPECT_FALSE(f.cache.reserve({1, 1}));
  f.cache.unhold(slots[0]);
  EXPECT_FALSE(f.cache.reserve({1, 1})) << "the pinned expert alone fills a limit of 1";
  EXPECT_EQ(f.cache.ready_count(), 1u) << "but the unheld one went, down to the limit";
  EXPECT_EQ(f.cache.set_limit(2), 0u);
  EXPECT_TRUE(f.cache.reserve({1, 1}));

  // 0 (or more than the slots) lifts the limit.
  EXPECT_EQ(f.cache.set_limit(0), 0u);
  EXPECT_EQ(f.cache.limit(), 8u);
  EXPECT_EQ(f.cache.set_limit(100), 0u);
  EXPECT_EQ(f.cache.limit(), 8u);
}

TEST(ExpertCache, EvictAllKeepsOnlyHeldPinnedAndLoadingSlots) {
  Fixture f(6, "cyclic");
  EvictionLog log;
  f.cache.set_eviction_listener(&log);
  const uint32_t held = load(f.cache, {0, 0});
  f.cache.hold(held);
  load(f.cache, {1, 1});
  ASSERT_TRUE(f.cache.set_pinned({1, 1}, true));
  load(f.cache, {2, 2});
  load(f.cache, {3, 3});
  ASSERT_TRUE(f.cache.reserve({3, 4}));  // loading
  EXPECT_EQ(f.cache.evict_all(), 2u);
  EXPECT_EQ(log.seen.size(), 2u);
  EXPECT_EQ(f.cache.ready_count(), 2u);
  EXPECT_EQ(f.cache.loading_count(), 1u);
  EXPECT_EQ(f.cache.lookup({2, 2}), -1);
  EXPECT_EQ(f.cache.lookup({3, 3}), -1);
  EXPECT_EQ(f.cache.evict_all(), 0u);
}

}  // namespace
}  // namespace expertd
