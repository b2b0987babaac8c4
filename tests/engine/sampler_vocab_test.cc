// Sampling and token text.
#include <gtest/gtest.h>

#include <map>

#include "engine/model.h"
#include "engine/sampler.h"
#include "engine/vocab.h"
#include "tests/engine/fixture.h"

namespace expertd::engine {
namespace {

TEST(Sampler, GreedyTakesTheFirstLargestLogit) {
  Sampler s(SamplerOptions{}, 5);
  const std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f, 1.0f};
  EXPECT_EQ(s.sample(logits), 1u);
  EXPECT_EQ(argmax(logits), 1u);
}

TEST(Sampler, TopPKeepsOnlyTheNucleus) {
  // Probabilities ~0.64, 0.24, 0.09, 0.03: top-p 0.7 keeps the first two only.
  const std::vector<float> logits = {3.0f, 2.0f, 1.0f, 0.0f};
  Sampler s(SamplerOptions{1.0f, 0.7f, 42}, 4);
  std::map<uint32_t, int> counts;
  for (int i = 0; i < 2000; ++i) ++counts[s.sample(logits)];
  EXPECT_EQ(counts.count(2), 0u);
  EXPECT_EQ(counts.count(3), 0u);
  // Renormalised over the nucleus: 0.64 / 0.88 = 0.73 for token 0.
  EXPECT_NEAR(counts[0] / 2000.0, 0.731, 0.04);
}

TEST(Sampler, SeededRunsRepeat) {
  const std::vector<float> logits = {0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 0.6f};
  Sampler a(SamplerOptions{0.8f, 0.95f, 7}, 6);
  Sampler b(SamplerOptions{0.8f, 0.95f, 7}, 6);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(a.sample(logits), b.sample(logits));
}

TEST(Vocab, ByteLevelPiecesDecodeToBytes) {
  EXPECT_EQ(decode_byte_level("Ġthe"), " the");
  EXPECT_EQ(decode_byte_level("Ċ"), "\n");
  EXPECT_EQ(decode_byte_level("Ā"), std::string(1, '\0'));
  EXPECT_EQ(decode_byte_level("<|im_end|>"), "<|im_end|>");
  // "é" in UTF-8 is C3 A9, which byte-level BPE spells "Ã©".
  EXPECT_EQ(decode_byte_level("Ã©"), "é");
}

TEST(Vocab, TheFixtureVocabularySpellsItsPrompt) {
  const auto fx = test::TinyFixture::load();
  auto model = DenseModel::load(fx.gguf("f32"));
  ASSERT_TRUE(model);
  const auto vocab = Vocab::from_gguf(model->gguf());
  ASSERT_TRUE(vocab.has_value());
  EXPECT_EQ(vocab->size(), 256u);
  EXPECT_EQ(vocab->decode(fx.tokens), fx.meta.at("text").get<std::string>());
  for (uint32_t b = 0; b < 256; ++b) EXPECT_EQ(vocab->decode(b), std::string(1, char(b)));
}

}  // namespace
}  // namespace expertd::engine
