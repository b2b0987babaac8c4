// Progress guaranteed (issue 14): each session reserves its top-k at attach, a session above its
// reservation is refused or times out with an error that names the slots and who holds them, and
// a stopped daemon cannot hang a client's acquire. Against the real expertd over its socket.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <cerrno>
#include <string>
#include <thread>
#include <vector>

#include "expertd/client.h"
#include "testing/expertd_fixture.h"

namespace expertd::client {
namespace {

using test::Daemon;
using test::TempDir;

// top-k 2 (expert-forge's default), 4 layers of 8 experts.
constexpr const char* kSmallModel = "--layers 4 --experts 8 --embd 256 --ff 512 --seed 7";

// A daemon whose model "m" has `cache_slots` cache slots (a limit on a 64 MiB cache) and 2 staging
// slots (1 MiB of staging is fewer than 2 slots, and 2 is the floor), and an acquire deadline of
// `deadline_ms`.
class ProgressTest : public ::testing::Test {
 protected:
  void start(uint32_t cache_slots, uint32_t deadline_ms = 300) {
    model_ = test::forge(dir_.path(), "m", kSmallModel);
    daemon_ = std::make_unique<Daemon>(
        dir_.path(), std::vector<std::string>{"--model", "m=" + model_, "--socket",
                                              dir_.path() + "/run/expertd.sock", "--cache", "64MiB",
                                              "--staging", "1MiB", "--no-mlock",
                                              "--acquire-timeout-ms", std::to_string(deadline_ms)});
    ASSERT_TRUE(daemon_->start());
    admin_ = connect();
    ASSERT_TRUE(admin_);
    const auto st = admin_->set_cache_limit("m", cache_slots);
    ASSERT_TRUE(st) << st.error().message;
  }
  void TearDown() override {
    if (daemon_ && daemon_->pid() > 0) {
      const std::string log = daemon_->log();
      EXPECT_EQ(daemon_->stop(), 0) << log;
    }
  }
  std::unique_ptr<Client> connect() {
    auto c = Client::connect(daemon_->socket());
    EXPECT_TRUE(c) << c.error().message;
    return c ? std::move(*c) : nullptr;
  }
  std::unique_ptr<Session> attach(const std::string& name) {
    auto s = admin_->attach("m", name);
    EXPECT_TRUE(s) << s.error().message;
    return s ? std::move(*s) : nullptr;
  }
  ModelStats model_stats() {
    auto st = admin_->stats();
    EXPECT_TRUE(st) << st.error().message;
    return st && !st->models.empty() ? st->models[0] : ModelStats{};
  }

  TempDir dir_;
  std::string model_;
  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<Client> admin_;
};

TEST_F(ProgressTest, AttachBeyondTheReservationsIsRefusedWithTheNumbers) {
  start(2);  // 2 cache + 2 staging slots: the top-k of 2 sessions
  auto a = attach("a");
  auto b = attach("b");
  ASSERT_TRUE(a && b);
  EXPECT_EQ(model_stats().reserved_slots, 4u);

  auto c = admin_->attach("m", "c");
  ASSERT_FALSE(c);
  EXPECT_EQ(c.error().code, EBUSY);
  EXPECT_NE(c.error().message.find("model 'm': no room for another session: its 4 slots (2 cache "
                                   "+ 2 staging) hold the top-k (2) of 2 sessions, and 2 are "
                                   "attached; 3 sessions need at least 6 slots of "),
            std::string::npos)
      << c.error().message;

  // The limit cannot be lowered under the reservations either.
  const auto lower = admin_->set_cache_limit("m", 1);
  ASSERT_FALSE(lower);
  EXPECT_NE(lower.error().message.find("the attached sessions reserve 4 slots"), std::string::npos)
      << lower.error().message;

  // A detach gives its reservation back.
  ASSERT_TRUE(b->detach());
  ASSERT_TRUE(test::wait_until([&] { return model_stats().reserved_slots == 2; },
                               std::chrono::seconds(10)));
  auto d = admin_->attach("m", "d");
  EXPECT_TRUE(d) << d.error().message;
}

TEST_F(ProgressTest, ASessionAtItsBoundIsRefusedAtOnceAndKeepsWorking) {
  start(2);
  auto a = attach("a");
  auto b = attach("b");
  ASSERT_TRUE(a && b);
  const uint32_t two[] = {0, 1};
  auto held = a->acquire(0, two);
  ASSERT_TRUE(held) << held.error().message;

  // Its top-k held, and no slot left unreserved: a third could only wait for its own release.
  const uint32_t third[] = {2};
  auto more = a->acquire(0, third);
  ASSERT_FALSE(more);
  EXPECT_EQ(more.error().code, EBUSY) << "refused, not timed out";
  EXPECT_NE(more.error().message.find("acquire of layer 0 expert 2: refused at once: this session "
                                      "holds the most slots it may"),
            std::string::npos)
      << more.error().message;
  EXPECT_NE(more.error().message.find("model 'm' has 4 slots (2 cache + 2 staging)"),
            std::string::npos)
      << more.error().message;
  EXPECT_EQ(a->holds(), 2u);

  // The other session's reservation was untouched, and a gets its third after a release.
  auto other = b->acquire(1, two);
  ASSERT_TRUE(other) << other.error().message;
  ASSERT_TRUE(b->release(*other));
  ASSERT_TRUE(a->release((*held)[1].slot));
  auto again = a->acquire(0, third);
  ASSERT_TRUE(again) << again.error().message;
  ASSERT_TRUE(a->release(*again));
  ASSERT_TRUE(a->release((*held)[0].slot));
}

TEST_F(ProgressTest, AnAcquireAboveItsReservationWaitsForARelease) {
  start(4, 60'000);  // 6 slots; 2 sessions reserve 4, 2 are nobody's
  auto a = attach("a");
  auto b = attach("b");
  ASSERT_TRUE(a && b);
  const uint32_t four[] = {0, 1, 2, 3};
  auto held = a->acquire(0, four);  // its 2 and both unreserved ones
  ASSERT_TRUE(held) << held.error().message;

  // b's third waits: its first two are its own; the third needs one of a's.
  b->set_wait_timeout_ms(60'000);
  std::atomic<bool> done{false};
  Status got = Ok{};
  std::thread waiter([&] {
    const uint32_t three[] = {4, 5, 6};
    auto v = b->acquire(1, three);
    got = v ? Status(Ok{}) : Status(v.error());
    if (v) (void)b->release(*v);
    done = true;
  });
  // The daemon has all three, and the call has not returned.
  auto seen = [&] {
    auto st = admin_->stats();
    if (!st) return false;
    for (const auto& s : st->sessions) {
      if (s.client == "b" && s.acquires == 3) return true;
    }
    return false;
  };
  ASSERT_TRUE(test::wait_until(seen, std::chrono::seconds(10)));
  EXPECT_FALSE(done.load());
  ASSERT_TRUE(a->release((*held)[3].slot));
  waiter.join();
  EXPECT_TRUE(got) << got.error().message;
  ASSERT_TRUE(a->release((*held)[0].slot));
  ASSERT_TRUE(a->release((*held)[1].slot));
  ASSERT_TRUE(a->release((*held)[2].slot));
}

TEST_F(ProgressTest, NoSlotWithinTheDeadlineIsETIMEDOUTNamingWhoHoldsThem) {
  start(4);
  auto a = attach("a");
  auto b = attach("b");
  ASSERT_TRUE(a && b);
  const uint32_t four[] = {0, 1, 2, 3};
  auto held = a->acquire(0, four);
  ASSERT_TRUE(held) << held.error().message;

  const uint32_t three[] = {4, 5, 6};
  const uint64_t t0 = test::now_ms();
  auto v = b->acquire(1, three);
  const uint64_t waited = test::now_ms() - t0;
  ASSERT_FALSE(v);
  EXPECT_EQ(v.error().code, ETIMEDOUT);
  EXPECT_NE(v.error().message.find("no cache slot free within 300 ms: model 'm' has 6 slots (4 "
                                   "cache + 2 staging), 2 sessions hold "),
            std::string::npos)
      << v.error().message;
  EXPECT_GE(waited, 300u);
  EXPECT_EQ(b->holds(), 0u) << "nothing stays held after a failed acquire";
  EXPECT_EQ(model_stats().scheduler.acquire_timeouts, 1u);

  // b's own reservation still serves it.
  const uint32_t two[] = {4, 5};
  auto ok = b->acquire(1, two);
  ASSERT_TRUE(ok) << ok.error().message;
  ASSERT_TRUE(b->release(*ok));
  ASSERT_TRUE(a->release(*held));
}

TEST_F(ProgressTest, AStoppedDaemonCannotHangAnAcquire) {
  start(4);
  auto a = attach("a");
  ASSERT_TRUE(a);
  EXPECT_EQ(a->daemon_acquire_timeout_ms(), 300u);
  EXPECT_EQ(a->daemon_read_timeout_ms(), 30000u);
  EXPECT_EQ(a->wait_timeout_ms(), 300u + 30000u + 5000u)
      << "the daemon's deadlines (a slot, then the read into it) and a grace";
  a->set_wait_timeout_ms(500);

  ASSERT_EQ(::kill(daemon_->pid(), SIGSTOP), 0);
  const uint32_t cold[] = {3};
  const uint64_t t0 = test::now_ms();
  auto v = a->acquire(2, cold);
  const uint64_t waited = test::now_ms() - t0;
  ASSERT_EQ(::kill(daemon_->pid(), SIGCONT), 0);
  ASSERT_FALSE(v);
  EXPECT_EQ(v.error().code, ETIMEDOUT);
  EXPECT_EQ(v.error().message, fmt::format("expertd completed no acquire of session {} within 500 "
                                           "ms (the daemon is stopped or wedged; its own deadlines "
                                           "are 300 ms for a slot, 30000 ms for a read)",
                                           a->id()));
  EXPECT_GE(waited, 500u);

  // The daemon answers the abandoned acquire once it runs again; the session's next acquire gives
  // that slot back and goes on. (The same expert: both answers come from one load, the abandoned
  // one first, so this call reads it.)
  auto ok = a->acquire(2, cold);
  ASSERT_TRUE(ok) << ok.error().message;
  ASSERT_TRUE(a->release(*ok));
  ASSERT_TRUE(test::wait_until(
      [&] {
        auto st = admin_->stats();
        return st && !st->sessions.empty() && st->sessions[0].holds == 0;
      },
      std::chrono::seconds(10)))
      << "the abandoned acquire's slot was given back";
}

}  // namespace
}  // namespace expertd::client
