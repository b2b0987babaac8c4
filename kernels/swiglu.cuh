// SwiGLU: out[i] = silu(gate[i]) * up[i], silu(x) = x / (1 + exp(-x)), over n elements (k experts'
// hidden vectors back to back). out may alias gate or up.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace expertd::kernels {

cudaError_t swiglu(const float* gate, const float* up, float* out, uint64_t n, cudaStream_t stream);

// gpt-oss's clamped SwiGLU over one expert's n hidden values, on its biased gate and up (bg, bu: n
// each): g = min(gate + bg, limit), u = clamp(up + bu, -limit, limit),
// out = (u + 1) * g / (1 + exp(-alpha g)), in double as CpuEngine's oai_swiglu. out may alias gate
// or up.
cudaError_t oai_swiglu(const float* gate, const float* up, const float* bg, const float* bu,
                       float* out, uint64_t n, float alpha, float limit, cudaStream_t stream);
// The same over `rows` rows of n values back to back (one expert's rows of a prefill chunk), every
// row with the same biases bg, bu (n each).
cudaError_t oai_swiglu_rows(const float* gate, const float* up, const float* bg, const float* bu,
                            float* out, uint32_t rows, uint64_t n, float alpha, float limit,
                            cudaStream_t stream);

}  // namespace expertd::kernels
