// Decode attention for one query position with grouped-query heads over a KV cache.
//
// The caches of one layer are [position][kv head][head_dim] floats; positions 0..n_pos-1 are
// valid (the current token's k and v already stored at n_pos-1). Query head h reads kv head
// h / (n_head / n_head_kv). out[h][i] = sum_t softmax_t(q_h . k_t * scale) * v_t[i].
// Works for any n_pos up to the cache's length (an online softmax: no scratch, nothing assumed
// about n_pos being small). head_dim up to 512; n_head a multiple of n_head_kv.
// gpt-oss: only positions first..n_pos-1 are attended (its sliding window; first < n_pos), and
// `sinks` (n_head floats, or null) adds one logit per head to the softmax's denominator whose
// value is dropped. first = 0 and no sinks compute exactly what the plain attention computes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace expertd::kernels {

cudaError_t decode_attention(const float* q, const float* k_cache, const float* v_cache, float* out,
                             uint32_t n_head, uint32_t n_head_kv, uint32_t head_dim, uint32_t n_pos,
                             float scale, cudaStream_t stream, uint32_t first = 0,
                             const float* sinks = nullptr);

}  // namespace expertd::kernels
