#include "text/chat_template.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstddef>
#include <cstdint>
#include <ctime>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <utility>

#include "text/tokenizer.h"

namespace expertd::text {
namespace {

constexpr std::string_view kKnown =
    "known: ChatML/Qwen3, DeepSeek-V3/V4, Mistral/Mixtral/Nemo/Small-3.2, Llama 3, GLM-4.5/4.6, "
    "gpt-oss, Kimi-K2";

// A family is recognised when its template contains every one of these fragments of the vendor
// template (the expressions that decide the output for plain conversations) and none of `absent`.
// Look-alikes that differ in those expressions (Qwen3.5, QwQ, DeepSeek-V3.2, Llama 3.2, ...) miss
// a fragment and are refused; tests/fixtures/chat holds them to keep it so.
struct Signature {
  ChatTemplate::Kind kind;
  std::string_view family;
  std::vector<std::string_view> present;
  std::vector<std::string_view> absent;
};

const std::vector<Signature>& signatures() {
  using K = ChatTemplate::Kind;
  static const std::vector<Signature> sigs = {
      {K::kDeepseek4,
       "deepseek4",
       {"<｜User｜>", "set drop_thinking = true", "set state.in_user = true",
        "{{- thinking_end_token -}}", "(message['content'] or '')"},
       {}},
      {K::kDeepseek3,
       "deepseek3",
       {"<｜User｜>", "ns.is_last_user", "{{'<think></think>'}}", "content.split('</think>', 1)[1]",
        "ns.system_prompt + '\n\n' + message['content']"},
       {}},
      {K::kQwen3,
       "qwen3",
       {"<|im_start|>", "set ns.last_query_index = index",
        R"('<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n'))",
        "enable_thinking is defined and enable_thinking is false"},
       {"image", "video"}},
      {K::kQwen25,
       "qwen2.5",
       {"<|im_start|>", "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
        R"((message.role == "assistant" and not message.tool_calls))"},
       {"<think>"}},
      {K::kMistral,
       "mistral",
       {"[INST]", R"(' [INST] ' + system_message + '\n\n' + message['content'] + ' [/INST]')",
        "' ' + message['content'] + eos_token",
        "(message['role'] == 'user') != (loop.index0 % 2 == 0)"},
       {"[SYSTEM_PROMPT]", "[AVAILABLE_TOOLS]"}},
      {K::kMistralNemo,
       "mistral-nemo",
       {R"("[INST]" + system_message + "\n\n" + message["content"] + "[/INST]")",
        "{%- if tools is not none and (message == user_messages[-1]) %}",
        R"({%- for key, val in tool.items() if key != "return" %})",
        "{%- set out = tool_call.function|tojson %}", "{{- out[:-1] }}",
        R"('[TOOL_RESULTS]{"content": ' + content|string + ", ")",
        R"({{- message["content"] + eos_token}})"},
       {"[SYSTEM_PROMPT]"}},
      {K::kMistralSmall32,
       "mistral-small-3.2",
       {"You are Mistral Small 3, a Large Language Model (LLM) created by Mistral AI",
        "The current date is \" + today + \".",
        "{{- '[SYSTEM_PROMPT]' + system_prompt + '[/SYSTEM_PROMPT]' }}",
        "{{- '[AVAILABLE_TOOLS]' + tools|tojson + '[/AVAILABLE_TOOLS]' }}",
        "{{- '[CALL_ID]' + tool_call.id }}",
        "{{- '[ARGS]' + tool_call['function']['arguments']|tojson }}",
        "{{- '[TOOL_RESULTS]' + message.tool_call_id + '[TOOL_CONTENT]' + content|string + "
        "'[/TOOL_RESULTS]' }}"},
       {}},
      {K::kMistralV01,
       "mistral-v0.1",
       {"[INST]", "'[INST] ' + message['content'] + ' [/INST]'", "message['content'] + eos_token",
        "(message['role'] == 'user') != (loop.index0 % 2 == 0)",
        "Only user and assistant roles are supported!"},
       {"system", "[SYSTEM_PROMPT]", "[AVAILABLE_TOOLS]"}},
      {K::kLlama31,
       "llama3.1",
       {"<|start_header_id|>", "Cutting Knowledge Date: December 2023",
        R"(set date_string = "26 Jul 2024")", "set system_message = messages[0]['content']|trim",
        R"('<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>')"},
       {"strftime_now"}},
      {K::kGlm45,
       "glm4.5",
       // The user line is spelled two ways (the vendor's, and llama.cpp's converter's that sets
       // `content` first); both write the text on the line after <|user|>.
       {"[gMASK]<sop>", "{%- if m.role == 'user' -%}<|user|>\n",
        "<|system|>\n{{ visible_text(m.content) }}",
        "{%- if loop.index0 > ns.last_user_index and reasoning_content -%}",
        R"({{ '\n<think>' + reasoning_content.strip() +  '</think>'}})",
        R"({{ '\n<think></think>' }})", R"({{ '\n' + content.strip() }})",
        R"(<|assistant|>{{- '\n<think></think>' if (enable_thinking is defined and not enable_thinking) else '' -}})"},
       {"clear_thinking"}},
      {K::kGptOss,
       "gpt-oss",
       {"<|start|>system<|message|>", R"(Knowledge cutoff: 2024-06\n)",
        R"("Current date: " + strftime_now("%Y-%m-%d") + "\n\n")",
        R"({%- set reasoning_effort = "medium" %})", R"({{- "<|start|>developer<|message|>" }})",
        R"({{- "# Instructions\n\n" }})",
        R"("<|start|>assistant<|channel|>final<|message|>" + message.content + "<|return|>")",
        R"("<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>")",
        R"("<|start|>user<|message|>" + message.content + "<|end|>")"},
       {}},
      {K::kKimiK2,
       "kimi-k2",
       {"<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot "
        "AI.<|im_end|>\n  {% endif %}",
        "{%- if loop.first and messages[0]['role'] != 'system' -%}",
        "<|im_user|>{{role_name}}<|im_middle|>", "<|im_assistant|>{{role_name}}<|im_middle|>",
        "<|im_system|>{{role_name}}<|im_middle|>",
        "{%- elif message['content'] is not none -%}\n    {{render_content(message)}}",
        "<|im_assistant|>assistant<|im_middle|>"},
       {"<think>"}},
      {K::kKimiK2Helpful,
       "kimi-k2-helpful",
       {"<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>\n  {%- endif -%}",
        "{%- if loop.first and messages[0]['role'] != 'system' -%}", "<|im_user|>user<|im_middle|>",
        "<|im_assistant|>assistant<|im_middle|>",
        "{%- elif message['content'] is string -%}\n    {{ message['content'] }}"},
       {"<think>", "role_name"}},
      {K::kLlama3,
       "llama3",
       {"<|start_header_id|>",
        R"('<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>')",
        "set content = bos_token + content"},
       {"Cutting Knowledge", "system_message", "tools"}},
  };
  return sigs;
}

std::string strip_spaces(std::string_view s) {
  std::string out;
  for (const char c : s) {
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r') out += c;
  }
  return out;
}

// Plain ChatML has many spellings of one loop; it is recognised only whole (white space aside), as
// the canonical template in either quoting, since ChatML-based templates that add a default system
// prompt or thinking blocks render differently.
bool is_plain_chatml(std::string_view text) {
  static const std::array<std::string, 2> canonical = {
      strip_spaces(
          R"({% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %})"),
      strip_spaces(
          R"({% for message in messages %}{{'<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %})"),
  };
  const std::string s = strip_spaces(text);
  return std::find(canonical.begin(), canonical.end(), s) != canonical.end();
}

bool contains(std::string_view s, std::string_view part) {
  return s.find(part) != std::string_view::npos;
}
bool starts_with(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }
bool ends_with(std::string_view s, std::string_view p) {
  return s.size() >= p.size() && s.substr(s.size() - p.size()) == p;
}

// Python's str.isspace() for one code point (what Jinja's trim filter strips).
bool py_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0d) || (cp >= 0x1c && cp <= 0x20) || cp == 0x85 || cp == 0xa0 ||
         cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200a) || cp == 0x2028 || cp == 0x2029 ||
         cp == 0x202f || cp == 0x205f || cp == 0x3000;
}

// The code point at s[i] and its length in bytes (the text is the caller's UTF-8; a malformed
// byte counts as one non-space code point).
std::pair<uint32_t, size_t> decode_at(std::string_view s, size_t i) {
  const auto b = static_cast<unsigned char>(s[i]);
  size_t n = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 1;
  if (i + n > s.size()) return {0xfffd, 1};
  uint32_t cp = n == 1 ? b : b & (0x7f >> n);
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3f);
  return {cp, n};
}

// Jinja's `trim`: Python's str.strip() with Unicode white space.
std::string_view py_strip(std::string_view s) {
  size_t b = 0;
  while (b < s.size()) {
    const auto [cp, n] = decode_at(s, b);
    if (!py_space(cp)) break;
    b += n;
  }
  size_t e = s.size();
  while (e > b) {
    size_t start = e - 1;  // back up to the first byte of the last code point
    while (start > b && (static_cast<unsigned char>(s[start]) & 0xc0) == 0x80) --start;
    const auto [cp, n] = decode_at(s, start);
    if (!py_space(cp) || start + n != e) break;
    e = start;
  }
  return s.substr(b, e - b);
}

std::string_view lstrip_nl(std::string_view s) {
  while (!s.empty() && s.front() == '\n') s.remove_prefix(1);
  return s;
}
std::string_view rstrip_nl(std::string_view s) {
  while (!s.empty() && s.back() == '\n') s.remove_suffix(1);
  return s;
}
// The text before a call, as the parsers give it: less its trailing (ASCII) white space.
std::string_view rstrip_space(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

Error template_error(std::string message) { return make_error(EINVAL, std::move(message)); }

// Qwen3-0.6B's template (and the Qwen3 MoE models'): reasoning kept only after the last real user
// query, the final assistant turn always gets a <think> block.
// enable_thinking false closes an empty block in the generation prompt: the model answers at once.
std::string render_qwen3(std::span<const ChatMessage> m, bool gen, const ChatOptions& o,
                         std::span<const std::string> tools) {
  std::string out;
  const size_t n = m.size();
  if (!tools.empty()) {
    out += "<|im_start|>system\n";
    if (m[0].role == "system") out += m[0].content + "\n\n";
    out +=
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are "
        "provided with function signatures within <tools></tools> XML tags:\n<tools>";
    for (const std::string& t : tools) out += "\n" + t;
    out +=
        "\n</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
        "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n";
  } else if (m[0].role == "system") {
    out += "<|im_start|>system\n" + m[0].content + "<|im_end|>\n";
  }
  size_t last_query = n - 1;
  for (size_t k = n; k-- > 0;) {
    const std::string& c = m[k].content;
    if (m[k].role == "user" &&
        !(starts_with(c, "<tool_response>") && ends_with(c, "</tool_response>"))) {
      last_query = k;
      break;
    }
  }
  for (size_t i = 0; i < n; ++i) {
    const ChatMessage& msg = m[i];
    if (msg.role == "user" || (msg.role == "system" && i != 0)) {
      out += "<|im_start|>" + msg.role + "\n" + msg.content + "<|im_end|>\n";
    } else if (msg.role == "assistant") {
      std::string_view content = msg.content;
      std::string_view reasoning;
      const size_t first_end = msg.content.find("</think>");
      if (first_end != std::string::npos) {
        content =
            lstrip_nl(std::string_view(msg.content).substr(msg.content.rfind("</think>") + 8));
        std::string_view before = rstrip_nl(std::string_view(msg.content).substr(0, first_end));
        const size_t open = before.rfind("<think>");
        if (open != std::string_view::npos) before = before.substr(open + 7);
        reasoning = lstrip_nl(before);
      }
      if (i > last_query && (i == n - 1 || !reasoning.empty())) {
        out += "<|im_start|>assistant\n<think>\n";
        out += lstrip_nl(rstrip_nl(reasoning));
        out += "\n</think>\n\n";
        out += lstrip_nl(content);
      } else {
        out += "<|im_start|>assistant\n";
        out += content;
      }
      for (size_t j = 0; j < msg.tool_calls.size(); ++j) {
        if (j > 0 || !content.empty()) out += "\n";
        out += "<tool_call>\n{\"name\": \"" + msg.tool_calls[j].name +
               "\", \"arguments\": " + msg.tool_calls[j].arguments + "}\n</tool_call>";
      }
      out += "<|im_end|>\n";
    } else if (msg.role == "tool") {
      if (i == 0 || m[i - 1].role != "tool") out += "<|im_start|>user";
      out += "\n<tool_response>\n" + msg.content + "\n</tool_response>";
      if (i == n - 1 || m[i + 1].role != "tool") out += "<|im_end|>\n";
    }
  }
  if (gen) {
    out += "<|im_start|>assistant\n";
    if (o.enable_thinking == false) out += "<think>\n\n</think>\n\n";
  }
  return out;
}

std::string render_qwen25(std::span<const ChatMessage> m, bool gen) {
  std::string out;
  if (m[0].role == "system") {
    out += "<|im_start|>system\n" + m[0].content + "<|im_end|>\n";
  } else {
    out +=
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n";
  }
  for (size_t i = 0; i < m.size(); ++i) {
    if (m[i].role == "system" && i == 0) continue;
    out += "<|im_start|>" + m[i].role + "\n" + m[i].content + "<|im_end|>\n";
  }
  if (gen) out += "<|im_start|>assistant\n";
  return out;
}

std::string render_chatml(std::span<const ChatMessage> m, bool gen) {
  std::string out;
  for (const ChatMessage& msg : m) {
    out += "<|im_start|>" + msg.role + "\n" + msg.content + "<|im_end|>\n";
  }
  if (gen) out += "<|im_start|>assistant\n";
  return out;
}

// Tools, calls and their arguments as the templates read them: JSON values kept in order.
using ojson = nlohmann::ordered_json;

// Python's json.dumps, below with template_json.
void python_string(std::string_view s, std::string& out);
void python_json(const nlohmann::ordered_json& v, std::string& out);

// A string as tojson writes it.
std::string json_quoted(std::string_view s) {
  std::string out;
  python_string(s, out);
  return out;
}

// v[key], or null when v is not an object or has no such key (Jinja's undefined).
const ojson* member(const ojson& v, const char* key) {
  if (!v.is_object()) return nullptr;
  const auto it = v.find(key);
  return it == v.end() ? nullptr : &*it;
}

// Jinja's truth of a value (undefined is false).
bool truthy(const ojson* v) {
  if (v == nullptr || v->is_null()) return false;
  if (v->is_boolean()) return v->get<bool>();
  if (v->is_number()) return v->get<double>() != 0;
  if (v->is_string()) return !v->get_ref<const std::string&>().empty();
  return !v->empty();
}

bool is_string(const ojson* v, std::string_view s) {
  return v != nullptr && v->is_string() && v->get_ref<const std::string&>() == s;
}

// Every system message, joined, goes first (both DeepSeek templates).
std::string deepseek_system(std::span<const ChatMessage> m) {
  std::string sys;
  bool first = true;
  for (const ChatMessage& msg : m) {
    if (msg.role != "system") continue;
    if (!first) sys += "\n\n";
    sys += msg.content;
    first = false;
  }
  return sys;
}

// DeepSeek-V3.1 and V4 read `thinking`, else enable_thinking; off by default.
bool deepseek_thinking(const ChatOptions& o) {
  return o.thinking.value_or(o.enable_thinking.value_or(false));
}

// A call's arguments as the templates' tojson writes them: the JSON object a server parses them
// into first (as vLLM does), or, when they are not JSON, the string quoted.
std::string tojson_arguments(const std::string& arguments) {
  auto args = template_json(arguments);
  return args ? *args : json_quoted(arguments);
}

// DeepSeek-V3.1: an empty <think></think> opens each answer to a user turn; the generation prompt
// opens the block when thinking, else closes it empty. Calls follow the answer's content between
// <｜tool▁calls▁begin｜> and <｜tool▁calls▁end｜>, each NAME<｜tool▁sep｜>ARGUMENTS; tool results
// follow them, and the model's next answer follows the results with no generation prompt (its
// template writes none after a tool result). The template writes no tool definitions.
std::string render_deepseek3(std::span<const ChatMessage> m, bool gen, const std::string& bos,
                             const ChatOptions& o) {
  std::string out = bos + deepseek_system(m);
  bool last_user = false;
  bool after_tool = false;
  for (const ChatMessage& msg : m) {
    if (msg.role == "user") {
      last_user = true;
      after_tool = false;
      out += "<｜User｜>" + msg.content;
    } else if (msg.role == "tool") {
      last_user = false;
      after_tool = true;
      out += "<｜tool▁output▁begin｜>" + msg.content + "<｜tool▁output▁end｜>";
    } else if (msg.role == "assistant") {
      if (last_user) out += "<｜Assistant｜><think></think>";
      last_user = false;
      std::string_view content = msg.content;
      const size_t end = content.find("</think>");
      if (!msg.tool_calls.empty() || after_tool || end == std::string_view::npos) {
        out += content;  // after a tool result, and with calls, as it is
      } else {
        out += content.substr(end + 8);
      }
      after_tool = false;
      if (!msg.tool_calls.empty()) {
        out += "<｜tool▁calls▁begin｜>";
        for (const ChatToolCall& call : msg.tool_calls) {
          out += "<｜tool▁call▁begin｜>" + call.name + "<｜tool▁sep｜>" +
                 tojson_arguments(call.arguments) + "<｜tool▁call▁end｜>";
        }
        out += "<｜tool▁calls▁end｜>";
      }
      out += "<｜end▁of▁sentence｜>";
    }
  }
  if (gen && last_user) {
    out += deepseek_thinking(o) ? "<｜Assistant｜><think>" : "<｜Assistant｜><think></think>";
  }
  return out;
}

// DeepSeek-V4's tools: the system prompt's "## Tools" section with each function's JSON, and its
// calls in DSML tags, each argument a parameter (strings as they are, other values as JSON).
constexpr std::string_view kDsmlToolsHeader =
    "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can "
    "invoke tools by writing a \"<｜DSML｜tool_calls>\" block like the following:\n\n"
    "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"$TOOL_NAME\">\n<｜DSML｜parameter "
    "name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n...\n"
    "</｜DSML｜invoke>\n<｜DSML｜invoke name=\"$TOOL_NAME2\">\n...\n</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n\nString parameters should be specified as is and set "
    "`string=\"true\"`. For all other types (numbers, booleans, arrays, objects), pass the value "
    "in JSON format and set `string=\"false\"`.\n\nIf thinking_mode is enabled (triggered by "
    "<think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool "
    "calls or final response.\n\nOtherwise, output directly after </think> with tool calls or "
    "final response.\n\n### Available Tool Schemas\n\n";

std::string deepseek4_system(std::span<const ChatMessage> m, std::span<const std::string> tools) {
  std::string sys = deepseek_system(m);
  if (tools.empty()) return sys;
  if (!sys.empty()) sys += "\n\n";
  sys += kDsmlToolsHeader;
  for (const std::string& text : tools) {
    const ojson tool = ojson::parse(text, nullptr, /*allow_exceptions=*/false);
    const ojson* fn = member(tool, "function");
    if (!is_string(member(tool, "type"), "function") || fn == nullptr) continue;
    python_json(*fn, sys);
    sys += "\n";
  }
  return sys +
         "\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke "
         "tool calls.\n";
}

Result<std::string> dsml_calls(std::span<const ChatToolCall> calls) {
  std::string out = "\n\n<｜DSML｜tool_calls>\n";
  for (const ChatToolCall& call : calls) {
    out += "<｜DSML｜invoke name=\"" + call.name + "\">\n";
    const ojson args = ojson::parse(call.arguments, nullptr, /*allow_exceptions=*/false);
    if (!args.is_object()) {
      return template_error("tool call " + call.name + ": arguments are not a JSON object");
    }
    for (const auto& [key, value] : args.items()) {
      out += "<｜DSML｜parameter name=\"" + key + "\" string=\"";
      if (value.is_string()) {
        out += "true\">" + value.get<std::string>();
      } else {
        out += "false\">";
        python_json(value, out);
      }
      out += "</｜DSML｜parameter>\n";
    }
    if (args.empty()) out += "\n";
    out += "</｜DSML｜invoke>\n";
  }
  return out + "</｜DSML｜tool_calls>";
}

// DeepSeek-V4: consecutive user turns (and tool results, as <tool_result>) merge; answers open
// with </think>, except, when thinking, those after the last user turn or tool result (or all,
// with tools or tool results in the conversation), with an empty <think></think> (the message's
// reasoning_content, which ChatMessage has not); the generation prompt opens the block when
// thinking, else closes it. `high_effort_preamble`: V4-Flash's template, which writes one for
// reasoning_effort "high" (both write another for "max", which ChatOptions does not take).
Result<std::string> render_deepseek4(std::span<const ChatMessage> m, bool gen,
                                     const std::string& bos, const ChatOptions& o,
                                     bool high_effort_preamble,
                                     std::span<const std::string> tools) {
  const bool thinking = deepseek_thinking(o);
  std::string out = bos;
  if (thinking && high_effort_preamble && o.reasoning_effort == "high") {
    out +=
        "Reasoning Effort: Absolute maximum with no shortcuts permitted.\nYou MUST be very "
        "thorough in your thinking and comprehensively decompose the problem to resolve the root "
        "cause, rigorously stress-testing your logic against all potential paths, edge cases, and "
        "adversarial scenarios.\nExplicitly write out your entire deliberation process, "
        "documenting "
        "every intermediate step, considered alternative, and rejected hypothesis to ensure "
        "absolutely no assumption is left unchecked.\n\n";
  }
  out += deepseek4_system(m, tools);
  ptrdiff_t last_user = -1;
  bool tool_results = false;
  for (size_t k = 0; k < m.size(); ++k) {
    if (m[k].role == "user" || m[k].role == "tool") last_user = static_cast<ptrdiff_t>(k);
    tool_results = tool_results || m[k].role == "tool";
  }
  bool in_user = false;
  for (size_t i = 0; i < m.size(); ++i) {
    const ChatMessage& msg = m[i];
    if (msg.role == "user" || msg.role == "tool") {
      out += in_user ? "\n\n" : "<｜User｜>";
      in_user = true;
      out += msg.role == "tool" ? "<tool_result>" + msg.content + "</tool_result>" : msg.content;
    } else if (msg.role == "assistant") {
      in_user = false;
      const bool keep =
          thinking && (!tools.empty() || tool_results || static_cast<ptrdiff_t>(i) > last_user);
      out += keep ? "<｜Assistant｜><think></think>" : "<｜Assistant｜></think>";
      out += msg.content;
      if (!msg.tool_calls.empty()) {
        auto calls = dsml_calls(msg.tool_calls);
        if (!calls) return calls.take_error();
        out += *calls;
      }
      out += "<｜end▁of▁sentence｜>";
    }
  }
  if (gen) out += thinking ? "<｜Assistant｜><think>" : "<｜Assistant｜></think>";
  return out;
}

// Mixtral-8x7B-Instruct's template: an optional first system message folds into the first user
// turn; the rest must alternate user/assistant. It has no generation prompt ([/INST] is one).
Result<std::string> render_mistral(std::span<const ChatMessage> m, const std::string& bos,
                                   const std::string& eos) {
  const bool has_system = m[0].role == "system";
  const std::span<const ChatMessage> turns = has_system ? m.subspan(1) : m;
  std::string out = bos;
  for (size_t i = 0; i < turns.size(); ++i) {
    const ChatMessage& msg = turns[i];
    if ((msg.role == "user") != (i % 2 == 0)) {
      return template_error(
          "After the optional system message, conversation roles must alternate "
          "user/assistant/user/assistant/...");
    }
    if (msg.role == "user") {
      out += " [INST] ";
      if (i == 0 && has_system) out += m[0].content + "\n\n";
      out += msg.content + " [/INST]";
    } else if (msg.role == "assistant") {
      out += " " + msg.content + eos;
    } else {
      return template_error(
          "Only user and assistant roles are supported, with the exception of an initial optional "
          "system message!");
    }
  }
  return out;
}

// Mistral-Nemo's and Small-3.2's conversations: an optional system message first, then turns
// that alternate user/assistant, calls and tool results aside (their rule); the last user turn is
// where the tools go.
struct MistralTurns {
  bool has_system = false;
  std::span<const ChatMessage> turns;  // after the system message
  const ChatMessage* last_user = nullptr;
};

Result<MistralTurns> mistral_turns(std::span<const ChatMessage> m) {
  MistralTurns out;
  out.has_system = m[0].role == "system";
  out.turns = out.has_system ? m.subspan(1) : m;
  size_t index = 0;
  for (const ChatMessage& msg : out.turns) {
    if (msg.role == "user") out.last_user = &msg;
    if (msg.role == "tool" || !msg.tool_calls.empty()) continue;
    if ((msg.role == "user") != (index++ % 2 == 0)) {
      return template_error(
          "After the optional system message, conversation roles must alternate "
          "user/assistant/user/assistant/...");
    }
  }
  return out;
}

Error bad_call_id() {
  return template_error("Tool call IDs should be alphanumeric strings with length 9!");
}

// Mistral-Nemo-Instruct-2407's template: an optional first system message folds into the last
// message when that is a user turn (else it is dropped); the other turns alternate user/assistant,
// calls and tool results aside. The tools, as JSON of the template's own making (a string value
// written unescaped), go before the last user turn (and any other equal to it); calls are a JSON
// list after [TOOL_CALLS] (the turn's content dropped), results [TOOL_RESULTS] with their content
// unquoted. Call ids must have 9 characters. No generation prompt ([/INST] is one).
Result<std::string> render_mistral_nemo(std::span<const ChatMessage> m, const std::string& bos,
                                        const std::string& eos,
                                        std::span<const std::string> tools) {
  auto parts = mistral_turns(m);
  if (!parts) return parts.take_error();
  const auto [has_system, turns, last_user] = *parts;
  std::string out = bos;
  for (size_t i = 0; i < turns.size(); ++i) {
    const ChatMessage& msg = turns[i];
    if (msg.role == "user") {
      // The template compares the messages whole (Python dicts): role and content here.
      if (!tools.empty() && msg.content == last_user->content) {
        out += "[AVAILABLE_TOOLS][";
        for (size_t t = 0; t < tools.size(); ++t) {
          const ojson tool = ojson::parse(tools[t], nullptr, /*allow_exceptions=*/false);
          const ojson* fn = member(tool, "function");
          if (fn == nullptr || !fn->is_object()) return template_error("a tool without function");
          out += "{\"type\": \"function\", \"function\": {";
          bool first = true;
          for (const auto& [key, value] : fn->items()) {
            if (key == "return") continue;
            out += (first ? "\"" : ", \"") + key + "\": ";
            first = false;
            if (value.is_string()) {
              out += "\"" + value.get<std::string>() + "\"";
            } else {
              python_json(value, out);
            }
          }
          out += t + 1 < tools.size() ? "}}, " : "}}]";
        }
        out += "[/AVAILABLE_TOOLS]";
      }
      const bool system_here = i + 1 == turns.size() && has_system;
      out += "[INST]" + (system_here ? m[0].content + "\n\n" : std::string()) + msg.content +
             "[/INST]";
    } else if (!msg.tool_calls.empty()) {
      out += "[TOOL_CALLS][";
      for (size_t k = 0; k < msg.tool_calls.size(); ++k) {
        const ChatToolCall& call = msg.tool_calls[k];
        out += "{\"name\": " + json_quoted(call.name) +
               ", \"arguments\": " + tojson_arguments(call.arguments);
        if (call.id.size() != 9) return bad_call_id();
        out += ", \"id\": \"" + call.id + "\"}";
        out += k + 1 < msg.tool_calls.size() ? ", " : "]" + eos;
      }
    } else if (msg.role == "assistant") {
      out += msg.content + eos;
    } else if (msg.role == "tool") {
      out += "[TOOL_RESULTS]{\"content\": " + msg.content + ", ";
      if (msg.tool_call_id.size() != 9) return bad_call_id();
      out += "\"call_id\": \"" + msg.tool_call_id + "\"}[/TOOL_RESULTS]";
    } else {
      return template_error(
          "Only user and assistant roles are supported, with the exception of an initial optional "
          "system message!");
    }
  }
  return out;
}

// Today's date as strftime_now("%Y-%m-%d") gives it (the local time, as Python's datetime.now()).
std::string today() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  char buf[16];
  return std::string(buf, std::strftime(buf, sizeof buf, "%Y-%m-%d", &tm));
}

// Mistral-Small-3.2-24B-Instruct-2506's template: a [SYSTEM_PROMPT] first, the first system message
// or the template's own (today's date in it); later system messages where they come; the other
// turns alternate user/assistant, calls and tool results aside. The tools, as tojson writes the
// list, go before the last user turn (and any other equal to it); each call is
// [TOOL_CALLS]NAME[CALL_ID]ID[ARGS]JSON, a result [TOOL_RESULTS]ID[TOOL_CONTENT]...; ids must have
// 9 characters. No generation prompt ([/INST] is one).
Result<std::string> render_mistral_small32(std::span<const ChatMessage> m, const std::string& bos,
                                           const std::string& eos, const std::string& date,
                                           std::span<const std::string> tools) {
  auto parts = mistral_turns(m);
  if (!parts) return parts.take_error();
  const auto [has_system, turns, last_user] = *parts;
  std::string out = bos + "[SYSTEM_PROMPT]";
  if (has_system) {
    out += m[0].content;
  } else {
    out +=
        "You are Mistral Small 3, a Large Language Model (LLM) created by Mistral AI, a French "
        "startup headquartered in Paris.\nYour knowledge base was last updated on 2023-10-01. The "
        "current date is " +
        (date.empty() ? today() : date) +
        ".\n\nWhen you're not sure about some information or when the user's request requires "
        "up-to-date or specific data, you must use the available tools to fetch the information. "
        "Do not hesitate to use tools whenever they can provide a more accurate or complete "
        "response. If no relevant tools are available, then clearly state that you don't have the "
        "information and avoid making up anything.\n\nIf the user's question is not clear, "
        "ambiguous, or does not provide enough context for you to accurately answer the question, "
        "you do not try to answer it right away and you rather ask the user to clarify their "
        "request (e.g. \"What are some good restaurants around me?\" => \"Where are you?\" or "
        "\"When is the next flight to Tokyo\" => \"Where do you travel from?\").\nYou are always "
        "very attentive to dates, and when asked about information at specific dates, you discard "
        "information that is at another date.\nYou follow these instructions in all languages, and "
        "always respond to the user in the language they use or request.\nNext sections describe "
        "the capabilities that you have.\n\n# WEB BROWSING INSTRUCTIONS\n\nYou cannot perform any "
        "web search or access internet to open URLs, links etc. If it seems like the user is "
        "expecting you to do so, you clarify the situation and ask the user to copy paste the text "
        "directly in the chat.\n\n# MULTI-MODAL INSTRUCTIONS\n\nYou have the ability to read "
        "images, but you cannot generate images. You also cannot transcribe audio files or "
        "videos.\nYou cannot read nor transcribe audio files or videos.\n\n# TOOL CALLING "
        "INSTRUCTIONS\n\nYou may have access to tools that you can use to fetch information or "
        "perform actions. You must use these tools in the following situations:\n\n1. When the "
        "request requires up-to-date information.\n2. When the request requires specific data that "
        "you do not have in your knowledge base.\n3. When the request involves actions that you "
        "cannot perform without tools.\n\nAlways prioritize using tools to provide the most "
        "accurate and helpful response. If tools are not available, inform the user that you "
        "cannot perform the requested action at the moment.";
  }
  out += "[/SYSTEM_PROMPT]";
  for (const ChatMessage& msg : turns) {
    if (msg.role == "system") {
      out += "[SYSTEM_PROMPT]" + msg.content + "[/SYSTEM_PROMPT]";
    } else if (msg.role == "user") {
      // The template compares the messages whole (Python dicts): role and content here.
      if (!tools.empty() && msg.content == last_user->content) {
        out += "[AVAILABLE_TOOLS][";
        for (size_t t = 0; t < tools.size(); ++t) out += (t > 0 ? ", " : "") + tools[t];
        out += "][/AVAILABLE_TOOLS]";
      }
      out += "[INST]" + msg.content + "[/INST]";
    } else if (msg.role == "assistant") {
      for (const ChatToolCall& call : msg.tool_calls) {
        out += "[TOOL_CALLS]" + call.name;
        if (call.id.size() != 9) return bad_call_id();
        out += "[CALL_ID]" + call.id + "[ARGS]" + tojson_arguments(call.arguments);
      }
      out += (msg.tool_calls.empty() ? msg.content : std::string()) + eos;
    } else {  // tool
      if (msg.tool_call_id.size() != 9) return bad_call_id();
      out +=
          "[TOOL_RESULTS]" + msg.tool_call_id + "[TOOL_CONTENT]" + msg.content + "[/TOOL_RESULTS]";
    }
  }
  return out;
}

// Mistral-7B-Instruct-v0.1's template: no system message at all.
Result<std::string> render_mistral_v01(std::span<const ChatMessage> m, const std::string& bos,
                                       const std::string& eos) {
  std::string out = bos;
  for (size_t i = 0; i < m.size(); ++i) {
    if ((m[i].role == "user") != (i % 2 == 0)) {
      return template_error("Conversation roles must alternate user/assistant/user/assistant/...");
    }
    if (m[i].role == "user") {
      out += "[INST] " + m[i].content + " [/INST]";
    } else if (m[i].role == "assistant") {
      out += m[i].content + eos;
    } else {
      return template_error("Only user and assistant roles are supported!");
    }
  }
  return out;
}

void llama3_turn(std::string& out, std::string_view role, std::string_view content) {
  out += "<|start_header_id|>";
  out += role;
  out += "<|end_header_id|>\n\n";
  out += py_strip(content);
  out += "<|eot_id|>";
}

std::string render_llama3(std::span<const ChatMessage> m, bool gen, const std::string& bos) {
  std::string out = bos;
  for (const ChatMessage& msg : m) llama3_turn(out, msg.role, msg.content);
  if (gen) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
  return out;
}

// Llama 3.1/3.3: a system block with the fixed dates the template defaults to comes first always.
std::string render_llama31(std::span<const ChatMessage> m, bool gen, const std::string& bos) {
  std::string out = bos;
  std::string_view system;
  std::span<const ChatMessage> rest = m;
  if (m[0].role == "system") {
    system = py_strip(m[0].content);
    rest = m.subspan(1);
  }
  out +=
      "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday "
      "Date: 26 Jul 2024\n\n";
  out += system;
  out += "<|eot_id|>";
  for (const ChatMessage& msg : rest) llama3_turn(out, msg.role, msg.content);
  if (gen) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
  return out;
}

// The text after the last `sep` of s (all of s when there is none): Python's s.split(sep)[-1].
std::string_view after_last(std::string_view s, std::string_view sep) {
  const size_t at = s.rfind(sep);
  return at == std::string_view::npos ? s : s.substr(at + sep.size());
}

// GLM-4.5/4.6: every answer opens with a <think> block, filled only after the last user turn; the
// generation prompt leaves thinking to the model. enable_thinking false: "/nothink" ends each user
// message (once), and the generation prompt closes an empty block.
std::string render_glm45(std::span<const ChatMessage> m, bool gen, const ChatOptions& o,
                         std::span<const std::string> tools) {
  const bool no_think = o.enable_thinking == false;
  std::string out = "[gMASK]<sop>";
  if (!tools.empty()) {
    out +=
        "<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML "
        "tags:\n<tools>\n";
    for (const std::string& t : tools) out += t + "\n";
    out +=
        "</tools>\n\nFor each function call, output the function name and arguments within the "
        "following XML format:\n<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n"
        "<arg_value>{arg-value-1}</arg_value>\n<arg_key>{arg-key-2}</arg_key>\n"
        "<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>";
  }
  ptrdiff_t last_user = -1;  // none: every turn is after it
  for (size_t k = 0; k < m.size(); ++k) {
    if (m[k].role == "user") last_user = static_cast<ptrdiff_t>(k);
  }
  for (size_t i = 0; i < m.size(); ++i) {
    const ChatMessage& msg = m[i];
    if (msg.role == "tool") {
      if (i == 0 || m[i - 1].role != "tool") out += "<|observation|>";
      out += "\n<tool_response>\n" + msg.content + "\n</tool_response>";
      continue;
    }
    if (msg.role != "assistant") {
      out += "<|" + msg.role + "|>\n" + msg.content;
      if (no_think && msg.role == "user" && !ends_with(msg.content, "/nothink")) out += "/nothink";
      continue;
    }
    std::string_view content = msg.content;
    std::string_view reasoning;
    const size_t first_end = content.find("</think>");
    if (first_end != std::string_view::npos) {
      reasoning = lstrip_nl(after_last(rstrip_nl(content.substr(0, first_end)), "<think>"));
      content = lstrip_nl(after_last(content, "</think>"));
    }
    out += "<|assistant|>\n<think>";
    if (static_cast<ptrdiff_t>(i) > last_user) out += py_strip(reasoning);
    out += "</think>";
    if (!py_strip(content).empty()) {
      out += "\n";
      out += py_strip(content);
    }
    // Each call's arguments as key/value pairs: strings as they are, other values as tojson.
    for (const ChatToolCall& call : msg.tool_calls) {
      out += "\n<tool_call>" + call.name + "\n";
      nlohmann::ordered_json args;
      try {
        args = nlohmann::ordered_json::parse(call.arguments);
      } catch (const nlohmann::ordered_json::exception&) {
        args = nlohmann::ordered_json::object();
      }
      for (const auto& [k, v] : args.items()) {
        out += "<arg_key>" + k + "</arg_key>\n<arg_value>";
        if (v.is_string()) {
          out += v.get<std::string>();
        } else {
          out += *template_json(v.dump());
        }
        out += "</arg_value>\n";
      }
      out += "</tool_call>";
    }
  }
  if (gen) out += no_think ? "<|assistant|>\n<think></think>" : "<|assistant|>";
  return out;
}

// Python's str() of a value, as Jinja's join and {{ }} write it.
std::string py_str(const ojson& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_boolean()) return v.get<bool>() ? "True" : "False";
  if (v.is_null()) return "None";
  return *template_json(v.dump());
}

// `name not in (required or [])`.
bool optional_key(const ojson* required, const std::string& name) {
  if (!truthy(required) || !required->is_array()) return true;
  return std::none_of(required->begin(), required->end(),
                      [&](const ojson& r) { return r.is_string() && r == name; });
}

size_t code_points(std::string_view s) {
  return static_cast<size_t>(std::count_if(
      s.begin(), s.end(), [](char c) { return (static_cast<unsigned char>(c) & 0xc0) != 0x80; }));
}

// The template's render_typescript_type macro, white space and all (a nested object's members
// each on a new line after 16 spaces; a oneOf's alternatives joined by " | " and a newline).
std::string ts_type(const ojson& spec) {
  const ojson* type = member(spec, "type");
  const bool nullable = truthy(member(spec, "nullable"));
  if (is_string(type, "array")) {
    const ojson* items = member(spec, "items");
    std::string out = "any[]";
    if (truthy(items)) {
      const ojson* t = member(*items, "type");
      if (is_string(t, "string")) {
        out = "string[]";
      } else if (is_string(t, "number") || is_string(t, "integer")) {
        out = "number[]";
      } else if (is_string(t, "boolean")) {
        out = "boolean[]";
      } else {
        const std::string inner = ts_type(*items);
        out = inner == "object | object" || code_points(inner) > 50 ? "any[]" : inner + "[]";
      }
    }
    return nullable ? out + " | null" : out;
  }
  if (type != nullptr && type->is_array() && !type->empty()) {
    std::string out;
    for (const ojson& t : *type) out += (out.empty() ? "" : " | ") + py_str(t);
    return out;
  }
  // The template means to write "any" for a oneOf with object alternatives, but its flag is set
  // inside the loop (a Jinja scope of its own), so it never is.
  if (const ojson* one_of = member(spec, "oneOf"); truthy(one_of) && one_of->is_array()) {
    std::string out;
    for (size_t i = 0; i < one_of->size(); ++i) {
      const ojson& variant = (*one_of)[i];
      out += ts_type(variant);
      if (const ojson* d = member(variant, "description"); truthy(d)) out += "// " + py_str(*d);
      if (const ojson* d = member(variant, "default")) {
        out += std::string(20, ' ') + "// default: " + *template_json(d->dump());
      }
      if (i + 1 < one_of->size()) out += " | \n";
    }
    return out;
  }
  if (is_string(type, "string")) {
    if (const ojson* e = member(spec, "enum"); truthy(e) && e->is_array()) {
      std::string out = "\"";
      for (size_t i = 0; i < e->size(); ++i) out += (i > 0 ? "\" | \"" : "") + py_str((*e)[i]);
      return out + "\"";
    }
    return nullable ? "string | null" : "string";
  }
  if (is_string(type, "number") || is_string(type, "integer")) return "number";
  if (is_string(type, "boolean")) return "boolean";
  if (is_string(type, "object")) {
    const ojson* props = member(spec, "properties");
    if (!truthy(props) || !props->is_object()) return "object";
    const ojson* required = member(spec, "required");
    std::string out = "{\n";
    size_t i = 0;
    for (const auto& [name, prop] : props->items()) {
      out += name + (optional_key(required, name) ? "?" : "") + ": \n" + std::string(16, ' ') +
             ts_type(prop);
      if (++i < props->size()) out += ", ";
    }
    return out + "}";
  }
  return "any";
}

// Jinja's `str + value`: Python refuses anything but a string.
Result<std::string> concat(const ojson& v) {
  if (v.is_string()) return v.get<std::string>();
  return template_error(fmt::format("can only concatenate str (not \"{}\") to str",
                                    v.is_boolean()  ? "bool"
                                    : v.is_number() ? (v.is_number_float() ? "float" : "int")
                                    : v.is_null()   ? "NoneType"
                                    : v.is_array()  ? "list"
                                                    : "dict"));
}

// The developer message's "## functions" namespace (render_tool_namespace). A tool without a
// description, which the template cannot render, gets no comment line.
Result<std::string> gpt_oss_namespace(std::span<const std::string> tools) {
  std::string out = "## functions\n\nnamespace functions {\n\n";
  for (const std::string& text : tools) {
    const ojson tool = ojson::parse(text, nullptr, /*allow_exceptions=*/false);
    const ojson* fn = member(tool, "function");
    const ojson* name = fn == nullptr ? nullptr : member(*fn, "name");
    if (name == nullptr || !name->is_string()) {
      return template_error("a tool without function.name: " + text.substr(0, 80));
    }
    if (const ojson* d = member(*fn, "description"); d != nullptr && !d->is_null()) {
      out += "// " + py_str(*d) + "\n";
    }
    out += "type " + name->get<std::string>() + " = ";
    const ojson* params = member(*fn, "parameters");
    const ojson* props = params == nullptr ? nullptr : member(*params, "properties");
    if (!truthy(params) || !truthy(props) || !props->is_object()) {
      out += "() => any;\n\n";
      continue;
    }
    const ojson* required = member(*params, "required");
    out += "(_: {\n";
    for (const auto& [pname, spec] : props->items()) {
      if (const ojson* d = member(spec, "description"); truthy(d)) out += "// " + py_str(*d) + "\n";
      out += pname + (optional_key(required, pname) ? "?" : "") + ": " + ts_type(spec);
      if (const ojson* d = member(spec, "default")) {
        if (truthy(member(spec, "enum")) || truthy(member(spec, "oneOf"))) {
          auto value = concat(*d);
          if (!value) return value.take_error();
          out += (truthy(member(spec, "enum")) ? ", // default: " : "// default: ") + *value;
        } else {
          out += ", // default: " + *template_json(d->dump());
        }
      }
      out += ",\n";
    }
    out += "}) => any;\n\n";
  }
  return out + "} // namespace functions";
}

// gpt-oss (harmony): the system block with the model identity, date and reasoning effort (medium
// unless given), a first system message as the developer's instructions and the tools after them,
// answers in the final channel; the last one ends with <|return|> when no generation prompt
// follows. A call goes to=functions.NAME in the commentary channel (only a message's first: the
// template takes one per message), after the message's content as analysis unless a later answer
// without calls follows; a tool's result comes from functions.NAME of the last call, quoted as
// JSON.
Result<std::string> render_gpt_oss(std::span<const ChatMessage> m, bool gen,
                                   const std::string& date, const ChatOptions& o,
                                   std::span<const std::string> tools) {
  std::string out =
      "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
      "Knowledge cutoff: 2024-06\nCurrent date: " +
      (date.empty() ? today() : date) + "\n\nReasoning: " +
      (o.reasoning_effort.empty() ? std::string("medium") : o.reasoning_effort) +
      "\n\n# Valid channels: analysis, commentary, final. Channel must be "
      "included for every message.";
  if (!tools.empty())
    out += "\nCalls to these tools must go to the commentary channel: 'functions'.";
  out += "<|end|>";
  std::span<const ChatMessage> rest = m;
  std::string_view developer;
  if (m[0].role == "system") {
    developer = m[0].content;
    rest = m.subspan(1);
  }
  if (!developer.empty() || !tools.empty()) {
    out += "<|start|>developer<|message|>";
    if (!developer.empty()) out += "# Instructions\n\n" + std::string(developer) + "\n\n";
    if (!tools.empty()) {
      auto ns = gpt_oss_namespace(tools);
      if (!ns) return ns.take_error();
      out += "# Tools\n\n" + *ns;
    }
    out += "<|end|>";
  }
  std::optional<std::string> last_call;  // the name the next tool result comes from
  for (size_t i = 0; i < rest.size(); ++i) {
    const ChatMessage& msg = rest[i];
    if (msg.role == "user") {
      out += "<|start|>user<|message|>" + msg.content + "<|end|>";
    } else if (msg.role == "tool") {
      if (!last_call) {
        return template_error(
            "Message has tool role, but there was no previous assistant message with a tool "
            "call!");
      }
      out += "<|start|>functions." + *last_call + " to=assistant<|channel|>commentary<|message|>" +
             json_quoted(msg.content) + "<|end|>";
    } else if (msg.role == "assistant") {
      if (contains(msg.content, "<|channel|>analysis<|message|>") ||
          contains(msg.content, "<|channel|>final<|message|>")) {
        return template_error(
            "You have passed a message containing <|channel|> tags in the content field. Instead "
            "of doing this, you should pass analysis messages (the string between '<|message|>' "
            "and '<|end|>') in the 'thinking' field, and final messages (the string between "
            "'<|message|>' and '<|end|>') in the 'content' field.");
      }
      if (!msg.tool_calls.empty()) {
        const bool final_follows = std::any_of(rest.begin() + i + 1, rest.end(), [](auto& later) {
          return later.role == "assistant" && later.tool_calls.empty();
        });
        if (!msg.content.empty() && !final_follows) {
          out += "<|start|>assistant<|channel|>analysis<|message|>" + msg.content + "<|end|>";
        }
        const ChatToolCall& call = msg.tool_calls[0];
        out += "<|start|>assistant to=functions." + call.name + "<|channel|>commentary json" +
               "<|message|>" + tojson_arguments(call.arguments) + "<|call|>";
        last_call = call.name;
        continue;
      }
      const bool last = i + 1 == rest.size() && !gen;
      out += "<|start|>assistant<|channel|>final<|message|>" + msg.content +
             (last ? "<|return|>" : "<|end|>");
      last_call.reset();
    }  // a later system message: the template drops it
  }
  if (gen) out += "<|start|>assistant";
  return out;
}

// Kimi-K2: a default system turn (`preamble`) when the first message is not a system one.
std::string render_kimi_k2(std::span<const ChatMessage> m, bool gen, std::string_view preamble) {
  std::string out;
  if (m[0].role != "system") out += preamble;
  for (const ChatMessage& msg : m) {
    const std::string_view tag = msg.role == "user"        ? "<|im_user|>"
                                 : msg.role == "assistant" ? "<|im_assistant|>"
                                                           : "<|im_system|>";
    out += tag;
    out += msg.role + "<|im_middle|>" + msg.content + "<|im_end|>";
  }
  if (gen) out += "<|im_assistant|>assistant<|im_middle|>";
  return out;
}

}  // namespace

ChatTemplate::ChatTemplate(Kind kind, std::string family, std::string bos, std::string eos)
    : kind_(kind), family_(std::move(family)), bos_(std::move(bos)), eos_(std::move(eos)) {
  switch (kind_) {
    case Kind::kChatml:
    case Kind::kQwen3:
    case Kind::kQwen25:
      stop_strings_ = {"<|im_end|>"};
      break;
    case Kind::kDeepseek3:
    case Kind::kDeepseek4:
      stop_strings_ = {"<｜end▁of▁sentence｜>"};
      break;
    case Kind::kMistral:
    case Kind::kMistralV01:
    case Kind::kMistralNemo:
    case Kind::kMistralSmall32:
      if (!eos_.empty()) stop_strings_ = {eos_};
      break;
    case Kind::kLlama3:
    case Kind::kLlama31:
      stop_strings_ = {"<|eot_id|>"};
      break;
    case Kind::kGlm45:
      stop_strings_ = {"<|user|>", "<|observation|>"};
      break;
    case Kind::kGptOss:
      stop_strings_ = {"<|return|>", "<|call|>"};
      break;
    case Kind::kKimiK2:
    case Kind::kKimiK2Helpful:
      stop_strings_ = {"<|im_end|>"};
      break;
  }
}

Result<ChatTemplate> ChatTemplate::from_gguf(const GgufFile& file, const Tokenizer& tok) {
  std::string bos = tok.bos() ? tok.decode(*tok.bos()) : std::string();
  std::string eos = tok.eos() ? tok.decode(*tok.eos()) : std::string();
  const GgufValue* v = file.find("tokenizer.chat_template");
  if (v == nullptr) {
    return ChatTemplate(Kind::kChatml, "chatml (default: the model has no tokenizer.chat_template)",
                        std::move(bos), std::move(eos));
  }
  const std::string* text = v->as_string();
  if (text == nullptr) {
    return make_error(EINVAL, file.path() + ": tokenizer.chat_template is a " +
                                  std::string(gguf_value_type_name(v->type)) + ", not a string");
  }
  auto t = from_text(*text, std::move(bos), std::move(eos));
  if (!t) return make_error(t.error().code, file.path() + ": " + t.error().message);
  return t;
}

Result<ChatTemplate> ChatTemplate::from_text(std::string_view jinja, std::string bos,
                                             std::string eos) {
  if (is_plain_chatml(jinja)) {
    return ChatTemplate(Kind::kChatml, "chatml", std::move(bos), std::move(eos));
  }
  for (const Signature& sig : signatures()) {
    const bool all = std::all_of(sig.present.begin(), sig.present.end(),
                                 [&](std::string_view p) { return contains(jinja, p); });
    const bool none = std::none_of(sig.absent.begin(), sig.absent.end(),
                                   [&](std::string_view p) { return contains(jinja, p); });
    if (all && none) {
      ChatTemplate t(sig.kind, std::string(sig.family), std::move(bos), std::move(eos));
      t.high_effort_preamble_ = sig.kind == Kind::kDeepseek4 &&
                                contains(jinja, "reasoning_effort == 'high'") &&
                                contains(jinja, "{{- reasoning_effort_high -}}");
      return t;
    }
  }
  // The first line that says something: templates often open with "{%- if ... %}" blocks.
  std::string_view first = jinja;
  while (!first.empty() && (first.front() == '\n' || first.front() == '\r')) first.remove_prefix(1);
  first = first.substr(0, first.find('\n'));
  if (first.size() > 120) first = first.substr(0, 120);
  return make_error(EINVAL, "chat template not supported (first line: '" + std::string(first) +
                                "'); " + std::string(kKnown));
}

// The templates named() knows, by name.
constexpr std::array<std::pair<std::string_view, ChatTemplate::Kind>, 15> kNamed = {{
    {"chatml", ChatTemplate::Kind::kChatml},
    {"qwen3", ChatTemplate::Kind::kQwen3},
    {"qwen2.5", ChatTemplate::Kind::kQwen25},
    {"deepseek3", ChatTemplate::Kind::kDeepseek3},
    {"deepseek4", ChatTemplate::Kind::kDeepseek4},
    {"mistral", ChatTemplate::Kind::kMistral},
    {"mistral-v0.1", ChatTemplate::Kind::kMistralV01},
    {"mistral-nemo", ChatTemplate::Kind::kMistralNemo},
    {"mistral-small-3.2", ChatTemplate::Kind::kMistralSmall32},
    {"llama3", ChatTemplate::Kind::kLlama3},
    {"llama3.1", ChatTemplate::Kind::kLlama31},
    {"glm4.5", ChatTemplate::Kind::kGlm45},
    {"gpt-oss", ChatTemplate::Kind::kGptOss},
    {"kimi-k2", ChatTemplate::Kind::kKimiK2},
    {"kimi-k2-helpful", ChatTemplate::Kind::kKimiK2Helpful},
}};

Result<ChatTemplate> ChatTemplate::named(std::string_view family, std::string bos,
                                         std::string eos) {
  for (const auto& [name, kind] : kNamed) {
    if (name == family)
      return ChatTemplate(kind, std::string(name), std::move(bos), std::move(eos));
  }
  return make_error(
      EINVAL, "chat template family '" + std::string(family) + "' unknown; known: " + names());
}

std::string ChatTemplate::names() {
  std::string out;
  for (const auto& [name, kind] : kNamed) {
    if (!out.empty()) out += ", ";
    out += name;
  }
  return out;
}

Result<std::string> ChatTemplate::render(std::span<const ChatMessage> messages,
                                         bool add_generation_prompt, const ChatOptions& options,
                                         std::span<const std::string> tools) const {
  if (messages.empty()) return make_error(EINVAL, "chat template: no messages");
  bool tool_parts = !tools.empty();
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& r = messages[i].role;
    tool_parts = tool_parts || r == "tool" || !messages[i].tool_calls.empty();
    if (r != "system" && r != "user" && r != "assistant" && r != "tool") {
      return make_error(EINVAL, "chat template: message " + std::to_string(i) + " has role '" + r +
                                    "'; known: system, user, assistant, tool");
    }
  }
  if (tool_parts && !supports_tools()) {
    return make_error(
        EINVAL,
        "chat template: tools, tool calls and tool messages are not "
        "supported with the " +
            family_ +
            " template yet (Qwen3, GLM-4.5, gpt-oss, DeepSeek-V3.1/V4, Mistral-Nemo/Small-3.2)");
  }
  switch (kind_) {
    case Kind::kChatml:
      return render_chatml(messages, add_generation_prompt);
    case Kind::kQwen3:
      return render_qwen3(messages, add_generation_prompt, options, tools);
    case Kind::kQwen25:
      return render_qwen25(messages, add_generation_prompt);
    case Kind::kDeepseek3:
      return render_deepseek3(messages, add_generation_prompt, bos_, options);
    case Kind::kDeepseek4:
      return render_deepseek4(messages, add_generation_prompt, bos_, options, high_effort_preamble_,
                              tools);
    case Kind::kMistral:
      return render_mistral(messages, bos_, eos_);
    case Kind::kMistralV01:
      return render_mistral_v01(messages, bos_, eos_);
    case Kind::kMistralNemo:
      return render_mistral_nemo(messages, bos_, eos_, tools);
    case Kind::kMistralSmall32:
      return render_mistral_small32(messages, bos_, eos_, date_, tools);
    case Kind::kLlama3:
      return render_llama3(messages, add_generation_prompt, bos_);
    case Kind::kLlama31:
      return render_llama31(messages, add_generation_prompt, bos_);
    case Kind::kGlm45:
      return render_glm45(messages, add_generation_prompt, options, tools);
    case Kind::kGptOss:
      return render_gpt_oss(messages, add_generation_prompt, date_, options, tools);
    case Kind::kKimiK2:
      // Kimi-K2-Instruct's template; its system turn ends with the template's stray newline.
      return render_kimi_k2(messages, add_generation_prompt,
                            "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created "
                            "by Moonshot AI.<|im_end|>\n");
    case Kind::kKimiK2Helpful:
      return render_kimi_k2(messages, add_generation_prompt,
                            "<|im_system|>system<|im_middle|>You are a helpful "
                            "assistant<|im_end|>");
  }
  return make_error(EINVAL, "chat template: unknown family");
}

std::vector<std::string> ChatTemplate::ignored(const ChatOptions& o) const {
  const bool deepseek = kind_ == Kind::kDeepseek3 || kind_ == Kind::kDeepseek4;
  std::vector<std::string> out;
  if (o.enable_thinking && !(deepseek || kind_ == Kind::kQwen3 || kind_ == Kind::kGlm45)) {
    out.push_back("enable_thinking");
  }
  if (o.thinking && !deepseek) out.push_back("thinking");
  // DeepSeek-V4's template reads reasoning_effort only as "max", not a value ChatOptions takes;
  // V4-Flash's also as "high".
  const bool effort =
      kind_ == Kind::kGptOss || (high_effort_preamble_ && o.reasoning_effort == "high");
  if (!o.reasoning_effort.empty() && !effort) out.push_back("reasoning_effort");
  return out;
}

ChatOptions ChatOptions::overridden_by(const ChatOptions& over) const {
  ChatOptions out = *this;
  if (over.enable_thinking) out.enable_thinking = over.enable_thinking;
  if (over.thinking) out.thinking = over.thinking;
  if (!over.reasoning_effort.empty()) out.reasoning_effort = over.reasoning_effort;
  return out;
}

bool valid_reasoning_effort(std::string_view effort) {
  return effort == "low" || effort == "medium" || effort == "high";
}

Status read_chat_flags(std::string_view kwargs_json, std::string_view reasoning_effort,
                       ChatOptions& out) {
  if (!kwargs_json.empty()) {
    EXPERTD_TRY(read_chat_template_kwargs(kwargs_json, "--chat-template-kwargs", out));
  }
  if (!reasoning_effort.empty()) {
    if (!out.reasoning_effort.empty() && out.reasoning_effort != reasoning_effort) {
      return make_error(EINVAL, fmt::format("--reasoning-effort {} and --chat-template-kwargs' "
                                            "reasoning_effort {} differ",
                                            reasoning_effort, out.reasoning_effort));
    }
    out.reasoning_effort = std::string(reasoning_effort);
  }
  return Ok{};
}

Status read_chat_template_kwargs(std::string_view kwargs_json, std::string_view where,
                                 ChatOptions& out, std::string* param) {
  using json = nlohmann::json;
  auto fail = [&](std::string field, std::string message) -> Status {
    if (param != nullptr) *param = std::move(field);
    return make_error(EINVAL, std::move(message));
  };
  const json kwargs = json::parse(kwargs_json, nullptr, /*allow_exceptions=*/false);
  if (kwargs.is_discarded()) {
    return fail(std::string(where), std::string(where) + ": not JSON: '" +
                                        std::string(kwargs_json.substr(0, 80)) + "'");
  }
  if (!kwargs.is_object()) {
    return fail(std::string(where),
                std::string(where) + " must be an object, got " +
                    kwargs.dump(-1, ' ', false, json::error_handler_t::replace));
  }
  auto shown = [](const json& v) {
    return std::string(v.is_string()    ? "a string"
                       : v.is_boolean() ? "a boolean"
                       : v.is_number()  ? "a number"
                       : v.is_array()   ? "an array"
                                        : "an object") +
           " (" + v.dump(-1, ' ', false, json::error_handler_t::replace) + ")";
  };
  ChatOptions read;
  for (const char* key : {"enable_thinking", "thinking"}) {
    const auto it = kwargs.find(key);
    if (it == kwargs.end() || it->is_null()) continue;
    const std::string name = std::string(where) + "." + key;
    if (!it->is_boolean()) return fail(name, name + " must be a boolean, got " + shown(*it));
    (std::string_view(key) == "thinking" ? read.thinking : read.enable_thinking) = it->get<bool>();
  }
  if (const auto it = kwargs.find("reasoning_effort"); it != kwargs.end() && !it->is_null()) {
    const std::string name = std::string(where) + ".reasoning_effort";
    if (!it->is_string()) return fail(name, name + " must be a string, got " + shown(*it));
    read.reasoning_effort = it->get<std::string>();
    if (!valid_reasoning_effort(read.reasoning_effort)) {
      return fail(name, name + " must be one of " + std::string(kReasoningEfforts) + ", got '" +
                            read.reasoning_effort + "'");
    }
  }
  out = out.overridden_by(read);
  return Ok{};
}

ChatTemplate ChatTemplate::with_date(std::string date) const {
  ChatTemplate t = *this;
  t.date_ = std::move(date);
  return t;
}

Result<ChatTemplate> ChatTemplate::from_flag(const std::string& flag, const GgufFile& file,
                                             const Tokenizer& tok) {
  if (flag.empty()) return from_gguf(file, tok);
  const std::string bos = tok.bos() ? tok.decode(*tok.bos()) : std::string();
  const std::string eos = tok.eos() ? tok.decode(*tok.eos()) : std::string();
  std::ifstream f(flag, std::ios::binary);
  auto t = f ? from_text(std::string(std::istreambuf_iterator<char>(f), {}), bos, eos)
             : named(flag, bos, eos);
  if (!t) return Error{t.error().code, "--chat-template " + flag + ": " + t.error().message};
  return t;
}

}  // namespace expertd::text

namespace expertd::text {
namespace {

// Python's json.dumps string escapes with ensure_ascii=False.
void python_string(std::string_view s, std::string& out) {
  out += '"';
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20 || c == 0x7f) {
          out += fmt::format("\\u{:04x}", c);
        } else {
          out += ch;
        }
    }
  }
  out += '"';
}

void python_json(const nlohmann::ordered_json& v, std::string& out) {
  switch (v.type()) {
    case nlohmann::ordered_json::value_t::object: {
      out += '{';
      bool first = true;
      for (const auto& [k, x] : v.items()) {
        if (!first) out += ", ";
        first = false;
        python_string(k, out);
        out += ": ";
        python_json(x, out);
      }
      out += '}';
      break;
    }
    case nlohmann::ordered_json::value_t::array: {
      out += '[';
      for (size_t i = 0; i < v.size(); ++i) {
        if (i > 0) out += ", ";
        python_json(v[i], out);
      }
      out += ']';
      break;
    }
    case nlohmann::ordered_json::value_t::string:
      python_string(v.get_ref<const std::string&>(), out);
      break;
    default:
      out += v.dump();  // numbers, booleans, null
  }
}

}  // namespace

// The <tool_call>...</tool_call> blocks of an answer (Qwen3's and GLM-4.5's calls): the text
// before the first, and each block's body, up to the first block followed by anything but
// whitespace. A last block without its closing tag (cut at max_tokens) runs to the answer's end
// and sets `cut`.
struct CallBlocks {
  std::string_view before;
  std::vector<std::string_view> bodies;
  bool cut = false;
};

static std::optional<CallBlocks> call_blocks(std::string_view answer) {
  constexpr std::string_view kOpen = "<tool_call>", kClose = "</tool_call>";
  const size_t first = answer.find(kOpen);
  if (first == std::string_view::npos) return std::nullopt;
  CallBlocks out;
  out.before = answer.substr(0, first);
  for (size_t at = first; at != std::string_view::npos;) {
    const size_t body = at + kOpen.size();
    const size_t end = answer.find(kClose, body);
    if (end == std::string_view::npos) {
      out.bodies.push_back(answer.substr(body));
      out.cut = true;
      break;
    }
    out.bodies.push_back(answer.substr(body, end - body));
    const size_t after = end + kClose.size();
    const size_t next = answer.find(kOpen, after);
    const std::string_view between = answer.substr(
        after, next == std::string_view::npos ? std::string_view::npos : next - after);
    if (between.find_first_not_of(" \n\t\r") != std::string_view::npos) break;
    at = next;
  }
  return out;
}

// GLM-4.5's calls: <tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n...
// </tool_call>, a value that reads as JSON taken as that value, else as a string.
static std::optional<ParsedToolCalls> parse_glm_calls(std::string_view answer) {
  const auto blocks = call_blocks(answer);
  if (!blocks || blocks->cut) return std::nullopt;
  ParsedToolCalls out;
  out.content = std::string(rstrip_space(blocks->before));
  for (const std::string_view body : blocks->bodies) {
    const size_t nl = body.find('\n');
    std::string_view name = body.substr(0, nl);
    while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back()))) {
      name.remove_suffix(1);
    }
    if (name.empty()) return std::nullopt;
    nlohmann::ordered_json args = nlohmann::ordered_json::object();
    std::string_view rest = nl == std::string_view::npos ? "" : body.substr(nl);
    for (;;) {
      const size_t k0 = rest.find("<arg_key>");
      if (k0 == std::string_view::npos) break;
      const size_t k1 = rest.find("</arg_key>", k0);
      const size_t v0 = rest.find("<arg_value>", k1);
      const size_t v1 = rest.find("</arg_value>", v0);
      if (k1 == std::string_view::npos || v0 == std::string_view::npos ||
          v1 == std::string_view::npos) {
        return std::nullopt;
      }
      const std::string key(rest.substr(k0 + 9, k1 - k0 - 9));
      const std::string value(rest.substr(v0 + 11, v1 - v0 - 11));
      try {
        args[key] = nlohmann::ordered_json::parse(value);
      } catch (const nlohmann::ordered_json::exception&) {
        args[key] = value;
      }
      rest = rest.substr(v1 + 12);
    }
    out.calls.push_back({std::string(name), args.dump()});
  }
  return out;
}

Result<std::string> template_json(std::string_view json_text) {
  nlohmann::ordered_json v;
  try {
    v = nlohmann::ordered_json::parse(json_text);
  } catch (const nlohmann::ordered_json::exception& e) {
    return make_error(EINVAL, std::string("not JSON: ") + e.what());
  }
  std::string out;
  python_json(v, out);
  return out;
}

bool ChatTemplate::supports_tools() const {
  return kind_ == Kind::kQwen3 || kind_ == Kind::kGlm45 || kind_ == Kind::kGptOss ||
         kind_ == Kind::kDeepseek3 || kind_ == Kind::kDeepseek4 || kind_ == Kind::kMistralNemo ||
         kind_ == Kind::kMistralSmall32;
}

void ChatTemplate::fit_call_ids(std::span<ChatMessage> messages) const {
  if (kind_ != Kind::kMistralNemo && kind_ != Kind::kMistralSmall32) return;
  auto fit = [](std::string& id) {
    if (id.size() > 9) id.erase(0, id.size() - 9);
  };
  for (ChatMessage& m : messages) {
    fit(m.tool_call_id);
    for (ChatToolCall& call : m.tool_calls) fit(call.id);
  }
}

std::optional<ChatTemplate::ForcedCall> ChatTemplate::forced_call(std::string_view name) const {
  switch (kind_) {
    case Kind::kQwen3:
      return ForcedCall{"<tool_call>\n", false};
    case Kind::kMistralNemo:
      return ForcedCall{"[TOOL_CALLS][", false};
    case Kind::kMistralSmall32:
      if (name.empty()) return std::nullopt;
      return ForcedCall{"[TOOL_CALLS]" + std::string(name) + "[ARGS]", true};
    case Kind::kDeepseek3:
      if (name.empty()) return std::nullopt;
      return ForcedCall{
          "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>" + std::string(name) + "<｜tool▁sep｜>",
          true};
    case Kind::kGptOss:
      // The header as the template writes earlier calls (the recipient before the channel).
      if (name.empty()) return std::nullopt;
      return ForcedCall{
          " to=functions." + std::string(name) + "<|channel|>commentary json<|message|>", true};
    default:
      return std::nullopt;
  }
}

std::span<const std::string_view> ChatTemplate::tool_call_markers() const {
  static constexpr std::array<std::string_view, 1> kBlocks = {"<tool_call>"};
  // The reasoning splitter leaves a call's harmony header in the content, from its <|start|>
  // (after an analysis message), its <|channel|> or its recipient (first in the answer).
  static constexpr std::array<std::string_view, 3> kHarmony = {"<|start|>", "<|channel|>",
                                                               " to=functions."};
  // DeepSeek-V3.1's first call may come without the list's opening tag.
  static constexpr std::array<std::string_view, 2> kDeepseek3 = {"<｜tool▁calls▁begin｜>",
                                                                 "<｜tool▁call▁begin｜>"};
  static constexpr std::array<std::string_view, 1> kDsml = {"<｜DSML｜tool_calls>"};
  static constexpr std::array<std::string_view, 1> kMistral = {"[TOOL_CALLS]"};
  switch (kind_) {
    case Kind::kQwen3:
    case Kind::kGlm45:
      return kBlocks;
    case Kind::kGptOss:
      return kHarmony;
    case Kind::kDeepseek3:
      return kDeepseek3;
    case Kind::kDeepseek4:
      return kDsml;
    case Kind::kMistralNemo:
    case Kind::kMistralSmall32:
      return kMistral;
    default:
      return {};
  }
}

ChatTemplate::CallHold ChatTemplate::hold_for_calls(std::string_view pending, bool done) const {
  size_t first = std::string_view::npos;
  size_t opening = 0;  // the longest end of `pending` that a marker starts with
  for (const std::string_view marker : tool_call_markers()) {
    first = std::min(first, pending.find(marker));
    for (size_t n = std::min(pending.size(), marker.size() - 1); n > opening; --n) {
      if (marker.starts_with(pending.substr(pending.size() - n))) {
        opening = n;
        break;
      }
    }
  }
  if (done && first == std::string_view::npos) return {pending.size(), false};
  // White space just before a call is not content (the parsers drop it): held with the call, or
  // until what follows it says.
  size_t ready = first != std::string_view::npos ? first : pending.size() - opening;
  while (ready > 0 && std::isspace(static_cast<unsigned char>(pending[ready - 1]))) --ready;
  return {ready, first != std::string_view::npos};
}

// gpt-oss's call, as the reasoning splitter leaves it in the content: a header naming
// to=functions.NAME (before or after its <|channel|>, from "<|start|>assistant" after an analysis
// message), "<|message|>", and the arguments up to <|call|> (a stop string: usually already cut)
// or the end. The text before the header is content. One call: <|call|> ends the answer.
static std::optional<ParsedToolCalls> parse_harmony_call(std::string_view answer) {
  constexpr std::string_view kTo = " to=functions.", kMessage = "<|message|>";
  const size_t to = answer.find(kTo);
  if (to == std::string_view::npos) return std::nullopt;
  // The header starts at the last tag before the recipient.
  size_t start = to;
  for (const std::string_view tag : {"<|start|>", "<|channel|>"}) {
    const size_t at = answer.rfind(tag, to);
    if (at != std::string_view::npos && answer.find("<|message|>", at) > to) {
      start = std::min(start, at);
    }
  }
  const size_t message = answer.find(kMessage, to);
  if (message == std::string_view::npos) return std::nullopt;
  std::string_view name = answer.substr(to + kTo.size(), message - to - kTo.size());
  name = name.substr(0, std::min(name.find(' '), name.find('<')));
  if (name.empty()) return std::nullopt;
  std::string_view body = answer.substr(message + kMessage.size());
  body = body.substr(0, std::min(body.find("<|call|>"), body.find("<|end|>")));
  const ojson args = ojson::parse(body, nullptr, /*allow_exceptions=*/false);
  if (args.is_discarded()) return std::nullopt;
  ParsedToolCalls out;
  out.content = std::string(answer.substr(0, start));
  out.calls.push_back({std::string(name), args.dump()});
  return out;
}

// DeepSeek-V3.1's calls: [<｜tool▁calls▁begin｜>] then <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>JSON
// <｜tool▁call▁end｜> each, up to <｜tool▁calls▁end｜> or the end; a last call cut short still
// counts when its JSON is whole (as Qwen3's).
static std::optional<ParsedToolCalls> parse_deepseek3_calls(std::string_view answer) {
  constexpr std::string_view kBegin = "<｜tool▁call▁begin｜>", kSep = "<｜tool▁sep｜>",
                             kEnd = "<｜tool▁call▁end｜>";
  size_t at = answer.find(kBegin);
  if (at == std::string_view::npos) return std::nullopt;
  ParsedToolCalls out;
  std::string_view before = answer.substr(0, at);
  if (const size_t list = before.rfind("<｜tool▁calls▁begin｜>"); list != std::string_view::npos) {
    before = before.substr(0, list);
  }
  out.content = std::string(before);
  while (at != std::string_view::npos) {
    const size_t sep = answer.find(kSep, at);
    if (sep == std::string_view::npos) return std::nullopt;
    const std::string_view name =
        py_strip(answer.substr(at + kBegin.size(), sep - at - kBegin.size()));
    const size_t end = answer.find(kEnd, sep);
    const std::string_view body =
        answer.substr(sep + kSep.size(), end == std::string_view::npos ? std::string_view::npos
                                                                       : end - sep - kSep.size());
    const ojson args = ojson::parse(body, nullptr, /*allow_exceptions=*/false);
    if (name.empty() || !args.is_object()) return std::nullopt;
    out.calls.push_back({std::string(name), args.dump()});
    if (end == std::string_view::npos) break;
    // The next call follows at once (white space at most); anything else ends the list.
    const size_t next = end + kEnd.size();
    const size_t skip = answer.find_first_not_of(" \n\t\r", next);
    at = skip != std::string_view::npos && answer.substr(skip).starts_with(kBegin)
             ? skip
             : std::string_view::npos;
  }
  return out;
}

// DeepSeek-V4's DSML calls: <｜DSML｜tool_calls> then <｜DSML｜invoke name="NAME"> with
// <｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter> each (a string as
// it is, else JSON) and </｜DSML｜invoke>, up to </｜DSML｜tool_calls>. The text before is content,
// less its trailing white space.
static std::optional<ParsedToolCalls> parse_dsml_calls(std::string_view answer) {
  constexpr std::string_view kList = "<｜DSML｜tool_calls>", kInvoke = "<｜DSML｜invoke name=\"",
                             kInvokeEnd = "</｜DSML｜invoke>",
                             kParam = "<｜DSML｜parameter name=\"",
                             kParamEnd = "</｜DSML｜parameter>";
  const size_t list = answer.find(kList);
  if (list == std::string_view::npos) return std::nullopt;
  ParsedToolCalls out;
  out.content = std::string(rstrip_space(answer.substr(0, list)));
  std::string_view rest = answer.substr(list + kList.size());
  for (size_t at = rest.find(kInvoke); at != std::string_view::npos; at = rest.find(kInvoke)) {
    rest.remove_prefix(at + kInvoke.size());
    const size_t quote = rest.find("\">");
    const size_t end = rest.find(kInvokeEnd);
    if (quote == std::string_view::npos || end == std::string_view::npos || quote > end) {
      return std::nullopt;
    }
    const std::string name(rest.substr(0, quote));
    std::string_view params = rest.substr(quote + 2, end - quote - 2);
    rest.remove_prefix(end + kInvokeEnd.size());
    ojson args = ojson::object();
    for (size_t p = params.find(kParam); p != std::string_view::npos; p = params.find(kParam)) {
      params.remove_prefix(p + kParam.size());
      const size_t key_end = params.find('"');
      const size_t open = params.find('>');
      const size_t close = params.find(kParamEnd);
      if (key_end == std::string_view::npos || open == std::string_view::npos ||
          close == std::string_view::npos || open > close) {
        return std::nullopt;
      }
      const std::string key(params.substr(0, key_end));
      const std::string_view value = params.substr(open + 1, close - open - 1);
      const bool is_text =
          params.substr(key_end, open - key_end).find("string=\"true\"") != std::string_view::npos;
      ojson parsed = is_text ? ojson() : ojson::parse(value, nullptr, /*allow_exceptions=*/false);
      args[key] = is_text || parsed.is_discarded() ? ojson(std::string(value)) : std::move(parsed);
      params.remove_prefix(close + kParamEnd.size());
    }
    if (name.empty()) return std::nullopt;
    out.calls.push_back({name, args.dump()});
  }
  if (out.calls.empty()) return std::nullopt;
  return out;
}

// Mistral-Nemo's calls: [TOOL_CALLS] and a JSON list of {"name", "arguments"(, "id")} (one object
// alone taken as a list of one); arguments an object, or a string of JSON.
static std::optional<ParsedToolCalls> parse_mistral_calls(std::string_view answer) {
  constexpr std::string_view kCalls = "[TOOL_CALLS]";
  const size_t at = answer.find(kCalls);
  if (at == std::string_view::npos) return std::nullopt;
  ojson list = ojson::parse(answer.substr(at + kCalls.size()), nullptr, /*allow_exceptions=*/false);
  if (list.is_object()) list = ojson::array({std::move(list)});
  if (!list.is_array() || list.empty()) return std::nullopt;
  ParsedToolCalls out;
  out.content = std::string(rstrip_space(answer.substr(0, at)));
  for (const ojson& call : list) {
    const ojson* name = member(call, "name");
    if (name == nullptr || !name->is_string()) return std::nullopt;
    const ojson* args = member(call, "arguments");
    out.calls.push_back({name->get<std::string>(), args == nullptr     ? std::string("{}")
                                                   : args->is_string() ? args->get<std::string>()
                                                                       : args->dump()});
  }
  return out;
}

// Mistral-Small-3.2's calls: [TOOL_CALLS]NAME([CALL_ID]ID)[ARGS]JSON, one after another (white
// space between at most). The text before the first is content.
static std::optional<ParsedToolCalls> parse_mistral_small_calls(std::string_view answer) {
  constexpr std::string_view kCalls = "[TOOL_CALLS]", kArgs = "[ARGS]";
  size_t at = answer.find(kCalls);
  if (at == std::string_view::npos) return std::nullopt;
  ParsedToolCalls out;
  out.content = std::string(rstrip_space(answer.substr(0, at)));
  while (at != std::string_view::npos) {
    const size_t args = answer.find(kArgs, at);
    if (args == std::string_view::npos) return std::nullopt;
    std::string_view name = answer.substr(at + kCalls.size(), args - at - kCalls.size());
    name = name.substr(0, name.find("[CALL_ID]"));
    const size_t next = answer.find(kCalls, args);
    const ojson value = ojson::parse(
        answer.substr(args + kArgs.size(),
                      next == std::string_view::npos ? next : next - args - kArgs.size()),
        nullptr, /*allow_exceptions=*/false);
    if (py_strip(name).empty() || !value.is_object()) return std::nullopt;
    out.calls.push_back({std::string(py_strip(name)), value.dump()});
    at = next;
  }
  return out;
}

std::optional<ParsedToolCalls> ChatTemplate::parse_tool_calls(std::string_view answer) const {
  if (!supports_tools()) return std::nullopt;
  if (kind_ == Kind::kGlm45) return parse_glm_calls(answer);
  if (kind_ == Kind::kGptOss) return parse_harmony_call(answer);
  if (kind_ == Kind::kDeepseek3) return parse_deepseek3_calls(answer);
  if (kind_ == Kind::kDeepseek4) return parse_dsml_calls(answer);
  if (kind_ == Kind::kMistralNemo) return parse_mistral_calls(answer);
  if (kind_ == Kind::kMistralSmall32) return parse_mistral_small_calls(answer);
  // Qwen3: each block a JSON object {"name", "arguments"}; a last one cut short still counts when
  // its JSON is whole.
  const auto blocks = call_blocks(answer);
  if (!blocks) return std::nullopt;
  ParsedToolCalls out;
  out.content = std::string(rstrip_nl(blocks->before));
  for (const std::string_view text : blocks->bodies) {
    nlohmann::ordered_json call;
    try {
      call = nlohmann::ordered_json::parse(text);
    } catch (const nlohmann::ordered_json::exception&) {
      return std::nullopt;
    }
    if (!call.is_object() || !call.contains("name") || !call["name"].is_string()) {
      return std::nullopt;
    }
    const auto args =
        call.contains("arguments") ? call["arguments"] : nlohmann::ordered_json::object();
    out.calls.push_back({call["name"].get<std::string>(),
                         args.is_string() ? args.get<std::string>() : args.dump()});
  }
  return out;
}

}  // namespace expertd::text
