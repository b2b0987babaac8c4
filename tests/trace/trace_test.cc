// Traces: the canonical JSON Lines form and the binary form round-trip; malformed files fail with
// an error naming the line (JSONL) or record and byte (binary); the raw Mixtral logs import to the
// shared canonical traces; and `expert-tune simulate --json`, run as a process, agrees with a small
// LRU and Belady written here (not cache/policy.h).
#include "trace/trace.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

namespace expertd {
namespace {

namespace fs = std::filesystem;

const std::string kTraceDir = EXPERTD_SHARED_DIR "/traces";

struct RunResult {
  int exit_code = -1;
  std::string out;  // stdout only
};

RunResult run_tune(const std::string& args) {
  const std::string cmd = std::string(EXPERT_TUNE_BIN) + " " + args;
  RunResult r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) r.out.append(buf, n);
  const int status = ::pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_all(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// The accesses of a canonical JSONL trace, read with nlohmann directly: (layer << 32) | expert.
std::vector<uint64_t> accesses_of_jsonl(const std::string& path) {
  std::ifstream in(path);
  std::vector<uint64_t> out;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const auto j = nlohmann::json::parse(line);
    for (const auto& e : j["experts"]) {
      out.push_back((j["layer"].get<uint64_t>() << 32) | e.get<uint64_t>());
    }
  }
  return out;
}

uint64_t lru_hits(uint32_t cap, const std::vector<uint64_t>& acc) {
  std::vector<uint64_t> cache;  // least recently used first
  uint64_t hits = 0;
  for (const uint64_t k : acc) {
    const auto it = std::find(cache.begin(), cache.end(), k);
    if (it != cache.end()) {
      ++hits;
      cache.erase(it);
    } else if (cap == 0) {
      continue;
    } else if (cache.size() == cap) {
      cache.erase(cache.begin());
    }
    cache.push_back(k);
  }
  return hits;
}

// MIN with bypass: on a miss with a full cache, of the resident keys and the incoming one, the one
// used again farthest ahead is left out.
uint64_t belady_hits(uint32_t cap, const std::vector<uint64_t>& acc) {
  constexpr size_t kNever = std::numeric_limits<size_t>::max();
  std::vector<size_t> next(acc.size(), kNever);
  std::unordered_map<uint64_t, size_t> seen;
  for (size_t i = acc.size(); i-- > 0;) {
    const auto it = seen.find(acc[i]);
    if (it != seen.end()) next[i] = it->second;
    seen[acc[i]] = i;
  }
  std::unordered_map<uint64_t, size_t> cache;  // key -> next use
  uint64_t hits = 0;
  for (size_t i = 0; i < acc.size(); ++i) {
    auto it = cache.find(acc[i]);
    if (it != cache.end()) {
      ++hits;
      it->second = next[i];
      continue;
    }
    if (cap == 0) continue;
    if (cache.size() == cap) {
      auto far = cache.begin();
      for (auto c = cache.begin(); c != cache.end(); ++c) {
        if (c->second > far->second) far = c;
      }
      if (far->second < next[i]) continue;  // the incoming key is needed last: bypass
      cache.erase(far);
    }
    cache.emplace(acc[i], next[i]);
  }
  return hits;
}

class TraceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = ::testing::TempDir() + "trace_XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }

  // A generated trace with lookahead predictions (some right, some wrong) and a few records
  // without weights.
  static Trace generated(uint64_t seed) {
    Trace t = make_synthetic_trace(40, 6, 16, 2, seed);
    std::mt19937 rng(static_cast<uint32_t>(seed));
    for (size_t i = 0; i < t.records.size(); ++i) {
      auto& r = t.records[i];
      for (uint32_t depth = 1; depth <= rng() % 4; ++depth) {
        r.predicted[depth] = {r.experts[0], static_cast<uint32_t>(rng() % 16)};
      }
      if (i % 17 == 3) r.weights.clear();
      if (i % 5 == 1) r.weights = {0.7123456f, 0.2876544f};
    }
    return t;
  }

  // Checks `simulate --json` on `file` against the reference LRU and Belady of `acc`.
  static void ValidateSimulate(const std::string& file, const std::vector<uint64_t>& acc) {
    const std::vector<uint32_t> caps = {0, 1, 2, 8, 16, 33, 64, 128};
    const auto r = run_tune("simulate --trace " + file +
                            " --policy lru --json --cache-experts 0,1,2,8,16,33,64,128");
    ASSERT_EQ(r.exit_code, 0) << r.out;
    std::istringstream lines(r.out);
    std::string line;
    size_t n = 0;
    while (std::getline(lines, line)) {
      ASSERT_LT(n, caps.size()) << line;
      const auto j = nlohmann::json::parse(line);
      const uint32_t cap = caps[n++];
      SCOPED_TRACE(fmt::format("{} capacity {}", file, cap));
      const uint64_t lru = lru_hits(cap, acc);
      const uint64_t min = belady_hits(cap, acc);
      EXPECT_EQ(j.at("cache_experts").get<uint32_t>(), cap);
      EXPECT_EQ(j.at("accesses").get<uint64_t>(), acc.size());
      EXPECT_EQ(j.at("hits").get<uint64_t>(), lru);
      EXPECT_NEAR(j.at("hit_rate").get<double>(), static_cast<double>(lru) / acc.size(), 1e-6);
      EXPECT_EQ(j.at("belady_hits").get<uint64_t>(), min);
      EXPECT_NEAR(j.at("belady_hit_rate").get<double>(), static_cast<double>(min) / acc.size(),
                  1e-6);
    }
    EXPECT_EQ(n, caps.size());
  }

  std::string dir_;
};

TEST_F(TraceTest, JsonlRoundTripKeepsEveryField) {
  const Trace t = generated(7);
  ASSERT_TRUE(write_trace_jsonl(path("t.jsonl"), t));
  const auto back = load_trace(path("t.jsonl"));
  ASSERT_TRUE(back) << back.error().message;
  ASSERT_EQ(back->records.size(), t.records.size());
  for (size_t i = 0; i < t.records.size(); ++i) EXPECT_EQ(back->records[i], t.records[i]) << i;
  EXPECT_EQ(back->tokens, 40u);
  EXPECT_EQ(back->layers, 6u);
  EXPECT_LE(back->experts, 16u);
  // The form is the issue's: one object per line, "predicted" keyed by depth.
  const std::string text = read_all(path("t.jsonl"));
  EXPECT_EQ(text.rfind("{\"token\": 0, \"layer\": 0, \"experts\": [", 0), 0u) << text.substr(0, 80);
  EXPECT_NE(text.find("\"predicted\": {\"1\": ["), std::string::npos);
}

TEST_F(TraceTest, BinaryRoundTripKeepsEveryField) {
  const Trace t = generated(11);
  ASSERT_TRUE(write_trace_binary(path("t.etrace"), t));
  const std::string bytes = read_all(path("t.etrace"));
  ASSERT_GE(bytes.size(), 16u);
  EXPECT_EQ(bytes.substr(0, 4), "EXTR");
  for (const auto& load : {load_trace_binary, load_trace}) {
    const auto back = load(path("t.etrace"));
    ASSERT_TRUE(back) << back.error().message;
    ASSERT_EQ(back->records.size(), t.records.size());
    for (size_t i = 0; i < t.records.size(); ++i) EXPECT_EQ(back->records[i], t.records[i]) << i;
  }
  // JSONL -> binary -> JSONL gives the same bytes.
  ASSERT_TRUE(write_trace_jsonl(path("a.jsonl"), t));
  const auto b = load_trace(path("t.etrace"));
  ASSERT_TRUE(b);
  ASSERT_TRUE(write_trace_jsonl(path("b.jsonl"), *b));
  EXPECT_EQ(read_all(path("a.jsonl")), read_all(path("b.jsonl")));
}

TEST_F(TraceTest, BinaryWriterRefusesIdsWiderThanU16) {
  Trace t;
  t.records.push_back({0, 0, {70000}, {1.0f}, {}});
  const auto st = write_trace_binary(path("t.etrace"), t);
  ASSERT_FALSE(st);
  EXPECT_NE(st.error().message.find("70000"), std::string::npos) << st.error().message;
}

TEST_F(TraceTest, MalformedJsonlNamesTheLine) {
  const std::string good =
      "{\"token\": 0, \"layer\": 0, \"experts\": [1, 2], \"weights\": [0.6, 0.4]}\n"
      "{\"token\": 0, \"layer\": 1, \"experts\": [3], \"weights\": [1.0]}\n";
  struct Case {
    const char* name;
    std::string line3;
    const char* want;
  };
  const std::vector<Case> cases = {
      {"bad json", "{\"token\": 1, \"layer\": 0,", "not a JSON object"},
      {"missing key", "{\"token\": 1, \"experts\": [1], \"weights\": [1]}", "missing \"layer\""},
      {"negative expert", "{\"token\": 1, \"layer\": 0, \"experts\": [-1], \"weights\": [1]}",
       "expert id -1 is not a non-negative integer"},
      {"weights length", "{\"token\": 1, \"layer\": 0, \"experts\": [1, 2], \"weights\": [1]}",
       "\"weights\" has 1 entries for 2 experts"},
      {"empty experts", "{\"token\": 1, \"layer\": 0, \"experts\": [], \"weights\": []}",
       "\"experts\" must list 1 to 255 experts, found 0"},
      {"layer repeats", "{\"token\": 0, \"layer\": 1, \"experts\": [1]}",
       "token 0 layer 1 after layer 1"},
      {"predicted key",
       "{\"token\": 1, \"layer\": 0, \"experts\": [1], \"predicted\": {\"x\": [1]}}",
       "\"predicted\" key \"x\""},
      {"weight type", "{\"token\": 1, \"layer\": 0, \"experts\": [1], \"weights\": [\"a\"]}",
       "weight \"a\" is not a number"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    write_all(path("bad.jsonl"), good + c.line3 + "\n");
    const auto t = load_trace(path("bad.jsonl"));
    ASSERT_FALSE(t);
    EXPECT_NE(t.error().message.find(path("bad.jsonl") + ":3: " + c.want), std::string::npos)
        << t.error().message;
  }
  // Out-of-order token, on line 4.
  write_all(path("order.jsonl"), good +
                                     "{\"token\": 5, \"layer\": 0, \"experts\": [1]}\n"
                                     "{\"token\": 4, \"layer\": 1, \"experts\": [1]}\n");
  const auto t = load_trace(path("order.jsonl"));
  ASSERT_FALSE(t);
  EXPECT_NE(t.error().message.find(path("order.jsonl") + ":4: token 4 after token 5"),
            std::string::npos)
      << t.error().message;
  write_all(path("empty.jsonl"), "\n\n");
  const auto e = load_trace(path("empty.jsonl"));
  ASSERT_FALSE(e);
  EXPECT_NE(e.error().message.find("no trace records"), std::string::npos);
}

TEST_F(TraceTest, MalformedBinaryIsAnErrorNeverACrash) {
  Trace t;
  t.records.push_back({0, 0, {1, 2}, {0.5f, 0.5f}, {{1, {1, 3}}}});
  t.records.push_back({0, 1, {4}, {}, {}});
  t.records.push_back({1, 0, {2, 1}, {0.9f, 0.1f}, {{1, {2}}, {2, {2, 1}}}});
  ASSERT_TRUE(write_trace_binary(path("t.etrace"), t));
  const std::string bytes = read_all(path("t.etrace"));
  // Every proper prefix is refused.
  for (size_t n = 0; n < bytes.size(); ++n) {
    write_all(path("cut.etrace"), bytes.substr(0, n));
    const auto r = load_trace_binary(path("cut.etrace"));
    ASSERT_FALSE(r) << "prefix of " << n << " bytes loaded";
    EXPECT_NE(r.error().message.find(path("cut.etrace")), std::string::npos);
    EXPECT_FALSE(load_trace(path("cut.etrace"))) << n;
  }
  auto expect_error = [&](std::string b, const std::string& want) {
    write_all(path("bad.etrace"), b);
    const auto r = load_trace_binary(path("bad.etrace"));
    ASSERT_FALSE(r) << want;
    EXPECT_NE(r.error().message.find(want), std::string::npos) << r.error().message;
  };
  // The second record is truncated (the count, 2, still fits the bytes left): the error names
  // the record and its byte offset.
  const size_t second = 16 + 8 + 2 * 2 + 2 * 4 + (2 + 2 * 2);
  std::string cut = bytes.substr(0, second + 5);
  cut[8] = 2;
  expect_error(cut, fmt::format("record 1 at byte {}: truncated at byte {}", second, second + 4));
  std::string b = bytes;
  b[0] = 'X';
  expect_error(b, "no \"EXTR\" magic");
  b = bytes;
  b[4] = 9;
  expect_error(b, "version 9");
  for (const uint64_t count : {uint64_t{1} << 62, ~uint64_t{0}, uint64_t{1000}}) {
    b = bytes;
    std::memcpy(b.data() + 8, &count, 8);
    expect_error(b, fmt::format("record count {} does not fit", count));
  }
  b = bytes;
  b[16 + 6] = 0;  // first record: no experts
  expect_error(b, "record 0 at byte 16: \"experts\" must list 1 to 255 experts, found 0");
  b = bytes;
  b[16 + 7] = 200;  // first record: 200 prediction depths
  expect_error(b, "record 0 at byte 16");
  expect_error(bytes + "x", "1 stray bytes");
}

TEST_F(TraceTest, ImportNumbersDecodeTokensAfterThePrompt) {
  // Prefill of 2 tokens, layer-major; then two decode tokens at position 0, the second one missing
  // layer 0.
  write_all(
      path("raw.jsonl"),
      "{\"layer\": 0, \"token_pos\": 0, \"experts\": [1, 2], \"gating_probs\": [0.6, 0.4]}\n"
      "{\"layer\": 0, \"token_pos\": 1, \"experts\": [3, 2], \"gating_probs\": [0.5, 0.5]}\n"
      "{\"layer\": 1, \"token_pos\": 0, \"experts\": [0, 2], \"gating_probs\": [0.7, 0.3]}\n"
      "{\"layer\": 1, \"token_pos\": 1, \"experts\": [1, 4], \"gating_probs\": [0.8, 0.2]}\n"
      "{\"layer\": 0, \"token_pos\": 0, \"experts\": [5, 6], \"gating_probs\": [0.9, 0.1]}\n"
      "{\"layer\": 1, \"token_pos\": 0, \"experts\": [6, 7], \"gating_probs\": "
      "[0.12345678, 0.87654322]}\n"
      "{\"layer\": 1, \"token_pos\": 0, \"experts\": [2, 7], \"gating_probs\": [0.3, 0.7]}\n");
  const auto t = import_raw_log(path("raw.jsonl"));
  ASSERT_TRUE(t) << t.error().message;
  const std::vector<std::pair<uint32_t, uint32_t>> want = {{0, 0}, {0, 1}, {1, 0}, {1, 1},
                                                           {2, 0}, {2, 1}, {3, 1}};
  ASSERT_EQ(t->records.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(t->records[i].token, want[i].first) << i;
    EXPECT_EQ(t->records[i].layer, want[i].second) << i;
  }
  EXPECT_EQ(t->records[3].experts, (std::vector<uint32_t>{1, 4}));
  EXPECT_FLOAT_EQ(t->records[5].weights[0], 0.123457f);  // rounded to 6 decimals
  EXPECT_EQ(t->tokens, 4u);

  write_all(path("bad.jsonl"),
            "{\"layer\": 0, \"token_idx\": 0, \"experts\": [1], \"gating_probs\": [1]}\n"
            "{\"layer\": 0, \"token_idx\": 1, \"experts\": [1]}\n");
  const auto bad = import_raw_log(path("bad.jsonl"));
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message.find(path("bad.jsonl") + ":2: missing \"gating_probs\""),
            std::string::npos)
      << bad.error().message;
}

TEST_F(TraceTest, ImportOfSharedRawLogsGivesTheCanonicalTraces) {
  for (const char* name : {"mixtral-8x7b-humaneval0", "mixtral-8x7b-humaneval1"}) {
    SCOPED_TRACE(name);
    const std::string raw = kTraceDir + "/" + name + ".jsonl";
    const std::string canonical = kTraceDir + "/" + name + ".trace.jsonl";
    if (!fs::exists(raw) || !fs::exists(canonical)) {
      GTEST_SKIP() << raw << " is absent: the shared Mixtral traces live beside the checkout";
    }
    const auto got = import_raw_log(raw);
    ASSERT_TRUE(got) << got.error().message;
    const auto want = load_trace_jsonl(canonical);
    ASSERT_TRUE(want) << want.error().message;
    ASSERT_EQ(got->records.size(), want->records.size());
    for (size_t i = 0; i < got->records.size(); ++i) {
      const auto& g = got->records[i];
      const auto& w = want->records[i];
      ASSERT_EQ(g.token, w.token) << "record " << i;
      ASSERT_EQ(g.layer, w.layer) << "record " << i;
      ASSERT_EQ(g.experts, w.experts) << "record " << i;
      ASSERT_EQ(g.weights.size(), w.weights.size()) << "record " << i;
      for (size_t k = 0; k < g.weights.size(); ++k) {
        EXPECT_NEAR(g.weights[k], w.weights[k], 1e-6) << "record " << i;
      }
    }
    EXPECT_EQ(got->tokens, want->tokens);
    // Written out, the import is the canonical file byte for byte; `expert-tune import` too.
    ASSERT_TRUE(write_trace_jsonl(path("lib.jsonl"), *got));
    EXPECT_EQ(read_all(path("lib.jsonl")), read_all(canonical));
    const auto r = run_tune("import --raw " + raw + " -o " + path("cli.jsonl"));
    ASSERT_EQ(r.exit_code, 0) << r.out;
    EXPECT_EQ(read_all(path("cli.jsonl")), read_all(canonical));
  }
}

TEST_F(TraceTest, SimulateOnSharedTraceMatchesReferenceLruAndBelady) {
  const std::string canonical = kTraceDir + "/mixtral-8x7b-humaneval0.trace.jsonl";
  if (!fs::exists(canonical)) {
    GTEST_SKIP() << canonical << " is absent: the shared Mixtral traces live beside the checkout";
  }
  const auto acc = accesses_of_jsonl(canonical);
  ASSERT_EQ(acc.size(), 13554u);  // ../shared/traces/README.md
  ValidateSimulate(canonical, acc);
  // The binary form simulates the same.
  const auto r = run_tune("convert " + canonical + " -o " + path("he0.etrace"));
  ASSERT_EQ(r.exit_code, 0) << r.out;
  ValidateSimulate(path("he0.etrace"), acc);
}

TEST_F(TraceTest, SimulateOnGeneratedTracesMatchesReferenceLruAndBelady) {
  for (const uint64_t seed : {1u, 2u, 3u}) {
    const Trace t = make_synthetic_trace(60, 8, 16, 2 + seed % 2, seed);
    ASSERT_TRUE(write_trace_jsonl(path("gen.jsonl"), t));
    const auto acc = accesses_of_jsonl(path("gen.jsonl"));
    ASSERT_EQ(acc.size(), 60u * 8 * (2 + seed % 2));
    ValidateSimulate(path("gen.jsonl"), acc);
    ASSERT_TRUE(write_trace_binary(path("gen.etrace"), t));
    ValidateSimulate(path("gen.etrace"), acc);
  }
}

TEST_F(TraceTest, CliErrorsAreClear) {
  write_all(path("bad.jsonl"), "{\"token\": 0, \"layer\": 0, \"experts\": []}\n");
  auto r = run_tune("convert " + path("bad.jsonl") + " -o " + path("out.etrace") + " 2>&1");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find(path("bad.jsonl") + ":1: "), std::string::npos) << r.out;
  r = run_tune("convert " + path("bad.jsonl") + " -o " + path("out.txt") + " 2>&1");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.out.find(".etrace (binary) or .jsonl"), std::string::npos) << r.out;
  r = run_tune("simulate --trace " + path("bad.jsonl") + " 2>&1");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find(path("bad.jsonl") + ":1: "), std::string::npos) << r.out;
  r = run_tune("import --raw " + path("missing.jsonl") + " -o " + path("o.jsonl") + " 2>&1");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("cannot open raw log"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace expertd
