// Sampling and token text.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <set>

#include "engine/model.h"
#include "tests/engine/fixture.h"
#include "text/sampler.h"
#include "text/vocab.h"

namespace expertd::engine {
namespace {

using namespace expertd::text;

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

// How often each token is drawn: `seeds` samplers of `draws` samples each.
std::map<uint32_t, int> tally(const SamplerOptions& base, const std::vector<float>& logits,
                              int seeds, int draws) {
  std::map<uint32_t, int> counts;
  for (int seed = 0; seed < seeds; ++seed) {
    SamplerOptions o = base;
    o.seed = static_cast<uint64_t>(seed);
    Sampler s(o, static_cast<uint32_t>(logits.size()));
    for (int i = 0; i < draws; ++i) ++counts[s.sample(logits)];
  }
  return counts;
}

TEST(Sampler, TopKNeverPicksBeyondTheKthToken) {
  // Nearly flat: without top-k every token is drawn often.
  const std::vector<float> logits = {2.0f, 1.9f, 1.8f, 1.7f};
  SamplerOptions o;
  o.temperature = 1.0f;
  EXPECT_GT(tally(o, logits, 50, 40)[2], 300);
  o.top_k = 2;
  auto counts = tally(o, logits, 50, 40);
  EXPECT_EQ(counts.count(2), 0u);
  EXPECT_EQ(counts.count(3), 0u);
  // Renormalised over the two: e^0.1 / (1 + e^0.1) = 0.525 for token 0.
  EXPECT_NEAR(counts[0] / 2000.0, 0.525, 0.04);
  // top_k 1 is greedy; top_k past the vocabulary keeps everything.
  o.top_k = 1;
  EXPECT_EQ(tally(o, logits, 20, 20)[0], 400);
  o.top_k = 10;
  EXPECT_GT(tally(o, logits, 50, 40)[3], 300);
}

TEST(Sampler, MinPKeepsTokensAtLeastMinPTimesTheTopProbability) {
  // Probabilities relative to the top: 1, e^-1 = 0.368, e^-2 = 0.135.
  const std::vector<float> logits = {0.0f, -1.0f, -2.0f};
  SamplerOptions o;
  o.temperature = 1.0f;
  o.min_p = 0.2f;
  auto counts = tally(o, logits, 50, 40);
  EXPECT_EQ(counts.count(2), 0u);
  EXPECT_NEAR(counts[0] / 2000.0, 1.0 / (1.0 + std::exp(-1.0)), 0.04);
  o.min_p = 0.1f;  // 0.135 >= 0.1: token 2 is back
  EXPECT_GT(tally(o, logits, 50, 40)[2], 100);
  o.min_p = 0.5f;  // only the top token
  EXPECT_EQ(tally(o, logits, 10, 20)[0], 200);
  o.min_p = 0.0f;
  EXPECT_GT(tally(o, logits, 50, 40)[2], 100);
}

TEST(Sampler, TemperatureComesBeforeMinP) {
  // At temperature 2 token 1 has e^-0.5 = 0.61 of the top probability, at 1 only e^-1 = 0.37.
  const std::vector<float> logits = {0.0f, -1.0f};
  SamplerOptions o;
  o.min_p = 0.5f;
  o.temperature = 1.0f;
  EXPECT_EQ(tally(o, logits, 10, 50).count(1), 0u);
  o.temperature = 2.0f;
  EXPECT_GT(tally(o, logits, 10, 50)[1], 100);
}

TEST(Sampler, TopPRenormalisesOverWhatTopKKept) {
  // Over all four: 0.644, 0.237, 0.087, 0.032; top-p 0.9 needs three tokens. Over the top 3:
  // 0.665, 0.245, 0.090; top-p 0.9 needs two.
  const std::vector<float> logits = {3.0f, 2.0f, 1.0f, 0.0f};
  SamplerOptions o;
  o.temperature = 1.0f;
  o.top_p = 0.9f;
  EXPECT_GT(tally(o, logits, 50, 40)[2], 80);
  o.top_k = 3;
  EXPECT_EQ(tally(o, logits, 50, 40).count(2), 0u);
}

TEST(Sampler, RepetitionPenaltyDividesPositiveAndMultipliesNegativeLogitsOnce) {
  SamplerOptions o;
  o.repeat_penalty = 2.0f;
  Sampler s(o, 5);
  for (const uint32_t t : {0u, 1u, 0u, 0u, 4u}) s.accept(t);
  const std::vector<float> logits = {2.0f, -2.0f, 0.5f, 1.5f, 0.0f};
  // Token 0 (three times in the window) once: 2 / 2 = 1; token 1: -2 * 2 = -4; 4 stays 0.
  EXPECT_EQ(s.sample(logits), 3u);  // 1.5 now beats token 0's 1.0
  const std::vector<double> want = {1.0, -4.0, 0.5, 1.5, 0.0};
  EXPECT_EQ(std::vector<double>(s.penalised_logits().begin(), s.penalised_logits().end()), want);
  // The sampled token joined the window: 1.5 / 2 = 0.75, so token 0 wins now.
  EXPECT_EQ(s.sample(logits), 0u);
  EXPECT_EQ(s.penalised_logits()[3], 0.75);
  // A penalty below 1 favours repeats: 2 / 0.5 = 4.
  o.repeat_penalty = 0.5f;
  Sampler favour(o, 5);
  favour.accept(0);
  EXPECT_EQ(favour.sample(logits), 0u);
  EXPECT_EQ(favour.penalised_logits()[0], 4.0);
}

TEST(Sampler, RepetitionPenaltyLooksBackRepeatLastNTokens) {
  SamplerOptions o;
  o.repeat_penalty = 4.0f;
  o.repeat_last_n = 2;
  Sampler s(o, 4);
  for (const uint32_t t : {0u, 1u, 2u}) s.accept(t);  // 0 has left the window
  const std::vector<float> logits = {1.0f, 1.0f, 1.0f, 0.5f};
  EXPECT_EQ(s.sample(logits), 0u);
  const std::vector<double> want = {1.0, 0.25, 0.25, 0.5};
  EXPECT_EQ(std::vector<double>(s.penalised_logits().begin(), s.penalised_logits().end()), want);
  // Window now {2, 0}: token 1 is back at 1.0 and wins.
  EXPECT_EQ(s.sample(logits), 1u);
  // repeat_last_n 0 turns the penalty off.
  o.repeat_last_n = 0;
  Sampler off(o, 4);
  off.accept(0);
  EXPECT_EQ(off.sample(logits), 0u);
  EXPECT_EQ(off.penalised_logits()[0], 1.0);
}

TEST(Sampler, EveryOptionIsReproducibleFromTheSeedAndTheSeedMatters) {
  std::vector<float> logits(50);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = std::sin(static_cast<float>(i));
  SamplerOptions o{0.9f, 0.95f, 7, 20, 0.05f, 1.3f, 8};
  auto run = [&](uint64_t seed) {
    SamplerOptions so = o;
    so.seed = seed;
    Sampler s(so, 50);
    s.accept(3);
    std::vector<uint32_t> out;
    for (int i = 0; i < 200; ++i) out.push_back(s.sample(logits));
    return out;
  };
  const auto a = run(7);
  EXPECT_EQ(a, run(7));
  EXPECT_NE(a, run(8));
  EXPECT_GT(std::set<uint32_t>(a.begin(), a.end()).size(), 3u);
}

TEST(Sampler, InvalidOptionsAreRefusedNamingTheOption) {
  auto error = [](SamplerOptions o) {
    auto s = Sampler::create(o, 10);
    EXPECT_FALSE(s.ok());
    return s ? std::string() : s.error().message;
  };
  SamplerOptions o;
  o.temperature = -0.5f;
  EXPECT_EQ(error(o), "temperature must be 0 (greedy) or positive, got -0.5");
  o = {};
  o.top_p = 0.0f;
  EXPECT_EQ(error(o), "top_p must be in (0, 1], got 0");
  o.top_p = 1.5f;
  EXPECT_EQ(error(o), "top_p must be in (0, 1], got 1.5");
  o = {};
  o.min_p = -0.1f;
  EXPECT_EQ(error(o), "min_p must be in [0, 1], got -0.1");
  o.min_p = 1.1f;
  EXPECT_EQ(error(o), "min_p must be in [0, 1], got 1.1");
  o = {};
  o.top_k = -1;
  EXPECT_EQ(error(o), "top_k must be 0 (off) or positive, got -1");
  o = {};
  o.repeat_penalty = 0.0f;
  EXPECT_EQ(error(o), "repeat_penalty must be positive (1 = off), got 0");
  o.repeat_penalty = -1.0f;
  EXPECT_EQ(error(o), "repeat_penalty must be positive (1 = off), got -1");
  o = {};
  o.repeat_last_n = -1;
  EXPECT_EQ(error(o), "repeat_last_n must be in [0, 1048576] (0 = off), got -1");
  o = {};
  o.temperature = std::nanf("");
  EXPECT_EQ(error(o), "temperature must be 0 (greedy) or positive, got nan");
  // The edges are valid.
  EXPECT_TRUE(Sampler::create(SamplerOptions{0.0f, 1.0f, 0, 0, 1.0f, 0.01f, 0}, 10).ok());
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

namespace expertd::engine {
namespace {

using namespace expertd::text;

// Step 0 and the rest of step 1: logit_bias is added first; presence and frequency penalties
// subtract over the window's counts, after the repetition penalty.
TEST(Sampler, LogitBiasThenPresenceAndFrequencyPenalties) {
  const std::vector<float> logits = {1.0f, 2.0f, 3.0f};
  SamplerOptions o;
  o.logit_bias = {{0, 10.0f}};
  Sampler biased(o, 3);
  EXPECT_EQ(biased.sample(logits), 0u);
  EXPECT_EQ(biased.penalised_logits()[0], 11.0);

  SamplerOptions f;
  f.frequency_penalty = 0.5f;
  Sampler freq(f, 3);
  for (int i = 0; i < 3; ++i) freq.accept(2);
  EXPECT_EQ(freq.sample(logits), 1u);  // 3 - 3 x 0.5 = 1.5 < 2
  EXPECT_EQ(freq.penalised_logits()[2], 1.5);

  SamplerOptions p;
  p.presence_penalty = 1.5f;
  p.repeat_penalty = 1.5f;  // first: 3 / 1.5 = 2, then - 1.5
  Sampler pres(p, 3);
  pres.accept(2);
  pres.accept(2);
  EXPECT_EQ(pres.sample(logits), 1u);
  EXPECT_EQ(pres.penalised_logits()[2], 0.5);
  // The chosen token joined the window: 1 is now penalised too (2 / 1.5 - 1.5 < 1).
  EXPECT_EQ(pres.sample(logits), 0u);

  SamplerOptions bad;
  bad.presence_penalty = 2.5f;
  EXPECT_NE(validate(bad).error().message.find("presence_penalty must be in [-2, 2], got 2.5"),
            std::string::npos);
  bad = {};
  bad.logit_bias = {{7, -101.0f}};
  EXPECT_NE(validate(bad).error().message.find("logit_bias of token 7 must be in [-100, 100]"),
            std::string::npos);
}

}  // namespace
}  // namespace expertd::engine
