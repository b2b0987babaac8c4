// NEOX-style rotary position embedding (llama.cpp's GGML_ROPE_TYPE_NEOX, as Qwen3 uses): in each
// of `heads` vectors of head_dim elements, element i < n_rot/2 is rotated with element i + n_rot/2
// by theta = pos * base^(-2i/n_rot); elements from n_rot on are left alone. In place.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace expertd::kernels {

cudaError_t rope_neox(float* x, uint32_t heads, uint32_t head_dim, uint32_t n_rot, uint32_t pos,
                      float base, cudaStream_t stream);

}  // namespace expertd::kernels
