// UniqueFd: the move-only owner of a file descriptor. A public installed header (the client
// library hands out the fds of a model's shard files in them) and, through base/fd.h, the owner
// every fd in the tree lives in. Header-only, so the installed library exports no symbol for it.
// The destructor does the one cleanup (close); a moved-from owner holds nothing.
#pragma once

#include <unistd.h>

#include <cerrno>
#include <utility>

namespace expertd {

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) reset(std::exchange(o.fd_, -1));
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  // Gives the fd up without closing it.
  [[nodiscard]] int release() { return std::exchange(fd_, -1); }
  // Closes the held fd (errno is preserved) and holds `fd` instead.
  void reset(int fd = -1) {
    if (fd_ >= 0 && fd_ != fd) {
      const int saved = errno;  // a cleanup on an error path must not change the error
      ::close(fd_);             // not retried on EINTR: on Linux the fd is released either way
      errno = saved;
    }
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

}  // namespace expertd
