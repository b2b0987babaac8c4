// libexpertd-client: the public client of expertd.
//
// Control plane: Client talks Cap'n Proto RPC (client/expertd.capnp) over the daemon's Unix
// socket. The RPC runs on a private kj event loop in a background thread the Client owns, so every
// public call is synchronous, may be made from any thread, and leaves the caller's thread alone
// between calls.
//
// Data plane: Session bypasses RPC. attach() receives (by fd passing) the model's arena and slot
// table, mapped read-only, and the session region, mapped read-write; acquire / prefetch / release
// / set_cursor write Request records into the session's request ring and read CompletionEntry
// records from its completion ring (client/include/expertd/protocol.h). The caller spins briefly
// for completions, then sleeps on an eventfd; a daemon that dies (the RPC connection drops) or
// closes the session (header `closed`) turns every later call into a clear error.
//
// Control calls time out after 30 s (a daemon that is alive but stuck); an acquire's wait for
// each completion after the daemon's acquire deadline plus 5 s (set_wait_timeout_ms). Like every kj
// program, a Client sets SIGPIPE to ignored for the process.
//
// Lifetimes: a Session keeps its Client's connection alive; destroying the Session detaches it
// (the daemon releases every slot it still holds). Pointers in a SlotView stay valid while the
// slot is held (until release) and the Session lives.
#pragma once

#include <sys/types.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "expertd/control_types.h"  // ModelLayout, Stats, ModelStats, SessionStats, ...
#include "expertd/protocol.h"
#include "expertd/result.h"
#include "expertd/unique_fd.h"

namespace expertd::client {

inline constexpr const char* kDefaultSocket = "/run/expertd/expertd.sock";

// $EXPERTD_SOCKET when set, else kDefaultSocket.
std::string default_socket();

struct DaemonInfo {
  std::string version;
  uint32_t protocol_version = 0;
  std::string backend;
  std::string backend_detail;
  std::vector<std::string> models;
};

// One slice of an acquired expert, inside the read-only arena mapping.
struct SliceView {
  const ModelLayout::Slice* info = nullptr;  // kind, ggml type, shape (owned by the Session)
  const uint8_t* data = nullptr;
  uint64_t bytes = 0;
};

// An acquired expert: a held slot. Give it back with Session::release().
struct SlotView {
  uint32_t slot = 0;
  uint32_t generation = 0;
  uint32_t layer = 0;
  uint32_t expert = 0;
  uint32_t slice_count = 0;
  std::array<SliceView, 3> slices{};
  const uint8_t* slot_data = nullptr;  // the start of the slot in the arena mapping
};

struct PrefetchHint {
  uint32_t layer = 0;
  uint32_t expert = 0;
  float score = 0.0f;  // the router's probability, in [0, 1]
  // The engine will acquire it at its cursor's token before passing the layer (a prefill chunk's
  // routing): the daemon reads it at any prefetch depth (protocol.h kPrefetchExact).
  bool exact = false;
};

// One of a model's GGUF files (a shard of a split model) as the daemon passed it: an fd opened
// read-only by the daemon on the very file it serves the experts from. Read it with pread(2); the
// client needs no access to the file's path.
struct ModelFile {
  uint32_t shard = 0;  // 0-based, in the model's shard order
  std::string name;    // the file's name without its directory (for messages)
  std::string path;    // where the daemon opened it (for messages)
  uint64_t bytes = 0;  // the file's size
  UniqueFd fd;         // O_RDONLY: writes fail with EBADF
};

class Connection;  // the RPC thread and its state (client.cc)

// One attached session: the data plane of one model. Thread-safe (calls are serialised by a
// mutex; one engine thread per session is the intended use).
class Session {
 public:
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  uint32_t id() const { return id_; }
  const ModelLayout& layout() const { return layout_; }

  // Acquires `experts` of `layer` (waiting for reads as needed) and returns them held, in order.
  // Every returned slot must be released. On error nothing stays held.
  Result<std::vector<SlotView>> acquire(uint32_t layer, std::span<const uint32_t> experts);
  // The same into `out` (out.size() >= experts.size()); allocates nothing.
  Status acquire(uint32_t layer, std::span<const uint32_t> experts, std::span<SlotView> out);
  // Hints for experts wanted soon (no completion; the daemon may ignore them).
  Status prefetch(std::span<const PrefetchHint> hints);
  // Gives back held slots.
  Status release(uint32_t slot);
  Status release(std::span<const SlotView> views);
  // The same with abi::kRelease* flags: kReleaseClientCopy tells the daemon this client keeps its
  // own copy of the expert (in VRAM), so the slot becomes the cache's first victim.
  Status release(uint32_t slot, uint32_t flags);
  // This client no longer keeps its own copy of (layer, expert) (its VRAM tier evicted it): the
  // daemon's copy, released earlier with kReleaseClientCopy, is an ordinary slot again. Needs no
  // hold; a no-op against a daemon that predates it (abi::kOpUnkeep).
  Status unkeep(uint32_t layer, uint32_t expert);
  // Where the engine is: prefetches for layers it has passed are dropped.
  Status set_cursor(uint32_t token, uint32_t layer);
  // The daemon's counters for this session (an RPC).
  Result<SessionStats> stats();
  // Detaches now (the destructor does it otherwise). Later data-plane calls fail.
  Status detach();

  // --- For engines (cudaHostRegister the arena once) and tests ---
  const uint8_t* arena() const { return arena_; }
  uint64_t arena_bytes() const { return arena_bytes_; }
  const abi::SlotTableHeader* slot_table() const { return table_header_; }
  const abi::SlotEntry* slot_entries() const { return table_entries_; }
  uint8_t* session_region() const { return region_; }
  uint64_t session_bytes() const { return region_bytes_; }
  // The Session's own fds: valid while it lives, closed by it.
  int arena_fd() const;
  int slot_table_fd() const;
  int session_fd() const;
  int request_doorbell_fd() const;
  int completion_doorbell_fd() const;
  uint32_t request_capacity() const { return request_capacity_; }
  uint32_t completion_capacity() const { return completion_capacity_; }
  // Slots this Session holds (acquired, not yet released).
  uint32_t holds() const { return holds_.load(std::memory_order_relaxed); }

  // Spin this long for a completion before sleeping on the eventfd.
  void set_spin_us(uint32_t us) { spin_ns_ = uint64_t{us} * 1000; }
  // How long an acquire waits for each completion before it fails with ETIMEDOUT (the daemon is
  // stopped or wedged). Default: the daemon's acquire and read deadlines plus 5 s, so the
  // daemon's own error (a slot not free in time, a read not back) comes first; 30 s with a daemon
  // that has none.
  void set_wait_timeout_ms(uint32_t ms) { wait_timeout_ns_ = uint64_t{ms} * 1'000'000; }
  uint32_t wait_timeout_ms() const { return static_cast<uint32_t>(wait_timeout_ns_ / 1'000'000); }
  // The daemon's deadline for an acquire that waits for a slot (0: a daemon without one).
  uint32_t daemon_acquire_timeout_ms() const { return daemon_timeout_ms_; }
  // The daemon's deadline for one disk read (0: none, or a daemon without one).
  uint32_t daemon_read_timeout_ms() const { return daemon_read_timeout_ms_; }

 private:
  friend class Client;
  Session() = default;

  struct LayerSlices {
    uint32_t first = 0;  // index into layout_.slices
    uint32_t count = 0;
  };

  Status check_open() const;
  Error gone(const std::string& why) const;
  Status push(const abi::Request& r);
  void ring_daemon();
  bool poll_completion(abi::CompletionEntry* out);
  Status wait_completion(abi::CompletionEntry* out);
  Status fill_view(const abi::CompletionEntry& c, SlotView& view) const;
  // The error of an acquire the daemon completed with -err; for EBUSY and ETIMEDOUT (no slot) it
  // names the model's slots and who holds them (a stats call).
  Error acquire_error(int err, uint32_t layer, uint32_t expert);
  void release_quietly(std::span<const SlotView> views, size_t count);
  Status push_release(uint32_t slot, uint32_t flags = 0);

  std::shared_ptr<Connection> conn_;
  uint64_t key_ = 0;  // the Session capability's key in the connection
  uint32_t id_ = 0;
  ModelLayout layout_;
  std::vector<LayerSlices> layer_slices_;  // per block layer

  // The fds and mappings the Session owns (move-only owners, client.cc); released last, after the
  // destructor has detached. The pointers below are views into its mappings.
  struct Resources;
  std::unique_ptr<Resources> res_;
  const uint8_t* arena_ = nullptr;
  uint64_t arena_bytes_ = 0;
  const uint8_t* table_ = nullptr;
  uint64_t table_bytes_ = 0;
  const abi::SlotTableHeader* table_header_ = nullptr;
  const abi::SlotEntry* table_entries_ = nullptr;
  uint8_t* region_ = nullptr;
  uint64_t region_bytes_ = 0;

  abi::SessionHeader* header_ = nullptr;
  abi::RingHeader* req_ = nullptr;
  abi::Request* req_entries_ = nullptr;
  abi::RingHeader* comp_ = nullptr;
  abi::CompletionEntry* comp_entries_ = nullptr;
  uint32_t request_capacity_ = 0;
  uint32_t completion_capacity_ = 0;
  uint32_t req_tail_ = 0;   // ours: the next request to write
  uint32_t comp_head_ = 0;  // ours: the next completion to read
  uint32_t in_flight_ = 0;  // acquires sent, completions not yet read
  uint32_t abandoned_ = 0;  // of those, acquires a timed-out call gave up on (released on arrival)
  uint64_t next_tag_ = 1;
  std::atomic<uint32_t> holds_{0};  // read by holds() from any thread
  std::vector<uint32_t> held_;      // per slot: holds taken by acquires, not yet released
  uint64_t spin_ns_ = 30'000;
  uint64_t wait_timeout_ns_ = 30'000'000'000;
  uint32_t daemon_timeout_ms_ = 0;
  uint32_t daemon_read_timeout_ms_ = 0;
  bool detached_ = false;
  bool watching_ = false;  // completion_fd_ is registered with the connection
  std::mutex mu_;
};

class Client {
 public:
  // Connects to the daemon's socket and checks the protocol version. Errors: "cannot connect to
  // expertd at PATH: No such file or directory (is expertd running?)", "permission denied: ...",
  // "protocol version mismatch: daemon 2, client 1".
  static Result<std::unique_ptr<Client>> connect(const std::string& socket);
  // The reconnect after "expertd went away" (the daemon stopped, crashed or restarted): connect(),
  // tried again while the daemon is not there or not answering yet (no socket file, nobody
  // accepting, the connection dropped) until `wait` has passed; then that last error. Permission
  // and protocol errors return at once. A restarted daemon is a new one: attach new sessions (the
  // old ones, their holds and their mappings are gone; a warm restart keeps the cache).
  static Result<std::unique_ptr<Client>> connect(const std::string& socket,
                                                 std::chrono::milliseconds wait);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  const std::string& socket() const { return socket_; }
  Result<DaemonInfo> info();
  Result<ModelLayout> open_model(const std::string& name);
  Result<std::unique_ptr<Session>> attach(const std::string& model, const std::string& client_name);
  // The model's GGUF files, every shard in order, each with its read-only fd (the dense weights of
  // a model served by name). Errors: "model 'x' is not served by this daemon (models: a, b)".
  Result<std::vector<ModelFile>> model_files(const std::string& model);
  Result<Stats> stats();
  // kPrefetchDepthAuto: each model chooses its depth from its measured hint precision.
  Status set_prefetch_depth(uint32_t depth);
  Status set_queue_depth(uint32_t depth);
  Status set_policy(const std::string& name);
  Status pin(const std::string& model, uint32_t layer, uint32_t expert);
  Status unpin(const std::string& model, uint32_t layer, uint32_t expert);
  Status evict(const std::string& model, uint32_t layer, uint32_t expert);
  // Caps `model`'s cache at `slots` slots (0: every slot of its arena's cache), evicting down to
  // it; the stats' cache_limit shows it. For sweeps over cache sizes on one running daemon.
  Status set_cache_limit(const std::string& model, uint32_t slots);
  // Drops every cached and staged expert of `model` that nobody holds or pinned and restarts the
  // policy's history; returns how many were dropped.
  Result<uint32_t> evict_all(const std::string& model);
  // An empty RPC round trip (benchmarks).
  Status ping();
  // False once the connection to the daemon dropped.
  bool connected() const;

 private:
  Client() = default;
  std::string socket_;
  std::shared_ptr<Connection> conn_;
};

}  // namespace expertd::client
