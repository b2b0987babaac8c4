// The committed reference fixtures (tests/fixtures/, written by tools/reference/*.py): the
// qwen3moe-tiny models with the logits and routing Hugging Face transformers computed for them,
// and the dequantisation vectors of the `gguf` package.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

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

}  // namespace expertd::engine::test
