// The matvec of the plain ggml formats (F32, F16, BF16). docs/KERNELS.md explains the shape of the
// matvec kernels; in short: a warp per row, each lane streaming 16-byte chunks (narrower when the
// pointers or rows are less aligned) and converting in registers; x is staged in shared memory as
// floats.
#include "kernels/matvec_float.cuh"
// The own header first (STYLE.md), then the internal ones of kernels/.
#include "kernels/blocks.cuh"
#include "kernels/matvec_common.cuh"

namespace expertd::kernels {
namespace {

using detail::kThreads;
using detail::kWarps;
using detail::LaunchCache;
using detail::LaunchShape;
using detail::plain_elem;
using detail::plan_launch;
using detail::pointer_bits;
using detail::vec_bytes;
using detail::VecOf;
using detail::warp_sum;

template <GgmlType T>
struct PlainType;
template <>
struct PlainType<GgmlType::F32> {
  static constexpr uint32_t kBytes = 4;
};
template <>
struct PlainType<GgmlType::F16> {
  static constexpr uint32_t kBytes = 2;
};
template <>
struct PlainType<GgmlType::BF16> {
  static constexpr uint32_t kBytes = 2;
};

// The dot product of one loaded chunk with the x values it multiplies (xs already offset).
template <GgmlType T>
__device__ __forceinline__ float plain_dot(uint4 v, const float* xs) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
  float r = 0.0f;
  if constexpr (T == GgmlType::F32) {
    const float4 xv = *reinterpret_cast<const float4*>(xs);
    r = fmaf(__uint_as_float(v.x), xv.x, r);
    r = fmaf(__uint_as_float(v.y), xv.y, r);
    r = fmaf(__uint_as_float(v.z), xv.z, r);
    r = fmaf(__uint_as_float(v.w), xv.w, r);
  } else {
#pragma unroll
    for (uint32_t i = 0; i < 2; ++i) {
      const float4 xv = *reinterpret_cast<const float4*>(xs + 4 * i);
      r = fmaf(plain_elem<T>(words[2 * i], 0), xv.x, r);
      r = fmaf(plain_elem<T>(words[2 * i], 1), xv.y, r);
      r = fmaf(plain_elem<T>(words[2 * i + 1], 0), xv.z, r);
      r = fmaf(plain_elem<T>(words[2 * i + 1], 1), xv.w, r);
    }
  }
  return r;
}

template <GgmlType T>
__device__ __forceinline__ float plain_dot(uint32_t v, const float* xs) {
  if constexpr (T == GgmlType::F32) {
    return __uint_as_float(v) * xs[0];
  } else {
    return fmaf(plain_elem<T>(v, 1), xs[1], plain_elem<T>(v, 0) * xs[0]);
  }
}

template <GgmlType T>
__device__ __forceinline__ float plain_dot(uint16_t v, const float* xs) {
  return plain_elem<T>(v, 0) * xs[0];
}

struct PlainArgs {
  MatvecBatch batch;
  uint64_t row_bytes;
  uint32_t rows;
  uint32_t cols;
  uint32_t rows_per_cta;
};

// Grid: (CTAs per job, jobs); a warp per row, lanes over V-byte chunks, kUnroll chunks in flight.
template <GgmlType T, int V>
__global__ void __launch_bounds__(kThreads) matvec_plain_kernel(const PlainArgs a) {
  using Vec = typename VecOf<V>::type;
  constexpr uint32_t kElems = V / PlainType<T>::kBytes;  // per chunk
  constexpr uint32_t kUnroll = 4;
  extern __shared__ __align__(16) float xsf[];
  const uint32_t job = blockIdx.y;
  const uint8_t* w = static_cast<const uint8_t*>(a.batch.w[job]);
  const float* x = a.batch.x[job];
  float* y = a.batch.y[job];
  const float* up = a.batch.up[job];
  if (up == nullptr) {
    for (uint32_t i = threadIdx.x; i < a.cols; i += kThreads) xsf[i] = x[i];
  } else {
    for (uint32_t i = threadIdx.x; i < a.cols; i += kThreads) {
      xsf[i] = detail::swiglu_value(x[i], up[i]);
    }
  }
  __syncthreads();

  const uint32_t warp = threadIdx.x / 32;
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t chunks = a.cols / kElems;
  const uint32_t row0 = blockIdx.x * a.rows_per_cta;
  const uint32_t row_end = min(a.rows, row0 + a.rows_per_cta);
  for (uint32_t row = row0 + warp; row < row_end; row += kWarps) {
    const uint8_t* src = w + uint64_t{row} * a.row_bytes;
    float acc = 0.0f;
    for (uint32_t c0 = lane; c0 < chunks; c0 += 32 * kUnroll) {
      Vec v[kUnroll];
#pragma unroll
      for (uint32_t u = 0; u < kUnroll; ++u) {
        const uint32_t c = c0 + 32 * u;
        if (c < chunks) v[u] = *reinterpret_cast<const Vec*>(src + uint64_t{c} * V);
      }
#pragma unroll
      for (uint32_t u = 0; u < kUnroll; ++u) {
        const uint32_t c = c0 + 32 * u;
        if (c < chunks) acc += plain_dot<T>(v[u], xsf + c * kElems);
      }
    }
    acc = warp_sum(acc);
    if (lane == 0) y[row] = acc;
  }
}

template <GgmlType T, int V>
cudaError_t launch_plain(const MatvecBatch& batch, uint64_t row_bytes, uint32_t rows, uint32_t cols,
                         cudaStream_t stream) {
  PlainArgs a{};
  a.batch = batch;
  a.row_bytes = row_bytes;
  a.rows = rows;
  a.cols = cols;
  const size_t smem = (size_t{cols} * sizeof(float) + 15) / 16 * 16;
  const auto kernel = matvec_plain_kernel<T, V>;
  static LaunchCache cache;
  LaunchShape shape;
  const cudaError_t e =
      plan_launch(kernel, &cache, smem, rows, batch.count, kWarps, kWarps, &shape);
  if (e != cudaSuccess) return e;
  a.rows_per_cta = shape.rows_per_cta;
  kernel<<<dim3(shape.ctas_per_job, batch.count), kThreads, smem, stream>>>(a);
  return cudaGetLastError();
}

template <GgmlType T>
cudaError_t dispatch_plain(const MatvecBatch& batch, uint64_t row_bytes, uint32_t rows,
                           uint32_t cols, cudaStream_t stream) {
  const uint32_t vec =
      vec_bytes(pointer_bits(batch) | row_bytes | uint64_t{cols} * PlainType<T>::kBytes);
  if (vec == 16) return launch_plain<T, 16>(batch, row_bytes, rows, cols, stream);
  if (vec == 4) return launch_plain<T, 4>(batch, row_bytes, rows, cols, stream);
  if constexpr (PlainType<T>::kBytes == 2) {
    if (vec == 2) return launch_plain<T, 2>(batch, row_bytes, rows, cols, stream);
  }
  return cudaErrorInvalidValue;  // not aligned to the element size
}

}  // namespace

cudaError_t matvec_float(GgmlType type, const MatvecBatch& batch, uint64_t row_bytes, uint32_t rows,
                         uint32_t cols, cudaStream_t stream) {
  switch (type) {
    case GgmlType::F32:
      return dispatch_plain<GgmlType::F32>(batch, row_bytes, rows, cols, stream);
    case GgmlType::F16:
      return dispatch_plain<GgmlType::F16>(batch, row_bytes, rows, cols, stream);
    case GgmlType::BF16:
      return dispatch_plain<GgmlType::BF16>(batch, row_bytes, rows, cols, stream);
    default:
      return cudaErrorInvalidValue;  // another family's
  }
}

}  // namespace expertd::kernels
