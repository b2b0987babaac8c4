// The plain matvec family (F32, F16, BF16): a warp per row, converted in registers
// (matvec_float.cu explains the shape). matvec_batched (kernels/matvec.cuh) checks the arguments
// and calls this; it does not check them again, except that a type of another family is
// cudaErrorInvalidValue.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/matvec.cuh"
#include "storage/ggml_types.h"

namespace expertd::kernels {

cudaError_t matvec_float(GgmlType type, const MatvecBatch& batch, uint64_t row_bytes, uint32_t rows,
                         uint32_t cols, cudaStream_t stream);

}  // namespace expertd::kernels
