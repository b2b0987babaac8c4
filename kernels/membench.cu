#include "kernels/membench.cuh"

namespace expertd::kernels {
namespace {

constexpr uint32_t kThreads = 256;
constexpr uint32_t kBlocksPerSm = 8;
constexpr uint32_t kUnroll = 4;

__global__ void __launch_bounds__(kThreads)
    read_bytes_kernel(const uint4* p, uint64_t n16, uint32_t* sink) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  uint32_t fold = 0;
  uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  for (; i + (kUnroll - 1) * stride < n16; i += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (uint32_t u = 0; u < kUnroll; ++u) v[u] = p[i + u * stride];
#pragma unroll
    for (uint32_t u = 0; u < kUnroll; ++u) fold ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n16; i += stride) {
    const uint4 v = p[i];
    fold ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (fold == 0x9e3779b9u) *sink = fold;
}

}  // namespace

cudaError_t read_bytes(const void* p, uint64_t n, uint32_t* sink, cudaStream_t stream) {
  if (p == nullptr || sink == nullptr || n == 0 || n % 16 != 0 ||
      reinterpret_cast<uintptr_t>(p) % 16 != 0) {
    return cudaErrorInvalidValue;
  }
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  int sms = 0;
  e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e != cudaSuccess) return e;
  const uint64_t n16 = n / 16;
  uint64_t blocks = uint64_t(sms > 0 ? sms : 1) * kBlocksPerSm;
  const uint64_t needed = (n16 + kThreads - 1) / kThreads;
  if (blocks > needed) blocks = needed;
  read_bytes_kernel<<<static_cast<uint32_t>(blocks), kThreads, 0, stream>>>(
      static_cast<const uint4*>(p), n16, sink);
  return cudaGetLastError();
}

}  // namespace expertd::kernels
