// Replacement policies on the real Mixtral-8x7B routing traces in ../shared/traces and on
// generated traces of the same shape, against LRU and Belady's optimum, and Belady against a
// brute-force reference on small generated traces.
#include "policy/policy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <random>
#include <set>

#include "testing/expertd_fixture.h"
#include "trace/synth.h"
#include "trace/trace.h"

namespace expertd {
namespace {

// Brute-force MIN: on a miss with a full cache, evict the resident key whose next use is farthest,
// or bypass when the incoming key's next use is farther than all of them.
uint64_t reference_belady(uint32_t cap, const std::vector<ExpertKey>& acc) {
  auto next_use = [&](size_t from, ExpertKey k) {
    for (size_t j = from; j < acc.size(); ++j) {
      if (acc[j] == k) return j;
    }
    return acc.size() + 1;
  };
  std::vector<ExpertKey> cache;
  uint64_t hits = 0;
  for (size_t i = 0; i < acc.size(); ++i) {
    if (std::find(cache.begin(), cache.end(), acc[i]) != cache.end()) {
      ++hits;
      continue;
    }
    if (cap == 0) continue;
    if (cache.size() < cap) {
      cache.push_back(acc[i]);
      continue;
    }
    size_t far = 0;
    size_t far_use = 0;
    for (size_t c = 0; c < cache.size(); ++c) {
      const size_t u = next_use(i + 1, cache[c]);
      if (u >= far_use) {
        far_use = u;
        far = c;
      }
    }
    if (next_use(i + 1, acc[i]) < far_use) cache[far] = acc[i];
  }
  return hits;
}

TEST(Belady, MatchesBruteForceOnGeneratedTraces) {
  std::mt19937 rng(5);
  for (int round = 0; round < 20; ++round) {
    std::vector<ExpertKey> acc;
    const uint32_t layers = 1 + rng() % 6;
    for (int i = 0; i < 300; ++i)
      acc.push_back({static_cast<uint32_t>(rng() % layers), static_cast<uint32_t>(rng() % 5)});
    for (uint32_t cap : {0u, 1u, 3u, 8u}) {
      EXPECT_EQ(simulate_belady(cap, acc).hits, reference_belady(cap, acc))
          << "round " << round << " capacity " << cap;
    }
  }
}

TEST(Policy, LruHitsOnlyWhatFits) {
  // Cyclic access over 10 experts with 9 slots: LRU always evicts the next one wanted.
  std::vector<ExpertKey> acc;
  for (int r = 0; r < 20; ++r) {
    for (uint32_t l = 0; l < 10; ++l) acc.push_back({l, 0});
  }
  EXPECT_EQ(simulate_policy("lru", {9, 10, 1}, acc)->hits, 0u);
  EXPECT_EQ(simulate_policy("lru", {10, 10, 1}, acc)->hits, 190u);
  EXPECT_GT(simulate_policy("cyclic", {9, 10, 1}, acc)->hits, 150u);
}

TEST(Policy, OutOfShapeAccessIsAnError) {
  std::vector<ExpertKey> acc = {{0, 0}, {4, 0}};
  const auto r = simulate_policy("lru", {2, 4, 8}, acc);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("layer 4"), std::string::npos);
}

TEST(Policy, DefaultNamesCyclicHint) {
  const auto p = make_policy("default", {4, 4, 8});
  ASSERT_TRUE(p) << p.error().message;
  EXPECT_EQ((*p)->name(), kDefaultPolicy);
  EXPECT_EQ(kDefaultPolicy, "cyclic-hint");
  EXPECT_EQ(policy_names().front(), kDefaultPolicy);
}

// A policy driven by hand as the cache drives it: demand accesses, each filling slot `next`.
struct Driven {
  explicit Driven(PolicyShape shape) : p(make_policy("cyclic-hint", shape).value()) {}
  void access(ExpertKey k, int32_t slot = -1) {
    p->on_access(k, slot);
    if (slot >= 0) return;
    p->on_insert(next, k);
    p->on_evictable(next, true);
    slot_key.push_back(k);
    ++next;
  }
  ExpertKey victim_key(ExpertKey incoming, bool force) {
    const auto v = p->victim(incoming, force);
    EXPECT_TRUE(v.has_value());
    return v ? slot_key[*v] : ExpertKey{99, 99};
  }
  std::unique_ptr<ReplacementPolicy> p;
  std::vector<ExpertKey> slot_key;
  uint32_t next = 0;
};

// 4 slots over 4 layers of 4 experts, top-2: layers 1 and 2 each hold their two experts of the
// last token and the cursor is at layer 3, so layer 1 is next wanted 2 layers from now, layer 2
// 3 layers from now; all four were used once, in the last token.
Driven warm_four() {
  Driven d({4, 4, 4});
  for (uint32_t l = 0; l < 4; ++l) {
    for (uint32_t e : {0u, 1u}) {
      if (l == 1 || l == 2) {
        d.access({l, e});
      } else {
        d.p->on_access({l, e}, -1);  // streamed, not cached
      }
    }
  }
  return d;
}

TEST(Policy, HintDemotesTheUnhintedExpertsOfTheHintedLayer) {
  Driven d = warm_four();
  // Unhinted, the farthest layer (2) goes first.
  EXPECT_EQ(d.victim_key({3, 2}, true).layer, 2u);
  // The router says layer 1 will want experts 0 and 2 (sure): expert 1 of layer 1 is then next
  // wanted a cycle later, so it goes before layer 2's experts.
  d.p->on_hint({1, 0}, 2, 1.0);
  d.p->on_hint({1, 2}, 2, 1.0);
  EXPECT_EQ(d.victim_key({3, 2}, true), (ExpertKey{1, 1}));
  // The hints hold through layer 0's visit, until layer 1's.
  d.p->on_access({0, 0}, -1);
  d.p->on_access({0, 1}, -1);
  EXPECT_EQ(d.victim_key({0, 2}, true), (ExpertKey{1, 1}));
  d.p->on_access({1, 0}, 0);
  d.p->on_access({1, 1}, 1);
  EXPECT_EQ(d.victim_key({1, 2}, true).layer, 1u)
      << "after its visit layer 1 is the farthest again";
}

TEST(Policy, HintProtectsAHintedResident) {
  Driven d = warm_four();
  // Layer 2 is the farthest, but its expert 1 is hinted for its next visit and expert 0 is not.
  d.p->on_hint({2, 1}, 3, 1.0);
  EXPECT_EQ(d.victim_key({3, 2}, true), (ExpertKey{2, 0}));
  // A hint of low probability protects less than the estimate it replaces.
  d.p->on_hint({2, 0}, 3, 0.9);
  d.p->on_hint({2, 1}, 3, 0.05);
  EXPECT_EQ(d.victim_key({3, 2}, true), (ExpertKey{2, 1}));
}

TEST(Policy, HintedPrefetchIsAdmittedOnlyWhenWorthMoreThanTheVictim) {
  Driven d = warm_four();
  // Expert 3 of layer 0 was never used: unhinted it is worth nothing and is refused (streamed).
  EXPECT_FALSE(d.p->victim({0, 3}, false).has_value());
  // A hint of low probability for it does not buy a slot either...
  d.p->on_hint({0, 3}, 1, 0.02);
  EXPECT_FALSE(d.p->victim({0, 3}, false).has_value());
  // ...a confident one does, and the victim is the least valuable resident (layer 2, farthest).
  d.p->on_hint({0, 3}, 1, 0.9);
  const auto v = d.p->victim({0, 3}, false);
  ASSERT_TRUE(v.has_value());
  EXPECT_EQ(d.slot_key[*v].layer, 2u);
  // The same confidence far away (the next token's layer 0, 5 layers ahead) is worth less than
  // the residents wanted sooner.
  Driven far = warm_four();
  far.p->on_hint({2, 3}, 7, 0.3);
  EXPECT_FALSE(far.p->victim({2, 3}, false).has_value());
  // With force the cache still gets a slot.
  EXPECT_TRUE(far.p->victim({2, 3}, true).has_value());
}

// Hits of each policy at one cache size.
struct Row {
  uint32_t slots = 0;
  uint64_t lru = 0, cyclic = 0, hint = 0, hint_oracle8 = 0, belady = 0;
};

// The claims on a Mixtral-shaped trace (32 layers, 8 experts, top-2), at cache sizes of half a
// token's accesses to three tokens' worth: Belady bounds every policy, hinted or not; below one
// token (64 accesses) LRU gets nothing while cyclic keeps a useful part; from two tokens on cyclic
// beats LRU; over the sizes together cyclic beats LRU by 0.1 (the sum of the hit rates); the
// default (cyclic-hint) beats cyclic at every size, and exact hints 8 layers ahead add to it.
std::vector<Row> check_policy_claims(const Trace& trace, const std::string& label) {
  const auto acc = trace.accesses();
  EXPECT_EQ(trace.layers, 32u);
  EXPECT_EQ(trace.experts, 8u);
  std::printf("%s: %zu accesses\n  slots      lru   cyclic  default  +oracle:8   belady    goal\n",
              label.c_str(), acc.size());
  std::vector<Row> rows;
  double sum_lru = 0, sum_cyclic = 0;
  for (uint32_t cap : {32u, 64u, 128u, 192u}) {
    const PolicyShape shape{cap, 32, 8};
    const auto lru = simulate_policy("lru", shape, acc);
    const auto cyc = simulate_policy("cyclic", shape, acc);
    const auto hint = simulate_policy("default", shape, acc);
    const auto oracle = simulate_policy("default", shape, acc, SimHints{.depth = 8});
    const auto opt = simulate_belady(cap, acc);
    EXPECT_TRUE(lru && cyc && hint && oracle);
    if (!lru || !cyc || !hint || !oracle) return rows;
    rows.push_back({cap, lru->hits, cyc->hits, hint->hits, oracle->hits, opt.hits});
    std::printf("  %5u  %6.1f%%  %6.1f%%  %6.1f%%  %8.1f%%  %6.1f%%  %5.1f%%\n", cap,
                100 * lru->hit_rate(), 100 * cyc->hit_rate(), 100 * hint->hit_rate(),
                100 * oracle->hit_rate(), 100 * opt.hit_rate(),
                50 * (lru->hit_rate() + opt.hit_rate()));
    EXPECT_LE(lru->hits, opt.hits);
    EXPECT_LE(cyc->hits, opt.hits);
    EXPECT_LE(oracle->hits, opt.hits);
    EXPECT_GT(hint->hits, cyc->hits) << cap << " slots";
    EXPECT_GT(oracle->hits, hint->hits) << cap << " slots";
    sum_lru += lru->hit_rate();
    sum_cyclic += cyc->hit_rate();
    if (cap == 32) {
      // Smaller than one token's 64 accesses: LRU gets nothing, cyclic keeps a useful part.
      EXPECT_LT(lru->hit_rate(), 0.01);
      EXPECT_GT(cyc->hit_rate(), 0.12);
    }
    if (cap >= 128) {
      EXPECT_GT(cyc->hits, lru->hits) << cap << " slots";
    }
  }
  EXPECT_GT(sum_cyclic, sum_lru + 0.1) << "cyclic must beat LRU over the sizes together";
  return rows;
}

// The goal of issue 13, (LRU + Belady) / 2, reached or not by `hits` of `acc.size()` accesses.
bool meets_goal(const Row& r, uint64_t hits) { return 2 * hits >= r.lru + r.belady; }

// What the default reaches over cyclic on a Mixtral-shaped trace (real or generated), and that
// the goal stays out of its reach from one token's working set up.
void check_default_gains(const std::vector<Row>& rows, size_t accesses) {
  ASSERT_EQ(rows.size(), 4u);
  for (const Row& r : rows) {
    SCOPED_TRACE(testing::Message() << r.slots << " slots");
    const double gain = static_cast<double>(r.hint - r.cyclic) / static_cast<double>(accesses);
    if (r.slots <= 64) {
      EXPECT_GT(gain, 0.02);  // 2.5-4.2 points measured
    }
    if (r.slots >= 64) {
      EXPECT_FALSE(meets_goal(r, r.hint));
    }
  }
}

class SharedTrace : public ::testing::TestWithParam<const char*> {
 protected:
  std::optional<Trace> load() {
    const auto dir = test::shared_traces_dir();
    if (!dir) return std::nullopt;
    const std::string path = *dir + "/" + GetParam();
    EXPECT_TRUE(std::filesystem::exists(path)) << path;
    auto trace = load_trace_jsonl(path);
    EXPECT_TRUE(trace) << trace.error().message;
    if (!trace) return std::nullopt;
    return std::move(*trace);
  }
};

// The table of docs/CACHE.md, hit for hit (deterministic): LRU, cyclic, the default
// (cyclic-hint) alone and with exact hints 8 layers ahead, and Belady, at 32/64/128/192 slots.
TEST_P(SharedTrace, PoliciesHitWhatDocsCacheSays) {
  const auto trace = load();
  if (!trace) GTEST_SKIP() << test::kNoSharedTraces;
  const auto rows = check_policy_claims(*trace, GetParam());
  const bool he0 = std::string(GetParam()).find("humaneval0") != std::string::npos;
  // slots, lru, cyclic, default, default + oracle:8, belady
  const std::vector<Row> want = he0 ? std::vector<Row>{{32, 0, 2159, 2565, 3027, 5463},
                                                       {64, 4646, 4521, 5028, 5510, 8246},
                                                       {128, 7764, 8421, 8584, 8806, 11251},
                                                       {192, 11300, 11479, 11511, 11556, 12684}}
                                    : std::vector<Row>{{32, 6, 748, 953, 1075, 2060},
                                                       {64, 1558, 1626, 1802, 2001, 3071},
                                                       {128, 2757, 3008, 3077, 3175, 4136},
                                                       {192, 4101, 4174, 4182, 4234, 4679}};
  ASSERT_EQ(rows.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE(testing::Message() << want[i].slots << " slots");
    EXPECT_EQ(rows[i].lru, want[i].lru);
    EXPECT_EQ(rows[i].cyclic, want[i].cyclic);
    EXPECT_EQ(rows[i].hint, want[i].hint);
    EXPECT_EQ(rows[i].hint_oracle8, want[i].hint_oracle8);
    EXPECT_EQ(rows[i].belady, want[i].belady);
  }
  check_default_gains(rows, trace->accesses().size());
}

// Why the goal is out of reach online (docs/CACHE.md): with the router's exact choices for the
// next 16 layers (half a token; decode has at most the current token's remaining layers) the
// default still misses it at 64 slots; it takes the exact routing of a whole token ahead (32
// layers), which decode cannot know (the next token is not sampled yet), and at 128 and 192 slots
// even that is not enough without prefetch.
TEST_P(SharedTrace, TheGoalNeedsAWholeTokenOfExactLookahead) {
  const auto trace = load();
  if (!trace) GTEST_SKIP() << test::kNoSharedTraces;
  const auto acc = trace->accesses();
  for (const uint32_t cap : {64u, 128u, 192u}) {
    SCOPED_TRACE(testing::Message() << cap << " slots");
    const PolicyShape shape{cap, 32, 8};
    const Row r{
        cap, simulate_policy("lru", shape, acc)->hits, 0, 0, 0, simulate_belady(cap, acc).hits};
    const auto half = simulate_policy("default", shape, acc, SimHints{.depth = 16});
    const auto whole = simulate_policy("default", shape, acc, SimHints{.depth = 32});
    ASSERT_TRUE(half && whole);
    EXPECT_FALSE(meets_goal(r, half->hits));
    EXPECT_EQ(meets_goal(r, whole->hits), cap == 64);
    EXPECT_LE(whole->hits, r.belady);
  }
}

INSTANTIATE_TEST_SUITE_P(Mixtral, SharedTrace,
                         ::testing::Values("mixtral-8x7b-humaneval0.trace.jsonl",
                                           "mixtral-8x7b-humaneval1.trace.jsonl"));

// The twin on generated Mixtral-shaped traces (trace/synth.h, calibrated to the shared ones'
// reuse and popularity), of the shared traces' lengths, five seeds each. The shared traces' own
// thresholds hold with the same room: measured on seeds 1..5 (218 and 83 tokens), cyclic hits
// 15.1-16.1% at 32 slots (humaneval0 15.9%, humaneval1 14.5%) while LRU hits none; the default
// (cyclic-hint) beats cyclic by 2.5-4.2 points at 32 and 64 slots (3.0-4.0 on the shared traces)
// and by 0.1-1.7 at 128 and 192 (0.2-1.4); exact hints 8 layers ahead add up to 4 points; the
// goal (LRU + Belady) / 2 is missed from 64 slots up by 4-11 points (3.6-10.5).
class GeneratedTrace : public ::testing::TestWithParam<uint32_t> {};

TEST_P(GeneratedTrace, DefaultBeatsCyclicAndBeladyBoundsAll) {
  for (const uint64_t seed : {1u, 2u, 3u, 4u, 5u}) {
    SCOPED_TRACE(seed);
    const Trace t = synthesize_trace(SynthParams::mixtral(GetParam()), seed);
    const auto rows = check_policy_claims(t, "generated seed " + std::to_string(seed));
    check_default_gains(rows, t.accesses().size());
  }
}

INSTANTIATE_TEST_SUITE_P(Mixtral, GeneratedTrace, ::testing::Values(218u, 83u));

}  // namespace
}  // namespace expertd
