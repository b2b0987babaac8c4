#include "kernels/prefill.cuh"
#include "kernels/rope_pair.cuh"

namespace expertd::kernels {
namespace {

constexpr uint32_t kThreads = 256;
constexpr uint64_t kMaxBlocks = 1u << 16;

uint32_t blocks_for(uint64_t n) {
  const uint64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<uint32_t>(b < kMaxBlocks ? b : kMaxBlocks);
}

// As rope_kernel (rope.cu), with the position taken from the row.
template <bool kNeox>
__global__ void __launch_bounds__(kThreads)
    rope_rows_kernel(float* x, uint32_t rows, uint32_t heads, uint32_t head_dim, uint32_t n_rot,
                     uint32_t pos0, double base) {
  const uint32_t half = n_rot / 2;
  const uint64_t per_row = uint64_t{heads} * half;
  const uint64_t total = per_row * rows;
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t idx = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; idx < total; idx += stride) {
    const uint64_t r = idx / per_row;
    const uint64_t rem = idx % per_row;
    const uint64_t h = rem / half;
    detail::rope_pair<kNeox>(x + (r * heads + h) * head_dim, static_cast<uint32_t>(rem % half),
                             n_rot, static_cast<double>(pos0 + r), base);
  }
}

template <bool kNeox>
cudaError_t launch_rope_rows(float* x, uint32_t rows, uint32_t heads, uint32_t head_dim,
                             uint32_t n_rot, uint32_t pos0, float base, cudaStream_t stream) {
  if (x == nullptr || rows == 0 || heads == 0 || head_dim == 0 || n_rot == 0 || n_rot % 2 != 0 ||
      n_rot > head_dim || !(base > 0.0f)) {
    return cudaErrorInvalidValue;
  }
  rope_rows_kernel<kNeox>
      <<<blocks_for(uint64_t{rows} * heads * (n_rot / 2)), kThreads, 0, stream>>>(
          x, rows, heads, head_dim, n_rot, pos0, static_cast<double>(base));
  return cudaGetLastError();
}

template <bool kMax, typename T>
__device__ T block_reduce(T v, T* red) {
  for (int o = 16; o > 0; o >>= 1) {
    const T other = __shfl_xor_sync(0xffffffffu, v, o);
    v = kMax ? (other > v ? other : v) : v + other;
  }
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  T r = red[0];
  for (uint32_t w = 1; w < blockDim.x / 32; ++w) r = kMax ? (red[w] > r ? red[w] : r) : r + red[w];
  __syncthreads();
  return r;
}

// One block per query row. The exponentials are taken in double (as the CPU reference's softmax)
// twice, for the sum and for the output, rather than stored: the row is read from global memory
// either way.
__global__ void __launch_bounds__(kThreads)
    causal_softmax_kernel(float* s, uint32_t n_ctx, uint32_t pos0) {
  __shared__ float red_f[kThreads / 32];
  __shared__ double red_d[kThreads / 32];
  float* row = s + uint64_t{blockIdx.x} * n_ctx;
  const uint32_t valid = pos0 + blockIdx.x + 1;
  float mx = -INFINITY;
  for (uint32_t t = threadIdx.x; t < valid; t += blockDim.x) mx = fmaxf(mx, row[t]);
  mx = block_reduce<true>(mx, red_f);
  double sum = 0.0;
  for (uint32_t t = threadIdx.x; t < valid; t += blockDim.x) {
    sum += exp(static_cast<double>(row[t]) - static_cast<double>(mx));
  }
  sum = block_reduce<false>(sum, red_d);
  // Every thread has read its elements for the sum before the reduction's barriers; each writes
  // only the elements it read.
  for (uint32_t t = threadIdx.x; t < n_ctx; t += blockDim.x) {
    row[t] =
        t < valid
            ? static_cast<float>(exp(static_cast<double>(row[t]) - static_cast<double>(mx)) / sum)
            : 0.0f;
  }
}

__global__ void __launch_bounds__(kThreads)
    gather_rows_kernel(const float* src, uint64_t src_stride, const uint32_t* idx, uint32_t rows,
                       uint32_t n, float* dst) {
  const uint64_t total = uint64_t{rows} * n;
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t e = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < total; e += stride) {
    const uint64_t r = e / n;
    dst[e] = src[uint64_t{idx[r]} * src_stride + e % n];
  }
}

__global__ void __launch_bounds__(kThreads)
    scatter_rows_kernel(const float* src, const uint32_t* idx, uint32_t rows, uint32_t n,
                        float* dst) {
  const uint64_t total = uint64_t{rows} * n;
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t e = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < total; e += stride) {
    const uint64_t r = e / n;
    dst[uint64_t{idx[r]} * n + e % n] = src[e];
  }
}

// moe_combine_kernel (combine.cu) per row: a float times a float is exact in double, the sum in
// slot order, rounded once.
__global__ void __launch_bounds__(kThreads)
    moe_combine_rows_kernel(const float* eo, const float* w, float* x, uint32_t rows, uint32_t k,
                            uint32_t n) {
  const uint64_t total = uint64_t{rows} * n;
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t e = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < total; e += stride) {
    const uint64_t r = e / n;
    const uint64_t i = e % n;
    double acc = 0.0;
    for (uint32_t j = 0; j < k; ++j) {
      const uint64_t slot = r * k + j;
      acc += static_cast<double>(w[slot]) * static_cast<double>(eo[slot * n + i]);
    }
    x[e] += static_cast<float>(acc);
  }
}

}  // namespace

cudaError_t rope_neox_rows(float* x, uint32_t rows, uint32_t heads, uint32_t head_dim,
                           uint32_t n_rot, uint32_t pos0, float base, cudaStream_t stream) {
  return launch_rope_rows<true>(x, rows, heads, head_dim, n_rot, pos0, base, stream);
}

cudaError_t rope_norm_rows(float* x, uint32_t rows, uint32_t heads, uint32_t head_dim,
                           uint32_t n_rot, uint32_t pos0, float base, cudaStream_t stream) {
  return launch_rope_rows<false>(x, rows, heads, head_dim, n_rot, pos0, base, stream);
}

cudaError_t causal_softmax(float* s, uint32_t rows, uint32_t n_ctx, uint32_t pos0,
                           cudaStream_t stream) {
  if (s == nullptr || rows == 0 || n_ctx == 0 || rows > 0x7fffffffu ||
      uint64_t{pos0} + rows > n_ctx) {
    return cudaErrorInvalidValue;
  }
  causal_softmax_kernel<<<rows, kThreads, 0, stream>>>(s, n_ctx, pos0);
  return cudaGetLastError();
}

cudaError_t gather_rows(const float* src, const uint32_t* idx, uint32_t rows, uint32_t n,
                        float* dst, cudaStream_t stream) {
  if (src == nullptr || idx == nullptr || dst == nullptr || rows == 0 || n == 0) {
    return cudaErrorInvalidValue;
  }
  gather_rows_kernel<<<blocks_for(uint64_t{rows} * n), kThreads, 0, stream>>>(src, n, idx, rows, n,
                                                                              dst);
  return cudaGetLastError();
}

cudaError_t gather_rows_strided(const float* src, uint64_t src_stride, const uint32_t* idx,
                                uint32_t rows, uint32_t n, float* dst, cudaStream_t stream) {
  if (src == nullptr || idx == nullptr || dst == nullptr || rows == 0 || n == 0 || src_stride < n) {
    return cudaErrorInvalidValue;
  }
  gather_rows_kernel<<<blocks_for(uint64_t{rows} * n), kThreads, 0, stream>>>(src, src_stride, idx,
                                                                              rows, n, dst);
  return cudaGetLastError();
}

cudaError_t scatter_rows(const float* src, const uint32_t* idx, uint32_t rows, uint32_t n,
                         float* dst, cudaStream_t stream) {
  if (src == nullptr || idx == nullptr || dst == nullptr || rows == 0 || n == 0) {
    return cudaErrorInvalidValue;
  }
  scatter_rows_kernel<<<blocks_for(uint64_t{rows} * n), kThreads, 0, stream>>>(src, idx, rows, n,
                                                                               dst);
  return cudaGetLastError();
}

cudaError_t moe_combine_rows(const float* eo, const float* w, float* x, uint32_t rows, uint32_t k,
                             uint32_t n, cudaStream_t stream) {
  if (eo == nullptr || w == nullptr || x == nullptr || rows == 0 || k == 0 || n == 0) {
    return cudaErrorInvalidValue;
  }
  moe_combine_rows_kernel<<<blocks_for(uint64_t{rows} * n), kThreads, 0, stream>>>(eo, w, x, rows,
                                                                                   k, n);
  return cudaGetLastError();
}

}  // namespace expertd::kernels
