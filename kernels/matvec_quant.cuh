// The quantised matvec family (Q8_0, Q4_K, Q6_K, MXFP4): x split into int8 digit planes, the quants
// multiplied by __dp4a (matvec_quant.cu explains the shape). matvec_batched (kernels/matvec.cuh)
// checks the arguments and calls this; it does not check them again, except that a type of
// another family is cudaErrorInvalidValue.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/matvec.cuh"
#include "storage/ggml_types.h"

namespace expertd::kernels {

// `variant` is never kDefault (matvec_batched resolves it).
cudaError_t matvec_quant(GgmlType type, const MatvecBatch& batch, uint64_t row_bytes, uint32_t rows,
                         uint32_t cols, cudaStream_t stream, MatvecVariant variant);

}  // namespace expertd::kernels
