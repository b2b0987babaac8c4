#include "cache/shm.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

namespace expertd {

size_t page_bytes() {
  static const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

SharedRegion::~SharedRegion() { reset(); }

SharedRegion::SharedRegion(SharedRegion&& other) noexcept { *this = std::move(other); }

SharedRegion& SharedRegion::operator=(SharedRegion&& other) noexcept {
  if (this != &other) {
    reset();
    fd_ = std::exchange(other.fd_, -1);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    locked_ = std::exchange(other.locked_, false);
    lock_error_ = std::move(other.lock_error_);
  }
  return *this;
}

void SharedRegion::reset() {
  if (data_ != nullptr) ::munmap(data_, size_);  // also drops the lock
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  data_ = nullptr;
  size_ = 0;
  locked_ = false;
}

Result<SharedRegion> SharedRegion::create(const std::string& name, size_t bytes, bool lock,
                                          bool client_writable) {
  const size_t page = page_bytes();
  SharedRegion r;
  r.size_ = (bytes + page - 1) / page * page;
  if (r.size_ == 0) r.size_ = page;
  r.fd_ = ::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  auto fail = [&](const char* what) {
    const int e = errno;
    return make_error(e, fmt::format("shared region '{}' ({} bytes): {}: {}", name, r.size_, what,
                                     std::strerror(e)));
  };
  if (r.fd_ < 0) return fail("memfd_create");
  if (::ftruncate(r.fd_, static_cast<off_t>(r.size_)) != 0) return fail("ftruncate");
  if (::fcntl(r.fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    return fail("F_ADD_SEALS(shrink|grow)");
  }
  void* p = ::mmap(nullptr, r.size_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r.fd_, 0);
  if (p == MAP_FAILED) return fail("mmap");
  r.data_ = static_cast<uint8_t*>(p);
  // From here on only this mapping can write; clients get EPERM for PROT_WRITE mappings.
  const int seals = client_writable ? F_SEAL_SEAL : F_SEAL_FUTURE_WRITE | F_SEAL_SEAL;
  if (::fcntl(r.fd_, F_ADD_SEALS, seals) != 0) {
    return fail("F_ADD_SEALS(future_write|seal)");
  }
  if (lock) {
    if (::mlock(r.data_, r.size_) == 0) {
      r.locked_ = true;
    } else {
      const int e = errno;
      r.lock_error_ = fmt::format("mlock of {} bytes failed: {}{}", r.size_, std::strerror(e),
                                  e == ENOMEM || e == EPERM
                                      ? " (raise RLIMIT_MEMLOCK, e.g. LimitMEMLOCK= in the unit)"
                                      : "");
    }
  }
  return r;
}

}  // namespace expertd
