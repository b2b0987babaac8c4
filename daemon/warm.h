// Warm restart: what one expertd hands the next so that the cache survives an upgrade, a crash or
// an exec. Per model three sealed memfds travel: the arena, the slot table (which slot holds which
// expert, and whether it is READY) and a manifest (what the cache was filled from: each shard's
// device, inode, size, mtime and ctime, the slot size and a digest of where every expert's slices
// land in a slot). They are named "warm.<i>.manifest", "warm.<i>.arena" and "warm.<i>.slots".
//
// Two carriers, one format: systemd's fd store (FDSTORE=1 at start, given back with names in
// LISTEN_FDS/LISTEN_FDNAMES when the service starts again, after a crash too), and exec on SIGUSR2
// (the fds inherited, the same variables set for the same pid). Neither is trusted: a successor
// copies a slot only when the manifest is its own to the byte (same files unchanged, same slot
// layout, same formats), the memfds are sealed against writes, growth and shrinking (so nobody can
// change them under the copy and no read can fault), their sizes match, and the slot entry is READY
// for an expert the model has. Any doubt starts that model cold, with one log line saying why.
//
// Only a pread daemon hands its cache over for now: an arena io_uring filled through registered
// buffers showed wrong bytes through a successor's mapping (warm.cc, restore_model).
//
// The arena is copied, not adopted: it is sealed against new writable mappings (clients must not
// write it), so a successor cannot write into it. The copy needs the old and the new arena at
// once while it runs (docs/RELIABILITY.md, "Warm restart", has its speed).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/fd.h"
#include "cache/shm.h"
#include "daemon/core.h"

namespace expertd {

struct NamedFd {
  std::string name;
  UniqueFd fd;
};

// The fds this process was started with (LISTEN_FDS and LISTEN_FDNAMES for this pid; the
// variables are removed): the listening control socket bound at `socket_path`, and the warm
// restart's fds. Anything else is closed and named in `ignored`. Every fd kept is CLOEXEC.
struct PassedFds {
  UniqueFd listen;  // invalid when none was passed
  std::vector<NamedFd> warm;
  std::vector<std::string> ignored;
};
PassedFds take_passed_fds(const std::string& socket_path);

// What restore_warm() took over, over all models.
struct WarmRestore {
  uint32_t models = 0;   // models that were warm
  uint64_t experts = 0;  // experts copied
  uint64_t bytes = 0;
};

// Copies the cached experts that `passed` describes into `core`'s caches. Call it after
// DaemonCore::create() and before start(). Logs each model's outcome (why a model starts cold).
// The fds are closed on return.
WarmRestore restore_warm(DaemonCore& core, std::vector<NamedFd> passed);

// What this daemon hands on: owns each model's manifest; the arena and slot table are the stores'.
// Move-only (it owns memfds).
class WarmExport {
 public:
  // A model it cannot describe (a name or shard count beyond the manifest's room) is left out,
  // logged.
  static WarmExport create(DaemonCore& core);
  // Duplicates (CLOEXEC) of every fd to hand on, with their names.
  std::vector<NamedFd> fds() const;

 private:
  struct Model {
    uint32_t index = 0;
    SharedRegion manifest;
    int arena_fd = -1;  // borrowed from the store, which outlives this
    int slots_fd = -1;
  };
  std::vector<Model> models_;
};

}  // namespace expertd
