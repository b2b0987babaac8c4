// Traces: the canonical JSON Lines form and the binary form round-trip; malformed files fail with
// an error naming the line (JSONL) or record and byte (binary); the raw Mixtral logs import to the
// shared canonical traces; and `expert-tune simulate --json`, run as a process, agrees with a small
// LRU and Belady written here (not policy/policy.h). Each claim on the shared traces is checked on
// a generated Mixtral-shaped trace too (trace/synth.h), so a fresh clone checks it.
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
#include <set>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "testing/expertd_fixture.h"
#include "trace/synth.h"

namespace expertd {
namespace {

namespace fs = std::filesystem;

struct RunResult {
  int exit_code = -1;
  std::string out;  // stdout only
};

// Runs expert-tune with `args` (separated by spaces); a trailing "2>&1" appends its stderr to out.
RunResult run_tune(std::string args) {
  const std::string merge = " 2>&1";
  const bool with_err = args.ends_with(merge);
  if (with_err) args.resize(args.size() - merge.size());
  std::vector<std::string> argv{test::bin_path("expert-tune")};
  std::istringstream words(args);
  for (std::string w; words >> w;) argv.push_back(w);
  const test::RunResult r = test::run_command(argv);
  return RunResult{r.status, with_err ? r.out + r.err : r.out};
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
  void SetUp() override { ASSERT_FALSE(dir_.path().empty()) << "mkdtemp failed"; }
  std::string path(const std::string& name) const { return dir_.file(name); }

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
      EXPECT_EQ(j.at("lru_hits").get<uint64_t>(), lru);
      EXPECT_NEAR(j.at("goal_hit_rate").get<double>(),
                  static_cast<double>(lru + min) / 2 / static_cast<double>(acc.size()), 1e-6);
    }
    EXPECT_EQ(n, caps.size());
  }

  test::TempDir dir_{"expertd-trace"};
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
  const auto dir = test::shared_traces_dir();
  if (!dir) GTEST_SKIP() << test::kNoSharedTraces;
  const std::string kTraceDir = *dir;
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

// Writes `t` as the vLLM hooks log it (the shared raw logs' two forms): prefill records layer-major
// with their positions ("token_pos" or "token_idx"), then, for the tokens from `prompt` on, decode
// records in time order all at position 0; gating_probs as full-precision floats. Records whose
// index is in `drop` are left out, as the collector left some out.
void write_raw_log(const std::string& file, const Trace& t, uint32_t prompt, const char* pos_key,
                   const std::set<size_t>& drop) {
  std::ofstream out(file);
  auto emit = [&](size_t i, uint32_t pos) {
    if (drop.count(i) != 0) return;
    const TraceRecord& r = t.records[i];
    nlohmann::ordered_json j;
    j["dataset"] = "synthetic";
    j["problem_id"] = 0;
    j["layer"] = r.layer;
    j[pos_key] = pos;
    j["experts"] = r.experts;
    std::vector<double> probs;
    for (const float w : r.weights) probs.push_back(static_cast<double>(w) + 2e-8);
    j["gating_probs"] = probs;
    out << j.dump() << "\n";
  };
  for (uint32_t l = 0; l < t.layers; ++l) {
    for (size_t i = 0; i < t.records.size(); ++i) {
      if (t.records[i].layer == l && t.records[i].token < prompt) emit(i, t.records[i].token);
    }
  }
  for (size_t i = 0; i < t.records.size(); ++i) {
    if (t.records[i].token >= prompt) emit(i, 0);
  }
}

// The twin of the import of the shared raw logs: generated logs of both forms, some records
// missing, import to the generated trace they were written from, and `expert-tune import` writes
// it byte for byte as the library does.
TEST_F(TraceTest, ImportOfGeneratedRawLogsGivesTheirCanonicalTraces) {
  struct Form {
    const char* pos_key;
    uint32_t prompt;  // all tokens: prefill only, like humaneval1
  };
  for (const Form f : {Form{"token_pos", 40}, Form{"token_idx", 83}}) {
    SCOPED_TRACE(f.pos_key);
    const Trace full = synthesize_trace(SynthParams::mixtral(83), f.prompt);
    std::set<size_t> drop;
    Trace want = full;
    want.records.clear();
    for (size_t i = 0; i < full.records.size(); ++i) {
      // Every 97th record is missing, but never the last of the prefill (it marks where the
      // prefill ends).
      const auto& r = full.records[i];
      if (i % 97 == 5 && !(r.token + 1 == f.prompt && r.layer + 1 == full.layers)) {
        drop.insert(i);
      } else {
        want.records.push_back(r);
      }
    }
    ASSERT_GT(drop.size(), 20u);
    write_raw_log(path("raw.jsonl"), full, f.prompt, f.pos_key, drop);
    const auto got = import_raw_log(path("raw.jsonl"));
    ASSERT_TRUE(got) << got.error().message;
    ASSERT_EQ(got->records.size(), want.records.size());
    for (size_t i = 0; i < got->records.size(); ++i) {
      ASSERT_EQ(got->records[i], want.records[i]) << "record " << i;
    }
    EXPECT_EQ(got->tokens, 83u);
    EXPECT_EQ(got->layers, 32u);
    EXPECT_EQ(got->experts, 8u);
    ASSERT_TRUE(write_trace_jsonl(path("want.jsonl"), want));
    ASSERT_TRUE(write_trace_jsonl(path("lib.jsonl"), *got));
    EXPECT_EQ(read_all(path("lib.jsonl")), read_all(path("want.jsonl")));
    const auto r = run_tune("import --raw " + path("raw.jsonl") + " -o " + path("cli.jsonl"));
    ASSERT_EQ(r.exit_code, 0) << r.out;
    EXPECT_EQ(read_all(path("cli.jsonl")), read_all(path("want.jsonl")));
  }
}

TEST_F(TraceTest, SimulateOnSharedTraceMatchesReferenceLruAndBelady) {
  const auto dir = test::shared_traces_dir();
  if (!dir) GTEST_SKIP() << test::kNoSharedTraces;
  const std::string canonical = *dir + "/mixtral-8x7b-humaneval0.trace.jsonl";
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

// The twin on a generated trace of humaneval0's shape (218 tokens, Mixtral's routing).
TEST_F(TraceTest, SimulateOnGeneratedMixtralTraceMatchesReferenceLruAndBelady) {
  const Trace t = synthesize_trace(SynthParams::mixtral(218), 0);
  ASSERT_TRUE(write_trace_jsonl(path("mix.jsonl"), t));
  const auto acc = accesses_of_jsonl(path("mix.jsonl"));
  ASSERT_EQ(acc.size(), 218u * 32 * 2);
  ValidateSimulate(path("mix.jsonl"), acc);
  const auto r = run_tune("convert " + path("mix.jsonl") + " -o " + path("mix.etrace"));
  ASSERT_EQ(r.exit_code, 0) << r.out;
  ValidateSimulate(path("mix.etrace"), acc);
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

// --- The generator (trace/synth.h) ----------------------------------------------------------

// Deterministic, well-formed, and as local as the real Mixtral traces it is calibrated to: 36-38%
// of a token's experts reused from the previous token, per-layer popularity from ~0.19 down to
// ~0.07 (trace/synth.h). Over 218 tokens, seeds 1..8 measured reuse 0.36-0.37, top share
// 0.19-0.20 and bottom share 0.08; the bounds below leave room around those.
TEST_F(TraceTest, GeneratedMixtralTraceHasTheLocalityOfTheRealOnes) {
  for (const uint64_t seed : {1u, 2u, 3u, 4u, 5u, 6u, 7u, 8u}) {
    SCOPED_TRACE(seed);
    const Trace t = synthesize_trace(SynthParams::mixtral(218), seed);
    EXPECT_EQ(t.records, synthesize_trace(SynthParams::mixtral(218), seed).records)
        << "not deterministic";
    EXPECT_NE(t.records, synthesize_trace(SynthParams::mixtral(218), seed + 100).records);
    ASSERT_EQ(t.records.size(), 218u * 32);
    EXPECT_EQ(t.tokens, 218u);
    for (const TraceRecord& r : t.records) {
      ASSERT_EQ(r.experts.size(), 2u);
      ASSERT_NE(r.experts[0], r.experts[1]);
      ASSERT_LT(std::max(r.experts[0], r.experts[1]), 8u);
      ASSERT_EQ(r.weights.size(), 2u);
      EXPECT_GE(r.weights[0], r.weights[1]);
      EXPECT_NEAR(r.weights[0] + r.weights[1], 1.0, 2e-6);
    }
    const TraceLocality m = measure_locality(t);
    EXPECT_GT(m.reuse, 0.32);
    EXPECT_LT(m.reuse, 0.43);
    EXPECT_GT(m.top_share, 0.16);
    EXPECT_LT(m.top_share, 0.24);
    EXPECT_GT(m.bottom_share, 0.04);
    EXPECT_LT(m.bottom_share, 0.11);
    // Written and read back, both forms.
    ASSERT_TRUE(write_trace_binary(path("g.etrace"), t));
    const auto back = load_trace(path("g.etrace"));
    ASSERT_TRUE(back) << back.error().message;
    EXPECT_EQ(back->records, t.records);
  }
}

// The calibration holds against the shared traces themselves, where they are.
TEST_F(TraceTest, GeneratedMixtralLocalityMatchesTheSharedTraces) {
  const auto dir = test::shared_traces_dir();
  if (!dir) GTEST_SKIP() << test::kNoSharedTraces;
  const TraceLocality gen = measure_locality(synthesize_trace(SynthParams::mixtral(218), 1));
  for (const char* name : {"mixtral-8x7b-humaneval0", "mixtral-8x7b-humaneval1"}) {
    SCOPED_TRACE(name);
    const auto real = load_trace(*dir + "/" + name + ".trace.jsonl");
    ASSERT_TRUE(real) << real.error().message;
    const TraceLocality m = measure_locality(*real);
    std::printf("%s: reuse %.3f, popularity %.3f .. %.3f; generated %.3f, %.3f .. %.3f\n", name,
                m.reuse, m.top_share, m.bottom_share, gen.reuse, gen.top_share, gen.bottom_share);
    EXPECT_NEAR(gen.reuse, m.reuse, 0.05);
    EXPECT_NEAR(gen.top_share, m.top_share, 0.04);
    EXPECT_NEAR(gen.bottom_share, m.bottom_share, 0.04);
  }
}

// The 128-expert top-8 shape: eight distinct experts per record, and far more reuse than chance
// (8 / 128 = 6%; keep 0.3 gives about a third).
TEST_F(TraceTest, GeneratedWideTraceRoutesTopEightOf128WithReuse) {
  const Trace t = synthesize_trace(SynthParams::wide(64), 7);
  ASSERT_EQ(t.records.size(), 64u * 48);
  EXPECT_EQ(t.layers, 48u);
  EXPECT_EQ(t.experts, 128u);
  for (const TraceRecord& r : t.records) {
    std::set<uint32_t> ids(r.experts.begin(), r.experts.end());
    ASSERT_EQ(ids.size(), 8u);
    ASSERT_LT(*ids.rbegin(), 128u);
  }
  const TraceLocality m = measure_locality(t);
  EXPECT_GT(m.reuse, 0.25);
  EXPECT_LT(m.reuse, 0.5);
  EXPECT_GT(m.top_share, 3.0 / 128) << "popularity is skewed";
}

// `expert-tune synth` writes what the library generates, in either form, and refuses bad shapes.
TEST_F(TraceTest, TuneSynthWritesTheGeneratedTrace) {
  auto r = run_tune("synth --tokens 50 --seed 3 -o " + path("cli.jsonl"));
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("50 tokens x 32 layers, top-2 of 8 experts"), std::string::npos) << r.out;
  ASSERT_TRUE(write_trace_jsonl(path("lib.jsonl"), synthesize_trace(SynthParams::mixtral(50), 3)));
  EXPECT_EQ(read_all(path("cli.jsonl")), read_all(path("lib.jsonl")));
  r = run_tune("synth --shape wide --tokens 5 --seed 2 -o " + path("w.etrace"));
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const auto w = load_trace(path("w.etrace"));
  ASSERT_TRUE(w) << w.error().message;
  EXPECT_EQ(w->records, synthesize_trace(SynthParams::wide(5), 2).records);
  r = run_tune("synth --shape tall -o " + path("x.jsonl") + " 2>&1");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.out.find("--shape tall: must be mixtral or wide"), std::string::npos) << r.out;
  r = run_tune("synth --top-k 9 -o " + path("x.jsonl") + " 2>&1");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_FALSE(fs::exists(path("x.jsonl")));
}

// `simulate --policy default` is cyclic-hint; hints (oracle or noisy) change its hits but never
// past Belady's; a bad --hints is a usage error naming the forms.
TEST_F(TraceTest, SimulateDefaultPolicyWithHints) {
  ASSERT_TRUE(write_trace_jsonl(path("mix.jsonl"), synthesize_trace(SynthParams::mixtral(60), 3)));
  auto json = [&](const std::string& args) {
    const auto r =
        run_tune("simulate --trace " + path("mix.jsonl") + " --json --cache-experts 64 " + args);
    EXPECT_EQ(r.exit_code, 0) << r.out;
    return r.exit_code == 0 ? nlohmann::json::parse(r.out) : nlohmann::json::object();
  };
  const auto plain = json("");
  const auto named = json("--policy default");
  const auto oracle = json("--hints oracle:8");
  const auto noisy = json("--hints noisy:0.7:8 --seed 4");
  ASSERT_TRUE(plain.contains("hits") && oracle.contains("hits") && noisy.contains("hits"));
  EXPECT_EQ(plain.at("policy"), "cyclic-hint");
  EXPECT_EQ(named.at("hits"), plain.at("hits"));
  EXPECT_EQ(oracle.at("hints"), "oracle:8");
  EXPECT_GT(oracle.at("hits").get<uint64_t>(), plain.at("hits").get<uint64_t>());
  EXPECT_LE(oracle.at("hits").get<uint64_t>(), oracle.at("belady_hits").get<uint64_t>());
  EXPECT_LE(noisy.at("hits").get<uint64_t>(), noisy.at("belady_hits").get<uint64_t>());
  EXPECT_EQ(json("--hints noisy:0.7:8 --seed 4"), noisy) << "deterministic for a seed";
  for (const char* bad : {"oracle:0", "noisy:1.5:2", "oracle", "psychic:3", "noisy:0.5"}) {
    const auto r = run_tune("simulate --trace " + path("mix.jsonl") + " --hints " + bad + " 2>&1");
    EXPECT_EQ(r.exit_code, 2) << bad;
    EXPECT_NE(r.out.find("expected none, oracle:D or noisy:R:D"), std::string::npos) << r.out;
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
