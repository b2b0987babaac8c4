// The CUDA engine against the CPU reference engine and against Hugging Face transformers, on a
// real device. Every test skips, saying why, where no CUDA device is present (CI, the dev VM);
// the device runs are recorded in docs/ENGINE.md and docs/PERFORMANCE.md.
//
// Tolerances: logits relative error (||gpu - ref|| / ||ref||) <= 1e-3 against the f32 fixture's
// transformers logits, <= 2e-2 against the q8_0 fixture's (a reference dequantised the same way),
// and <= 1e-3 against the CPU engine reading the same quantised experts (both dequantise
// identically; only the accumulation order and precision differ).
#include "engine/gpu_engine.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <tuple>

#include "engine/cpu_engine.h"
#include "engine/daemon_expert_source.h"
#include "engine/ds3_cpu_engine.h"
#include "engine/ds3_gpu_engine.h"
#include "engine/ds4_cpu_engine.h"
#include "engine/ds4_gpu_engine.h"
#include "engine/family.h"
#include "expertd/client.h"
#include "testing/expertd_fixture.h"
#include "tests/engine/batch_check.h"
#include "tests/engine/ds4_truncate_cuts.h"
#include "tests/engine/file_expert_source.h"
#include "tests/engine/fixture.h"

namespace expertd::engine {
namespace {

using expertd::test::Daemon;
using expertd::test::TempDir;
using test::TinyFixture;

#define REQUIRE_GPU()                                        \
  do {                                                       \
    std::string why_;                                        \
    if (!cuda_device_available(&why_)) GTEST_SKIP() << why_; \
  } while (0)

// The GPU engine's hints are the CPU engine's, in order, less those for experts its VRAM tier
// holds (TierHintFilter drops them: the source would read what VRAM already has).
void expect_cpu_hints_less_the_tiers(const std::vector<ExpertHint>& hc,
                                     const std::vector<ExpertHint>& hg) {
  ASSERT_LE(hg.size(), hc.size());
  ASSERT_GT(hg.size(), 0u);
  // The same (layer, expert) comes back token after token, so a GPU hint is matched with the next
  // CPU hint that has its score too: matching on the expert alone paired a hint the tier dropped
  // at one token with the GPU's of a later token (a 1.5e-3 "difference" on the H200).
  auto same = [](const ExpertHint& a, const ExpertHint& b) {
    return a.layer == b.layer && a.expert == b.expert && std::fabs(a.score - b.score) <= 1e-5f;
  };
  size_t j = 0;
  for (size_t i = 0; i < hg.size(); ++i) {
    while (j < hc.size() && !same(hc[j], hg[i])) ++j;
    ASSERT_LT(j, hc.size()) << "GPU hint " << i << " (layer " << hg[i].layer << " expert "
                            << hg[i].expert << " score " << hg[i].score
                            << ") is not among the CPU's, in order, with its score";
    ++j;
  }
}

GpuOptions tier(GpuOptions::Tier t, uint64_t value = 0) {
  GpuOptions g;
  g.tier = t;
  g.value = value;
  return g;
}

// create_gpu_engine on `model`: without a device, the device's error (and the test skips); with
// one, a "gpu" engine whose description() says `says`.
void expect_factory_picks(const DenseModel& model, ExpertSource& source, const std::string& says) {
  std::string why;
  auto picked =
      create_gpu_engine(model, source, EngineOptions{16, 0, 0}, tier(GpuOptions::Tier::Experts, 8));
  if (!cuda_device_available(&why)) {
    ASSERT_FALSE(picked);
    EXPECT_EQ(picked.error().message, why);
    GTEST_SKIP() << why;
  }
  ASSERT_TRUE(picked) << picked.error().message;
  EXPECT_EQ((*picked)->name(), "gpu");
  EXPECT_NE((*picked)->description().find(says), std::string::npos) << (*picked)->description();
}

// Fx's fixture (each file of `variants`, with its tolerance) token by token on the GPU through a
// VRAM tier of `small` slots, which evicts (more than `min_misses` misses), and one of `all` (every
// expert): logits within the tolerance of transformers', routing against the trace, every expert
// counted, then the prompt as one prefill and transformers' greedy tokens.
using Variants = std::initializer_list<std::pair<const char*, double>>;
constexpr Variants kF32AndQ8 = {{"f32", 1e-3}, {"q8_0", 2e-2}};
template <typename Fx>
void expect_tiny_fixture_on_gpu(const char* name, uint64_t small, uint64_t all, uint64_t min_misses,
                                Variants variants = kF32AndQ8) {
  const Fx fx = Fx::load();
  for (const auto& [variant, tol] : variants) {
    for (const uint64_t slots : {small, all}) {
      SCOPED_TRACE(fmt::format("{} {} tier {}", name, variant, slots));
      // As expert-run loads it for a CUDA engine: the matrices stay in the file until uploaded.
      auto model = DenseModel::load(Fx::gguf(variant), DenseLoad::Deferred);
      ASSERT_TRUE(model) << model.error().message;
      const ModelParams& p = model->params();
      auto source = test::FileExpertSource::open(*model);
      ASSERT_TRUE(source) << source.error().message;
      auto engine = create_gpu_engine(*model, **source, EngineOptions{128, 0, 0},
                                      tier(GpuOptions::Tier::Experts, slots));
      ASSERT_TRUE(engine) << engine.error().message;
      EXPECT_EQ((*engine)->name(), "gpu");
      const double worst = test::expect_fixture_logits(**engine, fx, variant, tol, 1e-4);
      std::printf("[ %s %s tier %llu ] GPU logits vs transformers: max relative error %.3e\n", name,
                  variant, static_cast<unsigned long long>(slots), worst);
      const EngineStats& s = (*engine)->stats();
      // glm4moe's dense first layer routes nothing (dense_lead is 0 for the other families).
      EXPECT_EQ(s.experts_used,
                fx.tokens.size() * (p.n_layer - p.sigmoid_moe.dense_lead) * p.n_expert_used);
      test::expect_fixture_greedy(**engine, fx, variant);
      EXPECT_EQ(s.vram_hits + s.vram_misses, s.experts_used);
      if (slots == small) {
        EXPECT_GT(s.vram_misses, min_misses);  // a tier this small evicts
      }
      EXPECT_EQ((*source)->gets(), (*source)->releases());
    }
  }
}

// The model in `gguf` on the CPU and the GPU engine (a 12-slot tier), each over its own file
// source, with router lookahead (depth 2, from a dense layer too): logits within 1e-3, the same
// routing (experts, weights, predictions), the CPU engine's hints less the tier's, the same
// counters, every hold given back.
void expect_gpu_matches_cpu_on_file(const std::string& gguf, const std::vector<uint32_t>& tokens,
                                    const std::string& label) {
  auto model = DenseModel::load(gguf);
  ASSERT_TRUE(model) << model.error().message;
  const uint32_t vocab = model->params().n_vocab;
  auto fs_cpu = test::FileExpertSource::open(*model);
  auto fs_gpu = test::FileExpertSource::open(*model);
  ASSERT_TRUE(fs_cpu && fs_gpu);
  const EngineOptions o{64, 2, 0};
  auto cpu = create_cpu_engine(*model, **fs_cpu, o);
  ASSERT_TRUE(cpu) << cpu.error().message;
  auto gpu = create_gpu_engine(*model, **fs_gpu, o, tier(GpuOptions::Tier::Experts, 12));
  ASSERT_TRUE(gpu) << gpu.error().message;
  std::vector<RoutingRecord> rc;
  std::vector<RoutingRecord> rg;
  (*cpu)->set_routing_log(&rc);
  (*gpu)->set_routing_log(&rg);
  std::vector<float> a(vocab);
  std::vector<float> b(vocab);
  double worst = 0.0;
  for (size_t t = 0; t < tokens.size(); ++t) {
    ASSERT_TRUE((*cpu)->decode(tokens[t], a));
    auto st = (*gpu)->decode(tokens[t], b);
    ASSERT_TRUE(st) << st.error().message;
    const double err = test::rel_err(b.data(), a.data(), vocab);
    EXPECT_LE(err, 1e-3) << "position " << t;
    worst = std::max(worst, err);
  }
  std::printf("[ %s ] GPU vs CPU engine: max relative error %.3e\n", label.c_str(), worst);
  ASSERT_EQ(rc.size(), rg.size());
  for (size_t i = 0; i < rc.size(); ++i) {
    EXPECT_EQ(rg[i].experts, rc[i].experts) << "record " << i;
    ASSERT_EQ(rg[i].weights.size(), rc[i].weights.size()) << "record " << i;
    for (size_t j = 0; j < rc[i].weights.size(); ++j) {
      EXPECT_NEAR(rg[i].weights[j], rc[i].weights[j], 1e-5) << "record " << i;
    }
    EXPECT_EQ(rg[i].predicted, rc[i].predicted) << "record " << i;
  }
  expect_cpu_hints_less_the_tiers((*fs_cpu)->hints(), (*fs_gpu)->hints());
  EXPECT_EQ((*gpu)->stats().hints_sent, (*cpu)->stats().hints_sent);
  EXPECT_EQ((*gpu)->stats().experts_used, (*cpu)->stats().experts_used);
  EXPECT_EQ((*fs_gpu)->gets(), (*fs_gpu)->releases());
}

uint64_t chunk_experts(const std::vector<RoutingRecord>& log, uint32_t chunk, uint32_t n);

// prefill() in chunks of `chunk` on the GPU, through a VRAM tier of `slots`, is decode() of each
// token: the last logits within 1e-4 (DeepSeek-V3's, GLM-4.5's and gpt-oss's routed experts run
// as GEMMs over their rows, run_experts_by_rows, and from 8 rows their attention's projections
// too, decode()'s as matvecs: the same f32 products summed in another order) and every routing
// decision, the chunks and positions counted, each chunk's distinct (layer, expert) pairs counted
// once, the engine at the prompt's end and decoding on from there, every hold given back.
void expect_chunked_prefill_is_decode(const DenseModel& model, const std::vector<uint32_t>& tokens,
                                      uint32_t chunk, uint64_t slots) {
  SCOPED_TRACE(fmt::format("tier slots {} chunk {}", slots, chunk));
  const uint32_t vocab = model.params().n_vocab;
  const auto n = static_cast<uint32_t>(tokens.size());
  auto fs = test::FileExpertSource::open(model);
  ASSERT_TRUE(fs) << fs.error().message;
  EngineOptions o{64, 2, 0};
  o.prefill_chunk = chunk;
  auto gpu = create_gpu_engine(model, **fs, o, tier(GpuOptions::Tier::Experts, slots));
  ASSERT_TRUE(gpu) << gpu.error().message;
  EXPECT_NE((*gpu)->description().find(fmt::format("prefill in chunks of {}", chunk)),
            std::string::npos)
      << (*gpu)->description();
  std::vector<RoutingRecord> decoded_routes;
  (*gpu)->set_routing_log(&decoded_routes);
  std::vector<float> decoded(vocab);
  for (const uint32_t t : tokens) ASSERT_TRUE((*gpu)->decode(t, decoded));
  (*gpu)->reset();
  std::vector<RoutingRecord> prefilled_routes;
  (*gpu)->set_routing_log(&prefilled_routes);
  const EngineStats before = (*gpu)->stats();
  std::vector<float> prefilled(vocab);
  auto st = (*gpu)->prefill(tokens, prefilled);
  ASSERT_TRUE(st) << st.error().message;
  (*gpu)->set_routing_log(nullptr);
  const double err = test::rel_err(prefilled.data(), decoded.data(), vocab);
  EXPECT_LE(err, 1e-4);
  std::printf("[ tier %llu chunk %u ] prefill vs decode: %.3e\n",
              static_cast<unsigned long long>(slots), chunk, err);
  ASSERT_EQ(prefilled_routes.size(), decoded_routes.size());
  for (size_t i = 0; i < decoded_routes.size(); ++i) {
    EXPECT_EQ(prefilled_routes[i].token, decoded_routes[i].token) << "record " << i;
    EXPECT_EQ(prefilled_routes[i].layer, decoded_routes[i].layer) << "record " << i;
    EXPECT_EQ(prefilled_routes[i].experts, decoded_routes[i].experts) << "record " << i;
  }
  const EngineStats& s = (*gpu)->stats();
  EXPECT_EQ(s.prefill_tokens - before.prefill_tokens, n);
  EXPECT_EQ(s.prefill_chunks - before.prefill_chunks, (n + chunk - 1) / chunk);
  EXPECT_EQ(s.prefill_experts - before.prefill_experts, chunk_experts(decoded_routes, chunk, n));
  EXPECT_EQ((*gpu)->position(), n);
  std::vector<float> next(vocab);
  ASSERT_TRUE((*gpu)->decode(tokens[0], next));
  EXPECT_EQ((*fs)->gets(), (*fs)->releases());
}

// glm4moe and gpt-oss: layer by layer over chunks of 5 and of 64 positions, a 12-slot tier.
void expect_prefill_is_decode(const std::string& gguf, const std::vector<uint32_t>& tokens) {
  auto model = DenseModel::load(gguf);
  ASSERT_TRUE(model) << model.error().message;
  for (const uint32_t chunk : {5u, 64u})
    expect_chunked_prefill_is_decode(*model, tokens, chunk, 12);
}

// Fx's `variant` file served by a real expertd as `name`: the CPU engine's logits and routing over
// fx.tokens, then the GPU engine's, in place and through a 6-slot VRAM tier with router lookahead
// (depth 2): logits within 1e-3 of the CPU engine's, the same routing, every hold given back.
template <typename Fx>
void expect_gpu_matches_cpu_through_expertd(const Fx& fx, const std::string& name,
                                            const std::string& variant = "q8_0") {
  const std::string gguf = Fx::gguf(variant);
  TempDir dir;
  const std::string sock = dir.path() + "/expertd.sock";
  Daemon d(dir.path(),
           {"--model", name + "=" + gguf, "--socket", sock, "--cache", "16MiB", "--no-mlock"});
  ASSERT_TRUE(d.start());
  auto model = DenseModel::load(gguf);
  ASSERT_TRUE(model) << model.error().message;
  auto run = [&](bool gpu, const GpuOptions& g, uint32_t depth,
                 std::vector<RoutingRecord>& routing) {
    std::vector<std::vector<float>> out;
    auto client = client::Client::connect(sock);
    EXPECT_TRUE(client);
    if (!client) return out;
    auto session = (*client)->attach(name, "gpu_engine_tests");
    EXPECT_TRUE(session);
    if (!session) return out;
    auto source = DaemonExpertSource::create(**session, *model);
    EXPECT_TRUE(source) << source.error().message;
    if (!source) return out;
    const EngineOptions o{128, depth, 0};
    auto engine =
        gpu ? create_gpu_engine(*model, **source, o, g) : create_cpu_engine(*model, **source, o);
    EXPECT_TRUE(engine) << engine.error().message;
    if (!engine) return out;
    (*engine)->set_routing_log(&routing);
    std::vector<float> l(fx.vocab);
    for (const uint32_t t : fx.tokens) {
      const Status st = (*engine)->decode(t, l);
      EXPECT_TRUE(st) << st.error().message;
      if (!st) break;
      out.push_back(l);
    }
    (*engine)->set_routing_log(nullptr);
    engine->reset();
    EXPECT_EQ((*session)->holds(), 0u) << "every hold is given back";
    return out;
  };
  std::vector<RoutingRecord> ref_routing;
  const auto ref = run(false, GpuOptions{}, 0, ref_routing);
  ASSERT_EQ(ref.size(), fx.tokens.size());
  for (const auto& [label, g, depth] :
       {std::tuple{"in-place", tier(GpuOptions::Tier::InPlace), 0u},
        std::tuple{"tier-6+prefetch", tier(GpuOptions::Tier::Experts, 6), 2u}}) {
    SCOPED_TRACE(label);
    std::vector<RoutingRecord> routing;
    const auto got = run(true, g, depth, routing);
    ASSERT_EQ(got.size(), ref.size());
    double worst = 0.0;
    for (size_t i = 0; i < got.size(); ++i) {
      const double err = test::rel_err(got[i].data(), ref[i].data(), fx.vocab);
      EXPECT_LE(err, 1e-3) << "position " << i;
      worst = std::max(worst, err);
    }
    std::printf("[ %s %s %s ] GPU vs CPU engine through expertd: max rel err %.3e\n", name.c_str(),
                variant.c_str(), label, worst);
    ASSERT_EQ(routing.size(), ref_routing.size());
    for (size_t i = 0; i < routing.size(); ++i) {
      EXPECT_EQ(routing[i].experts, ref_routing[i].experts) << "record " << i;
    }
  }
  const std::string log = d.log();
  EXPECT_EQ(d.stop(), 0) << log;
}

TEST(GpuEngine, TinyFixtureLogitsMatchTransformers) {
  REQUIRE_GPU();
  const TinyFixture fx = TinyFixture::load();
  for (const auto& [variant, tol] : {std::pair{"f32", 1e-3}, std::pair{"q8_0", 2e-2}}) {
    SCOPED_TRACE(variant);
    // As expert-run loads it for a CUDA engine: the matrices stay in the file until uploaded.
    auto model = DenseModel::load(fx.gguf(variant), DenseLoad::Deferred);
    ASSERT_TRUE(model) << model.error().message;
    auto source = test::FileExpertSource::open(*model);
    ASSERT_TRUE(source) << source.error().message;
    auto engine = GpuEngine::create(*model, **source, EngineOptions{32, 0, 0},
                                    tier(GpuOptions::Tier::Experts, 8));
    ASSERT_TRUE(engine) << engine.error().message;
    std::vector<RoutingRecord> routing;
    (*engine)->set_routing_log(&routing);
    const std::vector<float> expected = fx.logits(variant);
    std::vector<float> logits(fx.vocab);
    double worst = 0.0;
    for (size_t t = 0; t < fx.tokens.size(); ++t) {
      auto st = (*engine)->decode(fx.tokens[t], logits);
      ASSERT_TRUE(st) << st.error().message;
      const double err = test::rel_err(logits.data(), expected.data() + t * fx.vocab, fx.vocab);
      EXPECT_LE(err, tol) << "position " << t;
      worst = std::max(worst, err);
    }
    std::printf("[ %s ] GPU logits vs transformers: max relative error %.3e over %zu positions\n",
                variant, worst, fx.tokens.size());
    const std::vector<test::TraceEntry> trace = fx.trace(variant);
    ASSERT_EQ(routing.size(), trace.size());
    for (size_t i = 0; i < trace.size(); ++i) {
      EXPECT_EQ(routing[i].experts, trace[i].experts) << "record " << i;
    }
    EXPECT_EQ((*source)->gets(), (*source)->releases());
  }
}

// The engine's modes through a real expertd: in place (kernels read the pinned arena), a VRAM
// tier smaller than the model's experts (evictions, copies), and one that holds them all; with
// and without prefetch. Each must give the CPU engine's logits on the same daemon.
TEST(GpuEngine, DaemonModesMatchTheCpuEngine) {
  REQUIRE_GPU();
  TempDir dir;
  struct Case {
    const char* type;
    const char* dense;
  };
  const Case cases[] = {{"f32", "f32"},   {"f16", "bf16"},  {"bf16", "f16"},   {"q8_0", "q8_0"},
                        {"q4_k", "q4_k"}, {"q6_k", "q6_k"}, {"mxfp4", "mxfp4"}};
  std::vector<std::string> args;
  std::vector<std::pair<std::string, std::string>> models;
  for (const Case& c : cases) {
    const std::string name = std::string("m-") + c.type;
    const std::string path = expertd::test::forge(
        dir.path(), name,
        fmt::format("--layers 4 --experts 8 --top-k 2 --embd 512 --ff 768 --heads 8 --kv-heads 2 "
                    "--head-dim 64 --vocab 320 --expert-type {} --dense-type {} --seed 11",
                    c.type, c.dense));
    args.insert(args.end(), {"--model", name + "=" + path});
    models.emplace_back(name, path);
  }
  const std::string sock = dir.path() + "/expertd.sock";
  args.insert(args.end(), {"--socket", sock, "--cache", "64MiB", "--no-mlock"});
  Daemon d(dir.path(), args);
  ASSERT_TRUE(d.start());
  const std::vector<uint32_t> tokens = {1, 17, 255, 299, 3, 42, 7, 100};
  for (const auto& [name, path] : models) {
    auto model = DenseModel::load(path);
    ASSERT_TRUE(model) << model.error().message;
    const uint32_t vocab = model->params().n_vocab;
    // The CPU engine's logits, the reference.
    std::vector<std::vector<float>> ref;
    {
      auto client = client::Client::connect(sock);
      ASSERT_TRUE(client);
      auto session = (*client)->attach(name, "gpu_engine_tests");
      ASSERT_TRUE(session);
      auto source = DaemonExpertSource::create(**session, *model);
      ASSERT_TRUE(source) << source.error().message;
      auto cpu = CpuEngine::create(*model, **source, EngineOptions{16, 0, 0});
      ASSERT_TRUE(cpu);
      std::vector<float> l(vocab);
      for (const uint32_t t : tokens) {
        ASSERT_TRUE((*cpu)->decode(t, l));
        ref.push_back(l);
      }
    }
    for (const auto& [label, g, depth] :
         {std::tuple{"in-place", tier(GpuOptions::Tier::InPlace), 0u},
          std::tuple{"in-place+prefetch", tier(GpuOptions::Tier::InPlace), 2u},
          std::tuple{"tier-2 (top-k)", tier(GpuOptions::Tier::Experts, 2), 0u},
          std::tuple{"tier-2+prefetch", tier(GpuOptions::Tier::Experts, 2), 1u},
          std::tuple{"tier-3", tier(GpuOptions::Tier::Experts, 3), 0u},
          std::tuple{"tier-3+prefetch", tier(GpuOptions::Tier::Experts, 3), 1u},
          std::tuple{"tier-all+prefetch", tier(GpuOptions::Tier::Experts, 32), 2u}}) {
      SCOPED_TRACE(name + " " + label);
      auto client = client::Client::connect(sock);
      ASSERT_TRUE(client);
      auto session = (*client)->attach(name, "gpu_engine_tests");
      ASSERT_TRUE(session);
      auto source = DaemonExpertSource::create(**session, *model);
      ASSERT_TRUE(source) << source.error().message;
      auto gpu = GpuEngine::create(*model, **source, EngineOptions{16, depth, 0}, g);
      ASSERT_TRUE(gpu) << gpu.error().message;
      std::vector<float> l(vocab);
      double worst = 0.0;
      for (size_t i = 0; i < tokens.size(); ++i) {
        auto st = (*gpu)->decode(tokens[i], l);
        ASSERT_TRUE(st) << st.error().message;
        for (const float v : l) ASSERT_TRUE(std::isfinite(v));
        const double err = test::rel_err(l.data(), ref[i].data(), vocab);
        EXPECT_LE(err, 1e-3) << "position " << i;
        worst = std::max(worst, err);
      }
      const EngineStats& s = (*gpu)->stats();
      std::printf(
          "[ %s %s ] max rel err vs CPU %.3e; vram hits %llu misses %llu (read in place %llu) "
          "prefetched %llu (used %llu); tiers: distinct %u of %u\n",
          name.c_str(), label, worst, static_cast<unsigned long long>(s.vram_hits),
          static_cast<unsigned long long>(s.vram_misses),
          static_cast<unsigned long long>(s.vram_streamed),
          static_cast<unsigned long long>(s.vram_prefetches),
          static_cast<unsigned long long>(s.vram_prefetch_used), s.tiers_distinct,
          s.tiers_capacity);
      if ((*gpu)->vram_slots() > 0) {
        EXPECT_EQ(s.vram_hits + s.vram_misses, s.experts_used);
        EXPECT_LE(s.vram_streamed, s.vram_misses);
        // Measured after every token: the VRAM slots plus the daemon's arena slots.
        EXPECT_EQ(s.tiers_samples, tokens.size());
        EXPECT_GT(s.tiers_capacity, (*gpu)->vram_slots());
        EXPECT_GT(s.tiers_distinct, 0u);
        EXPECT_LE(s.tiers_distinct, s.tiers_capacity);
      }
      if ((*gpu)->vram_slots() == 3) {
        EXPECT_GT(s.vram_misses, 4u);  // a tier this small evicts
      }
      gpu->reset();
      EXPECT_EQ((*session)->holds(), 0u) << "every hold is given back";
    }
  }
  const std::string log = d.log();
  EXPECT_EQ(d.stop(), 0) << log;
}

// Benchmark mode: a script's routes replace the router on both engines, identically.
TEST(GpuEngine, ScriptedRoutingMatchesTheCpuEngine) {
  REQUIRE_GPU();
  TempDir dir;
  const std::string path = expertd::test::forge(
      dir.path(), "s",
      "--layers 3 --experts 8 --top-k 2 --embd 256 --ff 512 --heads 4 --kv-heads 2 "
      "--head-dim 64 --vocab 300 --expert-type q4_k --dense-type f16 --seed 3");
  auto model = DenseModel::load(path);
  ASSERT_TRUE(model);
  RoutingScript script(4, 3);
  for (uint32_t t = 0; t < 4; ++t) {
    for (uint32_t l = 0; l < 3; ++l) {
      ASSERT_TRUE(script.set(t, l,
                             ScriptedRoute{{(t + l) % 8, (t * 3 + l + 1) % 8}, {0.7f, 0.3f}, {}},
                             model->params()));
    }
  }
  EngineOptions o{8, 1, 0, &script, HintSource::Script};
  auto fs1 = test::FileExpertSource::open(*model);
  auto fs2 = test::FileExpertSource::open(*model);
  ASSERT_TRUE(fs1 && fs2);
  auto cpu = CpuEngine::create(*model, **fs1, o);
  auto gpu = GpuEngine::create(*model, **fs2, o, tier(GpuOptions::Tier::Experts, 4));
  ASSERT_TRUE(cpu && gpu) << (gpu ? "" : gpu.error().message);
  std::vector<RoutingRecord> rc;
  std::vector<RoutingRecord> rg;
  (*cpu)->set_routing_log(&rc);
  (*gpu)->set_routing_log(&rg);
  std::vector<float> a(300);
  std::vector<float> b(300);
  for (const uint32_t t : {5u, 6u, 7u, 8u}) {
    ASSERT_TRUE((*cpu)->decode(t, a));
    auto st = (*gpu)->decode(t, b);
    ASSERT_TRUE(st) << st.error().message;
    EXPECT_LE(test::rel_err(b.data(), a.data(), a.size()), 1e-3);
  }
  ASSERT_EQ(rc.size(), rg.size());
  for (size_t i = 0; i < rc.size(); ++i) {
    EXPECT_EQ(rc[i].experts, rg[i].experts);
    EXPECT_EQ(rc[i].predicted, rg[i].predicted);
  }
  EXPECT_EQ((*gpu)->stats().scripted_routes, 12u);
  EXPECT_DOUBLE_EQ((*gpu)->stats().prefetch_recall(), 1.0);  // the oracle names every expert
}

TEST(GpuEngine, ATierTooSmallForOneLayerIsRefused) {
  REQUIRE_GPU();
  const TinyFixture fx = TinyFixture::load();
  auto model = DenseModel::load(fx.gguf("f32"));
  ASSERT_TRUE(model);
  auto source = test::FileExpertSource::open(*model);
  ASSERT_TRUE(source);
  auto engine = GpuEngine::create(*model, **source, EngineOptions{8, 0, 0},
                                  tier(GpuOptions::Tier::Experts, 1));
  ASSERT_FALSE(engine);
  // The flag, the value, the minimum and why.
  for (const char* part :
       {"--vram-experts 1:", "at least 2 experts", "top-2", "computed together"}) {
    EXPECT_NE(engine.error().message.find(part), std::string::npos)
        << part << " in: " << engine.error().message;
  }
  // Exactly top-k is enough (the fixture's experts come from a file: no arena, every miss is
  // admitted).
  auto two = GpuEngine::create(*model, **source, EngineOptions{8, 0, 0},
                               tier(GpuOptions::Tier::Experts, 2));
  ASSERT_TRUE(two) << two.error().message;
  std::vector<float> l(model->params().n_vocab);
  for (size_t i = 0; i < std::min<size_t>(8, fx.tokens.size()); ++i) {
    const Status st = (*two)->decode(fx.tokens[i], l);
    ASSERT_TRUE(st) << st.error().message;
  }
  two->reset();
  auto in_place =
      GpuEngine::create(*model, **source, EngineOptions{8, 0, 0}, tier(GpuOptions::Tier::InPlace));
  ASSERT_FALSE(in_place);  // a file source has no arena to register
  EXPECT_NE(in_place.error().message.find("in-place"), std::string::npos);
}

// --- prefill -----------------------------------------------------------------------------------

uint32_t argmax(const std::vector<float>& v) {
  return static_cast<uint32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

// The largest logit minus the second largest: how far a greedy choice is from a tie.
double top2_margin(const std::vector<float>& v) {
  std::vector<float> s = v;
  std::partial_sort(s.begin(), s.begin() + 2, s.end(), std::greater<float>());
  return static_cast<double>(s[0]) - s[1];
}

// What prefill in chunks of `chunk` must acquire: the distinct (layer, expert) pairs of each
// chunk of the first n positions of a token-by-token routing log, summed over the chunks.
uint64_t chunk_experts(const std::vector<RoutingRecord>& log, uint32_t chunk, uint32_t n) {
  std::set<std::tuple<uint32_t, uint32_t, uint32_t>> seen;
  for (const RoutingRecord& r : log) {
    if (r.token >= n) continue;
    for (const uint32_t e : r.experts) seen.emplace(r.token / chunk, r.layer, e);
  }
  return seen.size();
}

struct DaemonConn {
  std::unique_ptr<client::Client> client;
  std::unique_ptr<client::Session> session;
  std::unique_ptr<DaemonExpertSource> source;

  static DaemonConn open(const std::string& sock, const std::string& name,
                         const DenseModel& model) {
    DaemonConn c;
    auto cl = client::Client::connect(sock);
    EXPECT_TRUE(cl) << cl.error().message;
    if (!cl) return c;
    c.client = std::move(*cl);
    auto s = c.client->attach(name, "gpu_engine_tests");
    EXPECT_TRUE(s) << s.error().message;
    if (!s) return c;
    c.session = std::move(*s);
    auto src = DaemonExpertSource::create(*c.session, model);
    EXPECT_TRUE(src) << src.error().message;
    if (src) c.source = std::move(*src);
    return c;
  }
};

// prefill() of the fixture's prompt in chunks of 1, 5 and 512 positions, in place, through a
// 3-slot VRAM tier (it evicts within a chunk's layer) and a tier holding every expert, against the
// CPU engine and the GPU engine fed token by token on the same daemon: the last position's logits,
// the routing records, the greedy continuation, the counters (each distinct expert of a chunk's
// layer acquired once), every hold given back; then truncate() and feeding the rest again gives
// the fresh sequence's logits.
TEST(GpuEngine, PrefillMatchesTokenByTokenThroughTheDaemon) {
  REQUIRE_GPU();
  const TinyFixture fx = TinyFixture::load();
  TempDir dir;
  const std::string sock = dir.path() + "/expertd.sock";
  Daemon d(dir.path(),
           {"--model", "tiny-f32=" + fx.gguf("f32"), "--model", "tiny-q8_0=" + fx.gguf("q8_0"),
            "--socket", sock, "--cache", "64MiB", "--no-mlock"});
  ASSERT_TRUE(d.start());
  const std::vector<uint32_t>& prompt = fx.tokens;
  const uint32_t n = static_cast<uint32_t>(prompt.size());
  const uint32_t gen = 6;
  for (const char* variant : {"f32", "q8_0"}) {
    const std::string name = std::string("tiny-") + variant;
    auto model = DenseModel::load(fx.gguf(variant));
    ASSERT_TRUE(model) << model.error().message;
    const ModelParams& p = model->params();
    const uint32_t vocab = p.n_vocab;
    const uint32_t all_experts = p.n_layer * p.n_expert;

    // The CPU engine token by token: every position's logits, the routing, the greedy tokens.
    std::vector<std::vector<float>> cpu_logits;
    std::vector<RoutingRecord> cpu_routing;
    std::vector<uint32_t> cpu_greedy;
    {
      DaemonConn c = DaemonConn::open(sock, name, *model);
      ASSERT_TRUE(c.source);
      auto cpu = CpuEngine::create(*model, *c.source, EngineOptions{32, 0, 0});
      ASSERT_TRUE(cpu) << cpu.error().message;
      (*cpu)->set_routing_log(&cpu_routing);
      std::vector<float> l(vocab);
      for (const uint32_t t : prompt) {
        ASSERT_TRUE((*cpu)->decode(t, l));
        cpu_logits.push_back(l);
      }
      for (uint32_t i = 0; i < gen; ++i) {
        cpu_greedy.push_back(argmax(l));
        ASSERT_TRUE((*cpu)->decode(cpu_greedy.back(), l));
      }
    }
    // The GPU engine token by token (every expert in VRAM): its last logits and experts used.
    std::vector<float> gpu_last(vocab);
    uint64_t gpu_experts_used = 0;
    {
      DaemonConn c = DaemonConn::open(sock, name, *model);
      ASSERT_TRUE(c.source);
      auto gpu = GpuEngine::create(*model, *c.source, EngineOptions{32, 0, 0},
                                   tier(GpuOptions::Tier::Experts, all_experts));
      ASSERT_TRUE(gpu) << gpu.error().message;
      for (const uint32_t t : prompt) {
        auto st = (*gpu)->decode(t, gpu_last);
        ASSERT_TRUE(st) << st.error().message;
      }
      gpu_experts_used = (*gpu)->stats().experts_used;
      EXPECT_EQ(gpu_experts_used, uint64_t{n} * p.n_layer * p.n_expert_used);
    }
    std::printf("[ %s ] CPU greedy margin %.3e at the prompt's end\n", variant,
                top2_margin(cpu_logits.back()));

    for (const auto& [label, g] :
         {std::pair{"in-place", tier(GpuOptions::Tier::InPlace)},
          std::pair{"tier-3", tier(GpuOptions::Tier::Experts, 3)},
          std::pair{"tier-all", tier(GpuOptions::Tier::Experts, all_experts)}}) {
      for (const uint32_t chunk : {1u, 5u, 512u}) {
        SCOPED_TRACE(fmt::format("{} {} chunk {}", name, label, chunk));
        DaemonConn c = DaemonConn::open(sock, name, *model);
        ASSERT_TRUE(c.source);
        EngineOptions o{32, 0, 0};
        o.prefill_chunk = chunk;
        auto gpu = GpuEngine::create(*model, *c.source, o, g);
        ASSERT_TRUE(gpu) << gpu.error().message;
        EXPECT_NE((*gpu)->description().find("prefill in chunks of"), std::string::npos)
            << (*gpu)->description();
        std::vector<RoutingRecord> routing;
        (*gpu)->set_routing_log(&routing);
        std::vector<float> l(vocab);
        auto st = (*gpu)->prefill(prompt, l);
        ASSERT_TRUE(st) << st.error().message;
        EXPECT_EQ((*gpu)->position(), n);
        for (const float v : l) ASSERT_TRUE(std::isfinite(v));
        const double err_cpu = test::rel_err(l.data(), cpu_logits.back().data(), vocab);
        const double err_gpu = test::rel_err(l.data(), gpu_last.data(), vocab);
        EXPECT_LE(err_cpu, 1e-3);
        EXPECT_LE(err_gpu, 1e-3);

        // The routing, in decode's order (position-major).
        ASSERT_EQ(routing.size(), uint64_t{n} * p.n_layer);
        for (size_t i = 0; i < routing.size(); ++i) {
          EXPECT_EQ(routing[i].token, cpu_routing[i].token) << "record " << i;
          EXPECT_EQ(routing[i].layer, cpu_routing[i].layer) << "record " << i;
          EXPECT_EQ(routing[i].experts, cpu_routing[i].experts) << "record " << i;
          for (size_t k = 0; k < routing[i].weights.size(); ++k) {
            EXPECT_NEAR(routing[i].weights[k], cpu_routing[i].weights[k], 1e-4) << "record " << i;
          }
        }

        const EngineStats s = (*gpu)->stats();
        const uint32_t effective = std::min(chunk, 32u);  // the chunk is capped at max_context
        EXPECT_EQ(s.prefill_tokens, n);
        EXPECT_EQ(s.tokens, n);
        EXPECT_EQ(s.prefill_chunks, (n + effective - 1) / effective);
        EXPECT_EQ(s.prefill_experts, chunk_experts(cpu_routing, effective, n));
        EXPECT_EQ(s.experts_used, s.prefill_experts);
        EXPECT_GT(s.prefill_ns, 0u);
        if (chunk == 1) {
          EXPECT_EQ(s.prefill_experts, gpu_experts_used);
        }
        if (chunk == 512) {
          EXPECT_LT(s.prefill_experts, gpu_experts_used);
        }
        if ((*gpu)->vram_slots() > 0) {
          EXPECT_EQ(s.vram_hits + s.vram_misses, s.experts_used);
        }
        std::printf(
            "[ %s %s chunk %u ] prefill vs CPU %.3e, vs GPU decode %.3e; experts acquired %llu "
            "(token by token %llu); vram hits %llu misses %llu\n",
            name.c_str(), label, chunk, err_cpu, err_gpu,
            static_cast<unsigned long long>(s.prefill_experts),
            static_cast<unsigned long long>(gpu_experts_used),
            static_cast<unsigned long long>(s.vram_hits),
            static_cast<unsigned long long>(s.vram_misses));
        EXPECT_EQ(c.session->holds(), 0u) << "prefill gives every hold back";

        // Greedy continuation from the prefilled cache: the CPU engine's tokens.
        std::vector<uint32_t> greedy;
        for (uint32_t i = 0; i < gen; ++i) {
          greedy.push_back(argmax(l));
          st = (*gpu)->decode(greedy.back(), l);
          ASSERT_TRUE(st) << st.error().message;
        }
        EXPECT_EQ(greedy, cpu_greedy);

        // truncate: back to position 7 (inside the prompt), then the rest of the prompt token by
        // token gives the fresh sequence's last logits; then back to 4 and prefill the rest.
        EXPECT_FALSE((*gpu)->truncate(n + gen + 1));
        EXPECT_EQ((*gpu)->position(), n + gen);
        ASSERT_TRUE((*gpu)->truncate(7));
        EXPECT_EQ((*gpu)->position(), 7u);
        for (uint32_t t = 7; t < n; ++t) {
          st = (*gpu)->decode(prompt[t], l);
          ASSERT_TRUE(st) << st.error().message;
          EXPECT_LE(test::rel_err(l.data(), cpu_logits[t].data(), vocab), 1e-3)
              << "after truncate(7), position " << t;
        }
        ASSERT_TRUE((*gpu)->truncate(4));
        st = (*gpu)->prefill(std::span<const uint32_t>(prompt).subspan(4), l);
        ASSERT_TRUE(st) << st.error().message;
        EXPECT_EQ((*gpu)->position(), n);
        EXPECT_LE(test::rel_err(l.data(), cpu_logits.back().data(), vocab), 1e-3)
            << "truncate(4) and prefill of the rest";
        (*gpu)->reset();
        EXPECT_EQ(c.session->holds(), 0u) << "every hold is given back";
      }
    }
  }
  const std::string log = d.log();
  EXPECT_EQ(d.stop(), 0) << log;
}

// Benchmark mode: the script's routes replace the router in prefill as in decode; a prompt
// longer than one chunk crosses chunk boundaries.
TEST(GpuEngine, PrefillFollowsARoutingScriptLikeDecode) {
  REQUIRE_GPU();
  const TinyFixture fx = TinyFixture::load();
  auto model = DenseModel::load(fx.gguf("f32"));
  ASSERT_TRUE(model) << model.error().message;
  const ModelParams& p = model->params();
  const uint32_t n = static_cast<uint32_t>(fx.tokens.size());
  RoutingScript script(n, p.n_layer);
  for (uint32_t t = 0; t < n; ++t) {
    for (uint32_t l = 0; l < p.n_layer; ++l) {
      ASSERT_TRUE(
          script.set(t, l, ScriptedRoute{{(t + l) % 8, (t * 3 + l + 1) % 8}, {0.7f, 0.3f}, {}}, p));
    }
  }
  EngineOptions o{32, 0, 0, &script, HintSource::Script};
  o.prefill_chunk = 5;
  auto fs1 = test::FileExpertSource::open(*model);
  auto fs2 = test::FileExpertSource::open(*model);
  ASSERT_TRUE(fs1 && fs2);
  auto cpu = CpuEngine::create(*model, **fs1, o);
  ASSERT_TRUE(cpu);
  auto gpu = GpuEngine::create(*model, **fs2, o, tier(GpuOptions::Tier::Experts, 4));
  ASSERT_TRUE(gpu) << gpu.error().message;
  std::vector<RoutingRecord> rc;
  std::vector<RoutingRecord> rg;
  (*cpu)->set_routing_log(&rc);
  (*gpu)->set_routing_log(&rg);
  std::vector<float> a(fx.vocab);
  std::vector<float> b(fx.vocab);
  for (const uint32_t t : fx.tokens) ASSERT_TRUE((*cpu)->decode(t, a));
  auto st = (*gpu)->prefill(fx.tokens, b);
  ASSERT_TRUE(st) << st.error().message;
  EXPECT_LE(test::rel_err(b.data(), a.data(), a.size()), 1e-3);
  ASSERT_EQ(rc.size(), rg.size());
  for (size_t i = 0; i < rc.size(); ++i) {
    EXPECT_EQ(rg[i].token, rc[i].token);
    EXPECT_EQ(rg[i].layer, rc[i].layer);
    EXPECT_EQ(rg[i].experts, rc[i].experts);
    EXPECT_EQ(rg[i].weights, rc[i].weights);
  }
  EXPECT_EQ((*gpu)->stats().scripted_routes, uint64_t{n} * p.n_layer);
  EXPECT_EQ((*gpu)->stats().prefill_chunks, (n + 4) / 5);
  EXPECT_EQ((*fs2)->gets(), (*fs2)->releases());
}

// --- deepseek4 (Ds4GpuEngine) ------------------------------------------------------------------

struct Ds4Fixture {
  std::vector<uint32_t> tokens;
  uint32_t prompt = 0;
  uint32_t vocab = 0;

  static Ds4Fixture load() {
    const nlohmann::json meta = test::read_json(test::fixture_path("deepseek4-tiny/fixture.json"));
    Ds4Fixture f;
    f.tokens = meta.at("tokens").get<std::vector<uint32_t>>();
    f.prompt = meta.at("prompt_tokens").get<uint32_t>();
    f.vocab = meta.at("logits_shape").at(1).get<uint32_t>();
    return f;
  }
  static std::string gguf(const std::string& variant) {
    return test::fixture_path("deepseek4-tiny/model-" + variant + ".gguf");
  }
  // The mxfp4 file holds the f32 file's numbers (its f32 experts are the mxfp4 ones expanded).
  static std::string reference(const std::string& variant) {
    return variant == "q8_0" ? "q8_0" : "f32";
  }
};

// GpuEngine stays the qwen3moe engine: it refuses deepseek4 by name, device or not.
TEST(Ds4GpuEngine, GpuEngineRefusesDeepseek4AndTheFactoryPicksTheDs4Engine) {
  auto model = DenseModel::load(Ds4Fixture::gguf("f32"));
  ASSERT_TRUE(model) << model.error().message;
  auto source = test::FileExpertSource::open(*model);
  ASSERT_TRUE(source);
  auto refused = GpuEngine::create(*model, **source, EngineOptions{16, 0, 0},
                                   tier(GpuOptions::Tier::Experts, 8));
  ASSERT_FALSE(refused);
  EXPECT_NE(
      refused.error().message.find(
          "GpuEngine runs qwen3moe (Qwen3-MoE), llama (Mixtral), gpt-oss, glm4moe (GLM-4.5), not "
          "'deepseek4'"),
      std::string::npos)
      << refused.error().message;
  expect_factory_picks(*model, **source, "deepseek4");
}

// The fixture token by token through a VRAM tier that evicts (8 slots for 5 layers x 16 experts)
// and one that holds every expert: logits against transformers, greedy tokens, the routing
// against the fixture's trace, then reset() and the first positions again.
TEST(Ds4GpuEngine, TinyFixtureLogitsRoutingAndGreedyTokensMatchTransformers) {
  REQUIRE_GPU();
  const Ds4Fixture fx = Ds4Fixture::load();
  for (const auto& [variant, tol] :
       {std::pair{"f32", 1e-3}, std::pair{"mxfp4", 1e-3}, std::pair{"q8_0", 2e-2}}) {
    for (const uint64_t slots : {8u, 80u}) {
      SCOPED_TRACE(fmt::format("{} tier {}", variant, slots));
      // As expert-run loads it for a CUDA engine: the matrices stay in the file until uploaded.
      auto model = DenseModel::load(Ds4Fixture::gguf(variant), DenseLoad::Deferred);
      ASSERT_TRUE(model) << model.error().message;
      const ModelParams& p = model->params();
      auto source = test::FileExpertSource::open(*model);
      ASSERT_TRUE(source) << source.error().message;
      auto engine = Ds4GpuEngine::create(*model, **source, EngineOptions{64, 0, 0},
                                         tier(GpuOptions::Tier::Experts, slots));
      ASSERT_TRUE(engine) << engine.error().message;
      EXPECT_EQ((*engine)->vram_slots(), slots);
      std::vector<RoutingRecord> routing;
      (*engine)->set_routing_log(&routing);
      const std::vector<float> expected = test::read_f32(
          test::fixture_path("deepseek4-tiny/logits-" + Ds4Fixture::reference(variant) + ".bin"));
      ASSERT_EQ(expected.size(), fx.tokens.size() * fx.vocab);
      std::vector<float> logits(fx.vocab);
      double worst = 0.0;
      for (size_t t = 0; t < fx.tokens.size(); ++t) {
        auto st = (*engine)->decode(fx.tokens[t], logits);
        ASSERT_TRUE(st) << st.error().message;
        const double err = test::rel_err(logits.data(), expected.data() + t * fx.vocab, fx.vocab);
        EXPECT_LE(err, tol) << "position " << t;
        worst = std::max(worst, err);
        if (t + 1 >= fx.prompt && t + 1 < fx.tokens.size() && std::string(variant) != "q8_0") {
          const auto best = std::max_element(logits.begin(), logits.end()) - logits.begin();
          EXPECT_EQ(static_cast<uint32_t>(best), fx.tokens[t + 1]) << "position " << t;
        }
      }
      std::printf(
          "[ %s tier %llu ] deepseek4 GPU logits vs transformers: max relative error "
          "%.3e over %zu positions\n",
          variant, static_cast<unsigned long long>(slots), worst, fx.tokens.size());
      const std::vector<test::TraceEntry> trace = test::read_trace(
          test::fixture_path("deepseek4-tiny/trace-" + Ds4Fixture::reference(variant) + ".jsonl"));
      ASSERT_EQ(routing.size(), trace.size());
      for (size_t i = 0; i < trace.size(); ++i) {
        EXPECT_EQ(routing[i].token, trace[i].token);
        EXPECT_EQ(routing[i].layer, trace[i].layer);
        EXPECT_EQ(routing[i].experts, trace[i].experts) << "record " << i;
        for (size_t k = 0; k < trace[i].weights.size(); ++k) {
          EXPECT_NEAR(routing[i].weights[k], trace[i].weights[k], 1e-4) << "record " << i;
        }
      }
      const EngineStats& s = (*engine)->stats();
      EXPECT_EQ(s.experts_used, fx.tokens.size() * p.n_layer * p.n_expert_used);
      EXPECT_EQ(s.vram_hits + s.vram_misses, s.experts_used);
      if (slots == 8) {
        EXPECT_GT(s.vram_misses, 80u);  // a tier this small evicts
      }

      (*engine)->reset();
      EXPECT_EQ((*engine)->position(), 0u);
      for (size_t t = 0; t < 20; ++t) {
        auto st = (*engine)->decode(fx.tokens[t], logits);
        ASSERT_TRUE(st) << st.error().message;
        EXPECT_LE(test::rel_err(logits.data(), expected.data() + t * fx.vocab, fx.vocab), tol)
            << "after reset, position " << t;
      }
      EXPECT_EQ((*source)->gets(), (*source)->releases());
    }
  }
}

// The GPU engine against the CPU engine on the same file, with router lookahead (depth 2): the
// logits, the routing records, the hints the source received (the exact hash-layer hints before
// layer 0, then the lookahead's) and the counters.
TEST(Ds4GpuEngine, MatchesTheCpuEngineOnTheSameFile) {
  REQUIRE_GPU();
  const Ds4Fixture fx = Ds4Fixture::load();
  for (const char* variant : {"f32", "mxfp4", "q8_0"}) {
    SCOPED_TRACE(variant);
    auto model = DenseModel::load(Ds4Fixture::gguf(variant));
    ASSERT_TRUE(model) << model.error().message;
    auto fs_cpu = test::FileExpertSource::open(*model);
    auto fs_gpu = test::FileExpertSource::open(*model);
    ASSERT_TRUE(fs_cpu && fs_gpu);
    const EngineOptions o{64, 2, 0};
    auto cpu = Ds4CpuEngine::create(*model, **fs_cpu, o);
    ASSERT_TRUE(cpu) << cpu.error().message;
    auto gpu = Ds4GpuEngine::create(*model, **fs_gpu, o, tier(GpuOptions::Tier::Experts, 12));
    ASSERT_TRUE(gpu) << gpu.error().message;
    std::vector<RoutingRecord> rc;
    std::vector<RoutingRecord> rg;
    (*cpu)->set_routing_log(&rc);
    (*gpu)->set_routing_log(&rg);
    std::vector<float> a(fx.vocab);
    std::vector<float> b(fx.vocab);
    double worst = 0.0;
    for (size_t t = 0; t < fx.tokens.size(); ++t) {
      ASSERT_TRUE((*cpu)->decode(fx.tokens[t], a));
      auto st = (*gpu)->decode(fx.tokens[t], b);
      ASSERT_TRUE(st) << st.error().message;
      const double err = test::rel_err(b.data(), a.data(), fx.vocab);
      EXPECT_LE(err, 1e-3) << "position " << t;
      worst = std::max(worst, err);
    }
    std::printf("[ %s ] deepseek4 GPU vs CPU engine: max relative error %.3e\n", variant, worst);
    ASSERT_EQ(rc.size(), rg.size());
    for (size_t i = 0; i < rc.size(); ++i) {
      EXPECT_EQ(rg[i].experts, rc[i].experts) << "record " << i;
      EXPECT_EQ(rg[i].predicted, rc[i].predicted) << "record " << i;
      for (size_t k = 0; k < rc[i].weights.size(); ++k) {
        EXPECT_NEAR(rg[i].weights[k], rc[i].weights[k], 1e-5) << "record " << i;
      }
    }
    expect_cpu_hints_less_the_tiers((*fs_cpu)->hints(), (*fs_gpu)->hints());
    const EngineStats& sc = (*cpu)->stats();
    const EngineStats& sg = (*gpu)->stats();
    EXPECT_EQ(sg.hash_hints, sc.hash_hints);
    EXPECT_GT(sg.hash_hints, 0u);
    EXPECT_EQ(sg.hints_sent, sc.hints_sent);
    EXPECT_EQ(sg.hash_experts, sc.hash_experts);
    EXPECT_EQ(sg.learned_experts, sc.learned_experts);
    EXPECT_EQ(sg.experts_used, sc.experts_used);
    EXPECT_DOUBLE_EQ(sg.prefetch_precision(), sc.prefetch_precision());
    EXPECT_DOUBLE_EQ(sg.prefetch_recall(), sc.prefetch_recall());
    EXPECT_EQ((*fs_gpu)->gets(), (*fs_gpu)->releases());
  }
}

// Through a real expertd: in place (the kernels read the registered arena), a VRAM tier that
// evicts, and one that holds every expert with prefetch; each gives the CPU engine's logits and
// routing on the same daemon, and gives every hold back.
TEST(Ds4GpuEngine, DaemonModesMatchTheCpuEngine) {
  REQUIRE_GPU();
  const Ds4Fixture fx = Ds4Fixture::load();
  TempDir dir;
  const std::string sock = dir.path() + "/expertd.sock";
  Daemon d(dir.path(), {"--model", "v4-f32=" + Ds4Fixture::gguf("f32"), "--model",
                        "v4-mxfp4=" + Ds4Fixture::gguf("mxfp4"), "--model",
                        "v4-q8_0=" + Ds4Fixture::gguf("q8_0"), "--socket", sock, "--cache", "16MiB",
                        "--no-mlock"});
  ASSERT_TRUE(d.start());
  const size_t n = 24;
  for (const char* variant : {"f32", "mxfp4", "q8_0"}) {
    const std::string name = std::string("v4-") + variant;
    auto model = DenseModel::load(Ds4Fixture::gguf(variant));
    ASSERT_TRUE(model) << model.error().message;
    std::vector<std::vector<float>> ref;
    std::vector<RoutingRecord> ref_routing;
    {
      auto client = client::Client::connect(sock);
      ASSERT_TRUE(client);
      auto session = (*client)->attach(name, "gpu_engine_tests");
      ASSERT_TRUE(session);
      auto source = DaemonExpertSource::create(**session, *model);
      ASSERT_TRUE(source) << source.error().message;
      auto cpu = Ds4CpuEngine::create(*model, **source, EngineOptions{32, 0, 0});
      ASSERT_TRUE(cpu);
      (*cpu)->set_routing_log(&ref_routing);
      std::vector<float> l(fx.vocab);
      for (size_t i = 0; i < n; ++i) {
        ASSERT_TRUE((*cpu)->decode(fx.tokens[i], l));
        ref.push_back(l);
      }
    }
    for (const auto& [label, g, depth] :
         {std::tuple{"in-place", tier(GpuOptions::Tier::InPlace), 0u},
          std::tuple{"in-place+prefetch", tier(GpuOptions::Tier::InPlace), 2u},
          std::tuple{"tier-3", tier(GpuOptions::Tier::Experts, 3), 0u},
          std::tuple{"tier-all+prefetch", tier(GpuOptions::Tier::Experts, 80), 2u}}) {
      SCOPED_TRACE(name + " " + label);
      auto client = client::Client::connect(sock);
      ASSERT_TRUE(client);
      auto session = (*client)->attach(name, "gpu_engine_tests");
      ASSERT_TRUE(session);
      auto source = DaemonExpertSource::create(**session, *model);
      ASSERT_TRUE(source) << source.error().message;
      auto gpu = Ds4GpuEngine::create(*model, **source, EngineOptions{32, depth, 0}, g);
      ASSERT_TRUE(gpu) << gpu.error().message;
      std::vector<RoutingRecord> routing;
      (*gpu)->set_routing_log(&routing);
      std::vector<float> l(fx.vocab);
      double worst = 0.0;
      for (size_t i = 0; i < n; ++i) {
        auto st = (*gpu)->decode(fx.tokens[i], l);
        ASSERT_TRUE(st) << st.error().message;
        const double err = test::rel_err(l.data(), ref[i].data(), fx.vocab);
        EXPECT_LE(err, 1e-3) << "position " << i;
        worst = std::max(worst, err);
      }
      ASSERT_EQ(routing.size(), ref_routing.size());
      for (size_t i = 0; i < routing.size(); ++i) {
        EXPECT_EQ(routing[i].experts, ref_routing[i].experts) << "record " << i;
      }
      const EngineStats& s = (*gpu)->stats();
      std::printf(
          "[ %s %s ] deepseek4 max rel err vs CPU %.3e; vram hits %llu misses %llu "
          "prefetched %llu\n",
          name.c_str(), label, worst, static_cast<unsigned long long>(s.vram_hits),
          static_cast<unsigned long long>(s.vram_misses),
          static_cast<unsigned long long>(s.vram_prefetches));
      if ((*gpu)->vram_slots() > 0) {
        EXPECT_EQ(s.vram_hits + s.vram_misses, s.experts_used);
      }
      if ((*gpu)->vram_slots() == 3) {
        EXPECT_GT(s.vram_misses, 10u);
      }
      gpu->reset();
      EXPECT_EQ((*session)->holds(), 0u) << "every hold is given back";
    }
  }
  const std::string log = d.log();
  EXPECT_EQ(d.stop(), 0) << log;
}

// prefill() of the fixture's prompt in chunks of 1, 5 and 512 positions (capped at the context),
// in place and through a 3-slot VRAM tier (it evicts within a chunk's layer), against the CPU
// engine fed token by token on the same daemon: the last position's logits, the routing records,
// the greedy continuation, the counters (each distinct expert of a chunk's layer acquired once,
// fewer than token by token in one chunk), every hold given back.
TEST(Ds4GpuEngine, PrefillMatchesTokenByTokenThroughTheDaemon) {
  REQUIRE_GPU();
  const Ds4Fixture fx = Ds4Fixture::load();
  TempDir dir;
  const std::string sock = dir.path() + "/expertd.sock";
  Daemon d(dir.path(), {"--model", "v4-f32=" + Ds4Fixture::gguf("f32"), "--model",
                        "v4-mxfp4=" + Ds4Fixture::gguf("mxfp4"), "--model",
                        "v4-q8_0=" + Ds4Fixture::gguf("q8_0"), "--socket", sock, "--cache", "16MiB",
                        "--no-mlock"});
  ASSERT_TRUE(d.start());
  const std::vector<uint32_t> prompt(fx.tokens.begin(), fx.tokens.begin() + fx.prompt);
  const uint32_t n = fx.prompt;
  const uint32_t gen = 4;
  const uint32_t ctx = 64;
  for (const char* variant : {"f32", "mxfp4", "q8_0"}) {
    const std::string name = std::string("v4-") + variant;
    const double tol = std::string(variant) == "f32" ? 1e-3 : 2e-2;
    auto model = DenseModel::load(Ds4Fixture::gguf(variant));
    ASSERT_TRUE(model) << model.error().message;
    const ModelParams& p = model->params();

    // The CPU engine token by token: the last logits, the routing, the greedy tokens.
    std::vector<float> cpu_last(fx.vocab);
    std::vector<RoutingRecord> cpu_routing;
    std::vector<uint32_t> cpu_greedy;
    uint64_t cpu_experts_used = 0;
    {
      DaemonConn c = DaemonConn::open(sock, name, *model);
      ASSERT_TRUE(c.source);
      auto cpu = Ds4CpuEngine::create(*model, *c.source, EngineOptions{ctx, 0, 0});
      ASSERT_TRUE(cpu) << cpu.error().message;
      (*cpu)->set_routing_log(&cpu_routing);
      std::vector<float> l(fx.vocab);
      for (const uint32_t t : prompt) ASSERT_TRUE((*cpu)->decode(t, l));
      cpu_last = l;
      cpu_experts_used = (*cpu)->stats().experts_used;
      EXPECT_EQ(cpu_experts_used, uint64_t{n} * p.n_layer * p.n_expert_used);
      (*cpu)->set_routing_log(nullptr);  // the prompt's routing only: prefill's is compared to it
      for (uint32_t i = 0; i < gen; ++i) {
        cpu_greedy.push_back(argmax(l));
        ASSERT_TRUE((*cpu)->decode(cpu_greedy.back(), l));
      }
    }
    std::printf("[ %s ] CPU greedy margin %.3e at the prompt's end\n", variant,
                top2_margin(cpu_last));

    for (const auto& [label, g] : {std::pair{"in-place", tier(GpuOptions::Tier::InPlace)},
                                   std::pair{"tier-3", tier(GpuOptions::Tier::Experts, 3)}}) {
      for (const uint32_t chunk : {1u, 5u, 512u}) {
        SCOPED_TRACE(fmt::format("{} {} chunk {}", name, label, chunk));
        DaemonConn c = DaemonConn::open(sock, name, *model);
        ASSERT_TRUE(c.source);
        EngineOptions o{ctx, 0, 0};
        o.prefill_chunk = chunk;
        auto gpu = Ds4GpuEngine::create(*model, *c.source, o, g);
        ASSERT_TRUE(gpu) << gpu.error().message;
        EXPECT_NE((*gpu)->description().find("prefill in chunks of"), std::string::npos)
            << (*gpu)->description();
        std::vector<RoutingRecord> routing;
        (*gpu)->set_routing_log(&routing);
        std::vector<float> l(fx.vocab);
        auto st = (*gpu)->prefill(prompt, l);
        ASSERT_TRUE(st) << st.error().message;
        EXPECT_EQ((*gpu)->position(), n);
        for (const float v : l) ASSERT_TRUE(std::isfinite(v));
        const double err = test::rel_err(l.data(), cpu_last.data(), fx.vocab);
        EXPECT_LE(err, tol);

        // The routing, in decode's order (position-major).
        ASSERT_EQ(routing.size(), cpu_routing.size());
        for (size_t i = 0; i < routing.size(); ++i) {
          EXPECT_EQ(routing[i].token, cpu_routing[i].token) << "record " << i;
          EXPECT_EQ(routing[i].layer, cpu_routing[i].layer) << "record " << i;
          EXPECT_EQ(routing[i].experts, cpu_routing[i].experts) << "record " << i;
        }

        const EngineStats s = (*gpu)->stats();
        const uint32_t effective = std::min(chunk, ctx);
        EXPECT_EQ(s.prefill_tokens, n);
        EXPECT_EQ(s.tokens, n);
        EXPECT_EQ(s.prefill_chunks, (n + effective - 1) / effective);
        EXPECT_EQ(s.prefill_experts, chunk_experts(cpu_routing, effective, n));
        EXPECT_EQ(s.experts_used, s.prefill_experts);
        EXPECT_EQ(s.hash_experts + s.learned_experts, s.experts_used);
        EXPECT_GT(s.prefill_ns, 0u);
        if (chunk == 1) {
          EXPECT_EQ(s.prefill_experts, cpu_experts_used);
        }
        if (chunk == 512) {
          EXPECT_LT(s.prefill_experts, cpu_experts_used);
        }
        if ((*gpu)->vram_slots() > 0) {
          EXPECT_EQ(s.vram_hits + s.vram_misses, s.experts_used);
        }
        std::printf(
            "[ %s %s chunk %u ] deepseek4 prefill vs CPU token by token %.3e; experts acquired "
            "%llu (token by token %llu); vram hits %llu misses %llu\n",
            name.c_str(), label, chunk, err, static_cast<unsigned long long>(s.prefill_experts),
            static_cast<unsigned long long>(cpu_experts_used),
            static_cast<unsigned long long>(s.vram_hits),
            static_cast<unsigned long long>(s.vram_misses));
        EXPECT_EQ(c.session->holds(), 0u) << "prefill gives every hold back";

        // Greedy continuation from the prefilled state: the CPU engine's tokens.
        std::vector<uint32_t> greedy;
        for (uint32_t i = 0; i < gen; ++i) {
          greedy.push_back(argmax(l));
          st = (*gpu)->decode(greedy.back(), l);
          ASSERT_TRUE(st) << st.error().message;
        }
        EXPECT_EQ(greedy, cpu_greedy);
        (*gpu)->reset();
        EXPECT_EQ(c.session->holds(), 0u) << "every hold is given back";
      }
    }
  }
  const std::string log = d.log();
  EXPECT_EQ(d.stop(), 0) << log;
}

// Where two logit vectors differ: how many entries, the largest |a - b| and its index.
struct LogitDiff {
  size_t count = 0;
  float max_abs = 0.0f;
  size_t at = 0;
};
LogitDiff logit_diff(const std::vector<float>& a, const std::vector<float>& b) {
  LogitDiff d;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (a[i] == b[i]) continue;
    ++d.count;
    const float abs = std::fabs(a[i] - b[i]);
    if (!(abs <= d.max_abs)) {  // NaN counts as the largest
      d.max_abs = abs;
      d.at = i;
    }
  }
  return d;
}

// Prefix reuse on the device (Ds4Forward.TruncateToAnyPositionGivesTheLogitsOfAFreshRun's twin):
// truncate(n) restores the last checkpoint at or before n (prefill chunk ends, every
// kCheckpointEvery decoded positions, the last cut) and feeds the rest again through prefill. Cuts
// at a checkpoint, between two, in the middle of a compressor's window (ratios 4 and 8) and of the
// sliding window (8), and at 0, each followed by three decoded positions; the run, the cuts and
// their refed counts are the CPU test's (ds4_truncate_cuts.h: the same checkpoints). The GPU's
// prefill is not decode() to the bit (its routed experts run as dequantised f32 cuBLAS GEMMs,
// decode's as fused matvecs on the encoded bytes), so the logits after a cut are compared to the
// bit with a fresh engine fed the same positions through the same calls (the prefill chunks and
// decodes that made the cut engine's state; the kernels are deterministic), and within prefill's
// tolerance (f32 1e-3, q8_0 2e-2, as PrefillMatchesTokenByTokenThroughTheDaemon) with a run that
// decoded every position.
TEST(Ds4GpuEngine, TruncateToAnyPositionGivesTheLogitsOfAFreshRun) {
  REQUIRE_GPU();
  for (const auto& [variant, tol] : {std::pair{"f32", 1e-3}, std::pair{"q8_0", 2e-2}}) {
    SCOPED_TRACE(variant);
    auto model = DenseModel::load(Ds4Fixture::gguf(variant));
    ASSERT_TRUE(model) << model.error().message;
    const uint32_t vocab = model->params().n_vocab;
    constexpr uint32_t kTokens = test::kDs4CutTokens;
    constexpr uint32_t kPrompt = test::kDs4CutPrompt;
    constexpr uint32_t kChunk = test::kDs4CutChunk;
    std::vector<uint32_t> ids(kTokens);
    for (uint32_t i = 0; i < kTokens; ++i) ids[i] = (i * 37 + 11) % vocab;
    EngineOptions o{kTokens + 8, 1, 0};
    o.prefill_chunk = kChunk;

    // The reference engine: first every position decoded once (each one's logits kept), then,
    // after each cut, reset and fed again as the cut engine was.
    auto ref_source = test::FileExpertSource::open(*model);
    ASSERT_TRUE(ref_source) << ref_source.error().message;
    auto ref = Ds4GpuEngine::create(*model, **ref_source, o, tier(GpuOptions::Tier::Experts, 80));
    ASSERT_TRUE(ref) << ref.error().message;
    std::vector<std::vector<float>> want(kTokens, std::vector<float>(vocab));
    for (uint32_t t = 0; t < kTokens; ++t) {
      auto st = (*ref)->decode(ids[t], want[t]);
      ASSERT_TRUE(st) << "position " << t << ": " << st.error().message;
    }

    // How the cut engine's state at each position was made: a call starts at t when begin[t]
    // (a prefill chunk running to the next begin when prefilled[t], else decode(ids[t])).
    std::vector<uint8_t> begin(kTokens + 1, 0);
    std::vector<uint8_t> prefilled(kTokens, 0);
    auto mark_prefill = [&](uint32_t from, uint32_t to) {
      for (uint32_t t = from; t < to; ++t) {
        prefilled[t] = 1;
        begin[t] = (t - from) % kChunk == 0;
      }
      begin[to] = 1;
    };
    auto mark_decode = [&](uint32_t t) {
      prefilled[t] = 0;
      begin[t] = begin[t + 1] = 1;
    };

    auto source = test::FileExpertSource::open(*model);
    ASSERT_TRUE(source) << source.error().message;
    auto made = Ds4GpuEngine::create(*model, **source, o, tier(GpuOptions::Tier::Experts, 80));
    ASSERT_TRUE(made) << made.error().message;
    Ds4GpuEngine& eng = **made;
    std::vector<float> logits(vocab);
    auto st = eng.prefill(std::span<const uint32_t>(ids.data(), kPrompt), logits);
    ASSERT_TRUE(st) << st.error().message;
    mark_prefill(0, kPrompt);
    EXPECT_LE(test::rel_err(logits.data(), want[kPrompt - 1].data(), vocab), tol);
    for (uint32_t t = kPrompt; t < test::kDs4CutDecoded; ++t) {
      st = eng.decode(ids[t], logits);
      ASSERT_TRUE(st) << "position " << t << ": " << st.error().message;
      mark_decode(t);
    }
    EXPECT_FALSE(eng.truncate(test::kDs4CutDecoded + 1)) << "past the position";
    EXPECT_EQ(eng.position(), test::kDs4CutDecoded);
    EXPECT_TRUE(eng.truncate(test::kDs4CutDecoded)) << "at the position";
    EXPECT_EQ(eng.refed_positions(), 0u);

    std::vector<float> fresh(vocab);
    std::vector<float> scratch(vocab);
    double worst = 0.0;
    for (const test::Ds4Cut& c : test::kDs4Cuts) {
      SCOPED_TRACE(fmt::format("cut at {}", c.n));
      const uint64_t before = eng.refed_positions();
      ASSERT_TRUE(eng.truncate(c.n));
      EXPECT_EQ(eng.position(), c.n);
      const uint64_t refed = eng.refed_positions() - before;
      EXPECT_EQ(refed, c.refed);
      ASSERT_LE(refed, c.n);
      const auto from = static_cast<uint32_t>(c.n - refed);
      mark_prefill(from, c.n);

      // The fresh engine, fed [0, n) through the calls that made the cut engine's state.
      (*ref)->reset();
      for (uint32_t t = 0; t < c.n;) {
        uint32_t end = t + 1;
        while (end < c.n && !begin[end]) ++end;
        if (prefilled[t]) {
          st = (*ref)->prefill(std::span<const uint32_t>(ids.data() + t, end - t), scratch);
        } else {
          st = (*ref)->decode(ids[t], scratch);
        }
        ASSERT_TRUE(st) << "fresh run, position " << t << ": " << st.error().message;
        t = end;
      }
      ASSERT_EQ((*ref)->position(), c.n);

      for (uint32_t t = c.n; t < c.n + 3; ++t) {
        st = eng.decode(ids[t], logits);
        ASSERT_TRUE(st) << "position " << t << ": " << st.error().message;
        mark_decode(t);
        st = (*ref)->decode(ids[t], fresh);
        ASSERT_TRUE(st) << "fresh run, position " << t << ": " << st.error().message;
        const LogitDiff d = logit_diff(logits, fresh);
        EXPECT_EQ(d.count, 0u) << fmt::format(
            "cut at {} (re-fed from {}), position {}: {} of {} logits differ from a fresh run's, "
            "max |diff| {:.3e} at {} ({} vs {})",
            c.n, from, t, d.count, vocab, d.max_abs, d.at, logits[d.at], fresh[d.at]);
        const double err = test::rel_err(logits.data(), want[t].data(), vocab);
        EXPECT_LE(err, tol) << "cut at " << c.n << ", position " << t << " against decode()";
        worst = std::max(worst, err);
      }
    }
    std::printf(
        "[ %s ] deepseek4 GPU truncate: %llu positions re-fed over %zu cuts; max relative error "
        "against decode() %.3e\n",
        variant, static_cast<unsigned long long>(eng.refed_positions()), std::size(test::kDs4Cuts),
        worst);
    EXPECT_EQ((*source)->gets(), (*source)->releases());
    EXPECT_EQ((*ref_source)->gets(), (*ref_source)->releases());
  }
}

// --- Mixtral (`llama` with routed experts: no q/k norms, NORM RoPE) -----------------------------

// The mixtral-tiny fixture (llama.cpp's converter made it) token by token through a VRAM tier that
// evicts (4 slots for 3 layers x 8 experts) and one that holds every expert: logits against
// transformers, routing against its trace, then the prompt as one prefill and transformers' greedy
// tokens.
TEST(MixtralGpuEngine, TinyFixtureLogitsRoutingAndGreedyTokensMatchTransformers) {
  REQUIRE_GPU();
  expect_tiny_fixture_on_gpu<test::MixtralFixture>("mixtral", 4, 24, 24);
}

// Through a real expertd, in place and with a VRAM tier plus router lookahead: the GPU engine gives
// the CPU engine's logits and routing on the same daemon and gives every hold back.
TEST(MixtralGpuEngine, ThroughExpertdMatchesTheCpuEngine) {
  REQUIRE_GPU();
  expect_gpu_matches_cpu_through_expertd(test::MixtralFixture::load(), "mixtral");
}

// --- GLM-4.5 (`glm4moe`: q/k/v biases, q/k norms, partial NEOX RoPE, a dense first layer,
// DeepSeek-V3's sigmoid routing with a selection bias, a shared expert, the MTP block skipped) ---

// create_gpu_engine takes glm4moe to GpuEngine (expert-run and expert-serve use it when a device is
// present); without a device it gives the device's error, not a refusal of the architecture.
TEST(Glm4MoeGpuEngine, TheFactoryPicksTheCudaEngineForGlm45) {
  auto model = DenseModel::load(test::Glm4MoeFixture::gguf("q8_0"), DenseLoad::Deferred);
  ASSERT_TRUE(model) << model.error().message;
  auto source = test::FileExpertSource::open(*model);
  ASSERT_TRUE(source);
  expect_factory_picks(*model, **source, "dense MLPs and shared experts as in the file");
}

// The glm4moe-tiny fixture token by token through a VRAM tier that evicts (4 slots, top-4 of 16
// experts on 2 sparse layers) and one that holds every expert: logits against transformers,
// routing and weights against its trace, then the prompt as one prefill and transformers' greedy
// tokens.
TEST(Glm4MoeGpuEngine, TinyFixtureLogitsRoutingAndGreedyTokensMatchTransformers) {
  REQUIRE_GPU();
  expect_tiny_fixture_on_gpu<test::Glm4MoeFixture>("glm4moe", 4, 48, 32);
}

// The GPU engine against the CPU engine on the same file with router lookahead (depth 2, from the
// dense layer too): logits, routing records, the hints the source received (less the VRAM
// tier's) and the counters; then prefill() against decode() on the GPU.
TEST(Glm4MoeGpuEngine, MatchesTheCpuEngineOnTheSameFile) {
  REQUIRE_GPU();
  const test::Glm4MoeFixture fx = test::Glm4MoeFixture::load();
  for (const char* variant : {"f32", "q8_0"}) {
    SCOPED_TRACE(variant);
    const std::string gguf = test::Glm4MoeFixture::gguf(variant);
    expect_gpu_matches_cpu_on_file(gguf, fx.tokens, fmt::format("glm4moe {}", variant));
    expect_prefill_is_decode(gguf, fx.tokens);
  }
}

// Through a real expertd, in place and with a VRAM tier plus router lookahead: the GPU engine gives
// the CPU engine's logits and routing on the same daemon and gives every hold back.
TEST(Glm4MoeGpuEngine, ThroughExpertdMatchesTheCpuEngine) {
  REQUIRE_GPU();
  expect_gpu_matches_cpu_through_expertd(test::Glm4MoeFixture::load(), "glm");
}

// --- gpt-oss (biases on q/k/v/o, router and experts; attention sinks; a sliding window on even
// layers; the softmax over the top-k logits; the clamped SwiGLU; YaRN) ----------------------------

// create_gpu_engine takes gpt-oss to GpuEngine; without a device it gives the device's error.
TEST(GptOssGpuEngine, TheFactoryPicksTheCudaEngineForGptOss) {
  auto model = DenseModel::load(test::GptOssFixture::gguf("mxfp4"), DenseLoad::Deferred);
  ASSERT_TRUE(model) << model.error().message;
  auto source = test::FileExpertSource::open(*model);
  ASSERT_TRUE(source);
  expect_factory_picks(*model, **source, "layer by layer");
}

// The gptoss-tiny fixture (window 8 under a 41-token prompt, non-zero sinks and biases, clamped
// SwiGLU inputs; MXFP4 experts and the same values in f32, one set of transformers' logits)
// token by token through a 4-slot tier (4 layers x 8 experts, top-2) and one holding every expert:
// logits within 1e-3 of transformers' for both files, routing against the trace, then the prompt
// as one prefill and the greedy tokens.
TEST(GptOssGpuEngine, TinyFixtureLogitsRoutingAndGreedyTokensMatchTransformers) {
  REQUIRE_GPU();
  expect_tiny_fixture_on_gpu<test::GptOssFixture>("gpt-oss", 4, 32, 32,
                                                  {{"f32", 1e-3}, {"mxfp4", 1e-3}});
}

// The GPU engine against the CPU engine on the same file with router lookahead (depth 2): logits,
// routing, hints less the tier's, counters; then prefill() against decode() on the GPU.
TEST(GptOssGpuEngine, MatchesTheCpuEngineOnTheSameFile) {
  REQUIRE_GPU();
  const test::GptOssFixture fx = test::GptOssFixture::load();
  for (const char* variant : {"f32", "mxfp4"}) {
    SCOPED_TRACE(variant);
    const std::string gguf = test::GptOssFixture::gguf(variant);
    expect_gpu_matches_cpu_on_file(gguf, fx.tokens, fmt::format("gpt-oss {}", variant));
    expect_prefill_is_decode(gguf, fx.tokens);
  }
}

// Through a real expertd (the MXFP4 file), in place and with a tier plus prefetch.
TEST(GptOssGpuEngine, ThroughExpertdMatchesTheCpuEngine) {
  REQUIRE_GPU();
  expect_gpu_matches_cpu_through_expertd(test::GptOssFixture::load(), "gptoss", "mxfp4");
}

// --- deepseek2 (Ds3GpuEngine) ------------------------------------------------------------------

std::string ds3_path(const std::string& file) {
  return test::fixture_path("deepseek3-tiny/" + file);
}

// The deepseek3-tiny fixtures against transformers (logits, routing, greedy tokens), with a VRAM
// tier that evicts and one that holds every expert; reset() starts the sequence again.
TEST(Ds3GpuEngine, TinyFixtureLogitsRoutingAndGreedyTokensMatchTransformers) {
  REQUIRE_GPU();
  const nlohmann::json meta = test::read_json(ds3_path("fixture.json"));
  const auto tokens = meta.at("tokens").get<std::vector<uint32_t>>();
  const uint32_t prompt = meta.at("prompt_tokens").get<uint32_t>();
  for (const auto& [variant, tol] : {std::pair{"f32", 1e-3}, std::pair{"q8_0", 2e-2}}) {
    for (const uint64_t slots : {6u, 40u}) {
      SCOPED_TRACE(fmt::format("{} tier {}", variant, slots));
      auto model =
          DenseModel::load(ds3_path(fmt::format("model-{}.gguf", variant)), DenseLoad::Deferred);
      ASSERT_TRUE(model) << model.error().message;
      const ModelParams& p = model->params();
      auto source = test::FileExpertSource::open(*model);
      ASSERT_TRUE(source) << source.error().message;
      auto engine = create_gpu_engine(*model, **source, EngineOptions{64, 0, 0},
                                      tier(GpuOptions::Tier::Experts, slots));
      ASSERT_TRUE(engine) << engine.error().message;
      EXPECT_EQ((*engine)->name(), "gpu");
      std::vector<RoutingRecord> routing;
      (*engine)->set_routing_log(&routing);
      const std::vector<float> expected =
          test::read_f32(ds3_path(fmt::format("logits-{}.bin", variant)));
      const auto greedy = std::string(variant) == "f32"
                              ? tokens
                              : meta.at("greedy_q8_0").get<std::vector<uint32_t>>();
      const uint32_t vocab = p.n_vocab;
      std::vector<float> logits(vocab);
      double worst = 0.0;
      for (size_t t = 0; t < tokens.size(); ++t) {
        auto st = (*engine)->decode(tokens[t], logits);
        ASSERT_TRUE(st) << st.error().message;
        const double err = test::rel_err(logits.data(), expected.data() + t * vocab, vocab);
        EXPECT_LE(err, tol) << "position " << t;
        worst = std::max(worst, err);
        if (t + 1 >= prompt && t + 1 < greedy.size()) {
          const auto best = std::max_element(logits.begin(), logits.end()) - logits.begin();
          EXPECT_EQ(static_cast<uint32_t>(best), greedy[t + 1]) << "position " << t;
        }
      }
      std::printf(
          "[ %s tier %llu ] deepseek3 GPU logits vs transformers: max relative error "
          "%.3e over %zu positions\n",
          variant, static_cast<unsigned long long>(slots), worst, tokens.size());
      const std::vector<test::TraceEntry> trace =
          test::read_trace(ds3_path(fmt::format("trace-{}.jsonl", variant)));
      ASSERT_EQ(routing.size(), trace.size());
      for (size_t i = 0; i < trace.size(); ++i) {
        EXPECT_EQ(routing[i].layer, trace[i].layer);
        EXPECT_EQ(routing[i].experts, trace[i].experts) << "record " << i;
      }
      const EngineStats& s = (*engine)->stats();
      EXPECT_EQ(s.experts_used, tokens.size() * (p.n_layer - p.ds3.dense_lead) * p.n_expert_used);
      EXPECT_EQ(s.vram_hits + s.vram_misses, s.experts_used);
      (*engine)->reset();
      for (size_t t = 0; t < 12; ++t) {
        ASSERT_TRUE((*engine)->decode(tokens[t], logits));
        EXPECT_LE(test::rel_err(logits.data(), expected.data() + t * vocab, vocab), tol)
            << "after reset, position " << t;
      }
      EXPECT_EQ((*source)->gets(), (*source)->releases());
    }
  }
}

// The GPU engine against the CPU engine on the same file with router lookahead (depth 2, from the
// dense layer too): logits, routing records, the hints the source received and the counters.
TEST(Ds3GpuEngine, MatchesTheCpuEngineOnTheSameFile) {
  REQUIRE_GPU();
  const auto tokens =
      test::read_json(ds3_path("fixture.json")).at("tokens").get<std::vector<uint32_t>>();
  for (const char* variant : {"f32", "q8_0"}) {
    SCOPED_TRACE(variant);
    expect_gpu_matches_cpu_on_file(ds3_path(fmt::format("model-{}.gguf", variant)), tokens,
                                   fmt::format("deepseek3 {}", variant));
  }
}

// Prefill in chunks (layer by layer over the chunk, the routed experts grouped by expert as GEMMs,
// issue 24) is decode() of each position: the last logits within 1e-4 and every routing
// decision, through tiers that evict (6 slots) or hold a layer (40). Each chunk counts its
// distinct (layer, expert) pairs once, and every hold goes back.
TEST(Ds3GpuEngine, ChunkedPrefillIsDecodeAndCountsEachExpertOncePerChunk) {
  REQUIRE_GPU();
  const auto tokens =
      test::read_json(ds3_path("fixture.json")).at("tokens").get<std::vector<uint32_t>>();
  auto model = DenseModel::load(ds3_path("model-q8_0.gguf"), DenseLoad::Deferred);
  ASSERT_TRUE(model) << model.error().message;
  // Through VRAM tiers only: a file source has no arena to register for the in-place mode.
  for (const uint64_t slots : {6u, 40u}) {
    for (const uint32_t chunk : {1u, 5u, 64u}) {
      expect_chunked_prefill_is_decode(*model, tokens, chunk, slots);
    }
  }
}

// engine/family.h's CUDA capabilities against the CUDA engines (the CPU ones: family_test.cc):
// which families a CUDA engine runs, which prefill in chunks (each routed expert acquired once per
// chunk and counted) rather than token by token, and which cut their state at any prefix.
TEST(FamilyCuda, TheCudaEnginesDoWhatTheRegistrySays) {
  std::string why;
  if (!cuda_device_available(&why)) GTEST_SKIP() << why;
  const std::pair<Family, const char*> fixtures[] = {
      {Family::Qwen3Moe, "qwen3moe-tiny"},   {Family::Mixtral, "mixtral-tiny"},
      {Family::GptOss, "gptoss-tiny"},       {Family::Glm4Moe, "glm4moe-tiny"},
      {Family::DeepSeek3, "deepseek3-tiny"}, {Family::DeepSeek4, "deepseek4-tiny"},
  };
  for (const auto& [family, dir] : fixtures) {
    const FamilyInfo& info = family_info(family);
    SCOPED_TRACE(std::string(info.arch));
    auto model = DenseModel::load(test::fixture_path(std::string(dir) + "/model-f32.gguf"));
    ASSERT_TRUE(model) << model.error().message;
    ASSERT_EQ(model->params().family, family);
    auto source = test::FileExpertSource::open(*model);
    ASSERT_TRUE(source) << source.error().message;
    EngineOptions o{16, 1, 0};
    o.prefill_chunk = 4;
    auto engine = create_gpu_engine(*model, **source, o, tier(GpuOptions::Tier::Experts, 64));
    ASSERT_EQ(static_cast<bool>(engine), info.caps.cuda)
        << (engine ? std::string("created") : engine.error().message);
    if (!engine) continue;
    std::vector<float> logits(model->params().n_vocab);
    const std::vector<uint32_t> prompt = {1, 2, 3, 4};
    ASSERT_TRUE((*engine)->prefill(prompt, logits));
    EXPECT_EQ((*engine)->stats().prefill_experts > 0, info.caps.cuda_batched_prefill)
        << "prefill_experts " << (*engine)->stats().prefill_experts;
    EXPECT_EQ((*engine)->truncate(2), info.caps.cuda_prefix_truncate);
    // Sequences: an engine the row says batches holds the four asked for.
    o.sequences = 4;
    auto batched = create_gpu_engine(*model, **source, o, tier(GpuOptions::Tier::Experts, 64));
    EXPECT_EQ(static_cast<bool>(batched), info.caps.cuda_batched_decode)
        << (batched ? std::string("created") : batched.error().message);
    if (batched) {
      EXPECT_EQ((*batched)->sequences(), 4u);
    }
  }
}

// decode_batch() on the CUDA engine (issue 25), as the CPU engine's in family_test.cc: four
// sequences decoded together give each one's logits as it decoded alone, to the bit, while rows
// join and leave. Every family runs the rows layer by layer and acquires each distinct expert of a
// step once (fewer acquires than the rows alone), through a VRAM tier of 8 slots that evicts and
// through each quantised type's kernels.
TEST(FamilyCuda, ABatchedStepIsEachSequenceAloneToTheBit) {
  std::string why;
  if (!cuda_device_available(&why)) GTEST_SKIP() << why;
  const std::tuple<const char*, const char*, bool> cases[] = {
      {"qwen3moe-tiny", "q8_0", true},   {"mixtral-tiny", "q8_0", true},
      {"qwen3moe-tiny", "f32", true},    {"gptoss-tiny", "mxfp4", true},
      {"glm4moe-tiny", "q8_0", true},    {"deepseek3-tiny", "q8_0", true},
      {"deepseek3-tiny", "f32", true},   {"deepseek4-tiny", "q8_0", true},
      {"deepseek4-tiny", "mxfp4", true},
  };
  for (const auto& [dir, variant, grouped] : cases) {
    SCOPED_TRACE(fmt::format("{} {}", dir, variant));
    test::expect_batch_is_each_alone(
        test::fixture_path(fmt::format("{}/model-{}.gguf", dir, variant)), DenseLoad::Deferred,
        [](const DenseModel& m, ExpertSource& s, const EngineOptions& o) {
          return create_gpu_engine(m, s, o, tier(GpuOptions::Tier::Experts, 8));
        },
        grouped);
  }
}

// The same at the real models' expert shapes (two layers of each, forged): the quantised matvec
// plans a split-K launch by the jobs in it, and the tiny fixtures' rows are too short for any
// split, so only real widths show whether the batched step's launches keep decode()'s plan (each
// launch of k uses, a partial one padded). Mixtral-8x7B (q4_k, 4096 x 14336, top-2), Qwen3-30B-A3B
// (q4_k, 2048 x 768, 128 experts top-8) and a DeepSeek-V3 layer (q4_k, 7168 x 2048, top-8).
TEST(FamilyCuda, ABatchedStepIsEachSequenceAloneToTheBitAtRealShapes) {
  REQUIRE_GPU();
  TempDir dir;
  const std::pair<const char*, const char*> shapes[] = {
      {"mixtral",
       "--arch mixtral --layers 2 --experts 8 --top-k 2 --embd 4096 --ff 14336 --heads 32 "
       "--kv-heads 8 --head-dim 128"},
      {"qwen3",
       "--arch qwen3moe --layers 2 --experts 128 --top-k 8 --embd 2048 --ff 768 --heads 32 "
       "--kv-heads 4 --head-dim 128"},
      {"deepseek3",
       "--arch deepseek3 --layers 2 --experts 32 --top-k 8 --embd 7168 --ff 2048 --heads 16 "
       "--kv-heads 1 --head-dim 128 --dense-layers 1"},
  };
  for (const auto& [name, shape] : shapes) {
    SCOPED_TRACE(name);
    const std::string path = expertd::test::forge(
        dir.path(), name,
        fmt::format("{} --vocab 512 --expert-type q4_k --dense-type f16 --seed 5", shape));
    test::expect_batch_is_each_alone(
        path, DenseLoad::Deferred,
        [](const DenseModel& m, ExpertSource& s, const EngineOptions& o) {
          return create_gpu_engine(m, s, o, tier(GpuOptions::Tier::Experts, 24));
        },
        true);
  }
}

}  // namespace
}  // namespace expertd::engine
