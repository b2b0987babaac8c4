// GpuEngine's chunked prefill beyond what gpu_engine_test.cc checks against the CPU engine (issue
// 24): the next layer's hints sent while a layer computes (the lookahead), the hints bounded by the
// daemon's slots, and the experts' GEMMs in bf16 (GpuOptions::PrefillGemm::Bf16) against the f32
// ones. Through a real expertd, on forged models of every quantised expert type and of both
// softmax-routed families. Every test skips without a CUDA device, saying why.
//
// The bf16 tolerance: the experts' weights and their rows are rounded to bf16 (8 significant
// bits, a relative error of at most 2^-9 each) and the products summed in f32, so each expert
// output differs from the f32 GEMM's by about 2^-9 of its size, and the residual stream carries
// that through the layers. kBf16Tolerance bounds the relative error of the last position's logits
// (test::rel_err: the largest difference over the largest logit); the figures measured on the H200
// are printed and in docs/ENGINE.md "Prefill GEMMs".
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "engine/daemon_expert_source.h"
#include "engine/gpu_engine.h"
#include "expertd/client.h"
#include "storage/slice_map.h"
#include "testing/expertd_fixture.h"
#include "tests/engine/fixture.h"

namespace expertd::engine {
namespace {

using expertd::test::Daemon;
using expertd::test::TempDir;

constexpr double kBf16Tolerance = 2e-2;

#define REQUIRE_GPU()                                        \
  do {                                                       \
    std::string why_;                                        \
    if (!cuda_device_available(&why_)) GTEST_SKIP() << why_; \
  } while (0)

struct Prefilled {
  std::vector<float> logits;
  EngineStats stats;
};

// One prefill of `prompt` in one chunk on a fresh engine attached to `name`.
Prefilled prefill(const std::string& sock, const std::string& name, const DenseModel& model,
                  const std::vector<uint32_t>& prompt, uint32_t depth, GpuOptions g) {
  Prefilled r;
  auto client = client::Client::connect(sock);
  EXPECT_TRUE(client) << client.error().message;
  if (!client) return r;
  auto session = (*client)->attach(name, "gpu_prefill_tests");
  EXPECT_TRUE(session) << session.error().message;
  if (!session) return r;
  auto source = DaemonExpertSource::create(**session, model);
  EXPECT_TRUE(source) << source.error().message;
  if (!source) return r;
  EngineOptions o{64, depth, 0};
  o.prefill_chunk = 512;
  auto gpu = GpuEngine::create(model, **source, o, g);
  EXPECT_TRUE(gpu) << gpu.error().message;
  if (!gpu) return r;
  r.logits.assign(model.params().n_vocab, 0.0f);
  auto st = (*gpu)->prefill(prompt, r.logits);
  EXPECT_TRUE(st) << st.error().message;
  for (const float v : r.logits) EXPECT_TRUE(std::isfinite(v));
  r.stats = (*gpu)->stats();
  (*gpu)->reset();
  EXPECT_EQ((*session)->holds(), 0u) << "every hold is given back";
  return r;
}

GpuOptions in_vram(uint64_t experts, GpuOptions::PrefillGemm gemm) {
  GpuOptions g;
  g.tier = experts == 0 ? GpuOptions::Tier::InPlace : GpuOptions::Tier::Experts;
  g.value = experts;
  g.prefill_gemm = gemm;
  return g;
}

std::vector<uint32_t> prompt_of(uint32_t n, uint32_t vocab) {
  std::vector<uint32_t> p;
  for (uint32_t i = 0; i < n; ++i) p.push_back((i * 7919u + 13u) % vocab);
  return p;
}

// The lookahead changes what is read ahead, never the numbers; bf16 GEMMs stay within their
// tolerance of the f32 ones, in place and through a VRAM tier, and say so in the counters.
TEST(GpuPrefill, LookaheadHintsAndBf16GemmsAgainstTheF32Prefill) {
  REQUIRE_GPU();
  TempDir dir;
  struct Case {
    const char* arch;
    const char* type;
  };
  const Case cases[] = {{"qwen3moe", "q4_k"},  {"qwen3moe", "q6_k"}, {"qwen3moe", "q8_0"},
                        {"qwen3moe", "mxfp4"}, {"qwen3moe", "f16"},  {"mixtral", "q4_k"}};
  std::vector<std::string> args;
  std::vector<std::pair<std::string, std::string>> models;
  for (const Case& c : cases) {
    const std::string name = fmt::format("{}-{}", c.arch, c.type);
    const std::string path = expertd::test::forge(
        dir.path(), name,
        fmt::format("--arch {} --layers 4 --experts 8 --top-k 2 --embd 512 --ff 768 --heads 8 "
                    "--kv-heads 2 --head-dim 64 --vocab 320 --expert-type {} --dense-type f32 "
                    "--seed 5",
                    c.arch, c.type));
    args.insert(args.end(), {"--model", name + "=" + path});
    models.emplace_back(name, path);
  }
  const std::string sock = dir.path() + "/expertd.sock";
  // Split between the six models: each keeps two layers of its experts (f16's are the largest).
  args.insert(args.end(), {"--socket", sock, "--cache", "384MiB", "--no-mlock"});
  Daemon d(dir.path(), args);
  ASSERT_TRUE(d.start());
  for (const auto& [name, path] : models) {
    auto model = DenseModel::load(path);
    ASSERT_TRUE(model) << model.error().message;
    const ModelParams& p = model->params();
    const std::vector<uint32_t> prompt = prompt_of(48, p.n_vocab);
    const uint32_t all = p.n_layer * p.n_expert;
    using G = GpuOptions::PrefillGemm;
    const Prefilled base = prefill(sock, name, *model, prompt, 0, in_vram(all, G::F32));
    ASSERT_EQ(base.logits.size(), p.n_vocab);
    EXPECT_EQ(base.stats.prefill_lookahead_hints, 0u) << name << ": depth 0 sends none";
    for (const uint64_t slots : {uint64_t{0}, uint64_t{3}, uint64_t{all}}) {
      SCOPED_TRACE(fmt::format("{} vram {}", name, slots));
      const Prefilled ahead = prefill(sock, name, *model, prompt, 1, in_vram(slots, G::F32));
      const double err_ahead = test::rel_err(ahead.logits.data(), base.logits.data(), p.n_vocab);
      EXPECT_LE(err_ahead, 1e-6) << "the lookahead only hints";
      // 48 rows route to every expert of every layer: the next layer's are hinted from each
      // layer but the last.
      EXPECT_GT(ahead.stats.prefill_lookahead_hints, 0u);
      EXPECT_LE(ahead.stats.prefill_lookahead_hints, uint64_t{p.n_layer - 1} * p.n_expert);
      EXPECT_EQ(ahead.stats.prefill_hints_held, 0u) << "the cache keeps two layers";
      EXPECT_EQ(ahead.stats.prefill_bf16_gemms, 0u);

      const Prefilled bf = prefill(sock, name, *model, prompt, 1, in_vram(slots, G::Bf16));
      const double err_bf = test::rel_err(bf.logits.data(), base.logits.data(), p.n_vocab);
      EXPECT_LE(err_bf, kBf16Tolerance);
      EXPECT_GT(err_bf, 0.0) << "bf16 rounds: the same logits mean the f32 path ran";
      EXPECT_EQ(bf.stats.prefill_bf16_gemms, 3 * bf.stats.prefill_experts);
      EXPECT_EQ(bf.stats.prefill_experts, ahead.stats.prefill_experts);
      std::printf(
          "[ %s vram %llu ] lookahead vs none %.3e; bf16 vs f32 %.3e (tolerance %.0e); "
          "lookahead hints %llu, experts %llu\n",
          name.c_str(), static_cast<unsigned long long>(slots), err_ahead, err_bf, kBf16Tolerance,
          static_cast<unsigned long long>(ahead.stats.prefill_lookahead_hints),
          static_cast<unsigned long long>(ahead.stats.prefill_experts));
    }
  }
  const std::string log = d.log();
  EXPECT_EQ(d.stop(), 0) << log;
}

// A daemon whose slots cannot keep a layer's experts until their acquire: prefill hints at most
// kHintFill of them at once (the rest as the acquires free room), no lookahead, the same logits.
TEST(GpuPrefill, HintsStayWithinTheDaemonsSlots) {
  REQUIRE_GPU();
  TempDir dir;
  const std::string path = expertd::test::forge(
      dir.path(), "m",
      "--layers 4 --experts 16 --top-k 2 --embd 512 --ff 768 --heads 8 --kv-heads 2 --head-dim 64 "
      "--vocab 320 --expert-type q4_k --dense-type f32 --seed 9");
  auto model = DenseModel::load(path);
  ASSERT_TRUE(model) << model.error().message;
  const ModelParams& p = model->params();
  const std::vector<uint32_t> prompt = prompt_of(64, p.n_vocab);
  using G = GpuOptions::PrefillGemm;
  std::vector<float> wide;
  for (const char* cache : {"64MiB", "6MiB"}) {
    SCOPED_TRACE(cache);
    TempDir run;
    const std::string sock = run.path() + "/expertd.sock";
    Daemon d(run.path(), {"--model", "m=" + path, "--socket", sock, "--cache", cache, "--staging",
                          "2MiB", "--no-mlock"});
    ASSERT_TRUE(d.start());
    const Prefilled r = prefill(sock, "m", *model, prompt, 1, in_vram(0, G::F32));
    ASSERT_EQ(r.logits.size(), p.n_vocab);
    if (wide.empty()) {
      wide = r.logits;
      EXPECT_EQ(r.stats.prefill_hints_held, 0u);
      EXPECT_GT(r.stats.prefill_lookahead_hints, 0u);
    } else {
      EXPECT_LE(test::rel_err(r.logits.data(), wide.data(), p.n_vocab), 1e-6);
      EXPECT_GT(r.stats.prefill_hints_held, 0u) << "16 experts a layer, fewer slots";
      EXPECT_EQ(r.stats.prefill_lookahead_hints, 0u) << "no room left for the next layer";
    }
    std::printf("[ cache %s ] hints %llu, held back %llu, lookahead %llu, experts %llu\n", cache,
                static_cast<unsigned long long>(r.stats.prefill_hints),
                static_cast<unsigned long long>(r.stats.prefill_hints_held),
                static_cast<unsigned long long>(r.stats.prefill_lookahead_hints),
                static_cast<unsigned long long>(r.stats.prefill_experts));
    const std::string log = d.log();
    EXPECT_EQ(d.stop(), 0) << log;
  }
}

// The daemon reads a prefill layer's experts ahead of their acquires: the layer's hints are
// flagged exact, and a fresh daemon, whose automatic prefetch depth is 0 until predicted hints
// earn it, reads them while the first groups are acquired and computed. (Unflagged, a one-chunk
// prompt on a fresh daemon read nothing ahead; and sent after the cursor named the layer, as the
// CUDA prefills did until 2026-12-04, a hint for the cursor's own layer was for the next token.)
// No lookahead (depth 0), so every load comes from the exact hints. GpuEngine's chunked and
// layer-by-layer prefills and Ds3GpuEngine's, in place, through a real expertd.
TEST(GpuPrefill, TheDaemonReadsALayersExactHintsAhead) {
  REQUIRE_GPU();
  TempDir dir;
  const std::string forged = expertd::test::forge(
      dir.path(), "m",
      "--layers 4 --experts 16 --top-k 2 --embd 512 --ff 768 --heads 8 --kv-heads 2 --head-dim 64 "
      "--vocab 320 --expert-type q4_k --dense-type f32 --seed 9");
  struct Case {
    const char* name;
    std::string path;
    std::vector<uint32_t> prompt;
  };
  std::vector<Case> cases;
  cases.push_back({"m", forged, {}});
  for (const char* fx : {"glm4moe-tiny", "deepseek3-tiny"}) {
    cases.push_back({fx, test::fixture_path(std::string(fx) + "/model-q8_0.gguf"),
                     test::read_json(test::fixture_path(std::string(fx) + "/fixture.json"))
                         .at("tokens")
                         .get<std::vector<uint32_t>>()});
  }
  std::vector<std::string> args;
  for (const Case& c : cases)
    args.insert(args.end(), {"--model", std::string(c.name) + "=" + c.path});
  const std::string sock = dir.path() + "/expertd.sock";
  args.insert(args.end(), {"--socket", sock, "--cache", "128MiB", "--no-mlock"});
  Daemon d(dir.path(), args);
  ASSERT_TRUE(d.start());
  for (Case& c : cases) {
    SCOPED_TRACE(c.name);
    auto model = DenseModel::load(c.path, DenseLoad::Deferred);
    ASSERT_TRUE(model) << model.error().message;
    const ModelParams& p = model->params();
    if (c.prompt.empty()) c.prompt = prompt_of(64, p.n_vocab);
    auto client = client::Client::connect(sock);
    ASSERT_TRUE(client) << client.error().message;
    auto session = (*client)->attach(c.name, "gpu_prefill_tests");
    ASSERT_TRUE(session) << session.error().message;
    auto source = DaemonExpertSource::create(**session, *model);
    ASSERT_TRUE(source) << source.error().message;
    EngineOptions o{static_cast<uint32_t>(c.prompt.size()) + 1, 0, 0};
    o.prefill_chunk = 512;
    auto engine = create_gpu_engine(*model, **source, o, in_vram(0, GpuOptions::PrefillGemm::F32));
    ASSERT_TRUE(engine) << engine.error().message;
    auto counters = [&] {
      auto st = (*client)->stats();
      EXPECT_TRUE(st) << st.error().message;
      client::SchedulerStats out;
      if (!st) return out;
      for (const auto& m : st->models) {
        if (m.name == c.name) out = m.scheduler;
      }
      return out;
    };
    const client::SchedulerStats before = counters();
    std::vector<float> logits(p.n_vocab);
    auto done = (*engine)->prefill(c.prompt, logits);
    ASSERT_TRUE(done) << done.error().message;
    const client::SchedulerStats after = counters();
    const EngineStats& s = (*engine)->stats();
    const uint64_t loads = after.prefetch_loads - before.prefetch_loads;
    const uint64_t useful = after.prefetch_useful - before.prefetch_useful;
    std::printf("[ %s ] experts acquired %llu, exact hints %llu, read ahead %llu (useful %llu)\n",
                c.name, static_cast<unsigned long long>(s.prefill_experts),
                static_cast<unsigned long long>(s.prefill_hints),
                static_cast<unsigned long long>(loads), static_cast<unsigned long long>(useful));
    EXPECT_GT(s.prefill_hints, 0u);
    EXPECT_GT(loads, 0u) << "the layers' exact hints were read ahead";
    EXPECT_EQ(after.exact_loads - before.exact_loads, loads) << "every one of them exact";
    EXPECT_EQ(after.exact_wasted - before.exact_wasted, 0u);
    EXPECT_GT(useful, 0u);
    EXPECT_EQ(s.prefill_lookahead_hints, 0u) << "no lookahead at depth 0";
    engine->reset();
    EXPECT_EQ((*session)->holds(), 0u);
  }
  const std::string log = d.log();
  EXPECT_EQ(d.stop(), 0) << log;
}

// The source expertd's experts come through, counting the experts get() asked for, by layer.
class CountingSource final : public ForwardingSource {
 public:
  CountingSource(ExpertSource& inner, uint32_t layers) : ForwardingSource(inner), gets(layers, 0) {}
  Status get(uint32_t layer, std::span<const uint32_t> experts,
             std::span<ExpertView> out) override {
    if (layer < gets.size()) gets[layer] += experts.size();
    return inner_.get(layer, experts, out);
  }
  std::vector<uint64_t> gets;
};

// GpuOptions::preload fills the VRAM tier at creation with the experts of the last MoE layers, and
// a prefill chunk finds them there: not one of them is asked of the daemon again, although the
// chunk's misses of the earlier layers would have evicted them (the policy values experts never
// used at nothing) but for the chunk's sweep (VramTier::begin_sweep). The logits are those of an
// engine that started empty. Every CUDA engine: GpuEngine's chunked (qwen3moe, Mixtral) and
// layer-by-layer (GLM-4.5, gpt-oss) prefills, Ds3GpuEngine, Ds4GpuEngine; the tiny fixtures
// llama.cpp's converter wrote, served by a real expertd.
TEST(GpuPrefill, APreloadedTierHoldsTheLastLayersAndTheChunkFindsThemThere) {
  REQUIRE_GPU();
  TempDir dir;
  const std::pair<const char*, const char*> fixtures[] = {
      {"qwen3moe-tiny", "q8_0"}, {"mixtral-tiny", "q8_0"},   {"glm4moe-tiny", "q8_0"},
      {"gptoss-tiny", "mxfp4"},  {"deepseek3-tiny", "q8_0"}, {"deepseek4-tiny", "q8_0"},
      {"kimi-k2-tiny", "q8_0"}};
  std::vector<std::string> args;
  for (const auto& [fx, variant] : fixtures) {
    args.insert(
        args.end(),
        {"--model", fmt::format("{}={}", fx,
                                test::fixture_path(fmt::format("{}/model-{}.gguf", fx, variant)))});
  }
  const std::string sock = dir.path() + "/expertd.sock";
  args.insert(args.end(), {"--socket", sock, "--cache", "256MiB", "--no-mlock"});
  Daemon d(dir.path(), args);
  ASSERT_TRUE(d.start());
  for (const auto& [fx, variant] : fixtures) {
    SCOPED_TRACE(fx);
    const std::string path = test::fixture_path(fmt::format("{}/model-{}.gguf", fx, variant));
    auto model = DenseModel::load(path, DenseLoad::Deferred);
    ASSERT_TRUE(model) << model.error().message;
    const ModelParams& p = model->params();
    const std::vector<uint32_t> prompt =
        test::read_json(test::fixture_path(std::string(fx) + "/fixture.json"))
            .at("tokens")
            .get<std::vector<uint32_t>>();
    auto map = SliceMap::build(model->gguf());
    ASSERT_TRUE(map) << map.error().message;
    // The last two MoE layers the engine runs, whole: a file's next-n (MTP) blocks, which it
    // skips (GLM-4.5), come after them.
    std::vector<uint32_t> moe;
    for (const auto& l : map->layers()) {
      if (l.layer < p.n_layer) moe.push_back(l.layer);
    }
    ASSERT_GE(moe.size(), 2u);
    const uint32_t last = moe.back();
    const uint32_t before_last = moe[moe.size() - 2];
    const uint64_t slots = 2ull * p.n_expert;
    std::vector<float> empty_start;
    for (const bool preload : {false, true}) {
      SCOPED_TRACE(preload ? "preloaded" : "empty at start");
      auto client = client::Client::connect(sock);
      ASSERT_TRUE(client) << client.error().message;
      auto session = (*client)->attach(fx, "gpu_prefill_tests");
      ASSERT_TRUE(session) << session.error().message;
      auto daemon_source = DaemonExpertSource::create(**session, *model);
      ASSERT_TRUE(daemon_source) << daemon_source.error().message;
      CountingSource source(**daemon_source, p.n_layer);
      EngineOptions o{static_cast<uint32_t>(prompt.size()) + 1, 1, 0};
      o.prefill_chunk = 512;
      GpuOptions g;
      g.tier = GpuOptions::Tier::Experts;
      g.value = slots;
      g.preload = preload;
      uint32_t progress_calls = 0;
      g.preload_progress = [&](uint32_t experts, uint32_t of, uint64_t bytes) {
        ++progress_calls;
        EXPECT_LE(experts, of);
        EXPECT_GT(bytes, 0u);
      };
      auto created = create_gpu_engine(*model, source, o, g);
      ASSERT_TRUE(created) << created.error().message;
      std::unique_ptr<Engine> engine = std::move(*created);
      const EngineStats at_start = engine->stats();
      uint64_t got_at_start = 0;
      for (uint32_t l = 0; l < p.n_layer; ++l) {
        got_at_start += source.gets[l];
        if (preload && l != last && l != before_last) {
          EXPECT_EQ(source.gets[l], 0u) << l;
        }
      }
      if (preload) {
        EXPECT_EQ(at_start.vram_preloaded, slots);
        EXPECT_EQ(source.gets[last], p.n_expert);
        EXPECT_EQ(source.gets[before_last], p.n_expert);
        EXPECT_GT(at_start.vram_preload_bytes, 0u);
        EXPECT_EQ(at_start.copy_bytes, 0u) << "a preload is not a copy of the decode's";
        EXPECT_EQ(progress_calls, 2u) << "one call per layer";
      } else {
        EXPECT_EQ(got_at_start, 0u);
        EXPECT_EQ(at_start.vram_preloaded, 0u);
      }
      std::fill(source.gets.begin(), source.gets.end(), 0);
      std::vector<float> logits(p.n_vocab);
      auto st = engine->prefill(prompt, logits);
      ASSERT_TRUE(st) << st.error().message;
      const uint64_t tail = source.gets[last] + source.gets[before_last];
      if (preload) {
        EXPECT_EQ(tail, 0u) << "every expert of the last two layers was found in VRAM";
        EXPECT_GT(engine->stats().vram_hits, 0u);
        ASSERT_EQ(empty_start.size(), logits.size());
        EXPECT_LE(test::rel_err(logits.data(), empty_start.data(), p.n_vocab), 1e-6);
      } else {
        EXPECT_GT(tail, 0u) << "an empty tier asks the daemon for them";
        empty_start = logits;
      }
      std::printf(
          "[ %s, %s ] the last two layers' experts asked of the daemon in the prefill: "
          "%llu\n",
          fx, preload ? "preloaded" : "empty at start", static_cast<unsigned long long>(tail));
      engine.reset();  // destroyed: every hold goes back
      EXPECT_EQ((*session)->holds(), 0u) << "every hold is given back";
    }
  }
  const std::string log = d.log();
  EXPECT_EQ(d.stop(), 0) << log;
}

}  // namespace
}  // namespace expertd::engine
