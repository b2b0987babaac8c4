// The matvec entry points: the argument checks, then the family's launcher.
#include "kernels/matvec.cuh"
#include "kernels/matvec_float.cuh"
#include "kernels/matvec_quant.cuh"

namespace expertd::kernels {

cudaError_t matvec(GgmlType type, const void* w, uint64_t row_bytes, uint32_t rows, uint32_t cols,
                   const float* x, float* y, cudaStream_t stream) {
  MatvecBatch batch;
  batch.count = 1;
  batch.w[0] = w;
  batch.x[0] = x;
  batch.y[0] = y;
  return matvec_batched(type, batch, row_bytes, rows, cols, stream);
}

cudaError_t matvec_batched(GgmlType type, const MatvecBatch& batch, uint64_t row_bytes,
                           uint32_t rows, uint32_t cols, cudaStream_t stream) {
  if (!expert_type_supported(type) || batch.count == 0 || batch.count > kMaxBatch || rows == 0 ||
      cols == 0) {
    return cudaErrorInvalidValue;
  }
  const GgmlTypeTraits& traits = ggml_traits(type);
  if (cols % traits.block_elems != 0 ||
      uint64_t{cols} / traits.block_elems * traits.block_bytes > row_bytes) {
    return cudaErrorInvalidValue;
  }
  for (uint32_t j = 0; j < batch.count; ++j) {
    if (batch.w[j] == nullptr || batch.x[j] == nullptr || batch.y[j] == nullptr) {
      return cudaErrorInvalidValue;
    }
  }
  switch (type) {
    case GgmlType::F32:
    case GgmlType::F16:
    case GgmlType::BF16:
      return matvec_float(type, batch, row_bytes, rows, cols, stream);
    default:
      return matvec_quant(type, batch, row_bytes, rows, cols, stream);
  }
}

}  // namespace expertd::kernels
