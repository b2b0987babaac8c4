// The storage reactor in steady state allocates nothing: a DaemonCore and its RpcServer run in
// this process on a forged model, a real client session (libexpertd-client over the Unix socket
// and the shared-memory rings) warms the cache, and then the allocation probe counts every
// operator new on the reactor thread over idle loops (the wait's timeout, doorbells without
// requests) and over loops busy with acquires, releases, prefetches and cursor moves of cached
// experts. A reactor that builds a container per loop (the command queue's swap did) fails.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <memory>
#include <numeric>
#include <thread>
#include <vector>

#include "daemon/core.h"
#include "daemon/rpc.h"
#include "expertd/client.h"
#include "testing/alloc_probe.h"
#include "testing/expertd_fixture.h"

namespace expertd {
namespace {

constexpr const char* kModel = "--layers 4 --experts 8 --embd 256 --ff 512 --seed 11";
constexpr uint32_t kLoops = 200;  // of each kind

// Polls `loops()` until it reaches `target`; false after 10 s.
template <typename F>
bool wait_for_loops(F loops, uint64_t target) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (loops() < target) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::yield();
  }
  return true;
}

class ReactorAllocTest : public ::testing::Test {
 protected:
  void SetUp() override {
    DaemonConfig config;
    config.models = {{"m", test::forge(dir_.path(), "m", kModel)}};
    config.socket = dir_.path() + "/expertd.sock";
    config.cache = "64MiB";  // every expert stays cached
    config.staging = "4MiB";
    config.lock_memory = false;
    config.queue_depth = 8;  // configured: no read probe at start
    config.max_sessions = 4;
    auto core = DaemonCore::create(config);
    ASSERT_TRUE(core) << core.error().message;
    core_ = std::move(*core);
    ASSERT_TRUE(core_->start());
    auto rpc = RpcServer::start(*core_, config);
    ASSERT_TRUE(rpc) << rpc.error().message;
    rpc_ = std::move(*rpc);
    auto c = client::Client::connect(config.socket);
    ASSERT_TRUE(c) << c.error().message;
    client_ = std::move(*c);
    auto s = client_->attach("m", "reactor-alloc-test");
    ASSERT_TRUE(s) << s.error().message;
    session_ = std::move(*s);
    for (uint32_t l = 0; l < session_->layout().block_count; ++l) {
      if (session_->layout().has_experts(l)) layers_.push_back(l);
    }
    ASSERT_FALSE(layers_.empty());
    experts_.resize(session_->layout().expert_count);
    std::iota(experts_.begin(), experts_.end(), 0u);
    views_.resize(experts_.size());
  }

  void TearDown() override {
    session_.reset();
    client_.reset();
    if (rpc_) rpc_->stop();
    if (core_) core_->stop();
  }

  // Every expert of every layer acquired and released: the reads are done, the cache is warm.
  void one_round(uint32_t token) {
    for (const uint32_t l : layers_) {
      ASSERT_TRUE(session_->set_cursor(token, l));
      const std::array<client::PrefetchHint, 2> hints{
          {{l, experts_.front(), 0.5f}, {l, experts_.back(), 0.25f}}};
      ASSERT_TRUE(session_->prefetch(hints));
      const auto st = session_->acquire(l, experts_, views_);
      ASSERT_TRUE(st) << st.error().message;
      ASSERT_TRUE(session_->release(std::span<const client::SlotView>(views_)));
    }
  }

  uint64_t loops() const { return core_->reactor_loops(); }

  test::TempDir dir_;
  std::unique_ptr<DaemonCore> core_;
  std::unique_ptr<RpcServer> rpc_;
  std::unique_ptr<client::Client> client_;
  std::unique_ptr<client::Session> session_;
  std::vector<uint32_t> layers_;
  std::vector<uint32_t> experts_;
  std::vector<client::SlotView> views_;
};

TEST_F(ReactorAllocTest, SteadyStateLoopsAllocateNothing) {
  for (uint32_t token = 0; token < 3; ++token) ASSERT_NO_FATAL_FAILURE(one_round(token));
  // A posted command marks the reactor thread (commands may allocate: they are the control plane,
  // and none runs in the windows below).
  std::promise<void> marked;
  ASSERT_TRUE(core_->post([&marked](DaemonCore&) {
    test::watch_allocations_on_this_thread();
    marked.set_value();
  }));
  marked.get_future().wait();

  // Idle: loops ended by the wait's 100 ms timeout, for more than the second between two status
  // refreshes, then loops woken by a doorbell with no request.
  const uint64_t idle0 = loops();
  test::arm_allocation_count();
  ASSERT_TRUE(wait_for_loops([this] { return loops(); }, idle0 + 12));
  for (uint32_t i = 0; i < kLoops; ++i) {
    const uint64_t before = loops();
    const uint64_t one = 1;
    ASSERT_EQ(::write(session_->request_doorbell_fd(), &one, sizeof(one)), 8);
    ASSERT_TRUE(wait_for_loops([this] { return loops(); }, before + 1));
  }
  const uint64_t idle_allocs = test::disarm_allocation_count();
  const std::string idle_first = test::first_counted_allocation();
  const uint64_t idle_loops = loops() - idle0;

  // Busy: acquire, release, prefetch and cursor traffic on cached experts.
  const uint64_t busy0 = loops();
  test::arm_allocation_count();
  uint32_t token = 3;
  while (loops() - busy0 < kLoops) ASSERT_NO_FATAL_FAILURE(one_round(token++));
  const uint64_t busy_allocs = test::disarm_allocation_count();
  const std::string busy_first = test::first_counted_allocation();
  const uint64_t busy_loops = loops() - busy0;

  EXPECT_GE(idle_loops, kLoops);
  EXPECT_GE(busy_loops, kLoops);
  EXPECT_EQ(idle_allocs, 0u) << "over " << idle_loops
                             << " idle reactor loops; the first: " << idle_first;
  EXPECT_EQ(busy_allocs, 0u) << "over " << busy_loops
                             << " busy reactor loops; the first: " << busy_first;
  // The traffic was served from the cache, so the loops measured are the steady state.
  auto stats = client_->stats();
  ASSERT_TRUE(stats) << stats.error().message;
  ASSERT_EQ(stats->models.size(), 1u);
  EXPECT_GT(stats->models[0].scheduler.hits, 0u);
  EXPECT_GE(stats->reactor_loops, idle0 + idle_loops + busy_loops);
}

}  // namespace
}  // namespace expertd
