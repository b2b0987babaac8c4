// The VRAM tier's bookkeeping (pure host code, so CI checks it without a GPU): replacement by the
// daemon's policies (LRU order with "lru"; on layer-cyclic access smaller than a token's working
// set, the default keeps experts LRU cannot), refused admission, pins that protect the layer being
// computed, erase, and the prefetched-then-used accounting.
#include "engine/vram_tier.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <list>
#include <map>
#include <random>

namespace expertd::engine {
namespace {

std::unique_ptr<VramTier> tier(uint32_t slots, uint32_t layers, uint32_t experts,
                               std::string_view policy) {
  auto t = VramTier::create(slots, layers, experts, policy);
  if (!t) ADD_FAILURE() << t.error().message;
  return t ? std::move(*t) : nullptr;
}
std::unique_ptr<VramTier> lru(uint32_t slots, uint32_t layers, uint32_t experts) {
  return tier(slots, layers, experts, "lru");
}

TEST(VramTier, FillsEmptySlotsThenEvictsTheLeastRecentlyUsed) {
  const auto owned = lru(3, 2, 4);
  VramTier& t = *owned;
  EXPECT_EQ(t.find(0, 0), VramTier::kNone);
  const uint32_t a = t.insert(0, 0, false);
  const uint32_t b = t.insert(0, 1, false);
  const uint32_t c = t.insert(1, 2, false);
  EXPECT_NE(a, b);
  EXPECT_NE(b, c);
  EXPECT_EQ(t.size(), 3u);
  EXPECT_EQ(t.find(0, 0), a);  // (0,1) is now the least recently used
  VramTier::Entry evicted;
  const uint32_t d = t.insert(1, 3, false, false, &evicted);
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
  const auto owned = lru(2, 1, 8);
  VramTier& t = *owned;
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
  const auto owned = lru(3, 1, 8);
  VramTier& t = *owned;
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
  const auto owned = lru(2, 1, 4);
  VramTier& t = *owned;
  const uint32_t a = t.insert(0, 3, true);
  EXPECT_TRUE(t.take_prefetched(t.find(0, 3)));
  EXPECT_FALSE(t.take_prefetched(a));
}

// Against an independent LRU (std::list) on a random access stream with random pins.
TEST(VramTier, MatchesAReferenceLru) {
  const uint32_t slots = 7;
  const auto owned = lru(slots, 4, 16);
  VramTier& t = *owned;
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

// Decode's access pattern: token after token, every layer in order, top-k distinct experts per
// layer drawn from a skewed (Zipf, s = 1) per-layer distribution, as real routers are. The tier
// is driven as GpuExperts drives it: find() each routed expert, insert() the misses (a refusal is
// streamed from host memory), the layer's slots pinned until the layer is done.
struct CyclicRun {
  uint64_t accesses = 0;
  uint64_t hits = 0;
  uint64_t streamed = 0;
  double hit_rate() const { return accesses ? static_cast<double>(hits) / accesses : 0.0; }
};

// Per token and layer (token-major), the k routed experts.
std::vector<std::vector<uint32_t>> cyclic_routes(uint32_t layers, uint32_t experts, uint32_t k,
                                                 uint32_t tokens) {
  std::mt19937 rng(7);
  std::vector<std::vector<uint32_t>> order(layers);
  for (uint32_t l = 0; l < layers; ++l) {
    order[l].resize(experts);
    for (uint32_t e = 0; e < experts; ++e) order[l][e] = e;
    std::shuffle(order[l].begin(), order[l].end(), rng);
  }
  std::vector<std::vector<uint32_t>> routes;
  for (uint32_t tok = 0; tok < tokens; ++tok) {
    for (uint32_t l = 0; l < layers; ++l) {
      std::vector<double> w(experts);
      for (uint32_t r = 0; r < experts; ++r) w[r] = 1.0 / (r + 1);
      std::vector<uint32_t> chosen;
      while (chosen.size() < k) {
        std::discrete_distribution<uint32_t> pick(w.begin(), w.end());
        const uint32_t r = pick(rng);
        w[r] = 0.0;
        chosen.push_back(order[l][r]);
      }
      routes.push_back(std::move(chosen));
    }
  }
  return routes;
}

CyclicRun run_cyclic(VramTier& t, const std::vector<std::vector<uint32_t>>& routes,
                     uint32_t layers) {
  CyclicRun run;
  std::vector<uint32_t> pinned;
  for (size_t i = 0; i < routes.size(); ++i) {
    const auto l = static_cast<uint32_t>(i % layers);
    pinned.clear();
    for (const uint32_t e : routes[i]) {
      ++run.accesses;
      uint32_t slot = t.find(l, e);
      if (slot != VramTier::kNone) {
        ++run.hits;
      } else {
        slot = t.insert(l, e, false);
        if (slot == VramTier::kNone) {
          ++run.streamed;
          continue;
        }
      }
      t.pin(slot);
      pinned.push_back(slot);
    }
    for (const uint32_t s : pinned) t.unpin(s);
  }
  return run;
}

// Belady's MIN with bypass on the same accesses: what no online policy can beat.
double belady(uint32_t slots, const std::vector<std::vector<uint32_t>>& routes, uint32_t layers) {
  std::vector<ExpertKey> keys;
  for (size_t i = 0; i < routes.size(); ++i) {
    for (const uint32_t e : routes[i])
      keys.push_back(ExpertKey{static_cast<uint32_t>(i % layers), e});
  }
  return simulate_belady(slots, keys).hit_rate();
}

// The Mixtral shape (32 layers, 8 experts, top-2: 64 experts a token) with a tier of 32 slots,
// half a token's working set. LRU always evicts the expert wanted soonest and keeps nothing; the
// default policy keeps a stable set (refusing the rest, which stream) and hits.
TEST(VramTier, DefaultPolicyHitsWhereLruKeepsNothingOnLayerCyclicAccess) {
  const uint32_t layers = 32, experts = 8, k = 2, slots = 32, tokens = 400;
  const auto routes = cyclic_routes(layers, experts, k, tokens);
  const auto old = lru(slots, layers, experts);
  const auto def = tier(slots, layers, experts, VramTier::kDefaultPolicy);
  const CyclicRun a = run_cyclic(*old, routes, layers);
  const CyclicRun b = run_cyclic(*def, routes, layers);
  std::printf(
      "[ vram tier ] %u slots, %u layers x top-%u of %u, %u tokens: lru %.1f%% hits, "
      "%s %.1f%% hits (%llu streamed, %llu evictions), Belady %.1f%%\n",
      slots, layers, k, experts, tokens, 100.0 * a.hit_rate(), def->policy_name().data(),
      100.0 * b.hit_rate(), static_cast<unsigned long long>(b.streamed),
      static_cast<unsigned long long>(def->evictions()), 100.0 * belady(slots, routes, layers));
  EXPECT_EQ(a.streamed, 0u) << "LRU never refuses";
  EXPECT_GT(b.hit_rate(), 0.10);
  EXPECT_GT(b.hit_rate(), a.hit_rate() + 0.10);
  EXPECT_GT(b.streamed, 0u) << "a tier smaller than a token must refuse some experts";
}

// The Qwen3-30B-A3B shape (48 layers, 128 experts, top-8: 384 a token) with 256 slots.
TEST(VramTier, DefaultPolicyBeatsLruOnAManyExpertShape) {
  const uint32_t layers = 48, experts = 128, k = 8, slots = 256, tokens = 150;
  const auto routes = cyclic_routes(layers, experts, k, tokens);
  const auto old = lru(slots, layers, experts);
  const auto def = tier(slots, layers, experts, VramTier::kDefaultPolicy);
  const CyclicRun a = run_cyclic(*old, routes, layers);
  const CyclicRun b = run_cyclic(*def, routes, layers);
  std::printf(
      "[ vram tier ] %u slots, %u layers x top-%u of %u, %u tokens: lru %.1f%% hits, "
      "%s %.1f%% hits, Belady %.1f%%\n",
      slots, layers, k, experts, tokens, 100.0 * a.hit_rate(), def->policy_name().data(),
      100.0 * b.hit_rate(), 100.0 * belady(slots, routes, layers));
  EXPECT_GT(b.hit_rate(), a.hit_rate() + 0.05);
}

// A refused insert displaces nothing; with force it takes a victim; pinned slots stay either way.
TEST(VramTier, RefusedAdmissionDisplacesNothing) {
  const auto owned = tier(2, 4, 4, VramTier::kDefaultPolicy);
  VramTier& t = *owned;
  // (0, 0) and (0, 1) used every token; (3, 3) once.
  for (int tok = 0; tok < 20; ++tok) {
    for (const uint32_t e : {0u, 1u}) {
      if (t.find(0, e) == VramTier::kNone) {
        ASSERT_NE(t.insert(0, e, false), VramTier::kNone);
      }
    }
    for (uint32_t l = 1; l < 4; ++l) (void)t.find(l, 0);
  }
  EXPECT_EQ(t.find(3, 3), VramTier::kNone);
  EXPECT_EQ(t.insert(3, 3, false), VramTier::kNone) << "a one-off is not worth a hot slot";
  EXPECT_EQ(t.refusals(), 1u);
  EXPECT_TRUE(t.contains(0, 0));
  EXPECT_TRUE(t.contains(0, 1));
  EXPECT_EQ(t.evictions(), 0u);
  t.pin(t.find(0, 0));
  VramTier::Entry evicted;
  const uint32_t s = t.insert(3, 3, false, true, &evicted);
  ASSERT_NE(s, VramTier::kNone) << "force admits while a slot is unpinned";
  EXPECT_EQ(evicted.layer, 0u);
  EXPECT_EQ(evicted.expert, 1u) << "the pinned slot is not the victim";
  t.pin(s);
  EXPECT_EQ(t.insert(2, 2, false, true), VramTier::kNone) << "every slot pinned";
}

// A prefill chunk's sweep: the residents of layers it has not reached are not victims until it
// reaches them, whatever the policy thinks of them; without the sweep the same misses evict them.
TEST(VramTier, ASweepKeepsTheLayersItHasNotReached) {
  for (const bool sweep : {false, true}) {
    SCOPED_TRACE(sweep ? "sweeping" : "not sweeping");
    const auto owned = tier(4, 4, 4, VramTier::kDefaultPolicy);
    VramTier& t = *owned;
    // Preloaded: the last two layers' first two experts, never used yet (worth nothing to the
    // policy, so its first victims).
    for (const uint32_t l : {2u, 3u}) {
      for (const uint32_t e : {0u, 1u}) ASSERT_NE(t.insert(l, e, false), VramTier::kNone);
    }
    if (sweep) t.begin_sweep();
    // Layer 0 of the chunk: two misses.
    t.sweep_to(0);
    for (const uint32_t e : {0u, 1u}) {
      ASSERT_EQ(t.find(0, e), VramTier::kNone);
      const uint32_t s = t.insert(0, e, false);
      EXPECT_EQ(s == VramTier::kNone, sweep) << "expert " << e;
    }
    EXPECT_EQ(t.contains(2, 0) && t.contains(2, 1) && t.contains(3, 0) && t.contains(3, 1), sweep);
    if (!sweep) continue;
    EXPECT_EQ(t.refusals(), 2u);
    EXPECT_EQ(t.evictions(), 0u);
    // A prefetch for layer 1 (not reached yet) finds nothing to evict either.
    EXPECT_EQ(t.insert(1, 3, true), VramTier::kNone);
    // Layer 2: its residents are computed (pinned); layer 3's stay held, and so do layer 2's
    // while the chunk is on it (a later group of the layer may want them).
    t.sweep_to(2);
    const uint32_t a = t.find(2, 0);
    const uint32_t b = t.find(2, 1);
    ASSERT_NE(a, VramTier::kNone);
    ASSERT_NE(b, VramTier::kNone);
    t.pin(a);
    t.pin(b);
    EXPECT_EQ(t.insert(2, 2, false), VramTier::kNone) << "layer 2's are pinned, layer 3's held";
    t.unpin(a);
    t.unpin(b);
    EXPECT_EQ(t.insert(2, 3, false), VramTier::kNone) << "layer 2's held while on it";
    // Layer 3: its two residents are routed (found and pinned, as acquire() does before it
    // inserts the misses), and the miss takes a slot of layer 2, passed now.
    t.sweep_to(3);
    t.pin(t.find(3, 0));
    t.pin(t.find(3, 1));
    VramTier::Entry evicted;
    const uint32_t s = t.insert(3, 2, false, true, &evicted);
    ASSERT_NE(s, VramTier::kNone);
    EXPECT_EQ(evicted.layer, 2u);
    EXPECT_TRUE(t.contains(3, 0) && t.contains(3, 1));
    t.end_sweep();
    EXPECT_FALSE(t.sweeping());
  }
}

// An insert during a sweep for the layer it is on, or one ahead (a prefetch), is held at once;
// a passed layer's are not; a forced insert that finds only held slots ends the sweep instead of
// failing.
TEST(VramTier, ASweepHoldsWhatItPrefetchesAndGivesWayToAForcedInsert) {
  const auto owned = tier(3, 4, 4, "lru");
  VramTier& t = *owned;
  t.begin_sweep();
  t.sweep_to(0);
  ASSERT_NE(t.insert(0, 0, false), VramTier::kNone);
  ASSERT_NE(t.insert(2, 0, true), VramTier::kNone) << "a free slot";
  ASSERT_NE(t.insert(0, 1, false), VramTier::kNone) << "a free slot";
  EXPECT_EQ(t.insert(0, 2, false), VramTier::kNone) << "every resident held";
  // On layer 1: layer 0's are passed, (2, 0) still held; lru's victim is the oldest of layer 0.
  t.sweep_to(1);
  VramTier::Entry evicted;
  ASSERT_NE(t.insert(1, 0, false, false, &evicted), VramTier::kNone);
  EXPECT_EQ(evicted.layer, 0u);
  EXPECT_EQ(evicted.expert, 0u);
  EXPECT_TRUE(t.contains(2, 0));
  t.pin(t.find(0, 1));
  EXPECT_EQ(t.insert(1, 1, false), VramTier::kNone) << "one pinned, two held";
  EXPECT_TRUE(t.sweeping());
  ASSERT_NE(t.insert(1, 1, false, true, &evicted), VramTier::kNone);
  EXPECT_EQ(evicted.layer == 2 || evicted.layer == 1, true) << "a held slot gave way";
  EXPECT_FALSE(t.sweeping());
}

TEST(VramTier, UnknownPolicyIsAnError) {
  auto t = VramTier::create(4, 2, 2, "mru");
  ASSERT_FALSE(t);
  EXPECT_NE(t.error().message.find("mru"), std::string::npos) << t.error().message;
}

}  // namespace
}  // namespace expertd::engine
