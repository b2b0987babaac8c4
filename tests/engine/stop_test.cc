// Stopping: the stop matcher on hand-fed token texts, the end tokens read from GGUF metadata, and
// expert-run through a real expertd cutting its output at a stop string or at --max-tokens.
#include "text/stop.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "storage/gguf_writer.h"
#include "testing/expertd_fixture.h"
#include "tests/engine/fixture.h"

namespace expertd::engine {
namespace {

using namespace expertd::text;

using expertd::test::Daemon;
using expertd::test::TempDir;
using test::TinyFixture;

StopMatcher matcher(std::vector<std::string> stops) {
  auto m = StopMatcher::create(std::move(stops));
  EXPECT_TRUE(m.ok());
  return std::move(m).value();
}

// What each push emitted, and whether it stopped.
std::vector<std::pair<std::string, bool>> feed(StopMatcher& m,
                                               const std::vector<std::string>& texts) {
  std::vector<std::pair<std::string, bool>> out;
  for (const std::string& t : texts) {
    const StopMatcher::Step step = m.push(t);
    out.emplace_back(std::string(step.emit), step.stop);
    if (step.stop) break;
  }
  return out;
}

using Steps = std::vector<std::pair<std::string, bool>>;

TEST(StopMatcher, AStopStringOverSeveralTokensIsHeldBackThenCut) {
  StopMatcher m = matcher({"</s>"});
  EXPECT_EQ(feed(m, {"Hello <", "/", "s> and more"}),
            (Steps{{"Hello ", false}, {"", false}, {"", true}}));
  EXPECT_TRUE(m.stopped());
}

TEST(StopMatcher, APartialMatchThatFailsIsEmittedWhole) {
  StopMatcher m = matcher({"abc"});
  EXPECT_EQ(feed(m, {"xa", "b", "d", "ab"}),
            (Steps{{"x", false}, {"", false}, {"abd", false}, {"", false}}));
  EXPECT_EQ(m.held(), 2u);
  // Generation ended otherwise: the held "ab" is text after all.
  EXPECT_EQ(m.finish(), "ab");
  EXPECT_EQ(m.held(), 0u);
  EXPECT_FALSE(m.stopped());
}

TEST(StopMatcher, AFailedMatchCanStartAnotherOne) {
  // "aaa" is no stop but may end in the start of "aab"; after "aba" + "c" fails, "ab" + "ab"
  // completes "abab".
  StopMatcher m = matcher({"aab", "abab"});
  EXPECT_EQ(feed(m, {"aaa"}), (Steps{{"a", false}}));
  EXPECT_EQ(m.held(), 2u);
  EXPECT_EQ(feed(m, {"c", "aba", "c", "ab", "ab"}),
            (Steps{{"aac", false}, {"", false}, {"abac", false}, {"", false}, {"", true}}));
}

TEST(StopMatcher, TheEarliestStopStringWinsAndTextAfterItIsDropped) {
  StopMatcher m = matcher({"world", "lo"});
  EXPECT_EQ(feed(m, {"Hello world"}), (Steps{{"Hel", true}}));
  StopMatcher nl = matcher({"\n"});
  EXPECT_EQ(feed(nl, {"ab", "c\nd"}), (Steps{{"ab", false}, {"c", true}}));
  // A stop string at the very start emits nothing.
  StopMatcher first = matcher({"x", "###"});
  EXPECT_EQ(feed(first, {"#", "#x"}), (Steps{{"", false}, {"##", true}}));
}

TEST(StopMatcher, WithoutStopStringsEverythingIsEmitted) {
  StopMatcher m = matcher({});
  EXPECT_EQ(feed(m, {"a", "</s>", ""}), (Steps{{"a", false}, {"</s>", false}, {"", false}}));
  EXPECT_EQ(m.finish(), "");
}

TEST(StopMatcher, AnEmptyStopStringIsRefused) {
  auto m = StopMatcher::create({"ok", ""});
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.error().message, "stop: a stop string must not be empty");
}

TEST(EndTokens, ReadFromTheGgufWhereTheyArePresent) {
  const TinyFixture fx = TinyFixture::load();
  auto tiny = GgufFile::open(fx.gguf("f32"));
  ASSERT_TRUE(tiny) << tiny.error().message;
  const EndTokens t = EndTokens::from_gguf(*tiny);
  EXPECT_EQ(t.eos, 0u);
  EXPECT_FALSE(t.eot.has_value());
  EXPECT_FALSE(t.eom.has_value());
  EXPECT_TRUE(t.contains(0));
  EXPECT_FALSE(t.contains(1));

  TempDir dir;
  const std::string path = dir.path() + "/end.gguf";
  GgufWriter w;
  w.set_u32("tokenizer.ggml.eos_token_id", 2);
  w.set_i32("tokenizer.ggml.eot_token_id", 7);
  w.set_i32("tokenizer.ggml.eom_token_id", -1);  // "none", as some converters write it
  ASSERT_TRUE(w.begin(path, GgufWriterOptions{.sync = false}));
  ASSERT_TRUE(w.finish());
  ASSERT_TRUE(w.commit());
  auto f = GgufFile::open(path);
  ASSERT_TRUE(f) << f.error().message;
  const EndTokens e = EndTokens::from_gguf(*f);
  EXPECT_EQ(e.eos, 2u);
  EXPECT_EQ(e.eot, 7u);
  EXPECT_FALSE(e.eom.has_value());
  EXPECT_TRUE(e.contains(7));
  EXPECT_FALSE(e.contains(UINT32_MAX));
}

// gpt-oss's GGUF names <|return|> as its EOS; one that also named <|end|> (the end of the analysis
// message) would stop every answer before its final channel.
TEST(EndTokens, HarmonyEndIsNotAnEndToken) {
  TempDir dir;
  auto write = [&](const std::string& name, std::vector<std::string> tokens) {
    const std::string path = dir.path() + "/" + name;
    GgufWriter w;
    w.set_array("tokenizer.ggml.tokens", std::span<const std::string>(tokens));
    w.set_u32("tokenizer.ggml.eos_token_id", 2);
    w.set_u32("tokenizer.ggml.eot_token_id", 4);
    EXPECT_TRUE(w.begin(path, GgufWriterOptions{.sync = false}));
    EXPECT_TRUE(w.finish());
    EXPECT_TRUE(w.commit());
    auto f = GgufFile::open(path);
    EXPECT_TRUE(f) << f.error().message;
    return EndTokens::from_gguf(*f);
  };
  const std::vector<std::string> harmony = {"<|startoftext|>", "<|endoftext|>", "<|return|>",
                                            "<|start|>",       "<|end|>",       "<|call|>"};
  const EndTokens e = write("harmony.gguf", harmony);
  EXPECT_EQ(e.eos, 2u);
  EXPECT_FALSE(e.eot.has_value());
  EXPECT_FALSE(e.contains(4));
  // Without <|call|> it is not harmony's vocabulary: <|end|> stays what the file says.
  std::vector<std::string> other = harmony;
  other[5] = "<|other|>";
  EXPECT_EQ(write("other.gguf", other).eot, 4u);
}

// expert-run on the fixture model through a real expertd. The fixture's vocabulary is one byte
// per token, so token i of the output is byte i of its text.
class ExpertRunStopTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fx_ = TinyFixture::load();
    socket_ = dir_.path() + "/expertd.sock";
    daemon_ = std::make_unique<Daemon>(
        dir_.path(), std::vector<std::string>{"--model", "tiny=" + fx_.gguf("f32"), "--socket",
                                              socket_, "--cache", "16MiB", "--no-mlock"});
    ASSERT_TRUE(daemon_->start());
  }
  void TearDown() override {
    const std::string log = daemon_->log();
    EXPECT_EQ(daemon_->stop(), 0) << log;
  }

  nlohmann::json run(std::vector<std::string> extra) {
    std::string prompt;
    for (const uint32_t t : fx_.tokens) prompt += (prompt.empty() ? "" : ",") + std::to_string(t);
    std::vector<std::string> argv = {expertd::test::bin_path("expert-run"),
                                     "--socket",
                                     socket_,
                                     "--model",
                                     "tiny",
                                     "--gguf",
                                     fx_.gguf("f32"),
                                     "--prompt-tokens",
                                     prompt,
                                     "--json",
                                     "--cpu",
                                     "--ignore-eos"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    const auto r = expertd::test::run_command(argv);
    EXPECT_EQ(r.status, 0) << r.out << r.err;
    return r.status == 0 ? nlohmann::json::parse(r.out) : nlohmann::json::object();
  }

  TempDir dir_;
  TinyFixture fx_;
  std::string socket_;
  std::unique_ptr<Daemon> daemon_;
};

// As expert-run's JSON spells a text (bytes that are not UTF-8 become U+FFFD).
std::string as_json(const std::string& text) {
  return nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

TEST_F(ExpertRunStopTest, StopCutsTheOutputAndMaxTokensEndsIt) {
  const nlohmann::json full = run({"--max-tokens", "8"});
  ASSERT_TRUE(full.contains("generated"));
  EXPECT_EQ(full.at("stop_reason"), "max_tokens");
  const auto ids = full.at("generated").get<std::vector<uint32_t>>();
  ASSERT_EQ(ids.size(), 8u);
  std::string text;
  for (const uint32_t t : ids) text += static_cast<char>(t);
  EXPECT_EQ(full.at("text").dump(), as_json(text));

  // A stop string of the 3rd and 4th tokens' text, and one that never occurs.
  const std::string stop = text.substr(2, 2);
  const size_t at = text.find(stop);
  const nlohmann::json cut = run({"--max-tokens", "8", "--stop", "never there", "--stop", stop});
  EXPECT_EQ(cut.at("stop_reason"), "stop");
  // Generation stopped at the token that completed the stop string; the text ends before it.
  EXPECT_EQ(cut.at("generated").get<std::vector<uint32_t>>(),
            std::vector<uint32_t>(ids.begin(), ids.begin() + static_cast<ptrdiff_t>(at + 2)));
  EXPECT_EQ(cut.at("text").dump(), as_json(text.substr(0, at)));
  // Every key of the plain run is still there.
  for (const auto& [key, value] : full.items()) EXPECT_TRUE(cut.contains(key)) << key;

  // A stop string whose first byte matches token 3 but whose second never follows: held back,
  // then emitted, and the run ends at --max-tokens with the whole text.
  std::string partial = text.substr(2, 1) + "?";
  for (char c = 1; text.find(partial) != std::string::npos; ++c) partial[1] = c;
  const nlohmann::json held = run({"--max-tokens", "8", "--stop", partial});
  EXPECT_EQ(held.at("stop_reason"), "max_tokens");
  EXPECT_EQ(held.at("generated").get<std::vector<uint32_t>>(), ids);
  EXPECT_EQ(held.at("text").dump(), as_json(text));
  const nlohmann::json short_run = run({"--max-tokens", "3"});
  EXPECT_EQ(short_run.at("stop_reason"), "max_tokens");
  EXPECT_EQ(short_run.at("generated").size(), 3u);
}

TEST(ExpertRunOptions, BadSamplingOptionsAreRefusedNamingTheFlag) {
  const TinyFixture fx = TinyFixture::load();
  auto error = [&](std::vector<std::string> extra) {
    std::vector<std::string> argv = {expertd::test::bin_path("expert-run"),
                                     "--socket",
                                     "/nonexistent/expertd.sock",
                                     "--model",
                                     "tiny",
                                     "--gguf",
                                     fx.gguf("f32"),
                                     "--prompt-tokens",
                                     "1,2"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    const auto r = expertd::test::run_command(argv);
    EXPECT_EQ(r.status, 1);
    return r.err;
  };
  EXPECT_EQ(error({"--top-p", "1.5"}), "expert-run: --top-p must be in (0, 1], got 1.5\n");
  EXPECT_EQ(error({"--temperature", "-1"}),
            "expert-run: --temperature must be 0 (greedy) or positive, got -1\n");
  EXPECT_EQ(error({"--min-p", "2"}), "expert-run: --min-p must be in [0, 1], got 2\n");
  EXPECT_EQ(error({"--top-k", "-3"}), "expert-run: --top-k must be 0 (off) or positive, got -3\n");
  EXPECT_EQ(error({"--repeat-penalty", "0"}),
            "expert-run: --repeat-penalty must be positive (1 = off), got 0\n");
  EXPECT_EQ(error({"--stop", ""}), "expert-run: --stop: a stop string must not be empty\n");
}

}  // namespace
}  // namespace expertd::engine
