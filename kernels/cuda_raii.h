// Owners of CUDA and cuBLAS resources: a stream (CudaStream), an event (CudaEvent), device memory
// (DeviceBytes), pinned host memory (PinnedBytes), a host range registered with CUDA
// (HostRegistration), a cuBLAS handle (CublasHandle) and an instantiated CUDA graph
// (CudaGraphExec). Each is move-only; its destructor does
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

// A move-only owner of one handle H (a pointer type) that Free releases, with a byte count for
// memory. The owners below add only how they are created and what they hand out.
template <typename H, void (*Free)(H)>
class Owner {
 public:
  Owner() = default;
  Owner(Owner&& o) noexcept : h_(std::exchange(o.h_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  Owner& operator=(Owner&& o) noexcept {
    if (this != &o) {
      reset();
      h_ = std::exchange(o.h_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  Owner(const Owner&) = delete;
  Owner& operator=(const Owner&) = delete;
  ~Owner() { reset(); }

  bool valid() const { return h_ != nullptr; }

 protected:
  H h_ = nullptr;
  size_t size_ = 0;

 private:
  void reset() {
    if (h_ != nullptr) Free(std::exchange(h_, nullptr));
    size_ = 0;
  }
};

inline void destroy_stream(cudaStream_t s) { ignore_cleanup(cudaStreamDestroy(s)); }
inline void destroy_event(cudaEvent_t e) { ignore_cleanup(cudaEventDestroy(e)); }
inline void free_device(void* p) { ignore_cleanup(cudaFree(p)); }
inline void free_pinned(void* p) { ignore_cleanup(cudaFreeHost(p)); }
inline void unregister_host(void* p) { ignore_cleanup(cudaHostUnregister(p)); }
inline void destroy_graph(cudaGraph_t g) { ignore_cleanup(cudaGraphDestroy(g)); }
inline void destroy_graph_exec(cudaGraphExec_t g) { ignore_cleanup(cudaGraphExecDestroy(g)); }
// Dropped on purpose, as above; cuBLAS keeps no last-error state to clear.
inline void destroy_cublas(cublasHandle_t h) { (void)cublasDestroy(h); }

}  // namespace detail

// Work still enqueued when a stream's owner goes completes; the stream's resources go when it has.
class CudaStream : public detail::Owner<cudaStream_t, detail::destroy_stream> {
 public:
  // Non-blocking by default: the engine's and the bench's streams must not serialise with the
  // legacy default stream.
  static Result<CudaStream> create(unsigned flags = cudaStreamNonBlocking) {
    CudaStream s;
    const cudaError_t e = cudaStreamCreateWithFlags(&s.h_, flags);
    if (e != cudaSuccess) return detail::creation_failed(e, "cudaStreamCreateWithFlags", __LINE__);
    return s;
  }
  cudaStream_t get() const { return h_; }
};

class CudaEvent : public detail::Owner<cudaEvent_t, detail::destroy_event> {
 public:
  static Result<CudaEvent> create(unsigned flags = cudaEventDefault) {
    CudaEvent ev;
    const cudaError_t e = cudaEventCreateWithFlags(&ev.h_, flags);
    if (e != cudaSuccess) return detail::creation_failed(e, "cudaEventCreateWithFlags", __LINE__);
    return ev;
  }
  cudaEvent_t get() const { return h_; }
};

namespace detail {

// cudaMallocHost is overloaded (a template too): these give each allocator one address.
inline cudaError_t malloc_device(void** p, size_t bytes) { return cudaMalloc(p, bytes); }
inline cudaError_t malloc_pinned(void** p, size_t bytes) { return cudaMallocHost(p, bytes); }
inline constexpr char kCudaMalloc[] = "cudaMalloc";
inline constexpr char kCudaMallocHost[] = "cudaMallocHost";

// Bytes that Alloc allocates and Free frees.
template <cudaError_t (*Alloc)(void**, size_t), void (*Free)(void*), const char* kCall>
class Bytes : public Owner<void*, Free> {
 public:
  static Result<Bytes> alloc(uint64_t bytes) {
    Bytes m;
    const cudaError_t e = Alloc(&m.h_, bytes);
    if (e != cudaSuccess) return creation_failed(e, kCall, __LINE__);
    m.size_ = bytes;
    return m;
  }
  template <typename T = uint8_t>
  T* get() const {
    return static_cast<T*>(this->h_);
  }
  uint64_t size() const { return this->size_; }
};

}  // namespace detail

// cudaMalloc'ed bytes. Only the holder knows whether work in flight still reads or writes them:
// synchronise its streams before this goes.
using DeviceBytes = detail::Bytes<detail::malloc_device, detail::free_device, detail::kCudaMalloc>;

// cudaMallocHost'ed (pinned, mapped) bytes.
using PinnedBytes =
    detail::Bytes<detail::malloc_pinned, detail::free_pinned, detail::kCudaMallocHost>;

// Host memory someone else owns (a mapping), page-locked and known to CUDA by cudaHostRegister
// until this goes. It must go before the memory is unmapped, and after the last copy or kernel
// that reads through it has completed.
class HostRegistration : public detail::Owner<void*, detail::unregister_host> {
 public:
  // `flags` as cudaHostRegister's, e.g. cudaHostRegisterReadOnly | cudaHostRegisterMapped for a
  // PROT_READ mapping the GPU reads in place.
  static Result<HostRegistration> create(const void* host, size_t bytes, unsigned flags) {
    HostRegistration r;
    // cudaHostRegister takes a non-const pointer; with cudaHostRegisterReadOnly nothing writes.
    void* p = const_cast<void*>(host);
    const cudaError_t e = cudaHostRegister(p, bytes, flags);
    if (e != cudaSuccess) return detail::creation_failed(e, "cudaHostRegister", __LINE__);
    r.h_ = p;
    r.size_ = bytes;
    return r;
  }
  const uint8_t* host() const { return static_cast<const uint8_t*>(h_); }
  size_t size() const { return size_; }
};

// A cuBLAS handle bound to one stream.
class CublasHandle : public detail::Owner<cublasHandle_t, detail::destroy_cublas> {
 public:
  static Result<CublasHandle> create(cudaStream_t stream) {
    CublasHandle c;
    EXPERTD_CUBLAS_TRY(cublasCreate(&c.h_));
    EXPERTD_CUBLAS_TRY(cublasSetStream(c.h_, stream));
    return c;
  }
  cublasHandle_t get() const { return h_; }
};

// An executable graph of the work `enqueue` puts on `stream`, captured in relaxed mode (the
// launchers' one-time driver queries are allowed during capture). Launched on any stream with
// cudaGraphLaunch; it must not outlive the memory its kernels use.
class CudaGraphExec : public detail::Owner<cudaGraphExec_t, detail::destroy_graph_exec> {
 public:
  template <typename Enqueue>
  static Result<CudaGraphExec> capture(cudaStream_t stream, Enqueue enqueue) {
    EXPERTD_CUDA_TRY(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
    const Status st = enqueue();
    cudaGraph_t graph = nullptr;
    const cudaError_t end = cudaStreamEndCapture(stream, &graph);
    if (!st) {
      if (graph != nullptr) detail::destroy_graph(graph);
      return st.error();
    }
    if (end != cudaSuccess) return detail::creation_failed(end, "cudaStreamEndCapture", __LINE__);
    CudaGraphExec g;
    const cudaError_t e = cudaGraphInstantiate(&g.h_, graph, 0);
    detail::destroy_graph(graph);  // the executable graph keeps what it needs
    if (e != cudaSuccess) return detail::creation_failed(e, "cudaGraphInstantiate", __LINE__);
    return g;
  }
  cudaGraphExec_t get() const { return h_; }
};

}  // namespace expertd::cuda
