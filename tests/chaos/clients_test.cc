// Chaos, the clients' side (issue 14): the real expertd under clients that die anywhere, many
// clients checking every byte, and clients that write garbage. Each client is a separate
// expert-chaos-client process (bench/chaos_client.cc) that compares every slice it acquires with
// the GGUF file's bytes, so a kill can land anywhere: before connecting, inside attach, with a
// request half-answered, while holding slots. The figures each test prints go to
// docs/RELIABILITY.md ("## Clients").
#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "base/fd.h"
#include "expertd/client.h"
#include "testing/expertd_fixture.h"

extern char** environ;

namespace expertd::client {
namespace {

using test::Daemon;
using test::TempDir;

// 4 layers x 16 experts (top 2), 412 KiB a slot; 8 MiB of cache is 19 slots, so the clients keep
// evicting and reloading (slot reuse is where wrong bytes would come from). A small staging ring
// keeps the arena's pages, and so the daemon's RSS, the same from the warm-up on.
constexpr const char* kModel = "--layers 4 --experts 16 --embd 256 --ff 512 --seed 11";

// The random seed: $EXPERTD_CHAOS_SEED to replay a run (each test prints the seed it used).
uint64_t chaos_seed() {
  const char* env = std::getenv("EXPERTD_CHAOS_SEED");
  return env != nullptr && *env ? std::stoull(env) : std::random_device{}();
}

size_t fd_count(pid_t pid) {
  size_t n = 0;
  if (DIR* d = ::opendir(fmt::format("/proc/{}/fd", pid).c_str())) {
    while (const dirent* e = ::readdir(d)) n += e->d_name[0] != '.';
    ::closedir(d);
  }
  return n;
}

uint64_t rss_kib(pid_t pid) {
  const std::string status = test::read_file(fmt::format("/proc/{}/status", pid));
  const auto at = status.find("VmRSS:");
  return at == std::string::npos ? 0 : std::stoull(status.substr(at + 6));
}

// One expert-chaos-client process; its stdout comes back through a pipe.
class ChaosClient {
 public:
  explicit ChaosClient(std::vector<std::string> args) {
    int p[2];
    EXPECT_EQ(::pipe2(p, O_CLOEXEC), 0);
    out_ = UniqueFd(p[0]);
    UniqueFd write_end(p[1]);
    ::fcntl(out_.get(), F_SETFL, O_NONBLOCK);
    args.insert(args.begin(), test::bin_path("expert-chaos-client"));
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, write_end.get(), 1);
    const int rc = ::posix_spawn(&pid_, argv[0], &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    EXPECT_EQ(rc, 0) << argv[0] << ": " << std::strerror(rc);
    if (rc != 0) pid_ = -1;
  }
  ~ChaosClient() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  ChaosClient(const ChaosClient&) = delete;
  ChaosClient& operator=(const ChaosClient&) = delete;

  // What it printed so far.
  const std::string& output() {
    char buf[4096];
    ssize_t n;
    while ((n = ::read(out_.get(), buf, sizeof(buf))) > 0)
      text_.append(buf, static_cast<size_t>(n));
    return text_;
  }
  bool attached() { return output().find("attached\n") != std::string::npos; }

  void kill9() {
    ASSERT_GT(pid_, 0);
    ASSERT_EQ(::kill(pid_, SIGKILL), 0);
    ASSERT_EQ(::waitpid(pid_, nullptr, 0), pid_);
    pid_ = -1;
  }
  // Waits for its exit (up to `timeout`): the exit status, -1 if it still runs.
  int wait(std::chrono::milliseconds timeout) {
    int status = -1;
    const bool done = test::wait_until(
        [&] {
          output();
          return ::waitpid(pid_, &status, WNOHANG) == pid_;
        },
        timeout);
    if (!done) return -1;
    pid_ = -1;
    output();
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  // The JSON summary it printed last.
  nlohmann::json summary() {
    const std::string& t = output();
    const auto start = t.rfind("\n{");
    return nlohmann::json::parse(start == std::string::npos ? t : t.substr(start + 1), nullptr,
                                 false);
  }

 private:
  pid_t pid_ = -1;
  UniqueFd out_;
  std::string text_;
};

class ClientsChaosTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = test::forge(dir_.path(), "m", kModel);
    daemon_ = std::make_unique<Daemon>(
        dir_.path(),
        std::vector<std::string>{"--model", "m=" + model_, "--socket", dir_.path() + "/e.sock",
                                 "--cache", "8MiB", "--staging", "1MiB", "--no-mlock"});
    ASSERT_TRUE(daemon_->start());
    auto c = Client::connect(daemon_->socket());
    ASSERT_TRUE(c) << c.error().message;
    admin_ = std::move(*c);
  }
  void TearDown() override {
    admin_.reset();
    if (daemon_->pid() > 0) {
      const std::string log = daemon_->log();
      EXPECT_EQ(daemon_->stop(), 0) << log;
    }
  }

  std::vector<std::string> client_args(const std::string& name, double seconds, uint64_t seed) {
    return {"--socket",  daemon_->socket(),
            "--model",   "m",
            "--name",    name,
            "--seconds", fmt::format("{}", seconds),
            "--seed",    std::to_string(seed)};
  }

  // Runs one verifying client for `seconds` and checks it saw only right bytes and no error.
  void verify_still_served(double seconds) {
    ChaosClient c(client_args("after", seconds, 99));
    EXPECT_EQ(c.wait(std::chrono::seconds(60)), 0) << c.output();
    const auto j = c.summary();
    ASSERT_FALSE(j.is_discarded()) << c.output();
    EXPECT_GT(j["acquires"].get<uint64_t>(), 0u) << c.output();
    EXPECT_EQ(j["wrong_bytes"].get<uint64_t>(), 0u) << c.output();
    EXPECT_EQ(j["errors"].get<uint64_t>(), 0u) << c.output();
  }

  Stats stats() {
    auto st = admin_->stats();
    EXPECT_TRUE(st) << st.error().message;
    return st ? *st : Stats{};
  }

  TempDir dir_;
  std::string model_;
  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<Client> admin_;
};

TEST_F(ClientsChaosTest, AHundredKilledClientsLeaveNoSessionsHoldsFdsOrMemory) {
  // Warm up: every slot of the arena written once, so its pages count in the RSS from here on.
  {
    ChaosClient warm(client_args("warm", 2, 1));
    ASSERT_EQ(warm.wait(std::chrono::seconds(60)), 0) << warm.output();
  }
  ASSERT_TRUE(test::wait_until([&] { return stats().sessions.empty(); }, std::chrono::seconds(5)));
  const pid_t pid = daemon_->pid();
  const size_t fds_before = fd_count(pid);
  const uint64_t rss_before = rss_kib(pid);

  // 100 clients, at most 4 alive at once (each holds at most 2 batches of top-2: 16 of the 19
  // slots), each SIGKILLed at a random moment 0-250 ms after it was started.
  const uint64_t seed = chaos_seed();
  std::mt19937_64 rng(seed);
  constexpr int kKills = 100;
  int started = 0, killed = 0, attached_when_killed = 0;
  struct Live {
    std::unique_ptr<ChaosClient> client;
    uint64_t kill_at_ms = 0;
  };
  std::vector<Live> live(4);
  const uint64_t t0 = test::now_ms();
  while (killed < kKills) {
    for (auto& l : live) {
      if (!l.client && started < kKills) {
        auto args = client_args(fmt::format("doomed-{}", started), 30, rng());
        args.insert(args.end(), {"--hold", "--prefetch"});
        l.client = std::make_unique<ChaosClient>(args);
        l.kill_at_ms = test::now_ms() + rng() % 250;
        ++started;
      } else if (l.client && test::now_ms() >= l.kill_at_ms) {
        attached_when_killed += l.client->attached();
        l.client->kill9();
        l.client.reset();
        ++killed;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));  // the kills' random moments
  }
  const uint64_t kill_ms = test::now_ms() - t0;

  // Every session goes, with its holds; the fds and the memory come back.
  const uint64_t t1 = test::now_ms();
  EXPECT_TRUE(test::wait_until([&] { return stats().sessions.empty(); }, std::chrono::seconds(10)))
      << stats().sessions.size() << " sessions left";
  const uint64_t cleared_ms = test::now_ms() - t1;
  EXPECT_TRUE(
      test::wait_until([&] { return fd_count(pid) == fds_before; }, std::chrono::seconds(10)))
      << "fds: " << fds_before << " before, " << fd_count(pid) << " after";
  const uint64_t rss_after = rss_kib(pid);
  EXPECT_LT(rss_after, rss_before + 16 * 1024) << "RSS grew from " << rss_before << " KiB";
  const Stats st = stats();
  ASSERT_EQ(st.models.size(), 1u);
  EXPECT_EQ(st.sessions_closed_hostile, 0u) << "a killed client is not a hostile one";
  EXPECT_EQ(st.models[0].scheduler.loads_failed, 0u);

  // Every slot is free again: one session can hold all 19 at once (19 experts of 2 layers).
  {
    auto s = admin_->attach("m", "survivor");
    ASSERT_TRUE(s) << s.error().message;
    std::vector<std::vector<SlotView>> all;
    const uint32_t slots = st.models[0].cache_slots;
    for (uint32_t got = 0, layer = 0; got < slots; ++layer) {
      std::vector<uint32_t> experts;
      for (uint32_t e = 0; e < 16 && got + experts.size() < slots; ++e) experts.push_back(e);
      auto v = (*s)->acquire(layer, experts);
      ASSERT_TRUE(v) << v.error().message;
      got += static_cast<uint32_t>(v->size());
      all.push_back(std::move(*v));
    }
    EXPECT_EQ((*s)->holds(), slots);
  }
  verify_still_served(1);

  const std::string figures = fmt::format(
      "kills {} (seed {}): {} after attach, {} before; {} ms; sessions gone {} ms after the last; "
      "daemon fds {} -> {}; RSS {} -> {} KiB",
      killed, seed, attached_when_killed, killed - attached_when_killed, kill_ms, cleared_ms,
      fds_before, fd_count(pid), rss_before, rss_after);
  std::printf("[ figures  ] %s\n", figures.c_str());
  RecordProperty("figures", figures);
}

TEST_F(ClientsChaosTest, EightClientsSeeOnlyTheFilesBytes) {
  constexpr int kClients = 8;
  constexpr double kSeconds = 8;
  const std::string lat = dir_.path() + "/latencies.bin";
  std::vector<std::unique_ptr<ChaosClient>> clients;
  for (int i = 0; i < kClients; ++i) {
    auto args = client_args(fmt::format("verify-{}", i), kSeconds, 1000 + i);
    args.insert(args.end(), {"--prefetch", "--latencies", lat});
    clients.push_back(std::make_unique<ChaosClient>(args));
  }
  uint64_t acquires = 0, experts = 0, bytes = 0, wrong = 0, errors = 0;
  for (auto& c : clients) {
    EXPECT_EQ(c->wait(std::chrono::seconds(120)), 0) << c->output();
    const auto j = c->summary();
    ASSERT_FALSE(j.is_discarded()) << c->output();
    acquires += j["acquires"].get<uint64_t>();
    experts += j["experts"].get<uint64_t>();
    bytes += j["bytes_verified"].get<uint64_t>();
    wrong += j["wrong_bytes"].get<uint64_t>();
    errors += j["errors"].get<uint64_t>();
    EXPECT_EQ(j["errors"].get<uint64_t>(), 0u) << c->output();
  }
  EXPECT_EQ(wrong, 0u);
  EXPECT_GT(acquires, uint64_t{kClients});

  // All clients' latencies together (the clients append them to one file).
  const std::string raw = test::read_file(lat);
  std::vector<uint32_t> us(raw.size() / sizeof(uint32_t));
  std::memcpy(us.data(), raw.data(), us.size() * sizeof(uint32_t));
  EXPECT_EQ(us.size(), acquires);
  std::sort(us.begin(), us.end());
  auto pct = [&](double p) {
    return us.empty() ? 0u : us[std::min(us.size() - 1, static_cast<size_t>(p * us.size()))];
  };
  const Stats st = stats();
  ASSERT_EQ(st.models.size(), 1u);
  const auto& sch = st.models[0].scheduler;
  EXPECT_EQ(sch.loads_failed, 0u);
  EXPECT_GE(sch.acquires, experts);
  const std::string figures = fmt::format(
      "{} clients x {} s: {} acquires ({} experts, {:.0f} MB verified), {} wrong bytes, {} errors; "
      "acquire p50 {} us, p99 {} us, max {} us; daemon: {} hits, {} misses, {} evictions",
      kClients, kSeconds, acquires, experts, static_cast<double>(bytes) / 1e6, wrong, errors,
      pct(0.50), pct(0.99), us.empty() ? 0u : us.back(), sch.hits, sch.misses, sch.evictions);
  std::printf("[ figures  ] %s\n", figures.c_str());
  RecordProperty("figures", figures);
}

// Writes `r` straight into the session's request ring, as a broken client would, and rings the
// doorbell (tests/client/client_test.cc does the same for its named cases).
bool raw_push(Session& s, const abi::Request& r) {
  auto* h = reinterpret_cast<abi::SessionHeader*>(s.session_region());
  auto* ring = reinterpret_cast<abi::RingHeader*>(s.session_region() + h->request_ring_offset);
  auto* entries = reinterpret_cast<abi::Request*>(ring + 1);
  const uint32_t tail = ring->tail.value.load(std::memory_order_relaxed);
  if (tail - ring->head.value.load(std::memory_order_acquire) >= ring->capacity) return false;
  entries[tail & (ring->capacity - 1)] = r;
  ring->tail.value.store(tail + 1, std::memory_order_release);
  const uint64_t one = 1;
  return ::write(s.request_doorbell_fd(), &one, sizeof(one)) == 8;
}

TEST_F(ClientsChaosTest, RandomRingEntriesAndGarbageFramesLeaveTheDaemonServingOthers) {
  const pid_t pid = daemon_->pid();
  verify_still_served(0.5);  // the arena and the RPC thread warmed up
  ASSERT_TRUE(test::wait_until([&] { return stats().sessions.empty(); }, std::chrono::seconds(5)));
  const size_t fds_before = fd_count(pid);
  const uint64_t seed = chaos_seed();
  std::mt19937_64 rng(seed);

  // 40 sessions each write up to 32 random entries, each field valid 19 times in 20 (so real
  // acquires, hints and cursors run, and the session holds slots, before a bad one arrives):
  // unknown ops, layers and experts out of range, releases of slots never held, scores NaN,
  // negative or infinite, random flags.
  constexpr int kSessions = 40;
  const float bad_scores[] = {NAN, -1.0f, INFINITY, 2.0f};
  auto valid = [&] { return rng() % 20 != 0; };
  int closed = 0;
  uint64_t pushed = 0;
  for (int i = 0; i < kSessions; ++i) {
    auto s = admin_->attach("m", fmt::format("random-{}", i));
    ASSERT_TRUE(s) << s.error().message;
    auto* h = reinterpret_cast<abi::SessionHeader*>((*s)->session_region());
    for (int e = 0; e < 32 && h->closed.load() == 0; ++e) {
      const uint32_t ops[] = {abi::kOpAcquire, abi::kOpAcquire, abi::kOpPrefetch, abi::kOpCursor,
                              abi::kOpRelease};
      abi::Request r{};
      r.op = valid() ? ops[rng() % 5] : static_cast<uint32_t>(rng() % 256);
      r.layer = valid() ? static_cast<uint32_t>(rng() % 4) : static_cast<uint32_t>(rng());
      r.expert = valid() ? static_cast<uint32_t>(rng() % 16) : static_cast<uint32_t>(rng());
      r.arg = static_cast<uint32_t>(rng() % 64);
      r.tag = rng();
      r.score = valid() ? static_cast<float>(rng() % 100) / 100.0f : bad_scores[rng() % 4];
      r.flags = valid() ? 0 : static_cast<uint32_t>(rng());
      if (!raw_push(**s, r)) break;
      ++pushed;
    }
    // A session whose entries all happened to be valid stays open; most are closed.
    closed +=
        test::wait_until([&] { return h->closed.load() != 0; }, std::chrono::milliseconds(200));
  }

  // 200 connections that write garbage: random bytes, or a Cap'n Proto segment table claiming
  // absurd sizes, then hang up.
  constexpr int kFrames = 200;
  for (int i = 0; i < kFrames; ++i) {
    UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    ASSERT_TRUE(fd.valid());
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, daemon_->socket().c_str(), sizeof(addr.sun_path) - 1);
    ASSERT_EQ(::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    std::vector<uint32_t> words(1 + rng() % 512);
    for (auto& w : words) w = static_cast<uint32_t>(rng());
    if (i % 2 == 0) {
      const uint32_t claims[] = {0u, 1u, 511u, 0xffffffffu};
      words[0] = claims[rng() % 4];  // segment count - 1
      if (words.size() > 1) words[1] = static_cast<uint32_t>(rng() % (1u << 20));  // words
    }
    (void)!::send(fd.get(), words.data(), words.size() * 4, MSG_NOSIGNAL);
  }

  // The daemon lives, forgets them all and serves a new client every right byte.
  ASSERT_EQ(::kill(pid, 0), 0) << daemon_->log();
  EXPECT_TRUE(test::wait_until([&] { return stats().sessions.empty(); }, std::chrono::seconds(10)));
  EXPECT_TRUE(
      test::wait_until([&] { return fd_count(pid) == fds_before; }, std::chrono::seconds(10)))
      << "fds: " << fds_before << " before, " << fd_count(pid) << " after";
  EXPECT_EQ(stats().sessions_closed_hostile, static_cast<uint64_t>(closed));
  EXPECT_TRUE(admin_->ping());
  verify_still_served(1);

  const std::string figures = fmt::format(
      "{} sessions, {} random entries (seed {}): {} sessions closed by the daemon, {} left open "
      "(every entry valid); {} garbage connections; daemon fds {} -> {}",
      kSessions, pushed, seed, closed, kSessions - closed, kFrames, fds_before, fd_count(pid));
  std::printf("[ figures  ] %s\n", figures.c_str());
  RecordProperty("figures", figures);
}

}  // namespace
}  // namespace expertd::client
