// Chaos, restarts: the real expertd restarted or killed under clients. Clients get "expertd went
// away", reconnect (Client::connect with a wait), and read only right bytes (every acquired expert
// is checked against expert-forge's content). With a hand-over (SIGUSR2's exec, or systemd's fd
// store, played here by a notify socket the test owns) the cache comes back warm; a stale or
// hostile fd store starts the model cold, and says why. The hit rate of the first 100 acquires
// after a restart, warm and cold, is printed for docs/RELIABILITY.md ("Warm restart").
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "base/fd.h"
#include "client/include/expertd/protocol.h"
#include "expertd/client.h"
#include "forge/content.h"
#include "storage/gguf.h"
#include "testing/expected_bytes.h"
#include "testing/expertd_fixture.h"

extern char** environ;

namespace expertd::client {
namespace {

using namespace std::chrono_literals;
using test::Daemon;
using test::TempDir;

// 8 MoE layers x 16 experts: 128 experts, of which the cache keeps 48 (set_cache_limit).
constexpr const char* kModel = "--layers 8 --experts 16 --embd 128 --ff 256 --seed 11";
constexpr uint32_t kLayers = 8;
constexpr uint32_t kExperts = 16;
constexpr uint32_t kCacheSlots = 48;

using Expected = test::ExpectedBytes;

// A deterministic decode-like routing: per token, each layer in turn, 2 experts drawn with a skew
// (experts 0..5 of each layer take 85% of the draws: 48 experts, the size of the cache).
class Routing {
 public:
  explicit Routing(uint64_t seed) : x_(seed) {}
  std::array<uint32_t, 2> next() {
    const uint32_t a = draw();
    uint32_t b = draw();
    while (b == a) b = draw();
    return {a, b};
  }

 private:
  uint32_t draw() {
    x_ = x_ * 6364136223846793005ull + 1442695040888963407ull;
    const uint32_t r = static_cast<uint32_t>(x_ >> 33) % 100;
    return r < 85 ? r % 6 : 6 + r % (kExperts - 6);
  }
  uint64_t x_;
};

// One client's decode loop; every acquire's bytes are checked. Returns the wrong ones.
struct Decoder {
  Decoder(const Expected& expected, uint64_t seed) : expected_(expected), routing_(seed) {}
  // Acquires layer by layer, n acquires in all. The first error stops it (returned).
  Status run(Session& s, uint32_t n) {
    for (uint32_t done = 0; done < n; done += 2) {
      if (!pending_) {
        pending_ = routing_.next();
        layer_ = (layer_ + 1) % kLayers;
      }
      auto views = s.acquire(layer_, *pending_);
      if (!views) return views.take_error();
      for (const SlotView& v : *views) {
        if (expected_.right(v)) continue;
        if (wrong++ < 4) {
          std::printf("wrong bytes: layer %u expert %u slot %u generation %u (session %u)\n",
                      v.layer, v.expert, v.slot, v.generation, s.id());
        }
      }
      acquired += views->size();
      EXPERTD_TRY(s.release(*views));
      pending_.reset();
    }
    return Ok{};
  }
  uint64_t wrong = 0;
  uint64_t acquired = 0;

 private:
  const Expected& expected_;
  Routing routing_;
  std::optional<std::array<uint32_t, 2>> pending_;
  uint32_t layer_ = kLayers - 1;
};

// The pread backend; hand_over_under_clients(true) and AnIoUringArenaSurvivesAPageCacheDrop run
// io_uring (docs/RELIABILITY.md, "Warm restart": its hand-over's wrong bytes, found and fixed).
std::vector<std::string> daemon_args(const std::string& model, const std::string& socket) {
  return {"--model",    "m=" + model,       "--socket", socket,     "--cache",   "64MiB",
          "--no-mlock", "--prefetch-depth", "0",        "--verify", "--backend", "pread"};
}

struct Connected {
  std::unique_ptr<Client> client;
  std::unique_ptr<Session> session;
};

Result<Connected> connect_and_attach(const std::string& socket, const char* name) {
  Connected c;
  EXPERTD_TRY_ASSIGN(c.client, Client::connect(socket, 20s));
  EXPERTD_TRY(c.client->set_cache_limit("m", kCacheSlots));
  EXPERTD_TRY_ASSIGN(c.session, c.client->attach("m", name));
  return c;
}

ModelStats model_stats(Client& c) {
  auto st = c.stats();
  EXPECT_TRUE(st) << st.error().message;
  return st && !st->models.empty() ? st->models[0] : ModelStats{};
}

// The daemon's open fds but its sockets: connections come and go with the clients (and close a
// moment after them); a leaked memfd, eventfd or file stays.
uint32_t open_fds(pid_t pid) {
  uint32_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator(fmt::format("/proc/{}/fd", pid))) {
    std::error_code ec;
    const auto target = std::filesystem::read_symlink(e.path(), ec).string();
    if (!ec && target.rfind("socket:", 0) != 0) ++n;
  }
  return n;
}

// open_fds() once it holds still (five equal readings in a row): the main thread opens its
// signalfd and hands fds to the fd store just after the socket starts listening.
uint32_t settled_fds(pid_t pid) {
  uint32_t last = open_fds(pid);
  int same = 0;
  test::wait_until(
      [&] {
        const uint32_t n = open_fds(pid);
        same = n == last ? same + 1 : 0;
        last = n;
        return same >= 5;
      },
      10s);
  return last;
}

// Hits among the first `n` acquires of a decoder that goes on where the last one stopped.
double first_hit_rate(const std::string& socket, Decoder& d, uint32_t n) {
  auto c = connect_and_attach(socket, "first100");
  EXPECT_TRUE(c) << c.error().message;
  if (!c) return -1;
  const auto before = model_stats(*c->client);
  EXPECT_TRUE(d.run(*c->session, n));
  const auto after = model_stats(*c->client);
  return static_cast<double>(after.scheduler.hits - before.scheduler.hits) /
         static_cast<double>(after.scheduler.acquires - before.scheduler.acquires);
}

// Waits for a restarted daemon: it answers, and its uptime is below `below_ms`.
bool restarted(const std::string& socket, uint64_t below_ms) {
  return test::wait_until(
      [&] {
        auto c = Client::connect(socket);
        if (!c) return false;
        auto st = (*c)->stats();
        return st && st->uptime_ms < below_ms;
      },
      20s);
}

// Two SIGUSR2 hand-overs under kClients decoding clients. `uring`: the io_uring backend (registered
// buffers, no checksum manifest: nothing but the fix guards the hand-over); else pread.
void hand_over_under_clients(bool uring) {
  TempDir dir("expertd-chaos-restart");
  const std::string model = test::forge(dir.path(), "m", kModel);
  const Expected expected(model);
  std::vector<std::string> args = daemon_args(model, dir.file("d.sock"));
  if (uring) {
    args.back() = "uring";
  }
  Daemon d(dir.path(), args);
  d.set_binary("expertd-test");
  ASSERT_TRUE(d.start());
  const uint32_t fds_before = settled_fds(d.pid());  // no client yet

  // Three clients decode on; each reconnects when the daemon goes away.
  constexpr int kClients = 3;
  std::atomic<bool> stop{false};
  std::atomic<int> went_away{0}, reconnected{0};
  std::atomic<uint64_t> wrong{0}, acquired{0};
  std::vector<std::string> errors(kClients);
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i) {
    clients.emplace_back([&, i] {
      Decoder dec(expected, 100 + i);
      bool again = false;
      while (!stop) {
        auto c = connect_and_attach(d.socket(), "chaos");
        if (!c && c.error().message.find("expertd went away") != std::string::npos) continue;
        if (!c) {
          errors[i] = c.error().message;
          break;
        }
        reconnected += again ? 1 : 0;
        while (!stop) {
          const auto st = dec.run(*c->session, 64);
          if (st) continue;
          if (st.error().message.find("expertd went away") == std::string::npos) {
            errors[i] = st.error().message;
            stop = true;
          }
          ++went_away;
          again = true;
          break;
        }
      }
      wrong += dec.wrong;
      acquired += dec.acquired;
    });
  }
  auto first = Client::connect(d.socket(), 20s);
  ASSERT_TRUE(first) << first.error().message;
  std::unique_ptr<Client> admin = std::move(*first);
  ASSERT_TRUE(test::wait_until([&] { return model_stats(*admin).scheduler.acquires > 2000; }, 30s));
  const pid_t pid = d.pid();

  // Two hand-overs in a row, clients running.
  for (int round = 0; round < 2; ++round) {
    const auto uptime = admin->stats();
    ASSERT_TRUE(uptime);
    ASSERT_EQ(::kill(pid, SIGUSR2), 0);
    ASSERT_TRUE(restarted(d.socket(), uptime->uptime_ms)) << d.log();
    auto again = Client::connect(d.socket(), 20s);
    ASSERT_TRUE(again) << again.error().message;
    admin = std::move(*again);
    EXPECT_GT(model_stats(*admin).cache_ready, 0u) << "the cache came back cold:\n" << d.log();
    const uint64_t now = model_stats(*admin).scheduler.acquires;
    ASSERT_TRUE(
        test::wait_until([&] { return model_stats(*admin).scheduler.acquires > now + 1000; }, 30s))
        << d.log();
  }
  stop = true;
  for (auto& t : clients) t.join();
  for (const auto& e : errors) EXPECT_EQ(e, "");
  EXPECT_EQ(wrong.load(), 0u) << d.log();
  EXPECT_GE(went_away.load(), kClients * 2);
  EXPECT_GE(reconnected.load(), kClients * 2);
  EXPECT_EQ(d.pid(), pid);  // exec, not a new process
  admin.reset();
  // No fd leaks across two execs: with every client gone, at most the count of the first start
  // (sockets aside; a transient fd of the first start may have been counted: at most, not equal).
  ASSERT_TRUE(test::wait_until([&] { return open_fds(pid) <= fds_before; }, 10s))
      << open_fds(pid) << " fds, " << fds_before << " before";
  const std::string log = d.log();
  size_t warm_starts = 0;
  for (size_t at = 0; (at = log.find("cached experts taken over", at)) != std::string::npos; ++at) {
    ++warm_starts;
  }
  EXPECT_EQ(warm_starts, 2u) << log;
  EXPECT_EQ(log.find("starts cold"), std::string::npos) << log;
  std::printf(
      "restart chaos: %d clients, 2 SIGUSR2 hand-overs, %llu acquires checked, %llu wrong, "
      "%d went-away errors, %d reconnects, fds %u before / %u after\n",
      kClients, static_cast<unsigned long long>(acquired.load()),
      static_cast<unsigned long long>(wrong.load()), went_away.load(), reconnected.load(),
      fds_before, open_fds(pid));
  EXPECT_EQ(d.stop(), 0);
}

TEST(RestartTest, Sigusr2HandsTheCacheOverUnderClients) { hand_over_under_clients(false); }

TEST(RestartTest, Sigusr2HandsAnIoUringCacheOverUnderClients) { hand_over_under_clients(true); }

TEST(RestartTest, FirstHundredAcquiresAfterARestartWarmAndCold) {
  TempDir dir("expertd-chaos-first100");
  const std::string model = test::forge(dir.path(), "m", kModel);
  const Expected expected(model);
  Daemon d(dir.path(), daemon_args(model, dir.file("d.sock")));
  d.set_binary("expertd-test");
  ASSERT_TRUE(d.start());
  Decoder warm_dec(expected, 7);
  {
    auto c = connect_and_attach(d.socket(), "warmup");
    ASSERT_TRUE(c) << c.error().message;
    ASSERT_TRUE(warm_dec.run(*c->session, 1600));
  }
  Decoder cold_dec = warm_dec;  // the same routing goes on after either restart
  const double steady = first_hit_rate(d.socket(), warm_dec, 100);
  Decoder warm_after = cold_dec;

  uint64_t uptime = 0;
  {
    auto admin = Client::connect(d.socket(), 20s);
    ASSERT_TRUE(admin);
    uptime = (*admin)->stats()->uptime_ms;
  }
  ASSERT_EQ(::kill(d.pid(), SIGUSR2), 0);
  ASSERT_TRUE(restarted(d.socket(), uptime)) << d.log();
  const double warm = first_hit_rate(d.socket(), warm_after, 100);

  d.kill9();
  ASSERT_TRUE(d.start());
  const double cold = first_hit_rate(d.socket(), cold_dec, 100);
  EXPECT_EQ(warm_dec.wrong + warm_after.wrong + cold_dec.wrong, 0u);
  std::printf(
      "first 100 acquires: hit rate %.0f%% without a restart, %.0f%% after a warm restart "
      "(SIGUSR2), %.0f%% after a cold one (SIGKILL, new daemon)\n",
      steady * 100, warm * 100, cold * 100);
  EXPECT_GT(warm, cold + 0.1);
  EXPECT_EQ(d.stop(), 0);
}

// --- systemd's fd store, played by the test ------------------------------------------------

// A NOTIFY_SOCKET the daemon talks to as it would to systemd; keeps what FDSTORE=1 sends.
class FdStore {
 public:
  explicit FdStore(const std::string& path) : path_(path) {
    fd_ = UniqueFd(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strncpy(a.sun_path, path.c_str(), sizeof(a.sun_path) - 1);
    EXPECT_EQ(::bind(fd_.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  }
  // Reads every message waiting; FDSTORE=1 keeps its fd under FDNAME, FDSTOREREMOVE=1 drops it.
  void drain() {
    while (true) {
      char buf[4096];
      alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int) * 8)];
      iovec iov{buf, sizeof(buf) - 1};
      msghdr m{};
      m.msg_iov = &iov;
      m.msg_iovlen = 1;
      m.msg_control = ctl;
      m.msg_controllen = sizeof(ctl);
      const ssize_t n = ::recvmsg(fd_.get(), &m, MSG_CMSG_CLOEXEC);
      if (n < 0) return;
      const std::string text(buf, static_cast<size_t>(n));
      std::vector<UniqueFd> fds;
      for (cmsghdr* c = CMSG_FIRSTHDR(&m); c != nullptr; c = CMSG_NXTHDR(&m, c)) {
        if (c->cmsg_type != SCM_RIGHTS) continue;
        const size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < k; ++i) {
          int f;
          std::memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
          fds.emplace_back(f);
        }
      }
      const auto name_at = text.find("FDNAME=");
      const std::string name =
          name_at == std::string::npos
              ? ""
              : text.substr(name_at + 7, text.find('\n', name_at) - name_at - 7);
      if (text.find("FDSTOREREMOVE=1") != std::string::npos) {
        std::erase_if(stored, [&](const NamedFd& f) { return f.name == name; });
        ++removed;
      } else if (text.find("FDSTORE=1") != std::string::npos && fds.size() == 1) {
        stored.push_back(NamedFd{name, std::move(fds[0])});
      }
    }
  }
  struct NamedFd {
    std::string name;
    UniqueFd fd;
  };
  std::vector<NamedFd> stored;
  int removed = 0;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  UniqueFd fd_;
};

// expertd started as systemd starts a service with an fd store: the fds at 3.., LISTEN_FDS,
// LISTEN_FDNAMES, and LISTEN_PID its own pid (a shell sets it, then execs).
class Service {
 public:
  Service(const std::string& log, std::vector<std::string> args, const FdStore& store,
          const std::vector<std::pair<std::string, int>>& fds)
      : log_(log) {
    std::vector<std::string> argv = {"/bin/sh", "-c", "LISTEN_PID=$$ exec \"$0\" \"$@\"",
                                     test::bin_path("expertd-test")};
    argv.insert(argv.end(), args.begin(), args.end());
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      if (std::strncmp(*e, "LISTEN_", 7) != 0 && std::strncmp(*e, "NOTIFY_", 7) != 0) {
        env.emplace_back(*e);
      }
    }
    std::string names;
    for (const auto& f : fds) names += (names.empty() ? "" : ":") + f.first;
    env.push_back("NOTIFY_SOCKET=" + store.path());
    if (!fds.empty()) {
      env.push_back(fmt::format("LISTEN_FDS={}", fds.size()));
      env.push_back("LISTEN_FDNAMES=" + names);
    }
    std::vector<char*> a, e;
    for (auto& s : argv) a.push_back(s.data());
    for (auto& s : env) e.push_back(s.data());
    a.push_back(nullptr);
    e.push_back(nullptr);
    const UniqueFd out(::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
    // Sources above the targets, so no dup2 closes one still to be passed.
    std::vector<UniqueFd> high;
    for (const auto& f : fds) high.emplace_back(::fcntl(f.second, F_DUPFD_CLOEXEC, 100));
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, out.get(), 1);
    posix_spawn_file_actions_adddup2(&fa, out.get(), 2);
    for (size_t i = 0; i < high.size(); ++i) {
      posix_spawn_file_actions_adddup2(&fa, high[i].get(), static_cast<int>(3 + i));
    }
    EXPECT_EQ(posix_spawn(&pid_, a[0], &fa, nullptr, a.data(), e.data()), 0);
    posix_spawn_file_actions_destroy(&fa);
  }
  ~Service() { kill9(); }
  void kill9() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  int stop() {
    ::kill(pid_, SIGTERM);
    int st = 0;
    ::waitpid(pid_, &st, 0);
    pid_ = -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  }
  std::string log() const { return test::read_file(log_); }

 private:
  std::string log_;
  pid_t pid_ = -1;
};

class FdStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = test::forge(dir_.path(), "m", kModel);
    expected_ = std::make_unique<Expected>(model_);
    socket_ = dir_.file("d.sock");
  }
  // Starts the service with `fds` and waits until it answers.
  std::unique_ptr<Service> start(const std::vector<std::pair<std::string, int>>& fds) {
    std::vector<std::string> args = daemon_args(model_, socket_);
    if (uring_) args.back() = "uring";
    auto s = std::make_unique<Service>(dir_.file(fmt::format("expertd-{}.log", ++starts_)),
                                       std::move(args), store_, fds);
    EXPECT_TRUE(test::wait_until([&] { return test::socket_listens(socket_); }, 20s)) << s->log();
    return s;
  }
  // Fills the cache through one client; returns what it acquired.
  void fill(Decoder& dec) {
    auto c = connect_and_attach(socket_, "fill");
    ASSERT_TRUE(c) << c.error().message;
    ASSERT_TRUE(dec.run(*c->session, 800));
  }
  // Starts a daemon, fills its cache through `dec`, waits for its fds in the store, SIGKILLs it;
  // returns the stored fds.
  std::vector<std::pair<std::string, int>> fill_and_kill(Decoder& dec) {
    auto s = start({});
    fill(dec);
    EXPECT_TRUE(test::wait_until([&] { return stored().size() == 3; }, 10s)) << s->log();
    s->kill9();
    return stored();
  }
  std::vector<std::pair<std::string, int>> stored() {
    store_.drain();
    std::vector<std::pair<std::string, int>> out;
    for (const auto& f : store_.stored) out.emplace_back(f.name, f.fd.get());
    return out;
  }
  TempDir dir_{"expertd-chaos-fdstore"};
  std::string model_, socket_;
  std::unique_ptr<Expected> expected_;
  FdStore store_{dir_.file("notify.sock")};
  int starts_ = 0;
  bool uring_ = false;  // the io_uring backend (registered buffers) instead of pread
};

TEST_F(FdStoreTest, SigkillComesBackWarmFromTheFdStore) {
  auto s = start({});
  Decoder dec(*expected_, 3);
  fill(dec);
  ASSERT_TRUE(test::wait_until([&] { return stored().size() == 3; }, 10s)) << s->log();
  s->kill9();
  ::unlink(socket_.c_str());  // systemd's socket unit would keep it; without one it is rebound
  s = start(stored());
  auto c = Client::connect(socket_, 20s);
  ASSERT_TRUE(c) << c.error().message;
  EXPECT_GT(model_stats(**c).cache_ready, kCacheSlots / 2) << s->log();
  Decoder again = dec;
  const double warm = first_hit_rate(socket_, again, 100);
  EXPECT_EQ(dec.wrong + again.wrong, 0u) << s->log();
  EXPECT_GT(warm, 0.5) << s->log();
  // The new daemon replaced the old entries by its own.
  ASSERT_TRUE(test::wait_until([&] { return stored().size() == 3 && store_.removed >= 3; }, 10s))
      << s->log();
  std::printf("SIGKILL + fd store: first 100 acquires hit %.0f%%\n", warm * 100);
  EXPECT_NE(s->log().find("warm restart: model 'm': "), std::string::npos) << s->log();
  EXPECT_EQ(s->stop(), 0);
}

// A page missing from the handed-over arena (a hole in its memfd: what the kernel's page-cache
// drop left before the fix of docs/RELIABILITY.md "Warm restart") reads as zeros: the expert whose
// bytes it held is not taken over, the others are, and every byte served is right.
TEST_F(FdStoreTest, AHoleInTheArenaLeavesThatExpertBehind) {
  Decoder dec(*expected_, 3);
  const auto real = fill_and_kill(dec);
  ASSERT_EQ(real.size(), 3u);
  int arena_fd = -1, slots_fd = -1;
  for (const auto& f : real) {
    if (f.first == "warm.0.arena") arena_fd = f.second;
    if (f.first == "warm.0.slots") slots_fd = f.second;
  }
  ASSERT_GE(arena_fd, 0);
  ASSERT_GE(slots_fd, 0);
  abi::SlotTableHeader header{};
  ASSERT_EQ(::pread(slots_fd, &header, sizeof(header), 0), static_cast<ssize_t>(sizeof(header)));
  std::vector<abi::SlotEntry> entries(header.slot_count);
  const size_t table = entries.size() * sizeof(abi::SlotEntry);
  ASSERT_EQ(::pread(slots_fd, entries.data(), table, sizeof(header)), static_cast<ssize_t>(table));
  uint32_t ready = 0, first_ready = header.slot_count;
  for (uint32_t i = 0; i < header.slot_count; ++i) {
    if (entries[i].state.load() != abi::kSlotReady) continue;
    ++ready;
    first_ready = std::min(first_ready, i);
  }
  ASSERT_GT(ready, 1u);
  // The arena again, its first READY slot's first page punched out.
  std::string bytes(header.arena_bytes, '\0');
  ASSERT_EQ(::pread(arena_fd, bytes.data(), bytes.size(), 0), static_cast<ssize_t>(bytes.size()));
  const UniqueFd holed(::memfd_create("holed", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  ASSERT_EQ(::pwrite(holed.get(), bytes.data(), bytes.size(), 0),
            static_cast<ssize_t>(bytes.size()));
  ASSERT_EQ(::fallocate(holed.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                        static_cast<off_t>(first_ready * header.slot_bytes), 4096),
            0);
  ASSERT_EQ(::fcntl(holed.get(), F_ADD_SEALS,
                    F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL),
            0);
  auto with = real;
  for (auto& f : with) {
    if (f.first == "warm.0.arena") f.second = holed.get();
  }
  ::unlink(socket_.c_str());
  auto s = start(with);
  auto c = Client::connect(socket_, 20s);
  ASSERT_TRUE(c) << c.error().message;
  EXPECT_EQ(model_stats(**c).cache_ready, ready - 1) << s->log();
  Decoder again = dec;
  (void)first_hit_rate(socket_, again, 200);
  EXPECT_EQ(dec.wrong + again.wrong, 0u) << s->log();
  c->reset();
  EXPECT_EQ(s->stop(), 0);
  const std::string log = s->log();
  EXPECT_NE(log.find("1 experts handed over had pages missing from the arena"), std::string::npos)
      << log;
  EXPECT_NE(log.find("loads checked, 0 differ"), std::string::npos) << log;
}

// The io_uring hand-over's wrong bytes (docs/RELIABILITY.md, "Warm restart"), made to happen every
// time: an arena filled by io_uring READ_FIXED, its daemon killed (its mapping and its ring's pin
// on the pages gone), the page cache dropped while only the fd store holds the memfd, then a new
// daemon copies the arena in. Pages the kernel wrote and nobody dirtied would be dropped and come
// back as zeros: every adopted expert is checked (--verify) and every acquire's bytes compared.
// Needs root (drop_caches is machine-wide: it costs others only a re-read of clean files).
TEST_F(FdStoreTest, AnIoUringArenaSurvivesAPageCacheDropAfterSigkill) {
  const char* drop = "/proc/sys/vm/drop_caches";
  if (::access(drop, W_OK) != 0) GTEST_SKIP() << drop << " is not writable (run as root)";
  uring_ = true;
  auto s = start({});
  Decoder dec(*expected_, 3);
  fill(dec);
  ASSERT_TRUE(test::wait_until([&] { return stored().size() == 3; }, 10s)) << s->log();
  const std::string first_log = s->log();
  ASSERT_NE(first_log.find("registered buffers ("), std::string::npos) << first_log;
  s->kill9();
  // The kernel tears the dead daemon's ring down (and unpins its buffers) after the exit, on its
  // own time; then only the fd store holds the arena.
  std::this_thread::sleep_for(500ms);
  {
    const UniqueFd f(::open(drop, O_WRONLY | O_CLOEXEC));
    ASSERT_TRUE(f.valid());
    ASSERT_EQ(::write(f.get(), "1", 1), 1);  // the page cache (clean pages), not the slabs
  }
  ::unlink(socket_.c_str());
  s = start(stored());
  auto c = Client::connect(socket_, 20s);
  ASSERT_TRUE(c) << c.error().message;
  const uint64_t adopted = model_stats(**c).cache_ready;
  EXPECT_GT(adopted, kCacheSlots / 2) << s->log();
  Decoder again = dec;
  const double warm = first_hit_rate(socket_, again, 200);
  EXPECT_EQ(dec.wrong + again.wrong, 0u) << s->log();
  EXPECT_GT(warm, 0.5) << s->log();
  c->reset();
  EXPECT_EQ(s->stop(), 0);
  // The verifier checked every adopted expert as it was copied in, then the reads since.
  const std::string log = s->log();
  EXPECT_NE(log.find("cached experts taken over"), std::string::npos) << log;
  EXPECT_NE(log.find("loads checked, 0 differ"), std::string::npos) << log;
  EXPECT_EQ(log.find("differ from the forged content"), std::string::npos) << log;
  std::printf(
      "io_uring arena after SIGKILL + drop_caches: %llu experts adopted, %llu acquires, "
      "%llu wrong, first 200 acquires hit %.0f%%\n",
      static_cast<unsigned long long>(adopted),
      static_cast<unsigned long long>(again.acquired - dec.acquired),
      static_cast<unsigned long long>(dec.wrong + again.wrong), warm * 100);
}

// A fully sealed memfd of `size` bytes starting with `bytes` (-1 on a failure, which the daemon
// then reports).
UniqueFd sealed_memfd(std::string_view bytes, size_t size) {
  UniqueFd fd(::memfd_create("fake", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  const bool ok =
      fd.valid() && ::ftruncate(fd.get(), static_cast<off_t>(size)) == 0 &&
      ::pwrite(fd.get(), bytes.data(), bytes.size(), 0) == static_cast<ssize_t>(bytes.size()) &&
      ::fcntl(fd.get(), F_ADD_SEALS,
              F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL) == 0;
  EXPECT_TRUE(ok) << std::strerror(errno);
  return fd;
}

// Starts with `fds`, expects the model cold with `why` in the log, and right bytes.
void expect_cold(Service& s, const std::string& socket, const Expected& expected,
                 const std::string& why) {
  auto c = Client::connect(socket, 20s);
  ASSERT_TRUE(c) << c.error().message;
  EXPECT_EQ(model_stats(**c).cache_ready, 0u);
  Decoder dec(expected, 5);
  auto session = (*c)->attach("m", "cold");
  ASSERT_TRUE(session);
  ASSERT_TRUE(dec.run(**session, 200));
  EXPECT_EQ(dec.wrong, 0u);
  const std::string log = s.log();
  EXPECT_NE(log.find("it starts cold"), std::string::npos) << log;
  EXPECT_NE(log.find(why), std::string::npos) << log;
}

TEST_F(FdStoreTest, AStaleOrHostileFdStoreStartsCold) {
  Decoder dec(*expected_, 3);
  const auto real = fill_and_kill(dec);
  ASSERT_EQ(real.size(), 3u);
  auto with = [&](const std::string& role, int fd) {
    auto v = real;
    for (auto& f : v) {
      if (f.first == "warm.0." + role) f.second = fd;
    }
    return v;
  };

  // Starts with `fd` as the role's fd, expects the model cold saying `why`.
  auto cold_with = [&](const std::string& role, int fd, const std::string& why) {
    ::unlink(socket_.c_str());
    auto cold = start(with(role, fd));
    expect_cold(*cold, socket_, *expected_, why);
    cold->kill9();
  };

  // An unsealed memfd where the arena should be: anyone could still write it.
  {
    const UniqueFd fake(::memfd_create("fake", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    ASSERT_EQ(::ftruncate(fake.get(), 1 << 20), 0);
    cold_with("arena", fake.get(), "the arena is not a sealed memfd");
  }
  // A sealed manifest of garbage.
  cold_with("manifest", sealed_memfd("garbage!", 8192).get(), "the manifest's magic is wrong");
  // A sealed arena too small for the slots the manifest names (a read past it would fault).
  cold_with("arena", sealed_memfd("", 4096).get(), "the arena is 4096 bytes");
  // A manifest an io_uring daemon of an earlier version wrote (arena_fill 1: its pages may have
  // been dropped after it exited): without checksums it is not trusted.
  {
    int real_manifest = -1;
    for (const auto& f : real) {
      if (f.first == "warm.0.manifest") real_manifest = f.second;
    }
    ASSERT_GE(real_manifest, 0);
    struct stat st {};
    ASSERT_EQ(::fstat(real_manifest, &st), 0);
    std::string bytes(static_cast<size_t>(st.st_size), '\0');
    ASSERT_EQ(::pread(real_manifest, bytes.data(), bytes.size(), 0),
              static_cast<ssize_t>(bytes.size()));
    // daemon/warm.cc's Manifest: 4 u32, the name (256 bytes), 2 u64, 3 u32, then arena_fill.
    constexpr size_t kArenaFill = 16 + 256 + 16 + 12;
    uint32_t fill = 0;
    std::memcpy(&fill, bytes.data() + kArenaFill, sizeof(fill));
    ASSERT_EQ(fill, 0u);  // this daemon runs pread
    fill = 1;
    std::memcpy(bytes.data() + kArenaFill, &fill, sizeof(fill));
    cold_with("manifest", sealed_memfd(bytes, bytes.size()).get(),
              "an io_uring daemon of an earlier version filled it");
  }
  // The model file changed (touched: mtime and ctime) since the cache was filled.
  {
    const struct timespec times[2] = {{0, UTIME_NOW}, {1, 0}};
    ASSERT_EQ(::utimensat(AT_FDCWD, model_.c_str(), times, 0), 0);
    ::unlink(socket_.c_str());
    auto cold = start(real);
    expect_cold(*cold, socket_, *expected_, "shard 0 changed since its experts were cached");
    cold->kill9();
  }
}

}  // namespace
}  // namespace expertd::client
