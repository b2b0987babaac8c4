#include "daemon/rpc.h"

#include <capnp/rpc-twoparty.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <kj/async-io.h>
#include <kj/async.h>
#include <kj/timer.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <future>
#include <utility>
#include <vector>

#include "base/clock.h"
#include "base/fd.h"
#include "client/expertd.capnp.h"
#include "client/include/expertd/protocol.h"
#include "client/wire.h"

#ifndef EXPERTD_VERSION
#define EXPERTD_VERSION "0.0.0"
#endif

namespace expertd {

namespace {

constexpr uint kMaxFdsPerMessage = 8;
constexpr int kListenBacklog = 128;
constexpr uint32_t kMaxConnections = 256;
// A refused peer may read its error; then the connection goes.
constexpr auto kRefusedLinger = 5 * kj::SECONDS;

kj::Exception to_kj(const Error& e) {
  // The description is the message alone: the client shows it as is.
  return kj::Exception(
      e.code == EBUSY ? kj::Exception::Type::OVERLOADED : kj::Exception::Type::FAILED, __FILE__,
      __LINE__, kj::heapString(e.message.data(), e.message.size()));
}

kj::StringPtr text(const std::string& s) { return kj::StringPtr(s.c_str(), s.size()); }
std::string str(capnp::Text::Reader t) { return std::string(t.cStr(), t.size()); }

// Runs `fn(core) -> Result<T>` on the reactor thread; the promise resolves on the RPC thread.
// A command the caller no longer waits for (its connection closed) is skipped. The value travels
// on the heap (kj::Own): small to move, and it keeps GCC's maybe-uninitialized analysis of kj's
// NullableValue quiet.
template <typename T, typename Fn>
kj::Promise<kj::Own<T>> on_reactor(DaemonCore& core, Fn fn) {
  auto paf = kj::newPromiseAndCrossThreadFulfiller<kj::Own<T>>();
  // std::function needs a copyable callable: the fulfiller rides in a shared_ptr.
  auto fulfiller =
      std::make_shared<kj::Own<kj::CrossThreadPromiseFulfiller<kj::Own<T>>>>(kj::mv(paf.fulfiller));
  const bool posted = core.post([fulfiller, fn = std::move(fn)](DaemonCore& c) mutable {
    if (!(*fulfiller)->isWaiting()) return;
    Result<T> r = fn(c);
    if (r) {
      (*fulfiller)->fulfill(kj::heap<T>(std::move(r).value()));
    } else {
      (*fulfiller)->reject(to_kj(r.error()));
    }
  });
  if (!posted) {
    return KJ_EXCEPTION(OVERLOADED, "expertd is stopping or its command queue is full");
  }
  return kj::mv(paf.promise);
}

// An fd passed to the client; closed when the capability goes.
class FdImpl final : public rpc::Fd::Server {
 public:
  explicit FdImpl(UniqueFd fd) : fd_(std::move(fd)) {}
  kj::Maybe<int> getFd() override { return fd_.get(); }

 private:
  UniqueFd fd_;
};

// The result of an attach while it travels from the reactor to the RPC thread. Owns the fds (in
// the Attachment) and the session: if nobody takes them (the caller's connection closed
// meanwhile), the fds close and the destructor detaches the session.
class OwnedAttachment {
 public:
  OwnedAttachment(DaemonCore& core, Attachment a) : core_(&core), a_(std::move(a)) {}
  OwnedAttachment(OwnedAttachment&& o) noexcept
      : core_(std::exchange(o.core_, nullptr)), a_(std::move(o.a_)) {}
  OwnedAttachment& operator=(OwnedAttachment&&) = delete;
  ~OwnedAttachment() {
    if (core_ == nullptr) return;
    const uint32_t id = a_.session;
    (void)core_->post([id](DaemonCore& c) { c.detach(id, "attach abandoned by the client"); });
  }
  // Hands over the fds and the session.
  Attachment release() {
    core_ = nullptr;
    return std::move(a_);
  }

 private:
  DaemonCore* core_;
  Attachment a_;
};

class SessionImpl final : public rpc::Session::Server {
 public:
  SessionImpl(DaemonCore& core, uint32_t id) : core_(core), id_(id) {}
  ~SessionImpl() {
    // The client dropped its capability, or its connection went away (process death included).
    if (!detached_) {
      const uint32_t id = id_;
      (void)core_.post([id](DaemonCore& c) { c.detach(id, "client disconnected"); });
    }
  }

  kj::Promise<void> stats(StatsContext context) override {
    if (detached_) return KJ_EXCEPTION(FAILED, "session already detached");
    const uint32_t id = id_;
    return on_reactor<SessionStats>(core_,
                                    [id](DaemonCore& c) -> Result<SessionStats> {
                                      for (auto& s : c.stats().sessions) {
                                        if (s.session == id) return std::move(s);
                                      }
                                      return make_error(ENOENT, "session is gone");
                                    })
        .then([context](kj::Own<SessionStats> p) mutable {
          wire::fill(*p, context.getResults().initStats());
        });
  }

  kj::Promise<void> detach(DetachContext) override {
    if (detached_) return kj::READY_NOW;
    detached_ = true;
    const uint32_t id = id_;
    return on_reactor<Ok>(core_,
                          [id](DaemonCore& c) -> Result<Ok> {
                            c.detach(id, "client detached");
                            return Ok{};
                          })
        .ignoreResult();
  }

 private:
  DaemonCore& core_;
  uint32_t id_;
  bool detached_ = false;
};

// The bootstrap capability of one allowed connection.
class ExpertdImpl final : public rpc::Expertd::Server {
 public:
  ExpertdImpl(DaemonCore& core, ClientIdentity peer) : core_(core), peer_(std::move(peer)) {}

  kj::Promise<void> info(InfoContext context) override {
    return on_reactor<DaemonStats>(
               core_,
               [](DaemonCore& c) -> Result<DaemonStats> {
                 DaemonStats d;  // only the backend is needed: skip the per-model work
                 auto full = c.stats();
                 d.backend = std::move(full.backend);
                 d.backend_detail = std::move(full.backend_detail);
                 return d;
               })
        .then([this, context](kj::Own<DaemonStats> d) mutable {
          auto r = context.getResults();
          r.setVersion(EXPERTD_VERSION);
          r.setProtocolVersion(abi::kProtocolVersion);
          r.setBackend(text(d->backend));
          r.setBackendDetail(text(d->backend_detail));
          const auto& names = core_.model_names();
          auto models = r.initModels(static_cast<uint>(names.size()));
          for (uint i = 0; i < names.size(); ++i) models.set(i, text(names[i]));
        });
  }

  kj::Promise<void> openModel(OpenModelContext context) override {
    std::string name = str(context.getParams().getName());
    return on_reactor<ModelLayout>(core_, [name](DaemonCore& c) { return c.open_model(name); })
        .then([context](kj::Own<ModelLayout> l) mutable {
          wire::fill(*l, context.getResults().initLayout());
        });
  }

  kj::Promise<void> attach(AttachContext context) override {
    const auto p = context.getParams();
    std::string model = str(p.getModel());
    ClientIdentity who = peer_;
    who.name = str(p.getClientName()).substr(0, 64);
    return on_reactor<OwnedAttachment>(core_,
                                       [model, who](DaemonCore& c) -> Result<OwnedAttachment> {
                                         auto a = c.attach(model, who);
                                         if (!a) return a.take_error();
                                         return OwnedAttachment(c, std::move(*a));
                                       })
        .then([this, context](kj::Own<OwnedAttachment> owned) mutable {
          Attachment a = owned->release();
          auto r = context.getResults();
          r.setSession(kj::heap<SessionImpl>(core_, a.session));
          r.setSessionId(a.session);
          r.setArenaBytes(a.arena_bytes);
          r.setSlotTableBytes(a.slot_table_bytes);
          r.setSessionBytes(a.session_bytes);
          r.setRequestCapacity(a.request_capacity);
          r.setCompletionCapacity(a.completion_capacity);
          r.setArena(kj::heap<FdImpl>(std::move(a.arena_fd)));
          r.setSlotTable(kj::heap<FdImpl>(std::move(a.slot_table_fd)));
          r.setSessionRegion(kj::heap<FdImpl>(std::move(a.session_fd)));
          r.setRequestDoorbell(kj::heap<FdImpl>(std::move(a.request_doorbell)));
          r.setCompletionDoorbell(kj::heap<FdImpl>(std::move(a.completion_doorbell)));
        });
  }

  kj::Promise<void> stats(StatsContext context) override {
    return on_reactor<DaemonStats>(core_,
                                   [](DaemonCore& c) -> Result<DaemonStats> { return c.stats(); })
        .then([context](kj::Own<DaemonStats> d) mutable {
          wire::fill(*d, context.getResults().initStats());
        });
  }

  kj::Promise<void> setPrefetchDepth(SetPrefetchDepthContext context) override {
    const uint32_t depth = context.getParams().getDepth();
    return status(core_, [depth](DaemonCore& c) { return c.set_prefetch_depth(depth); });
  }

  kj::Promise<void> setQueueDepth(SetQueueDepthContext context) override {
    const uint32_t depth = context.getParams().getDepth();
    return status(core_, [depth](DaemonCore& c) { return c.set_queue_depth(depth); });
  }

  kj::Promise<void> setPolicy(SetPolicyContext context) override {
    std::string name = str(context.getParams().getName());
    return status(core_, [name](DaemonCore& c) { return c.set_policy(name); });
  }

  kj::Promise<void> pin(PinContext context) override {
    const auto p = context.getParams();
    return pin_as(str(p.getModel()), p.getLayer(), p.getExpert(), true);
  }

  kj::Promise<void> unpin(UnpinContext context) override {
    const auto p = context.getParams();
    return pin_as(str(p.getModel()), p.getLayer(), p.getExpert(), false);
  }

  kj::Promise<void> evict(EvictContext context) override {
    const auto p = context.getParams();
    std::string model = str(p.getModel());
    const uint32_t layer = p.getLayer();
    const uint32_t expert = p.getExpert();
    return status(core_,
                  [model, layer, expert](DaemonCore& c) { return c.evict(model, layer, expert); });
  }

  kj::Promise<void> setCacheLimit(SetCacheLimitContext context) override {
    const auto p = context.getParams();
    std::string model = str(p.getModel());
    const uint32_t slots = p.getSlots();
    return status(core_, [model, slots](DaemonCore& c) { return c.set_cache_limit(model, slots); });
  }

  kj::Promise<void> evictAll(EvictAllContext context) override {
    std::string model = str(context.getParams().getModel());
    return on_reactor<uint32_t>(core_, [model](DaemonCore& c) { return c.evict_all(model); })
        .then([context](kj::Own<uint32_t> n) mutable { context.getResults().setEvicted(*n); });
  }

  kj::Promise<void> ping(PingContext) override { return kj::READY_NOW; }

  // On this thread: the shard paths are fixed at start and open() must not stall the reactor.
  // The connection passed the permission check, so its peer may read the model's files.
  kj::Promise<void> modelFiles(ModelFilesContext context) override {
    const auto p = context.getParams();
    uint32_t count = 0;
    auto files = core_.open_model_files(str(p.getModel()), p.getFirst(), kMaxFdsPerMessage, &count);
    if (!files) return to_kj(files.error());
    auto r = context.getResults();
    r.setShardCount(count);
    auto list = r.initFiles(static_cast<uint>(files->size()));
    for (uint i = 0; i < files->size(); ++i) {
      ModelFileFd& f = (*files)[i];
      auto b = list[i];
      b.setShard(f.shard);
      b.setName(text(f.name));
      b.setPath(text(f.path));
      b.setBytes(f.bytes);
      b.setFile(kj::heap<FdImpl>(std::move(f.fd)));
    }
    return kj::READY_NOW;
  }

 private:
  template <typename Fn>
  static kj::Promise<void> status(DaemonCore& core, Fn fn) {
    return on_reactor<Ok>(core, std::move(fn)).ignoreResult();
  }

  kj::Promise<void> pin_as(std::string model, uint32_t layer, uint32_t expert, bool pinned) {
    return status(core_, [model = std::move(model), layer, expert, pinned](DaemonCore& c) {
      return c.pin(model, layer, expert, pinned);
    });
  }

  DaemonCore& core_;
  ClientIdentity peer_;
};

// One accepted connection: its stream, its half of the two-party network and its RPC system.
// Destroying it drops every capability the peer held (its sessions detach).
struct Connection {
  Connection(kj::Own<kj::AsyncCapabilityStream> s, capnp::Capability::Client bootstrap)
      : stream(kj::mv(s)),
        network(*stream, kMaxFdsPerMessage, capnp::rpc::twoparty::Side::SERVER),
        rpc(capnp::makeRpcServer(network, kj::mv(bootstrap))) {}
  kj::Own<kj::AsyncCapabilityStream> stream;
  capnp::TwoPartyVatNetwork network;
  capnp::RpcSystem<capnp::rpc::twoparty::VatId> rpc;
};

struct PeerCredentials {  // unknown until SO_PEERCRED says otherwise: nobody is allowed
  pid_t pid = 0;
  uid_t uid = static_cast<uid_t>(-1);
  gid_t gid = static_cast<gid_t>(-1);
  std::vector<gid_t> groups;  // supplementary groups (SO_PEERGROUPS), when the kernel has it
};

PeerCredentials peer_credentials(int fd) {
  PeerCredentials p;
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) {
    p.pid = cred.pid;
    p.uid = cred.uid;
    p.gid = cred.gid;
  }
#ifdef SO_PEERGROUPS
  std::vector<gid_t> groups(64);
  socklen_t glen = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &glen) != 0 && errno == ERANGE) {
    groups.resize(glen / sizeof(gid_t) + 1);
    glen = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &glen) != 0) glen = 0;
  }
  groups.resize(glen / sizeof(gid_t));
  p.groups = std::move(groups);
#endif
  return p;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The RPC thread

struct RpcServer::Loop : public kj::TaskSet::ErrorHandler {
  Loop(DaemonCore& c, const DaemonConfig& config) : core(c) {
    allowed_uids = config.allowed_uids;
    allowed_gids = config.allowed_gids;
#if EXPERTD_TEST_HOOKS  // expertd-test only (daemon/CMakeLists.txt); never in expertd
    if (const char* hook = std::getenv("EXPERTD_TEST_PEER_UID"); hook != nullptr && *hook) {
      test_uid = static_cast<uid_t>(std::strtoul(hook, nullptr, 10));
      has_test_uid = true;
      spdlog::warn("rpc: test hook EXPERTD_TEST_PEER_UID is set: every peer is treated as uid {}",
                   test_uid);
    }
#endif
  }

  void taskFailed(kj::Exception&& e) override {
    spdlog::debug("rpc: connection ended: {}", e.getDescription().cStr());
  }

  bool allowed(const PeerCredentials& p) const {
    if (p.uid == 0 || p.uid == ::getuid()) return true;
    // Members of the daemon's own group (primary or supplementary: SO_PEERGROUPS) pass, as the
    // documentation says: `usermod -aG expertd USER` is how a user is let in.
    const gid_t own = ::getgid();
    if (p.gid == own || std::find(p.groups.begin(), p.groups.end(), own) != p.groups.end()) {
      return true;
    }
    if (std::find(allowed_uids.begin(), allowed_uids.end(), p.uid) != allowed_uids.end()) {
      return true;
    }
    for (const gid_t g : allowed_gids) {
      if (g == p.gid || std::find(p.groups.begin(), p.groups.end(), g) != p.groups.end()) {
        return true;
      }
    }
    return false;
  }

  // Accepts forever; a failed accept (EMFILE, ENOBUFS) is logged and retried shortly.
  kj::Promise<void> accept_loop(kj::ConnectionReceiver& listener) {
    return listener.accept()
        .then(
            [this](kj::Own<kj::AsyncIoStream>&& s) -> kj::Promise<void> {
              on_connection(s.downcast<kj::AsyncCapabilityStream>());
              return kj::READY_NOW;
            },
            [this](kj::Exception&& e) -> kj::Promise<void> {
              spdlog::error("rpc: accept failed: {}; retrying", e.getDescription().cStr());
              return timer->afterDelay(100 * kj::MILLISECONDS);
            })
        .then([this, &listener] { return accept_loop(listener); });
  }

  // Serves `stream` with a bootstrap on which every call fails with `why`, for a few seconds.
  void refuse(kj::Own<kj::AsyncCapabilityStream> stream, const std::string& why) {
    capnp::Capability::Client refused(
        kj::Exception(kj::Exception::Type::FAILED, __FILE__, __LINE__, kj::str(why.c_str())));
    auto conn = kj::heap<Connection>(kj::mv(stream), kj::mv(refused));
    auto done = conn->network.onDisconnect().exclusiveJoin(timer->afterDelay(kRefusedLinger));
    tasks->add(done.attach(kj::mv(conn)));
  }

  void on_connection(kj::Own<kj::AsyncCapabilityStream> stream) {
    PeerCredentials peer;
    KJ_IF_MAYBE (fd, stream->getFd()) {
      peer = peer_credentials(*fd);
    }
    if (has_test_uid) {  // a stranger: its own uid and gid, in no other group
      peer.uid = test_uid;
      peer.gid = static_cast<gid_t>(test_uid);
      peer.groups.clear();
    }
    if (!allowed(peer)) {
      if (refusal_log.allow()) {
        spdlog::warn(
            "rpc: refused a connection from pid {} (uid {}, gid {}): not in allowed_uids "
            "or allowed_gids, nor in the daemon's group{}",
            peer.pid, peer.uid, peer.gid, refusal_log.suppressed_note());
      }
      refuse(kj::mv(stream),
             fmt::format("permission denied: uid {} is not allowed (allowed_uids/allowed_gids "
                         "in expertd.toml)",
                         peer.uid));
      return;
    }
    if (connections >= kMaxConnections) {
      if (refusal_log.allow()) {
        spdlog::warn(
            "rpc: refused a connection from pid {} (uid {}): {} connections already "
            "open{}",
            peer.pid, peer.uid, connections, refusal_log.suppressed_note());
      }
      refuse(kj::mv(stream),
             fmt::format("expertd is at its limit of {} connections", kMaxConnections));
      return;
    }
    spdlog::debug("rpc: connection from pid {} (uid {}, gid {})", peer.pid, peer.uid, peer.gid);
    ClientIdentity who;
    who.pid = peer.pid;
    who.uid = peer.uid;
    who.gid = peer.gid;
    auto conn = kj::heap<Connection>(
        kj::mv(stream), capnp::Capability::Client(kj::heap<ExpertdImpl>(core, std::move(who))));
    ++connections;
    auto done = conn->network.onDisconnect();
    tasks->add(done.attach(kj::mv(conn), kj::defer([this] { --connections; })));
  }

  // The thread's body: serves `listen_fd` until stop is fulfilled.
  void run(UniqueFd listen_fd, std::promise<std::string>& started) {
    bool announced = false;  // after that, `started` belongs to a returned start()
    try {
      auto io = kj::setupAsyncIo();
      timer = &io.provider->getTimer();
      tasks = kj::heap<kj::TaskSet>(*this);
      auto stop = kj::newPromiseAndCrossThreadFulfiller<void>();
      stop_fulfiller = kj::mv(stop.fulfiller);
      auto listener = io.lowLevelProvider->wrapListenSocketFd(
          listen_fd.release(), kj::LowLevelAsyncIoProvider::TAKE_OWNERSHIP |
                                   kj::LowLevelAsyncIoProvider::ALREADY_CLOEXEC |
                                   kj::LowLevelAsyncIoProvider::ALREADY_NONBLOCK);
      auto accepting = accept_loop(*listener).eagerlyEvaluate([](kj::Exception&& e) {
        spdlog::error("rpc: accepting connections failed: {}", e.getDescription().cStr());
      });
      started.set_value("");
      announced = true;
      stop.promise.wait(io.waitScope);
      // Teardown on this thread, inside its event loop: the connections (and with them the
      // sessions' capabilities) first.
      tasks = nullptr;
      accepting = nullptr;
      listener = nullptr;
      timer = nullptr;
    } catch (const kj::Exception& e) {
      tasks = nullptr;
      std::string why = fmt::format("rpc thread: {}", e.getDescription().cStr());
      if (announced) {
        spdlog::error("{}", why);
      } else {
        started.set_value(why);
      }
    }
  }

  DaemonCore& core;
  std::vector<uid_t> allowed_uids;
  std::vector<gid_t> allowed_gids;
  uint32_t connections = 0;  // allowed connections open
  // Refused connections are logged at most kBurst times per kWindow: a peer that reconnects in a
  // loop must not flood the journal. The next line logged says how many were left out.
  struct RefusalLog {
    static constexpr uint32_t kBurst = 5;
    static constexpr uint64_t kWindowNs = 10'000'000'000;
    uint64_t window_start = 0;
    uint32_t in_window = 0;
    uint64_t suppressed = 0;
    bool allow() {
      const uint64_t now = monotonic_ns();
      if (now - window_start >= kWindowNs) {
        window_start = now;
        in_window = 0;
      }
      if (in_window < kBurst) {
        ++in_window;
        return true;
      }
      ++suppressed;
      return false;
    }
    // " (N more refusals not logged)" once after some were left out, else "".
    std::string suppressed_note() {
      if (suppressed == 0) return {};
      const uint64_t n = std::exchange(suppressed, 0);
      return fmt::format(" ({} more refused connection{} not logged)", n, n == 1 ? "" : "s");
    }
  };
  RefusalLog refusal_log;
  bool has_test_uid = false;
  uid_t test_uid = 0;
  kj::Timer* timer = nullptr;
  kj::Own<kj::TaskSet> tasks;  // the connections; lives inside the thread's event loop
  kj::Own<kj::CrossThreadPromiseFulfiller<void>> stop_fulfiller;
};

// ---------------------------------------------------------------------------------------------
// Socket setup

namespace {

Error socket_error(const std::string& path, const char* what, int e) {
  return make_error(e, fmt::format("control socket {}: {}: {}", path, what, std::strerror(e)));
}

Status make_parent_dirs(const std::string& path) {
  for (size_t pos = path.find('/', 1); pos != std::string::npos; pos = path.find('/', pos + 1)) {
    const std::string dir = path.substr(0, pos);
    if (::mkdir(dir.c_str(), 0755) != 0) {
      const int e = errno;  // before the format below
      if (e != EEXIST)
        return socket_error(path, fmt::format("creating directory {}", dir).c_str(), e);
    }
  }
  return Ok{};
}

// A socket file left by a daemon that died is removed; one somebody listens on is an error.
Status remove_stale_socket(const std::string& path, const sockaddr_un& addr) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    return errno == ENOENT ? Status(Ok{}) : Status(socket_error(path, "stat", errno));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return make_error(EEXIST,
                      fmt::format("control socket {}: the path exists and is not a socket", path));
  }
  const UniqueFd probe(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!probe.valid()) return socket_error(path, "socket", errno);
  const int r = ::connect(probe.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  const int e = errno;
  if (r == 0) {
    return make_error(EADDRINUSE,
                      fmt::format("control socket {}: another expertd is listening on it", path));
  }
  if (e != ECONNREFUSED) return socket_error(path, "probing the existing socket", e);
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    return socket_error(path, "removing the stale socket", errno);
  }
  spdlog::info("rpc: removed the stale socket {} (nothing listened on it)", path);
  return Ok{};
}

}  // namespace

Result<std::unique_ptr<RpcServer>> RpcServer::start(DaemonCore& core, const DaemonConfig& config,
                                                    UniqueFd passed) {
  const std::string& path = config.socket;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return make_error(ENAMETOOLONG, fmt::format("control socket '{}': the path must be 1..{} bytes",
                                                path, sizeof(addr.sun_path) - 1));
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);

  // Socket activation (expertd.socket), or a warm restart: the socket is bound and listening.
  UniqueFd fd;
  bool activated = false;
  if (!passed.valid() && sd_listen_fds(1) >= 1 &&
      sd_is_socket_unix(SD_LISTEN_FDS_START, SOCK_STREAM, 1, path.c_str(), 0) > 0) {
    passed = UniqueFd(SD_LISTEN_FDS_START);
  }
  if (passed.valid()) {
    fd = std::move(passed);
    activated = true;
    const int flags = ::fcntl(fd.get(), F_GETFL);
    ::fcntl(fd.get(), F_SETFL, flags | O_NONBLOCK);
    ::fcntl(fd.get(), F_SETFD, FD_CLOEXEC);
    spdlog::info("rpc: using the socket systemd passed for {}", path);
  } else {
    EXPERTD_TRY(make_parent_dirs(path));
    EXPERTD_TRY(remove_stale_socket(path, addr));
    fd = UniqueFd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd.valid()) return socket_error(path, "socket", errno);
    if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
      return socket_error(path, "bind", errno);
    }
    if (::chmod(path.c_str(), 0660) != 0) return socket_error(path, "chmod 0660", errno);
    // Members of the first allowed group reach the socket through its group permission.
    if (!config.allowed_gids.empty() &&
        ::chown(path.c_str(), static_cast<uid_t>(-1), config.allowed_gids.front()) != 0) {
      const int e = errno;
      spdlog::warn("rpc: cannot give {} to group {}: {}", path, config.allowed_gids.front(),
                   std::strerror(e));
    }
    if (::listen(fd.get(), kListenBacklog) != 0) return socket_error(path, "listen", errno);
  }
  struct stat st {};
  if (!activated) (void)::stat(path.c_str(), &st);

  std::unique_ptr<RpcServer> server(new RpcServer());
  server->socket_path_ = path;
  server->socket_dev_ = st.st_dev;
  server->socket_ino_ = st.st_ino;
  server->listen_dup_ = UniqueFd(::fcntl(fd.get(), F_DUPFD_CLOEXEC, 3));
  server->loop_ = std::make_shared<Loop>(core, config);
  std::promise<std::string> started;
  auto started_future = started.get_future();
  server->thread_ = std::thread([loop = server->loop_, fd = std::move(fd), &started]() mutable {
    loop->run(std::move(fd), started);
  });
  const std::string error = started_future.get();
  if (!error.empty()) {
    server->thread_.join();
    server->stopped_ = true;
    ::unlink(path.c_str());
    return make_error(EIO, fmt::format("control socket {}: {}", path, error));
  }
  spdlog::info("rpc: listening on {}", path);
  return server;
}

UniqueFd RpcServer::take_listen_fd() {
  socket_ino_ = 0;  // the successor serves the file: stop() must not remove it
  return std::move(listen_dup_);
}

void RpcServer::stop() {
  if (stopped_.exchange(true)) return;
  if (loop_ && loop_->stop_fulfiller.get() != nullptr) loop_->stop_fulfiller->fulfill();
  if (thread_.joinable()) thread_.join();
  listen_dup_ = UniqueFd();  // no successor: nothing may wait in the backlog
  // Remove the socket file only if it is still ours (a new daemon may have replaced it).
  struct stat st {};
  if (socket_ino_ != 0 && ::stat(socket_path_.c_str(), &st) == 0 && st.st_dev == socket_dev_ &&
      st.st_ino == socket_ino_) {
    ::unlink(socket_path_.c_str());
  }
}

RpcServer::~RpcServer() { stop(); }

}  // namespace expertd
