#include "kernels/blocks.cuh"
#include "kernels/swiglu.cuh"

namespace expertd::kernels {
namespace {

constexpr uint32_t kThreads = 256;
constexpr uint64_t kMaxBlocks = 4096;

// detail::swiglu_value: the CPU reference's operations exactly (a few thousand elements per
// token, so double exp costs nothing measurable).
__global__ void __launch_bounds__(kThreads)
    swiglu_kernel(const float* gate, const float* up, float* out, uint64_t n) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[i] = detail::swiglu_value(gate[i], up[i]);
  }
}

__global__ void __launch_bounds__(kThreads)
    oai_swiglu_kernel(const float* gate, const float* up, const float* bg, const float* bu,
                      float* out, uint64_t n, uint64_t period, float alpha, float limit) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) {
    // The biases repeat every `period` values (a row). The sums and clamps in float, the rest in
    // double: CpuEngine's operations.
    const uint64_t c = i % period;
    const double g = fminf(__fadd_rn(gate[i], bg[c]), limit);
    const double u = fminf(fmaxf(__fadd_rn(up[i], bu[c]), -limit), limit);
    out[i] = static_cast<float>((u + 1.0) * g / (1.0 + exp(-static_cast<double>(alpha) * g)));
  }
}

}  // namespace

cudaError_t oai_swiglu(const float* gate, const float* up, const float* bg, const float* bu,
                       float* out, uint64_t n, float alpha, float limit, cudaStream_t stream) {
  return oai_swiglu_rows(gate, up, bg, bu, out, 1, n, alpha, limit, stream);
}

cudaError_t oai_swiglu_rows(const float* gate, const float* up, const float* bg, const float* bu,
                            float* out, uint32_t rows, uint64_t n, float alpha, float limit,
                            cudaStream_t stream) {
  if (gate == nullptr || up == nullptr || bg == nullptr || bu == nullptr || out == nullptr ||
      rows == 0 || n == 0) {
    return cudaErrorInvalidValue;
  }
  const uint64_t total = uint64_t{rows} * n;
  uint64_t blocks = (total + kThreads - 1) / kThreads;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  oai_swiglu_kernel<<<static_cast<uint32_t>(blocks), kThreads, 0, stream>>>(gate, up, bg, bu, out,
                                                                            total, n, alpha, limit);
  return cudaGetLastError();
}

cudaError_t swiglu(const float* gate, const float* up, float* out, uint64_t n,
                   cudaStream_t stream) {
  if (gate == nullptr || up == nullptr || out == nullptr || n == 0) return cudaErrorInvalidValue;
  uint64_t blocks = (n + kThreads - 1) / kThreads;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  swiglu_kernel<<<static_cast<uint32_t>(blocks), kThreads, 0, stream>>>(gate, up, out, n);
  return cudaGetLastError();
}

}  // namespace expertd::kernels
