// The routers: every family's routing decision from a layer's router logits, and the
// probabilities its lookahead hints are ranked by (issue 24: a building block the CPU and CUDA
// engines share, rather than functions of one engine's header). Pure functions over host arrays;
// the callers own every scratch buffer, so none allocates.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "engine/model.h"

namespace expertd::engine {

// Writes the indices of the `count` largest of probs into order[0, count) (order holds
// probs.size() entries), largest first; equal values keep the lower index first, as the router
// kernel orders them. Instantiated for float and double.
template <typename T>
void top_indices(std::span<const T> probs, std::vector<uint32_t>& order, uint32_t count);

// gpt-oss's routing (CpuEngine's and GpuEngine's): probs = the logits (n_expert), the top k of them
// (top_indices' order) into experts, weighted by the softmax over those k alone (topk: k scratch).
void gptoss_route(std::span<const float> logits, uint32_t k, std::span<double> probs,
                  std::vector<uint32_t>& order, std::span<double> topk, std::span<uint32_t> experts,
                  std::span<float> weights);

// Qwen3-MoE's and Mixtral's routing: probs = softmax over every logit (n_expert), the top k of
// them (top_indices' order) into experts, weighted by their probabilities, renormalised over the
// k when `norm_topk`.
void softmax_route(std::span<const float> logits, uint32_t k, bool norm_topk,
                   std::span<double> probs, std::vector<uint32_t>& order,
                   std::span<uint32_t> experts, std::span<float> weights);

// Their router lookahead (and gpt-oss's): the softmax over every logit.
void softmax_hint_probs(std::span<const float> logits, std::span<double> probs);

// A layer's routing from its router logits (n_expert): probs = sigmoid (or softmax) of them;
// the top-k of probs + bias over the best n_group_used groups (ties to the lower index);
// experts[0, k) by descending probability, weights their probabilities renormalised
// (weights_norm) × weights_scale. probs, sel and order: n_expert scratch.
void ds3_route(const SigmoidMoe& d, std::span<const float> bias, std::span<const float> logits,
               uint32_t k, std::span<double> probs, std::span<double> sel,
               std::vector<uint32_t>& order, std::span<uint32_t> experts, std::span<float> weights);

// A layer's router lookahead, the probabilities its hints are ranked by: max(0, score + bias),
// normalised to sum 1.
void ds3_hint_probs(const SigmoidMoe& d, std::span<const float> bias, std::span<const float> logits,
                    std::span<double> probs);

// A layer's routing from its router logits (n_expert): probs = sqrtsoftplus(logits); the experts
// are tid2eid[token] on a hash layer, else the top-k of probs + e_score_correction_bias (ties to
// the lower index); experts[0, k) by descending probability, weights their probabilities
// renormalised (weights_norm) times weights_scale. probs, sel and order: n_expert scratch.
void ds4_route(const Ds4Params& d, const Ds4LayerWeights& l, bool hash, uint32_t token,
               std::span<const float> logits, uint32_t k, std::span<double> probs,
               std::span<double> sel, std::vector<uint32_t>& order, std::span<uint32_t> experts,
               std::span<float> weights);

// A learned layer's router lookahead, the probabilities its hints are ranked by:
// max(0, sqrtsoftplus(logits) + bias), normalised to sum 1.
void ds4_hint_probs(const Ds4LayerWeights& l, std::span<const float> logits,
                    std::span<double> probs);

}  // namespace expertd::engine
