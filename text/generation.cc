#include "text/generation.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

namespace expertd::text {

Result<std::unique_ptr<Generation>> Generation::create(
    const GenerationOptions& options, uint32_t n_vocab,
    std::function<std::string(uint32_t)> token_text, EndTokens end_tokens,
    std::span<const uint32_t> prompt) {
  EXPERTD_TRY(validate(options.sampling));
  if (!token_text && (!options.end_strings.empty() || !options.stops.empty())) {
    return make_error(EINVAL, "stop strings need the model's vocabulary, and it has none");
  }
  if (!token_text && options.json_schema) {
    return make_error(EINVAL, "response_format needs the model's vocabulary, and it has none");
  }
  EXPERTD_TRY_ASSIGN(StopMatcher ends, StopMatcher::create(options.end_strings));
  EXPERTD_TRY_ASSIGN(StopMatcher stops, StopMatcher::create(options.stops));
  std::unique_ptr<Generation> g(new Generation(options, n_vocab, std::move(token_text), end_tokens,
                                               std::move(ends), std::move(stops)));
  for (const uint32_t t : prompt) g->sampler_.accept(t);  // the penalty's window starts there
  if (options.json_schema) {
    g->constraint_.emplace(options.json_schema);
    g->texts_.resize(n_vocab);
    g->ends_answer_.assign(n_vocab, 0);
    for (uint32_t id = 0; id < n_vocab; ++id) {
      g->texts_[id] = g->token_text_(id);
      bool end = end_tokens.contains(id);
      for (const std::string& s : options.end_strings) {
        end = end || g->texts_[id].find(s) != std::string::npos;
      }
      g->ends_answer_[id] = end ? 1 : 0;
    }
  }
  return g;
}

Generation::Generation(const GenerationOptions& options, uint32_t n_vocab,
                       std::function<std::string(uint32_t)> token_text, EndTokens end_tokens,
                       StopMatcher ends, StopMatcher stops)
    : opts_(options),
      token_text_(std::move(token_text)),
      end_tokens_(end_tokens),
      ends_(std::move(ends)),
      stops_(std::move(stops)),
      splitter_(options.reasoning, options.starts_in_reasoning),
      sampler_(options.sampling, n_vocab) {
  tokens_.reserve(options.max_tokens);
}

void Generation::through(ReasoningSplitter::Step s) {
  if (stopped_) return;
  reasoning_.append(s.reasoning);
  if (s.content.empty()) return;
  const StopMatcher::Step st = stops_.push(s.content);
  content_.append(st.emit);
  stopped_ = st.stop;
}

std::optional<uint32_t> Generation::advance(std::span<const float> logits) {
  raw_.clear();
  reasoning_.clear();
  content_.clear();
  logprob_.reset();
  if (*stop_reason_ != '\0') return std::nullopt;
  if (tokens_.size() >= opts_.max_tokens) {
    stop_reason_ = "max_tokens";
    return std::nullopt;
  }
  std::span<const float> allowed = logits;
  if (constraint_) {
    // Structured output: only tokens that keep the text JSON of the schema; end tokens once the
    // value is whole.
    masked_.assign(logits.begin(), logits.end());
    const bool whole = constraint_->complete();
    bool any = false;
    for (uint32_t id = 0; id < masked_.size(); ++id) {
      const bool ok =
          ends_answer_[id] ? whole : !texts_[id].empty() && constraint_->allows(texts_[id]);
      if (ok) {
        any = true;
      } else {
        masked_[id] = -INFINITY;
      }
    }
    if (!any) {  // no token of the vocabulary continues the value
      stop_reason_ = "stop";
      return std::nullopt;
    }
    allowed = masked_;
  }
  const uint32_t next = sampler_.sample(allowed);
  tokens_.push_back(next);
  if (constraint_ && !ends_answer_[next]) constraint_->accept(texts_[next]);
  if (opts_.stop_at_end_token && end_tokens_.contains(next)) {
    stop_reason_ = "eos";
    return std::nullopt;
  }
  if (opts_.logprobs >= 0) {
    // log p = x - (max + log sum exp(x - max)), in double.
    const size_t n = logits.size();
    lsm_.resize(n);
    double mx = -INFINITY;
    for (const float x : logits) mx = std::max(mx, static_cast<double>(x));
    double sum = 0.0;
    for (const float x : logits) sum += std::exp(static_cast<double>(x) - mx);
    const double norm = mx + std::log(sum);
    for (size_t i = 0; i < n; ++i) lsm_[i] = static_cast<double>(logits[i]) - norm;
    TokenLogprob lp;
    lp.token = next;
    lp.logprob = lsm_[next];
    const size_t k = std::min<size_t>(static_cast<size_t>(opts_.logprobs), n);
    if (k > 0) {
      order_.resize(n);
      std::iota(order_.begin(), order_.end(), 0u);
      std::partial_sort(order_.begin(), order_.begin() + static_cast<int64_t>(k), order_.end(),
                        [&](uint32_t a, uint32_t b) {
                          return lsm_[a] > lsm_[b] || (lsm_[a] == lsm_[b] && a < b);
                        });
      for (size_t i = 0; i < k; ++i) lp.top.emplace_back(order_[i], lsm_[order_[i]]);
    }
    logprob_ = std::move(lp);
  }
  if (token_text_) {
    const StopMatcher::Step end = ends_.push(token_text_(next));
    raw_.append(end.emit);
    through(splitter_.push(end.emit));
    if (end.stop || stopped_) {
      stop_reason_ = "stop";
      return std::nullopt;
    }
  }
  if (constraint_ && constraint_->closed()) {  // the object or array closed: nothing may follow
    stop_reason_ = "stop";
    return std::nullopt;
  }
  if (tokens_.size() == opts_.max_tokens) {
    stop_reason_ = "max_tokens";
    return std::nullopt;
  }
  return next;
}

void Generation::finish() {
  logprob_.reset();
  raw_.clear();
  reasoning_.clear();
  content_.clear();
  if (!token_text_) return;
  if (!ends_.stopped()) {
    const std::string held(ends_.finish());
    raw_.append(held);
    through(splitter_.push(held));
  }
  through(splitter_.finish());
  if (!stopped_) content_.append(stops_.finish());
}

const char* Generation::finish_reason() const {
  return std::string_view(stop_reason_) == "max_tokens" || *stop_reason_ == '\0' ? "length"
                                                                                 : "stop";
}

}  // namespace expertd::text
