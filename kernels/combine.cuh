// The MoE block's weighted sum and the residual adds.
//
// moe_combine: x[i] += sum_j weights[j] * expert_out[j][i] for j < k (expert_out is k vectors of
// n back to back; weights lives in device memory, as router_topk wrote it). add: x[i] += y[i].
// add_rows: x[r][i] += b[i] for r < rows, i < n (a bias on each of `rows` rows back to back).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace expertd::kernels {

cudaError_t moe_combine(const float* expert_out, const float* weights, float* x, uint32_t k,
                        uint32_t n, cudaStream_t stream);

cudaError_t add(float* x, const float* y, uint32_t n, cudaStream_t stream);

cudaError_t add_rows(float* x, const float* b, uint32_t rows, uint32_t n, cudaStream_t stream);

}  // namespace expertd::kernels
