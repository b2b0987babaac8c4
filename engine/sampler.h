// Picks the next token from logits: greedy (temperature 0) or temperature + top-p (nucleus)
// sampling from a seeded generator, so a run is reproducible. Buffers are sized at construction.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace expertd::engine {

struct SamplerOptions {
  float temperature = 0.0f;  // 0: greedy
  float top_p = 1.0f;        // keep the smallest set of tokens whose probability reaches top_p
  uint64_t seed = 0;
};

class Sampler {
 public:
  Sampler(const SamplerOptions& options, uint32_t n_vocab);
  // The chosen token id; logits.size() must be the vocabulary size given at construction.
  uint32_t sample(std::span<const float> logits);

 private:
  SamplerOptions opts_;
  std::mt19937_64 rng_;
  std::vector<double> probs_;
  std::vector<uint32_t> order_;
};

// The index of the largest logit (the first one on ties).
uint32_t argmax(std::span<const float> logits);

}  // namespace expertd::engine
