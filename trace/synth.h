// Generated routing traces with the locality of real ones, for machines without the shared
// traces (a fresh clone, CI, the GPU device) and for shapes no trace was collected for.
//
// Each layer routes by its own skewed popularity: a random permutation ranks its experts, and the
// expert of rank r (0-based) weighs 1 / (r + 1)^zipf_s. Each expert the previous token chose at
// the same layer is chosen again with probability `keep`; the rest of the top-k are drawn by
// popularity, without repeats. Gate weights, when drawn, are k exponential variates sorted
// descending and normalised (for top-2 the larger averages 0.75, as in Mixtral's traces).
//
// mixtral() is calibrated against the shared Mixtral-8x7B HumanEval traces (32 layers, top-2 of
// 8): there, 37% of a token's experts at a layer were also the previous token's (36-38%), and the
// per-layer popularity shares, sorted, run from 0.19 down to 0.07. zipf_s 0.4 and keep 0.15 give
// 37% and 0.19 .. 0.08. wide() is a 128-expert top-8 model (Qwen3-30B-A3B's shape, 48 layers); no
// trace of one is at hand, so its skew (0.8) and keep (0.3) are assumptions, not measurements.
#pragma once

#include <cstdint>

#include "trace/trace.h"

namespace expertd {

struct SynthParams {
  uint32_t tokens = 256;
  uint32_t layers = 32;
  uint32_t experts = 8;
  uint32_t top_k = 2;
  double zipf_s = 0.4;       // popularity exponent (0: uniform)
  double keep = 0.15;        // chance that each of the previous token's experts is kept
  bool gate_weights = true;  // drawn weights; false: uniform 1/k
  static SynthParams mixtral(uint32_t tokens = 256);
  static SynthParams wide(uint32_t tokens = 256);
};

// Deterministic: the same parameters and seed give the same trace, on any machine with the same
// standard library (std::mt19937_64; the distributions are libstdc++'s).
Trace synthesize_trace(const SynthParams& p, uint64_t seed);

// Measured locality of a trace, to compare a generated trace with a real one.
struct TraceLocality {
  double reuse = 0;  // of the experts of (token t, layer l), the share also routed at (t - 1, l)
  double top_share = 0;     // the most popular expert's share of a layer's routes, layer average
  double bottom_share = 0;  // the least popular expert's
};
TraceLocality measure_locality(const Trace& t);

}  // namespace expertd
