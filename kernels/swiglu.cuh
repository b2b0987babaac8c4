// SwiGLU: out[i] = silu(gate[i]) * up[i], silu(x) = x / (1 + exp(-x)), over n elements (k experts'
// hidden vectors back to back). out may alias gate or up.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace expertd::kernels {

cudaError_t swiglu(const float* gate, const float* up, float* out, uint64_t n, cudaStream_t stream);

}  // namespace expertd::kernels
