// libexpertd-client against the real expertd binary: connect and its errors, sessions acquiring
// every expert from several threads with every byte checked against expert-forge's content
// function, the sealed arena, hostile ring entries, a client killed while holding slots, the
// daemon killed under a client, and a refused peer.
#include "expertd/client.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "forge/content.h"
#include "storage/gguf.h"
#include "testing/expected_bytes.h"
#include "testing/expertd_fixture.h"

namespace expertd::client {
namespace {

using test::Daemon;
using test::TempDir;

constexpr const char* kSmallModel = "--layers 4 --experts 8 --embd 256 --ff 512 --seed 7";

using Expected = test::ExpectedBytes;

std::vector<uint32_t> iota(uint32_t n) {
  std::vector<uint32_t> v(n);
  std::iota(v.begin(), v.end(), 0u);
  return v;
}

// One daemon serving one small forged model ("m") on a temporary socket.
class ClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = test::forge(dir_.path(), "m", kSmallModel);
    daemon_ = std::make_unique<Daemon>(dir_.path(), daemon_args());
    ASSERT_TRUE(daemon_->start());
  }
  void TearDown() override {
    if (daemon_->pid() > 0) {
      const std::string log = daemon_->log();
      EXPECT_EQ(daemon_->stop(), 0) << log;
    }
  }
  virtual std::vector<std::string> daemon_args() {
    return {"--model", "m=" + model_, "--socket", dir_.path() + "/run/expertd.sock",
            "--cache", "64MiB",       "--verify", "--no-mlock"};
  }
  std::unique_ptr<Client> connect() {
    auto c = Client::connect(daemon_->socket());
    EXPECT_TRUE(c) << c.error().message;
    return c ? std::move(*c) : nullptr;
  }

  TempDir dir_;
  std::string model_;
  std::unique_ptr<Daemon> daemon_;
};

TEST(ClientConnect, NoDaemonSaysSo) {
  TempDir dir;
  auto c = Client::connect(dir.path() + "/nothing.sock");
  ASSERT_FALSE(c);
  EXPECT_EQ(c.error().message, "cannot connect to expertd at " + dir.path() +
                                   "/nothing.sock: No such file or directory (is expertd "
                                   "running?)");
}

TEST_F(ClientTest, InfoAndModels) {
  auto c = connect();
  ASSERT_TRUE(c);
  auto info = c->info();
  ASSERT_TRUE(info) << info.error().message;
  EXPECT_EQ(info->protocol_version, abi::kProtocolVersion);
  EXPECT_EQ(info->models, std::vector<std::string>{"m"});
  EXPECT_FALSE(info->backend.empty());
  EXPECT_FALSE(info->version.empty());

  auto layout = c->open_model("m");
  ASSERT_TRUE(layout) << layout.error().message;
  EXPECT_EQ(layout->block_count, 4u);
  EXPECT_EQ(layout->expert_count, 8u);
  EXPECT_EQ(layout->slices.size(), 4u * 3u);

  auto missing = c->open_model("nope");
  ASSERT_FALSE(missing);
  EXPECT_EQ(missing.error().message, "model 'nope' is not served by this daemon (models: m)");
  auto attach_missing = c->attach("nope", "test");
  ASSERT_FALSE(attach_missing);
  EXPECT_EQ(attach_missing.error().message,
            "model 'nope' is not served by this daemon (models: m)");
  // A huge name comes back clipped to 64 bytes, with its length (the message stays under
  // max_frame, 1 MiB).
  const std::string huge(1 << 19, 'n');
  auto huge_missing = c->attach(huge, "test");
  ASSERT_FALSE(huge_missing);
  EXPECT_EQ(huge_missing.error().message,
            "model '" + std::string(64, 'n') +
                "... (524288 bytes)' is not served by this daemon (models: m)");
  EXPECT_TRUE(c->ping());
}

TEST_F(ClientTest, AcquireEveryExpertVerified) {
  auto c = connect();
  ASSERT_TRUE(c);
  auto s = c->attach("m", "verify");
  ASSERT_TRUE(s) << s.error().message;
  Expected expected(model_);
  const auto experts = iota(8);
  for (int round = 0; round < 2; ++round) {  // misses, then hits
    for (uint32_t layer = 0; layer < 4; ++layer) {
      auto views = (*s)->acquire(layer, experts);
      ASSERT_TRUE(views) << views.error().message;
      ASSERT_EQ(views->size(), 8u);
      for (uint32_t i = 0; i < 8; ++i) {
        EXPECT_EQ((*views)[i].layer, layer);
        EXPECT_EQ((*views)[i].expert, i);
        EXPECT_EQ(expected.difference((*views)[i]), "");
      }
      EXPECT_EQ((*s)->holds(), 8u);
      ASSERT_TRUE((*s)->release(*views));
      EXPECT_EQ((*s)->holds(), 0u);
    }
  }
  auto st = (*s)->stats();
  ASSERT_TRUE(st) << st.error().message;
  EXPECT_EQ(st->acquires, 64u);
  EXPECT_EQ(st->client, "verify");
  EXPECT_EQ(st->pid, ::getpid());
}

TEST(ClientModels, SplitShardsOtherTypesAndTwoModelsAreServedByteExact) {
  TempDir dir;
  const std::string plain = test::forge(dir.path(), "plain", kSmallModel);
  test::forge(dir.path(), "split",
              "--layers 3 --experts 6 --embd 256 --ff 768 --expert-type q4_k --split 2 --seed 9 "
              "--alignment 64");
  const std::string split = dir.path() + "/split-00001-of-00002.gguf";
  const std::string sock = dir.path() + "/expertd.sock";
  Daemon d(dir.path(), {"--model", "plain=" + plain, "--model", "split=" + split, "--socket", sock,
                        "--cache", "64MiB", "--verify", "--no-mlock"});
  ASSERT_TRUE(d.start());
  {
    auto c = Client::connect(sock);
    ASSERT_TRUE(c) << c.error().message;
    auto info = (*c)->info();
    ASSERT_TRUE(info) << info.error().message;
    EXPECT_EQ(info->models, (std::vector<std::string>{"plain", "split"}));
    for (const auto& [name, path, layers, experts] :
         {std::tuple{"plain", plain, 4u, 8u}, std::tuple{"split", split, 3u, 6u}}) {
      auto s = (*c)->attach(name, "two-models");
      ASSERT_TRUE(s) << s.error().message;
      Expected expected(path);
      for (uint32_t layer = 0; layer < layers; ++layer) {
        auto views = (*s)->acquire(layer, iota(experts));
        ASSERT_TRUE(views) << views.error().message;
        for (const auto& v : *views) EXPECT_EQ(expected.difference(v), "") << name;
        ASSERT_TRUE((*s)->release(*views));
      }
    }
  }
  const std::string log = d.log();
  EXPECT_EQ(d.stop(), 0) << log;
}

TEST_F(ClientTest, SeveralClientsAtOnceSeeTheForgedBytes) {
  Expected expected(model_);
  constexpr int kClients = 4;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kClients; ++t) {
    threads.emplace_back([&, t] {
      auto c = Client::connect(daemon_->socket());
      if (!c) {
        ADD_FAILURE() << c.error().message;
        ++failures;
        return;
      }
      auto s = (*c)->attach("m", fmt::format("client-{}", t));
      if (!s) {
        ADD_FAILURE() << s.error().message;
        ++failures;
        return;
      }
      for (int round = 0; round < 3; ++round) {
        for (uint32_t l = 0; l < 4; ++l) {
          const uint32_t layer = (l + static_cast<uint32_t>(t)) % 4;  // different orders
          auto views = (*s)->acquire(layer, iota(8));
          if (!views) {
            ADD_FAILURE() << views.error().message;
            ++failures;
            return;
          }
          for (const auto& v : *views) {
            if (!expected.right(v)) ++failures;
          }
          if (!(*s)->release(*views)) ++failures;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  auto c = connect();
  auto st = c->stats();
  ASSERT_TRUE(st) << st.error().message;
  ASSERT_EQ(st->models.size(), 1u);
  EXPECT_EQ(st->models[0].scheduler.acquires, uint64_t{kClients} * 3 * 4 * 8);
  EXPECT_EQ(st->models[0].scheduler.loads_failed, 0u);
}

TEST_F(ClientTest, TheSealedArenaCannotBeWrittenOrResized) {
  auto c = connect();
  auto s = c->attach("m", "sealed");
  ASSERT_TRUE(s) << s.error().message;
  for (const int fd : {(*s)->arena_fd(), (*s)->slot_table_fd()}) {
    errno = 0;
    void* p = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    EXPECT_EQ(p, MAP_FAILED);
    EXPECT_EQ(errno, EPERM);
    errno = 0;
    EXPECT_NE(::ftruncate(fd, 1 << 20), 0);
    EXPECT_EQ(errno, EPERM);
    errno = 0;
    EXPECT_NE(::ftruncate(fd, 0), 0);
    EXPECT_EQ(errno, EPERM);
    const uint8_t byte = 0x5a;
    errno = 0;
    EXPECT_EQ(::pwrite(fd, &byte, 1, 0), -1);
    EXPECT_EQ(errno, EPERM);
    errno = 0;
    EXPECT_EQ(::write(fd, &byte, 1), -1);
    EXPECT_EQ(errno, EPERM);
  }
  // The client's own read-only mapping cannot be made writable either.
  EXPECT_NE(::mprotect(const_cast<uint8_t*>((*s)->arena()), 4096, PROT_READ | PROT_WRITE), 0);
  // And what it maps is what the daemon loaded.
  Expected expected(model_);
  const uint32_t experts[] = {3, 5};
  auto views = (*s)->acquire(1, experts);
  ASSERT_TRUE(views) << views.error().message;
  for (const auto& v : *views) EXPECT_EQ(expected.difference(v), "");
  ASSERT_TRUE((*s)->release(*views));
}

TEST_F(ClientTest, ClientSideErrorsLeaveTheSessionUsable) {
  auto c = connect();
  auto s = c->attach("m", "careful");
  ASSERT_TRUE(s) << s.error().message;
  const uint32_t bad_expert[] = {8};
  auto r = (*s)->acquire(0, bad_expert);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().message, "acquire: expert 8 of layer 0: the model has 8 experts per layer");
  const uint32_t ok_expert[] = {1};
  auto r2 = (*s)->acquire(4, ok_expert);
  ASSERT_FALSE(r2);
  EXPECT_EQ(r2.error().message, "acquire: layer 4 has no routed experts (model 'm' has 4 layers)");
  auto rel = (*s)->release(3);
  ASSERT_FALSE(rel);
  EXPECT_EQ(rel.error().message, "release of slot 3: this session does not hold it");
  const PrefetchHint hints[] = {{1, 2, 0.9f}, {2, 3, 0.1f}};
  EXPECT_TRUE((*s)->prefetch(hints));
  EXPECT_TRUE((*s)->set_cursor(0, 0));
  auto views = (*s)->acquire(0, ok_expert);
  ASSERT_TRUE(views) << views.error().message;
  auto flagged = (*s)->release((*views)[0].slot, 0x80);
  ASSERT_FALSE(flagged);
  EXPECT_EQ(flagged.error().message,
            fmt::format("release of slot {}: unknown flags 0x80", (*views)[0].slot));
  // A client copy (the GPU engine's VRAM tier) is an ordinary release for the session.
  EXPECT_TRUE((*s)->release((*views)[0].slot, abi::kReleaseClientCopy));
  EXPECT_EQ((*s)->holds(), 0u);
}

// --- Hostile ring entries ----------------------------------------------------------------------

// Writes `r` straight into the session's request ring, as a misbehaving client would, and rings
// the doorbell.
void raw_push(Session& s, const abi::Request& r) {
  auto* h = reinterpret_cast<abi::SessionHeader*>(s.session_region());
  auto* ring = reinterpret_cast<abi::RingHeader*>(s.session_region() + h->request_ring_offset);
  auto* entries = reinterpret_cast<abi::Request*>(ring + 1);
  const uint32_t tail = ring->tail.value.load(std::memory_order_relaxed);
  const uint64_t deadline = test::now_ms() + 2000;
  while (tail - ring->head.value.load(std::memory_order_acquire) >= ring->capacity &&
         h->closed.load() == 0 && test::now_ms() < deadline) {
    std::this_thread::yield();
  }
  entries[tail & (ring->capacity - 1)] = r;
  ring->tail.value.store(tail + 1, std::memory_order_release);
  const uint64_t one = 1;
  ASSERT_EQ(::write(s.request_doorbell_fd(), &one, sizeof(one)), 8);
}

bool wait_closed(Session& s, uint64_t timeout_ms) {
  auto* h = reinterpret_cast<abi::SessionHeader*>(s.session_region());
  return test::wait_until([&] { return h->closed.load() != 0; },
                          std::chrono::milliseconds(timeout_ms));
}

struct HostileCase {
  const char* name;
  std::vector<abi::Request> entries;  // pushed once
  uint32_t repeat = 1;                // times the entries are pushed
};

void PrintTo(const HostileCase& c, std::ostream* os) { *os << c.name; }

class HostileRingTest : public ClientTest, public ::testing::WithParamInterface<HostileCase> {};

TEST_P(HostileRingTest, ClosesOnlyThatSession) {
  auto c = connect();
  auto victim = c->attach("m", "hostile");
  ASSERT_TRUE(victim) << victim.error().message;
  auto c2 = connect();
  auto bystander = c2->attach("m", "bystander");
  ASSERT_TRUE(bystander) << bystander.error().message;
  const uint32_t warm[] = {0, 1, 2};
  auto held = (*bystander)->acquire(0, warm);  // held across the other session's closure
  ASSERT_TRUE(held) << held.error().message;

  for (uint32_t i = 0; i < GetParam().repeat; ++i) {
    for (const auto& r : GetParam().entries) raw_push(**victim, r);
    if (reinterpret_cast<abi::SessionHeader*>((*victim)->session_region())->closed.load()) break;
  }
  ASSERT_TRUE(wait_closed(**victim, 2000)) << daemon_->log();
  const uint32_t one[] = {0};
  auto r = (*victim)->acquire(0, one);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("expertd closed session"), std::string::npos)
      << r.error().message;

  Expected expected(model_);
  for (const auto& v : *held) EXPECT_EQ(expected.difference(v), "");
  EXPECT_TRUE((*bystander)->release(*held));
  auto views = (*bystander)->acquire(2, iota(8));
  ASSERT_TRUE(views) << views.error().message;
  for (const auto& v : *views) EXPECT_EQ(expected.difference(v), "");
  EXPECT_TRUE((*bystander)->release(*views));
  auto st = c2->stats();
  ASSERT_TRUE(st) << st.error().message;
  EXPECT_EQ(st->sessions_closed_hostile, 1u);
}

abi::Request req(uint32_t op, uint32_t layer, uint32_t expert, uint32_t arg = 0, float score = 0.5f,
                 uint32_t flags = 0) {
  abi::Request r{};
  r.op = op;
  r.layer = layer;
  r.expert = expert;
  r.arg = arg;
  r.tag = 1;
  r.score = score;
  r.flags = flags;
  return r;
}

INSTANTIATE_TEST_SUITE_P(
    Entries, HostileRingTest,
    ::testing::Values(HostileCase{"bad_op", {req(77, 0, 0)}},
                      HostileCase{"layer_out_of_range", {req(abi::kOpAcquire, 99, 0)}},
                      HostileCase{"expert_out_of_range", {req(abi::kOpAcquire, 0, 1000)}},
                      HostileCase{"release_unheld", {req(abi::kOpRelease, 0, 0, 5)}},
                      HostileCase{"prefetch_nan", {req(abi::kOpPrefetch, 0, 0, 0, NAN)}},
                      HostileCase{"prefetch_unknown_flags",
                                  {req(abi::kOpPrefetch, 0, 0, 0, 0.5f, 0x6)}},
                      HostileCase{"cursor_out_of_range", {req(abi::kOpCursor, 1u << 30, 0)}},
                      HostileCase{"unkeep_out_of_range", {req(abi::kOpUnkeep, 0, 1000)}},
                      // Acquires whose completions are never read, past the completion ring.
                      HostileCase{"acquire_flood", {req(abi::kOpAcquire, 1, 2)}, 4096}),
    [](const ::testing::TestParamInfo<HostileCase>& p) { return std::string(p.param.name); });

// --- Clients and daemons that die ---------------------------------------------------------------

uint32_t holds_of(Client& c, pid_t pid, bool* present) {
  auto st = c.stats();
  EXPECT_TRUE(st) << st.error().message;
  *present = false;
  uint32_t holds = 0;
  if (!st) return 0;
  for (const auto& s : st->sessions) {
    if (s.pid == pid) {
      *present = true;
      holds += s.holds;
    }
  }
  return holds;
}

class KilledClientTest : public ClientTest {
  std::vector<std::string> daemon_args() override {
    auto a = ClientTest::daemon_args();
    a.insert(a.end(), {"--staging", "1MiB"});  // 2 staging slots: the cache is all there is
    return a;
  }
};

TEST_F(KilledClientTest, AClientKilledWhileHoldingLosesItsHoldsWithinASecond) {
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The child holds every expert of the model (the whole cache), then waits to be killed.
    ::close(ready[0]);
    char ok = '0';
    auto c = Client::connect(daemon_->socket());
    std::unique_ptr<Session> s;
    if (c) {
      auto a = (*c)->attach("m", "doomed");
      if (a) s = std::move(*a);
    }
    bool held = s != nullptr;
    for (uint32_t layer = 0; held && layer < 4; ++layer) held = bool(s->acquire(layer, iota(8)));
    if (held) ok = '1';
    (void)!::write(ready[1], &ok, 1);
    while (true) ::pause();
  }
  ::close(ready[1]);
  char ok = 0;
  ASSERT_EQ(::read(ready[0], &ok, 1), 1);
  ::close(ready[0]);
  ASSERT_EQ(ok, '1') << "the child could not acquire\n" << daemon_->log();

  auto c = connect();
  bool present = false;
  EXPECT_EQ(holds_of(*c, child, &present), 32u);
  EXPECT_TRUE(present);

  ASSERT_EQ(::kill(child, SIGKILL), 0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);
  const uint64_t t0 = test::now_ms();
  test::wait_until(
      [&] {
        (void)holds_of(*c, child, &present);
        return !present;
      },
      std::chrono::seconds(5));
  const uint64_t freed_ms = test::now_ms() - t0;
  EXPECT_FALSE(present);
  EXPECT_LT(freed_ms, 1000u) << "the dead client's session lingered";
  RecordProperty("holds_freed_ms", std::to_string(freed_ms));

  // Every slot is free for the living: all 32 experts held at once again.
  auto s = c->attach("m", "survivor");
  ASSERT_TRUE(s) << s.error().message;
  Expected expected(model_);
  std::vector<std::vector<SlotView>> all;
  for (uint32_t layer = 0; layer < 4; ++layer) {
    auto views = (*s)->acquire(layer, iota(8));
    ASSERT_TRUE(views) << views.error().message;
    for (const auto& v : *views) EXPECT_EQ(expected.difference(v), "");
    all.push_back(std::move(*views));
  }
  EXPECT_EQ((*s)->holds(), 32u);
  for (const auto& v : all) EXPECT_TRUE((*s)->release(v));
}

TEST_F(ClientTest, TheDaemonKilledUnderAClientIsAClearErrorThenReconnectWorks) {
  auto c = connect();
  auto s = c->attach("m", "orphan");
  ASSERT_TRUE(s) << s.error().message;
  const uint32_t two[] = {0, 1};
  auto views = (*s)->acquire(0, two);
  ASSERT_TRUE(views) << views.error().message;
  ASSERT_TRUE((*s)->release(*views));

  // A client asleep in acquire() when the daemon dies wakes with an error.
  ASSERT_EQ(::kill(daemon_->pid(), SIGSTOP), 0);
  std::atomic<uint64_t> woke_ms{0};
  Result<std::vector<SlotView>> blocked = make_error(0, "");
  std::thread waiter([&] {
    const uint32_t cold[] = {7};
    blocked = (*s)->acquire(3, cold);
    woke_ms = test::now_ms();
  });
  // Until it sleeps on its completion doorbell (it sets the ring's `waiting` first).
  const auto* hdr = reinterpret_cast<const abi::SessionHeader*>((*s)->session_region());
  const auto* comp = reinterpret_cast<const abi::RingHeader*>((*s)->session_region() +
                                                              hdr->completion_ring_offset);
  EXPECT_TRUE(
      test::wait_until([&] { return comp->waiting.value.load() != 0; }, std::chrono::seconds(10)))
      << "the client never slept in acquire()";
  const uint64_t killed_ms = test::now_ms();
  daemon_->kill9();
  waiter.join();
  ASSERT_FALSE(blocked);
  EXPECT_NE(blocked.error().message.find("expertd went away"), std::string::npos)
      << blocked.error().message;
  EXPECT_LT(woke_ms.load() - killed_ms, 1000u);
  RecordProperty("client_woke_ms", std::to_string(woke_ms.load() - killed_ms));
  EXPECT_FALSE(c->connected());
  auto info = c->info();
  ASSERT_FALSE(info);
  EXPECT_NE(info.error().message.find("expertd went away"), std::string::npos)
      << info.error().message;

  // A new daemon on the same (stale) socket path; the client reconnects.
  ASSERT_TRUE(daemon_->start());
  auto c2 = connect();
  ASSERT_TRUE(c2);
  auto s2 = c2->attach("m", "reborn");
  ASSERT_TRUE(s2) << s2.error().message;
  auto again = (*s2)->acquire(0, two);
  ASSERT_TRUE(again) << again.error().message;
  Expected expected(model_);
  for (const auto& v : *again) EXPECT_EQ(expected.difference(v), "");
  EXPECT_TRUE((*s2)->release(*again));
}

TEST_F(ClientTest, SigtermWithClientsAttachedDrainsAndExitsZero) {
  auto c = connect();
  auto s = c->attach("m", "lingering");
  ASSERT_TRUE(s) << s.error().message;
  const uint32_t experts[] = {0, 1, 2};
  auto held = (*s)->acquire(0, experts);  // still held when the daemon stops
  ASSERT_TRUE(held) << held.error().message;
  const std::string log = daemon_->log();
  EXPECT_EQ(daemon_->stop(), 0) << log;
  auto r = (*s)->acquire(1, experts);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("expertd went away"), std::string::npos) << r.error().message;
  auto st = c->stats();
  ASSERT_FALSE(st);
  EXPECT_NE(st.error().message.find("expertd went away"), std::string::npos) << st.error().message;
  EXPECT_FALSE(test::socket_listens(daemon_->socket()));
}

// --- Peer credentials ----------------------------------------------------------------------------

TEST(ClientPeer, AUidNotAllowedIsRefusedWithAClearError) {
  TempDir dir;
  const std::string model = test::forge(dir.path(), "m", kSmallModel);
  const std::string sock = dir.path() + "/expertd.sock";
  Daemon d(dir.path(),
           {"--model", "m=" + model, "--socket", sock, "--cache", "64MiB", "--no-mlock"},
           {"EXPERTD_TEST_PEER_UID=4242"});
  d.set_binary("expertd-test");  // the hook exists only in expertd-test
  ASSERT_TRUE(d.start());
  auto c = Client::connect(sock);
  ASSERT_FALSE(c);
  EXPECT_EQ(c.error().message,
            "permission denied: uid 4242 is not allowed (allowed_uids/allowed_gids in "
            "expertd.toml)");
  const std::string log = d.log();
  EXPECT_NE(log.find("EXPERTD_TEST_PEER_UID"), std::string::npos) << log;
  EXPECT_NE(log.find("refused a connection"), std::string::npos) << log;
  // A peer that keeps reconnecting is refused every time but logged at most 5 times in 10 s.
  for (int i = 0; i < 20; ++i) EXPECT_FALSE(Client::connect(sock));
  const std::string flood = d.log();
  size_t lines = 0;
  for (size_t at = flood.find("refused a connection"); at != std::string::npos;
       at = flood.find("refused a connection", at + 1)) {
    ++lines;
  }
  EXPECT_LE(lines, 5u) << flood;
  EXPECT_EQ(d.stop(), 0);

  // The same uid, allowed.
  Daemon allowed(dir.path(),
                 {"--model", "m=" + model, "--socket", sock, "--cache", "64MiB", "--no-mlock",
                  "--allow-uid", "4242"},
                 {"EXPERTD_TEST_PEER_UID=4242"});
  allowed.set_binary("expertd-test");
  ASSERT_TRUE(allowed.start());
  auto ok = Client::connect(sock);
  ASSERT_TRUE(ok) << ok.error().message;
  // A peer allowed to attach may read the model's files too.
  auto files = (*ok)->model_files("m");
  ASSERT_TRUE(files) << files.error().message;
  ASSERT_EQ(files->size(), 1u);
  EXPECT_EQ(files->front().path, model);
  EXPECT_TRUE(files->front().fd.valid());
  ok->reset();
  EXPECT_EQ(allowed.stop(), 0);
}

// As real uids (setpriv): a member of the daemon's group (here root's group 0, the tests' daemon
// runs as root) is let in without allowed_gids, as `usermod -aG expertd USER` promises; the same
// uid outside the group is refused by the daemon with its message (the socket is opened to all so
// the daemon, not the file's mode, decides).
TEST(ClientPeer, AMemberOfTheDaemonsGroupIsLetInAsARealUid) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run expertctl as another uid (setpriv)";
  const std::string setpriv = test::find_in_path("setpriv");
  if (setpriv.empty()) GTEST_SKIP() << "setpriv (util-linux) is not installed";
  TempDir dir;
  ASSERT_EQ(::chmod(dir.path().c_str(), 0755), 0);
  const std::string model = test::forge(dir.path(), "m", kSmallModel);
  const std::string sock = dir.path() + "/expertd.sock";
  Daemon d(dir.path(),
           {"--model", "m=" + model, "--socket", sock, "--cache", "64MiB", "--no-mlock"});
  ASSERT_TRUE(d.start());
  ASSERT_EQ(::chmod(sock.c_str(), 0666), 0);
  // A copy beside the socket: the build tree may lie under a directory uid 4242 cannot enter
  // (/root). expertctl needs only system libraries.
  const std::string ctl = dir.path() + "/expertctl";
  std::filesystem::copy_file(test::bin_path("expertctl"), ctl);
  ASSERT_EQ(::chmod(ctl.c_str(), 0755), 0);
  const std::string own_gid = std::to_string(::getgid());
  const test::RunResult member =
      test::run_command({setpriv, "--reuid=4242", "--regid=4242", "--groups=" + own_gid, ctl,
                         "status", "--socket", sock});
  EXPECT_EQ(member.status, 0) << member.out << member.err;
  const test::RunResult stranger = test::run_command(
      {setpriv, "--reuid=4242", "--regid=4242", "--clear-groups", ctl, "status", "--socket", sock});
  EXPECT_NE(stranger.status, 0) << stranger.out;
  EXPECT_NE(stranger.err.find("permission denied: uid 4242 is not allowed"), std::string::npos)
      << stranger.err;
  EXPECT_NE(d.log().find("nor in the daemon's group"), std::string::npos) << d.log();
  EXPECT_EQ(d.stop(), 0);
}

TEST(ClientPeer, TheShippedExpertdHasNoTestHook) {
  TempDir dir;
  const std::string model = test::forge(dir.path(), "m", kSmallModel);
  const std::string sock = dir.path() + "/expertd.sock";
  Daemon d(dir.path(),
           {"--model", "m=" + model, "--socket", sock, "--cache", "64MiB", "--no-mlock"},
           {"EXPERTD_TEST_PEER_UID=4242"});
  ASSERT_TRUE(d.start());
  auto c = Client::connect(sock);  // our own uid, whatever the environment says
  ASSERT_TRUE(c) << c.error().message;
  c->reset();
  const std::string log = d.log();
  EXPECT_EQ(log.find("EXPERTD_TEST_PEER_UID"), std::string::npos) << log;
  EXPECT_EQ(d.stop(), 0);
}

}  // namespace
}  // namespace expertd::client
