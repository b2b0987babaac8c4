// Chat templates: the text a model was trained to see around each turn of a conversation.
//
// A GGUF's tokenizer.chat_template is a Jinja program. No C++ Jinja engine is packaged here
// (Debian 12 has none of jinja2cpp/inja/minja), so instead of interpreting the program this module
// recognises the known families by fragments of their vendor templates and reproduces what those
// templates render for conversations of system/user/assistant messages with string content:
// ChatML, Qwen3, Qwen2.5, DeepSeek-V3.1, DeepSeek-V4, Mistral/Mixtral (v0.1, the Mixtral-8x7B
// form, Mistral-Nemo, and Mistral-Small-3.2 with today's date), Llama 3, Llama 3.1/3.3,
// GLM-4.5/4.6, gpt-oss (harmony, today's date) and Kimi-K2, with the thinking switches their
// templates read (ChatOptions: the chat_template_kwargs of vLLM and llama.cpp's server) or each
// template's default where none is given. Tools, assistant tool calls and tool results too for
// Qwen3, GLM-4.5, gpt-oss, DeepSeek-V3.1/V4, Mistral-Nemo and Mistral-Small-3.2
// (tests/fixtures/chat-tools/, tools/reference/make_tool_fixtures.py).
// Anything else is refused, naming the template's first line, rather than rendered as a look-alike
// family: a wrong template gives plausible but degraded answers that nobody notices.
// tests/fixtures/chat/ holds transformers' renderings (tools/reference/make_chat_fixtures.py) that
// the output must equal.
//
// Immutable after construction; render() is const and may run on several threads at once.
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "expertd/result.h"
#include "storage/gguf.h"

namespace expertd::text {

class Tokenizer;

// One function call of an assistant turn: the function's name and its arguments as JSON text
// (OpenAI's API carries them as a string; the template writes them as they are).
struct ChatToolCall {
  std::string name;
  std::string arguments;
  std::string id;  // "" when not given; Mistral's templates write it
};

struct ChatMessage {
  std::string role;  // system | user | assistant | tool (a tool's result)
  std::string content;
  std::vector<ChatToolCall> tool_calls;  // assistant
  std::string tool_call_id;              // tool: the call it answers (Mistral's templates write it)
};

// A JSON value's text as the templates' `tojson` writes it (transformers': Python's json.dumps
// with ensure_ascii=False: ", " and ": " separators, keys in the order given, non-ASCII kept).
// `json_text` must keep its keys' order, so parse it with an order-keeping parser. Errors: not
// JSON.
Result<std::string> template_json(std::string_view json_text);

// What a model's answer says, split into its text and its tool calls (parse_tool_calls).
struct ParsedToolCalls {
  std::string content;  // the text before the first call
  std::vector<ChatToolCall> calls;
};

// The switches a template reads besides the messages (transformers' apply_chat_template keyword
// arguments, vLLM's and llama.cpp's chat_template_kwargs); unset, the template's default. Each is
// spelled as the templates spell it, and a family whose template does not read one ignores it, as
// the template would (ChatTemplate::ignored names them):
//  - enable_thinking: Qwen3 (false: the generation prompt closes an empty <think> block), GLM-4.5
//    (false: "/nothink" after each user message, an empty block after the generation prompt),
//    DeepSeek-V3.1/V4 (when `thinking` is unset; their default is off).
//  - thinking: DeepSeek-V3.1/V4's own name for it (true: the generation prompt opens <think>).
//  - reasoning_effort: gpt-oss's system message "Reasoning: <effort>" (default medium);
//    DeepSeek-V4-Flash's "high", when thinking, a preamble before the system prompt.
struct ChatOptions {
  std::optional<bool> enable_thinking;
  std::optional<bool> thinking;
  std::string reasoning_effort;  // low | medium | high; "" = the template's default

  // This one with the switches `over` sets replaced (a request's over a server's defaults).
  ChatOptions overridden_by(const ChatOptions& over) const;
  bool empty() const { return !enable_thinking && !thinking && reasoning_effort.empty(); }
};

// Reads the switches ChatOptions knows from `kwargs_json`, a chat_template_kwargs object's JSON
// text, into `out` (set ones replace out's); other keys are ignored, as vLLM ignores them. `where`
// names the object in errors: "chat_template_kwargs.enable_thinking must be a boolean, got a string
// (\"no\")". Errors: EINVAL, not JSON or not an object, a known key of the wrong type or value
// (null counts as unset); `param`, when given, is set to the field at fault ("" for the object).
Status read_chat_template_kwargs(std::string_view kwargs_json, std::string_view where,
                                 ChatOptions& out, std::string* param = nullptr);
// The command-line switches of expert-run and expert-serve: --chat-template-kwargs (JSON, read as
// above; empty: none) and --reasoning-effort (empty: none) into `out`. Errors name the flag; both
// giving a reasoning effort must agree.
Status read_chat_flags(std::string_view kwargs_json, std::string_view reasoning_effort,
                       ChatOptions& out);
// The reasoning_effort values the templates are given (OpenAI's): "low", "medium", "high".
bool valid_reasoning_effort(std::string_view effort);
inline constexpr const char* kReasoningEfforts = "low, medium, high";

class ChatTemplate {
 public:
  // From the GGUF's tokenizer.chat_template; a file without one gets ChatML (what llama.cpp does),
  // and family() says "chatml (default: the model has no tokenizer.chat_template)". BOS/EOS texts
  // come from the tokenizer.
  static Result<ChatTemplate> from_gguf(const GgufFile& file, const Tokenizer& tok);
  // From template text (a .jinja file's contents) or a family name ("chatml", "qwen3", "deepseek3",
  // "deepseek4", "mistral", "mistral-nemo", "mistral-small-3.2", "llama3", "glm4.5", "gpt-oss",
  // "kimi-k2"). An unknown
  // template: EINVAL, message "chat template not supported (first line: '...'); known:
  // ChatML/Qwen3, DeepSeek-V3/V4, Mistral/Mixtral/Nemo, Llama 3, GLM-4.5/4.6, gpt-oss, Kimi-K2".
  static Result<ChatTemplate> from_text(std::string_view jinja, std::string bos, std::string eos);
  static Result<ChatTemplate> named(std::string_view family, std::string bos, std::string eos);
  // The names named() accepts, "chatml, qwen3, ..." (for --help and errors).
  static std::string names();
  // A --chat-template flag's value: a .jinja file when one exists at that path, else a family name;
  // empty, the model's own template (from_gguf). Errors name the flag and the value.
  static Result<ChatTemplate> from_flag(const std::string& flag, const GgufFile& file,
                                        const Tokenizer& tok);

  // The prompt text (to be encoded with add_special=false, as transformers' apply_chat_template
  // does); add_generation_prompt opens the assistant's turn. Errors: no messages, an unknown role,
  // a conversation the family's template itself rejects (e.g. Mistral's alternation rule) with the
  // template's message. `options`: the thinking switches, as the family's template reads them.
  // `tools`: the request's tool definitions, each as template_json() writes it; a family whose
  // template has no tool syntax here refuses tools, tool calls and tool messages (EINVAL, naming
  // the family).
  Result<std::string> render(std::span<const ChatMessage> messages, bool add_generation_prompt,
                             const ChatOptions& options = {},
                             std::span<const std::string> tools = {}) const;
  // Whether this family's template renders tools and their results (Qwen3, GLM-4.5, gpt-oss,
  // DeepSeek-V3.1/V4, Mistral-Nemo, Mistral-Small-3.2).
  bool supports_tools() const;
  // How a forced call of `name` ("": of any of the tools) is written so that it can be
  // constrained: the text that opens it after the generation prompt, and what JSON follows. Qwen3:
  // "<tool_call>\n" (Mistral-Nemo: "[TOOL_CALLS]["), then {"name", "arguments"}; gpt-oss and
  // DeepSeek-V3.1 (and Mistral-Small-3.2: "[TOOL_CALLS]NAME[ARGS]"): the named function's
  // header, then its arguments. nullopt where the calls are not JSON (GLM-4.5's key/value tags,
  // DeepSeek-V4's DSML parameters), the name is written outside the JSON and none is given, or
  // there is no tool support.
  struct ForcedCall {
    std::string opening;
    bool arguments_only = false;  // the JSON is the arguments; else {"name", "arguments"}
  };
  std::optional<ForcedCall> forced_call(std::string_view name) const;
  // The texts at which a call may begin in the answer's content (Qwen3's "<tool_call>"; gpt-oss's
  // "<|start|>", "<|channel|>" and " to=functions." of a header the reasoning splitter leaves in
  // the content). Empty without tool support.
  std::span<const std::string_view> tool_call_markers() const;
  // A stream's content while it looks for calls: of `pending` (content not sent yet), the first
  // `ready` bytes can go out; the rest is held, from the first marker (`call` true: held to the
  // answer's end, where parse_tool_calls says whether it is one) or, without one, the end that may
  // be opening a marker, and the white space before either (which the parsers drop before a
  // call). `done`: the answer is over, and nothing is held for a marker to come.
  struct CallHold {
    size_t ready = 0;
    bool call = false;
  };
  CallHold hold_for_calls(std::string_view pending, bool done) const;
  // The tool calls in a model's answer, in this family's syntax (Qwen3: <tool_call>{"name",
  // "arguments"}</tool_call> blocks; GLM-4.5: <tool_call>NAME with <arg_key>/<arg_value> pairs;
  // gpt-oss: a commentary message to=functions.NAME, as the reasoning splitter leaves it in the
  // content; DeepSeek-V3.1: <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>JSON; DeepSeek-V4: DSML invoke
  // and parameter tags; Mistral-Nemo: [TOOL_CALLS] and a JSON list of {"name", "arguments", "id"};
  // Mistral-Small-3.2: [TOOL_CALLS]NAME[ARGS]JSON each, maybe [CALL_ID]ID before [ARGS]): nullopt
  // when there are none or one is malformed (the answer is then text).
  // Arguments come back as compact JSON text.
  std::optional<ParsedToolCalls> parse_tool_calls(std::string_view answer) const;
  // Mistral's templates take call ids (tool_calls[].id, a tool message's tool_call_id) of
  // exactly 9 characters and refuse others; OpenAI's and this server's are longer. Those keep
  // their last 9 here, as vLLM cuts them (the same id, given back, is cut the same); other
  // families write no ids and keep them as they are.
  void fit_call_ids(std::span<ChatMessage> messages) const;
  // The switches `options` sets that this family's template does not read (render ignores them):
  // "enable_thinking", "thinking", "reasoning_effort", for a log line.
  std::vector<std::string> ignored(const ChatOptions& options) const;
  const std::string& family() const { return family_; }
  // Texts that end an assistant turn (e.g. "<|im_end|>"), for stop handling when they are not
  // single end tokens.
  const std::vector<std::string>& stop_strings() const { return stop_strings_; }
  const std::string& bos() const { return bos_; }
  const std::string& eos() const { return eos_; }

  // The families named() accepts, and from_text() detects (family() names the variant, e.g.
  // "llama3.1", "qwen2.5", "mistral-v0.1").
  enum class Kind {
    kChatml,
    kQwen3,
    kQwen25,
    kDeepseek3,
    kDeepseek4,
    kMistral,
    kMistralV01,
    kMistralNemo,
    kMistralSmall32,
    kLlama3,
    kLlama31,
    kGlm45,
    kGptOss,
    kKimiK2,
    kKimiK2Helpful,
  };
  Kind kind() const { return kind_; }

  // The same template with strftime_now's date fixed ("2026-01-15"), for templates that write
  // today's date (gpt-oss's "Current date: ...", Mistral-Small-3.2's system prompt); by default
  // render() takes the local date at the
  // time of the call, as transformers' strftime_now does.
  ChatTemplate with_date(std::string date) const;

 private:
  ChatTemplate(Kind kind, std::string family, std::string bos, std::string eos);

  Kind kind_;
  std::string family_;
  std::string bos_;
  std::string eos_;
  std::vector<std::string> stop_strings_;
  std::string date_;  // empty: today's
  // DeepSeek-V4-Flash's template: reasoning_effort "high", when thinking, writes a preamble.
  bool high_effort_preamble_ = false;
};

}  // namespace expertd::text
