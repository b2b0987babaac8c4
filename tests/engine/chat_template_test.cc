// engine/chat_template against transformers' own renderer: tests/fixtures/chat/<name>.json (from
// tools/reference/make_chat_fixtures.py) holds each vendor template, the family it must be detected
// as (or null: it must be refused), and transformers' output or error for a fixed set of
// conversations, plain and with thinking switches ("kwargs": ChatOptions, as chat_template_kwargs).
#include "text/chat_template.h"

#include <gtest/gtest.h>

#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "tests/engine/fixture.h"
#include "text/tokenizer.h"

namespace expertd::engine {
namespace {

using namespace expertd::text;

using test::fixture_path;
using test::read_json;

std::vector<std::string> fixture_names() {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(fixture_path("chat"))) {
    if (e.path().extension() == ".json") names.push_back(e.path().stem().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::vector<ChatMessage> messages_of(const nlohmann::json& j) {
  std::vector<ChatMessage> m;
  for (const auto& msg : j) m.push_back({msg["role"], msg["content"]});
  return m;
}

TEST(ChatTemplate, FixturesCoverEveryFamilyAndLookAlikes) {
  const std::vector<std::string> names = fixture_names();
  int supported = 0, refused = 0;
  for (const std::string& n : names) {
    const nlohmann::json f = read_json(fixture_path("chat/" + n + ".json"));
    (f["family"].is_null() ? refused : supported) += 1;
  }
  EXPECT_GE(supported, 10);
  EXPECT_GE(refused, 5);
}

TEST(ChatTemplate, FixturesRenderEveryThinkingSwitchThroughEverySupportedTemplate) {
  for (const std::string& n : fixture_names()) {
    const nlohmann::json f = read_json(fixture_path("chat/" + n + ".json"));
    if (f["family"].is_null()) continue;
    std::set<std::string> keys;
    for (const nlohmann::json& c : f["cases"]) {
      if (!c.contains("kwargs")) continue;
      for (const auto& [k, v] : c["kwargs"].items()) keys.insert(k);
    }
    EXPECT_EQ(keys, (std::set<std::string>{"enable_thinking", "reasoning_effort", "thinking"}))
        << n;
  }
}

class ChatTemplateVsTransformers : public ::testing::TestWithParam<std::string> {};

TEST_P(ChatTemplateVsTransformers, DetectsTheFamilyAndRendersEveryConversationAsTransformers) {
  const nlohmann::json f = read_json(fixture_path("chat/" + GetParam() + ".json"));
  const std::string text = f["template"];
  auto t = ChatTemplate::from_text(text, f["bos"], f["eos"]);
  if (f["family"].is_null()) {
    ASSERT_FALSE(t) << GetParam() << " must be refused, was detected as " << t->family();
    const std::string first = text.substr(0, text.find('\n')).substr(0, 120);
    EXPECT_EQ(t.error().code, EINVAL);
    EXPECT_EQ(t.error().message,
              "chat template not supported (first line: '" + first +
                  "'); known: ChatML/Qwen3, DeepSeek-V3/V4, Mistral/Mixtral/Nemo/Small-3.2, "
                  "Llama 3, GLM-4.5/4.6, gpt-oss, Kimi-K2");
    return;
  }
  ASSERT_TRUE(t) << t.error().message;
  EXPECT_EQ(t->family(), f["family"].get<std::string>());
  // strftime_now's date, fixed by the generator (gpt-oss's "Current date: ...").
  if (f.contains("date")) t = t->with_date(f["date"]);
  ASSERT_GE(f["cases"].size(), 40u);
  int i = 0;
  for (const nlohmann::json& c : f["cases"]) {
    const std::vector<ChatMessage> m = messages_of(c["messages"]);
    const bool gen = c["add_generation_prompt"];
    ChatOptions options;
    if (c.contains("kwargs")) {
      const Status read = read_chat_template_kwargs(c["kwargs"].dump(), "kwargs", options);
      ASSERT_TRUE(read) << read.error().message;
    }
    auto out = t->render(m, gen, options);
    const std::string what = GetParam() + " case " + std::to_string(i++) + " " +
                             c["messages"].dump() + (gen ? " +gen" : "") +
                             (c.contains("kwargs") ? " kwargs " + c["kwargs"].dump() : "");
    if (c.contains("error")) {
      ASSERT_FALSE(out) << what << " rendered " << nlohmann::json(*out).dump();
      EXPECT_EQ(out.error().message, c["error"].get<std::string>()) << what;
    } else {
      ASSERT_TRUE(out) << what << ": " << out.error().message;
      EXPECT_EQ(*out, c["output"].get<std::string>())
          << what << "\n got " << nlohmann::json(*out).dump() << "\nwant " << c["output"].dump();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ChatTemplateVsTransformers, ::testing::ValuesIn(fixture_names()),
                         [](const ::testing::TestParamInfo<std::string>& p) {
                           std::string s = p.param;
                           for (char& ch : s) {
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           }
                           return s;
                         });

TEST(ChatTemplate, NamedFamiliesRenderAsTheirTemplates) {
  for (const char* n : {"chatml", "qwen3", "deepseek3", "deepseek4", "mistral", "llama3", "glm4.5",
                        "gpt-oss", "kimi-k2", "kimi-k2-helpful"}) {
    const nlohmann::json f = read_json(fixture_path(std::string("chat/") + n + ".json"));
    auto t = ChatTemplate::named(n, f["bos"], f["eos"]);
    ASSERT_TRUE(t) << t.error().message;
    EXPECT_EQ(t->family(), n);
    if (f.contains("date")) t = t->with_date(f["date"]);
    const nlohmann::json& c = f["cases"][3];
    auto out = t->render(messages_of(c["messages"]), c["add_generation_prompt"]);
    ASSERT_TRUE(out) << out.error().message;
    EXPECT_EQ(*out, c["output"].get<std::string>()) << n;
  }
  auto bad = ChatTemplate::named("gemma", "", "");
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message.find("'gemma'"), std::string::npos) << bad.error().message;
}

TEST(ChatTemplate, ThinkingSwitchesChangeTheGenerationPromptAsTheTemplatesDo) {
  const std::vector<ChatMessage> m = {{"user", "Hi"}};
  ChatOptions off;
  off.enable_thinking = false;
  EXPECT_EQ(*ChatTemplate::named("qwen3", "", "")->render(m, true, off),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
  EXPECT_EQ(*ChatTemplate::named("glm4.5", "", "")->render(m, true, off),
            "[gMASK]<sop><|user|>\nHi/nothink<|assistant|>\n<think></think>");
  ChatOptions on;
  on.thinking = true;
  EXPECT_EQ(*ChatTemplate::named("deepseek3", "<s>", "")->render(m, true, on),
            "<s><｜User｜>Hi<｜Assistant｜><think>");
  EXPECT_EQ(*ChatTemplate::named("deepseek4", "<s>", "")->render(m, true, on),
            "<s><｜User｜>Hi<｜Assistant｜><think>");
  ChatOptions low;
  low.reasoning_effort = "low";
  auto oss = ChatTemplate::named("gpt-oss", "", "")->with_date("2026-01-15").render(m, true, low);
  EXPECT_NE(oss->find("\n\nReasoning: low\n\n"), std::string::npos) << *oss;
}

TEST(ChatTemplate, IgnoredNamesTheSwitchesAFamilysTemplateDoesNotRead) {
  ChatOptions all;
  all.enable_thinking = false;
  all.thinking = true;
  all.reasoning_effort = "high";
  EXPECT_EQ(ChatTemplate::named("qwen3", "", "")->ignored(all),
            (std::vector<std::string>{"thinking", "reasoning_effort"}));
  EXPECT_EQ(ChatTemplate::named("deepseek3", "", "")->ignored(all),
            std::vector<std::string>{"reasoning_effort"});
  EXPECT_EQ(ChatTemplate::named("gpt-oss", "", "")->ignored(all),
            (std::vector<std::string>{"enable_thinking", "thinking"}));
  EXPECT_EQ(ChatTemplate::named("llama3", "", "")->ignored(all),
            (std::vector<std::string>{"enable_thinking", "thinking", "reasoning_effort"}));
  EXPECT_TRUE(ChatTemplate::named("llama3", "", "")->ignored({}).empty());
  // V4-Flash's template reads "high" (a preamble when thinking); V4's does not.
  const nlohmann::json flash = read_json(fixture_path("chat/deepseek4-flash.json"));
  auto t = ChatTemplate::from_text(flash["template"].get<std::string>(), "", "");
  ASSERT_TRUE(t) << t.error().message;
  EXPECT_EQ(t->ignored(all), std::vector<std::string>{});
  EXPECT_EQ(ChatTemplate::named("deepseek4", "", "")->ignored(all),
            std::vector<std::string>{"reasoning_effort"});
}

TEST(ChatTemplate, ChatTemplateKwargsAreReadStrictlyNamingTheField) {
  ChatOptions o;
  std::string param;
  ASSERT_TRUE(read_chat_template_kwargs(
      R"({"enable_thinking": false, "reasoning_effort": "low", "other": [1], "thinking": null})",
      "chat_template_kwargs", o, &param));
  EXPECT_EQ(o.enable_thinking, false);
  EXPECT_FALSE(o.thinking);
  EXPECT_EQ(o.reasoning_effort, "low");
  // Set keys replace earlier ones; unset keep them.
  ASSERT_TRUE(read_chat_template_kwargs(R"({"thinking": true})", "x", o));
  EXPECT_EQ(o.enable_thinking, false);
  EXPECT_EQ(o.thinking, true);

  auto bad =
      read_chat_template_kwargs(R"({"enable_thinking": "no"})", "chat_template_kwargs", o, &param);
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.error().message,
            R"(chat_template_kwargs.enable_thinking must be a boolean, got a string ("no"))");
  EXPECT_EQ(param, "chat_template_kwargs.enable_thinking");
  bad = read_chat_template_kwargs(R"({"reasoning_effort": "max"})", "chat_template_kwargs", o,
                                  &param);
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.error().message,
            "chat_template_kwargs.reasoning_effort must be one of low, medium, high, got 'max'");
  EXPECT_EQ(param, "chat_template_kwargs.reasoning_effort");
  bad = read_chat_template_kwargs("[1]", "--chat-template-kwargs", o, &param);
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.error().message, "--chat-template-kwargs must be an object, got [1]");
  bad = read_chat_template_kwargs("{nope", "--chat-template-kwargs", o, &param);
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.error().message, "--chat-template-kwargs: not JSON: '{nope'");
}

// The two tools' flags (expert-run --chat, expert-serve's defaults): both empty change nothing;
// --reasoning-effort sets what the kwargs leave unset, agrees with them or is refused naming both.
TEST(ChatTemplate, ChatFlagsJoinTheKwargsAndTheReasoningEffort) {
  ChatOptions o;
  ASSERT_TRUE(read_chat_flags("", "", o));
  EXPECT_EQ(o.reasoning_effort, "");
  ASSERT_TRUE(read_chat_flags(R"({"enable_thinking": false})", "high", o));
  EXPECT_EQ(o.enable_thinking, false);
  EXPECT_EQ(o.reasoning_effort, "high");
  ChatOptions same;
  ASSERT_TRUE(read_chat_flags(R"({"reasoning_effort": "low"})", "low", same));
  EXPECT_EQ(same.reasoning_effort, "low");
  ChatOptions differ;
  const Status bad = read_chat_flags(R"({"reasoning_effort": "low"})", "high", differ);
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.error().message,
            "--reasoning-effort high and --chat-template-kwargs' reasoning_effort low differ");
  ChatOptions broken;
  const Status not_json = read_chat_flags("{nope", "", broken);
  ASSERT_FALSE(not_json);
  EXPECT_EQ(not_json.error().message, "--chat-template-kwargs: not JSON: '{nope'");
}

TEST(ChatTemplate, UnknownTemplateIsRefusedNamingItsFirstLine) {
  auto t = ChatTemplate::from_text(
      "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n"
      "{% endfor %}",
      "<bos>", "<eos>");
  ASSERT_FALSE(t);
  EXPECT_EQ(t.error().message,
            "chat template not supported (first line: '{{ bos_token }}{% for m in messages "
            "%}<start_of_turn>{{ m.role }}'); known: ChatML/Qwen3, DeepSeek-V3/V4, "
            "Mistral/Mixtral/Nemo/Small-3.2, Llama 3, GLM-4.5/4.6, gpt-oss, Kimi-K2");
}

TEST(ChatTemplate, UnknownRoleAndEmptyConversationAreErrors) {
  auto t = ChatTemplate::named("qwen3", "", "");
  ASSERT_TRUE(t);
  const std::vector<ChatMessage> odd = {{"user", "q", {}}, {"function", "result", {}}};
  auto out = t->render(odd, true);
  ASSERT_FALSE(out);
  EXPECT_EQ(out.error().message,
            "chat template: message 1 has role 'function'; known: system, user, assistant, tool");
  // A tool result on a family without tool syntax here is refused, naming it.
  const std::vector<ChatMessage> tool = {{"user", "q", {}}, {"tool", "result", {}}};
  auto llama = ChatTemplate::named("llama3", "", "")->render(tool, true);
  ASSERT_FALSE(llama);
  EXPECT_NE(llama.error().message.find("not supported with the llama3"), std::string::npos)
      << llama.error().message;
  EXPECT_FALSE(t->render({}, true));
}

TEST(ChatTemplate, StopStringsEndEachFamilysAssistantTurn) {
  EXPECT_EQ(ChatTemplate::named("qwen3", "", "")->stop_strings(),
            std::vector<std::string>{"<|im_end|>"});
  EXPECT_EQ(ChatTemplate::named("deepseek4", "", "")->stop_strings(),
            std::vector<std::string>{"<｜end▁of▁sentence｜>"});
  EXPECT_EQ(ChatTemplate::named("mistral", "<s>", "</s>")->stop_strings(),
            std::vector<std::string>{"</s>"});
  EXPECT_EQ(ChatTemplate::named("llama3", "", "")->stop_strings(),
            std::vector<std::string>{"<|eot_id|>"});
  // GLM's turn ends where the next role tag would begin (its generation_config's eos ids).
  EXPECT_EQ(ChatTemplate::named("glm4.5", "[gMASK]", "<|endoftext|>")->stop_strings(),
            (std::vector<std::string>{"<|user|>", "<|observation|>"}));
  // Not <|end|>: it closes the analysis channel before the final one.
  EXPECT_EQ(ChatTemplate::named("gpt-oss", "", "")->stop_strings(),
            (std::vector<std::string>{"<|return|>", "<|call|>"}));
  EXPECT_EQ(ChatTemplate::named("kimi-k2", "", "")->stop_strings(),
            std::vector<std::string>{"<|im_end|>"});
}

TEST(ChatTemplate, GptOssWritesTodaysDateUnlessOneIsFixed) {
  auto t = ChatTemplate::named("gpt-oss", "<|startoftext|>", "<|return|>");
  ASSERT_TRUE(t) << t.error().message;
  const std::vector<ChatMessage> m = {{"user", "Hi"}};
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  char today[16];
  today[std::strftime(today, sizeof today, "%Y-%m-%d", &tm)] = '\0';
  auto out = t->render(m, true);
  ASSERT_TRUE(out) << out.error().message;
  EXPECT_NE(out->find(std::string("\nCurrent date: ") + today + "\n\n"), std::string::npos) << *out;
  auto fixed = t->with_date("1999-12-31").render(m, true);
  ASSERT_TRUE(fixed) << fixed.error().message;
  EXPECT_NE(fixed->find("\nCurrent date: 1999-12-31\n\n"), std::string::npos) << *fixed;
  EXPECT_EQ(t->with_date("1999-12-31").family(), "gpt-oss");
}

TEST(ChatTemplate, FromGgufReadsTheDeepseek4TemplateAndItsBosFromTheTokenizer) {
  auto f = GgufFile::open(fixture_path("deepseek4-tiny/model-f32.gguf"));
  ASSERT_TRUE(f) << f.error().message;
  auto tok = Tokenizer::from_gguf(*f);
  ASSERT_TRUE(tok) << tok.error().message;
  auto t = ChatTemplate::from_gguf(*f, *tok);
  ASSERT_TRUE(t) << t.error().message;
  EXPECT_EQ(t->family(), "deepseek4");
  EXPECT_EQ(t->bos(), tok->decode(*tok->bos()));
  const std::vector<ChatMessage> m = {{"system", "S"}, {"user", "Hi"}};
  auto out = t->render(m, true);
  ASSERT_TRUE(out) << out.error().message;
  EXPECT_EQ(*out, t->bos() + "S<｜User｜>Hi<｜Assistant｜></think>");
}

TEST(ChatTemplate, FromGgufWithoutATemplateIsChatml) {
  auto f = GgufFile::open(fixture_path("qwen3moe-tiny/model-f32.gguf"));
  ASSERT_TRUE(f) << f.error().message;
  auto tok = Tokenizer::from_gguf(*f);
  ASSERT_TRUE(tok) << tok.error().message;
  auto t = ChatTemplate::from_gguf(*f, *tok);
  ASSERT_TRUE(t) << t.error().message;
  EXPECT_EQ(t->family(), "chatml (default: the model has no tokenizer.chat_template)");
  const std::vector<ChatMessage> m = {{"user", "Hi"}};
  EXPECT_EQ(*t->render(m, true), "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(t->stop_strings(), std::vector<std::string>{"<|im_end|>"});
}

}  // namespace
}  // namespace expertd::engine

namespace expertd::engine {
namespace {

using namespace expertd::text;

void check_tool_fixture(const std::string& name);

// Tool calls (issue 25) against transformers: tests/fixtures/chat-tools/<name>.json, written by
// tools/reference/make_tool_fixtures.py from the vendor template with tools, assistant tool calls
// and tool results. Read with the keys' order kept: the template writes the tools as given.
TEST(ChatTemplateTools, RendersToolsCallsAndResultsAsTransformers) {
  for (const char* name : {"qwen3", "glm4.5", "gpt-oss", "deepseek3", "deepseek4",
                           "deepseek4-flash", "mistral-nemo", "mistral-small-3.2"}) {
    SCOPED_TRACE(name);
    check_tool_fixture(name);
  }
  // Another family refuses tools rather than dropping them.
  auto chatml = ChatTemplate::named("chatml", "", "");
  ASSERT_TRUE(chatml);
  const ChatMessage user{"user", "Hi", {}};
  const std::string tool = R"({"type": "function"})";
  auto refused = chatml->render(std::span(&user, 1), true, {}, std::span(&tool, 1));
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message.find("not supported with the chatml template"),
            std::string::npos)
      << refused.error().message;
}

void check_tool_fixture(const std::string& name) {
  std::ifstream in(test::fixture_path("chat-tools/" + name + ".json"));
  ASSERT_TRUE(in) << "no fixture";
  const nlohmann::ordered_json f = nlohmann::ordered_json::parse(in);
  auto t = ChatTemplate::from_text(f["template"].get<std::string>(), f["bos"], f["eos"]);
  ASSERT_TRUE(t) << t.error().message;
  ASSERT_TRUE(t->supports_tools());
  ASSERT_GE(f["cases"].size(), 20u);
  // strftime_now's date, fixed by the generator (gpt-oss's "Current date: ...").
  if (f.contains("date")) t = t->with_date(f["date"]);
  int i = 0;
  for (const auto& c : f["cases"]) {
    std::vector<std::string> tools;
    if (!c["tools"].is_null()) {
      for (const auto& tool : c["tools"]) {
        auto text = template_json(tool.dump());
        ASSERT_TRUE(text) << text.error().message;
        tools.push_back(*text);
      }
    }
    std::vector<ChatMessage> m;
    for (const auto& msg : c["messages"]) {
      ChatMessage cm{msg["role"], msg["content"], {}, msg.value("tool_call_id", "")};
      if (msg.contains("tool_calls")) {
        for (const auto& tc : msg["tool_calls"]) {
          cm.tool_calls.push_back({tc["function"]["name"], tc["function"]["arguments"], tc["id"]});
        }
      }
      m.push_back(std::move(cm));
    }
    ChatOptions options;
    if (c.contains("kwargs")) {
      ASSERT_TRUE(read_chat_template_kwargs(c["kwargs"].dump(), "kwargs", options));
    }
    auto out = t->render(m, c["add_generation_prompt"], options, tools);
    if (c.contains("error")) {  // the template refuses the conversation: so does render()
      ASSERT_FALSE(out) << "case " << i << ": " << *out;
      EXPECT_EQ(out.error().message, c["error"].get<std::string>()) << "case " << i;
      ++i;
      continue;
    }
    ASSERT_TRUE(out) << "case " << i << ": " << out.error().message;
    EXPECT_EQ(*out, c["output"].get<std::string>())
        << "case " << i << "\n got " << nlohmann::json(*out).dump() << "\nwant "
        << c["output"].dump();
    ++i;
  }
}

// `answer` parses into `content` and `calls` (name and compact arguments each).
void expect_parsed(const ChatTemplate& t, std::string_view answer, std::string_view content,
                   const std::vector<std::pair<std::string, std::string>>& calls) {
  SCOPED_TRACE(answer);
  const auto p = t.parse_tool_calls(answer);
  ASSERT_TRUE(p);
  EXPECT_EQ(p->content, content);
  std::vector<std::pair<std::string, std::string>> got;
  for (const auto& c : p->calls) got.emplace_back(c.name, c.arguments);
  EXPECT_EQ(got, calls);
}

TEST(ChatTemplateTools, ParsesTheCallsOfAnAnswer) {
  auto t = ChatTemplate::named("qwen3", "", "<|im_end|>");
  ASSERT_TRUE(t);
  expect_parsed(
      *t,
      "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
      "</tool_call>\n<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": \"x\", \"n\": 2}}\n"
      "</tool_call>",
      "Checking.",
      {{"get_weather", R"({"city":"Paris"})"}, {"search", R"({"q":"x","n":2})"}});  // model's order
  EXPECT_FALSE(t->parse_tool_calls("no calls here"));
  EXPECT_FALSE(t->parse_tool_calls("<tool_call>\n{\"name\": \"x\", \"argu"));  // cut short
  EXPECT_FALSE(t->parse_tool_calls("<tool_call>\n[1]\n</tool_call>"));
  // A call cut at max_tokens after its JSON closed still counts.
  auto cut = t->parse_tool_calls("<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n");
  ASSERT_TRUE(cut);
  EXPECT_EQ(cut->calls[0].arguments, "{}");
  auto glm = ChatTemplate::named("glm4.5", "", "");
  ASSERT_TRUE(glm);
  expect_parsed(*glm,
                "\n<tool_call>search\n<arg_key>q</arg_key>\n<arg_value>Paris events</arg_value>\n"
                "<arg_key>filters</arg_key>\n<arg_value>[\"today\"]</arg_value>\n</tool_call>",
                "", {{"search", R"({"q":"Paris events","filters":["today"]})"}});
  // gpt-oss: the call's header as the reasoning splitter leaves it in the content (after an
  // analysis message, or first in the answer, the recipient before or after the channel).
  auto oss = ChatTemplate::named("gpt-oss", "", "");
  ASSERT_TRUE(oss);
  for (const char* answer :
       {"<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        "<|message|>{\"city\": \"Paris\"}",
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        "{\"city\": \"Paris\"}<|call|>",
        " to=functions.get_weather<|channel|>commentary json<|message|>{\"city\":\"Paris\"}"}) {
    expect_parsed(*oss, answer, "", {{"get_weather", R"({"city":"Paris"})"}});
  }
  expect_parsed(*oss,
                "Checking.<|start|>assistant<|channel|>commentary to=functions.now "
                "<|constrain|>json<|message|>{}",
                "Checking.", {{"now", "{}"}});  // a commentary preamble
  EXPECT_FALSE(oss->parse_tool_calls("It is sunny."));
  EXPECT_FALSE(oss->parse_tool_calls("<|channel|>commentary to=functions.f <|message|>{\"a\":"));
  // A forced call names its function in the header; the JSON is the arguments.
  EXPECT_FALSE(oss->forced_call(""));
  const auto forced = oss->forced_call("get_weather");
  ASSERT_TRUE(forced);
  EXPECT_EQ(forced->opening, " to=functions.get_weather<|channel|>commentary json<|message|>");
  EXPECT_TRUE(forced->arguments_only);
  EXPECT_EQ(t->forced_call("")->opening, "<tool_call>\n");
  EXPECT_FALSE(t->forced_call("")->arguments_only);
  EXPECT_FALSE(ChatTemplate::named("glm4.5", "", "")->forced_call("search"));
  // template_json writes Python's json.dumps: separators, order, unicode, escapes.
  EXPECT_EQ(*template_json(R"({"b": [1, 2.5, true, null], "a": "é\n\"x\"\u0001"})"),
            "{\"b\": [1, 2.5, true, null], \"a\": \"é\\n\\\"x\\\"\\u0001\"}");
}

// Each family's calls: an answer with two (content before them), one cut short (not a call), and
// the forced call's opening for a named function ("": not JSON, no forced call).
TEST(ChatTemplateTools, ParsesEachFamilysCallsAndOpensItsForcedCall) {
  struct Case {
    const char* family;
    std::string answer;
    std::string content;
    std::string cut;
    std::string forced;  // forced_call("now")
  };
  const std::vector<std::pair<std::string, std::string>> calls = {
      {"get_weather", R"({"city":"Paris"})"}, {"now", "{}"}};
  const std::vector<Case> cases = {
      {"deepseek3",
       "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": "
       "\"Paris\"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
       "<｜tool▁calls▁end｜>",
       "Checking.", "<｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"a\":",
       "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>"},
      // DSML: strings as they are, other values as JSON.
      {"deepseek4",
       "Checking.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke "
       "name=\"get_weather\">\n<｜DSML｜parameter "
       "name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
       "<｜DSML｜invoke name=\"now\">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
       "Checking.", "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">", ""},
      // A JSON list (or one object), arguments an object or a string of JSON.
      {"mistral-nemo",
       "Checking. [TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": "
       "\"Paris\"}, \"id\": \"abcdefghi\"}, {\"name\": \"now\", \"arguments\": \"{}\"}]",
       "Checking.", "[TOOL_CALLS][{\"name\": \"now\", \"argum", "[TOOL_CALLS]["},
      {"mistral-small-3.2",
       "Checking.\n[TOOL_CALLS]get_weather[CALL_ID]abcdefghi[ARGS]{\"city\": \"Paris\"}"
       "[TOOL_CALLS]now[ARGS]{}",
       "Checking.", "[TOOL_CALLS]now[ARGS]{\"a", "[TOOL_CALLS]now[ARGS]"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.family);
    auto t = ChatTemplate::named(c.family, "<s>", "</s>");
    ASSERT_TRUE(t);
    expect_parsed(*t, c.answer, c.content, calls);
    EXPECT_FALSE(t->parse_tool_calls(c.cut));
    EXPECT_FALSE(t->parse_tool_calls("It is sunny."));
    const auto forced = t->forced_call("now");
    EXPECT_EQ(forced ? forced->opening : "", c.forced);
  }
  expect_parsed(*ChatTemplate::named("mistral-nemo", "", ""), "[TOOL_CALLS]{\"name\": \"now\"}", "",
                {{"now", "{}"}});
  // Where the opening names the function, "required" with several tools cannot be forced.
  EXPECT_FALSE(ChatTemplate::named("deepseek3", "", "")->forced_call(""));
  EXPECT_FALSE(ChatTemplate::named("mistral-small-3.2", "", "")->forced_call(""));
}

// A stream sends content up to where a call opens, or may be opening, and holds the rest.
TEST(ChatTemplateTools, StreamsHoldContentFromWhereACallMayOpen) {
  using Hold = ChatTemplate::CallHold;
  auto eq = [](Hold a, Hold b) { return a.ready == b.ready && a.call == b.call; };
  auto qwen3 = ChatTemplate::named("qwen3", "", "");
  ASSERT_TRUE(qwen3);
  EXPECT_TRUE(eq(qwen3->hold_for_calls("It is sunny.", false), {12, false}));
  EXPECT_TRUE(eq(qwen3->hold_for_calls("Checking <tool", false), {8, false}));
  EXPECT_TRUE(eq(qwen3->hold_for_calls("Checking <tool", true), {14, false}));  // over: all out
  EXPECT_TRUE(eq(qwen3->hold_for_calls("Checking <tool_call>\n{", false), {8, true}));
  EXPECT_TRUE(eq(qwen3->hold_for_calls("a < b", false), {5, false}));
  // White space before a call (or what may be one) waits with it.
  EXPECT_TRUE(eq(qwen3->hold_for_calls("Checking.\n\n", false), {9, false}));
  EXPECT_TRUE(eq(qwen3->hold_for_calls("Checking.\n\n", true), {11, false}));
  // gpt-oss: any header the splitter left in the content, wherever it starts.
  auto oss = ChatTemplate::named("gpt-oss", "", "");
  ASSERT_TRUE(oss);
  EXPECT_TRUE(eq(oss->hold_for_calls("Sure.<|start|>assistant<|chan", false), {5, true}));
  EXPECT_TRUE(eq(oss->hold_for_calls("<|channel|>commentary to=functions.f", false), {0, true}));
  EXPECT_TRUE(eq(oss->hold_for_calls(" to=functions.f<|channel|>", false), {0, true}));
  EXPECT_TRUE(eq(oss->hold_for_calls("I want to", false), {6, false}));  // " to" may open one
  EXPECT_TRUE(eq(oss->hold_for_calls("Hi <|", false), {2, false}));
  auto nemo = ChatTemplate::named("mistral-nemo", "", "");
  ASSERT_TRUE(nemo);
  EXPECT_TRUE(eq(nemo->hold_for_calls("Ok [TOOL_CA", false), {2, false}));
  // No tool syntax: nothing held.
  EXPECT_TRUE(
      eq(ChatTemplate::named("chatml", "", "")->hold_for_calls("<tool", false), {5, false}));
}

// Mistral's templates take 9-character ids: longer ones keep their last 9.
TEST(ChatTemplateTools, MistralCallIdsKeepTheirLastNineCharacters) {
  auto nemo = ChatTemplate::named("mistral-nemo", "<s>", "</s>");
  ASSERT_TRUE(nemo);
  std::vector<ChatMessage> m = {{"user", "Hi"},
                                {"assistant", "", {{"now", "{}", "call_0123456789abcdef"}}},
                                {"tool", "12:00", {}, "call_0123456789abcdef"}};
  nemo->fit_call_ids(m);
  EXPECT_EQ(m[1].tool_calls[0].id, "789abcdef");
  EXPECT_EQ(m[2].tool_call_id, "789abcdef");
  EXPECT_EQ(*nemo->render(m, true),
            "<s>[INST]Hi[/INST][TOOL_CALLS][{\"name\": \"now\", \"arguments\": {}, \"id\": "
            "\"789abcdef\"}]</s>[TOOL_RESULTS]{\"content\": 12:00, \"call_id\": \"789abcdef\"}"
            "[/TOOL_RESULTS]");
  m[1].tool_calls[0].id = "call_1";  // shorter: the template's error
  auto refused = nemo->render(m, true);
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().message, "Tool call IDs should be alphanumeric strings with length 9!");
  // A family whose template writes no ids keeps them.
  ChatTemplate::named("qwen3", "", "")->fit_call_ids(m);
  EXPECT_EQ(m[1].tool_calls[0].id, "call_1");
  EXPECT_EQ(m[2].tool_call_id, "789abcdef");
}

}  // namespace
}  // namespace expertd::engine
