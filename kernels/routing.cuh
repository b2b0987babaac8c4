// The MoE router's softmax and top-k, for `rows` independent router outputs of n_expert logits
// (row 0 the current layer, further rows the lookahead layers for prefetch hints).
//
// probs[r][e] = softmax(logits[r])[e]; experts[r][0..k) are the k largest probabilities, largest
// first, ties to the lower index (as the CPU reference orders them); weights[r][j] is the chosen
// expert's probability, divided by the sum of the k chosen when norm_topk (Qwen3's
// norm_topk_prob). n_expert up to 1024, k up to 64 and k <= n_expert. probs may be null when only
// the choice is wanted.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace expertd::kernels {

cudaError_t router_topk(const float* logits, uint32_t rows, uint32_t n_expert, uint32_t k,
                        bool norm_topk, uint32_t* experts, float* weights, float* probs,
                        cudaStream_t stream);

}  // namespace expertd::kernels
