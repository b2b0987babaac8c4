// engine/tokenizer against Hugging Face `tokenizers`: the GGUFs and HF's encodings of a fixed
// corpus of 10,000 strings come from tools/reference/make_tokenizer_fixtures.py (small byte-level
// BPE vocabularies trained with each model family's pre-tokenizer, and a Mixtral-style
// SentencePiece BPE with byte fallback, written as llama.cpp's converter writes them).
#include "text/tokenizer.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "storage/gguf_writer.h"
#include "testing/temp_dir.h"
#include "tests/engine/fixture.h"

namespace expertd::engine {
namespace {

using namespace expertd::text;

using expertd::test::TempDir;
using test::fixture_path;
using test::read_json;

std::string show(const std::vector<uint32_t>& ids) {
  std::string s;
  for (const uint32_t id : ids) s += std::to_string(id) + " ";
  return s;
}

std::string escaped(const std::string& s) { return nlohmann::json(s).dump(); }

Tokenizer load(const std::string& name) {
  auto f = GgufFile::open(fixture_path("tokenizers/" + name + ".gguf"));
  EXPECT_TRUE(f) << f.error().message;
  auto t = Tokenizer::from_gguf(*f);
  EXPECT_TRUE(t) << t.error().message;
  return std::move(*t);
}

class TokenizerVsHf : public ::testing::TestWithParam<std::string> {};

TEST_P(TokenizerVsHf, EveryCorpusStringEncodesAndDecodesAsHf) {
  const std::string name = GetParam();
  const Tokenizer tok = load(name);
  const nlohmann::json corpus = read_json(fixture_path("tokenizers/corpus.json"));
  const nlohmann::json ref = read_json(fixture_path("tokenizers/" + name + ".json"));
  EXPECT_EQ(tok.pre(), ref["pre"].get<std::string>());
  ASSERT_GE(corpus.size(), 10000u);
  ASSERT_EQ(ref["ids"].size(), corpus.size());
  const nlohmann::json& decoded = ref["decoded"];
  size_t matched = 0;
  size_t round_trips = 0;
  size_t reported = 0;
  for (size_t i = 0; i < corpus.size(); ++i) {
    const std::string text = corpus[i].get<std::string>();
    const auto want = ref["ids"][i].get<std::vector<uint32_t>>();
    auto got = tok.encode(text, /*add_special=*/false);
    ASSERT_TRUE(got) << got.error().message;
    if (*got == want) {
      ++matched;
    } else if (reported++ < 20) {
      ADD_FAILURE() << name << " string " << i << " " << escaped(text) << "\n  hf:   " << show(want)
                    << "\n  ours: " << show(*got);
    }
    // HF's decoding is the string itself except where NFC changed it (the fixture has those).
    const std::string key = std::to_string(i);
    const std::string expect = decoded.contains(key) ? decoded[key].get<std::string>() : text;
    if (tok.decode(want) == expect) {
      ++round_trips;
    } else if (reported++ < 20) {
      ADD_FAILURE() << name << " decode of string " << i << " " << escaped(text) << " gives "
                    << escaped(tok.decode(want));
    }
  }
  EXPECT_EQ(matched, corpus.size())
      << name << ": " << matched << " of " << corpus.size() << " strings encode as HF does";
  EXPECT_EQ(round_trips, corpus.size());
  std::printf("%s: %zu / %zu strings encoded as HF, %zu decoded as HF\n", name.c_str(), matched,
              corpus.size(), round_trips);

  // With special tokens: BOS where the tokenizer adds it (HF's post-processor, the GGUF's
  // add_bos_token).
  const nlohmann::json& special = ref["ids_special"];
  ASSERT_GT(special.size(), 0u);
  for (size_t i = 0; i < special.size(); ++i) {
    auto got = tok.encode(corpus[i].get<std::string>(), /*add_special=*/true);
    ASSERT_TRUE(got) << got.error().message;
    EXPECT_EQ(*got, special[i].get<std::vector<uint32_t>>()) << name << " string " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Families, TokenizerVsHf,
                         ::testing::Values("gpt2", "qwen2", "llama3", "deepseek-v3", "mixtral",
                                           "glm4", "gpt-oss", "kimi-k2"),
                         [](const auto& param_info) {
                           std::string n = param_info.param;
                           for (char& c : n) c = c == '-' ? '_' : c;
                           return n;
                         });

TEST(Tokenizer, SpecialTokensAreWholeTokensAndBosFollowsAddBos) {
  const Tokenizer tok = load("llama3");
  ASSERT_TRUE(tok.bos().has_value());
  EXPECT_TRUE(tok.add_bos());
  EXPECT_EQ(tok.type(*tok.bos()), TokenType::kControl);
  auto ids = tok.encode("<|begin_of_text|>hi<|eot_id|><|eot_id", false);
  ASSERT_TRUE(ids);
  ASSERT_GE(ids->size(), 3u);
  EXPECT_EQ((*ids)[0], *tok.bos());
  EXPECT_EQ(tok.decode((*ids)[0]), "<|begin_of_text|>");
  EXPECT_EQ(tok.decode(*ids), "<|begin_of_text|>hi<|eot_id|><|eot_id");
  auto with_bos = tok.encode("hi", true);
  ASSERT_TRUE(with_bos);
  EXPECT_EQ(with_bos->front(), *tok.bos());
  EXPECT_EQ(tok.decode(UINT32_MAX), "");

  const Tokenizer gpt2 = load("gpt2");
  EXPECT_FALSE(gpt2.add_bos());
  auto no_bos = gpt2.encode("hi", true);
  ASSERT_TRUE(no_bos);
  EXPECT_EQ(no_bos->size(), gpt2.encode("hi", false)->size());
}

// Long runs (a pasted file, a whitespace block) are one pre-token each: they must neither hit
// PCRE2's limits nor lose bytes.
TEST(Tokenizer, LongRunsEncodeAndRoundTrip) {
  const std::string text = std::string(200000, ' ') + "a" + std::string(200000, 'x') +
                           std::string(100000, '7') + std::string(50000, '\n') + "\xe4\xbd\xa0";
  for (const char* name :
       {"gpt2", "qwen2", "llama3", "deepseek-v3", "mixtral", "glm4", "gpt-oss", "kimi-k2"}) {
    const Tokenizer tok = load(name);
    auto ids = tok.encode(text, false);
    ASSERT_TRUE(ids) << name << ": " << ids.error().message;
    EXPECT_EQ(tok.decode(*ids), text) << name;
  }
}

TEST(Tokenizer, InvalidUtf8IsAnError) {
  const Tokenizer tok = load("gpt2");
  for (const std::string& bad : {std::string("a\xff"), std::string("\xc3"),
                                 std::string("\xed\xa0\x80"), std::string("\xc0\xaf")}) {
    auto r = tok.encode(bad, false);
    ASSERT_FALSE(r) << escaped(bad);
    EXPECT_NE(r.error().message.find("not valid UTF-8"), std::string::npos) << r.error().message;
  }
}

// A GGUF whose tokenizer keys are those of `gpt2.gguf` with `pre` (or the model) replaced.
Result<Tokenizer> with_keys(const std::string& dir, const std::string& model,
                            const std::string& pre) {
  auto src = GgufFile::open(fixture_path("tokenizers/gpt2.gguf"));
  EXPECT_TRUE(src);
  const GgufArray* tokens = src->find("tokenizer.ggml.tokens")->as_array();
  const GgufArray* merges = src->find("tokenizer.ggml.merges")->as_array();
  const GgufArray* types = src->find("tokenizer.ggml.token_type")->as_array();
  std::vector<std::string> t, m;
  std::vector<int32_t> ty;
  for (uint64_t i = 0; i < tokens->count; ++i) {
    t.emplace_back(tokens->string_at(i));
    ty.push_back(static_cast<int32_t>(*types->int_at(i)));
  }
  for (uint64_t i = 0; i < merges->count; ++i) m.emplace_back(merges->string_at(i));
  GgufWriter w;
  w.set_string("tokenizer.ggml.model", model);
  if (!pre.empty()) w.set_string("tokenizer.ggml.pre", pre);
  w.set_array("tokenizer.ggml.tokens", std::span<const std::string>(t));
  w.set_array("tokenizer.ggml.merges", std::span<const std::string>(m));
  w.set_array("tokenizer.ggml.token_type", std::span<const int32_t>(ty));
  const std::string path = dir + "/" + model + pre + ".gguf";
  EXPECT_TRUE(w.begin(path, GgufWriterOptions{.sync = false}));
  EXPECT_TRUE(w.finish());
  EXPECT_TRUE(w.commit());
  auto f = GgufFile::open(path);
  EXPECT_TRUE(f) << f.error().message;
  return Tokenizer::from_gguf(*f);
}

TEST(Tokenizer, UnknownPreTokenizerOrModelIsRefusedByName) {
  TempDir dir;
  auto unknown = with_keys(dir.path(), "gpt2", "chameleon");
  ASSERT_FALSE(unknown);
  EXPECT_NE(unknown.error().message.find("tokenizer.ggml.pre \"chameleon\" is not supported"),
            std::string::npos)
      << unknown.error().message;
  EXPECT_NE(unknown.error().message.find("(supported: default, gpt-2, qwen2, llama-bpe, llama3, "
                                         "deepseek-v3, glm4, gpt-4o, kimi-k2)"),
            std::string::npos)
      << unknown.error().message;
  auto rwkv = with_keys(dir.path(), "rwkv", "default");
  ASSERT_FALSE(rwkv);
  EXPECT_NE(rwkv.error().message.find("tokenizer.ggml.model \"rwkv\" is not supported"),
            std::string::npos)
      << rwkv.error().message;
}

TEST(Tokenizer, NoPreKeyIsDefaultWhichSplitsAsGpt2) {
  TempDir dir;
  auto def = with_keys(dir.path(), "gpt2", "");
  ASSERT_TRUE(def) << def.error().message;
  EXPECT_EQ(def->pre(), "default");
  const Tokenizer gpt2 = load("gpt2");
  const nlohmann::json corpus = read_json(fixture_path("tokenizers/corpus.json"));
  for (size_t i = 0; i < 500; ++i) {
    const std::string s = corpus[i].get<std::string>();
    EXPECT_EQ(*def->encode(s, false), *gpt2.encode(s, false)) << escaped(s);
  }
}

}  // namespace
}  // namespace expertd::engine

namespace expertd::engine {
namespace {

TEST(Tokenizer, SentencePieceFallsBackToBytesAndPrefixesEachStretch) {
  const Tokenizer tok = load("mixtral");
  EXPECT_TRUE(tok.add_bos());
  EXPECT_EQ(tok.type(0), TokenType::kUnknown);
  // A character the vocabulary does not have (U+16A0, runic) becomes its three UTF-8 bytes
  // (HF: ▁ <0xE1> <0x9A> <0xA0>).
  auto ids = tok.encode("\xe1\x9a\xa0", false);
  ASSERT_TRUE(ids);
  ASSERT_EQ(ids->size(), 4u) << show(*ids);
  EXPECT_EQ(tok.decode((*ids)[0]), " ");
  for (size_t i = 1; i < 4; ++i) EXPECT_EQ(tok.type((*ids)[i]), TokenType::kByte);
  EXPECT_EQ(tok.decode(*ids), "\xe1\x9a\xa0");
  // Text after a special token gets its own ▁ (HF's Prepend normaliser runs per stretch).
  auto s = tok.encode("a</s>b", true);
  ASSERT_TRUE(s);
  EXPECT_EQ(s->front(), 1u);
  EXPECT_EQ(tok.decode(*s), "<s> a</s> b");
}

}  // namespace
}  // namespace expertd::engine
