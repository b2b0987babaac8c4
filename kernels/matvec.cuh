// The fused matvec of ggml weights on the GPU, for the expert types (kExpertTypes: F32, F16, BF16,
// Q8_0, Q4_K, Q6_K and MXFP4), with the block layouts of ggml's reference dequantize_row_*. Two
// families do the work: matvec_float.cu (F32, F16, BF16) and matvec_quant.cu (Q8_0, Q4_K, Q6_K,
// MXFP4).
//
// matvec: y[r] = sum_c W[r][c] * x[c] for rows r < rows, where row r of W starts at
// w + r * row_bytes and holds `cols` elements of `type` (cols a whole number of blocks). The
// weight is dequantised in registers as it is read (fused); accumulation is in float.
// `w` may be device memory or mapped pinned host memory (cudaHostRegisterMapped), which is how
// the in-place mode reads the daemon's arena. `w` must be 2-byte aligned (4-byte for F32; any
// address for MXFP4, whose 17-byte blocks put rows anywhere); the widest loads (16 bytes) are used
// when every w and row_bytes are 16-byte aligned, narrower ones otherwise. x is staged in shared
// memory, which bounds cols (about 54k for Q8_0 and Q6_K, 42k for Q4_K and MXFP4, 58k for
// F32/F16/BF16 on an H200); a larger cols, a misaligned w, or row_bytes below the
// row's data is cudaErrorInvalidValue. The device's occupancy and SM count are queried on the host
// at a kernel's first call per device and shared-memory size, then cached.
//
// matvec_batched: up to kMaxBatch independent matvecs of the same type and shape in one launch
// (the gate and up projections of all routed experts, then their down projections); job j reads
// w[j] and x[j] and writes y[j].
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "storage/ggml_types.h"

namespace expertd::kernels {

inline constexpr uint32_t kMaxBatch = 32;

struct MatvecBatch {
  uint32_t count = 0;
  const void* w[kMaxBatch] = {};
  const float* x[kMaxBatch] = {};
  float* y[kMaxBatch] = {};
};

cudaError_t matvec(GgmlType type, const void* w, uint64_t row_bytes, uint32_t rows, uint32_t cols,
                   const float* x, float* y, cudaStream_t stream);

cudaError_t matvec_batched(GgmlType type, const MatvecBatch& batch, uint64_t row_bytes,
                           uint32_t rows, uint32_t cols, cudaStream_t stream);

}  // namespace expertd::kernels
