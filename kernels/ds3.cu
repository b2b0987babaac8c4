// DeepSeek-V3's decode op (ds3.cuh), next to the lines of engine/ds3_cpu_engine.cc it mirrors.
#include <cmath>

#include "kernels/ds3.cuh"
#include "kernels/reduce.cuh"

namespace expertd::kernels {
namespace {

using detail::block_reduce;
using detail::dot;
using detail::kThreads;

__global__ void mla_attention_kernel(const float* qabs, const float* q, uint32_t q_stride,
                                     const float* latent, const float* krope, uint32_t n,
                                     uint32_t kv_lora, uint32_t n_rot, double scale,
                                     double* scratch, uint32_t stride, float* out) {
  __shared__ double red[kThreads];
  const uint32_t h = blockIdx.x;
  const float* qa = qabs + static_cast<uint64_t>(h) * kv_lora;
  const float* qr = q + static_cast<uint64_t>(h) * q_stride;
  double* sc = scratch + static_cast<uint64_t>(h) * stride;
  double mx = -INFINITY;
  for (uint32_t t = threadIdx.x; t < n; t += kThreads) {
    sc[t] = (dot(qa, latent + static_cast<uint64_t>(t) * kv_lora, kv_lora) +
             dot(qr, krope + static_cast<uint64_t>(t) * n_rot, n_rot)) *
            scale;
    mx = fmax(mx, sc[t]);
  }
  mx = block_reduce<true>(mx, red);
  double part = 0.0;
  for (uint32_t t = threadIdx.x; t < n; t += kThreads) {
    sc[t] = exp(sc[t] - mx);
    part += sc[t];
  }
  const double sum = block_reduce<false>(part, red);
  __syncthreads();  // every sc[t] written before any channel reads it
  for (uint32_t c = threadIdx.x; c < kv_lora; c += kThreads) {
    double acc = 0.0;
    for (uint32_t t = 0; t < n; ++t)
      acc += (sc[t] / sum) * latent[static_cast<uint64_t>(t) * kv_lora + c];
    out[static_cast<uint64_t>(h) * kv_lora + c] = static_cast<float>(acc);
  }
}

}  // namespace

cudaError_t ds3_mla_attention(const float* qabs, const float* q, uint32_t q_stride,
                              const float* latent, const float* krope, uint32_t n, uint32_t n_head,
                              uint32_t kv_lora, uint32_t n_rot, double scale, double* scratch,
                              uint32_t stride, float* out, cudaStream_t stream) {
  if (stride < n) return cudaErrorInvalidValue;
  if (n_head == 0 || n == 0) return cudaSuccess;
  mla_attention_kernel<<<n_head, kThreads, 0, stream>>>(
      qabs, q, q_stride, latent, krope, n, kv_lora, n_rot, scale, scratch, stride, out);
  return cudaGetLastError();
}

}  // namespace expertd::kernels
