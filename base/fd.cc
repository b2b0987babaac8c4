#include "base/fd.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>

namespace expertd {

UniqueFd dup_fd(int fd) { return UniqueFd(::fcntl(fd, F_DUPFD_CLOEXEC, 0)); }

Mapping Mapping::map(size_t bytes, int prot, int flags, int fd, int64_t offset) {
  void* p = ::mmap(nullptr, bytes, prot, flags, fd, static_cast<off_t>(offset));
  if (p == MAP_FAILED) return Mapping();
  return Mapping(p, bytes);
}

void Mapping::reset() {
  if (addr_ != nullptr) {
    const int saved = errno;
    ::munmap(addr_, bytes_);
    errno = saved;
  }
  addr_ = nullptr;
  bytes_ = 0;
}

}  // namespace expertd
