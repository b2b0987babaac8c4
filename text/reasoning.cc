#include "text/reasoning.h"

#include <algorithm>
#include <array>

namespace expertd::text {
namespace {

constexpr std::string_view kThinkOpen = "<think>";
constexpr std::string_view kThinkClose = "</think>";
constexpr std::string_view kStartAssistant = "<|start|>assistant";
constexpr std::string_view kChannel = "<|channel|>";
constexpr std::string_view kMessage = "<|message|>";
constexpr std::string_view kEnd = "<|end|>";
// <|return|> and <|call|> end the answer; the chat template's stop strings stop generation there,
// so they arrive only when the splitter is used without them.
constexpr std::array<std::string_view, 3> kBodyEnds = {kEnd, "<|return|>", "<|call|>"};

bool space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

size_t leading_space(std::string_view s) {
  size_t i = 0;
  while (i < s.size() && space(s[i])) ++i;
  return i;
}

// The longest suffix of `s` that is a proper prefix of `tag`: what the next piece may complete.
size_t partial_tag(std::string_view s, std::string_view tag) {
  for (size_t k = std::min(tag.size() - 1, s.size()); k > 0; --k) {
    if (s.substr(s.size() - k) == tag.substr(0, k)) return k;
  }
  return 0;
}

// `s` is `whole` cut short, or starts with it: as far as it goes, it agrees.
bool agrees(std::string_view s, std::string_view whole) {
  const size_t n = std::min(s.size(), whole.size());
  return s.substr(0, n) == whole.substr(0, n);
}

}  // namespace

ReasoningSyntax reasoning_syntax(ChatTemplate::Kind kind) {
  using K = ChatTemplate::Kind;
  switch (kind) {
    case K::kQwen3:
    case K::kGlm45:
    case K::kDeepseek3:
    case K::kDeepseek4:
      return ReasoningSyntax::kThink;
    case K::kGptOss:
      return ReasoningSyntax::kHarmony;
    case K::kChatml:
    case K::kQwen25:
    case K::kMistral:
    case K::kMistralV01:
    case K::kMistralNemo:
    case K::kMistralSmall32:
    case K::kLlama3:
    case K::kLlama31:
    case K::kKimiK2:
    case K::kKimiK2Helpful:
      return ReasoningSyntax::kNone;
  }
  return ReasoningSyntax::kNone;
}

const char* reasoning_syntax_name(ReasoningSyntax syntax) {
  switch (syntax) {
    case ReasoningSyntax::kThink:
      return "<think>";
    case ReasoningSyntax::kHarmony:
      return "harmony";
    case ReasoningSyntax::kNone:
      break;
  }
  return "none";
}

bool prompt_opens_think(std::string_view prompt) {
  const size_t at = prompt.rfind(kThinkOpen);
  if (at == std::string_view::npos) return false;
  const std::string_view rest = prompt.substr(at + kThinkOpen.size());
  return leading_space(rest) == rest.size();
}

bool prompt_closes_think(std::string_view prompt) {
  const size_t at = prompt.rfind(kThinkClose);
  if (at == std::string_view::npos) return false;
  const std::string_view rest = prompt.substr(at + kThinkClose.size());
  return leading_space(rest) == rest.size();
}

ReasoningSyntax answer_reasoning_syntax(ChatTemplate::Kind kind, std::string_view prompt) {
  const ReasoningSyntax syntax = reasoning_syntax(kind);
  if (syntax == ReasoningSyntax::kThink && prompt_closes_think(prompt))
    return ReasoningSyntax::kNone;
  return syntax;
}

ReasoningSplitter::ReasoningSplitter(ReasoningSyntax syntax, bool in_reasoning) {
  switch (syntax) {
    case ReasoningSyntax::kThink:
      state_ = in_reasoning ? State::kThinking : State::kOpening;
      strip_ = in_reasoning;
      break;
    case ReasoningSyntax::kHarmony:
      state_ = State::kHeader;  // the prompt ends with <|start|>assistant
      break;
    case ReasoningSyntax::kNone:
      state_ = State::kRaw;
      break;
  }
  held_.reserve(kMaxHeld + 64);
}

ReasoningSplitter::Step ReasoningSplitter::push(std::string_view text) {
  reasoning_.clear();
  content_.clear();
  held_.append(text);
  run();
  return Step{reasoning_, content_};
}

ReasoningSplitter::Step ReasoningSplitter::finish() {
  reasoning_.clear();
  content_.clear();
  finishing_ = true;
  run();
  content_.append(held_);  // every state lets go of its bytes when finishing: none are left
  held_.clear();
  return Step{reasoning_, content_};
}

void ReasoningSplitter::run() {
  // Each handler consumes what it can; a state change goes round again with the rest.
  for (;;) {
    const State before = state_;
    switch (state_) {
      case State::kOpening:
        think_opening();
        break;
      case State::kThinking:
        think_body();
        break;
      case State::kAnswer:
        answer_start();
        break;
      case State::kHeader:
        harmony_header();
        break;
      case State::kBody:
        harmony_body();
        break;
      case State::kRaw:
        content_.append(held_);
        held_.clear();
        break;
    }
    if (state_ == before) return;
  }
}

void ReasoningSplitter::to_raw() {
  content_.append(held_);
  held_.clear();
  state_ = State::kRaw;
}

void ReasoningSplitter::think_opening() {
  // The rules depend on the text only, not on how it was cut into pieces: more than kMaxHeld
  // bytes of white space first is not an opening; neither is an answer that ends on white space
  // or half a tag.
  const size_t ws = leading_space(held_);
  if (ws > kMaxHeld) return to_raw();
  const std::string_view rest = std::string_view(held_).substr(ws);
  if (rest.starts_with(kThinkOpen)) {
    held_.erase(0, ws + kThinkOpen.size());
    state_ = State::kThinking;
    strip_ = true;
    return;
  }
  if (agrees(rest, kThinkOpen)) {
    if (finishing_) to_raw();
    return;  // a shorter piece than the tag: wait for the next
  }
  state_ = State::kAnswer;  // no block: the answer passes through from its first byte
  strip_ = false;
}

void ReasoningSplitter::think_body() {
  if (strip_) {
    held_.erase(0, leading_space(held_));
    if (held_.empty()) return;
    strip_ = false;
  }
  // The white space before </think> is dropped, up to kMaxHeld bytes of it: that much is held
  // back until the next piece says whether the tag follows.
  const size_t close = held_.find(kThinkClose);
  if (close != std::string::npos) {
    size_t end = close;
    for (size_t n = 0; end > 0 && space(held_[end - 1]) && n < kMaxHeld; ++n) --end;
    reasoning_.append(held_, 0, end);
    held_.erase(0, close + kThinkClose.size());
    state_ = State::kAnswer;
    strip_ = true;
    return;
  }
  if (finishing_) {
    reasoning_.append(held_);  // an unclosed block: its trailing white space is the model's
    held_.clear();
    return;
  }
  // Held: half a </think>, and the white space before it (dropped if the tag completes).
  size_t keep = held_.size() - partial_tag(held_, kThinkClose);
  for (size_t n = 0; keep > 0 && space(held_[keep - 1]) && n < kMaxHeld; ++n) --keep;
  reasoning_.append(held_, 0, keep);
  held_.erase(0, keep);
}

void ReasoningSplitter::answer_start() {
  if (strip_) {
    held_.erase(0, leading_space(held_));
    if (held_.empty()) return;
    strip_ = false;
  }
  content_.append(held_);
  held_.clear();
}

void ReasoningSplitter::harmony_header() {
  const size_t message = held_.find(kMessage);
  std::string_view h = std::string_view(held_).substr(0, message);
  // A header read whole starts with its parts; one still coming agrees with them so far.
  auto opens = [complete = message != std::string::npos](std::string_view s,
                                                         std::string_view part) {
    return complete ? s.starts_with(part) : agrees(s, part);
  };
  if (after_end_) {
    if (!opens(h, kStartAssistant)) return to_raw();
    h.remove_prefix(std::min(h.size(), kStartAssistant.size()));
  }
  // A recipient (" to=functions.x": a tool call) or another role's message is not for the user
  // as reasoning or content: the text goes through as it is.
  if (!opens(h, kChannel) || h.find(" to=") != std::string_view::npos) return to_raw();
  // A header longer than kMaxHeld (with its <|message|>) is not one, however it was cut.
  if (message == std::string::npos) {
    if (finishing_ || held_.size() >= kMaxHeld) to_raw();
    return;
  }
  if (message + kMessage.size() > kMaxHeld) return to_raw();
  // The last <|channel|> names it (gpt-oss sometimes writes a stray "<|channel|>commentary"
  // before the real one); "<|constrain|>..." may follow the name.
  std::string_view name = h.substr(h.rfind(kChannel) + kChannel.size());
  name = name.substr(0, std::min(name.find(' '), name.find('<')));
  if (name == "analysis") {
    body_reasoning_ = true;
  } else if (name == "final" || name == "commentary") {
    body_reasoning_ = false;
  } else {
    return to_raw();
  }
  held_.erase(0, message + kMessage.size());
  state_ = State::kBody;
}

void ReasoningSplitter::harmony_body() {
  std::string& out = body_reasoning_ ? reasoning_ : content_;
  size_t end = std::string::npos;
  std::string_view tag;
  for (const std::string_view t : kBodyEnds) {
    const size_t at = held_.find(t);
    if (at < end) {
      end = at;
      tag = t;
    }
  }
  if (end != std::string::npos) {
    out.append(held_, 0, end);
    held_.erase(0, end + tag.size());
    if (tag == kEnd) {
      state_ = State::kHeader;
      after_end_ = true;
    } else {
      state_ = State::kRaw;  // the answer is over: anything after it is not harmony's
    }
    return;
  }
  size_t hold = 0;
  if (!finishing_) {
    for (const std::string_view t : kBodyEnds) hold = std::max(hold, partial_tag(held_, t));
  }
  out.append(held_, 0, held_.size() - hold);
  held_.erase(0, held_.size() - hold);
}

}  // namespace expertd::text
