// The reasoning splitter on hand-written answers of both syntaxes: what goes to reasoning and to
// content, that the result does not depend on how the answer was cut into pieces (every tag split
// at every byte), that nothing but the parsed tags (and <think>'s white space) is dropped, and
// that a piece cut at character boundaries comes out as whole characters.
#include "text/reasoning.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

namespace expertd::text {
namespace {

struct Split {
  std::string reasoning;
  std::string content;
  bool operator==(const Split&) const = default;
};

std::ostream& operator<<(std::ostream& os, const Split& s) {
  return os << "{reasoning '" << s.reasoning << "', content '" << s.content << "'}";
}

Split feed(ReasoningSyntax syntax, bool in_reasoning, const std::vector<std::string>& pieces) {
  ReasoningSplitter splitter(syntax, in_reasoning);
  Split out;
  for (const std::string& p : pieces) {
    const ReasoningSplitter::Step step = splitter.push(p);
    out.reasoning += step.reasoning;
    out.content += step.content;
  }
  const ReasoningSplitter::Step step = splitter.finish();
  out.reasoning += step.reasoning;
  out.content += step.content;
  return out;
}

Split whole(ReasoningSyntax syntax, const std::string& text, bool in_reasoning = false) {
  return feed(syntax, in_reasoning, {text});
}

// The answer in one piece, byte by byte, and cut at every pair of byte positions: one result.
void expect_any_cut(ReasoningSyntax syntax, const std::string& text, const Split& want,
                    bool in_reasoning = false) {
  ASSERT_EQ(whole(syntax, text, in_reasoning), want) << text;
  std::vector<std::string> bytes;
  for (const char c : text) bytes.emplace_back(1, c);
  EXPECT_EQ(feed(syntax, in_reasoning, bytes), want) << "byte by byte: " << text;
  for (size_t i = 0; i <= text.size(); ++i) {
    for (size_t j = i; j <= text.size(); ++j) {
      const Split got =
          feed(syntax, in_reasoning, {text.substr(0, i), text.substr(i, j - i), text.substr(j)});
      ASSERT_EQ(got, want) << "cut at " << i << " and " << j << ": " << text;
    }
  }
}

bool valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    }
    i += n;
  }
  return true;
}

// Fed one character at a time, every step's reasoning and content are whole characters: the
// splitter holds back only ASCII (tags and white space), so it never cuts one.
void expect_whole_characters(ReasoningSyntax syntax, const std::string& text) {
  ReasoningSplitter splitter(syntax, false);
  for (size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    const size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : 4;
    const ReasoningSplitter::Step step = splitter.push(text.substr(i, n));
    EXPECT_TRUE(valid_utf8(step.reasoning)) << "after byte " << i << " of " << text;
    EXPECT_TRUE(valid_utf8(step.content)) << "after byte " << i << " of " << text;
    i += n;
  }
  const ReasoningSplitter::Step step = splitter.finish();
  EXPECT_TRUE(valid_utf8(step.reasoning));
  EXPECT_TRUE(valid_utf8(step.content));
}

constexpr auto kThink = ReasoningSyntax::kThink;
constexpr auto kHarmony = ReasoningSyntax::kHarmony;

TEST(ReasoningThink, Qwen3BlockIsReasoningAndItsWhiteSpaceGoes) {
  expect_any_cut(kThink, "<think>\nThe user greets me.\n</think>\n\nHello!",
                 {"The user greets me.", "Hello!"});
}

TEST(ReasoningThink, Glm45BlockAfterANewline) {
  expect_any_cut(kThink, "\n<think>Greeting, reply briefly.</think>\nHi there.",
                 {"Greeting, reply briefly.", "Hi there."});
}

TEST(ReasoningThink, EmptyBlockLeavesOnlyContent) {
  expect_any_cut(kThink, "<think>\n\n</think>\n\nJust the answer.", {"", "Just the answer."});
}

TEST(ReasoningThink, AnswerWithoutABlockIsContentAsItIs) {
  expect_any_cut(kThink, "  Hello <think>not a block</think> \n",
                 {"", "  Hello <think>not a block</think> \n"});
  expect_any_cut(kThink, "<thinking>is not the tag</thinking>",
                 {"", "<thinking>is not the tag</thinking>"});
}

TEST(ReasoningThink, OnlyTheFirstBlockIsReasoning) {
  expect_any_cut(kThink, "<think>a</think>b <think>c</think> d", {"a", "b <think>c</think> d"});
}

TEST(ReasoningThink, PromptThatOpenedTheBlockStartsInReasoning) {
  expect_any_cut(kThink, "\nLet me see.\n</think>\n\nIt is 4.", {"Let me see.", "It is 4."},
                 /*in_reasoning=*/true);
  // A <think> the model writes again there is reasoning text.
  expect_any_cut(kThink, "<think>x</think>y", {"<think>x", "y"}, /*in_reasoning=*/true);
}

TEST(ReasoningThink, UnclosedBlockIsAllReasoning) {
  // max_tokens ran out while thinking: the held white space and half tag are the model's text.
  expect_any_cut(kThink, "<think>\nStill thinking \n</thi", {"Still thinking \n</thi", ""});
  expect_any_cut(kThink, "<think>\n\n", {"", ""});
}

TEST(ReasoningThink, AnswerEndingOnHalfATagOrWhiteSpaceIsContent) {
  expect_any_cut(kThink, "\n <thi", {"", "\n <thi"});
  expect_any_cut(kThink, " \n", {"", " \n"});
  expect_any_cut(kThink, "", {"", ""});
}

TEST(ReasoningThink, NothingButTagsAndTheirWhiteSpaceIsDropped) {
  // Every byte of the model's text in order, once: reasoning then content is the answer without
  // the two tags and the white space around them.
  const std::string reasoning = "Step 1: 2 + 2.\n\nStep 2: it is 4 <not a tag> </thin";
  const std::string content = "The answer is 4.\n<think>later tags are text</think>\n";
  const Split got = whole(kThink, "<think>\n" + reasoning + "\n</think>\n\n" + content);
  EXPECT_EQ(got.reasoning, reasoning);
  EXPECT_EQ(got.content, content);
}

TEST(ReasoningThink, Utf8AroundTheTags) {
  const std::string text = "<think>Δ déjà vu, 思考中 🤔</think>答案：✓ ok";
  expect_any_cut(kThink, text, {"Δ déjà vu, 思考中 🤔", "答案：✓ ok"});
  expect_whole_characters(kThink, text);
  expect_whole_characters(kThink, "\n\n\xF0\x9F\xA4\x94 no block");
}

TEST(ReasoningThink, LongWhiteSpaceBeforeTheTagIsNotAnOpening) {
  // Bounded hold: past kMaxHeld bytes of white space the answer is content, however it is cut.
  const std::string ws(ReasoningSplitter::kMaxHeld + 1, '\n');
  expect_any_cut(kThink, ws + "<think>x</think>y", {"", ws + "<think>x</think>y"});
  const std::string fits(ReasoningSplitter::kMaxHeld, ' ');
  expect_any_cut(kThink, fits + "<think>x</think>y", {"x", "y"});
}

TEST(ReasoningThink, LongWhiteSpaceBeforeTheCloseIsDroppedUpToTheBound) {
  const std::string ws(ReasoningSplitter::kMaxHeld + 3, ' ');
  expect_any_cut(kThink, "<think>x" + ws + "</think>y", {"x   ", "y"});
}

const std::string kAnalysis = "<|channel|>analysis<|message|>";
const std::string kNext = "<|end|><|start|>assistant";

TEST(ReasoningHarmony, AnalysisIsReasoningFinalIsContent) {
  expect_any_cut(kHarmony,
                 kAnalysis + "User says hi. Respond friendly." + kNext +
                     "<|channel|>final<|message|>Hello! How can I help?",
                 {"User says hi. Respond friendly.", "Hello! How can I help?"});
}

TEST(ReasoningHarmony, ReturnEndsTheAnswer) {
  // Without the template's stop strings the splitter still takes <|return|> as the end.
  expect_any_cut(kHarmony, kAnalysis + "a" + kNext + "<|channel|>final<|message|>b<|return|>",
                 {"a", "b"});
}

TEST(ReasoningHarmony, SeveralMessagesAndAPreamble) {
  // Two analysis messages are one reasoning; a commentary preamble (no recipient) is content.
  expect_any_cut(kHarmony,
                 kAnalysis + "first. " + kNext + "<|channel|>commentary<|message|>Checking. " +
                     kNext + "<|channel|>analysis<|message|>second." + kNext +
                     "<|channel|>final<|message|>Done.",
                 {"first. second.", "Checking. Done."});
}

TEST(ReasoningHarmony, StrayCommentaryAndConstrainInTheHeader) {
  expect_any_cut(kHarmony,
                 "<|channel|>commentary<|channel|>analysis<|message|>x" + kNext +
                     "<|channel|>final <|constrain|>json<|message|>{\"a\": 1}",
                 {"x", "{\"a\": 1}"});
}

TEST(ReasoningHarmony, ToolCallIsContentVerbatim) {
  // A recipient is a tool call: not reasoning or an answer, so it is kept as written.
  const std::string call =
      "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
      "<|message|>{\"city\": \"Oslo\"}<|call|>";
  expect_any_cut(kHarmony, kAnalysis + "Need weather.<|end|>" + call, {"Need weather.", call});
}

TEST(ReasoningHarmony, TextThatIsNotHarmonyIsContent) {
  expect_any_cut(kHarmony, "Hello <|channel|>final<|message|>x",
                 {"", "Hello <|channel|>final<|message|>x"});
  expect_any_cut(kHarmony, "<|channel|>secret<|message|>x", {"", "<|channel|>secret<|message|>x"});
  expect_any_cut(kHarmony, kAnalysis + "a<|end|><|start|>user<|message|>hi",
                 {"a", "<|start|>user<|message|>hi"});
  // Headers missing their parts.
  expect_any_cut(kHarmony, "<|message|>x", {"", "<|message|>x"});
  expect_any_cut(kHarmony, "<|chan<|message|>x", {"", "<|chan<|message|>x"});
  expect_any_cut(kHarmony, kAnalysis + "a<|end|><|start|><|message|>b",
                 {"a", "<|start|><|message|>b"});
  expect_any_cut(kHarmony, kAnalysis + "a<|end|><|start|>assistant<|message|>b",
                 {"a", "<|start|>assistant<|message|>b"});
}

TEST(ReasoningHarmony, CutShortInAHeaderOrABody) {
  expect_any_cut(kHarmony, kAnalysis + "thinking <|en", {"thinking <|en", ""});
  expect_any_cut(kHarmony, kAnalysis + "think" + kNext + "<|chan",
                 {"think", "<|start|>assistant<|chan"});
  expect_any_cut(kHarmony, kAnalysis + "think<|end|>", {"think", ""});
  expect_any_cut(kHarmony, "<|channel|>analysis", {"", "<|channel|>analysis"});
}

TEST(ReasoningHarmony, LongHeaderIsNotOne) {
  const std::string name(ReasoningSplitter::kMaxHeld, 'x');
  const std::string text = "<|channel|>final " + name + "<|message|>y";
  expect_any_cut(kHarmony, text, {"", text});
}

TEST(ReasoningHarmony, Utf8InTheBodies) {
  const std::string text =
      kAnalysis + "Ελληνικά 🤔" + kNext + "<|channel|>final<|message|>Привет, 世界 ✓";
  expect_any_cut(kHarmony, text, {"Ελληνικά 🤔", "Привет, 世界 ✓"});
  expect_whole_characters(kHarmony, text);
}

// Answers made of tag fragments, white space and text, in both syntaxes: whole, byte by byte and
// cut at random places, one result; and every byte of the result is one of the answer's, in order
// within each part.
TEST(ReasoningAnySyntax, FragmentSoupDoesNotDependOnTheCuts) {
  const std::vector<std::string> parts = {"<|",
                                          "|>",
                                          "<|channel|>",
                                          "analysis",
                                          "final",
                                          "commentary",
                                          "<|message|>",
                                          "<|end|>",
                                          "<|start|>assistant",
                                          " to=",
                                          "<|return|>",
                                          "<think>",
                                          "</think>",
                                          "<thi",
                                          " ",
                                          "\n",
                                          "x",
                                          "λ",
                                          "<|start|>",
                                          "<|constrain|>"};
  std::mt19937 rng(7);
  for (int round = 0; round < 400; ++round) {
    std::string text;
    const size_t n = 1 + rng() % 14;
    // Most answers open as the syntax does, so the states past the opening are reached too.
    if (rng() % 2) text += round % 2 ? "<think>" : "<|channel|>analysis<|message|>";
    for (size_t i = 0; i < n; ++i) text += parts[rng() % parts.size()];
    for (const ReasoningSyntax syntax : {kThink, kHarmony}) {
      const Split want = whole(syntax, text);
      std::vector<std::string> bytes;
      for (const char c : text) bytes.emplace_back(1, c);
      ASSERT_EQ(feed(syntax, false, bytes), want) << text;
      for (int cut = 0; cut < 8; ++cut) {
        std::vector<std::string> pieces;
        for (size_t at = 0; at < text.size();) {
          const size_t len = 1 + rng() % 12;
          pieces.push_back(text.substr(at, len));
          at += len;
        }
        ASSERT_EQ(feed(syntax, false, pieces), want) << text;
      }
      // Each part is a subsequence of the answer: nothing made up, nothing reordered.
      for (const std::string* part : {&want.reasoning, &want.content}) {
        size_t at = 0;
        for (const char c : *part) {
          at = text.find(c, at);
          ASSERT_NE(at, std::string::npos) << text;
          ++at;
        }
      }
    }
  }
}

TEST(ReasoningNone, EverythingIsContent) {
  const std::string text = "<think>a</think>" + kAnalysis + "b";
  expect_any_cut(ReasoningSyntax::kNone, text, {"", text});
}

TEST(ReasoningSyntaxOf, TemplateFamilies) {
  using K = ChatTemplate::Kind;
  EXPECT_EQ(reasoning_syntax(K::kQwen3), kThink);
  EXPECT_EQ(reasoning_syntax(K::kGlm45), kThink);
  EXPECT_EQ(reasoning_syntax(K::kDeepseek3), kThink);
  EXPECT_EQ(reasoning_syntax(K::kDeepseek4), kThink);
  EXPECT_EQ(reasoning_syntax(K::kGptOss), kHarmony);
  for (const K k : {K::kChatml, K::kQwen25, K::kMistral, K::kMistralV01, K::kLlama3, K::kLlama31,
                    K::kKimiK2, K::kKimiK2Helpful}) {
    EXPECT_EQ(reasoning_syntax(k), ReasoningSyntax::kNone) << static_cast<int>(k);
  }
}

TEST(ReasoningSyntaxOf, PromptOpensThink) {
  EXPECT_TRUE(prompt_opens_think("<|im_start|>assistant\n<think>\n"));
  EXPECT_TRUE(prompt_opens_think("<｜Assistant｜><think>"));
  EXPECT_FALSE(prompt_opens_think("<｜Assistant｜><think></think>"));  // DeepSeek-V3.1, off
  EXPECT_FALSE(prompt_opens_think("<｜Assistant｜></think>"));         // DeepSeek-V4, off
  EXPECT_FALSE(prompt_opens_think("<think>x</think>\n<|im_start|>assistant\n"));
  EXPECT_FALSE(prompt_opens_think("<think>\nhalf"));
}

TEST(ReasoningSyntaxOf, NoFamilyOpensTheBlockInItsDefaultMode) {
  // Each template's default thinking mode: Qwen3 and GLM-4.5 leave <think> to the model, DeepSeek
  // V3.1/V4 close it in the prompt (thinking off). So answers start outside the block.
  for (const char* family : {"qwen3", "glm4.5", "deepseek3", "deepseek4", "gpt-oss"}) {
    auto t = ChatTemplate::named(family, "<bos>", "<eos>");
    ASSERT_TRUE(t.ok()) << family;
    const std::vector<ChatMessage> m = {{"user", "Hi"}};
    auto prompt = t->render(m, /*add_generation_prompt=*/true);
    ASSERT_TRUE(prompt.ok()) << family;
    EXPECT_FALSE(prompt_opens_think(*prompt)) << family << ": " << *prompt;
  }
}

TEST(ReasoningSyntaxOf, APromptThatClosesTheBlockHasAnAnswerWithoutReasoning) {
  EXPECT_TRUE(prompt_closes_think("<|im_start|>assistant\n<think>\n\n</think>\n\n"));  // Qwen3, off
  EXPECT_TRUE(prompt_closes_think("<｜Assistant｜><think></think>"));  // DeepSeek-V3.1, off
  EXPECT_TRUE(prompt_closes_think("<｜Assistant｜></think>"));         // DeepSeek-V4, off
  EXPECT_FALSE(prompt_closes_think("<|im_start|>assistant\n<think>\n"));
  EXPECT_FALSE(prompt_closes_think("<think>x</think>\n<|im_start|>assistant\n"));
  // Each switch that turns thinking off closes the block; on, it is open or left to the model.
  const std::vector<ChatMessage> m = {{"user", "Hi"}};
  ChatOptions off, on;
  off.enable_thinking = false;
  on.enable_thinking = true;
  using K = ChatTemplate::Kind;
  for (const char* family : {"qwen3", "glm4.5", "deepseek3", "deepseek4"}) {
    auto t = ChatTemplate::named(family, "<bos>", "<eos>");
    ASSERT_TRUE(t.ok()) << family;
    const std::string closed = *t->render(m, true, off);
    EXPECT_EQ(answer_reasoning_syntax(t->kind(), closed), ReasoningSyntax::kNone) << closed;
    const std::string open = *t->render(m, true, on);
    EXPECT_EQ(answer_reasoning_syntax(t->kind(), open), kThink) << open;
    EXPECT_EQ(prompt_opens_think(open), t->kind() == K::kDeepseek3 || t->kind() == K::kDeepseek4)
        << open;
  }
  // With the block closed, a "<think>" the model writes anyway is content.
  ReasoningSplitter s(answer_reasoning_syntax(K::kQwen3, "<think>\n\n</think>\n\n"), false);
  const auto step = s.push("<think>x</think>y");
  EXPECT_EQ(step.content, "<think>x</think>y");
  EXPECT_EQ(step.reasoning, "");
  EXPECT_EQ(answer_reasoning_syntax(K::kGptOss, "</think>"), kHarmony);
}

}  // namespace
}  // namespace expertd::text
