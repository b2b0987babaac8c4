#include "daemon/rpc.h"

#include <capnp/rpc-twoparty.h>
#include <capnp/schema.h>
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
#include <deque>
#include <future>
#include <unordered_map>
#include <utility>
#include <vector>

#include "base/clock.h"
#include "base/fd.h"
#include "base/log_limit.h"
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
// A refused peer may read its error; then the connection goes. At most kMaxRefusedLingering
// refused connections (kMaxRefusedLingeringPerUid of one uid) wait so at once: beyond that a
// refused one is closed at once, so a peer reconnecting in a loop cannot pile up fds.
constexpr auto kRefusedLinger = 5 * kj::SECONDS;
constexpr uint32_t kMaxRefusedLingering = 64;
constexpr uint32_t kMaxRefusedLingeringPerUid = 4;
// Calls of one connection that run at once (past the RPC thread: posted to the reactor). The
// others wait in order; while they wait, Cap'n Proto's flow limit (kFlowLimitWords of call
// messages not yet answered) stops reading the socket: back-pressure, not memory.
constexpr uint32_t kMaxCallsInFlight = 8;
constexpr size_t kFlowLimitWords = 1024;
// A connection whose peer does not read its answers: past this many bytes queued for it, its calls
// wait (and then the socket is not read) until the peer reads.
constexpr size_t kMaxQueuedReplyBytes = 1u << 20;
constexpr auto kQueuePoll = 5 * kj::MILLISECONDS;

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

// base/log_limit.h's limiter, naming what it left out in one word (connections and calls refused,
// idle connections closed).
struct RateLimitedLog : LogLimit {
  std::string suppressed_note(const char* what) { return LogLimit::suppressed_note(what, what); }
};

// One allowed connection's bookkeeping on the RPC thread: who it is, its calls in flight (at most
// kMaxCallsInFlight; later calls wait in `waiters`, oldest first), its sessions and its last call
// (for the idle timeout). Shared by the connection and the capabilities it serves, which may
// outlive each other by a turn of the event loop.
struct ConnState : std::enable_shared_from_this<ConnState> {
  ConnState(kj::Timer& t, kj::TaskSet& ts, RateLimitedLog& denials, uid_t u, bool a)
      : timer(t), tasks(ts), denial_log(denials), uid(u), admin(a) {}
  ConnState(const ConnState&) = delete;
  ConnState& operator=(const ConnState&) = delete;

  // Holds one of the connection's call slots; move-only, gives it back when destroyed.
  class Permit {
   public:
    explicit Permit(std::shared_ptr<ConnState> s) : s_(std::move(s)) {}
    Permit(Permit&&) = default;
    Permit& operator=(Permit&&) = delete;  // would drop a slot without giving it back
    ~Permit() {
      if (s_) s_->finished();
    }

   private:
    std::shared_ptr<ConnState> s_;
  };

  // A call slot: at once when one is free and the peer reads its answers, else in turn. Waiters
  // whose ConnState goes (the connection closed) are rejected by their fulfillers' destruction.
  kj::Promise<Permit> admit() {
    last_call_ns = monotonic_ns();
    if (waiters.empty() && can_run()) {
      ++in_flight;
      return Permit(shared_from_this());
    }
    auto paf = kj::newPromiseAndFulfiller<Permit>();
    waiters.push_back(kj::mv(paf.fulfiller));
    pump();
    return kj::mv(paf.promise);
  }

  bool idle(uint64_t now_ns, uint64_t timeout_ns) const {
    return in_flight == 0 && waiters.empty() && sessions == 0 &&
           now_ns - last_call_ns >= timeout_ns;
  }

  kj::Timer& timer;
  kj::TaskSet& tasks;          // the Loop's: outlives every connection
  RateLimitedLog& denial_log;  // the Loop's: refused calls of every connection
  const uid_t uid;
  const bool admin;
  capnp::TwoPartyVatNetwork* network = nullptr;  // null once the connection is gone
  uint32_t sessions = 0;
  uint64_t last_call_ns = monotonic_ns();

 private:
  bool can_run() const {
    return in_flight < kMaxCallsInFlight &&
           (network == nullptr || network->getCurrentQueueSize() <= kMaxQueuedReplyBytes);
  }
  void finished() {
    --in_flight;
    last_call_ns = monotonic_ns();
    pump();
  }
  // Hands free slots to waiters in order. When they wait for the peer to read its answers (no
  // event says so), it looks again in kQueuePoll.
  void pump() {
    if (pumping) return;  // a waiter whose call is gone drops its Permit (and finishes) at once
    pumping = true;
    while (!waiters.empty() && can_run()) {
      ++in_flight;
      auto f = kj::mv(waiters.front());
      waiters.pop_front();
      f->fulfill(Permit(shared_from_this()));
    }
    pumping = false;
    if (!waiters.empty() && in_flight < kMaxCallsInFlight && !polling) {
      polling = true;
      tasks.add(timer.afterDelay(kQueuePoll).then([weak = weak_from_this()] {
        if (auto s = weak.lock()) {
          s->polling = false;
          s->pump();
        }
      }));
    }
  }

  uint32_t in_flight = 0;
  std::deque<kj::Own<kj::PromiseFulfiller<Permit>>> waiters;
  bool pumping = false;
  bool polling = false;
};

// Runs a generated server's dispatchCall for `method` once the connection admits it.
template <typename Base>
capnp::Capability::Server::DispatchCallResult admitted(
    Base& server, const std::shared_ptr<ConnState>& conn, uint64_t interface_id, uint16_t method_id,
    capnp::CallContext<capnp::AnyPointer, capnp::AnyPointer> context) {
  return {
      conn->admit().then([&server, interface_id, method_id, context](ConnState::Permit p) mutable {
        return server.Base::dispatchCall(interface_id, method_id, context)
            .promise.attach(kj::mv(p));
      }),
      false};
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
  SessionImpl(DaemonCore& core, uint32_t id, std::shared_ptr<ConnState> conn)
      : core_(core), id_(id), conn_(std::move(conn)) {
    ++conn_->sessions;
  }
  ~SessionImpl() {
    --conn_->sessions;
    // The client dropped its capability, or its connection went away (process death included).
    if (!detached_) {
      const uint32_t id = id_;
      (void)core_.post([id](DaemonCore& c) { c.detach(id, "client disconnected"); });
    }
  }

  DispatchCallResult dispatchCall(
      uint64_t interface_id, uint16_t method_id,
      capnp::CallContext<capnp::AnyPointer, capnp::AnyPointer> context) override {
    return admitted<rpc::Session::Server>(*this, conn_, interface_id, method_id, context);
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
  std::shared_ptr<ConnState> conn_;
  bool detached_ = false;
};

// The calls a reader (any allowed peer) may make; every other call of Expertd needs an admin. A
// method added to the schema is an admin's until it is listed here.
constexpr const char* kReaderCalls[] = {"info",  "openModel", "attach",
                                        "stats", "ping",      "modelFiles"};

struct Roles {
  Roles() {
    const auto schema = capnp::Schema::from<rpc::Expertd>();
    for (const auto m : schema.getMethods()) {
      const uint16_t ordinal = m.getOrdinal();
      if (ordinal >= names.size()) names.resize(ordinal + 1);
      names[ordinal] = m.getProto().getName();
      bool reader = false;
      for (const char* r : kReaderCalls) reader |= names[ordinal] == r;
      if (reader) reader_calls.push_back(ordinal);
    }
  }
  bool reader_may(uint16_t method) const {
    return std::find(reader_calls.begin(), reader_calls.end(), method) != reader_calls.end();
  }
  kj::StringPtr name(uint16_t method) const {
    return method < names.size() ? names[method] : kj::StringPtr("?");
  }
  std::vector<kj::StringPtr> names;  // by ordinal; the schema's own strings
  std::vector<uint16_t> reader_calls;
};

const Roles& roles() {
  static const Roles r;  // built once from the compiled-in schema
  return r;
}

// The bootstrap capability of one allowed connection.
class ExpertdImpl final : public rpc::Expertd::Server {
 public:
  ExpertdImpl(DaemonCore& core, ClientIdentity peer, std::shared_ptr<ConnState> conn)
      : core_(core), peer_(std::move(peer)), conn_(std::move(conn)) {}

  // Roles first (a refused call costs nothing), then the connection's admission.
  DispatchCallResult dispatchCall(
      uint64_t interface_id, uint16_t method_id,
      capnp::CallContext<capnp::AnyPointer, capnp::AnyPointer> context) override {
    if (interface_id == capnp::typeId<rpc::Expertd>() && !peer_.admin &&
        !roles().reader_may(method_id)) {
      const kj::StringPtr call = roles().name(method_id);
      if (conn_->denial_log.allow()) {
        spdlog::warn("rpc: refused {} from pid {} (uid {}): it needs an admin{}", call.cStr(),
                     peer_.pid, peer_.uid, conn_->denial_log.suppressed_note("refused calls"));
      }
      return {KJ_EXCEPTION(
                  FAILED,
                  kj::str("permission denied: ", call, " needs an admin (root, uid ", ::getuid(),
                          " or a member of admin_gids in expertd.toml); "
                          "uid ",
                          peer_.uid, " may attach, acquire, hint and read stats only")),
              false};
    }
    return admitted<rpc::Expertd::Server>(*this, conn_, interface_id, method_id, context);
  }

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
          r.setSession(kj::heap<SessionImpl>(core_, a.session, conn_));
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
          r.setAcquireTimeoutMs(a.acquire_timeout_ms);
          r.setReadTimeoutMs(a.read_timeout_ms);
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
  std::shared_ptr<ConnState> conn_;
};

// One accepted connection: its stream, its half of the two-party network and its RPC system.
// Destroying it drops every capability the peer held (its sessions detach).
// Incoming messages larger than the receive options' traversal limit are refused by Cap'n Proto
// from their segment table, before any buffer is allocated for them (the connection is closed).
struct Connection {
  Connection(kj::Own<kj::AsyncCapabilityStream> s, capnp::Capability::Client bootstrap,
             capnp::ReaderOptions receive, std::shared_ptr<ConnState> st = nullptr)
      : stream(kj::mv(s)),
        network(*stream, kMaxFdsPerMessage, capnp::rpc::twoparty::Side::SERVER, receive),
        rpc(capnp::makeRpcServer(network, kj::mv(bootstrap))),
        state(std::move(st)) {
    rpc.setFlowLimit(kFlowLimitWords);
    if (state) state->network = &network;
  }
  ~Connection() {
    if (state) state->network = nullptr;  // capabilities may outlive the network by a turn
  }
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;
  kj::Own<kj::AsyncCapabilityStream> stream;
  capnp::TwoPartyVatNetwork network;
  capnp::RpcSystem<capnp::rpc::twoparty::VatId> rpc;
  std::shared_ptr<ConnState> state;
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
    admin_gids = config.admin_gids;
    max_connections_per_uid = config.max_connections_per_uid;
    idle_timeout_ns = uint64_t{config.idle_timeout_s} * 1'000'000'000u;
    receive.traversalLimitInWords = config.max_frame_bytes / sizeof(capnp::word);
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

  static bool in_group(const PeerCredentials& p, gid_t g) {
    return g == p.gid || std::find(p.groups.begin(), p.groups.end(), g) != p.groups.end();
  }

  bool admin(const PeerCredentials& p) const {
    if (p.uid == 0 || p.uid == ::getuid()) return true;
    for (const gid_t g : admin_gids) {
      if (in_group(p, g)) return true;
    }
    return false;
  }

  bool allowed(const PeerCredentials& p) const {
    if (admin(p)) return true;
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
  // Past kMaxRefusedLingering such connections, or kMaxRefusedLingeringPerUid of `uid`'s, it is
  // closed at once: one uid reconnecting in a loop cannot take the others' chance to read why.
  void refuse(kj::Own<kj::AsyncCapabilityStream> stream, uid_t uid, const std::string& why) {
    uint32_t& of_uid = refused_lingering_of_uid[uid];
    if (refused_lingering >= kMaxRefusedLingering || of_uid >= kMaxRefusedLingeringPerUid) {
      if (of_uid == 0) refused_lingering_of_uid.erase(uid);
      return;  // `stream` closes here
    }
    capnp::Capability::Client refused(
        kj::Exception(kj::Exception::Type::FAILED, __FILE__, __LINE__, kj::str(why.c_str())));
    auto conn = kj::heap<Connection>(kj::mv(stream), kj::mv(refused), receive);
    auto done = conn->network.onDisconnect().exclusiveJoin(timer->afterDelay(kRefusedLinger));
    ++refused_lingering;
    ++of_uid;
    tasks->add(done.attach(kj::mv(conn), kj::defer([this, uid] {
                             --refused_lingering;
                             if (--refused_lingering_of_uid[uid] == 0)
                               refused_lingering_of_uid.erase(uid);
                           })));
  }

  // Resolves when `s` has had no session, no call and no call in flight for idle_timeout_ns.
  kj::Promise<void> idle_watch(std::shared_ptr<ConnState> s) {
    if (idle_timeout_ns == 0) return kj::NEVER_DONE;
    const uint64_t check_ns = std::min<uint64_t>(idle_timeout_ns / 2 + 1, 1'000'000'000u);
    return timer->afterDelay(check_ns * kj::NANOSECONDS).then([this, s]() -> kj::Promise<void> {
      if (!s->idle(monotonic_ns(), idle_timeout_ns)) return idle_watch(s);
      if (idle_log.allow()) {
        spdlog::info("rpc: closed a connection of uid {}: idle for {} s (idle_timeout_s){}", s->uid,
                     idle_timeout_ns / 1'000'000'000u,
                     idle_log.suppressed_note("idle connections closed"));
      }
      return kj::READY_NOW;
    });
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
            peer.pid, peer.uid, peer.gid, refusal_log.suppressed_note("refused connections"));
      }
      refuse(kj::mv(stream), peer.uid,
             fmt::format("permission denied: uid {} is not allowed (allowed_uids/allowed_gids "
                         "in expertd.toml)",
                         peer.uid));
      return;
    }
    const bool is_admin = admin(peer);
    uint32_t& of_uid = connections_of_uid[peer.uid];
    std::string over;
    if (connections >= kMaxConnections + (is_admin ? kAdminReservedConnections : 0)) {
      over = fmt::format("expertd is at its limit of {} connections{}", connections,
                         is_admin ? "" : " (admins have a few more)");
    } else if (!is_admin && of_uid >= max_connections_per_uid) {
      over = fmt::format("uid {} has {} connections open, its limit (max_connections_per_uid {})",
                         peer.uid, of_uid, max_connections_per_uid);
    }
    if (!over.empty()) {
      if (of_uid == 0) connections_of_uid.erase(peer.uid);
      if (refusal_log.allow()) {
        spdlog::warn("rpc: refused a connection from pid {} (uid {}): {}{}", peer.pid, peer.uid,
                     over, refusal_log.suppressed_note("refused connections"));
      }
      refuse(kj::mv(stream), peer.uid, over);
      return;
    }
    spdlog::debug("rpc: connection from pid {} (uid {}, gid {}{})", peer.pid, peer.uid, peer.gid,
                  is_admin ? ", admin" : "");
    ClientIdentity who;
    who.pid = peer.pid;
    who.uid = peer.uid;
    who.gid = peer.gid;
    who.admin = is_admin;
    auto state = std::make_shared<ConnState>(*timer, *tasks, denial_log, peer.uid, is_admin);
    auto conn = kj::heap<Connection>(
        kj::mv(stream),
        capnp::Capability::Client(kj::heap<ExpertdImpl>(core, std::move(who), state)), receive,
        state);
    ++connections;
    ++of_uid;
    const uid_t uid = peer.uid;
    auto done = conn->network.onDisconnect().exclusiveJoin(idle_watch(state));
    tasks->add(done.attach(kj::mv(conn), kj::defer([this, uid] {
                             --connections;
                             if (--connections_of_uid[uid] == 0) connections_of_uid.erase(uid);
                           })));
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
  std::vector<gid_t> admin_gids;
  uint32_t max_connections_per_uid = 0;
  uint64_t idle_timeout_ns = 0;  // 0: never
  capnp::ReaderOptions receive;  // traversalLimitInWords: max_frame
  uint32_t refused_lingering = 0;
  std::unordered_map<uid_t, uint32_t> refused_lingering_of_uid;
  std::unordered_map<uid_t, uint32_t> connections_of_uid;  // allowed connections open, by uid
  RateLimitedLog refusal_log;
  RateLimitedLog idle_log;
  RateLimitedLog denial_log;
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
