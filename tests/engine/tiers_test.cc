// Tiers that act as one, on the CPU side of the GPU engine's path: a VramTier (the default
// policy) driven exactly as GpuExperts drives it (find each routed expert; a miss acquired from a
// real expertd through DaemonExpertSource; admitted into the tier or used in place; the hold given
// back after the layer, as a client copy when it was copied in) over a layer-cyclic routing
// pattern. Only the device copy itself is missing. The distinct experts held across both tiers
// (VramTier::distinct_with over the daemon's slot table) must rise when the engine tells the
// daemon which experts it keeps (kReleaseClientCopy) against independent tiers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "engine/daemon_expert_source.h"
#include "engine/model.h"
#include "engine/vram_tier.h"
#include "expertd/client.h"
#include "testing/expertd_fixture.h"

namespace expertd::engine {
namespace {

using expertd::test::Daemon;
using expertd::test::TempDir;

constexpr uint32_t kLayers = 8;
constexpr uint32_t kExperts = 8;
constexpr uint32_t kTopK = 2;
constexpr uint32_t kVramSlots = 6;     // a token's working set is 16 experts
constexpr uint32_t kHostSlots = 8;     // the daemon's cache limit
constexpr uint32_t kStagingSlots = 2;  // expertd's smallest staging ring (--staging 1)
constexpr uint32_t kTokens = 120;

// Per token and layer, top-k distinct experts drawn from a per-layer Zipf distribution (s = 1)
// over a shuffled expert order, as skewed as real routers are.
std::vector<std::vector<uint32_t>> routing(uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<uint32_t>> order(kLayers);
  for (auto& o : order) {
    o.resize(kExperts);
    for (uint32_t e = 0; e < kExperts; ++e) o[e] = e;
    std::shuffle(o.begin(), o.end(), rng);
  }
  std::vector<std::vector<uint32_t>> out;
  for (uint32_t t = 0; t < kTokens; ++t) {
    for (uint32_t l = 0; l < kLayers; ++l) {
      std::vector<double> w(kExperts);
      for (uint32_t r = 0; r < kExperts; ++r) w[r] = 1.0 / (r + 1);
      std::vector<uint32_t> chosen;
      while (chosen.size() < kTopK) {
        std::discrete_distribution<uint32_t> pick(w.begin(), w.end());
        const uint32_t r = pick(rng);
        w[r] = 0.0;
        chosen.push_back(order[l][r]);
      }
      out.push_back(chosen);
    }
  }
  return out;
}

struct TierRun {
  double distinct_mean = 0.0;  // over every token after the first
  uint64_t vram_hits = 0;
  uint64_t kept = 0;  // misses copied into the tier (released as client copies when coordinated)
  uint64_t streamed = 0;
};

TierRun run_tiers(const std::string& gguf, const DenseModel& model,
                  const std::vector<std::string>& daemon_policy, bool coordinate) {
  TierRun run;
  TempDir dir;
  const std::string socket = dir.path() + "/expertd.sock";
  std::vector<std::string> args{"--model", "m=" + gguf, "--socket", socket,      "--cache",
                                "16MiB",   "--staging", "1",        "--no-mlock"};
  args.insert(args.end(), daemon_policy.begin(), daemon_policy.end());
  Daemon daemon(dir.path(), args);
  EXPECT_TRUE(daemon.start());
  {
    auto control = client::Client::connect(socket);
    EXPECT_TRUE(control) << control.error().message;
    if (!control) return run;
    EXPECT_TRUE((*control)->set_cache_limit("m", kHostSlots));
    auto source = DaemonExpertSource::connect(socket, "m", model, "tiers_test");
    EXPECT_TRUE(source) << source.error().message;
    if (!source) return run;
    auto tier = VramTier::create(kVramSlots, kLayers, kExperts);
    EXPECT_TRUE(tier);
    if (!tier) return run;
    VramTier& t = **tier;
    std::vector<uint8_t> host(kLayers * kExperts);
    uint64_t distinct_sum = 0;
    const std::vector<std::vector<uint32_t>> routes = routing(11);
    std::vector<ExpertView> held;
    std::vector<uint8_t> held_kept;
    std::vector<uint32_t> pinned;
    for (uint32_t tok = 0; tok < kTokens; ++tok) {
      for (uint32_t l = 0; l < kLayers; ++l) {
        pinned.clear();
        for (const uint32_t e : routes[tok * kLayers + l]) {
          uint32_t slot = t.find(l, e);
          if (slot != VramTier::kNone) {
            ++run.vram_hits;
            t.pin(slot);
            pinned.push_back(slot);
            continue;
          }
          ExpertView v;
          const Status got = (*source)->get(l, std::span<const uint32_t>(&e, 1), {&v, 1});
          EXPECT_TRUE(got) << got.error().message;
          if (!got) return run;
          slot = t.insert(l, e, false);
          held.push_back(v);
          held_kept.push_back(slot != VramTier::kNone);
          if (slot == VramTier::kNone) {
            ++run.streamed;
            continue;
          }
          ++run.kept;
          t.pin(slot);
          pinned.push_back(slot);
        }
        // The layer computed: its slots unpinned, its holds given back.
        for (const uint32_t s : pinned) t.unpin(s);
        for (size_t i = 0; i < held.size(); ++i) {
          const std::span<const ExpertView> one(&held[i], 1);
          const Status st =
              held_kept[i] && coordinate ? (*source)->release_kept(one) : (*source)->release(one);
          EXPECT_TRUE(st) << st.error().message;
        }
        held.clear();
        held_kept.clear();
      }
      // Evictions happen inside acquires, which completed: the slot table is settled.
      EXPECT_GT((*source)->host_resident(kExperts, host), 0u);
      if (tok > 0) distinct_sum += t.distinct_with(host);
    }
    run.distinct_mean = static_cast<double>(distinct_sum) / (kTokens - 1);
  }
  const std::string log = daemon.log();
  EXPECT_EQ(daemon.stop(), 0) << log;
  return run;
}

TEST(Tiers, TellingTheDaemonWhatVramKeepsRaisesDistinctExpertsAcrossTiers) {
  TempDir dir;
  const std::string gguf = expertd::test::forge(
      dir.path(), "m",
      "--layers 8 --experts 8 --top-k 2 --embd 256 --ff 256 --heads 4 --kv-heads 2 --head-dim 64 "
      "--vocab 300 --expert-type q8_0 --dense-type f16 --seed 5");
  auto model = DenseModel::load(gguf);
  ASSERT_TRUE(model) << model.error().message;
  ASSERT_EQ(model->params().n_expert_used, kTopK);
  // The daemon's default policy and LRU: coordination must pay under both.
  const std::vector<std::vector<std::string>> policies{{}, {"--policy", "lru"}};
  for (const auto& policy : policies) {
    const std::string name = policy.empty() ? "default" : policy[1];
    SCOPED_TRACE("daemon policy " + name);
    std::vector<TierRun> runs;
    for (const bool coordinate : {false, true}) {
      runs.push_back(run_tiers(gguf, *model, policy, coordinate));
      if (HasFatalFailure() || HasFailure()) return;
    }
    std::printf(
        "[ tiers ] daemon policy %s, VRAM %u slots (%s) + host %u cache + %u staging slots, %u "
        "layers x top-%u of %u: distinct experts across tiers, mean per token: independent "
        "%.2f, coordinated %.2f (capacity %u); VRAM hits %llu / %llu\n",
        name.c_str(), kVramSlots, std::string(VramTier::kDefaultPolicy).c_str(), kHostSlots,
        kStagingSlots, kLayers, kTopK, kExperts, runs[0].distinct_mean, runs[1].distinct_mean,
        kVramSlots + kHostSlots + kStagingSlots, static_cast<unsigned long long>(runs[0].vram_hits),
        static_cast<unsigned long long>(runs[1].vram_hits));
    EXPECT_GT(runs[0].kept, 0u);
    EXPECT_EQ(runs[0].vram_hits, runs[1].vram_hits) << "the VRAM tier saw the same accesses";
    EXPECT_GT(runs[1].distinct_mean, runs[0].distinct_mean + 0.5);
  }
}

}  // namespace
}  // namespace expertd::engine
