// The CPU reference forward against Hugging Face transformers, with experts read straight from
// the GGUF by a test-only source (the product path, through expertd, is engine_daemon_test.cc).
#include <gtest/gtest.h>

#include <set>

#include "engine/cpu_engine.h"
#include "engine/cpu_ops.h"
#include "tests/engine/file_expert_source.h"
#include "tests/engine/fixture.h"

namespace expertd::engine {
namespace {

using test::FileExpertSource;
using test::TinyFixture;

constexpr double kMaxRelErr = 1e-4;

class TinyForward : public ::testing::TestWithParam<const char*> {};

TEST_P(TinyForward, LogitsAndRoutingMatchTransformers) {
  const std::string variant = GetParam();
  const TinyFixture fx = TinyFixture::load();
  auto model = DenseModel::load(fx.gguf(variant));
  ASSERT_TRUE(model) << model.error().message;
  auto source = FileExpertSource::open(*model);
  ASSERT_TRUE(source) << source.error().message;
  auto engine = CpuEngine::create(*model, **source, EngineOptions{32, 0, 0});
  ASSERT_TRUE(engine) << engine.error().message;
  std::vector<RoutingRecord> routing;
  (*engine)->set_routing_log(&routing);

  const std::vector<float> expected = fx.logits(variant);
  ASSERT_EQ(expected.size(), fx.tokens.size() * fx.vocab);
  std::vector<float> logits(fx.vocab);
  double worst = 0.0;
  for (size_t t = 0; t < fx.tokens.size(); ++t) {
    ASSERT_TRUE((*engine)->decode(fx.tokens[t], logits));
    const double err = test::rel_err(logits.data(), expected.data() + t * fx.vocab, fx.vocab);
    EXPECT_LE(err, kMaxRelErr) << variant << " position " << t;
    worst = std::max(worst, err);
  }
  RecordProperty("max_rel_err", std::to_string(worst));
  std::printf("[ %s ] max relative error of the logits over %zu positions: %.3e\n", variant.c_str(),
              fx.tokens.size(), worst);

  const std::vector<test::TraceEntry> trace = fx.trace(variant);
  ASSERT_EQ(routing.size(), trace.size());
  for (size_t i = 0; i < trace.size(); ++i) {
    EXPECT_EQ(routing[i].token, trace[i].token);
    EXPECT_EQ(routing[i].layer, trace[i].layer);
    EXPECT_EQ(routing[i].experts, trace[i].experts) << "record " << i;
    for (size_t k = 0; k < trace[i].weights.size(); ++k) {
      EXPECT_NEAR(routing[i].weights[k], trace[i].weights[k], 1e-5) << "record " << i;
    }
  }
  EXPECT_EQ((*source)->gets(), (*source)->releases());
  EXPECT_EQ((*engine)->stats().experts_used, fx.tokens.size() * 3 * 2);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TinyForward, ::testing::Values("f32", "q8_0"),
                         [](const auto& p) { return std::string(p.param); });

// The q8_0 fixture's expected logits differ from the f32 ones (6e-3) far beyond the tolerance, so
// the comparison above would notice experts computed from the wrong bytes.
TEST(TinyForward, VariantsAreDistinguishable) {
  const TinyFixture fx = TinyFixture::load();
  const auto a = fx.logits("f32");
  const auto b = fx.logits("q8_0");
  EXPECT_GT(test::rel_err(a.data(), b.data(), a.size()), 20 * kMaxRelErr);
}

TEST(TinyForward, PrefetchHintsPredictLaterLayersOnce) {
  const TinyFixture fx = TinyFixture::load();
  auto model = DenseModel::load(fx.gguf("f32"));
  ASSERT_TRUE(model);
  auto source = FileExpertSource::open(*model);
  ASSERT_TRUE(source);
  auto engine = CpuEngine::create(*model, **source, EngineOptions{32, 2, 3});
  ASSERT_TRUE(engine);
  std::vector<RoutingRecord> routing;
  (*engine)->set_routing_log(&routing);
  std::vector<float> logits(fx.vocab);
  ASSERT_TRUE((*engine)->decode(fx.tokens[0], logits));

  // Token 0: after layer 0, layers 1 and 2 get 3 candidates each; after layer 1, layer 2's
  // candidates not already sent. Never layer 0, never an expert twice.
  const auto& hints = (*source)->hints();
  std::set<std::pair<uint32_t, uint32_t>> seen;
  for (const ExpertHint& h : hints) {
    EXPECT_GE(h.layer, 1u);
    EXPECT_LT(h.layer, 3u);
    EXPECT_GT(h.score, 0.0f);
    EXPECT_LE(h.score, 1.0f);
    EXPECT_TRUE(seen.insert({h.layer, h.expert}).second) << h.layer << "/" << h.expert;
  }
  EXPECT_GE(hints.size(), 6u);
  EXPECT_LE(hints.size(), 9u);
  const EngineStats& s = (*engine)->stats();
  EXPECT_EQ(s.hints_sent, hints.size());
  EXPECT_EQ(s.routed_hintable, 2u * 2u);  // layers 1 and 2, top-2
  uint64_t hit = 0;
  for (const RoutingRecord& r : routing) {
    for (const uint32_t e : r.experts) hit += seen.count({r.layer, e});
  }
  EXPECT_EQ(s.hinted_routed, hit);
  EXPECT_DOUBLE_EQ(s.prefetch_recall(), static_cast<double>(hit) / 4.0);
  EXPECT_DOUBLE_EQ(s.prefetch_precision(), static_cast<double>(hit) / hints.size());
  EXPECT_EQ((*source)->cursor(), std::make_pair(0u, 2u));

  // Prefetching changes nothing in the result.
  auto plain_source = FileExpertSource::open(*model);
  auto plain = CpuEngine::create(*model, **plain_source, EngineOptions{32, 0, 0});
  std::vector<float> plain_logits(fx.vocab);
  ASSERT_TRUE((*plain)->decode(fx.tokens[0], plain_logits));
  EXPECT_EQ(logits, plain_logits);
  EXPECT_TRUE((*plain_source)->hints().empty());
}

TEST(TinyForward, ResetReplaysTheSequence) {
  const TinyFixture fx = TinyFixture::load();
  auto model = DenseModel::load(fx.gguf("f32"));
  ASSERT_TRUE(model);
  auto source = FileExpertSource::open(*model);
  auto engine = CpuEngine::create(*model, **source, EngineOptions{4, 0, 0});
  ASSERT_TRUE(engine);
  std::vector<float> first(fx.vocab);
  std::vector<float> again(fx.vocab);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE((*engine)->decode(fx.tokens[i], first));
  (*engine)->reset();
  EXPECT_EQ((*engine)->position(), 0u);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE((*engine)->decode(fx.tokens[i], again));
  EXPECT_EQ(first, again);
}

TEST(TinyForward, BadTokensAndAFullCacheAreErrors) {
  const TinyFixture fx = TinyFixture::load();
  auto model = DenseModel::load(fx.gguf("f32"));
  ASSERT_TRUE(model);
  auto source = FileExpertSource::open(*model);
  auto engine = CpuEngine::create(*model, **source, EngineOptions{1, 0, 0});
  ASSERT_TRUE(engine);
  std::vector<float> logits(fx.vocab);
  const Status bad = (*engine)->decode(256, logits);
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.error().message, "token 256 is outside the vocabulary of 256");
  ASSERT_TRUE((*engine)->decode(1, logits));
  const Status full = (*engine)->decode(2, logits);
  ASSERT_FALSE(full);
  EXPECT_EQ(full.error().message, "the KV cache is full (1 positions)");
}

TEST(TinyModel, ParamsComeFromTheMetadata) {
  const TinyFixture fx = TinyFixture::load();
  auto model = DenseModel::load(fx.gguf("q8_0"));
  ASSERT_TRUE(model) << model.error().message;
  const ModelParams& p = model->params();
  EXPECT_EQ(p.architecture, "qwen3moe");
  EXPECT_EQ(p.n_layer, 3u);
  EXPECT_EQ(p.n_embd, 64u);
  EXPECT_EQ(p.n_head, 4u);
  EXPECT_EQ(p.n_head_kv, 2u);
  EXPECT_EQ(p.head_dim, 16u);
  EXPECT_EQ(p.n_rot, 16u);
  EXPECT_EQ(p.n_expert, 8u);
  EXPECT_EQ(p.n_expert_used, 2u);
  EXPECT_EQ(p.n_ff_exp, 32u);
  EXPECT_EQ(p.n_vocab, 256u);
  EXPECT_FLOAT_EQ(p.rms_eps, 1e-6f);
  EXPECT_DOUBLE_EQ(p.rope_base, 1e6);
}

TEST(TinyModel, MissingFileIsAnError) {
  auto model = DenseModel::load("/nonexistent/model.gguf");
  ASSERT_FALSE(model);
  EXPECT_NE(model.error().message.find("/nonexistent/model.gguf"), std::string::npos);
}

TEST(CpuOps, RopeNeoxRotatesHalves) {
  // Position 0 is the identity; at position p pair (i, i + n/2) turns by p * base^(-2i/n).
  std::vector<float> v = {1, 2, 3, 4, 5, 6, 7, 8};
  std::vector<float> same = v;
  rope_neox(same.data(), 8, 0, 10000.0);
  EXPECT_EQ(same, v);
  std::vector<float> r = v;
  rope_neox(r.data(), 8, 3, 10000.0);
  for (int i = 0; i < 4; ++i) {
    const double theta = 3.0 * std::pow(10000.0, -2.0 * i / 8);
    EXPECT_NEAR(r[i], v[i] * std::cos(theta) - v[i + 4] * std::sin(theta), 1e-6);
    EXPECT_NEAR(r[i + 4], v[i] * std::sin(theta) + v[i + 4] * std::cos(theta), 1e-6);
  }
}

// Several rows of one step (or prefill chunk) hinting the same expert make one hint whose score
// is the chance that at least one of them routes to it (issue 25: the step's hints scored by how
// many rows want each expert); an expert hinted at an earlier layer is not hinted again, and its
// score does not change once its hints were routed past.
TEST(HintPlanner, RowsWantingTheSameExpertMakeOneHintScoredByAllOfThem) {
  ModelParams p;
  p.n_layer = 4;
  p.n_expert = 8;
  p.n_expert_used = 2;
  EngineOptions o{16, 2, 0};
  HintPlanner planner(p, o);
  EngineStats stats;
  planner.begin_token();
  planner.from_layer(0);
  const std::vector<float> row_a = {0.5f, 0.3f, 0.1f, 0.05f, 0.05f, 0.0f, 0.0f, 0.0f};
  const std::vector<float> row_b = {0.5f, 0.0f, 0.4f, 0.1f, 0.0f, 0.0f, 0.0f, 0.0f};
  planner.add_ranked(1, std::span<const float>(row_a));  // experts 0 (0.5) and 1 (0.3)
  planner.add_ranked(1, std::span<const float>(row_b));  // experts 0 (0.5) and 2 (0.4)
  const auto hints = planner.take(stats);
  ASSERT_EQ(hints.size(), 3u);
  EXPECT_EQ(hints[0].expert, 0u);
  EXPECT_FLOAT_EQ(hints[0].score, 0.75f) << "1 - (1 - 0.5)(1 - 0.5)";
  EXPECT_EQ(hints[1].expert, 1u);
  EXPECT_FLOAT_EQ(hints[1].score, 0.3f);
  EXPECT_EQ(hints[2].expert, 2u);
  EXPECT_FLOAT_EQ(hints[2].score, 0.4f);
  EXPECT_EQ(stats.hints_sent, 3u);
  // Layer 0 routed: the pending hints are gone; layer 1's view of layer 2 adds only new experts.
  const std::vector<uint32_t> routed = {0, 1};
  planner.routed(0, routed, stats, nullptr);
  planner.from_layer(1);
  planner.add_ranked(2, std::span<const float>(row_a));
  planner.add_ranked(2, std::span<const float>(row_a));
  const auto next = planner.take(stats);
  ASSERT_EQ(next.size(), 2u);
  EXPECT_FLOAT_EQ(next[0].score, 0.75f);
  EXPECT_FLOAT_EQ(next[1].score, 1.0f - 0.7f * 0.7f);
  // Layer 1's experts were hinted from layer 0: hinting them again from layer 1 adds nothing.
  planner.add_ranked(1, std::span<const float>(row_b));
  EXPECT_EQ(planner.take(stats).size(), 2u);
  for (const ExpertHint& h : planner.take(stats)) EXPECT_LE(h.score, 1.0f);
}

}  // namespace
}  // namespace expertd::engine
