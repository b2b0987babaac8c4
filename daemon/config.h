// expertd's configuration: a TOML file (/etc/expertd/expertd.toml, or --config PATH), overridden
// by command-line flags. Without a file the daemon runs from flags alone. Errors name the file,
// the key (or flag) and the bad value.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/size.h"
#include "expertd/result.h"
#include "storage/reader.h"

namespace expertd {

// Bounds the loader and the flags enforce: deeper prefetch than this many layers is noise, and
// io_uring rings beyond this many reads in flight only add latency on NVMe.
inline constexpr uint32_t kMaxPrefetchDepth = 64;
// prefetch_depth = "auto" (the default): each model's depth follows its measured hint precision
// (cache/scheduler.h, docs/CACHE.md "Prefetch admission and automatic depth").
inline constexpr uint32_t kPrefetchDepthAutoValue = 0xffffffffu;
inline constexpr uint32_t kMaxQueueDepth = 4096;
inline constexpr uint32_t kMaxReactorSpinUs = 100'000;
// An acquire's wait for a slot: at least a reactor sleep (100 ms), at most 10 minutes.
inline constexpr uint32_t kMinAcquireTimeoutMs = 100;
inline constexpr uint32_t kMaxAcquireTimeoutMs = 600'000;
// What the memory expertd may use (RAM, or its cgroup's limit when lower) must hold beyond the
// arena: the daemon's own memory (about 80 MiB RSS with a few sessions, the arena's share aside).
inline constexpr uint64_t kCgroupHeadroomBytes = 64ull << 20;
// A read's deadline: 1 s to an hour; 0 turns it off.
inline constexpr uint32_t kMinReadTimeoutMs = 1'000;
inline constexpr uint32_t kMaxReadTimeoutMs = 3'600'000;
// Control-plane bounds (daemon/rpc.cc). Connections from non-admins at once; admins may open
// kAdminReservedConnections more, so expertctl gets in when the others are all taken.
inline constexpr uint32_t kMaxConnections = 256;
inline constexpr uint32_t kAdminReservedConnections = 4;

struct ModelConfig {
  std::string name;  // what clients open it by
  std::string path;  // a GGUF file or its first shard
};

struct DaemonConfig {
  std::string config_path;  // the file read, empty when none
  std::vector<ModelConfig> models;
  std::string socket = "/run/expertd/expertd.sock";
  std::string cache = "25%";  // of physical memory, or a size such as 4GiB; split among models
  std::string staging = "64MiB";
  uint32_t prefetch_depth = kPrefetchDepthAutoValue;  // layers ahead, or auto
  uint32_t queue_depth = 0;                           // 0: probe the device at start
  uint64_t chunk_bytes = 0;  // 0 with queue_depth 0: probed; else 0 = whole slices
  BackendKind backend = BackendKind::Uring;
  std::string policy = "cyclic-hint";  // policy/policy.h kDefaultPolicy; "default" names it too
  bool lock_memory = true;
  bool verify = false;  // check every load of a forged model against its content function
  std::vector<uid_t> allowed_uids;
  std::vector<gid_t> allowed_gids;
  uint32_t max_sessions = 64;
  // An acquire that finds no slot waits at most this long, then fails with ETIMEDOUT.
  uint32_t acquire_timeout_ms = 10'000;
  // A disk read not back after this long fails its expert's load with ETIME (a stalled device or
  // file system must not hang acquires for ever; cache/scheduler.h). 0: no deadline.
  uint32_t read_timeout_ms = 30'000;
  // After a client's last request the reactor stays awake this long, polling the rings, before it
  // sleeps: a client's next request then needs no wake-up (docs/CLIENT.md "Round trips").
  // 0: sleep at once. At most kMaxReactorSpinUs.
  uint32_t reactor_spin_us = 200;
  // Check every load against a per-expert XXH3 manifest, built at the first start with it on and
  // kept in state_directory (docs/STORAGE.md "Content checksums").
  bool checksums = false;
  std::string state_directory = "/var/lib/expertd";  // systemd's StateDirectory=expertd
  // Roles and bounds (docs/SYSTEMD.md "Access"): members of admin_gids (besides root and the
  // daemon's uid) may change settings; the per-uid caps do not apply to admins.
  std::vector<gid_t> admin_gids;
  uint32_t max_connections_per_uid = 32;  // 1..kMaxConnections
  uint32_t max_sessions_per_uid = 16;     // at most max_sessions takes effect
  uint32_t idle_timeout_s = 300;          // a connection with no session and no call; 0: never
  uint64_t max_frame_bytes = 1u << 20;    // one incoming RPC message, checked before buffering
};

// Every key the configuration file may hold, and the flag that overrides it. The loader accepts
// exactly these keys; tests/daemon/config_keys_test.cc fails when one lacks its flag in
// `expertd --help` or its documented entry in systemd/expertd.toml.
struct ConfigKey {
  std::string_view key;
  std::string_view flag;
};
inline constexpr ConfigKey kConfigKeys[] = {
    {"socket", "--socket"},
    {"cache", "--cache"},
    {"staging", "--staging"},
    {"prefetch_depth", "--prefetch-depth"},
    {"queue_depth", "--queue-depth"},
    {"chunk", "--chunk"},
    {"backend", "--backend"},
    {"policy", "--policy"},
    {"lock_memory", "--lock-memory"},
    {"verify", "--verify"},
    {"allowed_uids", "--allow-uid"},
    {"allowed_gids", "--allow-gid"},
    {"max_sessions", "--max-sessions"},
    {"acquire_timeout_ms", "--acquire-timeout-ms"},
    {"read_timeout_ms", "--read-timeout-ms"},
    {"reactor_spin_us", "--reactor-spin-us"},
    {"admin_gids", "--admin-gid"},
    {"max_connections_per_uid", "--max-connections-per-uid"},
    {"max_sessions_per_uid", "--max-sessions-per-uid"},
    {"idle_timeout_s", "--idle-timeout-s"},
    {"max_frame", "--max-frame"},
    {"models", "--model"},  // the [models] table: NAME = "PATH"
    {"checksums", "--checksums"},
    {"state_directory", "--state-dir"},
};

// "auto" or an integer 0..kMaxPrefetchDepth; the error names `what` and the value.
Result<uint32_t> parse_prefetch_depth(const std::string& what, const std::string& value);
// "auto" or the number.
std::string prefetch_depth_name(uint32_t depth);

// "uring" or "pread".
Result<BackendKind> parse_backend(const std::string& what, const std::string& value);
const char* backend_kind_name(BackendKind kind);

// Reads a TOML file into `config` (keys absent from the file keep their values).
Status load_config_file(const std::string& path, DaemonConfig& config);
// Validates the whole configuration (models present and named uniquely, sizes parse, ...).
Status validate_config(const DaemonConfig& config);

}  // namespace expertd
