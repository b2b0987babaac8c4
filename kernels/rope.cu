#include "kernels/rope.cuh"
#include "kernels/rope_pair.cuh"

namespace expertd::kernels {
namespace {

constexpr uint32_t kThreads = 128;

// One thread per rotated pair.
template <bool kNeox>
__global__ void __launch_bounds__(kThreads) rope_kernel(float* x, uint32_t heads, uint32_t head_dim,
                                                        uint32_t n_rot, uint32_t pos, double base) {
  const uint32_t half = n_rot / 2;
  const uint64_t idx = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (idx >= uint64_t{heads} * half) return;
  const uint64_t h = idx / half;
  detail::rope_pair<kNeox>(x + h * head_dim, static_cast<uint32_t>(idx % half), n_rot,
                           static_cast<double>(pos), base);
}

// One thread per rotated pair (i, i + n_rot/2) of each head, at the given frequency.
__global__ void __launch_bounds__(kThreads)
    rope_freqs_kernel(float* x, uint32_t heads, uint32_t head_dim, uint32_t n_rot, uint32_t pos,
                      const double* inv_freq, double mscale) {
  const uint32_t half = n_rot / 2;
  const uint64_t idx = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (idx >= uint64_t{heads} * half) return;
  float* v = x + (idx / half) * head_dim;
  const uint32_t i = static_cast<uint32_t>(idx % half);
  const double theta = static_cast<double>(pos) * inv_freq[i];
  const double c = cos(theta) * mscale;
  const double s = sin(theta) * mscale;
  const double x0 = v[i];
  const double x1 = v[i + half];
  v[i] = static_cast<float>(x0 * c - x1 * s);
  v[i + half] = static_cast<float>(x0 * s + x1 * c);
}

template <bool kNeox>
cudaError_t launch_rope(float* x, uint32_t heads, uint32_t head_dim, uint32_t n_rot, uint32_t pos,
                        float base, cudaStream_t stream) {
  if (x == nullptr || heads == 0 || head_dim == 0 || n_rot == 0 || n_rot % 2 != 0 ||
      n_rot > head_dim || !(base > 0.0f)) {
    return cudaErrorInvalidValue;
  }
  const uint64_t pairs = uint64_t{heads} * (n_rot / 2);
  const uint64_t blocks = (pairs + kThreads - 1) / kThreads;
  if (blocks > 0x7fffffffu) return cudaErrorInvalidValue;
  rope_kernel<kNeox><<<static_cast<uint32_t>(blocks), kThreads, 0, stream>>>(
      x, heads, head_dim, n_rot, pos, static_cast<double>(base));
  return cudaGetLastError();
}

}  // namespace

cudaError_t rope_neox(float* x, uint32_t heads, uint32_t head_dim, uint32_t n_rot, uint32_t pos,
                      float base, cudaStream_t stream) {
  return launch_rope<true>(x, heads, head_dim, n_rot, pos, base, stream);
}

cudaError_t rope_norm(float* x, uint32_t heads, uint32_t head_dim, uint32_t n_rot, uint32_t pos,
                      float base, cudaStream_t stream) {
  return launch_rope<false>(x, heads, head_dim, n_rot, pos, base, stream);
}

cudaError_t rope_neox_freqs(float* x, uint32_t heads, uint32_t head_dim, uint32_t n_rot,
                            uint32_t pos, const double* inv_freq, double mscale,
                            cudaStream_t stream) {
  if (x == nullptr || inv_freq == nullptr || heads == 0 || n_rot == 0 || n_rot % 2 != 0 ||
      n_rot > head_dim) {
    return cudaErrorInvalidValue;
  }
  const uint64_t blocks = (uint64_t{heads} * (n_rot / 2) + kThreads - 1) / kThreads;
  if (blocks > 0x7fffffffu) return cudaErrorInvalidValue;
  rope_freqs_kernel<<<static_cast<uint32_t>(blocks), kThreads, 0, stream>>>(
      x, heads, head_dim, n_rot, pos, inv_freq, mscale);
  return cudaGetLastError();
}

}  // namespace expertd::kernels
