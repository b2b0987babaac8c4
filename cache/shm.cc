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

namespace {

// Faults every page of [data, data + bytes) for write (see create()): MADV_POPULATE_WRITE (Linux
// 5.14), else one store per page (the pages are new, so a zero changes nothing).
void populate_dirty(uint8_t* data, size_t bytes) {
  if (::madvise(data, bytes, MADV_POPULATE_WRITE) == 0) return;
  const size_t page = page_bytes();
  for (size_t at = 0; at < bytes; at += page) {
    // Volatile: a store of the zero already there must still reach the page.
    *static_cast<volatile uint8_t*>(data + at) = 0;
  }
}

}  // namespace

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
  r.map_ = Mapping::map(size, PROT_READ | PROT_WRITE, MAP_SHARED, r.fd_.get(), 0);
  if (!r.map_.valid()) return fail("mmap");
  // Every page is populated with a write fault, so each page of the memfd is dirty from the start
  // and stays so (tmpfs cleans a page only by swapping it out). MAP_POPULATE faults a shared
  // mapping for read ("we would not want to dirty them for nothing", mm/gup.c): its pages start
  // clean, and a page written only by an io_uring READ_FIXED (O_DIRECT into a registered, pinned
  // buffer: the kernel writes the page, never through our page table, and does not dirty it)
  // stays clean. Once our mapping and the ring's pin are gone (SIGUSR2's exec, a crash under
  // systemd's fd store) such a page is clean, unmapped and unreferenced: page-cache invalidation
  // (`echo 1 > /proc/sys/vm/drop_caches`) drops it, and the successor's copy reads zeros
  // (docs/RELIABILITY.md, "Warm restart").
  populate_dirty(r.map_.data(), size);
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
