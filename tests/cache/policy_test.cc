// Replacement policies on the real Mixtral-8x7B routing traces in ../shared/traces and on
// generated traces of the same shape, against LRU and Belady's optimum, and Belady against a
// brute-force reference on small generated traces.
#include "cache/policy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
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

// The claims on a Mixtral-shaped trace (32 layers, 8 experts, top-2), at cache sizes of half a
// token's accesses to three tokens' worth: Belady bounds both policies; below one token (64
// accesses) LRU gets nothing while cyclic keeps a useful part; from two tokens on cyclic beats LRU;
// and over the sizes together cyclic beats LRU by 0.1 (the sum of the hit rates).
void check_policy_claims(const Trace& trace, const std::string& label) {
  const auto acc = trace.accesses();
  ASSERT_EQ(trace.layers, 32u);
  ASSERT_EQ(trace.experts, 8u);
  std::printf("%s: %zu accesses\n  slots      lru   cyclic   belady\n", label.c_str(), acc.size());
  double sum_lru = 0, sum_cyclic = 0;
  for (uint32_t cap : {32u, 64u, 128u, 192u}) {
    const PolicyShape shape{cap, 32, 8};
    const auto lru = simulate_policy("lru", shape, acc);
    const auto cyc = simulate_policy("cyclic", shape, acc);
    const auto opt = simulate_belady(cap, acc);
    ASSERT_TRUE(lru && cyc);
    std::printf("  %5u  %6.1f%%  %6.1f%%  %6.1f%%\n", cap, 100 * lru->hit_rate(),
                100 * cyc->hit_rate(), 100 * opt.hit_rate());
    EXPECT_LE(lru->hits, opt.hits);
    EXPECT_LE(cyc->hits, opt.hits);
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
}

class SharedTrace : public ::testing::TestWithParam<const char*> {};

TEST_P(SharedTrace, CyclicBeatsLruAndBeladyBoundsBoth) {
  const auto dir = test::shared_traces_dir();
  if (!dir) GTEST_SKIP() << test::kNoSharedTraces;
  const std::string path = *dir + "/" + GetParam();
  ASSERT_TRUE(std::filesystem::exists(path)) << path;
  auto trace = load_trace_jsonl(path);
  ASSERT_TRUE(trace) << trace.error().message;
  check_policy_claims(*trace, GetParam());
}

INSTANTIATE_TEST_SUITE_P(Mixtral, SharedTrace,
                         ::testing::Values("mixtral-8x7b-humaneval0.trace.jsonl",
                                           "mixtral-8x7b-humaneval1.trace.jsonl"));

// The twin on generated Mixtral-shaped traces (trace/synth.h, calibrated to the shared ones'
// reuse and popularity), of the shared traces' lengths, five seeds each. The shared traces' own
// thresholds hold with the same room: measured on seeds 1, 2, 5 (218 tokens) and 1, 3 (83),
// cyclic hits 14.9-15.2% at 32 slots (humaneval0 15.6%, humaneval1 14.4%) while LRU hits none,
// cyclic beats LRU by 0.22-0.24 over the four sizes (0.21, 0.22), and by 2.3-2.9 points at 192
// slots (1.3, 1.4).
class GeneratedTrace : public ::testing::TestWithParam<uint32_t> {};

TEST_P(GeneratedTrace, CyclicBeatsLruAndBeladyBoundsBoth) {
  for (const uint64_t seed : {1u, 2u, 3u, 4u, 5u}) {
    const Trace t = synthesize_trace(SynthParams::mixtral(GetParam()), seed);
    check_policy_claims(t, "generated seed " + std::to_string(seed));
  }
}

INSTANTIATE_TEST_SUITE_P(Mixtral, GeneratedTrace, ::testing::Values(218u, 83u));

}  // namespace
}  // namespace expertd
