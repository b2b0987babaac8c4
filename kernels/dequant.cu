// dequantize on the GPU: eight consecutive elements per thread, decoded by blocks.cuh's element
// decoders (bit-identical to engine/dequant.cc).
#include "kernels/dequant.cuh"
// The own header first (STYLE.md), then the internal ones of kernels/.
#include "kernels/blocks.cuh"

namespace expertd::kernels {
namespace {

using detail::dequant8_mxfp4;
using detail::dequant8_plain;
using detail::dequant8_q4_k;
using detail::dequant8_q6_k;
using detail::dequant8_q8_0;

constexpr uint32_t kThreads = 256;

__device__ __forceinline__ void store(float* dst, float v) { *dst = v; }
__device__ __forceinline__ void store(__nv_bfloat16* dst, float v) {
  *dst = __float2bfloat16_rn(v);
}

template <GgmlType T, typename Out>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t* src, Out* dst, uint64_t n) {
  const uint64_t groups = (n + 7) / 8;
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t g = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; g < groups; g += stride) {
    const uint64_t e0 = g * 8;
    float out[8];
    if constexpr (T == GgmlType::Q8_0) {
      dequant8_q8_0(src, e0, out);
    } else if constexpr (T == GgmlType::Q4_K) {
      dequant8_q4_k(src, e0, out);
    } else if constexpr (T == GgmlType::Q6_K) {
      dequant8_q6_k(src, e0, out);
    } else if constexpr (T == GgmlType::MXFP4) {
      dequant8_mxfp4(src, e0, out);
    } else {
      dequant8_plain<T>(src, e0, n, out);
    }
#pragma unroll
    for (uint32_t i = 0; i < 8; ++i) {
      if (e0 + i < n) store(dst + e0 + i, out[i]);
    }
  }
}

template <GgmlType T, typename Out>
cudaError_t launch_dequantize(const void* src, Out* dst, uint64_t n, cudaStream_t stream) {
  constexpr uint64_t kMaxBlocks = 1u << 16;
  uint64_t blocks = ((n + 7) / 8 + kThreads - 1) / kThreads;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  dequantize_kernel<T, Out><<<static_cast<uint32_t>(blocks), kThreads, 0, stream>>>(
      static_cast<const uint8_t*>(src), dst, n);
  return cudaGetLastError();
}

template <typename Out>
cudaError_t dequantize_to(GgmlType type, const void* src, Out* dst, uint64_t n,
                          cudaStream_t stream) {
  if (!expert_type_supported(type) || src == nullptr || dst == nullptr || n == 0 ||
      n % ggml_traits(type).block_elems != 0) {
    return cudaErrorInvalidValue;
  }
  switch (type) {
    case GgmlType::F32:
      return launch_dequantize<GgmlType::F32>(src, dst, n, stream);
    case GgmlType::F16:
      return launch_dequantize<GgmlType::F16>(src, dst, n, stream);
    case GgmlType::BF16:
      return launch_dequantize<GgmlType::BF16>(src, dst, n, stream);
    case GgmlType::Q8_0:
      return launch_dequantize<GgmlType::Q8_0>(src, dst, n, stream);
    case GgmlType::Q4_K:
      return launch_dequantize<GgmlType::Q4_K>(src, dst, n, stream);
    case GgmlType::Q6_K:
      return launch_dequantize<GgmlType::Q6_K>(src, dst, n, stream);
    case GgmlType::MXFP4:
      return launch_dequantize<GgmlType::MXFP4>(src, dst, n, stream);
    default:
      return cudaErrorInvalidValue;  // not in kExpertTypes: rejected above
  }
}

__global__ void __launch_bounds__(kThreads)
    to_bf16_kernel(const float* src, __nv_bfloat16* dst, uint64_t n) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) {
    dst[i] = __float2bfloat16_rn(src[i]);
  }
}

}  // namespace

cudaError_t dequantize(GgmlType type, const void* src, float* dst, uint64_t n,
                       cudaStream_t stream) {
  return dequantize_to(type, src, dst, n, stream);
}

cudaError_t dequantize_bf16(GgmlType type, const void* src, __nv_bfloat16* dst, uint64_t n,
                            cudaStream_t stream) {
  return dequantize_to(type, src, dst, n, stream);
}

cudaError_t to_bf16(const float* src, __nv_bfloat16* dst, uint64_t n, cudaStream_t stream) {
  if (src == nullptr || dst == nullptr || n == 0) return cudaErrorInvalidValue;
  constexpr uint64_t kMaxBlocks = 1u << 16;
  uint64_t blocks = (n + kThreads - 1) / kThreads;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  to_bf16_kernel<<<static_cast<uint32_t>(blocks), kThreads, 0, stream>>>(src, dst, n);
  return cudaGetLastError();
}

}  // namespace expertd::kernels
