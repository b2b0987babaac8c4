#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "base/check.h"

namespace expertd::engine {

uint32_t argmax(std::span<const float> logits) {
  EXPERTD_CHECK(!logits.empty());
  uint32_t best = 0;
  for (uint32_t i = 1; i < logits.size(); ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  return best;
}

Sampler::Sampler(const SamplerOptions& options, uint32_t n_vocab)
    : opts_(options), rng_(options.seed), probs_(n_vocab), order_(n_vocab) {}

uint32_t Sampler::sample(std::span<const float> logits) {
  EXPERTD_CHECK_EQ(logits.size(), probs_.size());
  if (!(opts_.temperature > 0.0f)) return argmax(logits);
  const double inv_t = 1.0 / static_cast<double>(opts_.temperature);
  const double mx = logits[argmax(logits)];
  double sum = 0.0;
  for (size_t i = 0; i < logits.size(); ++i) {
    probs_[i] = std::exp((static_cast<double>(logits[i]) - mx) * inv_t);
    sum += probs_[i];
  }
  std::iota(order_.begin(), order_.end(), 0u);
  std::sort(order_.begin(), order_.end(), [&](uint32_t a, uint32_t b) {
    return probs_[a] > probs_[b] || (probs_[a] == probs_[b] && a < b);
  });
  // The nucleus: the most probable tokens until their mass reaches top_p (at least one).
  const double target = std::clamp(static_cast<double>(opts_.top_p), 0.0, 1.0) * sum;
  size_t keep = 0;
  double mass = 0.0;
  while (keep < order_.size() && (keep == 0 || mass < target)) mass += probs_[order_[keep++]];
  std::uniform_real_distribution<double> uniform(0.0, mass);
  double r = uniform(rng_);
  for (size_t i = 0; i < keep; ++i) {
    r -= probs_[order_[i]];
    if (r < 0.0) return order_[i];
  }
  return order_[keep - 1];
}

}  // namespace expertd::engine
