// The CPU engine on its product path: the real expertd binary serves the committed fixture models
// and the engine gets every routed expert through libexpertd-client (DaemonExpertSource). The
// logits must match Hugging Face transformers' within 1e-4 relative error at every position, and
// expert-run must report what the engine did.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

#include "engine/cpu_engine.h"
#include "engine/daemon_expert_source.h"
#include "expertd/client.h"
#include "testing/expertd_fixture.h"
#include "tests/engine/file_expert_source.h"
#include "tests/engine/fixture.h"
#include "text/sampler.h"

namespace expertd::engine {
namespace {

using namespace expertd::text;

using expertd::test::Daemon;
using expertd::test::TempDir;
using test::TinyFixture;

constexpr double kMaxRelErr = 1e-4;

// One expertd serving both fixture variants, as "tiny-f32" and "tiny-q8_0".
class EngineDaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fx_ = TinyFixture::load();
    socket_ = dir_.path() + "/expertd.sock";
    daemon_ = std::make_unique<Daemon>(
        dir_.path(), std::vector<std::string>{"--model", "tiny-f32=" + fx_.gguf("f32"), "--model",
                                              "tiny-q8_0=" + fx_.gguf("q8_0"), "--socket", socket_,
                                              "--cache", "16MiB", "--no-mlock"});
    ASSERT_TRUE(daemon_->start());
  }
  void TearDown() override {
    const std::string log = daemon_->log();
    EXPECT_EQ(daemon_->stop(), 0) << log;
  }

  TempDir dir_;
  TinyFixture fx_;
  std::string socket_;
  std::unique_ptr<Daemon> daemon_;
};

TEST_F(EngineDaemonTest, LogitsMatchTransformersWithExpertsFromExpertd) {
  for (const std::string variant : {"f32", "q8_0"}) {
    SCOPED_TRACE(variant);
    auto model = DenseModel::load(fx_.gguf(variant));
    ASSERT_TRUE(model) << model.error().message;
    auto client = client::Client::connect(socket_);
    ASSERT_TRUE(client) << client.error().message;
    auto session = (*client)->attach("tiny-" + variant, "engine_tests");
    ASSERT_TRUE(session) << session.error().message;
    auto source = DaemonExpertSource::create(**session, *model);
    ASSERT_TRUE(source) << source.error().message;
    // Prefetch hints go to the daemon too; they must not change a thing.
    auto engine = CpuEngine::create(*model, **source, EngineOptions{16, 2, 0});
    ASSERT_TRUE(engine) << engine.error().message;
    std::vector<RoutingRecord> routing;
    (*engine)->set_routing_log(&routing);

    const std::vector<float> expected = fx_.logits(variant);
    std::vector<float> logits(fx_.vocab);
    double worst = 0.0;
    for (size_t t = 0; t < fx_.tokens.size(); ++t) {
      const Status st = (*engine)->decode(fx_.tokens[t], logits);
      ASSERT_TRUE(st) << st.error().message;
      const double err = test::rel_err(logits.data(), expected.data() + t * fx_.vocab, fx_.vocab);
      EXPECT_LE(err, kMaxRelErr) << "position " << t;
      worst = std::max(worst, err);
    }
    RecordProperty("max_rel_err_" + variant, std::to_string(worst));
    std::printf("[ %s via expertd ] max relative error of the logits over %zu positions: %.3e\n",
                variant.c_str(), fx_.tokens.size(), worst);
    const auto trace = fx_.trace(variant);
    ASSERT_EQ(routing.size(), trace.size());
    for (size_t i = 0; i < trace.size(); ++i) {
      EXPECT_EQ(routing[i].experts, trace[i].experts) << "record " << i;
    }
    EXPECT_EQ((*session)->holds(), 0u);
    const EngineStats& s = (*engine)->stats();
    EXPECT_EQ(s.hint_errors, 0u);
    EXPECT_GT(s.hints_sent, 0u);
    // Releases and hints are one-way ring entries, counted when the daemon's reactor takes them:
    // wait for the last of them.
    auto ss = (*session)->stats();
    expertd::test::wait_until(
        [&] {
          ss = (*session)->stats();
          return !ss || (ss->releases == ss->acquires && ss->prefetches == s.hints_sent);
        },
        std::chrono::seconds(10));
    ASSERT_TRUE(ss) << ss.error().message;
    EXPECT_EQ(ss->acquires, fx_.tokens.size() * 3 * 2);
    EXPECT_EQ(ss->releases, ss->acquires);
    EXPECT_EQ(ss->prefetches, s.hints_sent);
  }
}

TEST_F(EngineDaemonTest, ADaemonServingAnotherFileIsRefused) {
  auto model = DenseModel::load(fx_.gguf("f32"));
  ASSERT_TRUE(model);
  auto client = client::Client::connect(socket_);
  ASSERT_TRUE(client);
  auto session = (*client)->attach("tiny-q8_0", "engine_tests");
  ASSERT_TRUE(session);
  auto source = DaemonExpertSource::create(**session, *model);
  ASSERT_FALSE(source);
  EXPECT_NE(source.error().message.find("model 'tiny-q8_0' layer 0"), std::string::npos)
      << source.error().message;
  EXPECT_NE(source.error().message.find("(a different file?)"), std::string::npos)
      << source.error().message;
}

// The greedy continuation of the fixture prompt, computed in-process from the GGUF.
std::vector<uint32_t> greedy_reference(const TinyFixture& fx, const std::string& variant,
                                       uint32_t n) {
  auto model = DenseModel::load(fx.gguf(variant));
  EXPECT_TRUE(model);
  auto source = test::FileExpertSource::open(*model);
  auto engine = CpuEngine::create(*model, **source, EngineOptions{64, 0, 0});
  std::vector<float> logits(fx.vocab);
  for (const uint32_t t : fx.tokens) EXPECT_TRUE((*engine)->decode(t, logits));
  std::vector<uint32_t> out;
  while (out.size() < n) {
    out.push_back(argmax(logits));
    if (out.size() < n) {
      EXPECT_TRUE((*engine)->decode(out.back(), logits));
    }
  }
  return out;
}

std::string joined(const std::vector<uint32_t>& v) {
  std::string s;
  for (const uint32_t x : v) s += (s.empty() ? "" : ",") + std::to_string(x);
  return s;
}

TEST_F(EngineDaemonTest, ExpertRunJsonReportsGenerationHitsAndPrefetch) {
  const std::string trace_path = dir_.path() + "/trace.jsonl";
  const auto r = expertd::test::run_command(
      {expertd::test::bin_path("expert-run"), "--socket", socket_, "--model", "tiny-f32", "--gguf",
       fx_.gguf("f32"), "--prompt-tokens", joined(fx_.tokens), "--max-tokens", "6",
       "--prefetch-depth", "2", "--record-trace", trace_path, "--json", "--ignore-eos", "--cpu"});
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const auto j = nlohmann::json::parse(r.out);
  const auto generated = j.at("generated").get<std::vector<uint32_t>>();
  EXPECT_EQ(generated, greedy_reference(fx_, "f32", 6));
  // The first generated token is transformers' greedy choice after the prompt.
  EXPECT_EQ(generated.front(), fx_.meta["variants"]["f32"]["greedy_next"].back().get<uint32_t>());
  EXPECT_EQ(j.at("engine").get<std::string>(), "cpu");
  EXPECT_GT(j.at("tokens_per_s").get<double>(), 0.0);
  EXPECT_GE(j.at("stall_ms_per_token").get<double>(), 0.0);
  const uint64_t steps = j.at("decode_steps").get<uint64_t>();
  EXPECT_EQ(steps, fx_.tokens.size() + 5);
  // The prompt is one prefill chunk: each routed (layer, expert) acquired once; then k per layer.
  const uint64_t acquired =
      j.at("prefill").at("experts_acquired").get<uint64_t>() + (steps - fx_.tokens.size()) * 3 * 2;
  EXPECT_LT(acquired, steps * 3 * 2);
  EXPECT_EQ(j.at("experts_used").get<uint64_t>(), acquired);
  const auto& hits = j.at("hits");
  EXPECT_EQ(hits.at("vram").get<uint64_t>(), 0u);
  // Every acquire was a host hit or waited for the disk; the first use of each expert must read.
  EXPECT_EQ(hits.at("host").get<uint64_t>() + hits.at("disk").get<uint64_t>(), acquired);
  EXPECT_GT(hits.at("host").get<uint64_t>(), 0u);
  for (const char* key : {"prefetch_precision", "prefetch_recall"}) {
    const double v = j.at(key).get<double>();
    EXPECT_GT(v, 0.0) << key;
    EXPECT_LE(v, 1.0) << key;
  }
  ASSERT_EQ(j.at("prefetch_by_depth").size(), 2u);  // --prefetch-depth 2
  for (const auto& d : j.at("prefetch_by_depth")) {
    EXPECT_GT(d.at("predicted").get<uint64_t>(), 0u);
    EXPECT_LE(d.at("recall").get<double>(), 1.0);
  }
  EXPECT_TRUE(j.contains("text"));

  // The recorded trace starts with the fixture's routing (the prompt), in canonical form.
  const auto recorded = test::read_trace(trace_path);
  const auto expected = fx_.trace("f32");
  ASSERT_EQ(recorded.size(), steps * 3);
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(recorded[i].token, expected[i].token);
    EXPECT_EQ(recorded[i].layer, expected[i].layer);
    EXPECT_EQ(recorded[i].experts, expected[i].experts) << "record " << i;
  }
}

// --feed-tokens decodes given ids through decode() from an empty context after the prompt: the
// fed positions route exactly as the fixture's prompt does from position 0 (the prompt's KV cache
// was dropped), every fed token is one decode step that sends lookahead hints, and "feed" counts
// the window alone.
TEST_F(EngineDaemonTest, ExpertRunFeedTokensDecodeTheIdsFromAnEmptyContext) {
  const std::string ids_path = dir_.path() + "/ids.txt";
  {
    std::ofstream f(ids_path);
    for (size_t i = 0; i < fx_.tokens.size(); ++i) f << fx_.tokens[i] << (i % 3 == 2 ? "\n" : ", ");
  }
  const std::string trace_path = dir_.path() + "/fed.jsonl";
  const auto r = expertd::test::run_command({expertd::test::bin_path("expert-run"), "--socket",
                                             socket_, "--model", "tiny-f32", "--prompt-tokens",
                                             "7,9,11,13", "--feed-tokens", ids_path,
                                             "--record-trace", trace_path, "--json", "--cpu"});
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const auto j = nlohmann::json::parse(r.out);
  const auto& feed = j.at("feed");
  const size_t n = fx_.tokens.size();
  EXPECT_EQ(feed.at("ids").get<std::vector<uint32_t>>(), fx_.tokens);
  EXPECT_EQ(feed.at("source").get<std::string>(), "file " + ids_path);
  EXPECT_EQ(feed.at("tokens").get<size_t>(), n);
  EXPECT_EQ(j.at("generated").size(), 0u);
  EXPECT_EQ(j.at("stop_reason").get<std::string>(), "fed");
  EXPECT_EQ(j.at("decode_steps").get<uint64_t>(), 4 + n);
  EXPECT_EQ(j.at("generation").at("steps").get<uint64_t>(), n);
  // Every fed token routes top-2 of 8 experts in each of 3 layers, each from a tier.
  const auto& hits = feed.at("hits");
  EXPECT_EQ(hits.at("vram").get<uint64_t>() + hits.at("host").get<uint64_t>() +
                hits.at("disk").get<uint64_t>(),
            n * 3 * 2);
  // Decode steps hint the next layer's experts (prefill sends none: it knows its routing).
  EXPECT_GT(feed.at("hints").get<uint64_t>(), 0u);
  EXPECT_GT(feed.at("tokens_per_s").get<double>(), 0.0);
  EXPECT_DOUBLE_EQ(feed.at("bytes_read_per_token").get<double>(),
                   feed.at("bytes_read").get<double>() / static_cast<double>(n));
  const double busy = feed.at("disk_busy_fraction").get<double>();
  EXPECT_GE(busy, 0.0);
  EXPECT_LE(busy, 1.0);
  if (hits.at("disk").get<uint64_t>() > 0) {
    EXPECT_GE(feed.at("reads_in_flight_max").get<uint32_t>(), 1u);
    EXPECT_GE(feed.at("reads_in_flight_mean").get<double>(), 1.0);
  }
  // The fed part of the trace starts again at position 0 and routes as the fixture's prompt.
  const auto recorded = test::read_trace(trace_path);
  const auto expected = fx_.trace("f32");
  ASSERT_EQ(recorded.size(), (4 + n) * 3);
  ASSERT_EQ(expected.size(), n * 3);
  for (size_t i = 0; i < expected.size(); ++i) {
    const auto& got = recorded[4 * 3 + i];
    EXPECT_EQ(got.token, expected[i].token) << "record " << i;
    EXPECT_EQ(got.layer, expected[i].layer) << "record " << i;
    EXPECT_EQ(got.experts, expected[i].experts) << "record " << i;
  }
}

// random:N:SEED draws as llama-bench's tg does: glibc's rand() % n_vocab after srand(SEED).
TEST_F(EngineDaemonTest, ExpertRunFeedRandomIdsAreGlibcRandModVocab) {
  const auto r = expertd::test::run_command({expertd::test::bin_path("expert-run"), "--socket",
                                             socket_, "--model", "tiny-f32", "--feed-tokens",
                                             "random:12:3", "--json", "--cpu"});
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const auto j = nlohmann::json::parse(r.out);
  std::srand(3);
  std::vector<uint32_t> want;
  for (int i = 0; i < 12; ++i) want.push_back(static_cast<uint32_t>(std::rand()) % fx_.vocab);
  EXPECT_EQ(j.at("feed").at("ids").get<std::vector<uint32_t>>(), want);
  EXPECT_EQ(j.at("feed").at("source").get<std::string>(), "random:12:3");
  EXPECT_EQ(j.at("prefill").at("tokens").get<size_t>(), 0u);
}

TEST_F(EngineDaemonTest, ExpertRunFeedTokensRefusesBadSpecsNamingThem) {
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir_.path() + "/" + name) << text;
    return dir_.path() + "/" + name;
  };
  const std::string word = write("word.txt", "1,2,abc\n");
  const std::string big = write("big.txt", "1,\n\n 99999999\n");
  const std::string empty = write("empty.txt", " ,\n");
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--feed-tokens", "random:0"}, "--feed-tokens 'random:0': random:N[:SEED] needs N in 1.."},
      {{"--feed-tokens", "random:8:x"}, "--feed-tokens 'random:8:x'"},
      {{"--feed-tokens", word},
       "--feed-tokens " + word + ": id 3 (line 1) is 'abc', not a token id"},
      {{"--feed-tokens", big},
       "--feed-tokens " + big + ": id 2 (line 3) is 99999999, outside the model's vocabulary of " +
           std::to_string(fx_.vocab)},
      {{"--feed-tokens", empty}, "--feed-tokens " + empty + ": no token ids in it"},
      {{"--feed-tokens", dir_.path() + "/none"}, "No such file or directory"},
      {{"--feed-tokens", "random:4", "--max-tokens", "3"}, "it takes no --max-tokens"},
  };
  for (const auto& [args, want] : cases) {
    std::vector<std::string> cmd = {
        expertd::test::bin_path("expert-run"), "--socket", socket_, "--model", "tiny-f32", "--cpu"};
    cmd.insert(cmd.end(), args.begin(), args.end());
    const auto r = expertd::test::run_command(cmd);
    EXPECT_EQ(r.status, 1) << args.back();
    EXPECT_NE(r.err.find(want), std::string::npos) << r.err;
  }
}

// The qwen3moe fixture's vocabulary (byte-level, qwen2 pre-tokenizer, one placeholder merge)
// tokenises its prompt text into the fixture's ids.
TEST_F(EngineDaemonTest, ExpertRunPromptTextGivesTheFixtureTokens) {
  const auto r = expertd::test::run_command(
      {expertd::test::bin_path("expert-run"), "--socket", socket_, "--model", "tiny-f32",
       "--prompt", "Hello, MoE!\n", "--max-tokens", "4", "--ignore-eos", "--cpu", "--json"});
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j.at("prompt_tokens").get<std::vector<uint32_t>>(), fx_.tokens);
  EXPECT_EQ(j.at("generated").get<std::vector<uint32_t>>(), greedy_reference(fx_, "f32", 4));
}

TEST_F(EngineDaemonTest, ExpertRunTextSaysWhichEngineRan) {
  const auto r = expertd::test::run_command(
      {expertd::test::bin_path("expert-run"), "--socket", socket_, "--model", "tiny-q8_0", "--gguf",
       fx_.gguf("q8_0"), "--prompt-tokens", "72,101,108,108,111", "--max-tokens", "3", "--cpu"});
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("expert-run: CPU reference engine"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("(--cpu)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("generated: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("hits: vram 0, host "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("prefetch: depth 1, "), std::string::npos) << r.out;
}

TEST(ExpertRun, NoDaemonSaysSo) {
  TempDir dir;
  const TinyFixture fx = TinyFixture::load();
  const auto r = expertd::test::run_command(
      {expertd::test::bin_path("expert-run"), "--socket", dir.path() + "/none.sock", "--model",
       "tiny", "--gguf", fx.gguf("f32"), "--prompt-tokens", "1,2", "--max-tokens", "1"});
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("expert-run: cannot connect to expertd at"), std::string::npos) << r.err;
}

// Forged models exercise what the tiny fixture does not: q4_k and mxfp4 experts, q6_k, f16 and
// mxfp4 dense weights, a split model. Whatever the numbers, experts through expertd must give
// exactly the logits of experts read from the file.
TEST(EngineForged, DaemonAndFileGiveIdenticalLogits) {
  TempDir dir;
  expertd::test::forge(dir.path(), "split",
                       "--layers 3 --experts 6 --top-k 2 --embd 256 --ff 512 --heads 4 "
                       "--kv-heads 2 --head-dim 64 --vocab 300 --expert-type q4_k "
                       "--dense-type q6_k --split 2 --seed 5");
  const std::string split = dir.path() + "/split-00001-of-00002.gguf";
  const std::string plain = expertd::test::forge(
      dir.path(), "plain",
      "--layers 2 --experts 4 --top-k 2 --embd 256 --ff 256 --heads 2 --kv-heads 1 "
      "--head-dim 128 --vocab 300 --expert-type q6_k --dense-type f16 --seed 6");
  // 800 and 480 are odd multiples of 32: rows of an odd number of 17-byte blocks.
  const std::string mx = expertd::test::forge(
      dir.path(), "mx",
      "--layers 2 --experts 4 --top-k 2 --embd 800 --ff 480 --heads 4 --kv-heads 2 "
      "--head-dim 64 --vocab 300 --expert-type mxfp4 --dense-type mxfp4 --seed 7");
  const std::string sock = dir.path() + "/expertd.sock";
  Daemon d(dir.path(), {"--model", "split=" + split, "--model", "plain=" + plain, "--model",
                        "mx=" + mx, "--socket", sock, "--cache", "32MiB", "--no-mlock"});
  ASSERT_TRUE(d.start());
  for (const auto& [name, path] :
       {std::pair{"split", split}, std::pair{"plain", plain}, std::pair{"mx", mx}}) {
    SCOPED_TRACE(name);
    auto model = DenseModel::load(path);
    ASSERT_TRUE(model) << model.error().message;
    auto client = client::Client::connect(sock);
    ASSERT_TRUE(client);
    auto session = (*client)->attach(name, "engine_tests");
    ASSERT_TRUE(session);
    auto daemon_source = DaemonExpertSource::create(**session, *model);
    ASSERT_TRUE(daemon_source) << daemon_source.error().message;
    auto file_source = test::FileExpertSource::open(*model);
    ASSERT_TRUE(file_source);
    auto a = CpuEngine::create(*model, **daemon_source, EngineOptions{8, 1, 0});
    auto b = CpuEngine::create(*model, **file_source, EngineOptions{8, 0, 0});
    const uint32_t vocab = model->params().n_vocab;
    std::vector<float> la(vocab);
    std::vector<float> lb(vocab);
    for (const uint32_t t : {1u, 17u, 255u, 299u}) {
      ASSERT_TRUE((*a)->decode(t, la));
      ASSERT_TRUE((*b)->decode(t, lb));
      EXPECT_EQ(la, lb) << "token " << t;
      for (const float x : la) ASSERT_TRUE(std::isfinite(x));
    }
  }
  const std::string log = d.log();
  EXPECT_EQ(d.stop(), 0) << log;
}

}  // namespace
}  // namespace expertd::engine
