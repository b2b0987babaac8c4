// Owners of kernel resources: a file descriptor (UniqueFd) and a memory mapping (Mapping). Both
// are move-only; the destructor does the one cleanup (close / munmap), and a moved-from owner
// holds nothing. Code that must hand a raw fd to the kernel or to another owner uses get() or
// release(); nothing else closes or unmaps by hand.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

#include "expertd/unique_fd.h"  // UniqueFd (public: the client library returns it)

namespace expertd {

// dup(2) with FD_CLOEXEC; an invalid UniqueFd (errno set) on failure.
UniqueFd dup_fd(int fd);

class Mapping {
 public:
  Mapping() = default;
  // Owns [addr, addr + bytes) as returned by mmap(2).
  Mapping(void* addr, size_t bytes) : addr_(addr), bytes_(bytes) {}
  Mapping(Mapping&& o) noexcept
      : addr_(std::exchange(o.addr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  Mapping& operator=(Mapping&& o) noexcept {
    if (this != &o) {
      reset();
      addr_ = std::exchange(o.addr_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() { reset(); }

  // mmap(2); an empty Mapping (errno set) on failure.
  static Mapping map(size_t bytes, int prot, int flags, int fd, int64_t offset);

  void* get() const { return addr_; }
  uint8_t* data() const { return static_cast<uint8_t*>(addr_); }
  size_t size() const { return bytes_; }
  bool valid() const { return addr_ != nullptr; }
  // Unmaps (errno is preserved).
  void reset();

 private:
  void* addr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace expertd
