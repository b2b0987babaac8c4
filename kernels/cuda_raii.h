// Owners of CUDA and cuBLAS resources: a stream (CudaStream), an event (CudaEvent), device memory
// (DeviceBytes), pinned host memory (PinnedBytes), a host range registered with CUDA
// (HostRegistration) and a cuBLAS handle (CublasHandle). Each is move-only; its destructor does
// the one cleanup, and a default-constructed or moved-from owner holds nothing. Nothing else in
// engine/, kernels/ or bench/ destroys, frees or unregisters by hand.
//
// Creation returns a Result whose error names the call (kernels/check.h). A failed CUDA creation
// also clears the runtime's last error: the failure is reported once, by that Result, and not again
// by the next launcher's cudaGetLastError().
//
// Destruction ignores the cleanup call's result on purpose. A destructor cannot report, and these
// calls fail in practice only on a sticky error (a kernel fault), which the call that met it has
// already reported and every later call repeats; a leaked handle in a context that is lost anyway
// costs nothing. A non-sticky error a failed cleanup leaves is cleared, so that the next checked
// call is not blamed for it. Nothing here throws or aborts: an owner can be destroyed in any state.
//
// Lifetimes between owners are the holder's business: memory must outlive the work enqueued on it
// (synchronise the stream first), a registration the copies and kernels that read through it. A
// struct of owners states that order in its member order (members are destroyed last to first).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <utility>

#include "expertd/result.h"
#include "kernels/check.h"

namespace expertd::cuda {
namespace detail {

// The result of a cleanup call, deliberately dropped (see the header comment).
inline void ignore_cleanup(cudaError_t e) {
  if (e != cudaSuccess) (void)cudaGetLastError();
}

inline Error creation_failed(cudaError_t e, const char* call, int line) {
  (void)cudaGetLastError();
  return cuda_error(e, call, __FILE__, line);
}

}  // namespace detail

class CudaStream {
 public:
  // Non-blocking by default: the engine's and the bench's streams must not serialise with the
  // legacy default stream.
  static Result<CudaStream> create(unsigned flags = cudaStreamNonBlocking) {
    CudaStream s;
    const cudaError_t e = cudaStreamCreateWithFlags(&s.s_, flags);
    if (e != cudaSuccess) return detail::creation_failed(e, "cudaStreamCreateWithFlags", __LINE__);
    return s;
  }
  CudaStream() = default;
  CudaStream(CudaStream&& o) noexcept : s_(std::exchange(o.s_, nullptr)) {}
  CudaStream& operator=(CudaStream&& o) noexcept {
    if (this != &o) {
      reset();
      s_ = std::exchange(o.s_, nullptr);
    }
    return *this;
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  // Work still enqueued completes; the stream's resources go when it has.
  ~CudaStream() { reset(); }

  cudaStream_t get() const { return s_; }
  bool valid() const { return s_ != nullptr; }

 private:
  void reset() {
    if (s_ != nullptr) detail::ignore_cleanup(cudaStreamDestroy(std::exchange(s_, nullptr)));
  }
  cudaStream_t s_ = nullptr;
};

class CudaEvent {
 public:
  static Result<CudaEvent> create(unsigned flags = cudaEventDefault) {
    CudaEvent ev;
    const cudaError_t e = cudaEventCreateWithFlags(&ev.e_, flags);
    if (e != cudaSuccess) return detail::creation_failed(e, "cudaEventCreateWithFlags", __LINE__);
    return ev;
  }
  CudaEvent() = default;
  CudaEvent(CudaEvent&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
  CudaEvent& operator=(CudaEvent&& o) noexcept {
    if (this != &o) {
      reset();
      e_ = std::exchange(o.e_, nullptr);
    }
    return *this;
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  ~CudaEvent() { reset(); }

  cudaEvent_t get() const { return e_; }
  bool valid() const { return e_ != nullptr; }

 private:
  void reset() {
    if (e_ != nullptr) detail::ignore_cleanup(cudaEventDestroy(std::exchange(e_, nullptr)));
  }
  cudaEvent_t e_ = nullptr;
};

// cudaMalloc'ed bytes. Only the holder knows whether work in flight still reads or writes them:
// synchronise its streams before this goes.
class DeviceBytes {
 public:
  static Result<DeviceBytes> alloc(uint64_t bytes) {
    DeviceBytes m;
    const cudaError_t e = cudaMalloc(&m.p_, bytes);
    if (e != cudaSuccess) return detail::creation_failed(e, "cudaMalloc", __LINE__);
    m.size_ = bytes;
    return m;
  }
  DeviceBytes() = default;
  DeviceBytes(DeviceBytes&& o) noexcept
      : p_(std::exchange(o.p_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  DeviceBytes& operator=(DeviceBytes&& o) noexcept {
    if (this != &o) {
      reset();
      p_ = std::exchange(o.p_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  ~DeviceBytes() { reset(); }

  template <typename T = uint8_t>
  T* get() const {
    return static_cast<T*>(p_);
  }
  uint64_t size() const { return size_; }
  bool valid() const { return p_ != nullptr; }

 private:
  void reset() {
    if (p_ != nullptr) detail::ignore_cleanup(cudaFree(std::exchange(p_, nullptr)));
    size_ = 0;
  }
  void* p_ = nullptr;
  uint64_t size_ = 0;
};

// cudaMallocHost'ed (pinned, mapped) bytes.
class PinnedBytes {
 public:
  static Result<PinnedBytes> alloc(uint64_t bytes) {
    PinnedBytes m;
    const cudaError_t e = cudaMallocHost(&m.p_, bytes);
    if (e != cudaSuccess) return detail::creation_failed(e, "cudaMallocHost", __LINE__);
    m.size_ = bytes;
    return m;
  }
  PinnedBytes() = default;
  PinnedBytes(PinnedBytes&& o) noexcept
      : p_(std::exchange(o.p_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  PinnedBytes& operator=(PinnedBytes&& o) noexcept {
    if (this != &o) {
      reset();
      p_ = std::exchange(o.p_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  PinnedBytes(const PinnedBytes&) = delete;
  PinnedBytes& operator=(const PinnedBytes&) = delete;
  ~PinnedBytes() { reset(); }

  template <typename T = uint8_t>
  T* get() const {
    return static_cast<T*>(p_);
  }
  uint64_t size() const { return size_; }
  bool valid() const { return p_ != nullptr; }

 private:
  void reset() {
    if (p_ != nullptr) detail::ignore_cleanup(cudaFreeHost(std::exchange(p_, nullptr)));
    size_ = 0;
  }
  void* p_ = nullptr;
  uint64_t size_ = 0;
};

// Host memory someone else owns (a mapping), page-locked and known to CUDA by cudaHostRegister
// until this goes. It must go before the memory is unmapped, and after the last copy or kernel
// that reads through it has completed.
class HostRegistration {
 public:
  // `flags` as cudaHostRegister's, e.g. cudaHostRegisterReadOnly | cudaHostRegisterMapped for a
  // PROT_READ mapping the GPU reads in place.
  static Result<HostRegistration> create(const void* host, size_t bytes, unsigned flags) {
    HostRegistration r;
    // cudaHostRegister takes a non-const pointer; with cudaHostRegisterReadOnly nothing writes.
    void* p = const_cast<void*>(host);
    const cudaError_t e = cudaHostRegister(p, bytes, flags);
    if (e != cudaSuccess) return detail::creation_failed(e, "cudaHostRegister", __LINE__);
    r.p_ = p;
    r.size_ = bytes;
    return r;
  }
  HostRegistration() = default;
  HostRegistration(HostRegistration&& o) noexcept
      : p_(std::exchange(o.p_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  HostRegistration& operator=(HostRegistration&& o) noexcept {
    if (this != &o) {
      reset();
      p_ = std::exchange(o.p_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  HostRegistration(const HostRegistration&) = delete;
  HostRegistration& operator=(const HostRegistration&) = delete;
  ~HostRegistration() { reset(); }

  const uint8_t* host() const { return static_cast<const uint8_t*>(p_); }
  size_t size() const { return size_; }
  bool valid() const { return p_ != nullptr; }

 private:
  void reset() {
    if (p_ != nullptr) detail::ignore_cleanup(cudaHostUnregister(std::exchange(p_, nullptr)));
    size_ = 0;
  }
  void* p_ = nullptr;
  size_t size_ = 0;
};

// A cuBLAS handle bound to one stream.
class CublasHandle {
 public:
  static Result<CublasHandle> create(cudaStream_t stream) {
    CublasHandle c;
    EXPERTD_CUBLAS_TRY(cublasCreate(&c.h_));
    EXPERTD_CUBLAS_TRY(cublasSetStream(c.h_, stream));
    return c;
  }
  CublasHandle() = default;
  CublasHandle(CublasHandle&& o) noexcept : h_(std::exchange(o.h_, nullptr)) {}
  CublasHandle& operator=(CublasHandle&& o) noexcept {
    if (this != &o) {
      reset();
      h_ = std::exchange(o.h_, nullptr);
    }
    return *this;
  }
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  ~CublasHandle() { reset(); }

  cublasHandle_t get() const { return h_; }
  bool valid() const { return h_ != nullptr; }

 private:
  void reset() {
    // Dropped on purpose, as above; cuBLAS keeps no last-error state to clear.
    if (h_ != nullptr) (void)cublasDestroy(std::exchange(h_, nullptr));
  }
  cublasHandle_t h_ = nullptr;
};

}  // namespace expertd::cuda
