// DeepSeek-V3 (`deepseek2`) on the product path: the real expertd serves the committed
// deepseek3-tiny and kimi-k2-tiny fixtures (llama.cpp's converter's output; Kimi-K2 is a
// DeepSeek-V3 with one expert group, its own scaling and YaRN betas) and the CPU engine gets its
// experts through libexpertd-client; expert-run decodes them by model name.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "engine/cpu_engine.h"
#include "engine/daemon_expert_source.h"
#include "expertd/client.h"
#include "testing/expertd_fixture.h"
#include "tests/engine/fixture.h"

namespace expertd::engine {
namespace {

using expertd::test::Daemon;
using expertd::test::TempDir;

class Ds3DaemonTest : public ::testing::TestWithParam<const char*> {
 protected:
  static std::string ds3_path(const std::string& file) {
    return test::fixture_path(std::string(GetParam()) + "/" + file);
  }
  void SetUp() override {
    meta_ = test::read_json(ds3_path("fixture.json"));
    tokens_ = meta_.at("tokens").get<std::vector<uint32_t>>();
    prompt_ = meta_.at("prompt_tokens").get<uint32_t>();
    socket_ = dir_.path() + "/expertd.sock";
    daemon_ = std::make_unique<Daemon>(
        dir_.path(),
        std::vector<std::string>{"--model", "v3-f32=" + ds3_path("model-f32.gguf"), "--model",
                                 "v3-q8_0=" + ds3_path("model-q8_0.gguf"), "--socket", socket_,
                                 "--cache", "16MiB", "--no-mlock"});
    ASSERT_TRUE(daemon_->start());
  }
  void TearDown() override {
    const std::string log = daemon_->log();
    EXPECT_EQ(daemon_->stop(), 0) << log;
  }

  TempDir dir_;
  nlohmann::json meta_;
  std::vector<uint32_t> tokens_;
  uint32_t prompt_ = 0;
  std::string socket_;
  std::unique_ptr<Daemon> daemon_;
};

TEST_P(Ds3DaemonTest, LogitsRoutingAndGreedyTokensMatchTransformers) {
  for (const std::string variant : {"f32", "q8_0"}) {
    SCOPED_TRACE(variant);
    auto model = DenseModel::load(ds3_path("model-" + variant + ".gguf"));
    ASSERT_TRUE(model) << model.error().message;
    const ModelParams& p = model->params();
    ASSERT_TRUE(p.is_ds3());
    auto client = client::Client::connect(socket_);
    ASSERT_TRUE(client) << client.error().message;
    auto session = (*client)->attach("v3-" + variant, "engine_tests");
    ASSERT_TRUE(session) << session.error().message;
    auto source = DaemonExpertSource::create(**session, *model);
    ASSERT_TRUE(source) << source.error().message;
    auto engine = create_cpu_engine(*model, **source, EngineOptions{64, 1, 0});
    ASSERT_TRUE(engine) << engine.error().message;
    std::vector<RoutingRecord> routing;
    (*engine)->set_routing_log(&routing);
    const std::vector<float> expected = test::read_f32(ds3_path("logits-" + variant + ".bin"));
    const std::vector<uint32_t> greedy =
        variant == "f32" ? tokens_ : meta_.at("greedy_q8_0").get<std::vector<uint32_t>>();
    const uint32_t vocab = p.n_vocab;
    std::vector<float> logits(vocab);
    double worst = 0.0;
    for (size_t t = 0; t < tokens_.size(); ++t) {
      const Status st = (*engine)->decode(tokens_[t], logits);
      ASSERT_TRUE(st) << st.error().message;
      const double err = test::rel_err(logits.data(), expected.data() + t * vocab, vocab);
      EXPECT_LE(err, 1e-4) << "position " << t;
      worst = std::max(worst, err);
      if (t + 1 >= prompt_ && t + 1 < greedy.size()) {
        const auto best = std::max_element(logits.begin(), logits.end()) - logits.begin();
        EXPECT_EQ(static_cast<uint32_t>(best), greedy[t + 1]) << "position " << t;
      }
    }
    std::printf("[ %s %s via expertd ] max relative error over %zu positions: %.3e\n", GetParam(),
                variant.c_str(), tokens_.size(), worst);
    const std::vector<test::TraceEntry> trace =
        test::read_trace(ds3_path("trace-" + variant + ".jsonl"));
    ASSERT_EQ(routing.size(), trace.size());
    for (size_t i = 0; i < trace.size(); ++i) {
      EXPECT_EQ(routing[i].token, trace[i].token);
      EXPECT_EQ(routing[i].layer, trace[i].layer);
      EXPECT_EQ(routing[i].experts, trace[i].experts) << "record " << i;
      for (size_t k = 0; k < trace[i].weights.size(); ++k) {
        EXPECT_NEAR(routing[i].weights[k], trace[i].weights[k], 1e-5) << "record " << i;
      }
    }
    // Only the MoE layers acquire experts; the dense first layer never asks the daemon.
    const uint32_t moe_layers = p.n_layer - p.ds3.dense_lead;
    // Every router-lookahead hint (depth 1, from the dense layer too) reached the daemon.
    const EngineStats& s = (*engine)->stats();
    EXPECT_GT(s.hints_sent, 0u);
    auto ss = (*session)->stats();
    expertd::test::wait_until(
        [&] {
          ss = (*session)->stats();
          return !ss || (ss->releases == ss->acquires && ss->prefetches == s.hints_sent);
        },
        std::chrono::seconds(10));
    ASSERT_TRUE(ss) << ss.error().message;
    EXPECT_EQ(ss->acquires, tokens_.size() * moe_layers * p.n_expert_used);
    EXPECT_EQ(ss->prefetches, s.hints_sent);
    EXPECT_EQ((*session)->holds(), 0u);
    EXPECT_EQ(s.hint_errors, 0u);
    // Depth 1, width k: layer 1's top-k from the dense layer 0 and layer 2's from layer 1, each
    // sent once per token.
    EXPECT_EQ(s.hints_sent, tokens_.size() * moe_layers * p.n_expert_used);
  }
}

// A truncated sequence continues as if the cut positions had never been fed.
TEST_P(Ds3DaemonTest, TruncateKeepsThePrefix) {
  auto model = DenseModel::load(ds3_path("model-f32.gguf"));
  ASSERT_TRUE(model) << model.error().message;
  auto source = DaemonExpertSource::connect(socket_, "v3-f32", *model, "engine_tests");
  ASSERT_TRUE(source) << source.error().message;
  auto engine = create_cpu_engine(*model, **source, EngineOptions{64, 0, 0});
  ASSERT_TRUE(engine) << engine.error().message;
  const uint32_t vocab = model->params().n_vocab;
  std::vector<float> logits(vocab);
  for (uint32_t t = 0; t < 10; ++t) ASSERT_TRUE((*engine)->decode(tokens_[t], logits));
  ASSERT_TRUE((*engine)->decode(200, logits));  // a token the fixture never has here
  ASSERT_TRUE((*engine)->truncate(10));
  const std::vector<float> expected = test::read_f32(ds3_path("logits-f32.bin"));
  ASSERT_TRUE((*engine)->decode(tokens_[10], logits));
  EXPECT_LE(test::rel_err(logits.data(), expected.data() + 10 * vocab, vocab), 1e-4);
}

// prefill() gives decode()'s logits to the bit, in chunks of any size, routes as decode() does,
// and acquires each (layer, expert) of a chunk once.
TEST_P(Ds3DaemonTest, PrefillMatchesDecodeAndAcquiresEachExpertOncePerChunk) {
  const std::vector<uint32_t> prompt(tokens_.begin(), tokens_.begin() + prompt_);
  for (const std::string variant : {"f32", "q8_0"}) {
    auto model = DenseModel::load(ds3_path("model-" + variant + ".gguf"));
    ASSERT_TRUE(model) << model.error().message;
    const uint32_t vocab = model->params().n_vocab;
    auto by_decode = DaemonExpertSource::connect(socket_, "v3-" + variant, *model, "decode");
    ASSERT_TRUE(by_decode) << by_decode.error().message;
    auto dec = create_cpu_engine(*model, **by_decode, EngineOptions{64, 1, 0});
    ASSERT_TRUE(dec) << dec.error().message;
    std::vector<RoutingRecord> want_routes;
    (*dec)->set_routing_log(&want_routes);
    std::vector<float> want(vocab);
    for (const uint32_t t : prompt) ASSERT_TRUE((*dec)->decode(t, want));
    const uint64_t decode_experts = (*dec)->stats().experts_used;
    (*dec)->set_routing_log(nullptr);
    std::vector<float> want_next(vocab);
    ASSERT_TRUE((*dec)->decode(tokens_[prompt_], want_next));
    for (const uint32_t chunk : {7u, 64u}) {
      SCOPED_TRACE(variant + " chunk " + std::to_string(chunk));
      auto source = DaemonExpertSource::connect(socket_, "v3-" + variant, *model, "prefill");
      ASSERT_TRUE(source) << source.error().message;
      EngineOptions o{64, 1, 0};
      o.prefill_chunk = chunk;
      auto eng = create_cpu_engine(*model, **source, o);
      ASSERT_TRUE(eng) << eng.error().message;
      std::vector<RoutingRecord> routes;
      (*eng)->set_routing_log(&routes);
      std::vector<float> got(vocab);
      ASSERT_TRUE((*eng)->prefill(prompt, got));
      EXPECT_EQ(got, want);
      ASSERT_EQ(routes.size(), want_routes.size());
      for (size_t i = 0; i < routes.size(); ++i) {
        EXPECT_EQ(routes[i].token, want_routes[i].token);
        EXPECT_EQ(routes[i].layer, want_routes[i].layer);
        EXPECT_EQ(routes[i].experts, want_routes[i].experts) << "record " << i;
      }
      const EngineStats& s = (*eng)->stats();
      EXPECT_EQ(s.prefill_tokens, prompt.size());
      EXPECT_EQ(s.prefill_chunks, (prompt.size() + chunk - 1) / chunk);
      EXPECT_LT(s.prefill_experts, decode_experts);
      EXPECT_EQ(s.experts_used, s.prefill_experts);
      // It continues as decode() does.
      ASSERT_TRUE((*eng)->decode(tokens_[prompt_], got));
      EXPECT_EQ(got, want_next);
    }
  }
}

TEST_P(Ds3DaemonTest, ExpertRunDecodesTheModelByName) {
  const std::string text = meta_.at("prompt").get<std::string>();
  const uint32_t n = static_cast<uint32_t>(tokens_.size()) - prompt_;
  const auto r = expertd::test::run_command(
      {expertd::test::bin_path("expert-run"), "--socket", socket_, "--model", "v3-q8_0", "--prompt",
       text, "--max-tokens", std::to_string(n), "--ignore-eos", "--cpu", "--json"});
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j.at("prompt_tokens").get<std::vector<uint32_t>>(),
            std::vector<uint32_t>(tokens_.begin(), tokens_.begin() + prompt_));
  const auto greedy = meta_.at("greedy_q8_0").get<std::vector<uint32_t>>();
  EXPECT_EQ(j.at("generated").get<std::vector<uint32_t>>(),
            std::vector<uint32_t>(greedy.begin() + prompt_, greedy.end()));
  EXPECT_EQ(j.at("engine").get<std::string>(), "cpu");
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Ds3DaemonTest,
                         ::testing::Values("deepseek3-tiny", "kimi-k2-tiny"),
                         [](const auto& param_info) {
                           std::string n = param_info.param;
                           for (char& c : n) c = c == '-' ? '_' : c;
                           return n;
                         });

}  // namespace
}  // namespace expertd::engine
