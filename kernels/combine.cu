#include <algorithm>

#include "kernels/combine.cuh"

namespace expertd::kernels {
namespace {

constexpr uint32_t kThreads = 256;
constexpr uint32_t kMaxBlocks = 4096;

uint32_t blocks_for(uint32_t n) {
  const uint32_t b = (n + kThreads - 1) / kThreads;
  return b < kMaxBlocks ? b : kMaxBlocks;
}

// The expert outputs are summed in double in expert order and the sum rounded once, as the CPU
// reference does (a float times a float is exact in double, so the result is bit-identical).
__global__ void __launch_bounds__(kThreads)
    moe_combine_kernel(const float* expert_out, const float* weights, float* x, uint32_t k,
                       uint32_t n) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) {
    double acc = 0.0;
    for (uint32_t j = 0; j < k; ++j) {
      acc += static_cast<double>(weights[j]) * static_cast<double>(expert_out[uint64_t{j} * n + i]);
    }
    x[i] += static_cast<float>(acc);
  }
}

__global__ void __launch_bounds__(kThreads) add_kernel(float* x, const float* y, uint32_t n) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) {
    x[i] += y[i];
  }
}

__global__ void __launch_bounds__(kThreads)
    add_rows_kernel(float* x, const float* b, uint64_t total, uint32_t n) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total; i += stride) {
    x[i] += b[i % n];
  }
}

}  // namespace

cudaError_t moe_combine(const float* expert_out, const float* weights, float* x, uint32_t k,
                        uint32_t n, cudaStream_t stream) {
  if (expert_out == nullptr || weights == nullptr || x == nullptr || k == 0 || n == 0) {
    return cudaErrorInvalidValue;
  }
  moe_combine_kernel<<<blocks_for(n), kThreads, 0, stream>>>(expert_out, weights, x, k, n);
  return cudaGetLastError();
}

cudaError_t add(float* x, const float* y, uint32_t n, cudaStream_t stream) {
  if (x == nullptr || y == nullptr || n == 0) return cudaErrorInvalidValue;
  add_kernel<<<blocks_for(n), kThreads, 0, stream>>>(x, y, n);
  return cudaGetLastError();
}

cudaError_t add_rows(float* x, const float* b, uint32_t rows, uint32_t n, cudaStream_t stream) {
  if (x == nullptr || b == nullptr || rows == 0 || n == 0) return cudaErrorInvalidValue;
  const uint64_t total = uint64_t{rows} * n;
  const uint64_t blocks = std::min<uint64_t>((total + kThreads - 1) / kThreads, kMaxBlocks);
  add_rows_kernel<<<static_cast<uint32_t>(blocks), kThreads, 0, stream>>>(x, b, total, n);
  return cudaGetLastError();
}

}  // namespace expertd::kernels
