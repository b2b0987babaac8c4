// Checked CUDA and cuBLAS calls. Every call the engine and the kernels' hosts make goes through one
// of these, so a failure names the call, the file and the line:
//   "cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, s) failed at engine/gpu_engine.cc:212:
//    cudaErrorInvalidValue (invalid argument)"
// EXPERTD_CUDA_TRY / EXPERTD_CUBLAS_TRY return an expertd::Error from the enclosing function (which
// returns Status or Result<T>). Kernel launchers in kernels/*.cuh return cudaGetLastError() after
// the launch, so `EXPERTD_CUDA_TRY(kernels::rms_norm(...))` checks the launch the same way.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <cerrno>
#include <string>

#include "expertd/result.h"

namespace expertd::cuda {

inline Error cuda_error(cudaError_t e, const char* call, const char* file, int line) {
  return Error{EIO, fmt::format("{} failed at {}:{}: {} ({})", call, file, line,
                                cudaGetErrorName(e), cudaGetErrorString(e))};
}

inline Error cublas_error(cublasStatus_t s, const char* call, const char* file, int line) {
  return Error{EIO, fmt::format("{} failed at {}:{}: {} ({})", call, file, line,
                                cublasGetStatusName(s), cublasGetStatusString(s))};
}

}  // namespace expertd::cuda

#define EXPERTD_CUDA_TRY(call)                                                        \
  do {                                                                                \
    const cudaError_t expertd_cuda_e_ = (call);                                       \
    if (expertd_cuda_e_ != cudaSuccess)                                               \
      return ::expertd::cuda::cuda_error(expertd_cuda_e_, #call, __FILE__, __LINE__); \
  } while (0)

#define EXPERTD_CUBLAS_TRY(call)                                                          \
  do {                                                                                    \
    const cublasStatus_t expertd_cublas_s_ = (call);                                      \
    if (expertd_cublas_s_ != CUBLAS_STATUS_SUCCESS)                                       \
      return ::expertd::cuda::cublas_error(expertd_cublas_s_, #call, __FILE__, __LINE__); \
  } while (0)
