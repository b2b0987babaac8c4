#include "kernels/rope.cuh"

namespace expertd::kernels {
namespace {

constexpr uint32_t kThreads = 128;

// One thread per rotated pair. The angle is computed in double, as the CPU reference does: at
// positions in the tens of thousands a float theta is off by whole milliradians.
__global__ void __launch_bounds__(kThreads)
    rope_neox_kernel(float* x, uint32_t heads, uint32_t head_dim, uint32_t n_rot, uint32_t pos,
                     double base) {
  const uint32_t half = n_rot / 2;
  const uint64_t idx = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (idx >= uint64_t{heads} * half) return;
  const uint32_t h = static_cast<uint32_t>(idx / half);
  const uint32_t i = static_cast<uint32_t>(idx % half);
  const double theta = static_cast<double>(pos) * pow(base, -2.0 * static_cast<double>(i) / n_rot);
  double s = 0.0;
  double c = 0.0;
  sincos(theta, &s, &c);
  float* v = x + uint64_t{h} * head_dim;
  const double x0 = v[i];
  const double x1 = v[i + half];
  v[i] = static_cast<float>(x0 * c - x1 * s);
  v[i + half] = static_cast<float>(x0 * s + x1 * c);
}

}  // namespace

cudaError_t rope_neox(float* x, uint32_t heads, uint32_t head_dim, uint32_t n_rot, uint32_t pos,
                      float base, cudaStream_t stream) {
  if (x == nullptr || heads == 0 || head_dim == 0 || n_rot == 0 || n_rot % 2 != 0 ||
      n_rot > head_dim || !(base > 0.0f)) {
    return cudaErrorInvalidValue;
  }
  const uint64_t pairs = uint64_t{heads} * (n_rot / 2);
  const uint64_t blocks = (pairs + kThreads - 1) / kThreads;
  if (blocks > 0x7fffffffu) return cudaErrorInvalidValue;
  rope_neox_kernel<<<static_cast<uint32_t>(blocks), kThreads, 0, stream>>>(
      x, heads, head_dim, n_rot, pos, static_cast<double>(base));
  return cudaGetLastError();
}

}  // namespace expertd::kernels
