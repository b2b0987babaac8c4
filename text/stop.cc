#include "text/stop.h"

#include <algorithm>

#include "base/check.h"

namespace expertd::text {

Result<StopMatcher> StopMatcher::create(std::vector<std::string> stops) {
  for (const std::string& s : stops) {
    if (s.empty()) return make_error(EINVAL, "stop: a stop string must not be empty");
  }
  return StopMatcher(std::move(stops));
}

StopMatcher::StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {
  size_t longest = 0;
  for (const std::string& s : stops_) longest = std::max(longest, s.size());
  pending_.reserve(longest + 64);
  out_.reserve(longest + 64);
}

StopMatcher::Step StopMatcher::push(std::string_view text) {
  EXPERTD_CHECK(!stopped_);
  pending_.append(text);
  // The earliest stop string in the text not yet emitted. The held part contains none whole, so
  // any match ends in the new text: this is the first time it can be seen.
  size_t cut = std::string::npos;
  for (const std::string& s : stops_) cut = std::min(cut, pending_.find(s));
  if (cut != std::string::npos) {
    out_.assign(pending_, 0, cut);
    pending_.clear();
    stopped_ = true;
    return Step{out_, true};
  }
  // Hold back the longest suffix that is a proper prefix of some stop string.
  size_t hold = 0;
  for (const std::string& s : stops_) {
    for (size_t k = std::min(s.size() - 1, pending_.size()); k > hold; --k) {
      if (std::string_view(pending_).substr(pending_.size() - k) ==
          std::string_view(s).substr(0, k)) {
        hold = k;
        break;
      }
    }
  }
  const size_t ready = pending_.size() - hold;
  out_.assign(pending_, 0, ready);
  pending_.erase(0, ready);
  return Step{out_, false};
}

std::string_view StopMatcher::finish() {
  out_.swap(pending_);
  pending_.clear();
  return out_;
}

EndTokens EndTokens::from_gguf(const GgufFile& meta) {
  auto id = [&](const char* key) -> std::optional<uint32_t> {
    const GgufValue* v = meta.find(key);
    const std::optional<uint64_t> u = v != nullptr ? v->as_u64() : std::nullopt;
    if (!u || *u > UINT32_MAX) return std::nullopt;
    return static_cast<uint32_t>(*u);
  };
  EndTokens t{id("tokenizer.ggml.eos_token_id"), id("tokenizer.ggml.eot_token_id"),
              id("tokenizer.ggml.eom_token_id")};
  // Harmony (gpt-oss): <|end|> closes one message (the analysis before the final answer), the
  // answer ends at <|return|> or <|call|>. A GGUF that names <|end|> as an end token would stop
  // generation after the reasoning; as llama.cpp does, a vocabulary with <|return|> and <|call|>
  // does not end generation at <|end|>.
  const GgufValue* tokens = meta.find("tokenizer.ggml.tokens");
  const GgufArray* arr = tokens != nullptr ? tokens->as_array() : nullptr;
  if (arr == nullptr || arr->elem_type != GgufValueType::STRING) return t;
  auto piece = [&](std::optional<uint32_t> token) {
    return token && *token < arr->count ? arr->string_at(*token) : std::string_view();
  };
  if (piece(t.eos) != "<|end|>" && piece(t.eot) != "<|end|>" && piece(t.eom) != "<|end|>") {
    return t;
  }
  bool has_return = false;
  bool has_call = false;
  for (uint64_t i = 0; i < arr->count; ++i) {
    const std::string_view p = arr->string_at(i);
    has_return = has_return || p == "<|return|>";
    has_call = has_call || p == "<|call|>";
  }
  if (!has_return || !has_call) return t;
  for (std::optional<uint32_t>* e : {&t.eos, &t.eot, &t.eom}) {
    if (piece(*e) == "<|end|>") e->reset();
  }
  return t;
}

}  // namespace expertd::text
