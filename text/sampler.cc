#include "text/sampler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "base/check.h"

namespace expertd::text {

uint32_t argmax(std::span<const float> logits) {
  EXPERTD_CHECK(!logits.empty());
  uint32_t best = 0;
  for (uint32_t i = 1; i < logits.size(); ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  return best;
}

Status validate(const SamplerOptions& o) {
  // Written so that NaN fails every check.
  if (!(o.temperature >= 0.0f) || std::isinf(o.temperature)) {
    return make_error(
        EINVAL, fmt::format("temperature must be 0 (greedy) or positive, got {}", o.temperature));
  }
  if (!(o.top_p > 0.0f && o.top_p <= 1.0f)) {
    return make_error(EINVAL, fmt::format("top_p must be in (0, 1], got {}", o.top_p));
  }
  if (o.top_k < 0) {
    return make_error(EINVAL, fmt::format("top_k must be 0 (off) or positive, got {}", o.top_k));
  }
  if (!(o.min_p >= 0.0f && o.min_p <= 1.0f)) {
    return make_error(EINVAL, fmt::format("min_p must be in [0, 1], got {}", o.min_p));
  }
  if (!(o.repeat_penalty > 0.0f) || std::isinf(o.repeat_penalty)) {
    return make_error(
        EINVAL, fmt::format("repeat_penalty must be positive (1 = off), got {}", o.repeat_penalty));
  }
  if (o.repeat_last_n < 0 || o.repeat_last_n > kMaxRepeatLastN) {
    return make_error(EINVAL, fmt::format("repeat_last_n must be in [0, {}] (0 = off), got {}",
                                          kMaxRepeatLastN, o.repeat_last_n));
  }
  for (const auto& [name, v] : {std::pair{"presence_penalty", o.presence_penalty},
                                std::pair{"frequency_penalty", o.frequency_penalty}}) {
    if (!(v >= -2.0f && v <= 2.0f)) {
      return make_error(EINVAL, fmt::format("{} must be in [-2, 2], got {}", name, v));
    }
  }
  for (const auto& [id, bias] : o.logit_bias) {
    if (!(bias >= -100.0f && bias <= 100.0f)) {
      return make_error(
          EINVAL, fmt::format("logit_bias of token {} must be in [-100, 100], got {}", id, bias));
    }
  }
  return Ok{};
}

Result<Sampler> Sampler::create(const SamplerOptions& options, uint32_t n_vocab) {
  if (auto st = validate(options); !st) return st.take_error();
  return Sampler(options, n_vocab);
}

Sampler::Sampler(const SamplerOptions& options, uint32_t n_vocab)
    : opts_(options),
      rng_(options.seed),
      logits_(n_vocab),
      probs_(n_vocab),
      order_(n_vocab),
      recent_(static_cast<size_t>(std::max(options.repeat_last_n, 0))),
      counts_(n_vocab, 0) {
  EXPERTD_CHECK(validate(options).ok());
  EXPERTD_CHECK(n_vocab > 0);
}

void Sampler::accept(uint32_t token) {
  if (recent_.empty()) return;
  recent_[recent_count_ % recent_.size()] = token;
  ++recent_count_;
}

void Sampler::penalise() {
  for (const auto& [id, bias] : opts_.logit_bias) {
    if (id < logits_.size()) logits_[id] += bias;
  }
  const bool repeat = opts_.repeat_penalty != 1.0f;
  const bool counted = opts_.presence_penalty != 0.0f || opts_.frequency_penalty != 0.0f;
  if (recent_.empty() || (!repeat && !counted)) return;
  const double penalty = opts_.repeat_penalty;
  const size_t n = static_cast<size_t>(std::min<uint64_t>(recent_count_, recent_.size()));
  for (size_t i = 0; i < n; ++i) {
    if (recent_[i] < counts_.size()) ++counts_[recent_[i]];
  }
  // Each distinct id once (its count is zeroed as it is used).
  for (size_t i = 0; i < n; ++i) {
    const uint32_t t = recent_[i];
    if (t >= logits_.size() || counts_[t] == 0) continue;
    const uint32_t count = counts_[t];
    counts_[t] = 0;
    if (repeat) logits_[t] = logits_[t] > 0.0 ? logits_[t] / penalty : logits_[t] * penalty;
    if (counted) {
      logits_[t] -= static_cast<double>(opts_.frequency_penalty) * count +
                    static_cast<double>(opts_.presence_penalty);
    }
  }
}

uint32_t Sampler::draw(size_t keep) {
  double mass = 0.0;
  for (size_t i = 0; i < keep; ++i) mass += probs_[order_[i]];
  std::uniform_real_distribution<double> uniform(0.0, mass);
  double r = uniform(rng_);
  for (size_t i = 0; i < keep; ++i) {
    r -= probs_[order_[i]];
    if (r < 0.0) return order_[i];
  }
  return order_[keep - 1];
}

uint32_t Sampler::sample(std::span<const float> logits) {
  EXPERTD_CHECK_EQ(logits.size(), logits_.size());
  const size_t n = logits.size();
  for (size_t i = 0; i < n; ++i) logits_[i] = logits[i];
  penalise();
  // The largest penalised logit (the first on ties): greedy's answer and softmax's shift.
  uint32_t best = 0;
  for (uint32_t i = 1; i < n; ++i) {
    if (logits_[i] > logits_[best]) best = i;
  }
  uint32_t chosen = best;
  if (opts_.temperature > 0.0f) {
    const double inv_t = 1.0 / static_cast<double>(opts_.temperature);
    const double mx = logits_[best];
    for (size_t i = 0; i < n; ++i) probs_[i] = std::exp((logits_[i] - mx) * inv_t);
    std::iota(order_.begin(), order_.end(), 0u);
    auto more_probable = [&](uint32_t a, uint32_t b) {
      return probs_[a] > probs_[b] || (probs_[a] == probs_[b] && a < b);
    };
    size_t keep = n;
    if (opts_.top_k > 0 && static_cast<size_t>(opts_.top_k) < n) {
      keep = static_cast<size_t>(opts_.top_k);
      std::partial_sort(order_.begin(), order_.begin() + static_cast<ptrdiff_t>(keep), order_.end(),
                        more_probable);
    } else {
      std::sort(order_.begin(), order_.end(), more_probable);
    }
    if (opts_.top_p < 1.0f) {
      double sum = 0.0;
      for (size_t i = 0; i < keep; ++i) sum += probs_[order_[i]];
      const double target = static_cast<double>(opts_.top_p) * sum;
      size_t nucleus = 0;
      double mass = 0.0;
      while (nucleus < keep && (nucleus == 0 || mass < target)) mass += probs_[order_[nucleus++]];
      keep = nucleus;
    }
    if (opts_.min_p > 0.0f) {
      // Relative to the most probable token, so no normalisation is needed.
      const double floor = static_cast<double>(opts_.min_p) * probs_[order_[0]];
      size_t above = 1;
      while (above < keep && probs_[order_[above]] >= floor) ++above;
      keep = above;
    }
    chosen = draw(keep);
  }
  accept(chosen);
  return chosen;
}

}  // namespace expertd::text
