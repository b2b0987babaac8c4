// Block-wide reductions and the double-accumulated dot product the DeepSeek kernels (ds4.cu,
// ds3.cu) share: the CPU reference's precision (engine/cpu_ops.h), on the device.
//
// Internal to kernels/ (included by .cu files only); everything is in kernels::detail.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace expertd::kernels::detail {

inline constexpr uint32_t kThreads = 256;

// A block-wide reduction of one double per thread (kThreads threads), sum or max; every thread
// gets the result. `red` holds kThreads doubles of shared memory.
template <bool kMax>
__device__ double block_reduce(double v, double* red) {
  red[threadIdx.x] = v;
  __syncthreads();
  for (uint32_t s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      const double o = red[threadIdx.x + s];
      red[threadIdx.x] = kMax ? fmax(red[threadIdx.x], o) : red[threadIdx.x] + o;
    }
    __syncthreads();
  }
  const double r = red[0];
  __syncthreads();  // red may be reused right after
  return r;
}

// sum_i a[i] * b[i] in double, in order (engine/cpu_ops.h's dot).
__device__ inline double dot(const float* a, const float* b, uint32_t n) {
  double s = 0.0;
  for (uint32_t i = 0; i < n; ++i) s += static_cast<double>(a[i]) * static_cast<double>(b[i]);
  return s;
}

}  // namespace expertd::kernels::detail
