// Mixtral (llama.cpp's `llama` with routed experts) against Hugging Face transformers:
// tests/fixtures/mixtral-tiny, written by tools/reference/make_mixtral_fixture.py (llama.cpp's own
// converter made the GGUF: q/k permuted for NORM RoPE, merged ffn_*_exps, a SentencePiece vocab).
// The forward with experts from the file and from a real expertd, expert-run by model name, the
// tokenizer, and the loader's errors on malformed Mixtral files.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>

#include "engine/cpu_engine.h"
#include "storage/gguf_writer.h"
#include "testing/temp_dir.h"
#include "tests/engine/fixture.h"
#include "tests/engine/fixture_daemon.h"
#include "tests/engine/gguf_edit.h"
#include "text/tokenizer.h"

namespace expertd::engine {
namespace {

using namespace expertd::text;

constexpr double kMaxRelErr = 1e-4;

using test::MixtralFixture;

std::string gguf(const std::string& variant) { return MixtralFixture::gguf(variant); }

class MixtralForward : public ::testing::TestWithParam<const char*> {};

TEST_P(MixtralForward, LogitsRoutingAndGreedyTokensMatchTransformers) {
  const double worst = test::expect_file_forward(MixtralFixture::load(), GetParam(), kMaxRelErr);
  RecordProperty("max_rel_err", std::to_string(worst));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, MixtralForward, ::testing::Values("f32", "q8_0"),
                         [](const auto& p) { return std::string(p.param); });

// The q8_0 reference differs from the f32 one far beyond the tolerance, so a test cannot pass on
// the wrong file.
TEST(MixtralForward, VariantsAreDistinguishable) {
  const MixtralFixture fx = MixtralFixture::load();
  const auto a = fx.logits("f32");
  const auto b = fx.logits("q8_0");
  EXPECT_GT(test::rel_err(a.data(), b.data(), a.size()), 20 * kMaxRelErr);
}

TEST(MixtralForward, ReadsMixtralFromTheLlamaFile) {
  auto model = DenseModel::load(gguf("q8_0"));
  ASSERT_TRUE(model) << model.error().message;
  const ModelParams& p = model->params();
  EXPECT_EQ(p.architecture, "llama");
  EXPECT_EQ(p.rope, RopeType::Norm);
  EXPECT_FALSE(p.qk_norm);
  EXPECT_EQ(p.n_expert, 8u);
  EXPECT_EQ(p.n_expert_used, 2u);
  EXPECT_EQ(p.n_ff_exp, 32u);  // llama.feed_forward_length: Mixtral's experts are the FFN
  EXPECT_EQ(p.n_head_kv, 2u);
  EXPECT_EQ(p.head_dim, 16u);
  EXPECT_TRUE(model->layer(0).q_norm.empty());
}

// NORM RoPE on the converter's permuted q/k rows is HF's rotate_half on the original ones.
TEST(MixtralForward, NormRopeOnPermutedRowsIsNeoxOnTheOriginal) {
  constexpr uint32_t kDim = 16;
  std::vector<float> original(kDim);
  for (uint32_t i = 0; i < kDim; ++i) original[i] = 0.25f * static_cast<float>(i) - 1.5f;
  // The converter's permutation: row (j, half) of the original goes to 2j + half.
  std::vector<float> permuted(kDim);
  for (uint32_t half = 0; half < 2; ++half) {
    for (uint32_t j = 0; j < kDim / 2; ++j) permuted[2 * j + half] = original[half * kDim / 2 + j];
  }
  rope_neox(original.data(), kDim, 37, 1e6);
  rope_norm(permuted.data(), kDim, 37, 1e6);
  for (uint32_t half = 0; half < 2; ++half) {
    for (uint32_t j = 0; j < kDim / 2; ++j) {
      EXPECT_FLOAT_EQ(permuted[2 * j + half], original[half * kDim / 2 + j]);
    }
  }
}

// The fixture's strings (spaces, digits, unicode through byte fallback, special-token text) give
// the ids and the decoding of tokenizer.json as Mixtral-8x7B ships it, from the converted file.
TEST(MixtralTokenizer, EncodesAndDecodesAsHuggingFace) {
  const MixtralFixture fx = MixtralFixture::load();
  auto file = GgufFile::open(gguf("f32"));
  ASSERT_TRUE(file) << file.error().message;
  auto tok = Tokenizer::from_gguf(*file);
  ASSERT_TRUE(tok) << tok.error().message;
  const auto& cases = fx.meta.at("tokenized");
  ASSERT_GE(cases.size(), 10u);
  for (const auto& c : cases) {
    const std::string text = c.at("text").get<std::string>();
    const auto want = c.at("ids").get<std::vector<uint32_t>>();
    auto ids = tok->encode(text, /*add_special=*/true);
    ASSERT_TRUE(ids) << ids.error().message;
    EXPECT_EQ(*ids, want) << text;
    const std::vector<uint32_t> body(want.begin() + 1, want.end());
    EXPECT_EQ(tok->decode(body), c.at("decoded").get<std::string>()) << text;
  }
  EXPECT_EQ(std::vector<uint32_t>(fx.tokens.begin(), fx.tokens.begin() + fx.prompt),
            cases.at(0).at("ids").get<std::vector<uint32_t>>());
}

// --- Through a real expertd.

class MixtralDaemonTest : public test::FixtureDaemonTest<MixtralFixture> {
 protected:
  MixtralDaemonTest() : FixtureDaemonTest("mixtral", {"f32", "q8_0"}) {}
};

TEST_F(MixtralDaemonTest, LogitsAndGreedyTokensMatchTransformersWithExpertsFromExpertd) {
  expect_matches_transformers(kMaxRelErr);
}

// expert-run by model name alone: the prompt text is tokenised with the file's SentencePiece
// vocabulary and the answer is transformers' greedy continuation.
TEST_F(MixtralDaemonTest, ExpertRunRunsMixtralByModelName) { expect_expert_run_by_name("f32"); }

// --- Malformed Mixtral files: one-line errors that name the key or tensor.

TEST(MixtralMalformed, TheUnchangedCopyLoads) {
  expertd::test::TempDir dir;
  EXPECT_EQ(test::load_error(test::rewrite(gguf("q8_0"), dir.path() + "/same.gguf", {})),
            "(loaded)");
}

TEST(MixtralMalformed, AMissingExpertUsedCountNamesTheKey) {
  expertd::test::TempDir dir;
  test::Edit e;
  e.key = "llama.expert_used_count";
  e.set_key = [](GgufWriter&) {};  // dropped
  const std::string path = dir.path() + "/m.gguf";
  const std::string msg = test::load_error(test::rewrite(gguf("q8_0"), path, e));
  EXPECT_EQ(msg, path + ": llama.expert_used_count is missing");
}

TEST(MixtralMalformed, AMissingExpertCountNamesTheKey) {
  expertd::test::TempDir dir;
  test::Edit e;
  e.key = "llama.expert_count";
  e.set_key = [](GgufWriter&) {};
  const std::string msg = test::load_error(test::rewrite(gguf("q8_0"), dir.path() + "/m.gguf", e));
  EXPECT_NE(msg.find("llama.expert_count"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

TEST(MixtralMalformed, AnExpertCountThatDisagreesWithTheTensorsNamesBoth) {
  expertd::test::TempDir dir;
  test::Edit e;
  e.key = "llama.expert_count";
  e.set_key = [](GgufWriter& w) { w.set_u32("llama.expert_count", 4); };
  const std::string msg = test::load_error(test::rewrite(gguf("q8_0"), dir.path() + "/m.gguf", e));
  EXPECT_NE(msg.find("blk.0.ffn_gate_exps.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("8"), std::string::npos) << msg;
  EXPECT_NE(msg.find("4"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

TEST(MixtralMalformed, AMissingExpertTensorIsNamedAtLoad) {
  expertd::test::TempDir dir;
  test::Edit e;
  e.drop_tensor = "blk.2.ffn_down_exps.weight";
  const std::string path = dir.path() + "/m.gguf";
  EXPECT_EQ(test::load_error(test::rewrite(gguf("q8_0"), path, e)),
            path + ": tensor blk.2.ffn_down_exps.weight is missing");
}

// llama.cpp's first Mixtral GGUFs stored one tensor per expert (blk.N.ffn_gate.E.weight).
TEST(MixtralMalformed, PerExpertTensorsAreRefusedNamingTheLayout) {
  expertd::test::TempDir dir;
  test::Edit e;
  e.reshape_tensor = "blk.0.ffn_gate_exps.weight";
  e.new_ne = {64, 32};
  e.rename_to = "blk.0.ffn_gate.0.weight";
  const std::string path = dir.path() + "/m.gguf";
  EXPECT_EQ(test::load_error(test::rewrite(gguf("q8_0"), path, e)),
            path +
                ": tensor blk.0.ffn_gate_exps.weight is missing: the experts are one tensor "
                "each (blk.0.ffn_gate.0.weight, llama.cpp's early Mixtral layout, which "
                "llama.cpp no longer loads either); convert the model again");
}

TEST(MixtralMalformed, RopeScalingIsRefusedByName) {
  expertd::test::TempDir dir;
  test::Edit e;
  e.key = "llama.rope.scaling.type";
  e.set_key = [](GgufWriter& w) { w.set_string("llama.rope.scaling.type", "yarn"); };
  const std::string path = dir.path() + "/m.gguf";
  const std::string msg = test::load_error(test::rewrite(gguf("q8_0"), path, e));
  EXPECT_EQ(msg, path +
                     ": llama.rope.scaling.type = yarn: the engine runs llama without RoPE "
                     "scaling");
}

}  // namespace
}  // namespace expertd::engine
