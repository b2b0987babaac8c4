// One answer's generation, shared by expert-run and expert-serve (issue 25: one loop, one
// behaviour): the sampler, then each token's text through three stages -- the chat template's
// turn-end strings cut the raw text; the reasoning splitter tells the reasoning from the content;
// the request's stop strings cut the content (so a stop string the model writes while it reasons
// does not end the answer before it is given). The caller owns the engine: it feeds the token
// advance() returns and calls advance() again with that step's logits.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "expertd/result.h"
#include "text/json_constraint.h"
#include "text/reasoning.h"
#include "text/sampler.h"
#include "text/stop.h"

namespace expertd::text {

struct GenerationOptions {
  SamplerOptions sampling;
  std::vector<std::string> end_strings;  // the chat template's turn ends: cut the raw text
  std::vector<std::string> stops;        // the request's stop strings: cut the content
  ReasoningSyntax reasoning = ReasoningSyntax::kNone;  // kNone: every byte is content
  bool starts_in_reasoning = false;                    // the prompt opened a <think> block
  uint32_t max_tokens = 16;
  bool stop_at_end_token = true;  // false: an end token is generated like any other (ignore_eos)
  // Log probabilities of each sampled token and its `logprobs` most likely alternatives, from the
  // model's logits (log-softmax, before temperature and penalties, as OpenAI reports them);
  // -1: none.
  int32_t logprobs = -1;
  // Structured output (response_format): every token whose bytes would leave JSON of this schema
  // is masked before sampling, end tokens (and tokens holding an end string) until the value is
  // whole; the answer ends when the value closes. Null: free text.
  std::shared_ptr<const JsonSchema> json_schema;
};

// One sampled token's log probability and the most likely alternatives at its step.
struct TokenLogprob {
  uint32_t token = 0;
  double logprob = 0.0;
  std::vector<std::pair<uint32_t, double>> top;  // most likely first
};

class Generation {
 public:
  // `token_text` gives one token's bytes (the model's tokenizer); without it (a model with no
  // vocabulary) there is no text and no end or stop string may be given. The prompt's ids start
  // the repetition penalty's window. Errors: options the sampler refuses, an empty stop string.
  static Result<std::unique_ptr<Generation>> create(const GenerationOptions& options,
                                                    uint32_t n_vocab,
                                                    std::function<std::string(uint32_t)> token_text,
                                                    EndTokens end_tokens,
                                                    std::span<const uint32_t> prompt);

  // Samples the next token from a step's logits and passes its text through the stages; the
  // token to feed next, or nothing when the answer is complete (an end token, an end or stop
  // string, max_tokens).
  std::optional<uint32_t> advance(std::span<const float> logits);
  // Releases what the stages held back (text no end string completed, the splitter's unfinished
  // tag, a prefix of a stop string). Call once, after advance() returned nothing or the caller
  // stopped early.
  void finish();

  // What the last advance() or finish() added: the raw text (after the end strings), and its
  // reasoning and content (after the stop strings).
  std::string_view raw_delta() const { return raw_; }
  std::string_view reasoning_delta() const { return reasoning_; }
  std::string_view content_delta() const { return content_; }
  // With GenerationOptions::logprobs >= 0: the last advance()'s token, unless it was an end token
  // that ended the answer (it is not part of the text).
  const std::optional<TokenLogprob>& last_logprob() const { return logprob_; }
  // The ids sampled so far (an end token that ended the answer included).
  const std::vector<uint32_t>& tokens() const { return tokens_; }
  uint32_t generated() const { return static_cast<uint32_t>(tokens_.size()); }
  // "eos", "stop" (an end or stop string) or "max_tokens" once complete; "" before.
  const char* stop_reason() const { return stop_reason_; }
  // OpenAI's finish_reason: "stop" (an end token or string) or "length".
  const char* finish_reason() const;

 private:
  Generation(const GenerationOptions& options, uint32_t n_vocab,
             std::function<std::string(uint32_t)> token_text, EndTokens end_tokens,
             StopMatcher ends, StopMatcher stops);
  void through(ReasoningSplitter::Step s);

  GenerationOptions opts_;
  std::function<std::string(uint32_t)> token_text_;
  EndTokens end_tokens_;
  StopMatcher ends_;
  StopMatcher stops_;
  ReasoningSplitter splitter_;
  Sampler sampler_;
  std::vector<uint32_t> tokens_;
  std::string raw_, reasoning_, content_;
  bool stopped_ = false;  // a stop string completed: nothing more reaches the content
  std::optional<TokenLogprob> logprob_;
  std::vector<double> lsm_;      // log-softmax of a step's logits
  std::vector<uint32_t> order_;  // token ids for the top alternatives
  const char* stop_reason_ = "";
  // With json_schema: the recognizer, every token's bytes, which tokens end the answer, and a
  // step's masked logits.
  std::optional<JsonConstraint> constraint_;
  std::vector<std::string> texts_;
  std::vector<uint8_t> ends_answer_;
  std::vector<float> masked_;
};

}  // namespace expertd::text
