// expert-run --batch-prompts FILE: several prompts decoded together in one engine, as
// expert-serve --parallel runs concurrent requests (Engine::decode_batch: each routed expert a
// step needs is read once for every sequence routing to it), for benchmarks of that sharing.
#pragma once

#include <cstdint>
#include <string>

#include "text/sampler.h"
#include "tools/common/engine_flags.h"

namespace expertd::tools {

struct BatchRun {
  EngineFlags flags;
  std::string file;  // --batch-prompts
  uint32_t max_tokens = 16;
  text::SamplerOptions sampling;
  bool ignore_eos = false;
  bool json = false;
  // Every sequence in every step (--batch-every-step); else engine::BatchWidth narrows a step whose
  // distinct experts outgrow the tiers.
  bool fixed_width = false;
};

// The prompts of FILE: one per line, token ids separated by commas or white space, or
// random:N[:SEED] (N ids, glibc rand() % n_vocab after srand(SEED), as --feed-tokens draws them);
// empty lines and lines starting with '#' are skipped. Each sequence prefills its prompt, then all
// generate together until each has max_tokens or its end token. A line "PROMPT | FEED" (every
// line then) feeds FEED's ids instead of generating, as --feed-tokens does for one sequence: the
// same work however the sequences are batched, for benchmarks. Prints per-sequence ids and the
// aggregate: decode tokens/s, MB read per generated token, sequences per step, experts acquired
// per step. Returns the process exit status.
int run_batch(const BatchRun& b);

}  // namespace expertd::tools
