// OwnedRing: the owner of one io_uring instance (its fd and its mmapped SQ/CQ rings). Move-only;
// the destructor does the one cleanup, io_uring_queue_exit. The struct io_uring lives on the heap
// so its address stays put when the owner moves (liburing keeps pointers into the rings, not into
// the struct, but nothing promises that).
//
// Exiting a ring does not wait for its requests: the kernel finishes reads still in flight on its
// own, into their buffers. An owner whose buffers die with it reaps its requests before the ring
// goes (UringBackend::drain_for_exit, GgufWriter::DirectIo).
#pragma once

#include <liburing.h>

#include <cerrno>
#include <memory>
#include <utility>

namespace expertd {

class OwnedRing {
 public:
  OwnedRing() = default;
  OwnedRing(OwnedRing&& o) noexcept : ring_(std::move(o.ring_)) {}
  OwnedRing& operator=(OwnedRing&& o) noexcept {
    if (this != &o) {
      reset();
      ring_ = std::move(o.ring_);
    }
    return *this;
  }
  OwnedRing(const OwnedRing&) = delete;
  OwnedRing& operator=(const OwnedRing&) = delete;
  ~OwnedRing() { reset(); }

  // io_uring_queue_init_params; 0 or -errno (the owner then holds nothing). `params` is in/out.
  int init(unsigned entries, io_uring_params& params) {
    reset();
    auto ring = std::make_unique<io_uring>();
    const int rc = io_uring_queue_init_params(entries, ring.get(), &params);
    if (rc == 0) ring_ = std::move(ring);
    return rc;
  }

  bool valid() const { return ring_ != nullptr; }
  io_uring* get() const { return ring_.get(); }

  // Exits the ring (errno is preserved: a cleanup on an error path must not change the error).
  void reset() {
    if (ring_ == nullptr) return;
    const int saved = errno;
    io_uring_queue_exit(ring_.get());
    errno = saved;
    ring_.reset();
  }

 private:
  std::unique_ptr<io_uring> ring_;
};

}  // namespace expertd
