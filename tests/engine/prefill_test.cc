// Batched prefill on the CPU engines, through the real expertd: the prompt's last logits must be
// decode()'s (token by token) for every chunk size, the greedy continuation the same, and each
// routed expert acquired once per chunk.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <set>
#include <thread>
#include <utility>

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

constexpr double kMaxRelErr = 1e-5;
constexpr uint32_t kContinuation = 6;

// max |a - b| / max |b|.
double max_rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0.0;
  double scale = 0.0;
  for (size_t i = 0; i < b.size(); ++i) {
    diff = std::max(diff, std::fabs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
  }
  return diff / scale;
}

struct Variant {
  std::string name;  // the daemon's model name
  std::string gguf;
  std::vector<uint32_t> prompt;
};

// Every committed fixture: qwen3moe-tiny (f32, q8_0) and deepseek4-tiny (f32, mxfp4, q8_0).
std::vector<Variant> variants() {
  std::vector<Variant> out;
  const test::TinyFixture q = test::TinyFixture::load();
  for (const std::string v : {"f32", "q8_0"}) out.push_back({"qwen-" + v, q.gguf(v), q.tokens});
  const auto meta = test::read_json(test::fixture_path("deepseek4-tiny/fixture.json"));
  const auto tokens = meta.at("tokens").get<std::vector<uint32_t>>();
  const auto n = meta.at("prompt_tokens").get<size_t>();
  for (const std::string v : {"f32", "mxfp4", "q8_0"}) {
    out.push_back({"v4-" + v, test::fixture_path("deepseek4-tiny/model-" + v + ".gguf"),
                   std::vector<uint32_t>(tokens.begin(), tokens.begin() + n)});
  }
  return out;
}

// One expertd serving every fixture; the cache is small, as a decode-sized daemon's would be.
class PrefillTest : public ::testing::Test {
 protected:
  void SetUp() override {
    variants_ = variants();
    socket_ = dir_.path() + "/expertd.sock";
    std::vector<std::string> args{"--socket", socket_, "--cache", "16MiB", "--no-mlock"};
    for (const Variant& v : variants_) {
      args.push_back("--model");
      args.push_back(v.name + "=" + v.gguf);
    }
    daemon_ = std::make_unique<Daemon>(dir_.path(), args);
    ASSERT_TRUE(daemon_->start());
  }
  void TearDown() override {
    const std::string log = daemon_->log();
    EXPECT_EQ(daemon_->stop(), 0) << log;
  }

  // An engine on `v` with its own session.
  struct Run {
    std::unique_ptr<client::Client> client;
    std::unique_ptr<client::Session> session;
    std::unique_ptr<DaemonExpertSource> source;
    std::unique_ptr<Engine> engine;
  };
  Run open(const DenseModel& model, const Variant& v, const EngineOptions& o) {
    Run r;
    auto client = client::Client::connect(socket_);
    EXPECT_TRUE(client) << client.error().message;
    if (!client) return r;
    r.client = std::move(*client);
    auto session = r.client->attach(v.name, "prefill_test");
    EXPECT_TRUE(session) << session.error().message;
    if (!session) return r;
    r.session = std::move(*session);
    auto source = DaemonExpertSource::create(*r.session, model);
    EXPECT_TRUE(source) << source.error().message;
    if (!source) return r;
    r.source = std::move(*source);
    auto engine = create_cpu_engine(model, *r.source, o);
    EXPECT_TRUE(engine) << engine.error().message;
    if (engine) r.engine = std::move(*engine);
    return r;
  }

  // Every acquire the session made has been released, and every hint the engine counted reached
  // the daemon (releases and hints are one-way ring entries: wait for the last).
  static void expect_settled(client::Session& session, const EngineStats& s) {
    const uint64_t hints = s.hints_sent + s.hash_hints + s.prefill_hints;
    auto ss = session.stats();
    expertd::test::wait_until(
        [&] {
          ss = session.stats();
          return !ss || (ss->releases == ss->acquires && ss->prefetches == hints);
        },
        std::chrono::seconds(10));
    ASSERT_TRUE(ss) << ss.error().message;
    EXPECT_EQ(ss->releases, ss->acquires);
    EXPECT_EQ(ss->acquires, s.experts_used);
    EXPECT_EQ(ss->prefetches, hints);
    EXPECT_EQ(session.holds(), 0u);
  }

  TempDir dir_;
  std::vector<Variant> variants_;
  std::string socket_;
  std::unique_ptr<Daemon> daemon_;
};

// Greedy tokens after the prompt's logits.
std::vector<uint32_t> continue_greedy(Engine& e, std::vector<float> logits) {
  std::vector<uint32_t> out;
  while (out.size() < kContinuation) {
    out.push_back(argmax(logits));
    const Status st = e.decode(out.back(), logits);
    EXPECT_TRUE(st) << st.error().message;
    if (!st) break;
  }
  return out;
}

TEST_F(PrefillTest, MatchesDecodeForEveryChunkSizeAndAcquiresEachExpertOncePerChunk) {
  for (const Variant& v : variants_) {
    SCOPED_TRACE(v.name);
    auto model = DenseModel::load(v.gguf);
    ASSERT_TRUE(model) << model.error().message;
    const ModelParams& p = model->params();
    const auto n = static_cast<uint32_t>(v.prompt.size());

    // Token by token.
    EngineOptions o;
    o.max_context = 64;
    o.prefetch_depth = 1;
    Run ref = open(*model, v, o);
    ASSERT_TRUE(ref.engine);
    std::vector<RoutingRecord> ref_log;
    ref.engine->set_routing_log(&ref_log);
    std::vector<float> expected(p.n_vocab);
    for (const uint32_t t : v.prompt) ASSERT_TRUE(ref.engine->decode(t, expected));
    const uint64_t ref_experts = ref.engine->stats().experts_used;
    ref.engine->set_routing_log(nullptr);
    const std::vector<uint32_t> ref_next = continue_greedy(*ref.engine, expected);
    std::set<std::pair<uint32_t, uint32_t>> distinct;
    for (const RoutingRecord& r : ref_log) {
      for (const uint32_t x : r.experts) distinct.insert({r.layer, x});
    }

    for (const uint32_t chunk : {1u, 3u, 7u, 512u}) {
      SCOPED_TRACE("chunk " + std::to_string(chunk));
      o.prefill_chunk = chunk;
      Run run = open(*model, v, o);
      ASSERT_TRUE(run.engine);
      std::vector<RoutingRecord> log;
      run.engine->set_routing_log(&log);
      std::vector<float> logits(p.n_vocab);
      const Status st = run.engine->prefill(v.prompt, logits);
      ASSERT_TRUE(st) << st.error().message;
      EXPECT_EQ(run.engine->position(), n);
      const double err = max_rel_err(logits, expected);
      EXPECT_LE(err, kMaxRelErr);
      std::printf("[ %s chunk %u ] prefill vs decode: max relative error %.3e\n", v.name.c_str(),
                  chunk, err);
      // The same routing, logged in decode's order.
      ASSERT_EQ(log.size(), ref_log.size());
      for (size_t i = 0; i < log.size(); ++i) {
        EXPECT_EQ(log[i].token, ref_log[i].token) << "record " << i;
        EXPECT_EQ(log[i].layer, ref_log[i].layer) << "record " << i;
        EXPECT_EQ(log[i].experts, ref_log[i].experts) << "record " << i;
      }
      run.engine->set_routing_log(nullptr);

      const EngineStats s = run.engine->stats();
      EXPECT_EQ(s.prefill_tokens, n);
      EXPECT_EQ(s.tokens, n);
      EXPECT_EQ(s.prefill_chunks, (n + chunk - 1) / chunk);
      EXPECT_EQ(s.hint_errors, 0u);
      EXPECT_GT(s.prefill_ns, 0u);
      if (chunk == 1) {
        EXPECT_EQ(s.prefill_experts, ref_experts);  // one position per chunk: nothing shared
      }
      if (chunk == 512) {
        // One chunk: every (layer, expert) the prompt routed to, acquired once.
        EXPECT_EQ(s.prefill_experts, distinct.size());
        EXPECT_LT(s.prefill_experts, ref_experts);
        // More experts than top-k per layer: hinted first, then acquired k at a time.
        EXPECT_GT(s.prefill_hints, 0u);
        std::printf("[ %s ] experts acquired: %llu by prefill, %llu token by token\n",
                    v.name.c_str(), static_cast<unsigned long long>(s.prefill_experts),
                    static_cast<unsigned long long>(ref_experts));
      }
      EXPECT_EQ(s.experts_used, s.prefill_experts);
      // Lookahead over a chunk counts each (layer, expert) once, as its hints are sent.
      EXPECT_LE(s.hinted_routed, s.hints_sent);
      EXPECT_LE(s.hinted_routed, s.routed_hintable);
      EXPECT_EQ(continue_greedy(*run.engine, logits), ref_next);
      expect_settled(*run.session, run.engine->stats());
    }
  }
}

TEST_F(PrefillTest, APromptLongerThanTheKvCacheIsRefusedBeforeAnythingRuns) {
  for (const Variant& v : variants_) {
    SCOPED_TRACE(v.name);
    auto model = DenseModel::load(v.gguf);
    ASSERT_TRUE(model) << model.error().message;
    EngineOptions o;
    o.max_context = static_cast<uint32_t>(v.prompt.size()) - 1;
    o.prefill_chunk = 4;
    Run run = open(*model, v, o);
    ASSERT_TRUE(run.engine);
    std::vector<float> logits(model->params().n_vocab);
    const Status st = run.engine->prefill(v.prompt, logits);
    ASSERT_FALSE(st);
    EXPECT_EQ(st.error().code, ENOSPC);
    EXPECT_NE(st.error().message.find("do not fit the KV cache"), std::string::npos)
        << st.error().message;
    EXPECT_EQ(run.engine->position(), 0u);
    EXPECT_EQ(run.engine->stats().experts_used, 0u);
    EXPECT_EQ(run.engine->stats().prefill_tokens, 0u);
    auto ss = run.session->stats();
    ASSERT_TRUE(ss) << ss.error().message;
    EXPECT_EQ(ss->acquires, 0u);
    // The prompt that fits still runs on the same engine.
    const std::vector<uint32_t> fits(v.prompt.begin(), v.prompt.end() - 1);
    EXPECT_TRUE(run.engine->prefill(fits, logits));
  }
}

// qwen3moe's KV cache is per position: truncate(n) and decode continue exactly as a fresh sequence
// fed the same prefix.
TEST_F(PrefillTest, TruncateThenDecodeContinuesAsAFreshSequence) {
  for (const Variant& v : variants_) {
    auto model = DenseModel::load(v.gguf);
    ASSERT_TRUE(model) << model.error().message;
    if (model->params().is_ds4()) continue;
    SCOPED_TRACE(v.name);
    const uint32_t vocab = model->params().n_vocab;
    EngineOptions o;
    o.max_context = 32;
    o.prefill_chunk = 5;
    Run run = open(*model, v, o);
    ASSERT_TRUE(run.engine);
    Run fresh = open(*model, v, o);
    ASSERT_TRUE(fresh.engine);
    std::vector<float> logits(vocab);
    std::vector<float> expected(vocab);
    ASSERT_TRUE(run.engine->prefill(v.prompt, logits));
    EXPECT_FALSE(run.engine->truncate(run.engine->position() + 1));
    EXPECT_EQ(run.engine->position(), v.prompt.size());
    const uint32_t keep = 4;
    ASSERT_TRUE(run.engine->truncate(keep));
    EXPECT_EQ(run.engine->position(), keep);
    // A different continuation of the kept prefix.
    std::vector<uint32_t> seq(v.prompt.begin(), v.prompt.begin() + keep);
    for (uint32_t t = 0; t < 5; ++t) seq.push_back((v.prompt[t] * 7 + 3) % vocab);
    ASSERT_TRUE(fresh.engine->prefill(std::span<const uint32_t>(seq.data(), keep), expected));
    for (size_t i = keep; i < seq.size(); ++i) {
      ASSERT_TRUE(run.engine->decode(seq[i], logits));
      ASSERT_TRUE(fresh.engine->decode(seq[i], expected));
      EXPECT_EQ(logits, expected) << "position " << i;
    }
    // And a prefill after the cut matches too.
    ASSERT_TRUE(run.engine->truncate(keep + 1));
    ASSERT_TRUE(fresh.engine->truncate(keep + 1));
    ASSERT_TRUE(run.engine->prefill(std::span<const uint32_t>(seq.data() + keep + 1, 3), logits));
    for (size_t i = keep + 1; i < keep + 4; ++i)
      ASSERT_TRUE(fresh.engine->decode(seq[i], expected));
    EXPECT_LE(max_rel_err(logits, expected), kMaxRelErr);
    expect_settled(*run.session, run.engine->stats());
  }
}

// A daemon with the smallest cache it accepts (top-k = 2 slots of 28 KiB for the qwen3moe fixture;
// expertd names the minimum if the slot size changes) and the smallest staging ring can never hold
// a layer's experts at once: prefill acquires them k at a time, so it still runs, and gives
// decode's logits.
TEST(PrefillSmallDaemon, AcquiresAtMostTopKAtATime) {
  const test::TinyFixture fx = test::TinyFixture::load();
  TempDir dir;
  const std::string socket = dir.path() + "/expertd.sock";
  Daemon daemon(dir.path(), {"--model", "tiny=" + fx.gguf("f32"), "--socket", socket, "--cache",
                             "56KiB", "--staging", "1", "--no-mlock"});
  ASSERT_TRUE(daemon.start());
  auto model = DenseModel::load(fx.gguf("f32"));
  ASSERT_TRUE(model) << model.error().message;
  ASSERT_EQ(model->params().n_expert_used, 2u);
  std::vector<float> expected(fx.vocab);
  std::vector<float> logits(fx.vocab);
  for (const uint32_t chunk : {1u, 512u}) {
    SCOPED_TRACE("chunk " + std::to_string(chunk));
    auto source = DaemonExpertSource::connect(socket, "tiny", *model, "prefill_test");
    ASSERT_TRUE(source) << source.error().message;
    EngineOptions o;
    o.max_context = 16;
    o.prefetch_depth = 1;
    o.prefill_chunk = chunk;
    auto engine = create_cpu_engine(*model, **source, o);
    ASSERT_TRUE(engine) << engine.error().message;
    const Status st = (*engine)->prefill(fx.tokens, chunk == 1 ? expected : logits);
    ASSERT_TRUE(st) << st.error().message;
  }
  EXPECT_EQ(logits, expected);
  const std::string log = daemon.log();
  EXPECT_EQ(daemon.stop(), 0) << log;
}

// The PrefillCursor tests' model: 4 layers of 16 experts, top-2, q8_0.
constexpr const char* kCursorModel =
    "--layers 4 --experts 16 --top-k 2 --embd 256 --ff 256 --heads 4 --kv-heads 2 --head-dim 64 "
    "--vocab 320 --expert-type q8_0 --seed 3";

// The cursor rule every prefill keeps (start_prefill_cursor, then each layer named only once its
// exact hints are out), against a real expertd at prefetch depth 1: hints sent while the cursor is
// before their layer are read ahead (layer 0's from the chunk's start, layer 1's with the cursor
// on layer 0); the same kind of hints sent after the cursor named their layer are for the next
// token, beyond the depth, and are never read (the CUDA prefills sent them so until 2026-12-04).
TEST(PrefillCursor, ALayersHintsAreReadAheadOnlyBeforeTheCursorNamesTheLayer) {
  TempDir dir;
  const std::string path = expertd::test::forge(dir.path(), "m", kCursorModel);
  const std::string socket = dir.path() + "/expertd.sock";
  Daemon daemon(dir.path(), {"--model", "m=" + path, "--socket", socket, "--cache", "64MiB",
                             "--prefetch-depth", "1", "--no-mlock"});
  ASSERT_TRUE(daemon.start());
  auto model = DenseModel::load(path);
  ASSERT_TRUE(model) << model.error().message;
  auto source = DaemonExpertSource::connect(socket, "m", *model, "prefill_test");
  ASSERT_TRUE(source) << source.error().message;
  ExpertSource& s = **source;
  auto hints = [](uint32_t layer, uint32_t from, uint32_t count) {
    std::vector<ExpertHint> h;
    for (uint32_t e = from; e < from + count; ++e) h.push_back(ExpertHint{layer, e, 1.0f});
    return h;
  };
  // The wrong order: layer 2 named, then its hints.
  ASSERT_TRUE(s.set_cursor(10, 2));
  ASSERT_TRUE(s.prefetch(hints(2, 0, 6)));
  // The rule, for the next chunk (last position 20): layer 0's hints from the chunk's start, then
  // layer 0 named, then layer 1's.
  EngineStats stats;
  start_prefill_cursor(s, 20, model->params().n_layer, stats);
  EXPECT_EQ(stats.hint_errors, 0u);
  ASSERT_TRUE(s.prefetch(hints(0, 0, 4)));
  ASSERT_TRUE(s.set_cursor(20, 0));
  ASSERT_TRUE(s.prefetch(hints(1, 0, 6)));
  auto ready = [&](uint32_t layer, uint32_t count) {
    std::vector<uint32_t> ids(count);
    for (uint32_t e = 0; e < count; ++e) ids[e] = e;
    std::vector<uint8_t> out(count);
    s.host_ready(layer, ids, out);
    return static_cast<uint32_t>(std::count(out.begin(), out.end(), uint8_t{1}));
  };
  for (int i = 0; i < 400 && (ready(0, 4) < 4 || ready(1, 6) < 6); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  EXPECT_EQ(ready(0, 4), 4u) << "layer 0's hints, sent from the chunk's start, were read ahead";
  EXPECT_EQ(ready(1, 6), 6u) << "layer 1's, sent with the cursor on layer 0, were read ahead";
  EXPECT_EQ(ready(2, 6), 0u) << "layer 2's, sent after the cursor named it, were not";
  auto st = (*source)->client()->stats();
  ASSERT_TRUE(st) << st.error().message;
  ASSERT_EQ(st->models.size(), 1u);
  EXPECT_EQ(st->models[0].scheduler.prefetch_loads, 10u);
  const std::string log = daemon.log();
  EXPECT_EQ(daemon.stop(), 0) << log;
}

// Passes every call on, but sends the hints as predictions (the exact flag cleared): what the
// engines sent before exact hints existed.
class PredictedHintsOnly : public ForwardingSource {
 public:
  using ForwardingSource::ForwardingSource;
  Status prefetch(std::span<const ExpertHint> hints) override {
    copy_.assign(hints.begin(), hints.end());
    for (ExpertHint& h : copy_) h.exact = false;
    return ForwardingSource::prefetch(copy_);
  }

 private:
  std::vector<ExpertHint> copy_;
};

// A fresh daemon's automatic depth is 0 until predicted hints earn it, and a one-chunk prompt
// never moves the cursor's token, so the estimate never folds during it: the prefill's own routing
// was read on demand only, layer after layer. Flagged exact, it is read ahead from the first layer.
TEST(PrefillCursor, AFreshDaemonReadsAChunksExactHintsAhead) {
  TempDir dir;
  const std::string path = expertd::test::forge(dir.path(), "m", kCursorModel);
  auto model = DenseModel::load(path);
  ASSERT_TRUE(model) << model.error().message;
  std::vector<uint32_t> prompt(48);
  for (uint32_t i = 0; i < prompt.size(); ++i) prompt[i] = (i * 37 + 5) % 320;
  std::vector<float> logits(model->params().n_vocab);
  std::vector<float> first;
  client::SchedulerStats with{};
  client::SchedulerStats without{};
  for (const bool exact : {true, false}) {
    SCOPED_TRACE(exact ? "exact hints" : "the same hints as predictions");
    TempDir run;
    const std::string socket = run.path() + "/expertd.sock";
    Daemon daemon(run.path(),
                  {"--model", "m=" + path, "--socket", socket, "--cache", "64MiB", "--no-mlock"});
    ASSERT_TRUE(daemon.start());
    auto source = DaemonExpertSource::connect(socket, "m", *model, "prefill_test");
    ASSERT_TRUE(source) << source.error().message;
    PredictedHintsOnly predicted(**source);
    ExpertSource& s = exact ? static_cast<ExpertSource&>(**source) : predicted;
    EngineOptions o{64, 1, 0};
    o.prefill_chunk = static_cast<uint32_t>(prompt.size());
    auto engine = CpuEngine::create(*model, s, o);
    ASSERT_TRUE(engine) << engine.error().message;
    ASSERT_TRUE((*engine)->prefill(prompt, logits));
    if (first.empty()) {
      first = logits;
    } else {
      EXPECT_EQ(logits, first) << "hints change what is read when, never the result";
    }
    EXPECT_GT((*engine)->stats().prefill_hints, 0u);
    auto st = (*source)->client()->stats();
    ASSERT_TRUE(st) << st.error().message;
    ASSERT_EQ(st->models.size(), 1u);
    EXPECT_EQ(st->models[0].prefetch_depth_now, 0u) << "no decode yet: no evidence";
    (exact ? with : without) = st->models[0].scheduler;
    const std::string log = daemon.log();
    EXPECT_EQ(daemon.stop(), 0) << log;
  }
  std::printf(
      "[ fresh daemon, one 48-row chunk ] exact hints: %llu read ahead, %llu demand "
      "misses; as predictions: %llu read ahead, %llu demand misses\n",
      static_cast<unsigned long long>(with.exact_loads),
      static_cast<unsigned long long>(with.misses),
      static_cast<unsigned long long>(without.prefetch_loads),
      static_cast<unsigned long long>(without.misses));
  EXPECT_EQ(without.prefetch_loads, 0u) << "predicted hints wait for evidence a chunk never gives";
  EXPECT_EQ(without.exact_hints, 0u);
  EXPECT_GT(with.exact_hints, 0u);
  EXPECT_EQ(with.exact_loads, with.prefetch_loads);
  EXPECT_EQ(with.exact_wasted, 0u);
  // The same experts are acquired either way: read ahead, or on demand.
  const uint64_t experts = without.misses;
  ASSERT_GT(experts, 16u);
  EXPECT_EQ(with.misses + with.exact_loads, experts);
  EXPECT_GE(with.exact_loads, experts / 2) << "most of the chunk's experts were read ahead";
}

// Benchmark mode: prefill takes the script's routes for every position, as decode does, on a
// forged model (q8_0 experts, f16 dense weights) read through the file source.
TEST(PrefillScripted, TakesTheScriptedRoutesAsDecodeDoes) {
  TempDir dir;
  auto model = DenseModel::load(expertd::test::forge(
      dir.path(), "m",
      "--layers 3 --experts 8 --top-k 2 --embd 256 --ff 256 --heads 4 --kv-heads 2 --head-dim 64 "
      "--vocab 300 --expert-type q8_0 --dense-type f16 --seed 9"));
  ASSERT_TRUE(model) << model.error().message;
  const ModelParams& p = model->params();
  const std::vector<uint32_t> prompt{5, 17, 250, 3, 99, 42, 7, 8, 9};
  RoutingScript script(static_cast<uint32_t>(prompt.size()), 3);
  for (uint32_t t = 0; t < prompt.size(); ++t) {
    if (t == 4) continue;  // a position the trace lacks: the router decides
    for (uint32_t l = 0; l < 3; ++l) {
      ASSERT_TRUE(
          script.set(t, l, ScriptedRoute{{(t + l) % 8, (t * 3 + l + 1) % 8}, {0.7f, 0.3f}, {}}, p));
    }
  }
  EngineOptions o{16, 2, 0, &script, HintSource::Script};
  o.prefill_chunk = 4;
  std::vector<float> expected(p.n_vocab);
  std::vector<float> logits(p.n_vocab);
  std::vector<RoutingRecord> ref_log;
  std::vector<RoutingRecord> log;
  auto ref_source = test::FileExpertSource::open(*model);
  ASSERT_TRUE(ref_source);
  auto ref = CpuEngine::create(*model, **ref_source, o);
  ASSERT_TRUE(ref);
  (*ref)->set_routing_log(&ref_log);
  for (const uint32_t t : prompt) ASSERT_TRUE((*ref)->decode(t, expected));
  auto source = test::FileExpertSource::open(*model);
  ASSERT_TRUE(source);
  auto engine = CpuEngine::create(*model, **source, o);
  ASSERT_TRUE(engine);
  (*engine)->set_routing_log(&log);
  ASSERT_TRUE((*engine)->prefill(prompt, logits));
  EXPECT_EQ(logits, expected);
  EXPECT_EQ((*engine)->stats().scripted_routes, (prompt.size() - 1) * 3);
  EXPECT_EQ((*engine)->stats().scripted_routes, (*ref)->stats().scripted_routes);
  ASSERT_EQ(log.size(), ref_log.size());
  for (size_t i = 0; i < log.size(); ++i) {
    EXPECT_EQ(log[i].token, ref_log[i].token);
    EXPECT_EQ(log[i].experts, ref_log[i].experts) << "record " << i;
    EXPECT_EQ(log[i].weights, ref_log[i].weights) << "record " << i;
    const ScriptedRoute* r = script.find(log[i].token, log[i].layer);
    if (r != nullptr) {
      EXPECT_EQ(log[i].experts, r->experts) << "record " << i;
    }
  }
  EXPECT_EQ((*engine)->stats().prefill_chunks, 3u);
}

}  // namespace
}  // namespace expertd::engine
