// The row-batched kernels of GpuEngine::prefill (a chunk of prompt positions at once; the GEMMs
// themselves are cuBLAS). Row-major throughout: row r of a [rows][n] buffer starts at r * n.
//
// rope_neox_rows: rope_neox (kernels/rope.cuh) of `rows` consecutive rows of `heads` vectors of
//   head_dim, row r at position pos0 + r; the same double angle math, so each row is
//   bit-identical to rope_neox at its position. rope_norm_rows: the same for rope_norm.
// causal_softmax: s is `rows` rows of n_ctx scores (row stride n_ctx); row r is the query at
//   position pos0 + r and keeps columns 0..pos0+r (softmax over them, max-subtracted, exp and sum
//   in double), the rest become 0. Needs pos0 + rows <= n_ctx.
// gather_rows: dst[i] = src[idx[i]] for i < rows (n floats each; the embedding lookup of a chunk
//   and the rows routed to one expert). gather_rows_strided: the same from rows `src_stride`
//   floats apart (>= n: padded rows).
// scatter_rows: dst[idx[i]] = src[i] for i < rows; the indices must be distinct.
// moe_combine_rows: x[r][i] += sum_j w[r][j] * eo[r][j][i] for r < rows, j < k: moe_combine
//   (kernels/combine.cuh) of each row, the same double sum in route-slot order.
// Every launcher rejects a null pointer or a zero size with cudaErrorInvalidValue, launching
// nothing.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace expertd::kernels {

cudaError_t rope_neox_rows(float* x, uint32_t rows, uint32_t heads, uint32_t head_dim,
                           uint32_t n_rot, uint32_t pos0, float base, cudaStream_t stream);
cudaError_t rope_norm_rows(float* x, uint32_t rows, uint32_t heads, uint32_t head_dim,
                           uint32_t n_rot, uint32_t pos0, float base, cudaStream_t stream);

cudaError_t causal_softmax(float* s, uint32_t rows, uint32_t n_ctx, uint32_t pos0,
                           cudaStream_t stream);

cudaError_t gather_rows(const float* src, const uint32_t* idx, uint32_t rows, uint32_t n,
                        float* dst, cudaStream_t stream);

cudaError_t gather_rows_strided(const float* src, uint64_t src_stride, const uint32_t* idx,
                                uint32_t rows, uint32_t n, float* dst, cudaStream_t stream);

cudaError_t scatter_rows(const float* src, const uint32_t* idx, uint32_t rows, uint32_t n,
                         float* dst, cudaStream_t stream);

cudaError_t moe_combine_rows(const float* eo, const float* w, float* x, uint32_t rows, uint32_t k,
                             uint32_t n, cudaStream_t stream);

}  // namespace expertd::kernels
