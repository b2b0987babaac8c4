// gpt-oss (llama.cpp's `gpt-oss`) against Hugging Face transformers: tests/fixtures/gptoss-tiny,
// written by tools/reference/make_gptoss_fixture.py (llama.cpp's own converter made both GGUFs,
// the MXFP4 one from the release's blocks/scales layout). The forward with experts from the file
// and from a real expertd (attention sinks, the sliding window, biases, the top-k-then-softmax
// router, the clamped SwiGLU and YaRN all matter to the logits), expert-run by model name, and the
// loader's errors on malformed gpt-oss files.
#include <gtest/gtest.h>

#include <memory>

#include "engine/cpu_engine.h"
#include "storage/gguf_writer.h"
#include "testing/temp_dir.h"
#include "tests/engine/fixture.h"
#include "tests/engine/fixture_daemon.h"
#include "tests/engine/gguf_edit.h"

namespace expertd::engine {
namespace {

constexpr double kMaxRelErr = 1e-4;

using test::GptOssFixture;

std::string gguf(const std::string& variant) { return GptOssFixture::gguf(variant); }

class GptOssForward : public ::testing::TestWithParam<const char*> {};

TEST_P(GptOssForward, LogitsRoutingAndGreedyTokensMatchTransformers) {
  const double worst = test::expect_file_forward(GptOssFixture::load(), GetParam(), kMaxRelErr);
  RecordProperty("max_rel_err", std::to_string(worst));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GptOssForward, ::testing::Values("f32", "mxfp4"),
                         [](const auto& p) { return std::string(p.param); });

TEST(GptOssForward, ReadsGptOssFromTheFile) {
  auto model = DenseModel::load(gguf("mxfp4"));
  ASSERT_TRUE(model) << model.error().message;
  const ModelParams& p = model->params();
  EXPECT_EQ(p.family, Family::GptOss);
  EXPECT_EQ(p.router, RouterKind::TopkSoftmax);
  EXPECT_EQ(p.act, ExpertAct::ClampedSwiglu);
  EXPECT_FALSE(p.qk_norm);
  EXPECT_EQ(p.swa_window, 8u);
  EXPECT_TRUE(p.sliding(0));
  EXPECT_FALSE(p.sliding(1));
  EXPECT_DOUBLE_EQ(p.yarn.factor, 4.0);
  EXPECT_EQ(p.yarn.orig_ctx, 32u);
  EXPECT_EQ(p.n_expert, 8u);
  EXPECT_EQ(p.n_expert_used, 2u);
  EXPECT_EQ(p.n_ff_exp, 32u);
  const LayerWeights& l = model->layer(3);
  EXPECT_EQ(l.sinks.size(), 4u);
  EXPECT_EQ(l.exp_gate_b.size(), 8u * 32u);
  EXPECT_EQ(l.exp_down_b.size(), 8u * 64u);
  // The prompt is longer than the window, so the sliding layers drop positions.
  EXPECT_GT(GptOssFixture::load().prompt, p.swa_window);
}

// --- Through a real expertd: the MXFP4 experts stream as the release stores them.

class GptOssDaemonTest : public test::FixtureDaemonTest<GptOssFixture> {
 protected:
  GptOssDaemonTest() : FixtureDaemonTest("gptoss", {"f32", "mxfp4"}) {}
};

TEST_F(GptOssDaemonTest, LogitsAndGreedyTokensMatchTransformersWithExpertsFromExpertd) {
  expect_matches_transformers(kMaxRelErr);
}

// expert-run by model name alone: the prompt text is tokenised with the file's byte-level BPE and
// the answer is transformers' greedy continuation.
TEST_F(GptOssDaemonTest, ExpertRunRunsGptOssByModelName) { expect_expert_run_by_name("mxfp4"); }

// --- Malformed gpt-oss files: one-line errors that name the key or tensor.

TEST(GptOssMalformed, TheUnchangedCopyLoads) {
  expertd::test::TempDir dir;
  EXPECT_EQ(test::load_error(test::rewrite(gguf("mxfp4"), dir.path() + "/same.gguf", {})),
            "(loaded)");
}

TEST(GptOssMalformed, AMissingSinkTensorIsNamed) {
  expertd::test::TempDir dir;
  test::Edit e;
  e.drop_tensor = "blk.1.attn_sinks.weight";
  const std::string path = dir.path() + "/m.gguf";
  EXPECT_EQ(test::load_error(test::rewrite(gguf("mxfp4"), path, e)),
            path + ": tensor blk.1.attn_sinks.weight is missing");
}

TEST(GptOssMalformed, AMissingSlidingWindowNamesTheKey) {
  expertd::test::TempDir dir;
  test::Edit e;
  e.key = "gpt-oss.attention.sliding_window";
  e.set_key = [](GgufWriter&) {};
  const std::string path = dir.path() + "/m.gguf";
  EXPECT_EQ(test::load_error(test::rewrite(gguf("mxfp4"), path, e)),
            path + ": gpt-oss.attention.sliding_window is missing");
}

TEST(GptOssMalformed, AnExpertCountThatDisagreesWithTheTensorsNamesBoth) {
  expertd::test::TempDir dir;
  test::Edit e;
  e.key = "gpt-oss.expert_count";
  e.set_key = [](GgufWriter& w) { w.set_u32("gpt-oss.expert_count", 4); };
  const std::string msg = test::load_error(test::rewrite(gguf("mxfp4"), dir.path() + "/m.gguf", e));
  EXPECT_NE(msg.find("blk.0."), std::string::npos) << msg;
  EXPECT_NE(msg.find("8"), std::string::npos) << msg;
  EXPECT_NE(msg.find("4"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

TEST(GptOssMalformed, AnExpertBiasOfTheWrongShapeIsNamed) {
  expertd::test::TempDir dir;
  test::Edit e;
  e.reshape_tensor = "blk.2.ffn_up_exps.bias";
  e.new_ne = {32, 4};
  const std::string path = dir.path() + "/m.gguf";
  EXPECT_EQ(test::load_error(test::rewrite(gguf("mxfp4"), path, e)),
            path + ": tensor blk.2.ffn_up_exps.bias: shape [32, 4, 1, 1], expected [32, 8]");
}

}  // namespace
}  // namespace expertd::engine
