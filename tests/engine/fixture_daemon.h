// The converter-made fixtures (tests/engine/fixture.h) run by the CPU engine: with the experts
// read from the file, and through a real expertd (the daemon serving each variant's GGUF as
// PREFIX-VARIANT, the forward with experts and dense weights from it, and expert-run by model
// name). Shared by the families' tests.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/cpu_engine.h"
#include "engine/daemon_expert_source.h"
#include "expertd/client.h"
#include "testing/expertd_fixture.h"
#include "testing/temp_dir.h"
#include "tests/engine/file_expert_source.h"
#include "tests/engine/fixture.h"

namespace expertd::engine::test {

// fx's `variant` with its experts read from the file: logits within `tol` relative of
// transformers', routing and greedy tokens as transformers'; every expert got is released.
// Returns the worst relative error.
template <typename Fx>
double expect_file_forward(const Fx& fx, const std::string& variant, double tol) {
  auto model = DenseModel::load(Fx::gguf(variant));
  EXPECT_TRUE(model) << model.error().message;
  if (!model) return 1.0;
  auto source = FileExpertSource::open(*model);
  EXPECT_TRUE(source) << source.error().message;
  if (!source) return 1.0;
  auto engine = create_cpu_engine(*model, **source, EngineOptions{128, 0, 0});
  EXPECT_TRUE(engine) << engine.error().message;
  if (!engine) return 1.0;
  const double worst = expect_fixture_logits(**engine, fx, variant, tol, 1e-5);
  std::printf("[ %s ] max relative error of the logits over %zu positions: %.3e\n",
              Fx::gguf(variant).c_str(), fx.tokens.size(), worst);
  expect_fixture_greedy(**engine, fx, variant);
  EXPECT_EQ((*source)->gets(), (*source)->releases());
  return worst;
}

// A daemon serving fx's variants as PREFIX-VARIANT (16 MiB cache, no mlock), stopped cleanly.
template <typename Fx>
class FixtureDaemonTest : public ::testing::Test {
 protected:
  FixtureDaemonTest(std::string prefix, std::vector<std::string> variants)
      : prefix_(std::move(prefix)), variants_(std::move(variants)) {}

  void SetUp() override {
    fx_ = Fx::load();
    socket_ = dir_.path() + "/expertd.sock";
    std::vector<std::string> args = {"--socket", socket_, "--cache", "16MiB", "--no-mlock"};
    for (const std::string& v : variants_) {
      args.insert(args.end(), {"--model", prefix_ + "-" + v + "=" + Fx::gguf(v)});
    }
    daemon_ = std::make_unique<expertd::test::Daemon>(dir_.path(), args);
    ASSERT_TRUE(daemon_->start());
  }
  void TearDown() override {
    const std::string log = daemon_->log();
    EXPECT_EQ(daemon_->stop(), 0) << log;
  }

  // Every variant's logits (within `tol` relative), routing and greedy tokens as transformers',
  // with the dense weights and the experts from the daemon; no hint errors, nothing left held.
  void expect_matches_transformers(double tol) {
    for (const std::string& variant : variants_) {
      SCOPED_TRACE(variant);
      const std::string name = prefix_ + "-" + variant;
      auto client = client::Client::connect(socket_);
      ASSERT_TRUE(client) << client.error().message;
      // The dense weights come from the daemon's fds too: nothing is read by path.
      auto model = DenseModel::load_from_daemon(**client, name);
      ASSERT_TRUE(model) << model.error().message;
      auto session = (*client)->attach(name, "engine_tests");
      ASSERT_TRUE(session) << session.error().message;
      auto source = DaemonExpertSource::create(**session, *model);
      ASSERT_TRUE(source) << source.error().message;
      auto engine = create_cpu_engine(*model, **source, EngineOptions{128, 1, 0});
      ASSERT_TRUE(engine) << engine.error().message;
      const double worst = expect_fixture_logits(**engine, fx_, variant, tol, 1e-5);
      std::printf("[ %s via expertd ] max relative error over %zu positions: %.3e\n", name.c_str(),
                  fx_.tokens.size(), worst);
      expect_fixture_greedy(**engine, fx_, variant);
      EXPECT_EQ((*engine)->stats().hint_errors, 0u);
      EXPECT_EQ((*session)->holds(), 0u);
    }
  }

  // expert-run --model PREFIX-VARIANT --prompt TEXT on the CPU: the fixture's prompt ids and
  // transformers' greedy continuation on that variant's weights.
  void expect_expert_run_by_name(const std::string& variant) {
    const std::vector<uint32_t> want = fx_.greedy(variant);
    const uint32_t n = static_cast<uint32_t>(want.size()) - fx_.prompt;
    const auto r = expertd::test::run_command(
        {expertd::test::bin_path("expert-run"), "--socket", socket_, "--model",
         prefix_ + "-" + variant, "--prompt", fx_.meta.at("prompt").template get<std::string>(),
         "--max-tokens", std::to_string(n), "--ignore-eos", "--cpu", "--json"});
    ASSERT_EQ(r.status, 0) << r.out << r.err;
    const nlohmann::json j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j.at("prompt_tokens").template get<std::vector<uint32_t>>(),
              std::vector<uint32_t>(fx_.tokens.begin(), fx_.tokens.begin() + fx_.prompt));
    EXPECT_EQ(j.at("generated").template get<std::vector<uint32_t>>(),
              std::vector<uint32_t>(want.begin() + fx_.prompt, want.end()));
  }

  expertd::test::TempDir dir_;
  Fx fx_;
  std::string socket_;
  std::unique_ptr<expertd::test::Daemon> daemon_;

 private:
  std::string prefix_;
  std::vector<std::string> variants_;
};

}  // namespace expertd::engine::test
