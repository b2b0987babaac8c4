// Picks the next token from logits: greedy (temperature 0) or sampling from a seeded generator, so
// a run is reproducible, with a repetition penalty, top-k, top-p (nucleus) and min-p.
//
// The order (documented in docs/ENGINE.md, "Sampling and stopping"), each step on what the one
// before it kept:
//   0. logit_bias: each listed id's bias added to its logit (OpenAI's; -100 bans, +100 forces);
//   1. repetition penalty on the logits of the token ids in the recent window (prompt and
//      generated tokens, the last repeat_last_n): logit / penalty if positive, logit * penalty if
//      not, once per distinct id however often it occurs (Hugging Face's
//      RepetitionPenaltyLogitsProcessor, llama.cpp's penalty_repeat); then, over the same window,
//      logit -= frequency_penalty * count + presence_penalty (OpenAI's, counted as llama.cpp's
//      penalty_freq and penalty_present count: the window, prompt included);
//   2. temperature: probabilities = softmax(logits / temperature); temperature 0 is greedy: the
//      argmax of the penalised logits, and steps 3-5 do not apply;
//   3. top-k: the k most probable tokens (ties: lower id first);
//   4. top-p: the fewest most probable tokens whose probability, renormalised over what top-k
//      kept, reaches top_p (at least one);
//   5. min-p: the tokens whose probability is at least min_p times the most probable one's;
//   6. one draw, in proportion to the kept probabilities, from an mt19937_64 seeded with `seed`.
//
// Owns every buffer it uses (sized at construction): sample() allocates nothing.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "expertd/result.h"

namespace expertd::text {

struct SamplerOptions {
  float temperature = 0.0f;  // 0: greedy; negative is an error
  float top_p = 1.0f;        // in (0, 1]; 1: off
  uint64_t seed = 0;
  int32_t top_k = 0;               // >= 0; 0: off
  float min_p = 0.0f;              // in [0, 1]; 0: off
  float repeat_penalty = 1.0f;     // > 0; 1: off
  int32_t repeat_last_n = 64;      // the penalty's window, in [0, kMaxRepeatLastN]; 0: off
  float presence_penalty = 0.0f;   // in [-2, 2]; 0: off
  float frequency_penalty = 0.0f;  // in [-2, 2]; 0: off
  std::vector<std::pair<uint32_t, float>> logit_bias;  // (id, bias in [-100, 100])
};

inline constexpr int32_t kMaxRepeatLastN = 1 << 20;

// Whether `options` can be sampled with; the error names the option (as the struct spells it) and
// the value.
Status validate(const SamplerOptions& options);

class Sampler {
 public:
  // The error of validate() for options that are not valid.
  static Result<Sampler> create(const SamplerOptions& options, uint32_t n_vocab);
  // `options` must be valid (checked: a bug otherwise).
  Sampler(const SamplerOptions& options, uint32_t n_vocab);

  // Records a token of the context (a prompt token) in the repetition penalty's window.
  void accept(uint32_t token);
  // The chosen token id, which joins the penalty's window; logits.size() must be the vocabulary
  // size given at construction.
  uint32_t sample(std::span<const float> logits);

  const SamplerOptions& options() const { return opts_; }
  // The logits of the last sample() after the repetition penalty (for tests and diagnostics).
  std::span<const double> penalised_logits() const { return logits_; }

 private:
  void penalise();             // step 1, on logits_
  uint32_t draw(size_t keep);  // step 6 over order_[0, keep)

  SamplerOptions opts_;
  std::mt19937_64 rng_;
  std::vector<double> logits_;   // the penalised logits
  std::vector<double> probs_;    // unnormalised probabilities
  std::vector<uint32_t> order_;  // token ids, most probable first (the kept prefix)
  // The penalty window: a ring of the last repeat_last_n token ids (recent_count_ of them valid),
  // and each id's count in it (zero again after each use).
  std::vector<uint32_t> recent_;
  uint64_t recent_count_ = 0;
  std::vector<uint32_t> counts_;
};

// The index of the largest logit (the first one on ties).
uint32_t argmax(std::span<const float> logits);

}  // namespace expertd::text
