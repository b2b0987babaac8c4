// Reasoning models write their thinking before the answer, in the same token stream. An
// OpenAI-compatible chat answer carries the two apart (DeepSeek's and vLLM's `reasoning_content`
// next to `content`); ReasoningSplitter tells them apart as the text arrives, token by token.
//
// Two syntaxes, chosen by the chat template's family (reasoning_syntax):
//  - kThink (Qwen3, GLM-4.5, DeepSeek-V3.1/V4): an answer may open with "<think>" (after white
//    space); the text up to "</think>" is reasoning, the rest content. A prompt that ends inside an
//    open <think> block (a template that opens it for the model) starts in the reasoning. White
//    space around the block (after <think>, before and after </think>) is dropped, as the
//    templates drop it when they render the turn again (Qwen3's strip('\n'), GLM's strip()) and as
//    llama.cpp's server does. Only the first block is reasoning: later tags are content.
//  - kHarmony (gpt-oss): the answer is a sequence of messages after the prompt's
//    "<|start|>assistant": "<|channel|>NAME<|message|>BODY<|end|>", the next one opening with
//    "<|start|>assistant", the last ending with <|return|> (or <|call|>). Channel analysis is
//    reasoning; final, and commentary without a recipient (a preamble), are content.
//
// Nothing the model writes is lost: text that does not parse as the syntax (a header that is not
// an assistant's channel header, a tool call's " to=" recipient, text before the first header)
// goes to content verbatim, tags and all, from there to the end. Dropped are only the tags that
// were parsed and, for kThink, the white space around the block. The splitter works on bytes:
// tags are ASCII, so a multi-byte character is never cut by it (the caller holds an incomplete
// one back, as before).
//
// Owns a buffer of held-back bytes (at most a tag or a message header long, kMaxHeld) and the
// output of the last call; a Step's views are valid until the next call.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "text/chat_template.h"

namespace expertd::text {

enum class ReasoningSyntax { kNone, kThink, kHarmony };

// How `kind`'s answers carry reasoning: kThink for Qwen3, GLM-4.5, DeepSeek-V3.1 and V4 (their
// templates have thinking modes), kHarmony for gpt-oss, kNone for the rest (Kimi-K2's recognised
// templates are the non-thinking Instruct ones).
ReasoningSyntax reasoning_syntax(ChatTemplate::Kind kind);
const char* reasoning_syntax_name(ReasoningSyntax syntax);

// Whether `prompt` ends inside an open <think> block (only white space after its last "<think>"):
// the answer then starts in the reasoning.
bool prompt_opens_think(std::string_view prompt);
// Whether `prompt` ends just after a closed block ("</think>" and only white space after it): the
// template turned thinking off (Qwen3's and GLM's enable_thinking false, DeepSeek's default) and
// the answer is content from its first byte, a "<think>" in it included.
bool prompt_closes_think(std::string_view prompt);
// How the answer to a `kind` template's `prompt` carries reasoning: reasoning_syntax(kind), but
// kNone when the prompt closed the think block itself (prompt_closes_think).
ReasoningSyntax answer_reasoning_syntax(ChatTemplate::Kind kind, std::string_view prompt);

class ReasoningSplitter {
 public:
  struct Step {
    std::string_view reasoning;
    std::string_view content;
  };
  // Bytes held back at most while a header or the white space before <think> is read: past it,
  // the text is not the syntax and goes to content.
  static constexpr size_t kMaxHeld = 256;

  // kNone passes everything to content. `in_reasoning` (kThink): the prompt opened the block.
  ReasoningSplitter(ReasoningSyntax syntax, bool in_reasoning);

  // The next piece of the answer; what can be told apart now. Within one step the reasoning, when
  // both are non-empty, came first, except for a harmony commentary preamble before an analysis
  // message in the same piece.
  Step push(std::string_view text);
  // The answer ended: what was held back, as what it was read as (an unfinished header or tag is
  // content verbatim; held white space of an unclosed <think> block is reasoning).
  Step finish();

 private:
  enum class State {
    kOpening,   // kThink: the answer's start; white space and a prefix of "<think>" are held
    kThinking,  // kThink: inside the block
    kAnswer,    // kThink: after </think>, or an answer without a block (passes through)
    kHeader,    // kHarmony: a message header is read, up to <|message|>
    kBody,      // kHarmony: a message's body, up to <|end|>, <|return|> or <|call|>
    kRaw,       // everything to content as it is
  };

  void run();  // consumes held_ as far as the state allows
  void think_opening();
  void think_body();
  void answer_start();
  void harmony_header();
  void harmony_body();
  void to_raw();  // held_ is not the syntax: content from here on

  State state_;
  bool strip_ = false;           // drop white space at the start of the current part (kThink)
  bool after_end_ = false;       // kHeader: a "<|start|>assistant" comes first (after <|end|>)
  bool body_reasoning_ = false;  // kBody: the message is analysis
  bool finishing_ = false;
  std::string held_;
  std::string reasoning_;
  std::string content_;
};

}  // namespace expertd::text
