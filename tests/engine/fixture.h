// The committed reference fixtures (tests/fixtures/, written by tools/reference/*.py): the
// qwen3moe-tiny models with the logits and routing Hugging Face transformers computed for them,
// and the dequantisation vectors of the `gguf` package.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "testing/paths.h"

namespace expertd::engine::test {

// The committed fixture REL, as the build copied it (testing's data_path: found relative to the
// test binary, so a copied build folder finds it too).
inline std::string fixture_path(const std::string& rel) { return expertd::test::data_path(rel); }

inline std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(f.good()) << path;
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

inline std::vector<float> read_f32(const std::string& path) {
  const std::vector<uint8_t> b = read_bytes(path);
  EXPECT_EQ(b.size() % 4, 0u) << path;
  std::vector<float> v(b.size() / 4);
  std::memcpy(v.data(), b.data(), v.size() * 4);
  return v;
}

inline nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  EXPECT_TRUE(f.good()) << path;
  return nlohmann::json::parse(f);
}

struct TraceEntry {
  uint32_t token = 0;
  uint32_t layer = 0;
  std::vector<uint32_t> experts;
  std::vector<float> weights;
};

inline std::vector<TraceEntry> read_trace(const std::string& path) {
  std::ifstream f(path);
  EXPECT_TRUE(f.good()) << path;
  std::vector<TraceEntry> out;
  std::string line;
  while (std::getline(f, line)) {
    const auto j = nlohmann::json::parse(line);
    out.push_back(TraceEntry{j.at("token").get<uint32_t>(), j.at("layer").get<uint32_t>(),
                             j.at("experts").get<std::vector<uint32_t>>(),
                             j.at("weights").get<std::vector<float>>()});
  }
  return out;
}

// The tiny model's fixture: its tokens and, per variant ("f32", "q8_0"), the GGUF, the expected
// logits [n_tokens][vocab] and the routing trace.
struct TinyFixture {
  nlohmann::json meta;
  std::vector<uint32_t> tokens;
  uint32_t vocab = 0;

  static TinyFixture load() {
    TinyFixture f;
    f.meta = read_json(fixture_path("qwen3moe-tiny/fixture.json"));
    f.tokens = f.meta.at("tokens").get<std::vector<uint32_t>>();
    f.vocab = f.meta.at("logits_shape").at(1).get<uint32_t>();
    return f;
  }
  std::string gguf(const std::string& variant) const {
    return fixture_path("qwen3moe-tiny/" +
                        meta.at("variants").at(variant).at("gguf").get<std::string>());
  }
  std::vector<float> logits(const std::string& variant) const {
    return read_f32(fixture_path("qwen3moe-tiny/" +
                                 meta.at("variants").at(variant).at("logits").get<std::string>()));
  }
  std::vector<TraceEntry> trace(const std::string& variant) const {
    return read_trace(fixture_path("qwen3moe-tiny/" +
                                   meta.at("variants").at(variant).at("trace").get<std::string>()));
  }
};

// What a fixture.json of the converter-made fixtures gives: `tokens` (the prompt, then
// transformers' greedy continuation), the prompt's length and the vocabulary (a logits row).
struct SequenceFixture {
  nlohmann::json meta;
  std::vector<uint32_t> tokens;
  uint32_t prompt = 0;
  uint32_t vocab = 0;

  void read(const std::string& dir) {
    meta = read_json(fixture_path(dir + "/fixture.json"));
    tokens = meta.at("tokens").get<std::vector<uint32_t>>();
    prompt = meta.at("prompt_tokens").get<uint32_t>();
    vocab = meta.at("logits_shape").at(1).get<uint32_t>();
  }
};

// A converter-made fixture with a file set per variant ("f32", "q8_0"; Self::kDir under
// tests/fixtures): `tokens` is the prompt then transformers' greedy continuation on the f32
// weights; per variant the GGUF llama.cpp's converter made (model-V.gguf), the expected logits
// [n_tokens][vocab] (logits-V.bin), the routing trace (trace-V.jsonl) and the greedy tokens (the
// q8_0 ones, greedy_q8_0, computed on the dequantised experts).
template <typename Self>
struct VariantFixture : SequenceFixture {
  static Self load() {
    Self f;
    f.read(Self::kDir);
    return f;
  }
  static std::string gguf(const std::string& variant) {
    return fixture_path(std::string(Self::kDir) + "/model-" + variant + ".gguf");
  }
  std::vector<float> logits(const std::string& variant) const {
    return read_f32(fixture_path(std::string(Self::kDir) + "/logits-" + variant + ".bin"));
  }
  std::vector<TraceEntry> trace(const std::string& variant) const {
    return read_trace(fixture_path(std::string(Self::kDir) + "/trace-" + variant + ".jsonl"));
  }
  std::vector<uint32_t> greedy(const std::string& variant) const {
    return variant == "f32" ? tokens : meta.at("greedy_q8_0").get<std::vector<uint32_t>>();
  }
};

// tools/reference/make_mixtral_fixture.py's.
struct MixtralFixture : VariantFixture<MixtralFixture> {
  static constexpr const char* kDir = "mixtral-tiny";
};

// tools/reference/make_glm4moe_fixture.py's: GLM-4.5 with its MTP block (which the engine skips).
struct Glm4MoeFixture : VariantFixture<Glm4MoeFixture> {
  static constexpr const char* kDir = "glm4moe-tiny";
};

// The gptoss-tiny fixture (tools/reference/make_gptoss_fixture.py): "mxfp4" (the release's
// layout, repacked by llama.cpp's converter) and "f32" hold the same expert values, so one set of
// logits, routing and greedy tokens serves both.
struct GptOssFixture : SequenceFixture {
  static GptOssFixture load() {
    GptOssFixture f;
    f.read("gptoss-tiny");
    return f;
  }
  static std::string gguf(const std::string& variant) {
    return fixture_path("gptoss-tiny/model-" + variant + ".gguf");
  }
  std::vector<float> logits(const std::string&) const {
    return read_f32(fixture_path("gptoss-tiny/logits.bin"));
  }
  std::vector<TraceEntry> trace(const std::string&) const {
    return read_trace(fixture_path("gptoss-tiny/trace.jsonl"));
  }
  std::vector<uint32_t> greedy(const std::string&) const { return tokens; }
};

// ||a - b|| / ||b||, in double.
inline double rel_err(const float* a, const float* b, size_t n) {
  double num = 0.0;
  double den = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(a[i]) - static_cast<double>(b[i]);
    num += d * d;
    den += static_cast<double>(b[i]) * static_cast<double>(b[i]);
  }
  return std::sqrt(num / den);
}

inline uint32_t argmax(const std::vector<float>& v) {
  return static_cast<uint32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

// Feeds fx.tokens to `engine`: the logits of every position within `tol` (relative) of
// transformers' (returns the worst), and the routing as transformers routed (weights within
// `weight_tol`). Fx: MixtralFixture or GptOssFixture.
template <typename Fx>
double expect_fixture_logits(Engine& engine, const Fx& fx, const std::string& variant, double tol,
                             double weight_tol) {
  std::vector<RoutingRecord> routing;
  engine.set_routing_log(&routing);
  const std::vector<float> expected = fx.logits(variant);
  EXPECT_EQ(expected.size(), fx.tokens.size() * fx.vocab);
  std::vector<float> logits(fx.vocab);
  double worst = 0.0;
  for (size_t t = 0; t < fx.tokens.size(); ++t) {
    const Status st = engine.decode(fx.tokens[t], logits);
    EXPECT_TRUE(st) << st.error().message;
    if (!st) break;
    const double err = test::rel_err(logits.data(), expected.data() + t * fx.vocab, fx.vocab);
    EXPECT_LE(err, tol) << variant << " position " << t;
    worst = std::max(worst, err);
  }
  const std::vector<test::TraceEntry> trace = fx.trace(variant);
  EXPECT_EQ(routing.size(), trace.size());
  for (size_t i = 0; i < std::min(trace.size(), routing.size()); ++i) {
    EXPECT_EQ(routing[i].token, trace[i].token);
    EXPECT_EQ(routing[i].layer, trace[i].layer);
    EXPECT_EQ(routing[i].experts, trace[i].experts) << "record " << i;
    for (size_t k = 0; k < trace[i].weights.size(); ++k) {
      EXPECT_NEAR(routing[i].weights[k], trace[i].weights[k], weight_tol) << "record " << i;
    }
  }
  engine.set_routing_log(nullptr);
  return worst;
}

// After reset(), the prompt as one prefill() and greedy decoding give transformers' greedy tokens
// for `variant`.
template <typename Fx>
void expect_fixture_greedy(Engine& engine, const Fx& fx, const std::string& variant) {
  const std::vector<uint32_t> want = fx.greedy(variant);
  engine.reset();
  std::vector<float> logits(fx.vocab);
  std::vector<uint32_t> seq(want.begin(), want.begin() + fx.prompt);
  const Status st = engine.prefill(seq, logits);
  ASSERT_TRUE(st) << st.error().message;
  while (seq.size() < want.size()) {
    seq.push_back(argmax(logits));
    ASSERT_TRUE(engine.decode(seq.back(), logits));
  }
  EXPECT_EQ(seq, want) << variant;
}

}  // namespace expertd::engine::test
