// When generation stops, apart from max_tokens: the model's end tokens (EOS, EOT, EOM) and the
// caller's stop strings.
//
// StopMatcher sees the decoded text token by token and says what may be shown now. A stop string
// may span several tokens, so text that could be the start of one is held back until the next
// tokens complete it (stop: the text before it is emitted, the stop string and whatever followed
// it in the same token are not) or rule it out (the held text is emitted). Owns a copy of the stop
// strings and two buffers; emitted text is a view into one of them, valid until the next call.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "expertd/result.h"
#include "storage/gguf.h"

namespace expertd::text {

class StopMatcher {
 public:
  struct Step {
    std::string_view emit;  // text now known not to belong to a stop string
    bool stop = false;      // a stop string completed: `emit` is the text before it
  };

  // The error names the option: an empty stop string would stop before the first token.
  static Result<StopMatcher> create(std::vector<std::string> stops);

  // The text of the next token. After a step that stopped, push() is a bug (checked).
  Step push(std::string_view text);
  // Generation ended for another reason: the held text, which no stop string completed.
  std::string_view finish();
  // Bytes held back now: a suffix of the text so far that is a proper prefix of a stop string.
  size_t held() const { return pending_.size(); }
  bool stopped() const { return stopped_; }

 private:
  explicit StopMatcher(std::vector<std::string> stops);

  std::vector<std::string> stops_;
  std::string pending_;  // held back: never contains a whole stop string
  std::string out_;      // what the last call emitted
  bool stopped_ = false;
};

// The tokens that end a turn, from the GGUF's tokenizer.ggml.eos_token_id, eot_token_id and
// eom_token_id, each where present (a negative value, or one past 2^32 - 1, counts as absent).
// Harmony's <|end|> is left out when the vocabulary has <|return|> and <|call|> (gpt-oss): it ends
// a message, not the answer.
struct EndTokens {
  std::optional<uint32_t> eos;
  std::optional<uint32_t> eot;
  std::optional<uint32_t> eom;

  static EndTokens from_gguf(const GgufFile& meta);
  bool contains(uint32_t token) const { return token == eos || token == eot || token == eom; }
};

}  // namespace expertd::text
