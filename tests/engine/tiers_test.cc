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

// The shape of one run: the model's routing geometry and the tiers' sizes.
struct Geometry {
  uint32_t layers = 8;
  uint32_t experts = 8;
  uint32_t top_k = 2;
  uint32_t vram_slots = 6;  // a token's working set is 16 experts
  uint32_t host_slots = 8;  // the daemon's cache limit
  uint32_t tokens = 120;
  std::string staging = "1";  // expertd's smallest staging ring
  uint32_t staging_slots = 2;
};

// Per token and layer, top-k distinct experts drawn from a per-layer Zipf distribution (s = 1)
// over a shuffled expert order, as skewed as real routers are.
std::vector<std::vector<uint32_t>> routing(const Geometry& g, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<uint32_t>> order(g.layers);
  for (auto& o : order) {
    o.resize(g.experts);
    for (uint32_t e = 0; e < g.experts; ++e) o[e] = e;
    std::shuffle(o.begin(), o.end(), rng);
  }
  std::vector<std::vector<uint32_t>> out;
  for (uint32_t t = 0; t < g.tokens; ++t) {
    for (uint32_t l = 0; l < g.layers; ++l) {
      std::vector<double> w(g.experts);
      for (uint32_t r = 0; r < g.experts; ++r) w[r] = 1.0 / (r + 1);
      std::vector<uint32_t> chosen;
      while (chosen.size() < g.top_k) {
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
  uint64_t disk_reads = 0;  // the daemon's misses: acquires that waited for a read
};

TierRun run_tiers(const Geometry& g, const std::string& gguf, const DenseModel& model,
                  const std::vector<std::string>& daemon_policy, bool coordinate) {
  TierRun run;
  TempDir dir;
  const std::string socket = dir.path() + "/expertd.sock";
  std::vector<std::string> args{"--model", "m=" + gguf, "--socket", socket,      "--cache",
                                "64MiB",   "--staging", g.staging,  "--no-mlock"};
  args.insert(args.end(), daemon_policy.begin(), daemon_policy.end());
  Daemon daemon(dir.path(), args);
  EXPECT_TRUE(daemon.start());
  {
    auto control = client::Client::connect(socket);
    EXPECT_TRUE(control) << control.error().message;
    if (!control) return run;
    EXPECT_TRUE((*control)->set_cache_limit("m", g.host_slots));
    auto source = DaemonExpertSource::connect(socket, "m", model, "tiers_test");
    EXPECT_TRUE(source) << source.error().message;
    if (!source) return run;
    auto tier = VramTier::create(g.vram_slots, g.layers, g.experts);
    EXPECT_TRUE(tier);
    if (!tier) return run;
    VramTier& t = **tier;
    std::vector<uint8_t> host(g.layers * g.experts);
    uint64_t distinct_sum = 0;
    const std::vector<std::vector<uint32_t>> routes = routing(g, 11);
    std::vector<ExpertView> held;
    std::vector<uint8_t> held_kept;
    std::vector<uint32_t> pinned;
    for (uint32_t tok = 0; tok < g.tokens; ++tok) {
      for (uint32_t l = 0; l < g.layers; ++l) {
        pinned.clear();
        for (const uint32_t e : routes[tok * g.layers + l]) {
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
          VramTier::Entry evicted;
          slot = t.insert(l, e, false, false, &evicted);
          if (coordinate && evicted.layer != VramTier::kNone) {
            const Status st = (*source)->unkeep(evicted.layer, evicted.expert);
            EXPECT_TRUE(st) << st.error().message;
          }
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
      EXPECT_GT((*source)->host_resident(g.experts, host), 0u);
      if (tok > 0) distinct_sum += t.distinct_with(host);
    }
    run.distinct_mean = static_cast<double>(distinct_sum) / (g.tokens - 1);
    auto stats = (*control)->stats();
    EXPECT_TRUE(stats) << stats.error().message;
    if (stats) run.disk_reads = stats->models.at(0).scheduler.misses;
  }
  const std::string log = daemon.log();
  EXPECT_EQ(daemon.stop(), 0) << log;
  return run;
}

// Both runs of one geometry, under the daemon's default policy and LRU.
struct Compared {
  std::string policy;
  TierRun independent, coordinated;
};
std::vector<Compared> compare(const Geometry& g, const std::string& forge_flags) {
  std::vector<Compared> out;
  TempDir dir;
  const std::string gguf = expertd::test::forge(dir.path(), "m", forge_flags);
  auto model = DenseModel::load(gguf);
  EXPECT_TRUE(model) << model.error().message;
  if (!model) return out;
  EXPECT_EQ(model->params().n_expert_used, g.top_k);
  const std::vector<std::vector<std::string>> policies{{}, {"--policy", "lru"}};
  for (const auto& policy : policies) {
    Compared c;
    c.policy = policy.empty() ? "default" : policy[1];
    c.independent = run_tiers(g, gguf, *model, policy, false);
    c.coordinated = run_tiers(g, gguf, *model, policy, true);
    std::printf(
        "[ tiers ] daemon policy %s, VRAM %u slots (%s) + host %u cache + %u staging slots, %u "
        "layers x top-%u of %u, %u tokens: distinct experts across tiers, mean per token: "
        "independent %.2f, coordinated %.2f (capacity %u); VRAM hits %llu / %llu; disk reads "
        "%llu / %llu\n",
        c.policy.c_str(), g.vram_slots, std::string(VramTier::kDefaultPolicy).c_str(), g.host_slots,
        g.staging_slots, g.layers, g.top_k, g.experts, g.tokens, c.independent.distinct_mean,
        c.coordinated.distinct_mean, g.vram_slots + g.host_slots + g.staging_slots,
        static_cast<unsigned long long>(c.independent.vram_hits),
        static_cast<unsigned long long>(c.coordinated.vram_hits),
        static_cast<unsigned long long>(c.independent.disk_reads),
        static_cast<unsigned long long>(c.coordinated.disk_reads));
    out.push_back(std::move(c));
  }
  return out;
}

TEST(Tiers, TellingTheDaemonWhatVramKeepsRaisesDistinctExpertsAcrossTiers) {
  const Geometry g;
  for (const Compared& c :
       compare(g,
               "--layers 8 --experts 8 --top-k 2 --embd 256 --ff 256 --heads 4 --kv-heads 2 "
               "--head-dim 64 --vocab 300 --expert-type q8_0 --dense-type f16 --seed 5")) {
    SCOPED_TRACE("daemon policy " + c.policy);
    EXPECT_GT(c.independent.kept, 0u);
    EXPECT_EQ(c.independent.vram_hits, c.coordinated.vram_hits)
        << "the VRAM tier saw the same accesses";
    EXPECT_GT(c.coordinated.distinct_mean, c.independent.distinct_mean + 0.5);
  }
}

// The Mixtral shape's proportions on the H200 (issue 13): a VRAM tier of 32 experts against 64 a
// token, a host cache of about half the model. The tier churns, so most experts it copied in are
// gone from it soon after; a host copy released as the client's must not stay the daemon's first
// victim then (kOpUnkeep). The engine's default stays independent tiers: docs/ENGINE.md.
TEST(Tiers, CoordinatedTiersReadNoMoreThanIndependentOnceTheTierTellsItsEvictions) {
  Geometry g;
  g.layers = 32;
  g.vram_slots = 32;
  g.host_slots = 128;
  g.tokens = 60;
  for (const Compared& c :
       compare(g,
               "--layers 32 --experts 8 --top-k 2 --embd 128 --ff 128 --heads 2 --kv-heads 1 "
               "--head-dim 64 --vocab 300 --expert-type q8_0 --dense-type f16 --seed 5")) {
    SCOPED_TRACE("daemon policy " + c.policy);
    EXPECT_EQ(c.independent.vram_hits, c.coordinated.vram_hits);
    EXPECT_LE(c.coordinated.disk_reads, c.independent.disk_reads);
  }
}

}  // namespace
}  // namespace expertd::engine
