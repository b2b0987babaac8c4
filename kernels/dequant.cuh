// dequantize on the GPU: the expert types (kExpertTypes: F32, F16, BF16, Q8_0, Q4_K, Q6_K, MXFP4)
// to f32, bit-identical to the CPU's engine/dequant.cc (the block decoders are kernels/blocks.cuh).
//
// dequantize: n elements (whole rows, a whole number of blocks) from `src` to f32. `src` may be
// unaligned. A type outside kExpertTypes, a null pointer, n == 0 or n not a whole number of blocks
// is cudaErrorInvalidValue.
//
// dequantize_bf16: the same values rounded to bf16 (round to nearest even), for prefill's tensor-
// core GEMMs (GpuOptions::PrefillGemm::Bf16): half the bytes of the f32 copy.
// to_bf16: n floats rounded to bf16 (the activations those GEMMs read).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "storage/ggml_types.h"

namespace expertd::kernels {

cudaError_t dequantize(GgmlType type, const void* src, float* dst, uint64_t n, cudaStream_t stream);

cudaError_t dequantize_bf16(GgmlType type, const void* src, __nv_bfloat16* dst, uint64_t n,
                            cudaStream_t stream);

cudaError_t to_bf16(const float* src, __nv_bfloat16* dst, uint64_t n, cudaStream_t stream);

}  // namespace expertd::kernels
