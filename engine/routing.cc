#include "engine/routing.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "engine/cpu_ops.h"

namespace expertd::engine {
namespace {

// probs[e] = the router's score of expert e: sigmoid (DeepSeek-V3) or softmax over all (V2).
void ds3_scores(const SigmoidMoe& d, std::span<const float> logits, std::span<double> probs) {
  const size_t n = logits.size();
  for (size_t e = 0; e < n; ++e) {
    probs[e] = d.sigmoid ? 1.0 / (1.0 + std::exp(-static_cast<double>(logits[e]))) : logits[e];
  }
  if (!d.sigmoid) softmax(probs.data(), n);
}

// DeepSeek's last step: the chosen order[0, k) sorted by descending probability (as the canonical
// trace lists them) into experts, weighted by their probabilities, renormalised over the k when
// `norm`, times `scale`.
void chosen_by_weight(std::span<const double> probs, uint32_t k, bool norm, double scale,
                      std::vector<uint32_t>& order, std::span<uint32_t> experts,
                      std::span<float> weights) {
  double sum = 0.0;
  for (uint32_t i = 0; i < k; ++i) sum += probs[order[i]];
  std::stable_sort(order.begin(), order.begin() + k,
                   [&](uint32_t a, uint32_t b) { return probs[a] > probs[b]; });
  for (uint32_t i = 0; i < k; ++i) {
    experts[i] = order[i];
    const double pr = probs[order[i]];
    weights[i] = static_cast<float>((norm ? pr / (sum + 1e-20) : pr) * scale);
  }
}

// torch's softplus (beta 1, threshold 20), then the square root: DeepSeek-V4's router score.
double sqrt_softplus(double x) { return std::sqrt(x > 20.0 ? x : std::log1p(std::exp(x))); }

}  // namespace

template <typename T>
void top_indices(std::span<const T> probs, std::vector<uint32_t>& order, uint32_t count) {
  std::iota(order.begin(), order.end(), 0u);
  std::partial_sort(order.begin(), order.begin() + count, order.end(), [&](uint32_t a, uint32_t b) {
    return probs[a] > probs[b] || (probs[a] == probs[b] && a < b);
  });
}
template void top_indices(std::span<const double>, std::vector<uint32_t>&, uint32_t);
template void top_indices(std::span<const float>, std::vector<uint32_t>&, uint32_t);

void gptoss_route(std::span<const float> logits, uint32_t k, std::span<double> probs,
                  std::vector<uint32_t>& order, std::span<double> topk, std::span<uint32_t> experts,
                  std::span<float> weights) {
  for (size_t e = 0; e < logits.size(); ++e) probs[e] = logits[e];
  top_indices(std::span<const double>(probs.data(), logits.size()), order, k);
  for (uint32_t i = 0; i < k; ++i) topk[i] = probs[order[i]];
  softmax(topk.data(), k);
  for (uint32_t i = 0; i < k; ++i) {
    experts[i] = order[i];
    weights[i] = static_cast<float>(topk[i]);
  }
}

void softmax_route(std::span<const float> logits, uint32_t k, bool norm_topk,
                   std::span<double> probs, std::vector<uint32_t>& order,
                   std::span<uint32_t> experts, std::span<float> weights) {
  const size_t n = logits.size();
  softmax_hint_probs(logits, probs);
  top_indices(std::span<const double>(probs.data(), n), order, k);
  double sum = 0.0;
  for (uint32_t i = 0; i < k; ++i) sum += probs[order[i]];
  for (uint32_t i = 0; i < k; ++i) {
    experts[i] = order[i];
    const double pr = probs[order[i]];
    weights[i] = static_cast<float>(norm_topk ? pr / sum : pr);
  }
}

void softmax_hint_probs(std::span<const float> logits, std::span<double> probs) {
  for (size_t e = 0; e < logits.size(); ++e) probs[e] = logits[e];
  softmax(probs.data(), logits.size());
}

void ds3_route(const SigmoidMoe& d, std::span<const float> bias, std::span<const float> logits,
               uint32_t k, std::span<double> probs, std::span<double> sel,
               std::vector<uint32_t>& order, std::span<uint32_t> experts,
               std::span<float> weights) {
  const size_t n = logits.size();
  ds3_scores(d, logits, probs);
  for (size_t e = 0; e < n; ++e) sel[e] = probs[e] + bias[e];
  if (d.n_group > 1) {
    // A group's score is the sum of its two best corrected scores (transformers, llama.cpp); the
    // experts of every group outside the best n_group_used are out of the running.
    const size_t per = n / d.n_group;
    double gscore[256];
    uint32_t gorder[256];
    const uint32_t ng = std::min<uint32_t>(d.n_group, 256);
    for (uint32_t gi = 0; gi < ng; ++gi) {
      double a = -INFINITY;
      double b = -INFINITY;
      for (size_t j = gi * per; j < (gi + 1) * per; ++j) {
        if (sel[j] > a) {
          b = a;
          a = sel[j];
        } else if (sel[j] > b) {
          b = sel[j];
        }
      }
      gscore[gi] = per >= 2 ? a + b : a;
      gorder[gi] = gi;
    }
    std::stable_sort(gorder, gorder + ng,
                     [&](uint32_t x, uint32_t y) { return gscore[x] > gscore[y]; });
    for (uint32_t r = d.n_group_used; r < ng; ++r) {
      for (size_t j = gorder[r] * per; j < (gorder[r] + 1) * per; ++j) sel[j] = -INFINITY;
    }
  }
  top_indices(std::span<const double>(sel.data(), n), order, k);
  chosen_by_weight(probs, k, d.weights_norm, d.weights_scale, order, experts, weights);
}

void ds3_hint_probs(const SigmoidMoe& d, std::span<const float> bias, std::span<const float> logits,
                    std::span<double> probs) {
  const size_t n = logits.size();
  ds3_scores(d, logits, probs);
  double sum = 0.0;
  for (size_t e = 0; e < n; ++e) {
    probs[e] = std::max(0.0, probs[e] + bias[e]);
    sum += probs[e];
  }
  for (size_t e = 0; e < n; ++e) probs[e] = sum > 0 ? probs[e] / sum : 0.0;
}

void ds4_route(const Ds4Params& d, const Ds4LayerWeights& l, bool hash, uint32_t token,
               std::span<const float> logits, uint32_t k, std::span<double> probs,
               std::span<double> sel, std::vector<uint32_t>& order, std::span<uint32_t> experts,
               std::span<float> weights) {
  const size_t n = logits.size();
  for (size_t e = 0; e < n; ++e) probs[e] = sqrt_softplus(logits[e]);
  if (hash) {
    const uint32_t* ex = l.tid2eid.data() + uint64_t{token} * k;
    std::copy_n(ex, k, order.begin());
  } else {
    for (size_t e = 0; e < n; ++e) sel[e] = probs[e] + l.exp_bias[e];
    top_indices(std::span<const double>(sel.data(), n), order, k);
  }
  chosen_by_weight(probs, k, d.weights_norm, d.weights_scale, order, experts, weights);
}

void ds4_hint_probs(const Ds4LayerWeights& l, std::span<const float> logits,
                    std::span<double> probs) {
  const size_t n = logits.size();
  double sum = 0.0;
  for (size_t e = 0; e < n; ++e) {
    probs[e] = std::max(0.0, sqrt_softplus(logits[e]) + l.exp_bias[e]);
    sum += probs[e];
  }
  for (size_t e = 0; e < n; ++e) probs[e] = sum > 0 ? probs[e] / sum : 0.0;
}

}  // namespace expertd::engine
