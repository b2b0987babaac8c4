// Chat templates: the text a model was trained to see around each turn of a conversation.
//
// A GGUF's tokenizer.chat_template is a Jinja program. No C++ Jinja engine is packaged here
// (Debian 12 has none of jinja2cpp/inja/minja), so instead of interpreting the program this module
// recognises the known families by fragments of their vendor templates and reproduces what those
// templates render for plain conversations (system/user/assistant messages with string content; no
// tools, each template's default thinking mode): ChatML, Qwen3, Qwen2.5, DeepSeek-V3.1,
// DeepSeek-V4, Mistral/Mixtral (v0.1 and the Mixtral-8x7B form), Llama 3, Llama 3.1/3.3,
// GLM-4.5/4.6 (thinking on), gpt-oss (harmony, reasoning medium, today's date) and Kimi-K2.
// Anything else is refused, naming the template's first line, rather than rendered as a look-alike
// family: a wrong template gives plausible but degraded answers that nobody notices.
// tests/fixtures/chat/ holds transformers' renderings (tools/reference/make_chat_fixtures.py) that
// the output must equal.
//
// Immutable after construction; render() is const and may run on several threads at once.
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "expertd/result.h"
#include "storage/gguf.h"

namespace expertd::engine {

class Tokenizer;

struct ChatMessage {
  std::string role;  // system | user | assistant
  std::string content;
};

class ChatTemplate {
 public:
  // From the GGUF's tokenizer.chat_template; a file without one gets ChatML (what llama.cpp does),
  // and family() says "chatml (default: the model has no tokenizer.chat_template)". BOS/EOS texts
  // come from the tokenizer.
  static Result<ChatTemplate> from_gguf(const GgufFile& file, const Tokenizer& tok);
  // From template text (a .jinja file's contents) or a family name ("chatml", "qwen3", "deepseek3",
  // "deepseek4", "mistral", "llama3", "glm4.5", "gpt-oss", "kimi-k2"). An unknown template:
  // EINVAL, message "chat template not supported (first line: '...'); known: ChatML/Qwen3,
  // DeepSeek-V3/V4, Mistral/Mixtral, Llama 3, GLM-4.5/4.6, gpt-oss, Kimi-K2".
  static Result<ChatTemplate> from_text(std::string_view jinja, std::string bos, std::string eos);
  static Result<ChatTemplate> named(std::string_view family, std::string bos, std::string eos);
  // A --chat-template flag's value: a .jinja file when one exists at that path, else a family name;
  // empty, the model's own template (from_gguf). Errors name the flag and the value.
  static Result<ChatTemplate> from_flag(const std::string& flag, const GgufFile& file,
                                        const Tokenizer& tok);

  // The prompt text (to be encoded with add_special=false, as transformers' apply_chat_template
  // does); add_generation_prompt opens the assistant's turn. Errors: no messages, an unknown role,
  // a conversation the family's template itself rejects (e.g. Mistral's alternation rule) with the
  // template's message.
  Result<std::string> render(std::span<const ChatMessage> messages,
                             bool add_generation_prompt) const;
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
    kLlama3,
    kLlama31,
    kGlm45,
    kGptOss,
    kKimiK2,
    kKimiK2Helpful,
  };
  Kind kind() const { return kind_; }

  // The same template with strftime_now's date fixed ("2026-01-15"), for templates that write
  // today's date (gpt-oss's "Current date: ..."); by default render() takes the local date at the
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
};

}  // namespace expertd::engine
