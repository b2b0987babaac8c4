// What the two matvec families (matvec_float.cu, matvec_quant.cu) share: the CTA size, the
// vector types of the weight loads, the warp reduction, and the launch planning (one wave over the
// SMs; the driver's answers cached per kernel).
//
// Internal to kernels/ (included by .cu files only); everything is in kernels::detail.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "kernels/matvec.cuh"

namespace expertd::kernels::detail {

inline constexpr uint32_t kThreads = 256;
inline constexpr uint32_t kWarps = kThreads / 32;
inline constexpr uint32_t kFull = 0xffffffffu;
inline constexpr size_t kDefaultSmem = 48 * 1024;

template <int V>
struct VecOf;
template <>
struct VecOf<16> {
  using type = uint4;
};
template <>
struct VecOf<4> {
  using type = uint32_t;
};
template <>
struct VecOf<2> {
  using type = uint16_t;
};
template <>
struct VecOf<1> {
  using type = uint8_t;
};

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

struct LaunchShape {
  uint32_t ctas_per_job = 0;
  uint32_t rows_per_cta = 0;
};

// What plan_launch needs from the driver for one kernel, kept from the kernel's last launch so a
// repeated call costs a cudaGetDevice instead of attribute and occupancy queries (several
// microseconds, which a decode step pays per launch): bits 0-15 the SM count, 16-23 the
// occupancy, 24-47 the dynamic shared memory it was computed for, 48-55 the device, 63 valid.
// Racing writers store the same value.
struct LaunchCache {
  std::atomic<uint64_t> packed{0};
};

inline constexpr uint64_t kCacheValid = uint64_t{1} << 63;

// One CTA's rows are a contiguous range; its size is a multiple of `granule` (the rows the CTA's
// groups take per step) and at least `min_rows`. Aim for a single wave over the SMs at the
// kernel's occupancy (a second wave of a few CTAs would double the time of a small matvec).
template <typename Kernel>
cudaError_t plan_launch(Kernel kernel, LaunchCache* cache, size_t smem, uint32_t rows,
                        uint32_t jobs, uint32_t granule, uint32_t min_rows, LaunchShape* shape) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const uint64_t key = kCacheValid | (uint64_t(dev & 0xff) << 48) | (uint64_t(smem) << 24);
  const uint64_t cached = cache->packed.load(std::memory_order_relaxed);
  uint64_t occupancy = (cached >> 16) & 0xffu;
  uint64_t sms = cached & 0xffffu;
  if ((cached & ~uint64_t{0xffffff}) != key) {
    int optin = 0;
    e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (e != cudaSuccess) return e;
    if (smem > static_cast<size_t>(optin)) return cudaErrorInvalidValue;  // cols too large
    if (smem > kDefaultSmem) {
      // The device's whole opt-in limit, not `smem`: a smaller value set by a concurrent caller
      // could then not fail a larger launch.
      e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin);
      if (e != cudaSuccess) return e;
    }
    int n = 0;
    e = cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    if (e != cudaSuccess) return e;
    sms = static_cast<uint64_t>(n > 0 ? (n < 0xffff ? n : 0xffff) : 1);
    int occ = 0;
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, kThreads, smem);
    if (e != cudaSuccess) return e;
    occupancy = static_cast<uint64_t>(occ < 1 ? 1 : (occ < 0xff ? occ : 0xff));
    if (dev >= 0 && dev <= 0xff && smem < (size_t{1} << 24)) {
      cache->packed.store(key | (occupancy << 16) | sms, std::memory_order_relaxed);
    }
  }
  const uint64_t resident = occupancy * sms;
  const uint64_t per_job = resident / jobs > 0 ? resident / jobs : 1;
  uint64_t rpc = (rows + per_job - 1) / per_job;
  if (rpc < min_rows) rpc = min_rows;
  rpc = (rpc + granule - 1) / granule * granule;
  shape->rows_per_cta = static_cast<uint32_t>(rpc);
  shape->ctas_per_job = static_cast<uint32_t>((rows + rpc - 1) / rpc);
  return cudaSuccess;
}

// The widest of 16, 4, 2 bytes dividing every value or'ed into `bits`; 0 if none does (the
// quantised family then takes single bytes for MXFP4, whose 17-byte blocks allow any address).
inline uint32_t vec_bytes(uint64_t bits) {
  if (bits % 16 == 0) return 16;
  if (bits % 4 == 0) return 4;
  if (bits % 2 == 0) return 2;
  return 0;
}

inline uint64_t pointer_bits(const MatvecBatch& batch) {
  uint64_t bits = 0;
  for (uint32_t j = 0; j < batch.count; ++j) bits |= reinterpret_cast<uintptr_t>(batch.w[j]);
  return bits;
}

}  // namespace expertd::kernels::detail
