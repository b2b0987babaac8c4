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

SharedRegion::SharedRegion(SharedRegion&& other) noexcept
    : fd_(std::move(other.fd_)),
      map_(std::move(other.map_)),
      locked_(std::exchange(other.locked_, false)),
      lock_error_(std::move(other.lock_error_)) {}

SharedRegion& SharedRegion::operator=(SharedRegion&& other) noexcept {
  if (this != &other) {
    map_ = std::move(other.map_);
    fd_ = std::move(other.fd_);
    locked_ = std::exchange(other.locked_, false);
    lock_error_ = std::move(other.lock_error_);
  }
  return *this;
}

Result<SharedRegion> SharedRegion::create(const std::string& name, size_t bytes, bool lock,
                                          bool client_writable) {
  const size_t page = page_bytes();
  SharedRegion r;
  size_t size = (bytes + page - 1) / page * page;
  if (size == 0) size = page;
  // Called right after the failing call: errno is read before anything else runs.
  auto fail = [&](const char* what) {
    const int e = errno;
    return make_error(e, fmt::format("shared region '{}' ({} bytes): {}: {}", name, size, what,
                                     std::strerror(e)));
  };
  r.fd_ = UniqueFd(::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!r.fd_.valid()) return fail("memfd_create");
  if (::ftruncate(r.fd_.get(), static_cast<off_t>(size)) != 0) return fail("ftruncate");
  if (::fcntl(r.fd_.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    return fail("F_ADD_SEALS(shrink|grow)");
  }
  r.map_ = Mapping::map(size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r.fd_.get(), 0);
  if (!r.map_.valid()) return fail("mmap");
  // From here on only this mapping can write; clients get EPERM for PROT_WRITE mappings.
  const int seals = client_writable ? F_SEAL_SEAL : F_SEAL_FUTURE_WRITE | F_SEAL_SEAL;
  if (::fcntl(r.fd_.get(), F_ADD_SEALS, seals) != 0) {
    return fail("F_ADD_SEALS(future_write|seal)");
  }
  if (lock) {
    if (::mlock(r.map_.get(), size) == 0) {
      r.locked_ = true;
    } else {
      const int e = errno;
      r.lock_error_ = fmt::format("mlock of {} bytes failed: {}{}", size, std::strerror(e),
                                  e == ENOMEM || e == EPERM
                                      ? " (raise RLIMIT_MEMLOCK, e.g. LimitMEMLOCK= in the unit)"
                                      : "");
    }
  }
  return r;
}

}  // namespace expertd
