#include "kernels/norm.cuh"

namespace expertd::kernels {
namespace {

constexpr uint32_t kMaxThreads = 256;

__device__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// One block per row. Every x[i] is read before the barrier and y[i] written after it by the thread
// that reads x[i] again, so y may alias x.
__global__ void __launch_bounds__(kMaxThreads)
    rms_norm_kernel(const float* x, const float* w, float* y, uint32_t n, float eps) {
  __shared__ float partial[kMaxThreads / 32];
  const uint64_t base = uint64_t{blockIdx.x} * n;
  const float* xr = x + base;
  float ss = 0.0f;
  for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
  ss = warp_sum(ss);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = ss;
  __syncthreads();
  float total = 0.0f;
  for (uint32_t i = 0; i < blockDim.x / 32; ++i) total += partial[i];
  // Correctly rounded sqrt and division (no fast math): within an ulp of the CPU's double.
  const float scale = 1.0f / sqrtf(total / static_cast<float>(n) + eps);
  float* yr = y + base;
  for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) yr[i] = xr[i] * scale * w[i];
}

}  // namespace

cudaError_t rms_norm(const float* x, const float* w, float* y, uint32_t rows, uint32_t n, float eps,
                     cudaStream_t stream) {
  if (x == nullptr || w == nullptr || y == nullptr || rows == 0 || n == 0 || rows > 0x7fffffffu ||
      !(eps >= 0.0f)) {
    return cudaErrorInvalidValue;
  }
  const uint32_t threads = n >= kMaxThreads ? kMaxThreads : (n + 31) / 32 * 32;
  rms_norm_kernel<<<rows, threads, 0, stream>>>(x, w, y, n, eps);
  return cudaGetLastError();
}

}  // namespace expertd::kernels
