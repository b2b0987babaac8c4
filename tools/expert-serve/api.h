// The OpenAI API's request fields as expert-serve reads them, and its response and error bodies.
// Reading is strict about types (a wrong type is a 400 naming the field) and lenient about fields
// it does not know (ignored, as most OpenAI-compatible servers do); fields it knows but cannot
// honour (n > 1, logprobs, ...) are refused rather than silently dropped.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "text/chat_template.h"
#include "text/json_constraint.h"
#include "text/sampler.h"

namespace expertd::serve {

// An answer other than 200, with OpenAI's error body.
struct ApiError {
  int status = 400;
  std::string message;
  std::string param;  // the request field at fault ("" = null)
  std::string type = "invalid_request_error";
  std::string code;  // "" = null
};

nlohmann::json error_body(const ApiError& e);

struct Message {
  std::string role;  // system (developer), user, assistant, tool
  std::string content;
  std::vector<text::ChatToolCall> tool_calls;  // assistant (with their ids, "" when not given)
  std::string tool_call_id;                    // tool ("" when not given)
};

// A function the model may call (tools[i].function).
struct Tool {
  std::string name;
  std::string parameters;  // its JSON Schema's text ("" when absent)
};

enum class ToolChoice { kNone, kAuto, kRequired, kNamed };

// One request to /v1/completions or /v1/chat/completions, checked field by field.
struct Request {
  bool chat = false;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  // Completions: the prompt as text, or as token ids (prompt_ids_given).
  std::string prompt_text;
  std::vector<uint32_t> prompt_ids;
  bool prompt_ids_given = false;
  std::vector<Message> messages;  // chat
  text::SamplerOptions sampling;
  std::vector<std::string> stops;
  std::optional<uint64_t> max_tokens;  // absent: completions 16, chat the rest of the context
  bool ignore_eos = false;             // an extension (vLLM's): generate past the end token
  // Log probabilities: -1 none, else each token's and this many alternatives (chat: logprobs
  // true and top_logprobs; completions: logprobs N).
  int32_t logprobs = -1;
  uint32_t n = 1;  // choices, each generated on its own sequence
  // Chat, an extension (llama.cpp's): "auto" or "deepseek" give the reasoning apart as
  // reasoning_content, "none" the raw text as content; "" = the server's --reasoning-format.
  std::string reasoning_format;
  // Chat: the thinking switches, from chat_template_kwargs (vLLM's and llama.cpp's:
  // enable_thinking, thinking, reasoning_effort; other keys ignored) and reasoning_effort
  // (OpenAI's); set ones override the server's --chat-template-kwargs / --reasoning-effort.
  text::ChatOptions chat_options;
  // response_format: json_object (any object) or json_schema (compiled); null: text.
  std::shared_ptr<const text::JsonSchema> json_schema;
  // Chat: tools, tool_choice (default auto with tools, none without; kNamed: tool_choice_name)
  // and parallel_tool_calls.
  std::vector<Tool> tools;
  ToolChoice tool_choice = ToolChoice::kNone;
  std::string tool_choice_name;
  bool parallel_tool_calls = true;
};

// The most alternatives top_logprobs (chat) or logprobs (completions) may ask for (OpenAI's 20).
inline constexpr int64_t kMaxTopLogprobs = 20;
// The most choices (n) one request may ask for.
inline constexpr int64_t kMaxChoices = 16;

// The values reasoning_format takes, as the error message lists them.
inline constexpr const char* kReasoningFormats = "auto, deepseek, none";

// Reads `body` (already parsed JSON) into `out`. `model` is the served model's name: another name
// is a 404. `n_vocab` bounds token-id prompts.
std::optional<ApiError> read_request(const nlohmann::json& body, bool chat,
                                     const std::string& model, uint32_t n_vocab, Request& out);

// The bytes of `text` that can be sent now: all but a trailing UTF-8 sequence that the next
// token may complete. Bytes that can never be valid are sent (and shown as U+FFFD).
size_t utf8_ready(std::string_view text);

// JSON text with invalid UTF-8 replaced by U+FFFD (as expert-run --json writes text).
std::string dump(const nlohmann::json& j);

}  // namespace expertd::serve
