// RMSNorm: y[r][i] = x[r][i] / sqrt(mean_i(x[r]^2) + eps) * w[i], for `rows` independent vectors
// of n elements sharing one weight vector (rows = 1 for the residual stream, n_head for the
// per-head q/k norms). y may alias x. Sums of squares accumulate in float over a block-wide
// reduction (the CPU reference accumulates in double).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace expertd::kernels {

cudaError_t rms_norm(const float* x, const float* w, float* y, uint32_t rows, uint32_t n, float eps,
                     cudaStream_t stream);

}  // namespace expertd::kernels
