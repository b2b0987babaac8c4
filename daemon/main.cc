// expertd: the expert streaming daemon. Reads its configuration (TOML, overridden by flags), opens
// the models, starts the storage reactor and the Cap'n Proto control socket, tells systemd it is
// ready, and runs until SIGTERM (drain, exit 0). SIGHUP reloads the tunables from the file. SIGUSR2
// execs the binary again (a new one, after an upgrade) with the cache handed over (daemon/warm.h).
#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "base/fd.h"
#include "daemon/config.h"
#include "daemon/core.h"
#include "daemon/rpc.h"
#include "daemon/warm.h"
#include "forge/verifier.h"

namespace {

using expertd::DaemonConfig;

struct Flags {
  std::string config_path;
  bool config_given = false;
  std::vector<std::string> models;
  std::string socket, cache, staging, chunk, backend, policy;
  std::string prefetch_depth;  // "auto" or a number; empty: not given
  int64_t queue_depth = -1;
  int64_t max_sessions = -1;
  int64_t acquire_timeout_ms = -1;
  int64_t read_timeout_ms = -1;
  int64_t reactor_spin_us = -1;
  std::vector<int64_t> allow_uids, allow_gids;
  std::vector<int64_t> admin_gids;
  int64_t max_connections_per_uid = -1, max_sessions_per_uid = -1, idle_timeout_s = -1;
  std::string max_frame;
  bool verify = false, verify_given = false;           // --verify[=false]
  bool lock_memory = true, lock_memory_given = false;  // --lock-memory[=false], --no-mlock
  bool checksums = false, checksums_given = false;     // --checksums[=false]
  std::string state_dir;
  std::string log_level = "info";
};

void setup_logging(const std::string& level) {
  auto logger = spdlog::stderr_color_mt("expertd");
  spdlog::set_default_logger(logger);
  // Under systemd (JOURNAL_STREAM set) the journal adds the time: log without it.
  if (std::getenv("JOURNAL_STREAM") != nullptr) {
    spdlog::set_pattern("<%^%l%$> %v");
  } else {
    spdlog::set_pattern("%Y-%m-%d %H:%M:%S.%e %^%l%$ %v");
  }
  spdlog::set_level(spdlog::level::from_str(level));
}

// Applies the flags over the file's values.
expertd::Status apply_flags(const Flags& f, DaemonConfig& c) {
  std::vector<std::string> flag_names;  // a flag's model replaces the file's; two flags clash
  for (const auto& m : f.models) {
    const auto eq = m.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == m.size()) {
      return expertd::make_error(EINVAL, "--model '" + m + "': expected NAME=PATH");
    }
    const std::string name = m.substr(0, eq);
    if (std::find(flag_names.begin(), flag_names.end(), name) != flag_names.end()) {
      return expertd::make_error(EINVAL, fmt::format("--model: the name '{}' is given twice "
                                                     "(each model needs its own name)",
                                                     name));
    }
    flag_names.push_back(name);
    bool replaced = false;
    for (auto& existing : c.models) {
      if (existing.name == name) {
        existing.path = m.substr(eq + 1);
        replaced = true;
      }
    }
    if (!replaced) c.models.push_back({name, m.substr(eq + 1)});
  }
  if (!f.socket.empty()) c.socket = f.socket;
  if (!f.cache.empty()) c.cache = f.cache;
  if (!f.staging.empty()) c.staging = f.staging;
  if (!f.policy.empty()) c.policy = f.policy;
  if (f.chunk == "auto") {
    c.chunk_bytes = 0;
  } else if (!f.chunk.empty()) {
    EXPERTD_TRY_ASSIGN(c.chunk_bytes, expertd::parse_size("--chunk", f.chunk, 0));
  }
  if (!f.backend.empty()) {
    EXPERTD_TRY_ASSIGN(c.backend, expertd::parse_backend("--backend", f.backend));
  }
  if (!f.prefetch_depth.empty()) {
    EXPERTD_TRY_ASSIGN(c.prefetch_depth,
                       expertd::parse_prefetch_depth("--prefetch-depth", f.prefetch_depth));
  }
  if (f.queue_depth >= 0) c.queue_depth = static_cast<uint32_t>(f.queue_depth);
  if (f.max_sessions >= 0) c.max_sessions = static_cast<uint32_t>(f.max_sessions);
  if (f.acquire_timeout_ms >= 0) c.acquire_timeout_ms = static_cast<uint32_t>(f.acquire_timeout_ms);
  if (f.read_timeout_ms >= 0) c.read_timeout_ms = static_cast<uint32_t>(f.read_timeout_ms);
  if (f.reactor_spin_us >= 0) c.reactor_spin_us = static_cast<uint32_t>(f.reactor_spin_us);
  for (const int64_t u : f.allow_uids) c.allowed_uids.push_back(static_cast<uid_t>(u));
  for (const int64_t g : f.allow_gids) c.allowed_gids.push_back(static_cast<gid_t>(g));
  for (const int64_t g : f.admin_gids) c.admin_gids.push_back(static_cast<gid_t>(g));
  if (f.max_connections_per_uid >= 0) {
    c.max_connections_per_uid = static_cast<uint32_t>(f.max_connections_per_uid);
  }
  if (f.max_sessions_per_uid >= 0) {
    c.max_sessions_per_uid = static_cast<uint32_t>(f.max_sessions_per_uid);
  }
  if (f.idle_timeout_s >= 0) c.idle_timeout_s = static_cast<uint32_t>(f.idle_timeout_s);
  if (!f.max_frame.empty()) {
    EXPERTD_TRY_ASSIGN(c.max_frame_bytes, expertd::parse_size("--max-frame", f.max_frame, 0));
  }
  if (f.verify_given) c.verify = f.verify;
  if (f.lock_memory_given) c.lock_memory = f.lock_memory;
  if (f.checksums_given) c.checksums = f.checksums;
  if (!f.state_dir.empty()) c.state_directory = f.state_dir;
  return expertd::Ok{};
}

expertd::Result<DaemonConfig> load(const Flags& f) {
  DaemonConfig c;
  const std::string path = f.config_given ? f.config_path : "/etc/expertd/expertd.toml";
  if (f.config_given || ::access(path.c_str(), F_OK) == 0) {
    EXPERTD_TRY(expertd::load_config_file(path, c));
  }
  EXPERTD_TRY(apply_flags(f, c));
  EXPERTD_TRY(expertd::validate_config(c));
  return c;
}

// SIGHUP: re-read the file (flags still win) and apply the tunables that can change at runtime.
void reload(expertd::DaemonCore& core, const Flags& f) {
  auto c = load(f);
  if (!c) {
    spdlog::error("reload: {}; keeping the current settings", c.error().message);
    return;
  }
  core.post([c = *c](expertd::DaemonCore& d) {
    int rejected = 0;
    for (const auto& st :
         {d.set_prefetch_depth(c.prefetch_depth), d.set_policy(c.policy),
          c.queue_depth ? d.set_queue_depth(c.queue_depth) : expertd::Status(expertd::Ok{})}) {
      if (!st) {
        spdlog::error("reload: {}", st.error().message);
        ++rejected;
      }
    }
    if (rejected == 0) {
      spdlog::info("reload: tunables applied (prefetch_depth {}, policy {}, queue_depth {})",
                   expertd::prefetch_depth_name(c.prefetch_depth), c.policy, c.queue_depth);
    } else {
      spdlog::warn("reload: {} tunable(s) rejected and kept as they were; the others applied",
                   rejected);
    }
  });
}

// The socket's problems, found before the models are opened (which can take a while): a path too
// long for sockaddr_un, a directory that cannot be created or written (the RPC server creates
// missing ones), a path that is not a socket, another daemon listening.
expertd::Status check_socket(const std::string& path) {
  sockaddr_un a{};
  if (path.size() >= sizeof(a.sun_path)) {
    return expertd::make_error(ENAMETOOLONG,
                               fmt::format("socket {}: the path is {} bytes, a Unix socket's "
                                           "is at most {}",
                                           path, path.size(), sizeof(a.sun_path) - 1));
  }
  std::string dir = path;
  struct stat st {};
  do {  // the nearest existing ancestor: where the first missing directory will be made
    const auto slash = dir.rfind('/');
    dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : dir.substr(0, slash));
  } while (::stat(dir.c_str(), &st) != 0 && dir != "/" && dir != ".");
  if (!S_ISDIR(st.st_mode)) {
    return expertd::make_error(ENOTDIR, fmt::format("socket {}: {} is not a directory", path, dir));
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    const int e = errno;
    return expertd::make_error(
        e, fmt::format("socket {}: cannot create it under {}: {}", path, dir, std::strerror(e)));
  }
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return expertd::make_error(
          EEXIST, fmt::format("socket {}: the path exists and is not a socket", path));
    }
    const expertd::UniqueFd probe(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    a.sun_family = AF_UNIX;
    std::memcpy(a.sun_path, path.data(), path.size());
    if (probe.valid() &&
        ::connect(probe.get(), reinterpret_cast<const sockaddr*>(&a), sizeof(a)) == 0) {
      return expertd::make_error(EADDRINUSE,
                                 fmt::format("socket {}: another process is listening on it "
                                             "(another expertd?)",
                                             path));
    }
  }
  return expertd::Ok{};
}

#if EXPERTD_TEST_HOOKS
// "eio=R,short=R,eagain=R,seed=N,eio_range=FILE:OFFSET:BYTES" (any subset, comma-separated):
// the fault injector's options (storage/reader.h FaultOptions) for the chaos tests.
expertd::Result<expertd::FaultOptions> parse_test_faults(const std::string& spec) {
  expertd::FaultOptions f;
  size_t at = 0;
  while (at <= spec.size()) {
    const size_t comma = std::min(spec.find(',', at), spec.size());
    const std::string item = spec.substr(at, comma - at);
    at = comma + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    const std::string key = item.substr(0, eq);
    const std::string value = eq == std::string::npos ? "" : item.substr(eq + 1);
    char* end = nullptr;
    if (key == "eio" || key == "short" || key == "eagain") {
      const double r = std::strtod(value.c_str(), &end);
      if (end == value.c_str() || *end != 0 || !(r >= 0 && r <= 1)) {
        return expertd::make_error(EINVAL, fmt::format("{}={}: a rate in [0, 1]", key, value));
      }
      (key == "eio" ? f.eio_rate : key == "short" ? f.short_rate : f.eagain_rate) = r;
    } else if (key == "seed") {
      f.seed = std::strtoull(value.c_str(), &end, 10);
    } else if (key == "eio_range" || key == "hang_range" || key == "stuck_range") {
      // hang_range: reads there never complete until cancelled; stuck_range: not even then.
      unsigned file = 0;
      unsigned long long offset = 0;
      unsigned long long bytes = 0;
      if (std::sscanf(value.c_str(), "%u:%llu:%llu", &file, &offset, &bytes) != 3) {
        return expertd::make_error(EINVAL,
                                   fmt::format("{}={}: FILE:OFFSET:BYTES expected", key, value));
      }
      if (key == "eio_range") {
        f.eio_file = file;
        f.eio_offset = offset;
        f.eio_bytes = bytes;
      } else {
        f.hang_file = file;
        f.hang_offset = offset;
        f.hang_bytes = bytes;
        f.hang_ignores_cancel = key == "stuck_range";
      }
    } else {
      return expertd::make_error(EINVAL, fmt::format("unknown key '{}'", key));
    }
  }
  return f;
}
#endif

// The binary to exec on SIGUSR2: the path this one was started by (ExecStart's, absolute), so
// that a binary replaced there since, or a symlink pointed at a new version, is the one that runs.
// Started by a bare name (a $PATH search), the file it was loaded from.
std::string own_binary(const char* argv0) {
  if (argv0 != nullptr && std::strchr(argv0, '/') != nullptr) return argv0;
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

// Sends each fd to systemd's fd store (FileDescriptorStoreMax= in the unit); nothing without
// NOTIFY_SOCKET. Entries of the same names from an earlier run are removed first.
void store_fds(const std::vector<expertd::NamedFd>& fds, const std::vector<std::string>& stale) {
  if (std::getenv("NOTIFY_SOCKET") == nullptr) return;
  for (const auto& name : stale) {
    sd_notifyf(0, "FDSTOREREMOVE=1\nFDNAME=%s", name.c_str());
  }
  int stored = 0;
  for (const auto& f : fds) {
    const std::string msg = "FDSTORE=1\nFDNAME=" + f.name;
    const int fd = f.fd.get();
    const int r = sd_pid_notify_with_fds(0, 0, msg.c_str(), &fd, 1);
    if (r > 0) ++stored;
    if (r < 0) spdlog::warn("warm restart: FDSTORE of {}: {}", f.name, std::strerror(-r));
  }
  spdlog::info("warm restart: {} fd(s) in systemd's fd store", stored);
}

// SIGUSR2: runs `exe` in this process, handing it the listening socket and the warm fds as
// systemd hands them over (LISTEN_FDS, LISTEN_FDNAMES, and LISTEN_PID: exec keeps the pid).
// Returns only when the exec failed.
void exec_successor(const std::string& exe, char** argv, expertd::UniqueFd listen,
                    std::vector<expertd::NamedFd> fds) {
  if (listen.valid()) fds.insert(fds.begin(), expertd::NamedFd{"listen", std::move(listen)});
  const int n = static_cast<int>(fds.size());
  // Above the targets first, so no dup2 below closes a source it still needs.
  std::vector<expertd::UniqueFd> high;
  std::string names;
  for (auto& f : fds) {
    high.emplace_back(::fcntl(f.fd.get(), F_DUPFD_CLOEXEC, 3 + n));
    names += (names.empty() ? "" : ":") + f.name;
  }
  for (int i = 0; i < n; ++i) {
    // dup2 clears FD_CLOEXEC on the target: these survive the exec.
    if (!high[static_cast<size_t>(i)].valid() ||
        ::dup2(high[static_cast<size_t>(i)].get(), 3 + i) < 0) {
      spdlog::critical("SIGUSR2: cannot pass fd {}: {}", fds[static_cast<size_t>(i)].name,
                       std::strerror(errno));
      return;
    }
  }
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view v(*e);
    if (v.rfind("LISTEN_", 0) != 0) env.emplace_back(v);
  }
  env.push_back(fmt::format("LISTEN_PID={}", ::getpid()));
  env.push_back(fmt::format("LISTEN_FDS={}", n));
  env.push_back("LISTEN_FDNAMES=" + names);
  std::vector<char*> envp;
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  spdlog::info("SIGUSR2: exec {} with {} fd(s) handed over", exe, n);
  ::execve(exe.c_str(), argv, envp.data());
  spdlog::critical("SIGUSR2: exec {}: {}", exe, std::strerror(errno));
}

int run(const Flags& flags, char** argv) {
  const std::string exe = own_binary(argv[0]);
  auto config = load(flags);
  if (!config) {
    spdlog::critical("{}", config.error().message);
    return 1;
  }
  // What systemd or the previous daemon handed over: the socket, the warm cache.
  expertd::PassedFds passed = expertd::take_passed_fds(config->socket);
  for (const auto& name : passed.ignored) {
    spdlog::warn("ignoring a passed fd named '{:.64}' (neither the control socket nor warm.*)",
                 name);
  }
  std::vector<std::string> stale_names;
  for (const auto& f : passed.warm) {
    if (std::find(stale_names.begin(), stale_names.end(), f.name) == stale_names.end()) {
      stale_names.push_back(f.name);
    }
  }
  // A socket handed over is bound already: nothing to check here.
  if (!passed.listen.valid()) {
    if (auto st = check_socket(config->socket); !st) {
      spdlog::critical("{}", st.error().message);
      return 1;
    }
  }
  // --verify checks every load against expert-forge's content function; the forge is linked
  // here, into the binary, not into the daemon's core library.
  expertd::BackendWrapper wrap_backend;
#if EXPERTD_TEST_HOOKS  // expertd-test only (daemon/CMakeLists.txt); never in expertd
  if (const char* hook = std::getenv("EXPERTD_TEST_FAULTS"); hook != nullptr && *hook) {
    auto faults = parse_test_faults(hook);
    if (!faults) {
      spdlog::critical("EXPERTD_TEST_FAULTS: {}", faults.error().message);
      return 1;
    }
    spdlog::warn("test hook EXPERTD_TEST_FAULTS is set: reads fail on purpose ({})", hook);
    wrap_backend = [f = *faults](std::unique_ptr<expertd::ReadBackend> inner) {
      return std::unique_ptr<expertd::ReadBackend>(
          expertd::make_faulty_backend(std::move(inner), f));
    };
  }
#endif
  auto core = expertd::DaemonCore::create(
      *config,
      [](const expertd::ExpertStore& store)
          -> expertd::Result<std::unique_ptr<expertd::LoadChecker>> {
        auto v = expertd::ForgeVerifier::create(store.model(), store.slice_map(), store.layouts());
        if (!v) return v.take_error();
        return std::unique_ptr<expertd::LoadChecker>(std::move(*v));
      },
      wrap_backend);
  if (!core) {
    spdlog::critical("{}", core.error().message);
    return 1;
  }
  expertd::restore_warm(**core, std::move(passed.warm));
  const expertd::WarmExport warm = expertd::WarmExport::create(**core);
  if (auto st = (*core)->start(); !st) {
    spdlog::critical("{}", st.error().message);
    return 1;
  }
  auto rpc = expertd::RpcServer::start(**core, *config, std::move(passed.listen));
  if (!rpc) {
    spdlog::critical("{}", rpc.error().message);
    (*core)->stop();
    return 1;
  }
  spdlog::info("expertd ready: {} model(s), socket {}", config->models.size(), config->socket);
  sd_notify(0, "READY=1");
  store_fds(warm.fds(), stale_names);

  // Signals arrive through a signalfd; the watchdog and STATUS= ride its poll timeout.
  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGTERM);
  sigaddset(&mask, SIGINT);
  sigaddset(&mask, SIGHUP);
  sigaddset(&mask, SIGUSR2);
  const expertd::UniqueFd sfd(::signalfd(-1, &mask, SFD_CLOEXEC));
  if (!sfd.valid()) {
    // The signals are blocked: without the signalfd SIGTERM would never be seen.
    const int e = errno;
    spdlog::critical("signalfd: {}", std::strerror(e));
    (*rpc)->stop();
    (*core)->stop();
    return 1;
  }
  uint64_t watchdog_usec = 0;
  const bool watchdog = sd_watchdog_enabled(0, &watchdog_usec) > 0;
  const uint64_t tick_ms = watchdog ? std::max<uint64_t>(watchdog_usec / 2000, 50) : 1000;
  std::string last_status;
  int exit_code = 0;
  bool handover = false;
  while (true) {
    pollfd p{sfd.get(), POLLIN, 0};
    const int r = ::poll(&p, 1, static_cast<int>(tick_ms));
    if (r < 0 && errno != EINTR) break;
    if (r > 0) {
      signalfd_siginfo si{};
      if (::read(sfd.get(), &si, sizeof(si)) == sizeof(si)) {
        if (si.ssi_signo == SIGHUP) {
          sd_notify(0, "RELOADING=1");
          reload(**core, flags);
          sd_notify(0, "READY=1");
        } else if (si.ssi_signo == SIGUSR2) {
          spdlog::info("SIGUSR2: draining, then exec {} with the cache handed over", exe);
          handover = true;
          break;
        } else {
          spdlog::info("{}: draining and stopping", si.ssi_signo == SIGTERM ? "SIGTERM" : "SIGINT");
          break;
        }
      }
    }
    // WATCHDOG=1 only while the reactor makes progress (it loops at least every 100 ms).
    const uint64_t now = expertd::monotonic_ns() / 1'000'000;
    const uint64_t last = (*core)->last_progress_ms();
    if (watchdog && now - last < watchdog_usec / 1000 / 2) sd_notify(0, "WATCHDOG=1");
    const std::string status = (*core)->status_line();
    if (status != last_status) {
      sd_notifyf(0, "STATUS=%s", status.c_str());
      last_status = status;
    }
  }
  if (handover) {
    expertd::UniqueFd listen = (*rpc)->take_listen_fd();
    // The core first: it drains its reads while every session still holds its slots, then starts
    // nothing. Closing the connections first would release the holds of clients that may still be
    // reading their slots while other sessions' loads reuse them.
    (*core)->stop();
    (*rpc)->stop();
    exec_successor(exe, argv, std::move(listen), warm.fds());
    return 1;  // the exec failed (logged); under systemd the fd store still has the cache
  }
  sd_notify(0, "STOPPING=1");
  (*rpc)->stop();
  (*core)->stop();
  spdlog::info("expertd stopped");
  return exit_code;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "expertd: out-of-core expert streaming daemon for Mixture-of-Experts models. Each flag "
      "overrides its key in the configuration file (systemd/expertd.toml documents them)"};
  app.set_version_flag("--version", std::string("expertd ") + EXPERTD_VERSION);
  Flags f;
  const auto u32 = CLI::Range(int64_t{0}, int64_t{0xffffffff});
  app.add_option("--config", f.config_path,
                 "TOML configuration (default /etc/expertd/expertd.toml when it exists)");
  app.add_option("--model", f.models,
                 "Serve a model: NAME=PATH (a .gguf or its first shard); "
                 "repeatable");
  app.add_option("--socket", f.socket, "Control socket path (default /run/expertd/expertd.sock)");
  app.add_option("--cache", f.cache,
                 "Expert cache size, e.g. 4GiB or 25% of RAM (of the memory cgroup's limit "
                 "when lower) (default 25%)");
  app.add_option("--staging", f.staging, "Staging ring size for streamed experts (default 64MiB)");
  app.add_option("--prefetch-depth", f.prefetch_depth,
                 fmt::format("Layers ahead prefetches may cover, 0..{}, or auto: chosen from the "
                             "measured hint precision (default auto)",
                             expertd::kMaxPrefetchDepth));
  app.add_option("--queue-depth", f.queue_depth,
                 fmt::format("Reads in flight, 0..{} (0 = probe the disk at start)",
                             expertd::kMaxQueueDepth))
      ->check(u32);
  app.add_option("--chunk", f.chunk,
                 "Read chunk size, e.g. 1MiB (auto = probe with the queue depth; default auto)");
  app.add_option("--backend", f.backend, "I/O backend: uring (default) or pread");
  app.add_option("--policy", f.policy,
                 "Cache policy: default (cyclic-hint), cyclic-hint, cyclic, lru or fifo");
  app.add_option("--allow-uid", f.allow_uids, "Also allow this uid on the socket; repeatable")
      ->check(u32);
  app.add_option("--allow-gid", f.allow_gids, "Also allow this gid on the socket; repeatable")
      ->check(u32);
  app.add_option("--max-sessions", f.max_sessions, "Sessions attached at once, 1..4096 (64)")
      ->check(u32);
  app.add_option("--acquire-timeout-ms", f.acquire_timeout_ms,
                 fmt::format("An acquire that finds no cache slot fails with ETIMEDOUT after this "
                             "long, {}..{} ms (10000)",
                             expertd::kMinAcquireTimeoutMs, expertd::kMaxAcquireTimeoutMs))
      ->check(u32);
  app.add_option("--read-timeout-ms", f.read_timeout_ms,
                 fmt::format("A disk read not back after this long fails its expert's load "
                             "(ETIME) and is cancelled: {}..{} ms, 0 = no deadline (30000)",
                             expertd::kMinReadTimeoutMs, expertd::kMaxReadTimeoutMs))
      ->check(u32);
  app.add_option("--reactor-spin-us", f.reactor_spin_us,
                 fmt::format("After a client's last request, poll the rings this long before "
                             "sleeping, so the next one needs no wake-up: 0..{} us, 0 = sleep at "
                             "once (200)",
                             expertd::kMaxReactorSpinUs))
      ->check(u32);
  app.add_option("--admin-gid", f.admin_gids,
                 "Members of this gid may change settings, evict, pin (besides root and the "
                 "daemon's uid); repeatable")
      ->check(u32);
  app.add_option("--max-connections-per-uid", f.max_connections_per_uid,
                 fmt::format("Connections one non-admin uid may hold, 1..{} (32)",
                             expertd::kMaxConnections))
      ->check(u32);
  app.add_option("--max-sessions-per-uid", f.max_sessions_per_uid,
                 "Sessions one non-admin uid may attach, 1..4096 (16)")
      ->check(u32);
  app.add_option("--idle-timeout-s", f.idle_timeout_s,
                 "Close a connection without a session after this many seconds with no call, "
                 "0..86400 (300; 0 = never)")
      ->check(u32);
  app.add_option("--max-frame", f.max_frame,
                 "Largest RPC message accepted, 4KiB..256MiB (default 1MiB)");
  app.add_flag("--verify", f.verify,
               "Check every expert read from a forged model against its content (tests); "
               "--verify=false turns it off");
  app.add_flag("--lock-memory,!--no-mlock", f.lock_memory,
               "mlock the arena (default); --no-mlock or --lock-memory=false does not");
  app.add_flag("--checksums", f.checksums,
               "Check every expert read against a per-expert XXH3 manifest, built at the first "
               "start and kept in the state directory; --checksums=false turns it off (default)");
  app.add_option("--state-dir", f.state_dir,
                 "Where expertd keeps its checksum manifests (default /var/lib/expertd)");
  app.add_option("--log-level", f.log_level, "trace, debug, info (default), warn, error");
  CLI11_PARSE(app, argc, argv);
  f.config_given = app.count("--config") > 0;
  f.verify_given = app.count("--verify") > 0;
  f.lock_memory_given = app.count("--lock-memory") > 0;
  f.checksums_given = app.count("--checksums") > 0;

  // Block the signals before any thread starts so only the signalfd sees them.
  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGTERM);
  sigaddset(&mask, SIGINT);
  sigaddset(&mask, SIGHUP);
  sigaddset(&mask, SIGUSR2);
  pthread_sigmask(SIG_BLOCK, &mask, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
  // spdlog reads an unknown level as "off": refuse it rather than run silent.
  const bool known_level =
      spdlog::level::from_str(f.log_level) != spdlog::level::off || f.log_level == "off";
  setup_logging(known_level ? f.log_level : "info");
  if (!known_level) {
    spdlog::critical("--log-level '{}': must be trace, debug, info, warn, error, critical or off",
                     f.log_level);
    return 1;
  }
  return run(f, argv);
}
