// Benchmark mode and hint bookkeeping on the CPU engine: a RoutingScript replaces the router, its
// oracle hints are exact, recorded traces carry "predicted", and expert-run --routing-trace
// replays the shared Mixtral trace (and its generated twin) through a real expertd.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "engine/cpu_engine.h"
#include "engine/daemon_expert_source.h"
#include "testing/expertd_fixture.h"
#include "tests/engine/file_expert_source.h"
#include "tests/engine/fixture.h"
#include "trace/synth.h"
#include "trace/trace.h"

namespace expertd::engine {
namespace {

using expertd::test::Daemon;
using expertd::test::TempDir;

using expertd::test::bin_path;

std::string small_model(const TempDir& dir, const std::string& extra = "") {
  return expertd::test::forge(dir.path(), "m",
                              "--layers 3 --experts 8 --top-k 2 --embd 256 --ff 256 --heads 4 "
                              "--kv-heads 2 --head-dim 64 --vocab 300 --expert-type q8_0 "
                              "--dense-type f16 --seed 9 " +
                                  extra);
}

TEST(RoutingScript, RejectsRoutesTheModelCannotTake) {
  TempDir dir;
  auto model = DenseModel::load(small_model(dir));
  ASSERT_TRUE(model);
  const ModelParams& p = model->params();
  RoutingScript s(2, 3);
  auto e1 = s.set(0, 0, ScriptedRoute{{1, 2, 3}, {}, {}}, p);
  ASSERT_FALSE(e1);
  EXPECT_NE(e1.error().message.find("routes to 3 experts, the model uses 2"), std::string::npos)
      << e1.error().message;
  auto e2 = s.set(0, 1, ScriptedRoute{{1, 8}, {}, {}}, p);
  ASSERT_FALSE(e2);
  EXPECT_NE(e2.error().message.find("expert 8 is outside"), std::string::npos);
  auto e3 = s.set(1, 2, ScriptedRoute{{1, 2}, {0.5f}, {}}, p);
  ASSERT_FALSE(e3);
  EXPECT_NE(e3.error().message.find("1 weights for 2 experts"), std::string::npos);
  auto e4 = s.set(2, 0, ScriptedRoute{{1, 2}, {}, {}}, p);
  ASSERT_FALSE(e4);
  EXPECT_NE(e4.error().message.find("outside 2 tokens"), std::string::npos);
  ASSERT_TRUE(s.set(1, 1, ScriptedRoute{{4, 5}, {}, {}}, p));
  ASSERT_NE(s.find(1, 1), nullptr);
  EXPECT_EQ(s.find(1, 1)->weights, (std::vector<float>{0.5f, 0.5f}));  // uniform when absent
  EXPECT_EQ(s.find(0, 1), nullptr);
}

TEST(ScriptedCpuEngine, RoutesAsScriptedAndOracleHintsAreExact) {
  TempDir dir;
  auto model = DenseModel::load(small_model(dir));
  ASSERT_TRUE(model);
  const ModelParams& p = model->params();
  RoutingScript script(4, 3);
  for (uint32_t t = 0; t < 4; ++t) {
    for (uint32_t l = 0; l < 3; ++l) {
      ASSERT_TRUE(
          script.set(t, l, ScriptedRoute{{(t + l) % 8, (t * 3 + l + 1) % 8}, {0.6f, 0.4f}, {}}, p));
    }
  }
  auto source = test::FileExpertSource::open(*model);
  ASSERT_TRUE(source);
  auto engine =
      CpuEngine::create(*model, **source, EngineOptions{8, 2, 0, &script, HintSource::Script});
  ASSERT_TRUE(engine);
  std::vector<RoutingRecord> log;
  (*engine)->set_routing_log(&log);
  std::vector<float> logits(p.n_vocab);
  for (const uint32_t t : {1u, 2u, 3u, 4u}) ASSERT_TRUE((*engine)->decode(t, logits));
  ASSERT_EQ(log.size(), 12u);
  for (const RoutingRecord& r : log) {
    const ScriptedRoute* s = script.find(r.token, r.layer);
    ASSERT_NE(s, nullptr);
    EXPECT_EQ(r.experts, s->experts);
    EXPECT_EQ(r.weights, s->weights);
    if (r.layer > 0) {
      // Hinted from two layers back where possible (layer 2 from layer 0), else one.
      const uint32_t depth = r.layer == 2 ? 2 : 1;
      ASSERT_EQ(r.predicted.count(depth), 1u) << r.token << "/" << r.layer;
      std::vector<uint32_t> pred = r.predicted.at(depth);
      std::vector<uint32_t> want = s->experts;
      std::sort(pred.begin(), pred.end());
      std::sort(want.begin(), want.end());
      EXPECT_EQ(pred, want);
    }
  }
  const EngineStats& st = (*engine)->stats();
  EXPECT_EQ(st.scripted_routes, 12u);
  EXPECT_DOUBLE_EQ(st.prefetch_precision(), 1.0);
  EXPECT_DOUBLE_EQ(st.prefetch_recall(), 1.0);
  // Per depth, every prediction counts, also one a deeper hint already sent.
  ASSERT_EQ(st.by_depth.size(), 2u);
  EXPECT_EQ(st.by_depth[0].predicted, 4u * 2 * 2);  // layers 1, 2 from one back, 4 tokens
  EXPECT_EQ(st.by_depth[1].predicted, 4u * 1 * 2);  // layer 2 from two back
  for (const DepthStats& d : st.by_depth) {
    EXPECT_DOUBLE_EQ(d.precision(), 1.0);
    EXPECT_DOUBLE_EQ(d.recall(), 1.0);
  }
}

TEST(ScriptedCpuEngine, PredictedListsAreTheHintsWhenTheScriptHasThem) {
  TempDir dir;
  auto model = DenseModel::load(small_model(dir));
  ASSERT_TRUE(model);
  const ModelParams& p = model->params();
  RoutingScript script(1, 3);
  ASSERT_TRUE(script.set(0, 0, ScriptedRoute{{0, 1}, {}, {}}, p));
  ASSERT_TRUE(script.set(0, 1, ScriptedRoute{{2, 3}, {}, {{1, {2, 7}}}}, p));  // half right
  ASSERT_TRUE(script.set(0, 2, ScriptedRoute{{4, 5}, {}, {{1, {6}}}}, p));     // wrong
  auto source = test::FileExpertSource::open(*model);
  ASSERT_TRUE(source);
  auto engine =
      CpuEngine::create(*model, **source, EngineOptions{4, 1, 0, &script, HintSource::Script});
  ASSERT_TRUE(engine);
  std::vector<float> logits(p.n_vocab);
  ASSERT_TRUE((*engine)->decode(7, logits));
  const EngineStats& st = (*engine)->stats();
  EXPECT_EQ(st.hints_sent, 3u);
  EXPECT_EQ(st.hinted_routed, 1u);
  EXPECT_EQ(st.routed_hintable, 4u);
  ASSERT_EQ(st.by_depth.size(), 1u);
  EXPECT_EQ(st.by_depth[0].predicted, 3u);
  EXPECT_EQ(st.by_depth[0].correct, 1u);
  EXPECT_EQ(st.by_depth[0].routed, 4u);
}

// The recorded trace of a routed run is canonical JSONL the trace library reads back, with the
// hints as "predicted".
TEST(RecordedTrace, RoundTripsThroughTheTraceLoader) {
  TempDir dir;
  auto model = DenseModel::load(small_model(dir));
  ASSERT_TRUE(model);
  auto source = test::FileExpertSource::open(*model);
  ASSERT_TRUE(source);
  auto engine = CpuEngine::create(*model, **source, EngineOptions{8, 2, 3});
  ASSERT_TRUE(engine);
  std::vector<RoutingRecord> log;
  (*engine)->set_routing_log(&log);
  std::vector<float> logits(model->params().n_vocab);
  for (const uint32_t t : {3u, 4u, 5u}) ASSERT_TRUE((*engine)->decode(t, logits));
  const std::string path = dir.path() + "/rec.jsonl";
  ASSERT_TRUE(write_routing_jsonl(path, log));
  auto trace = load_trace(path);
  ASSERT_TRUE(trace) << trace.error().message;
  ASSERT_EQ(trace->records.size(), log.size());
  size_t with_pred = 0;
  for (size_t i = 0; i < log.size(); ++i) {
    EXPECT_EQ(trace->records[i].experts, log[i].experts);
    EXPECT_EQ(trace->records[i].predicted, log[i].predicted);
    with_pred += !log[i].predicted.empty();
  }
  EXPECT_EQ(with_pred, 6u);  // layers 1 and 2 of each token
}

// expert-run --routing-trace TRACE (Mixtral's routing) through a real expertd: benchmark mode, said
// so in both reports, every route scripted, oracle hints exact, and the recorded trace routes as
// TRACE does.
void check_benchmark_mode(const TempDir& dir, const std::string& trace_path) {
  // Mixtral's routing shape (32 layers, 8 experts, top-2) at toy width.
  const std::string path = expertd::test::forge(
      dir.path(), "mix",
      "--layers 32 --experts 8 --top-k 2 --embd 256 --ff 256 --heads 4 --kv-heads 2 "
      "--head-dim 64 --vocab 300 --expert-type q4_k --dense-type f16 --seed 2");
  const std::string sock = dir.path() + "/expertd.sock";
  Daemon d(dir.path(),
           {"--model", "mix=" + path, "--socket", sock, "--cache", "32MiB", "--no-mlock"});
  ASSERT_TRUE(d.start());
  const std::string rec = dir.path() + "/rec.jsonl";
  const auto r = expertd::test::run_command(
      {bin_path("expert-run"), "--socket", sock, "--model", "mix", "--gguf", path,
       "--prompt-tokens", "1,2,3", "--max-tokens", "6", "--prefetch-depth", "2", "--routing-trace",
       trace_path, "--record-trace", rec, "--json", "--cpu"});
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_TRUE(j.at("benchmark_mode").get<bool>());
  EXPECT_NE(j.at("mode_note").get<std::string>().find("BENCHMARK MODE"), std::string::npos);
  const uint64_t steps = j.at("decode_steps").get<uint64_t>();
  EXPECT_EQ(steps, 3u + 5u);
  EXPECT_EQ(j.at("scripted_routes").get<uint64_t>(), steps * 32);
  EXPECT_DOUBLE_EQ(j.at("prefetch_recall").get<double>(), 1.0);  // oracle hints
  auto want = load_trace(trace_path);
  ASSERT_TRUE(want);
  auto recorded = load_trace(rec);
  ASSERT_TRUE(recorded) << recorded.error().message;
  ASSERT_EQ(recorded->records.size(), steps * 32);
  for (size_t i = 0; i < recorded->records.size(); ++i) {
    EXPECT_EQ(recorded->records[i].experts, want->records[i].experts) << "record " << i;
  }
  // The text report says it is a benchmark.
  const auto t = expertd::test::run_command(
      {bin_path("expert-run"), "--socket", sock, "--model", "mix", "--gguf", path,
       "--prompt-tokens", "1", "--max-tokens", "2", "--routing-trace", trace_path, "--cpu"});
  ASSERT_EQ(t.status, 0) << t.out << t.err;
  EXPECT_NE(t.out.find("BENCHMARK MODE"), std::string::npos) << t.out;
  const std::string log = d.log();
  EXPECT_EQ(d.stop(), 0) << log;
}

TEST(ExpertRunBenchmarkMode, ReplaysTheSharedMixtralTrace) {
  const auto shared = expertd::test::shared_traces_dir();
  if (!shared) GTEST_SKIP() << expertd::test::kNoSharedTraces;
  TempDir dir;
  check_benchmark_mode(dir, *shared + "/mixtral-8x7b-humaneval1.trace.jsonl");
}

// The twin on a generated Mixtral-shaped trace (trace/synth.h).
TEST(ExpertRunBenchmarkMode, ReplaysAGeneratedMixtralTrace) {
  TempDir dir;
  const std::string trace = dir.path() + "/mixtral-synth.jsonl";
  ASSERT_TRUE(write_trace_jsonl(trace, synthesize_trace(SynthParams::mixtral(83), 1)));
  check_benchmark_mode(dir, trace);
}

TEST(ExpertRunBenchmarkMode, ATraceForAnotherShapeIsRefused) {
  TempDir dir;
  const std::string path = small_model(dir);
  const std::string trace = dir.path() + "/t.jsonl";
  {
    std::ofstream f(trace);
    f << R"({"token": 0, "layer": 0, "experts": [9, 1], "weights": [0.5, 0.5]})"
      << "\n";
  }
  const auto r = expertd::test::run_command(
      {bin_path("expert-run"), "--socket", dir.path() + "/none.sock", "--model", "m", "--gguf",
       path, "--prompt-tokens", "1", "--routing-trace", trace, "--cpu"});
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("t.jsonl: the trace has 1 layers and 10 experts; the model has 3 and 8"),
            std::string::npos)
      << r.err;
}

}  // namespace
}  // namespace expertd::engine
