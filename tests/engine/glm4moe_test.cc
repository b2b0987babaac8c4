// GLM-4.5 (llama.cpp's `glm4moe`) against Hugging Face transformers: tests/fixtures/glm4moe-tiny,
// written by tools/reference/make_glm4moe_fixture.py (llama.cpp's own converter made the f32 GGUF,
// MTP block included; the q8_0 one has its routed experts re-encoded). The forward with experts
// from the file and from a real expertd (q/k/v biases, per-head q/k norms, partial NEOX RoPE, the
// dense first layer, sigmoid routing with the selection bias, the routed scaling factor and the
// shared expert all matter to the logits), expert-run by model name, and the loader's errors on
// malformed GLM-4.5 files.
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "engine/cpu_engine.h"
#include "storage/gguf_writer.h"
#include "testing/temp_dir.h"
#include "tests/engine/fixture.h"
#include "tests/engine/fixture_daemon.h"
#include "tests/engine/gguf_edit.h"

namespace expertd::engine {
namespace {

constexpr double kMaxRelErr = 1e-4;

using test::Edit;
using test::Glm4MoeFixture;

std::string gguf(const std::string& variant) { return Glm4MoeFixture::gguf(variant); }

class Glm4MoeForward : public ::testing::TestWithParam<const char*> {};

TEST_P(Glm4MoeForward, LogitsRoutingAndGreedyTokensMatchTransformers) {
  const double worst = test::expect_file_forward(Glm4MoeFixture::load(), GetParam(), kMaxRelErr);
  RecordProperty("max_rel_err", std::to_string(worst));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Glm4MoeForward, ::testing::Values("f32", "q8_0"),
                         [](const auto& p) { return std::string(p.param); });

TEST(Glm4MoeForward, ReadsGlm45FromTheFile) {
  auto model = DenseModel::load(gguf("q8_0"));
  ASSERT_TRUE(model) << model.error().message;
  const ModelParams& p = model->params();
  EXPECT_EQ(p.family, Family::Glm4Moe);
  EXPECT_EQ(p.router, RouterKind::Sigmoid);
  // block_count 4: three main layers and the MTP block the engine skips.
  EXPECT_EQ(p.n_layer, 3u);
  EXPECT_EQ(p.nextn_layers, 1u);
  EXPECT_EQ(p.head_dim, 32u);
  EXPECT_EQ(p.n_rot, 16u);  // partial_rotary_factor 0.5
  EXPECT_EQ(p.rope, RopeType::Neox);
  EXPECT_TRUE(p.qk_norm);
  EXPECT_EQ(p.sigmoid_moe.dense_lead, 1u);
  EXPECT_EQ(p.sigmoid_moe.n_ff, 96u);
  EXPECT_EQ(p.sigmoid_moe.n_shared, 1u);
  EXPECT_EQ(p.sigmoid_moe.n_group, 1u);
  EXPECT_TRUE(p.sigmoid_moe.sigmoid);
  EXPECT_FLOAT_EQ(p.sigmoid_moe.weights_scale, 2.5f);
  EXPECT_TRUE(p.sigmoid_moe.weights_norm);
  EXPECT_TRUE(p.dense_layer(0));
  EXPECT_FALSE(p.dense_layer(1));
  const LayerWeights& dense = model->layer(0);
  EXPECT_EQ(dense.ffn_gate.rows, 96u);
  EXPECT_EQ(dense.gate_inp.rows, 0u);
  const LayerWeights& moe = model->layer(2);
  EXPECT_EQ(moe.exp_bias.size(), 16u);
  EXPECT_EQ(moe.shexp_gate.rows, 32u);
  EXPECT_EQ(moe.bq.size(), 4u * 32u);
  EXPECT_EQ(moe.bk.size(), 2u * 32u);
  EXPECT_TRUE(moe.bo.empty());
}

// prefill() of the whole sequence gives decode()'s last logits to the bit (the dense layer and
// the shared expert as one matmul over the chunk).
TEST(Glm4MoeForward, PrefillIsDecodeToTheBit) {
  const Glm4MoeFixture fx = Glm4MoeFixture::load();
  auto model = DenseModel::load(gguf("q8_0"));
  ASSERT_TRUE(model) << model.error().message;
  auto source = test::FileExpertSource::open(*model);
  ASSERT_TRUE(source) << source.error().message;
  auto engine = create_cpu_engine(*model, **source, EngineOptions{128, 0, 0});
  ASSERT_TRUE(engine) << engine.error().message;
  std::vector<float> decoded(fx.vocab);
  for (uint32_t t : fx.tokens) ASSERT_TRUE((*engine)->decode(t, decoded));
  (*engine)->reset();
  std::vector<float> prefilled(fx.vocab);
  ASSERT_TRUE((*engine)->prefill(fx.tokens, prefilled));
  EXPECT_EQ(prefilled, decoded);
}

// --- Through a real expertd: the MTP block's experts are in the daemon's slice map too.

class Glm4MoeDaemonTest : public test::FixtureDaemonTest<Glm4MoeFixture> {
 protected:
  Glm4MoeDaemonTest() : FixtureDaemonTest("glm4moe", {"f32", "q8_0"}) {}
};

TEST_F(Glm4MoeDaemonTest, LogitsAndGreedyTokensMatchTransformersWithExpertsFromExpertd) {
  expect_matches_transformers(kMaxRelErr);
}

// expert-run by model name alone: the prompt text is tokenised with the file's byte-level BPE and
// the answer is transformers' greedy continuation.
TEST_F(Glm4MoeDaemonTest, ExpertRunRunsGlm45ByModelName) { expect_expert_run_by_name("q8_0"); }

// --- Malformed GLM-4.5 files: one-line errors that name the key or tensor.

std::string error_of(const Edit& edit) {
  expertd::test::TempDir dir;
  return test::load_error(test::rewrite(gguf("q8_0"), dir.path() + "/m.gguf", edit));
}

Edit drop_key(const std::string& key) {
  Edit e;
  e.key = key;
  e.set_key = [](GgufWriter&) {};
  return e;
}

Edit drop_tensor(const std::string& name) {
  Edit e;
  e.drop_tensor = name;
  return e;
}

TEST(Glm4MoeMalformed, TheUnchangedCopyLoads) { EXPECT_EQ(error_of(Edit{}), "(loaded)"); }

TEST(Glm4MoeMalformed, AMissingGroupCountNamesTheKey) {
  const std::string msg = error_of(drop_key("glm4moe.expert_group_count"));
  EXPECT_NE(msg.find("m.gguf: glm4moe.expert_group_count is missing; GLM-4.5 routing needs it"),
            std::string::npos)
      << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

TEST(Glm4MoeMalformed, AMissingSharedExpertCountNamesTheKey) {
  const std::string msg = error_of(drop_key("glm4moe.expert_shared_count"));
  EXPECT_NE(msg.find("m.gguf: glm4moe.expert_shared_count is missing; GLM-4.5's MoE needs it"),
            std::string::npos)
      << msg;
}

TEST(Glm4MoeMalformed, AMissingDenseWidthNamesTheKey) {
  const std::string msg = error_of(drop_key("glm4moe.feed_forward_length"));
  EXPECT_NE(msg.find("m.gguf: glm4moe.feed_forward_length is missing"), std::string::npos) << msg;
}

TEST(Glm4MoeMalformed, AMissingSelectionBiasIsNamed) {
  const std::string msg = error_of(drop_tensor("blk.2.exp_probs_b.bias"));
  EXPECT_NE(msg.find("m.gguf: tensor blk.2.exp_probs_b.bias is missing"), std::string::npos) << msg;
}

TEST(Glm4MoeMalformed, AMissingDenseLayerTensorIsNamed) {
  const std::string msg = error_of(drop_tensor("blk.0.ffn_up.weight"));
  EXPECT_NE(msg.find("m.gguf: tensor blk.0.ffn_up.weight is missing"), std::string::npos) << msg;
}

TEST(Glm4MoeMalformed, AMissingSharedExpertTensorIsNamed) {
  const std::string msg = error_of(drop_tensor("blk.1.ffn_down_shexp.weight"));
  EXPECT_NE(msg.find("m.gguf: tensor blk.1.ffn_down_shexp.weight is missing"), std::string::npos)
      << msg;
}

TEST(Glm4MoeMalformed, AMissingRoutedExpertTensorIsNamedAtLoad) {
  const std::string msg = error_of(drop_tensor("blk.2.ffn_gate_exps.weight"));
  EXPECT_NE(msg.find("tensor blk.2.ffn_gate_exps.weight is missing"), std::string::npos) << msg;
}

TEST(Glm4MoeMalformed, AnExpertCountThatDisagreesWithTheTensorsNamesBoth) {
  Edit e;
  e.key = "glm4moe.expert_count";
  e.set_key = [](GgufWriter& w) { w.set_u32("glm4moe.expert_count", 8); };
  const std::string msg = error_of(e);
  EXPECT_NE(msg.find("blk.1."), std::string::npos) << msg;
  EXPECT_NE(msg.find("16"), std::string::npos) << msg;
  EXPECT_NE(msg.find("8"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

TEST(Glm4MoeMalformed, AGatingFunctionOtherThanSoftmaxOrSigmoidIsNamed) {
  Edit e;
  e.key = "glm4moe.expert_gating_func";
  e.set_key = [](GgufWriter& w) { w.set_u32("glm4moe.expert_gating_func", 3); };
  const std::string msg = error_of(e);
  EXPECT_NE(msg.find("glm4moe.expert_gating_func = 3: glm4moe routers score with softmax (1) or "
                     "sigmoid (2)"),
            std::string::npos)
      << msg;
}

TEST(Glm4MoeMalformed, RopeScalingIsRefusedNamingTheKey) {
  Edit e;
  e.key = "glm4moe.rope.scaling.type";
  e.set_key = [](GgufWriter& w) { w.set_string("glm4moe.rope.scaling.type", "linear"); };
  const std::string msg = error_of(e);
  EXPECT_NE(msg.find("glm4moe.rope.scaling.type = 'linear': glm4moe supports yarn or none"),
            std::string::npos)
      << msg;
}

}  // namespace
}  // namespace expertd::engine
