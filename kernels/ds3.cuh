// DeepSeek-V3's own decode op, for Ds3GpuEngine: multi-head latent attention in the absorbed form,
// as Ds3CpuEngine::attention computes it (engine/ds3_cpu_engine.h), in the same precision: the
// scores' dot products, the softmax and the latent sums in double. The softmax's max and
// denominator are reduced in a tree, which differs from the reference's sequential sum only in
// the last bits of a double.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace expertd::kernels {

// One block per head h of n_head: over positions t < n,
//   score_t = (qabs_h . latent_t + qrope_h . krope_t) * scale,
// p = softmax(score), out_h[c] = sum_t p_t * latent_t[c]. qabs: [n_head][kv_lora] (the query
// absorbed into the latent space); qrope_h = q + h * q_stride (n_rot floats); latent:
// [*][kv_lora]; krope: [*][n_rot]; scratch: n_head * stride doubles, stride >= n; out:
// [n_head][kv_lora].
cudaError_t ds3_mla_attention(const float* qabs, const float* q, uint32_t q_stride,
                              const float* latent, const float* krope, uint32_t n, uint32_t n_head,
                              uint32_t kv_lora, uint32_t n_rot, double scale, double* scratch,
                              uint32_t stride, float* out, cudaStream_t stream);

}  // namespace expertd::kernels
