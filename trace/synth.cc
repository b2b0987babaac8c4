#include "trace/synth.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <vector>

namespace expertd {

SynthParams SynthParams::mixtral(uint32_t tokens) {
  SynthParams p;
  p.tokens = tokens;
  return p;
}

SynthParams SynthParams::wide(uint32_t tokens) {
  SynthParams p;
  p.tokens = tokens;
  p.layers = 48;
  p.experts = 128;
  p.top_k = 8;
  p.zipf_s = 0.8;
  p.keep = 0.3;
  return p;
}

Trace synthesize_trace(const SynthParams& p, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Trace t;
  t.layers = p.layers;
  t.experts = p.experts;
  t.tokens = p.tokens;
  const uint32_t top_k = std::min(p.top_k, p.experts);
  // Per layer, a random permutation gives each expert its popularity rank.
  std::vector<std::vector<double>> weight(p.layers, std::vector<double>(p.experts));
  for (auto& w : weight) {
    std::vector<uint32_t> rank(p.experts);
    std::iota(rank.begin(), rank.end(), 0u);
    std::shuffle(rank.begin(), rank.end(), rng);
    for (uint32_t e = 0; e < p.experts; ++e) {
      const double r = rank[e] + 1.0;
      w[e] = p.zipf_s == 1.0 ? 1.0 / r : std::pow(r, -p.zipf_s);
    }
  }
  std::vector<std::vector<uint32_t>> previous(p.layers);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::exponential_distribution<double> gate(1.0);
  std::vector<double> g;
  t.records.reserve(static_cast<size_t>(p.tokens) * p.layers);
  for (uint32_t tok = 0; tok < p.tokens; ++tok) {
    for (uint32_t l = 0; l < p.layers; ++l) {
      TraceRecord r;
      r.token = tok;
      r.layer = l;
      for (const uint32_t e : previous[l]) {
        if (r.experts.size() < top_k && u(rng) < p.keep) r.experts.push_back(e);
      }
      std::discrete_distribution<uint32_t> pick(weight[l].begin(), weight[l].end());
      while (r.experts.size() < top_k) {
        const uint32_t e = pick(rng);
        if (std::find(r.experts.begin(), r.experts.end(), e) == r.experts.end()) {
          r.experts.push_back(e);
        }
      }
      if (p.gate_weights) {
        g.resize(r.experts.size());
        for (double& x : g) x = gate(rng);
        std::sort(g.begin(), g.end(), std::greater<>());
        const double sum = std::accumulate(g.begin(), g.end(), 0.0);
        r.weights.clear();
        // Rounded to 6 decimals, as the canonical traces are.
        for (const double x : g)
          r.weights.push_back(static_cast<float>(std::round(x / sum * 1e6) / 1e6));
      } else {
        r.weights.assign(r.experts.size(), 1.0f / static_cast<float>(r.experts.size()));
      }
      previous[l] = r.experts;
      t.records.push_back(std::move(r));
    }
  }
  return t;
}

Trace make_synthetic_trace(uint32_t tokens, uint32_t layers, uint32_t experts, uint32_t top_k,
                           uint64_t seed, double reuse) {
  SynthParams p;
  p.tokens = tokens;
  p.layers = layers;
  p.experts = experts;
  p.top_k = top_k;
  p.zipf_s = 1.0;
  p.keep = reuse;
  p.gate_weights = false;
  return synthesize_trace(p, seed);
}

TraceLocality measure_locality(const Trace& t) {
  TraceLocality m;
  std::map<std::pair<uint32_t, uint32_t>, const TraceRecord*> at;
  for (const auto& r : t.records) at[{r.token, r.layer}] = &r;
  uint64_t reused = 0;
  uint64_t counted = 0;
  std::vector<std::vector<uint64_t>> routes(t.layers, std::vector<uint64_t>(t.experts));
  for (const auto& r : t.records) {
    for (const uint32_t e : r.experts) ++routes[r.layer][e];
    if (r.token == 0) continue;
    const auto prev = at.find({r.token - 1, r.layer});
    if (prev == at.end()) continue;
    const auto& pe = prev->second->experts;
    for (const uint32_t e : r.experts) reused += std::find(pe.begin(), pe.end(), e) != pe.end();
    counted += r.experts.size();
  }
  m.reuse = counted == 0 ? 0.0 : static_cast<double>(reused) / static_cast<double>(counted);
  uint32_t layers = 0;
  for (const auto& l : routes) {
    const uint64_t sum = std::accumulate(l.begin(), l.end(), uint64_t{0});
    if (sum == 0) continue;
    ++layers;
    m.top_share += static_cast<double>(*std::max_element(l.begin(), l.end())) / sum;
    m.bottom_share += static_cast<double>(*std::min_element(l.begin(), l.end())) / sum;
  }
  if (layers > 0) {
    m.top_share /= layers;
    m.bottom_share /= layers;
  }
  return m;
}

}  // namespace expertd
