#include "expertd/client.h"

#include <capnp/rpc-twoparty.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <kj/async-io.h>
#include <kj/async.h>
#include <poll.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <future>
#include <thread>
#include <unordered_map>
#include <utility>

#include "base/check.h"
#include "base/clock.h"
#include "base/fd.h"
#include "client/expertd.capnp.h"
#include "client/wire.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define EXPERTD_CPU_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define EXPERTD_CPU_PAUSE() asm volatile("yield" ::: "memory")
#else
#define EXPERTD_CPU_PAUSE() \
  do {                      \
  } while (0)
#endif

namespace expertd::client {

namespace {

constexpr uint kMaxFdsPerMessage = 8;
constexpr uint64_t kCallTimeoutMs = 30'000;      // a control call the daemon never answers
constexpr int kSleepSliceMs = 100;               // a sleeping waiter re-checks liveness this often
constexpr uint64_t kRingFullTimeoutMs = 10'000;  // the daemon stopped consuming requests
// How long past the daemon's own acquire deadline the client waits for a completion before it
// calls the daemon wedged (the daemon's clearer error arrives first), and the wait without one (a
// daemon that predates the deadline).
constexpr uint64_t kWaitGraceMs = 5'000;
constexpr uint64_t kDefaultWaitMs = 30'000;

std::string str(capnp::Text::Reader t) { return std::string(t.cStr(), t.size()); }
kj::StringPtr text(const std::string& s) { return kj::StringPtr(s.c_str(), s.size()); }

void wake(int eventfd) {
  const uint64_t one = 1;
  // A full counter (EAGAIN) is still readable: nothing is lost.
  [[maybe_unused]] const ssize_t n = ::write(eventfd, &one, sizeof(one));
}

// What attach() gets back from the RPC thread: the session's numbers and dup()ed fds.
struct AttachReply {
  uint64_t key = 0;
  uint32_t session = 0;
  uint64_t arena_bytes = 0;
  uint64_t slot_table_bytes = 0;
  uint64_t session_bytes = 0;
  uint32_t request_capacity = 0;
  uint32_t completion_capacity = 0;
  uint32_t acquire_timeout_ms = 0;  // 0 from a daemon without the deadline
  uint32_t read_timeout_ms = 0;     // 0 from a daemon without a read deadline, or with it off
  std::array<UniqueFd, 5> fds;      // arena, slot table, session, req, comp
};

}  // namespace

std::string default_socket() {
  const char* env = std::getenv("EXPERTD_SOCKET");
  return env != nullptr && *env ? std::string(env) : std::string(kDefaultSocket);
}

// ---------------------------------------------------------------------------------------------
// Connection: the RPC thread. Everything capnp lives on it; other threads reach it through
// executeSync() with functions that capture nothing capnp (kj destroys them on the caller).

class Connection {
 public:
  static Result<std::shared_ptr<Connection>> start(UniqueFd fd, std::string socket);
  ~Connection();

  // Runs `fn(bootstrap) -> kj::Promise<T>` on the RPC thread and waits for its value.
  template <typename T, typename Fn>
  Result<T> call(Fn&& fn) {
    if (disconnected_.load(std::memory_order_acquire)) return gone_error();
    try {
      return executor_->executeSync([this, &fn]() -> kj::Promise<T> {
        if (state_ == nullptr) {
          kj::throwFatalException(KJ_EXCEPTION(DISCONNECTED, "the client's RPC thread stopped"));
        }
        kj::Promise<T> answer = fn(*state_);
        return answer.exclusiveJoin(
            state_->timer->afterDelay(kCallTimeoutMs * kj::MILLISECONDS).then([]() -> T {
              kj::throwFatalException(kj::Exception(
                  kj::Exception::Type::OVERLOADED, __FILE__, __LINE__,
                  kj::str("expertd did not answer within ", kCallTimeoutMs / 1000, " s")));
            }));
      });
    } catch (const kj::Exception& e) {
      return to_error(e);
    }
  }

  bool disconnected() const { return disconnected_.load(std::memory_order_acquire); }
  std::string disconnect_reason() const {
    std::lock_guard<std::mutex> lock(mu_);
    return reason_;
  }
  Error gone_error() const {
    return make_error(ECONNRESET, "expertd went away: " + disconnect_reason() +
                                      " (when it is back: connect again and attach a new session)");
  }

  // Sleepers on these eventfds are woken when the connection drops. The fds are borrowed: a
  // Session unwatches its doorbell before it closes it.
  void watch_doorbell(int fd) {
    std::lock_guard<std::mutex> lock(mu_);
    doorbells_.push_back(fd);
    if (disconnected_.load()) wake(fd);
  }
  void unwatch_doorbell(int fd) {
    std::lock_guard<std::mutex> lock(mu_);
    doorbells_.erase(std::remove(doorbells_.begin(), doorbells_.end(), fd), doorbells_.end());
  }

  // State owned by the RPC thread.
  struct State {
    kj::Timer* timer;
    rpc::Expertd::Client bootstrap;
    std::unordered_map<uint64_t, rpc::Session::Client> sessions;
    uint64_t next_key = 1;
  };

 private:
  Connection() = default;
  void run(UniqueFd fd, std::promise<std::string>* started);
  void mark_disconnected(std::string why);
  Error to_error(const kj::Exception& e) {
    std::string d(e.getDescription().cStr());
    constexpr std::string_view kRemote = "remote exception: ";
    if (d.rfind(kRemote, 0) == 0) d.erase(0, kRemote.size());
    if (e.getType() == kj::Exception::Type::DISCONNECTED || disconnected()) {
      if (!disconnected()) mark_disconnected(d);
      return gone_error();
    }
    return make_error(e.getType() == kj::Exception::Type::OVERLOADED ? EBUSY : EIO, d);
  }

  std::string socket_;
  std::thread thread_;
  kj::Own<const kj::Executor> executor_;
  kj::Own<kj::CrossThreadPromiseFulfiller<void>> stop_;
  State* state_ = nullptr;
  std::atomic<bool> disconnected_{false};
  mutable std::mutex mu_;
  std::string reason_;
  std::vector<int> doorbells_;
};

Result<std::shared_ptr<Connection>> Connection::start(UniqueFd fd, std::string socket) {
  std::shared_ptr<Connection> c(new Connection());
  c->socket_ = std::move(socket);
  std::promise<std::string> started;
  auto future = started.get_future();
  c->thread_ = std::thread([raw = c.get(), fd = std::move(fd), &started]() mutable {
    raw->run(std::move(fd), &started);
  });
  const std::string error = future.get();
  if (!error.empty()) {
    c->thread_.join();
    return make_error(EIO, fmt::format("expertd at {}: {}", c->socket_, error));
  }
  return c;
}

void Connection::run(UniqueFd fd, std::promise<std::string>* started) {
  bool announced = false;
  try {
    auto io = kj::setupAsyncIo();
    auto stream = io.lowLevelProvider->wrapUnixSocketFd(
        fd.release(),
        kj::LowLevelAsyncIoProvider::TAKE_OWNERSHIP | kj::LowLevelAsyncIoProvider::ALREADY_CLOEXEC);
    capnp::TwoPartyClient rpc(*stream, kMaxFdsPerMessage);
    State state{&io.provider->getTimer(), rpc.bootstrap().castAs<rpc::Expertd>(), {}, 1};
    state_ = &state;
    auto watch =
        rpc.onDisconnect()
            .then([this]() { mark_disconnected("the connection closed"); },
                  [this](kj::Exception&& e) { mark_disconnected(e.getDescription().cStr()); })
            .eagerlyEvaluate(nullptr);
    auto stop = kj::newPromiseAndCrossThreadFulfiller<void>();
    stop_ = kj::mv(stop.fulfiller);
    executor_ = kj::getCurrentThreadExecutor().addRef();
    started->set_value("");
    announced = true;
    stop.promise.wait(io.waitScope);
    // Capabilities go before the RPC system and the stream they live on.
    state.sessions.clear();
    state_ = nullptr;
  } catch (const kj::Exception& e) {
    state_ = nullptr;
    if (announced) {
      mark_disconnected(e.getDescription().cStr());
    } else {
      started->set_value(e.getDescription().cStr());
    }
  }
}

void Connection::mark_disconnected(std::string why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (disconnected_.load()) return;
  reason_ = why.empty() ? "the connection closed" : std::move(why);
  disconnected_.store(true, std::memory_order_release);
  for (const int fd : doorbells_) wake(fd);
}

Connection::~Connection() {
  if (stop_.get() != nullptr) stop_->fulfill();
  if (thread_.joinable()) thread_.join();
}

// ---------------------------------------------------------------------------------------------
// Client

Result<std::unique_ptr<Client>> Client::connect(const std::string& socket) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket.empty() || socket.size() >= sizeof(addr.sun_path)) {
    return make_error(ENAMETOOLONG, fmt::format("cannot connect to expertd at '{}': the socket "
                                                "path must be 1..{} bytes",
                                                socket, sizeof(addr.sun_path) - 1));
  }
  std::memcpy(addr.sun_path, socket.c_str(), socket.size() + 1);
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) {
    const int e = errno;
    return make_error(e, fmt::format("socket: {}", std::strerror(e)));
  }
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int e = errno;
    const char* hint = e == EACCES || e == EPERM
                           ? " (is your user allowed to use expertd's socket?)"
                           : " (is expertd running?)";
    return make_error(
        e, fmt::format("cannot connect to expertd at {}: {}{}", socket, std::strerror(e), hint));
  }
  std::unique_ptr<Client> c(new Client());
  c->socket_ = socket;
  EXPERTD_TRY_ASSIGN(c->conn_, Connection::start(std::move(fd), socket));
  // The first call also tells whether we may talk at all (permission) and the same protocol.
  DaemonInfo info;
  EXPERTD_TRY_ASSIGN(info, c->info());
  if (info.protocol_version != abi::kProtocolVersion) {
    return make_error(EPROTO, fmt::format("protocol version mismatch: daemon {}, client {}",
                                          info.protocol_version, abi::kProtocolVersion));
  }
  return c;
}

Result<std::unique_ptr<Client>> Client::connect(const std::string& socket,
                                                std::chrono::milliseconds wait) {
  const uint64_t deadline = monotonic_ns() + static_cast<uint64_t>(wait.count()) * 1'000'000ull;
  uint64_t pause_ms = 5;
  while (true) {
    auto c = connect(socket);
    const int e = c ? 0 : c.error().code;
    const bool again = e == ENOENT || e == ECONNREFUSED || e == ECONNRESET || e == EPIPE;
    if (!again || monotonic_ns() >= deadline) return c;
    // Backs off to 200 ms: a daemon that opens its models takes a while, a restart less.
    std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms));
    pause_ms = std::min<uint64_t>(pause_ms * 2, 200);
  }
}

Client::~Client() = default;

bool Client::connected() const { return !conn_->disconnected(); }

Result<DaemonInfo> Client::info() {
  return conn_->call<DaemonInfo>([](Connection::State& s) {
    return s.bootstrap.infoRequest().send().then([](auto r) {
      DaemonInfo i;
      i.version = str(r.getVersion());
      i.protocol_version = r.getProtocolVersion();
      i.backend = str(r.getBackend());
      i.backend_detail = str(r.getBackendDetail());
      for (auto m : r.getModels()) i.models.push_back(str(m));
      return i;
    });
  });
}

Result<ModelLayout> Client::open_model(const std::string& name) {
  return conn_->call<ModelLayout>([&name](Connection::State& s) {
    auto req = s.bootstrap.openModelRequest();
    req.setName(text(name));
    return req.send().then([](auto r) { return wire::read(r.getLayout()); });
  });
}

Result<Stats> Client::stats() {
  return conn_->call<Stats>([](Connection::State& s) {
    return s.bootstrap.statsRequest().send().then([](auto r) { return wire::read(r.getStats()); });
  });
}

Status Client::set_prefetch_depth(uint32_t depth) {
  return conn_->call<Ok>([depth](Connection::State& s) {
    auto req = s.bootstrap.setPrefetchDepthRequest();
    req.setDepth(depth);
    return req.send().then([](auto) { return Ok{}; });
  });
}

Status Client::set_queue_depth(uint32_t depth) {
  return conn_->call<Ok>([depth](Connection::State& s) {
    auto req = s.bootstrap.setQueueDepthRequest();
    req.setDepth(depth);
    return req.send().then([](auto) { return Ok{}; });
  });
}

Status Client::set_policy(const std::string& name) {
  return conn_->call<Ok>([&name](Connection::State& s) {
    auto req = s.bootstrap.setPolicyRequest();
    req.setName(text(name));
    return req.send().then([](auto) { return Ok{}; });
  });
}

Status Client::pin(const std::string& model, uint32_t layer, uint32_t expert) {
  return conn_->call<Ok>([&](Connection::State& s) {
    auto req = s.bootstrap.pinRequest();
    req.setModel(text(model));
    req.setLayer(layer);
    req.setExpert(expert);
    return req.send().then([](auto) { return Ok{}; });
  });
}

Status Client::unpin(const std::string& model, uint32_t layer, uint32_t expert) {
  return conn_->call<Ok>([&](Connection::State& s) {
    auto req = s.bootstrap.unpinRequest();
    req.setModel(text(model));
    req.setLayer(layer);
    req.setExpert(expert);
    return req.send().then([](auto) { return Ok{}; });
  });
}

Status Client::evict(const std::string& model, uint32_t layer, uint32_t expert) {
  return conn_->call<Ok>([&](Connection::State& s) {
    auto req = s.bootstrap.evictRequest();
    req.setModel(text(model));
    req.setLayer(layer);
    req.setExpert(expert);
    return req.send().then([](auto) { return Ok{}; });
  });
}

Status Client::set_cache_limit(const std::string& model, uint32_t slots) {
  return conn_->call<Ok>([&](Connection::State& s) {
    auto req = s.bootstrap.setCacheLimitRequest();
    req.setModel(text(model));
    req.setSlots(slots);
    return req.send().then([](auto) { return Ok{}; });
  });
}

Result<uint32_t> Client::evict_all(const std::string& model) {
  return conn_->call<uint32_t>([&](Connection::State& s) {
    auto req = s.bootstrap.evictAllRequest();
    req.setModel(text(model));
    return req.send().then([](auto r) { return r.getEvicted(); });
  });
}

Result<std::vector<ModelFile>> Client::model_files(const std::string& model) {
  std::vector<ModelFile> files;
  // One call per message's worth of fds (the daemon sends at most kMaxFdsPerMessage).
  for (uint32_t count = 1; files.size() < count;) {
    const auto first = static_cast<uint32_t>(files.size());
    uint32_t got_count = 0;
    std::vector<ModelFile> part;
    EXPERTD_TRY_ASSIGN(part, conn_->call<std::vector<ModelFile>>([&](Connection::State& s) {
      auto req = s.bootstrap.modelFilesRequest();
      req.setModel(text(model));
      req.setFirst(first);
      return req.send().then([&got_count](capnp::Response<rpc::Expertd::ModelFilesResults> r) {
        got_count = r.getShardCount();
        std::vector<ModelFile> out;
        auto caps = kj::heapArrayBuilder<rpc::Fd::Client>(r.getFiles().size());
        auto fds = kj::heapArrayBuilder<kj::Promise<kj::Maybe<int>>>(r.getFiles().size());
        for (auto f : r.getFiles()) {
          ModelFile m;
          m.shard = f.getShard();
          m.name = str(f.getName());
          m.path = str(f.getPath());
          m.bytes = f.getBytes();
          out.push_back(std::move(m));
          caps.add(f.getFile());
          fds.add(caps.back().getFd());
        }
        // The capabilities own their fds until the dup()s below (as in attach()).
        return kj::joinPromises(fds.finish())
            .then([out = std::move(out),
                   caps = caps.finish()](kj::Array<kj::Maybe<int>> got) mutable {
              for (size_t i = 0; i < got.size(); ++i) {
                KJ_IF_MAYBE (fd, got[i]) {
                  out[i].fd = dup_fd(*fd);
                }
              }
              return std::move(out);
            });
      });
    }));
    count = got_count;
    if (part.empty() || files.size() + part.size() > count) {
      return make_error(EPROTO, fmt::format("model_files '{}': expertd sent {} files from {} of {}",
                                            model, part.size(), first, count));
    }
    for (ModelFile& f : part) {
      if (f.shard != files.size() || !f.fd.valid()) {
        return make_error(EPROTO, fmt::format("model_files '{}': file {} ({}) came as shard {}{}",
                                              model, files.size(), f.name, f.shard,
                                              f.fd.valid() ? "" : " without its file descriptor"));
      }
      files.push_back(std::move(f));
    }
  }
  return files;
}

Status Client::ping() {
  return conn_->call<Ok>([](Connection::State& s) {
    return s.bootstrap.pingRequest().send().then([](auto) { return Ok{}; });
  });
}

// Owned by a Session; the members' destructors unmap and close.
struct Session::Resources {
  UniqueFd arena_fd;
  UniqueFd table_fd;
  UniqueFd region_fd;
  UniqueFd request_fd;     // we write it when the daemon sleeps
  UniqueFd completion_fd;  // we sleep on it; watched by the connection while attached
  Mapping arena;           // PROT_READ
  Mapping table;           // PROT_READ
  Mapping region;          // read-write: the rings
};

namespace {

// Maps `bytes` of `fd` shared; checks the file is at least that large first (a short file would
// SIGBUS on access).
Result<Mapping> map_fd(const UniqueFd& fd, uint64_t bytes, int prot, const char* what) {
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) {
    const int e = errno;
    return make_error(e, fmt::format("{}: fstat: {}", what, std::strerror(e)));
  }
  if (bytes == 0 || static_cast<uint64_t>(st.st_size) < bytes) {
    return make_error(EPROTO, fmt::format("{}: expertd announced {} bytes, the file has {}", what,
                                          bytes, st.st_size));
  }
  Mapping m = Mapping::map(bytes, prot, MAP_SHARED, fd.get(), 0);
  if (!m.valid()) {
    const int e = errno;
    return make_error(e, fmt::format("{}: mmap of {} bytes: {}", what, bytes, std::strerror(e)));
  }
  return m;
}

bool power_of_two(uint32_t x) { return x != 0 && (x & (x - 1)) == 0; }

}  // namespace

Result<std::unique_ptr<Session>> Client::attach(const std::string& model,
                                                const std::string& client_name) {
  ModelLayout layout;
  EXPERTD_TRY_ASSIGN(layout, open_model(model));
  AttachReply reply;
  EXPERTD_TRY_ASSIGN(reply, conn_->call<AttachReply>([&](Connection::State& s) {
    auto req = s.bootstrap.attachRequest();
    req.setModel(text(model));
    req.setClientName(text(client_name));
    return req.send().then([&s](capnp::Response<rpc::Expertd::AttachResults> r) {
      auto caps = kj::heapArrayBuilder<rpc::Fd::Client>(5);
      caps.add(r.getArena());
      caps.add(r.getSlotTable());
      caps.add(r.getSessionRegion());
      caps.add(r.getRequestDoorbell());
      caps.add(r.getCompletionDoorbell());
      AttachReply a;
      a.key = s.next_key++;
      s.sessions.emplace(a.key, r.getSession());
      a.session = r.getSessionId();
      a.arena_bytes = r.getArenaBytes();
      a.slot_table_bytes = r.getSlotTableBytes();
      a.session_bytes = r.getSessionBytes();
      a.request_capacity = r.getRequestCapacity();
      a.completion_capacity = r.getCompletionCapacity();
      a.acquire_timeout_ms = r.getAcquireTimeoutMs();
      a.read_timeout_ms = r.getReadTimeoutMs();
      auto fds = kj::heapArrayBuilder<kj::Promise<kj::Maybe<int>>>(caps.size());
      for (auto& c : caps) fds.add(c.getFd());
      // The capabilities own their fds: they must outlive the dup()s below (an attach()ed
      // object would be dropped before the continuation runs).
      return kj::joinPromises(fds.finish())
          .then([a = std::move(a), caps = caps.finish()](kj::Array<kj::Maybe<int>> got) mutable {
            for (size_t i = 0; i < got.size(); ++i) {
              KJ_IF_MAYBE (fd, got[i]) {
                a.fds[i] = dup_fd(*fd);  // a copy of our own: the capability closes its fd
              }
            }
            return std::move(a);
          });
    });
  }));

  std::unique_ptr<Session> s(new Session());
  s->conn_ = conn_;
  s->key_ = reply.key;
  s->id_ = reply.session;
  s->res_ = std::make_unique<Session::Resources>();
  Session::Resources& res = *s->res_;
  res.arena_fd = std::move(reply.fds[0]);
  res.table_fd = std::move(reply.fds[1]);
  res.region_fd = std::move(reply.fds[2]);
  res.request_fd = std::move(reply.fds[3]);
  res.completion_fd = std::move(reply.fds[4]);
  // From here the Session's destructor detaches and cleans up whatever is set.
  for (const UniqueFd* fd :
       {&res.arena_fd, &res.table_fd, &res.region_fd, &res.request_fd, &res.completion_fd}) {
    if (!fd->valid()) {
      return make_error(EPROTO,
                        "attach: expertd sent no file descriptors (this client needs a "
                        "Unix socket with fd passing)");
    }
  }
  s->layout_ = std::move(layout);
  s->arena_bytes_ = reply.arena_bytes;
  s->table_bytes_ = reply.slot_table_bytes;
  s->region_bytes_ = reply.session_bytes;
  s->request_capacity_ = reply.request_capacity;
  s->completion_capacity_ = reply.completion_capacity;
  s->daemon_timeout_ms_ = reply.acquire_timeout_ms;
  s->daemon_read_timeout_ms_ = reply.read_timeout_ms;
  // An acquire may wait for a slot, then for the read into it: both deadlines, so the daemon's own
  // error comes first.
  s->wait_timeout_ns_ =
      (reply.acquire_timeout_ms
           ? reply.acquire_timeout_ms + uint64_t{reply.read_timeout_ms} + kWaitGraceMs
           : kDefaultWaitMs) *
      1'000'000;

  EXPERTD_TRY_ASSIGN(res.arena, map_fd(res.arena_fd, s->arena_bytes_, PROT_READ, "arena"));
  s->arena_ = res.arena.data();
  EXPERTD_TRY_ASSIGN(res.table, map_fd(res.table_fd, s->table_bytes_, PROT_READ, "slot table"));
  s->table_ = res.table.data();
  EXPERTD_TRY_ASSIGN(res.region, map_fd(res.region_fd, s->region_bytes_, PROT_READ | PROT_WRITE,
                                        "session region"));
  s->region_ = res.region.data();

  // The slot table: ours to trust only after its header matches.
  const ModelLayout& l = s->layout_;
  if (s->table_bytes_ < sizeof(abi::SlotTableHeader)) {
    return make_error(EPROTO, "slot table: smaller than its header");
  }
  s->table_header_ = reinterpret_cast<const abi::SlotTableHeader*>(s->table_);
  const abi::SlotTableHeader& th = *s->table_header_;
  if (th.magic != abi::kSlotTableMagic) {
    return make_error(EPROTO, fmt::format("slot table: bad magic {:#x} (expected {:#x})", th.magic,
                                          abi::kSlotTableMagic));
  }
  if (th.version != abi::kProtocolVersion) {
    return make_error(EPROTO, fmt::format("protocol version mismatch: daemon {}, client {}",
                                          th.version, abi::kProtocolVersion));
  }
  if (th.slot_count != l.slot_count || th.slot_bytes != l.slot_bytes ||
      abi::slot_table_bytes(th.slot_count) > s->table_bytes_ ||
      uint64_t{th.slot_count} * th.slot_bytes > s->arena_bytes_ || l.alignment == 0 ||
      (l.alignment & (l.alignment - 1)) != 0) {
    return make_error(EPROTO, fmt::format("slot table: {} slots of {} bytes does not match the "
                                          "model layout ({} slots of {} bytes, arena {} bytes)",
                                          th.slot_count, th.slot_bytes, l.slot_count, l.slot_bytes,
                                          s->arena_bytes_));
  }
  s->table_entries_ =
      reinterpret_cast<const abi::SlotEntry*>(s->table_ + sizeof(abi::SlotTableHeader));

  // The session region.
  if (s->region_bytes_ < sizeof(abi::SessionHeader)) {
    return make_error(EPROTO, "session region: smaller than its header");
  }
  s->header_ = reinterpret_cast<abi::SessionHeader*>(s->region_);
  const abi::SessionHeader& h = *s->header_;
  if (h.magic != abi::kSessionMagic) {
    return make_error(EPROTO, fmt::format("session region: bad magic {:#x} (expected {:#x})",
                                          h.magic, abi::kSessionMagic));
  }
  if (h.version != abi::kProtocolVersion) {
    return make_error(EPROTO, fmt::format("protocol version mismatch: daemon {}, client {}",
                                          h.version, abi::kProtocolVersion));
  }
  const abi::SessionLayout want =
      abi::session_layout(s->request_capacity_, s->completion_capacity_);
  if (!power_of_two(s->request_capacity_) || !power_of_two(s->completion_capacity_) ||
      h.request_ring_offset != want.request_ring_offset ||
      h.completion_ring_offset != want.completion_ring_offset || want.bytes > s->region_bytes_) {
    return make_error(EPROTO,
                      "session region: ring layout does not match the announced "
                      "capacities");
  }
  s->req_ = reinterpret_cast<abi::RingHeader*>(s->region_ + h.request_ring_offset);
  s->req_entries_ = reinterpret_cast<abi::Request*>(s->req_ + 1);
  s->comp_ = reinterpret_cast<abi::RingHeader*>(s->region_ + h.completion_ring_offset);
  s->comp_entries_ = reinterpret_cast<abi::CompletionEntry*>(s->comp_ + 1);
  if (s->req_->capacity != s->request_capacity_ || s->req_->entry_bytes != sizeof(abi::Request) ||
      s->comp_->capacity != s->completion_capacity_ ||
      s->comp_->entry_bytes != sizeof(abi::CompletionEntry)) {
    return make_error(EPROTO, "session region: ring headers do not match the announced layout");
  }
  s->req_tail_ = s->req_->tail.value.load(std::memory_order_relaxed);
  s->comp_head_ = s->comp_->head.value.load(std::memory_order_relaxed);

  // Per layer: where its slices are in the layout.
  s->layer_slices_.assign(l.block_count, {});
  for (uint32_t i = 0; i < l.slices.size(); ++i) {
    const uint32_t layer = l.slices[i].layer;
    if (layer >= l.block_count) {
      return make_error(EPROTO, fmt::format("model layout: slice of layer {} beyond {} layers",
                                            layer, l.block_count));
    }
    auto& ls = s->layer_slices_[layer];
    if (ls.count == 0) ls.first = i;
    if (ls.first + ls.count != i || ls.count == 3) {
      return make_error(EPROTO,
                        fmt::format("model layout: layer {}'s slices are not grouped", layer));
    }
    ++ls.count;
  }
  s->held_.assign(l.slot_count, 0);
  conn_->watch_doorbell(res.completion_fd.get());
  s->watching_ = true;
  return s;
}

// ---------------------------------------------------------------------------------------------
// Session: control

Session::~Session() {
  (void)detach();
  if (watching_) conn_->unwatch_doorbell(res_->completion_fd.get());  // before it closes
}

int Session::arena_fd() const { return res_->arena_fd.get(); }
int Session::slot_table_fd() const { return res_->table_fd.get(); }
int Session::session_fd() const { return res_->region_fd.get(); }
int Session::request_doorbell_fd() const { return res_->request_fd.get(); }
int Session::completion_doorbell_fd() const { return res_->completion_fd.get(); }

Status Session::detach() {
  std::lock_guard<std::mutex> lock(mu_);
  if (detached_) return Ok{};
  detached_ = true;
  holds_.store(0, std::memory_order_relaxed);
  std::fill(held_.begin(), held_.end(), 0);
  if (conn_ == nullptr || conn_->disconnected()) return Ok{};
  const uint64_t key = key_;
  return conn_->call<Ok>([key](Connection::State& s) -> kj::Promise<Ok> {
    auto it = s.sessions.find(key);
    if (it == s.sessions.end()) return Ok{};
    auto cap = kj::mv(it->second);
    s.sessions.erase(it);
    return cap.detachRequest().send().attach(kj::mv(cap)).then([](auto) { return Ok{}; });
  });
}

Result<SessionStats> Session::stats() {
  const uint64_t key = key_;
  return conn_->call<SessionStats>([key](Connection::State& s) -> kj::Promise<SessionStats> {
    auto it = s.sessions.find(key);
    if (it == s.sessions.end()) return KJ_EXCEPTION(FAILED, "session is detached");
    return it->second.statsRequest().send().then([](auto r) { return wire::read(r.getStats()); });
  });
}

// ---------------------------------------------------------------------------------------------
// Session: data plane

Error Session::gone(const std::string& why) const { return make_error(ECONNRESET, why); }

Status Session::check_open() const {
  if (detached_) return make_error(EBADF, fmt::format("session {} is detached", id_));
  const int32_t closed = header_->closed.load(std::memory_order_acquire);
  if (closed != 0) {
    return make_error(EPROTO, fmt::format("expertd closed session {}: {} (it rejected a request; "
                                          "the daemon's log says which)",
                                          id_, std::strerror(closed < 0 ? -closed : closed)));
  }
  if (conn_->disconnected()) return conn_->gone_error();
  return Ok{};
}

void Session::ring_daemon() {
  // Orders our tail store before reading the daemon's `waiting` (pairs with the daemon's fence
  // between setting waiting and re-reading our tail): either it sees the request or we see it
  // sleeping and wake it.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (req_->waiting.value.load(std::memory_order_relaxed) != 0) wake(res_->request_fd.get());
}

Status Session::push(const abi::Request& r) {
  uint32_t head = req_->head.value.load(std::memory_order_acquire);
  if (req_tail_ - head >= request_capacity_) {
    // Full: the daemon is behind. Make sure it is awake, then wait for room.
    ring_daemon();
    const uint64_t deadline = monotonic_ns() + kRingFullTimeoutMs * 1'000'000;
    while (req_tail_ - (head = req_->head.value.load(std::memory_order_acquire)) >=
           request_capacity_) {
      EXPERTD_TRY(check_open());
      if (monotonic_ns() > deadline) {
        return gone(
            fmt::format("expertd went away: session {}'s request ring stayed full for "
                        "{} s",
                        id_, kRingFullTimeoutMs / 1000));
      }
      std::this_thread::yield();
    }
  }
  req_entries_[req_tail_ & (request_capacity_ - 1)] = r;
  ++req_tail_;
  // Release: the daemon that sees the new tail sees the entry.
  req_->tail.value.store(req_tail_, std::memory_order_release);
  return Ok{};
}

bool Session::poll_completion(abi::CompletionEntry* out) {
  // Acquire: pairs with the daemon's release store of tail, so the entry is complete.
  const uint32_t tail = comp_->tail.value.load(std::memory_order_acquire);
  if (tail == comp_head_) return false;
  *out = comp_entries_[comp_head_ & (completion_capacity_ - 1)];
  ++comp_head_;
  // Release: the daemon may reuse the entry once it sees the new head.
  comp_->head.value.store(comp_head_, std::memory_order_release);
  return true;
}

Status Session::wait_completion(abi::CompletionEntry* out) {
  if (poll_completion(out)) return Ok{};
  const uint64_t start = monotonic_ns();
  const uint64_t spin_until = start + spin_ns_;
  const uint64_t deadline = start + wait_timeout_ns_;
  uint32_t spins = 0;
  while (true) {
    for (int i = 0; i < 64; ++i) {
      if (poll_completion(out)) return Ok{};
      EXPERTD_CPU_PAUSE();
    }
    if (++spins % 16 == 0) EXPERTD_TRY(check_open());
    if (monotonic_ns() >= spin_until) break;
    // Lets the reactor run when it shares this CPU (a 2-vCPU machine); returns at once otherwise.
    sched_yield();
  }
  // Sleep: announce it, then re-check (the daemon's fence pairs with ours), then block.
  while (true) {
    comp_->waiting.value.store(1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (poll_completion(out)) {
      comp_->waiting.value.store(0, std::memory_order_relaxed);
      return Ok{};
    }
    if (auto st = check_open(); !st) {
      comp_->waiting.value.store(0, std::memory_order_relaxed);
      return st;
    }
    const uint64_t now = monotonic_ns();
    if (now >= deadline) {
      comp_->waiting.value.store(0, std::memory_order_relaxed);
      // A daemon that lives but answers nothing (stopped, wedged, a read that never returns).
      return make_error(ETIMEDOUT, fmt::format("expertd completed no acquire of session {} within "
                                               "{} ms (the daemon is stopped or wedged; its own "
                                               "deadlines are {} ms for a slot, {} ms for a read)",
                                               id_, wait_timeout_ns_ / 1'000'000,
                                               daemon_timeout_ms_, daemon_read_timeout_ms_));
    }
    const int doorbell = res_->completion_fd.get();
    pollfd p{doorbell, POLLIN, 0};
    const int r = ::poll(&p, 1,
                         static_cast<int>(std::min<uint64_t>(
                             kSleepSliceMs, (deadline - now + 999'999) / 1'000'000)));
    const int err = errno;
    if (r > 0) {
      uint64_t v = 0;
      [[maybe_unused]] const ssize_t n = ::read(doorbell, &v, sizeof(v));
    } else if (r < 0 && err != EINTR) {
      comp_->waiting.value.store(0, std::memory_order_relaxed);
      return make_error(err,
                        fmt::format("poll on session {}'s doorbell: {}", id_, std::strerror(err)));
    }
  }
}

Status Session::fill_view(const abi::CompletionEntry& c, SlotView& v) const {
  const auto slot = static_cast<uint32_t>(c.result);
  if (slot >= layout_.slot_count) {
    return make_error(EPROTO,
                      fmt::format("expertd returned slot {} of {}", slot, layout_.slot_count));
  }
  const abi::SlotEntry& e = table_entries_[slot];
  // Acquire: pairs with the daemon's release store of state after layer/expert/generation.
  const uint32_t state = e.state.load(std::memory_order_acquire);
  if (state != abi::kSlotReady || e.layer != c.layer || e.expert != c.expert ||
      e.generation != c.generation) {
    return make_error(
        EPROTO,
        fmt::format("slot {} for layer {} expert {} (generation {}): the slot "
                    "table says state {}, layer {} expert {} (generation {})",
                    slot, c.layer, c.expert, c.generation, state, e.layer, e.expert, e.generation));
  }
  v.slot = slot;
  v.generation = c.generation;
  v.layer = c.layer;
  v.expert = c.expert;
  v.slot_data = arena_ + uint64_t{slot} * layout_.slot_bytes;
  // Slices are placed one after another, each widened to the alignment (SlotLayouts::place).
  const LayerSlices& ls = layer_slices_[c.layer];
  const uint64_t a = layout_.alignment;
  uint64_t pos = 0;
  v.slice_count = ls.count;
  for (uint32_t i = 0; i < ls.count; ++i) {
    const ModelLayout::Slice& s = layout_.slices[ls.first + i];
    const uint64_t offset = s.offset + uint64_t{c.expert} * s.stride;
    const uint64_t start = offset / a * a;
    const uint64_t end = (offset + s.bytes + a - 1) / a * a;
    v.slices[i] = SliceView{&s, v.slot_data + pos + (offset - start), s.bytes};
    pos += end - start;
  }
  if (pos > layout_.slot_bytes) {
    return make_error(EPROTO, fmt::format("layer {} expert {}: its slices need {} bytes, a slot "
                                          "has {}",
                                          c.layer, c.expert, pos, layout_.slot_bytes));
  }
  return Ok{};
}

Status Session::push_release(uint32_t slot, uint32_t flags) {
  abi::Request r{};
  r.op = abi::kOpRelease;
  r.arg = slot;
  r.flags = flags;
  // Callers release only what this Session counted as held.
  EXPERTD_CHECK_LT(slot, held_.size());
  EXPERTD_CHECK_GT(held_[slot], 0);
  EXPERTD_CHECK_GT(holds_.load(std::memory_order_relaxed), 0);
  EXPERTD_TRY(push(r));
  --held_[slot];
  holds_.fetch_sub(1, std::memory_order_relaxed);
  return Ok{};
}

void Session::release_quietly(std::span<const SlotView> views, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    if (views[i].slot_data != nullptr && held_[views[i].slot] > 0) {
      if (!push_release(views[i].slot)) break;
    }
  }
  ring_daemon();
}

Status Session::acquire(uint32_t layer, std::span<const uint32_t> experts,
                        std::span<SlotView> out) {
  std::lock_guard<std::mutex> lock(mu_);
  EXPERTD_TRY(check_open());
  const size_t n = experts.size();
  if (out.size() < n) {
    return make_error(EINVAL,
                      fmt::format("acquire: room for {} views, {} experts asked", out.size(), n));
  }
  if (layer >= layer_slices_.size() || layer_slices_[layer].count == 0) {
    return make_error(EINVAL, fmt::format("acquire: layer {} has no routed experts (model '{}' "
                                          "has {} layers)",
                                          layer, layout_.name, layout_.block_count));
  }
  for (const uint32_t e : experts) {
    if (e >= layout_.expert_count) {
      return make_error(EINVAL, fmt::format("acquire: expert {} of layer {}: the model has {} "
                                            "experts per layer",
                                            e, layer, layout_.expert_count));
    }
  }
  for (size_t i = 0; i < n; ++i) out[i] = SlotView{};
  const uint64_t tag0 = next_tag_;
  next_tag_ += n;
  // At most capacity - 1 acquires outstanding: the daemon closes a session that could overflow
  // its completion ring.
  const uint32_t window = completion_capacity_ - 1;
  size_t sent = 0;
  size_t done = 0;
  Status failed = Ok{};
  while (done < n) {
    bool pushed = false;
    while (sent < n && in_flight_ < window && failed) {
      abi::Request r{};
      r.op = abi::kOpAcquire;
      r.layer = layer;
      r.expert = experts[sent];
      r.tag = tag0 + sent;
      if (auto st = push(r); !st) {
        failed = std::move(st);
        break;
      }
      ++sent;
      ++in_flight_;
      pushed = true;
    }
    EXPERTD_CHECK_LE(in_flight_, window);
    if (pushed) ring_daemon();
    // Nothing of this call outstanding: done, or a push failed. (With no error, the window is
    // full of acquires an earlier call gave up on: wait for those.)
    if (done == sent && (!failed || in_flight_ == 0)) break;
    abi::CompletionEntry c{};
    if (auto st = wait_completion(&c); !st) {
      if (st.error().code != ETIMEDOUT) return st;  // the daemon dropped every hold
      // The daemon may still answer: those completions are given back when they come.
      abandoned_ = in_flight_;
      release_quietly(out, n);
      return st;
    }
    EXPERTD_CHECK_GT(in_flight_, 0);  // a completion answers an acquire we sent
    --in_flight_;
    if (c.tag < tag0 && abandoned_ > 0) {
      // The answer to an acquire an earlier call gave up on: give it back.
      --abandoned_;
      if (c.result >= 0 && static_cast<uint32_t>(c.result) < layout_.slot_count) {
        ++held_[static_cast<uint32_t>(c.result)];
        holds_.fetch_add(1, std::memory_order_relaxed);
        (void)push_release(static_cast<uint32_t>(c.result));
      }
      continue;
    }
    const uint64_t i = c.tag - tag0;
    if (c.tag < tag0 || i >= n || out[i].slot_data != nullptr || c.layer != layer ||
        c.expert != experts[i]) {
      // Not an answer to this call: a daemon bug; give a slot back and report it.
      if (c.result >= 0 && static_cast<uint32_t>(c.result) < layout_.slot_count) {
        ++held_[static_cast<uint32_t>(c.result)];
        holds_.fetch_add(1, std::memory_order_relaxed);
        (void)push_release(static_cast<uint32_t>(c.result));
      }
      if (failed) {
        failed = make_error(EPROTO, fmt::format("acquire: unexpected completion tag {} "
                                                "(layer {} expert {})",
                                                c.tag, c.layer, c.expert));
      }
      continue;
    }
    ++done;
    if (c.result < 0) {
      if (failed) failed = acquire_error(-c.result, layer, c.expert);
      continue;
    }
    if (auto st = fill_view(c, out[i]); !st) {
      if (failed) failed = std::move(st);
      continue;
    }
    EXPERTD_CHECK_LT(out[i].slot, held_.size());  // fill_view() checked it against the layout
    ++held_[out[i].slot];
    holds_.fetch_add(1, std::memory_order_relaxed);
  }
  if (!failed) {
    release_quietly(out, n);
    return failed;
  }
  return Ok{};
}

Error Session::acquire_error(int err, uint32_t layer, uint32_t expert) {
  const std::string what = fmt::format("acquire of layer {} expert {}", layer, expert);
  if (err == ETIME) {
    return make_error(ETIME, fmt::format("{}: its disk read did not come back within the daemon's "
                                         "read_timeout_ms (a stalled device or file system; "
                                         "expertd's log names the file and offset)",
                                         what));
  }
  if (err != EBUSY && err != ETIMEDOUT) {
    return make_error(err, fmt::format("{}: {}", what, std::strerror(err)));
  }
  // Why no slot: the daemon's numbers, one control call on this error path only.
  std::string numbers;
  const std::string model = layout_.name;
  auto stats = conn_->call<Stats>([](Connection::State& s) {
    return s.bootstrap.statsRequest().send().then([](auto r) { return wire::read(r.getStats()); });
  });
  if (stats) {
    uint32_t sessions = 0;
    uint32_t held = 0;
    for (const SessionStats& ss : stats->sessions) {
      if (ss.model != model) continue;
      ++sessions;
      held += ss.holds;
    }
    for (const ModelStats& m : stats->models) {
      if (m.name != model) continue;
      numbers = fmt::format(
          ": model '{}' has {} slots ({} cache + {} staging), {} sessions hold {} of them (this "
          "one {}), each reserving its top-k ({}) of the {} reserved",
          model, m.cache_limit + m.staging_slots, m.cache_limit, m.staging_slots, sessions, held,
          holds_.load(std::memory_order_relaxed), layout_.top_k, m.reserved_slots);
    }
  }
  if (err == ETIMEDOUT) {
    return make_error(ETIMEDOUT, fmt::format("{}: no cache slot free within {} ms{}", what,
                                             daemon_timeout_ms_, numbers));
  }
  return make_error(EBUSY, fmt::format("{}: refused at once: this session holds the most slots "
                                       "it may (its top-k and the slots no session reserves){}",
                                       what, numbers));
}

Result<std::vector<SlotView>> Session::acquire(uint32_t layer, std::span<const uint32_t> experts) {
  std::vector<SlotView> views(experts.size());
  EXPERTD_TRY(acquire(layer, experts, std::span<SlotView>(views)));
  return views;
}

Status Session::prefetch(std::span<const PrefetchHint> hints) {
  std::lock_guard<std::mutex> lock(mu_);
  EXPERTD_TRY(check_open());
  for (const PrefetchHint& h : hints) {
    if (h.layer >= layer_slices_.size() || layer_slices_[h.layer].count == 0 ||
        h.expert >= layout_.expert_count || !std::isfinite(h.score)) {
      return make_error(EINVAL, fmt::format("prefetch: layer {} expert {} score {}: no such "
                                            "routed expert or not a score",
                                            h.layer, h.expert, h.score));
    }
  }
  for (const PrefetchHint& h : hints) {
    abi::Request r{};
    r.op = abi::kOpPrefetch;
    r.layer = h.layer;
    r.expert = h.expert;
    r.score = std::clamp(h.score, 0.0f, 1.0f);
    r.flags = h.exact ? abi::kPrefetchExact : 0;
    if (auto st = push(r); !st) {
      ring_daemon();
      return st;
    }
  }
  ring_daemon();
  return Ok{};
}

Status Session::release(uint32_t slot) { return release(slot, 0); }

Status Session::release(uint32_t slot, uint32_t flags) {
  std::lock_guard<std::mutex> lock(mu_);
  EXPERTD_TRY(check_open());
  if (slot >= held_.size() || held_[slot] == 0) {
    return make_error(EINVAL,
                      fmt::format("release of slot {}: this session does not hold it", slot));
  }
  if ((flags & ~abi::kReleaseClientCopy) != 0) {
    return make_error(EINVAL, fmt::format("release of slot {}: unknown flags {:#x}", slot, flags));
  }
  EXPERTD_TRY(push_release(slot, flags));
  ring_daemon();
  return Ok{};
}

Status Session::unkeep(uint32_t layer, uint32_t expert) {
  std::lock_guard<std::mutex> lock(mu_);
  EXPERTD_TRY(check_open());
  if (header_->max_op < abi::kOpUnkeep) return Ok{};
  if (layer >= layout_.block_count || expert >= layout_.expert_count) {
    return make_error(EINVAL,
                      fmt::format("unkeep of layer {} expert {}: the model has {} layers "
                                  "of {} experts",
                                  layer, expert, layout_.block_count, layout_.expert_count));
  }
  abi::Request r{};
  r.op = abi::kOpUnkeep;
  r.layer = layer;
  r.expert = expert;
  EXPERTD_TRY(push(r));
  ring_daemon();
  return Ok{};
}

Status Session::release(std::span<const SlotView> views) {
  std::lock_guard<std::mutex> lock(mu_);
  EXPERTD_TRY(check_open());
  for (const SlotView& v : views) {
    if (v.slot >= held_.size() || held_[v.slot] == 0) {
      return make_error(EINVAL,
                        fmt::format("release of slot {}: this session does not hold it", v.slot));
    }
  }
  for (const SlotView& v : views) {
    if (auto st = push_release(v.slot); !st) {
      ring_daemon();
      return st;
    }
  }
  ring_daemon();
  return Ok{};
}

Status Session::set_cursor(uint32_t token, uint32_t layer) {
  std::lock_guard<std::mutex> lock(mu_);
  EXPERTD_TRY(check_open());
  if (layer >= layout_.block_count) {
    return make_error(EINVAL, fmt::format("set_cursor: layer {}: the model has {} layers", layer,
                                          layout_.block_count));
  }
  abi::Request r{};
  r.op = abi::kOpCursor;
  r.layer = layer;
  r.arg = token;
  EXPERTD_TRY(push(r));
  ring_daemon();
  return Ok{};
}

}  // namespace expertd::client
