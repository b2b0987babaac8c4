// DaemonCore: the storage side of expertd — every model's ExpertStore over one ReadBackend, the
// client sessions and their shared-memory rings — run by one storage reactor thread.
//
// Threads. The reactor thread owns all of it and sleeps only in the backend's wait (io_uring),
// where client doorbells and the command eventfd are watched too. Other threads (the Cap'n Proto
// control loop, signal handling) talk to it only through post(): a bounded command ring (a mutex
// for the posters, one atomic load for the reactor when it is empty) plus an eventfd. A command
// runs on the reactor thread and answers through its callback, also on the reactor thread (the
// caller hands the answer back to its own thread, e.g. with a kj cross-thread fulfiller). Nothing
// on the data path locks or allocates: a reactor loop without commands does neither
// (tests/daemon/reactor_alloc_test.cc counts its allocations).
//
// Sessions. attach() creates a session region (header + request ring + completion ring) and two
// eventfds (client → daemon doorbell, daemon → client doorbell). The reactor copies every request
// once, validates it and closes the session — only that session — on the first hostile entry
// (unknown op, layer or expert out of range, a release of a slot it does not hold, more
// outstanding acquires than its completion ring holds), logging why and storing the reason in the
// session header. Holds are counted per session; detach (or the client's death, seen as the
// control connection's hangup) releases all of them.
//
// Disk faults (docs/STORAGE.md). The reactor logs failed loads (rate-limited, LogLimit) and
// checks each model's files against what create() opened, once a second and after every failed
// load; a model whose file changed is no longer served (ESTALE, with the reason in stats, attach
// and openModel) until a restart. The other models go on.
#pragma once

#include <sys/types.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "base/fd.h"
#include "base/log_limit.h"
#include "cache/scheduler.h"
#include "cache/shm.h"
#include "cache/store.h"
#include "client/include/expertd/control_types.h"
#include "daemon/config.h"
#include "storage/read_probe.h"

namespace expertd {

// What open_model() and stats() return: the control plane's types, one definition with the client's
// (client/include/expertd/control_types.h, declared from client/expertd.capnp).
using ModelLayout = client::ModelLayout;
using ModelStats = client::ModelStats;
using SessionStats = client::SessionStats;
using DaemonStats = client::Stats;

// What an attached client gets: duplicates of the session's file descriptors, owned here until
// the caller passes them on (move-only). Ring capacities and the session id are also in the
// session region's header.
struct Attachment {
  uint32_t session = 0;
  UniqueFd arena_fd;             // sealed, read-only for the client
  UniqueFd slot_table_fd;        // sealed, read-only for the client
  UniqueFd session_fd;           // the session region, read-write
  UniqueFd request_doorbell;     // client writes it when the daemon sleeps
  UniqueFd completion_doorbell;  // daemon writes it when the client sleeps
  uint64_t arena_bytes = 0;
  uint64_t slot_table_bytes = 0;
  uint64_t session_bytes = 0;
  uint32_t request_capacity = 0;
  uint32_t completion_capacity = 0;
  uint32_t acquire_timeout_ms = 0;  // an acquire waits at most this long for a slot
  uint32_t read_timeout_ms = 0;     // and at most this long for a read (0: no read deadline)
};

// One of a model's files (a shard of a split model) opened for a client: read-only, the same file
// (device and inode) the daemon serves the experts from.
struct ModelFileFd {
  uint32_t shard = 0;
  std::string name;  // the file's name without its directory
  std::string path;
  uint64_t bytes = 0;
  UniqueFd fd;  // O_RDONLY | O_CLOEXEC, a file description of its own (not the backend's)
};

struct ClientIdentity {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  bool admin = false;  // root, the daemon's uid or admin_gids: no per-uid session cap
  std::string name;    // what the client calls itself (for stats and logs)
};

// Wraps the backend the daemon made (expertd-test's fault injection: EXPERTD_TEST_FAULTS).
using BackendWrapper =
    std::function<std::unique_ptr<ReadBackend>(std::unique_ptr<ReadBackend> backend)>;

// Makes the checker of one model's loads in verify mode (main() passes expert-forge's verifier;
// the core library does not link the forge).
using LoadCheckerFactory = std::function<Result<std::unique_ptr<LoadChecker>>(const ExpertStore&)>;

class DaemonCore {
 public:
  // Opens every model, chooses (or probes) the backend's read settings, creates the arenas.
  // Errors name the model and file. Does not start the reactor. `make_checker` serves
  // config.verify (an error names the model when verify is on without one).
  static Result<std::unique_ptr<DaemonCore>> create(const DaemonConfig& config,
                                                    const LoadCheckerFactory& make_checker = {},
                                                    const BackendWrapper& wrap_backend = {});
  ~DaemonCore();

  // Starts / stops the reactor thread. stop() drains reads in flight, then returns.
  Status start();
  void stop();
  bool running() const { return running_.load(); }

  // Thread-safe: runs `fn` on the reactor thread. False when the queue is full or stopped.
  bool post(std::function<void(DaemonCore&)> fn);

  // --- Reactor-thread API (call from inside post()) ---
  Result<ModelLayout> open_model(const std::string& name) const;
  Result<Attachment> attach(const std::string& model, const ClientIdentity& who);
  void detach(uint32_t session, const char* why);
  DaemonStats stats() const;
  Status set_prefetch_depth(uint32_t depth);
  Status set_queue_depth(uint32_t depth);
  Status set_policy(const std::string& policy);
  Status pin(const std::string& model, uint32_t layer, uint32_t expert, bool pinned);
  Status evict(const std::string& model, uint32_t layer, uint32_t expert);
  // Caps `model`'s cache at `slots` slots (0: all of them), evicting down to it.
  Status set_cache_limit(const std::string& model, uint32_t slots);
  // Empties `model`'s cache and staging ring (all but held and pinned experts) and restarts its
  // policy's history. Returns the number of experts dropped.
  Result<uint32_t> evict_all(const std::string& model);

  // --- Warm restart (daemon/warm.h) ---
  // What create() saw of a shard file when it opened it: a file changed since does not match.
  struct FileIdentity {
    uint64_t dev = 0;
    uint64_t ino = 0;
    uint64_t bytes = 0;
    int64_t mtime_ns = 0;
    int64_t ctime_ns = 0;
  };
  std::vector<FileIdentity> shard_identities(uint32_t model) const;
  // Model `model`'s store (the order of model_names()): before start() only, the reactor's after.
  ExpertStore& store(uint32_t model);

  // --- Any thread ---
  const std::vector<std::string>& model_names() const { return model_names_; }
  // Opens up to `max` of `model`'s files from shard `first` on, read-only (a fresh file description
  // each: no O_DIRECT, nothing the backend's fds share), and sets `*shard_count`. Errors: an
  // unknown model (named), `first` past the last shard, a file that can no longer be opened or
  // was replaced since the daemon opened it. Blocks on open(): call it off the reactor.
  Result<std::vector<ModelFileFd>> open_model_files(const std::string& model, uint32_t first,
                                                    uint32_t max, uint32_t* shard_count) const;
  std::string backend_name() const;
  // Milliseconds of monotonic time when the reactor last finished a loop (watchdog).
  uint64_t last_progress_ms() const { return last_progress_ms_.load(std::memory_order_relaxed); }
  // Loops the reactor has finished (also in stats()).
  uint64_t reactor_loops() const { return reactor_loops_.load(std::memory_order_relaxed); }
  // A short human status for systemd's STATUS=, refreshed by the reactor.
  std::string status_line() const;

 private:
  // ENOENT naming `name` (clipped) and the models served.
  Error unknown_model(std::string_view name) const;
  struct Session;
  struct Model;
  class Sink;

  DaemonCore() = default;
  // The reads' queue depth and chunk size: configured, or probed on the models' files.
  ReadConfig choose_read_config(const std::vector<GgufModel>& models,
                                const std::vector<std::string>& paths);
  void run();
  void run_commands();
  bool poll_session(Session& s);
  void handle_request(Session& s, const abi::Request& r);
  void close_session(Session& s, int reason, const std::string& why);
  void deliver(uint32_t model, const Completion& c);
  void flush_completions();
  bool arm_sleep();
  void refresh_status();
  // Files changed under the daemon (docs/STORAGE.md): statx of each of the model's files against
  // what create() opened; a change stops serving the model. Checked once a second and after
  // every failed load.
  void check_files(uint32_t model);
  // Logs the loads that failed since the last call (rate-limited), and checks their model's files.
  void log_failed_loads();

  DaemonConfig config_;
  std::unique_ptr<ReadBackend> io_;
  std::string fallback_reason_;
  std::string read_choice_;
  std::vector<std::unique_ptr<Model>> models_;
  std::vector<std::string> model_names_;
  // Per model (the order of model_names_), its shards as opened at create(): set once, then read
  // from any thread.
  struct ShardFile {
    std::string path;
    dev_t dev = 0;
    ino_t ino = 0;
    FileIdentity identity;  // the whole of it, for warm restart
  };
  std::vector<std::vector<ShardFile>> model_files_;
  std::unique_ptr<StoreReactor> reactor_;
  std::vector<std::unique_ptr<Session>> sessions_;  // index = session id; null when free
  uint64_t sessions_closed_hostile_ = 0;
  LogLimit load_failure_log_;               // failed loads: at most a burst of lines per window
  std::atomic<uint64_t> reactor_loops_{0};  // written by the reactor only
  uint64_t start_ns_ = 0;

  // The command ring: kMaxCommands slots allocated once by create(), so taking a command moves it
  // out of its slot and allocates nothing on the reactor. The commands are std::function because
  // they come from the control plane (RPC, signals), never from the data path; the poster pays for
  // building one. commands_queued_ is what the reactor reads every loop: while it is 0 the loop
  // takes no lock.
  // The RPC thread has at most 8 calls in flight per connection (daemon/rpc.cc), over at most
  // kMaxConnections + kAdminReservedConnections connections: 2080, with room for detaches.
  static constexpr uint32_t kMaxCommands = 4096;
  UniqueFd command_fd_;    // eventfd: a post() wakes the reactor
  std::mutex command_mu_;  // the slots and both indices
  std::vector<std::function<void(DaemonCore&)>> commands_;
  uint32_t command_head_ = 0;  // the next to run (reactor); free-running, mod kMaxCommands
  uint32_t command_tail_ = 0;  // the next free slot (posters)
  std::atomic<uint32_t> commands_queued_{0};

  std::thread thread_;
  std::atomic<bool> running_{false};
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> last_progress_ms_{0};
  // status_line()'s text. The reactor rewrites it once a second under status_mu_ (the main thread
  // reads it for systemd's STATUS=): one lock a second, not one a loop, and a fixed buffer, so the
  // refresh allocates nothing on the reactor.
  mutable std::mutex status_mu_;
  std::array<char, 192> status_{};
  size_t status_len_ = 0;
};

}  // namespace expertd
