// DeepSeek-V4 on the product path: the real expertd serves the committed deepseek4 fixtures and
// the CPU engine gets its experts through libexpertd-client; expert-run decodes them with --json.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "engine/cpu_engine.h"
#include "engine/daemon_expert_source.h"
#include "expertd/client.h"
#include "testing/expertd_fixture.h"
#include "tests/engine/fixture.h"
#include "text/tokenizer.h"

namespace expertd::engine {
namespace {

using namespace expertd::text;

using expertd::test::Daemon;
using expertd::test::TempDir;

std::string ds4_gguf(const std::string& variant) {
  return test::fixture_path("deepseek4-tiny/model-" + variant + ".gguf");
}

std::string joined(const std::vector<uint32_t>& v) {
  std::string s;
  for (const uint32_t x : v) s += (s.empty() ? "" : ",") + std::to_string(x);
  return s;
}

class Ds4DaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    meta_ = test::read_json(test::fixture_path("deepseek4-tiny/fixture.json"));
    tokens_ = meta_.at("tokens").get<std::vector<uint32_t>>();
    prompt_ = meta_.at("prompt_tokens").get<uint32_t>();
    socket_ = dir_.path() + "/expertd.sock";
    daemon_ = std::make_unique<Daemon>(
        dir_.path(), std::vector<std::string>{"--model", "v4-f32=" + ds4_gguf("f32"), "--model",
                                              "v4-q8_0=" + ds4_gguf("q8_0"), "--model",
                                              "v4-mxfp4=" + ds4_gguf("mxfp4"), "--socket", socket_,
                                              "--cache", "16MiB", "--no-mlock"});
    ASSERT_TRUE(daemon_->start());
  }
  void TearDown() override {
    const std::string log = daemon_->log();
    EXPECT_EQ(daemon_->stop(), 0) << log;
  }

  TempDir dir_;
  nlohmann::json meta_;
  std::vector<uint32_t> tokens_;
  uint32_t prompt_ = 0;
  std::string socket_;
  std::unique_ptr<Daemon> daemon_;
};

TEST_F(Ds4DaemonTest, LogitsMatchTransformersWithExpertsFromExpertd) {
  for (const std::string variant : {"f32", "mxfp4", "q8_0"}) {
    SCOPED_TRACE(variant);
    auto model = DenseModel::load(ds4_gguf(variant));
    ASSERT_TRUE(model) << model.error().message;
    const ModelParams& p = model->params();
    auto client = client::Client::connect(socket_);
    ASSERT_TRUE(client) << client.error().message;
    auto session = (*client)->attach("v4-" + variant, "engine_tests");
    ASSERT_TRUE(session) << session.error().message;
    auto source = DaemonExpertSource::create(**session, *model);
    ASSERT_TRUE(source) << source.error().message;
    auto engine = create_cpu_engine(*model, **source, EngineOptions{64, 1, 0});
    ASSERT_TRUE(engine) << engine.error().message;
    const std::vector<float> expected = test::read_f32(test::fixture_path(
        "deepseek4-tiny/logits-" + std::string(variant == "q8_0" ? "q8_0" : "f32") + ".bin"));
    const uint32_t vocab = p.n_vocab;
    std::vector<float> logits(vocab);
    double worst = 0.0;
    for (size_t t = 0; t < tokens_.size(); ++t) {
      const Status st = (*engine)->decode(tokens_[t], logits);
      ASSERT_TRUE(st) << st.error().message;
      const double err = test::rel_err(logits.data(), expected.data() + t * vocab, vocab);
      EXPECT_LE(err, 1e-4) << "position " << t;
      worst = std::max(worst, err);
    }
    std::printf("[ deepseek4 %s via expertd ] max relative error over %zu positions: %.3e\n",
                variant.c_str(), tokens_.size(), worst);
    const EngineStats& s = (*engine)->stats();
    EXPECT_EQ(s.hint_errors, 0u);
    EXPECT_EQ(s.hash_hints, tokens_.size() * p.ds4.hash_layers * p.n_expert_used);
    // Every hint (exact hash-layer hints and router lookahead) reached the daemon.
    auto ss = (*session)->stats();
    expertd::test::wait_until(
        [&] {
          ss = (*session)->stats();
          return !ss ||
                 (ss->releases == ss->acquires && ss->prefetches == s.hints_sent + s.hash_hints);
        },
        std::chrono::seconds(10));
    ASSERT_TRUE(ss) << ss.error().message;
    EXPECT_EQ(ss->acquires, tokens_.size() * p.n_layer * p.n_expert_used);
    EXPECT_EQ(ss->releases, ss->acquires);
    EXPECT_EQ(ss->prefetches, s.hints_sent + s.hash_hints);
    EXPECT_EQ((*session)->holds(), 0u);
  }
}

TEST_F(Ds4DaemonTest, ExpertRunDecodesADeepseek4ModelWithJson) {
  const std::vector<uint32_t> prompt(tokens_.begin(), tokens_.begin() + prompt_);
  const uint32_t n = static_cast<uint32_t>(tokens_.size()) - prompt_;
  for (const bool hints : {true, false}) {
    SCOPED_TRACE(hints ? "hash hints" : "no hash hints");
    std::vector<std::string> args{expertd::test::bin_path("expert-run"),
                                  "--socket",
                                  socket_,
                                  "--model",
                                  "v4-f32",
                                  "--gguf",
                                  ds4_gguf("f32"),
                                  "--prompt-tokens",
                                  joined(prompt),
                                  "--max-tokens",
                                  std::to_string(n),
                                  "--json",
                                  "--ignore-eos",
                                  "--cpu"};
    if (!hints) args.push_back("--no-hash-hints");
    const auto r = expertd::test::run_command(args);
    ASSERT_EQ(r.status, 0) << r.out << r.err;
    const auto j = nlohmann::json::parse(r.out);
    // transformers' greedy continuation.
    EXPECT_EQ(j.at("generated").get<std::vector<uint32_t>>(),
              std::vector<uint32_t>(tokens_.begin() + prompt_, tokens_.end()));
    EXPECT_EQ(j.at("engine").get<std::string>(), "cpu");
    for (const char* key : {"tokens_per_s", "stall_ms_per_token", "generation", "hits", "daemon",
                            "prefetch_precision", "experts_used", "decode_steps"}) {
      EXPECT_TRUE(j.contains(key)) << key;
    }
    const auto& v4 = j.at("deepseek4");
    EXPECT_EQ(v4.at("hash_layers").get<uint32_t>(), 2u);
    EXPECT_EQ(v4.at("hash_hints_enabled").get<bool>(), hints);
    const uint64_t steps = j.at("decode_steps").get<uint64_t>();
    // The prompt is one prefill chunk: each (layer, expert) it routes to is hinted and acquired
    // once; a hash layer's are tid2eid[token]. Then every generated token takes k per layer.
    auto model = DenseModel::load(ds4_gguf("f32"));
    ASSERT_TRUE(model) << model.error().message;
    std::set<std::pair<uint32_t, uint32_t>> hashed;
    for (const uint32_t t : prompt) {
      for (uint32_t layer = 0; layer < 2; ++layer) {
        for (uint32_t i = 0; i < 2; ++i) {
          hashed.insert({layer, model->ds4()->layers[layer].tid2eid[t * 2 + i]});
        }
      }
    }
    const uint64_t gen = steps - prompt_;
    const uint64_t acquired = j.at("prefill").at("experts_acquired").get<uint64_t>();
    EXPECT_EQ(v4.at("hash_hints").get<uint64_t>(), hints ? hashed.size() + gen * 2 * 2 : 0u);
    EXPECT_EQ(v4.at("hash").at("experts").get<uint64_t>(), hashed.size() + gen * 2 * 2);
    EXPECT_EQ(v4.at("learned").at("experts").get<uint64_t>(),
              acquired - hashed.size() + gen * 3 * 2);
    for (const char* cls : {"hash", "learned"}) {
      const double rate = v4.at(cls).at("hit_rate").get<double>();
      EXPECT_GE(rate, 0.0) << cls;
      EXPECT_LE(rate, 1.0) << cls;
    }
  }
}

// --prompt tokenises with the model's own vocabulary: the fixture's prompt text gives the
// fixture's token ids and so transformers' greedy continuation, streamed before the summary.
TEST_F(Ds4DaemonTest, ExpertRunTakesThePromptAsText) {
  const std::string text = meta_.at("prompt").get<std::string>();
  const uint32_t n = static_cast<uint32_t>(tokens_.size()) - prompt_;
  const auto r = expertd::test::run_command(
      {expertd::test::bin_path("expert-run"), "--socket", socket_, "--model", "v4-f32", "--prompt",
       text, "--max-tokens", std::to_string(n), "--ignore-eos", "--cpu", "--json"});
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j.at("prompt_tokens").get<std::vector<uint32_t>>(),
            std::vector<uint32_t>(tokens_.begin(), tokens_.begin() + prompt_));
  EXPECT_EQ(j.at("generated").get<std::vector<uint32_t>>(),
            std::vector<uint32_t>(tokens_.begin() + prompt_, tokens_.end()));

  const std::string file = dir_.path() + "/prompt.txt";
  {
    std::ofstream f(file, std::ios::binary);
    f << text;
  }
  const auto t = expertd::test::run_command({expertd::test::bin_path("expert-run"), "--socket",
                                             socket_, "--model", "v4-f32", "--prompt-file", file,
                                             "--max-tokens", "3", "--ignore-eos", "--cpu"});
  ASSERT_EQ(t.status, 0) << t.out << t.err;
  // The answer streams first; the summary follows on its own lines.
  EXPECT_LT(t.out.find("\n\nprompt: 39 tokens"), t.out.find("generated: ")) << t.out;

  const auto both =
      expertd::test::run_command({expertd::test::bin_path("expert-run"), "--socket", socket_,
                                  "--model", "v4-f32", "--prompt", "x", "--prompt-tokens", "1,2"});
  EXPECT_NE(both.status, 0);
  EXPECT_NE(both.err.find("give exactly one of --prompt, --prompt-file and --prompt-tokens"),
            std::string::npos)
      << both.err;
  const auto missing =
      expertd::test::run_command({expertd::test::bin_path("expert-run"), "--socket", socket_,
                                  "--model", "v4-f32", "--prompt-file", dir_.path() + "/none.txt"});
  EXPECT_NE(missing.status, 0);
  EXPECT_NE(missing.err.find("--prompt-file " + dir_.path() + "/none.txt: No such file"),
            std::string::npos)
      << missing.err;
}

// --chat renders the prompt as a user turn with the model's own template (DeepSeek-V4's, thinking
// off) and encodes it without adding a second BOS: the same tokens, and so the same answer, as
// --prompt-tokens of that conversation encoded by hand.
TEST_F(Ds4DaemonTest, ExpertRunChatRendersTheModelsTemplate) {
  auto f = GgufFile::open(ds4_gguf("f32"));
  ASSERT_TRUE(f) << f.error().message;
  auto tok = Tokenizer::from_gguf(*f);
  ASSERT_TRUE(tok) << tok.error().message;
  const std::string bos = tok->decode(*tok->bos());
  auto want = tok->encode(bos + "Be brief.<｜User｜>Hello, MoE!<｜Assistant｜></think>",
                          /*add_special=*/false);
  ASSERT_TRUE(want) << want.error().message;
  ASSERT_EQ(want->front(), *tok->bos());

  const auto chat = expertd::test::run_command(
      {expertd::test::bin_path("expert-run"), "--socket", socket_, "--model", "v4-f32", "--chat",
       "--system", "Be brief.", "--prompt", "Hello, MoE!", "--max-tokens", "4", "--ignore-eos",
       "--cpu", "--json"});
  ASSERT_EQ(chat.status, 0) << chat.out << chat.err;
  const auto jc = nlohmann::json::parse(chat.out);
  EXPECT_EQ(jc.at("prompt_tokens").get<std::vector<uint32_t>>(), *want);

  const auto ids = expertd::test::run_command(
      {expertd::test::bin_path("expert-run"), "--socket", socket_, "--model", "v4-f32",
       "--prompt-tokens", joined(*want), "--max-tokens", "4", "--ignore-eos", "--cpu", "--json"});
  ASSERT_EQ(ids.status, 0) << ids.out << ids.err;
  const auto ji = nlohmann::json::parse(ids.out);
  EXPECT_EQ(jc.at("generated"), ji.at("generated"));
  EXPECT_EQ(jc.at("generated").size(), 4u);
  // DeepSeek-V4 reasons in <think> blocks, but its default prompt closed the block (thinking off):
  // the answer is all content.
  EXPECT_EQ(jc.at("reasoning"), "");
  EXPECT_EQ(jc.at("content"), jc.at("text"));

  // The template's thinking switch: `thinking` opens the block, the answer starts in the reasoning.
  const auto think = expertd::test::run_command(
      {expertd::test::bin_path("expert-run"), "--socket", socket_, "--model", "v4-f32", "--chat",
       "--system", "Be brief.", "--prompt", "Hello, MoE!", "--max-tokens", "4", "--ignore-eos",
       "--cpu", "--json", "--chat-template-kwargs", R"({"thinking": true})"});
  ASSERT_EQ(think.status, 0) << think.out << think.err;
  const auto jt = nlohmann::json::parse(think.out);
  auto want_think =
      tok->encode(bos + "Be brief.<｜User｜>Hello, MoE!<｜Assistant｜><think>", false);
  ASSERT_TRUE(want_think) << want_think.error().message;
  EXPECT_EQ(jt.at("prompt_tokens").get<std::vector<uint32_t>>(), *want_think);
  EXPECT_EQ(jt.at("content"), "") << jt.at("text");  // no </think> in four random tokens
  const auto bad_kwargs = expertd::test::run_command(
      {expertd::test::bin_path("expert-run"), "--socket", socket_, "--model", "v4-f32", "--chat",
       "--prompt", "x", "--cpu", "--chat-template-kwargs", R"({"thinking": "yes"})"});
  EXPECT_NE(bad_kwargs.status, 0);
  EXPECT_NE(bad_kwargs.err.find("--chat-template-kwargs.thinking must be a boolean, got a string "
                                "(\"yes\")"),
            std::string::npos)
      << bad_kwargs.err;

  // --chat-template overrides the model's: ChatML by name gives other tokens.
  const auto chatml = expertd::test::run_command(
      {expertd::test::bin_path("expert-run"), "--socket", socket_, "--model", "v4-f32", "--chat",
       "--chat-template", "chatml", "--prompt", "Hello, MoE!", "--max-tokens", "1", "--cpu",
       "--json"});
  ASSERT_EQ(chatml.status, 0) << chatml.out << chatml.err;
  auto want_chatml =
      tok->encode("<|im_start|>user\nHello, MoE!<|im_end|>\n<|im_start|>assistant\n", false);
  ASSERT_TRUE(want_chatml) << want_chatml.error().message;
  EXPECT_EQ(nlohmann::json::parse(chatml.out).at("prompt_tokens").get<std::vector<uint32_t>>(),
            *want_chatml);

  // A template file it does not know is refused, naming the file and the template's first line.
  const std::string jinja = dir_.path() + "/gemma.jinja";
  {
    std::ofstream out(jinja, std::ios::binary);
    out << "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n{% endfor %}";
  }
  const auto bad = expertd::test::run_command({expertd::test::bin_path("expert-run"), "--socket",
                                               socket_, "--model", "v4-f32", "--chat",
                                               "--chat-template", jinja, "--prompt", "x", "--cpu"});
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.err.find("--chat-template " + jinja +
                         ": chat template not supported (first line: '{{ bos_token }}{% for m in "
                         "messages %}<start_of_turn>{{ m.role }}')"),
            std::string::npos)
      << bad.err;
  const auto no_chat =
      expertd::test::run_command({expertd::test::bin_path("expert-run"), "--socket", socket_,
                                  "--model", "v4-f32", "--system", "s", "--prompt", "x", "--cpu"});
  EXPECT_NE(no_chat.status, 0);
  EXPECT_NE(no_chat.err.find("--system, --chat-template, --chat-template-kwargs and "
                             "--reasoning-effort need --chat"),
            std::string::npos)
      << no_chat.err;
}

TEST_F(Ds4DaemonTest, ExpertRunTextReportsHashAndLearnedLayers) {
  const auto r = expertd::test::run_command(
      {expertd::test::bin_path("expert-run"), "--socket", socket_, "--model", "v4-q8_0", "--gguf",
       ds4_gguf("q8_0"), "--prompt-tokens", "68,101,101,112", "--max-tokens", "3", "--cpu"});
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("deepseek4: 2 hash layers (their experts are hinted exactly"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("deepseek4: hash layers "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("; learned layers "), std::string::npos) << r.out;
}

}  // namespace
}  // namespace expertd::engine

namespace expertd::engine {
namespace {

using namespace expertd::text;

// A forged V4 with an MTP block: the engines run the main blocks only, and expert-run says so.
TEST(Ds4Forged, MtpBlocksAreSkippedAndExpertRunSaysSo) {
  TempDir dir;
  auto path = expertd::test::forge_model(
      dir.path(), "mtp.gguf",
      "--arch deepseek4 --layers 3 --nextn 1 --experts 16 --top-k 4 --embd 256 --ff 256 "
      "--heads 4 --head-dim 128 --q-lora-rank 64 --o-lora-rank 64 --o-groups 2 --index-heads 4 "
      "--index-head-dim 64 --rope-dim 32 --index-topk 8 --window 8 --expert-type q8_0");
  ASSERT_TRUE(path) << path.error().message;
  auto model = DenseModel::load(*path);
  ASSERT_TRUE(model) << model.error().message;
  EXPECT_EQ(model->params().n_layer, 3u);
  EXPECT_EQ(model->params().nextn_layers, 1u);

  const std::string socket = dir.path() + "/expertd.sock";
  Daemon daemon(dir.path(),
                {"--model", "mtp=" + *path, "--socket", socket, "--cache", "64MiB", "--no-mlock"});
  ASSERT_TRUE(daemon.start());
  const auto r = expertd::test::run_command(
      {expertd::test::bin_path("expert-run"), "--socket", socket, "--model", "mtp", "--gguf", *path,
       "--prompt-tokens", "5,6,7", "--max-tokens", "4", "--ignore-eos", "--cpu"});
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("the file's 1 MTP (next-n) layer is skipped"), std::string::npos) << r.out;
  const std::string log = daemon.log();
  EXPECT_EQ(daemon.stop(), 0) << log;
}

}  // namespace
}  // namespace expertd::engine
