// SharedRegion: a sealed memfd mapped read-write by its owner (the daemon) and shareable with
// clients, who can only map it read-only.
//
// Created with MFD_ALLOW_SEALING, sized once, sealed against shrink and grow, mapped shared and
// populated with write faults (every page dirty: see create()), then sealed with
// F_SEAL_FUTURE_WRITE: the daemon's mapping stays writable, any later writable mapping (or
// write(2)) of the fd fails with EPERM. Optionally mlock()ed so expert bytes never hit
// swap; a failed mlock is reported, not fatal (the caller decides what to log). Owns the memfd and
// the daemon's mapping; move-only, and a moved-from region holds nothing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "base/fd.h"
#include "expertd/result.h"

namespace expertd {

class SharedRegion {
 public:
  SharedRegion() = default;
  SharedRegion(SharedRegion&& other) noexcept;
  SharedRegion& operator=(SharedRegion&& other) noexcept;
  SharedRegion(const SharedRegion&) = delete;
  SharedRegion& operator=(const SharedRegion&) = delete;

  // `bytes` is rounded up to the page size. `lock` asks for mlock (see locked()). With
  // `client_writable` the region is not sealed against future writes (a session's rings, which
  // the client writes too); it is still sealed against grow and shrink.
  static Result<SharedRegion> create(const std::string& name, size_t bytes, bool lock,
                                     bool client_writable = false);

  int fd() const { return fd_.get(); }
  uint8_t* data() const { return map_.data(); }
  size_t size() const { return map_.size(); }
  bool locked() const { return locked_; }
  const std::string& lock_error() const { return lock_error_; }  // why mlock failed, if it did

 private:
  UniqueFd fd_;
  Mapping map_;  // unmapping also drops the lock
  bool locked_ = false;
  std::string lock_error_;
};

size_t page_bytes();

}  // namespace expertd
