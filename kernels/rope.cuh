// Rotary position embedding, in place, over `heads` vectors of head_dim elements; pair i < n_rot/2
// is rotated by theta = pos * base^(-2i/n_rot) and elements from n_rot on are left alone.
// rope_neox: llama.cpp's GGML_ROPE_TYPE_NEOX (Qwen3), pair i is elements (i, i + n_rot/2).
// rope_norm: its NORM type (`llama`, Mixtral: the converter permutes q/k for it), pair i is
// elements (2i, 2i + 1).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace expertd::kernels {

cudaError_t rope_neox(float* x, uint32_t heads, uint32_t head_dim, uint32_t n_rot, uint32_t pos,
                      float base, cudaStream_t stream);
cudaError_t rope_norm(float* x, uint32_t heads, uint32_t head_dim, uint32_t n_rot, uint32_t pos,
                      float base, cudaStream_t stream);

// rope_neox_freqs: rope_neox with given inverse frequencies (n_rot / 2 doubles in device memory:
// YaRN's, for gpt-oss) and both rotated values scaled by `mscale` (YaRN's attention factor), in
// double as CpuEngine's rope_neox_freqs.
cudaError_t rope_neox_freqs(float* x, uint32_t heads, uint32_t head_dim, uint32_t n_rot,
                            uint32_t pos, const double* inv_freq, double mscale,
                            cudaStream_t stream);

}  // namespace expertd::kernels
