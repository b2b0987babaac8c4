// The prefetch telemetry by depth and the cache controls for tuning sweeps, end to end: hints and
// acquires sent through libexpertd-client's rings to the real expertd, read back through
// Client::stats(), Session::stats() and expertctl (stats, top, set cache-limit, evict-all).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "expertd/client.h"
#include "testing/expertctl_run.h"
#include "testing/expertd_fixture.h"

namespace expertd::client {
namespace {

using json = nlohmann::json;
using test::Daemon;
using test::TempDir;

class TelemetryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = test::forge(dir_.path(), "m", "--layers 4 --experts 8 --embd 256 --ff 512 --seed 3");
    daemon_ = std::make_unique<Daemon>(
        dir_.path(), std::vector<std::string>{"--model", "m=" + model_, "--socket",
                                              dir_.path() + "/expertd.sock", "--cache", "64MiB",
                                              "--prefetch-depth", "2", "--verify", "--no-mlock"});
    ASSERT_TRUE(daemon_->start());
    auto c = Client::connect(daemon_->socket());
    ASSERT_TRUE(c) << c.error().message;
    client_ = std::move(*c);
  }
  void TearDown() override {
    client_.reset();
    if (daemon_->pid() > 0) {
      const std::string log = daemon_->log();
      EXPECT_EQ(daemon_->stop(), 0) << log;
    }
  }

  ModelStats model_stats() {
    auto st = client_->stats();
    EXPECT_TRUE(st) << st.error().message;
    return st && !st->models.empty() ? st->models.front() : ModelStats{};
  }
  // Waits (up to 10 s) until the daemon finished `loads` loads.
  void wait_loads(uint64_t loads) {
    test::wait_until([&] { return model_stats().scheduler.loads_done >= loads; },
                     std::chrono::seconds(10));
    ASSERT_GE(model_stats().scheduler.loads_done, loads);
  }
  void acquire_release(Session& s, uint32_t layer, std::vector<uint32_t> experts) {
    auto v = s.acquire(layer, experts);
    ASSERT_TRUE(v) << v.error().message;
    ASSERT_TRUE(s.release(*v));
  }
  test::RunResult ctl(std::vector<std::string> args) {
    return test::expertctl(daemon_->socket(), std::move(args));
  }
  json ctl_json(std::vector<std::string> args) {
    return test::expertctl_json(daemon_->socket(), std::move(args));
  }

  TempDir dir_;
  std::string model_;
  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<Client> client_;
};

TEST_F(TelemetryTest, PrecisionRecallAndBytesByDepthReachClientsAndExpertctl) {
  auto s = client_->attach("m", "telemetry-test");
  ASSERT_TRUE(s) << s.error().message;
  Session& session = **s;
  // At layer 0: experts 0 and 1 of layer 1 (depth 1), expert 2 of layer 2 (depth 2) and expert 7
  // of layer 3 (depth 3: hinted, but beyond the daemon's prefetch depth of 2 for now).
  ASSERT_TRUE(session.set_cursor(0, 0));
  const std::vector<PrefetchHint> hints = {{1, 0, 0.9f}, {1, 1, 0.8f}, {2, 2, 0.7f}, {3, 7, 0.5f}};
  ASSERT_TRUE(session.prefetch(hints));
  wait_loads(3);
  ASSERT_TRUE(session.set_cursor(0, 1));
  acquire_release(session, 1, {0, 1});  // both prefetched: useful, recalled at depth 1
  ASSERT_TRUE(session.set_cursor(0, 2));
  acquire_release(session, 2, {2, 3});  // 2 prefetched (depth 2); 3 a miss nobody hinted
  // Layer 3's hint came within the prefetch depth as the cursor moved: it loads, and nobody
  // takes it before it is evicted.
  wait_loads(5);
  auto dropped = client_->evict_all("m");
  ASSERT_TRUE(dropped) << dropped.error().message;
  EXPECT_EQ(*dropped, 5u) << "all that was read: 3 prefetched and used, 1 unused, 1 miss";

  const ModelStats m = model_stats();
  ASSERT_EQ(m.prefetch_depths.size(), 8u);
  const auto& d1 = m.prefetch_depths[0];
  const auto& d2 = m.prefetch_depths[1];
  const auto& d3 = m.prefetch_depths[2];
  EXPECT_EQ(d1.depth, 1u);
  EXPECT_EQ(d1.hints, 2u);
  EXPECT_EQ(d1.loads, 2u);
  EXPECT_EQ(d1.useful, 2u);
  EXPECT_EQ(d1.wasted, 0u);
  EXPECT_EQ(d1.hinted_acquires, 2u);
  // An expert's read: its slices, each widened to the DIO alignment, at most a slot.
  uint64_t expert_bytes = 0;
  for (const auto& slice : session.layout().slices)
    expert_bytes += slice.layer == 1 ? slice.bytes : 0;
  EXPECT_GE(d1.useful_bytes, 2 * expert_bytes);
  EXPECT_LE(d1.useful_bytes, 2 * m.slot_bytes);
  EXPECT_EQ(d2.hints, 1u);
  EXPECT_EQ(d2.useful, 1u);
  EXPECT_EQ(d2.hinted_acquires, 1u);
  EXPECT_EQ(d3.hints, 1u);
  EXPECT_EQ(d3.loads, 1u);
  EXPECT_EQ(d3.useful, 0u);
  EXPECT_EQ(d3.wasted, 1u) << "evicted unused";
  EXPECT_GE(d3.wasted_bytes, expert_bytes);
  EXPECT_LE(d3.wasted_bytes, m.slot_bytes);
  EXPECT_LT(d1.useful_bytes + d2.useful_bytes + d3.wasted_bytes, m.scheduler.bytes_read)
      << "the miss read the rest";
  EXPECT_DOUBLE_EQ(d1.precision(), 1.0);
  EXPECT_DOUBLE_EQ(d3.precision(), 0.0);
  EXPECT_DOUBLE_EQ(d1.recall(m.scheduler.acquires), 0.5);
  EXPECT_DOUBLE_EQ(d2.recall(m.scheduler.acquires), 0.25);
  EXPECT_EQ(m.prefetch_depths[3].hints, 0u);
  EXPECT_EQ(m.prefetch_depths[7].depth, 8u);

  // The session sees its own counters, through its capability and through the daemon's stats.
  auto mine = session.stats();
  ASSERT_TRUE(mine) << mine.error().message;
  ASSERT_EQ(mine->prefetch_depths.size(), 8u);
  EXPECT_EQ(mine->prefetch_depths[0].useful, 2u);
  EXPECT_EQ(mine->prefetch_depths[2].wasted, 1u);
  auto all = client_->stats();
  ASSERT_TRUE(all);
  ASSERT_EQ(all->sessions.size(), 1u);
  EXPECT_EQ(all->sessions[0].prefetch_depths[1].hinted_acquires, 1u);

  // expertctl stats: the same numbers, JSON and text.
  const json j = ctl_json({"stats"});
  const json& depths = j["models"][0]["prefetch_depths"];
  ASSERT_EQ(depths.size(), 3u) << depths.dump() << ": depths 1..3 have counts";
  EXPECT_EQ(depths[0]["depth"], 1);
  EXPECT_EQ(depths[0]["useful_bytes"], d1.useful_bytes);
  EXPECT_EQ(depths[0]["precision"], 1.0);
  EXPECT_EQ(depths[0]["recall"], 0.5);
  EXPECT_EQ(depths[2]["wasted"], 1);
  EXPECT_EQ(depths[2]["precision"], 0.0);
  EXPECT_EQ(j["sessions"][0]["prefetch_depths"][0]["useful"], 2);
  const test::RunResult text = ctl({"stats"});
  ASSERT_EQ(text.status, 0) << text.err;
  EXPECT_NE(text.out.find("prefetch by depth"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("precision  recall"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("100.0%   50.0%"), std::string::npos) << text.out;

  // expertctl top: since start with --once.
  const json top = ctl_json({"top", "--once"});
  ASSERT_EQ(top["prefetch_depths"].size(), 3u) << top.dump();
  EXPECT_EQ(top["prefetch_depths"][1]["recall"], 0.25);
  EXPECT_EQ(top["prefetch_wasted"], 1);
  const test::RunResult top_text = ctl({"top", "--once"});
  ASSERT_EQ(top_text.status, 0) << top_text.err;
  EXPECT_NE(top_text.out.find("precision  recall"), std::string::npos) << top_text.out;
}

// SchedulerStats.demand_bytes: what the loads acquires started read, prefetch loads excluded.
TEST_F(TelemetryTest, DemandBytesCountWhatAcquiresReadNotWhatPrefetchesRead) {
  auto s = client_->attach("m", "telemetry-test");
  ASSERT_TRUE(s) << s.error().message;
  Session& session = **s;
  uint64_t expert_bytes = 0;  // one expert of layer 1 (its reads widen it to the DIO alignment)
  for (const auto& slice : session.layout().slices)
    expert_bytes += slice.layer == 1 ? slice.bytes : 0;

  // Three misses: every byte read so far was read for an acquire.
  acquire_release(session, 1, {0, 1, 2});
  const json before = ctl_json({"stats"})["models"][0]["scheduler"];
  ASSERT_TRUE(before.contains("demand_bytes")) << before.dump();
  EXPECT_GE(before["demand_bytes"].get<uint64_t>(), 3 * expert_bytes) << before.dump();
  EXPECT_EQ(before["demand_bytes"], before["bytes_read"]) << before.dump();

  // A prefetched expert is read and then acquired (useful), but its bytes are not demand bytes.
  ASSERT_TRUE(session.set_cursor(0, 0));
  const std::vector<PrefetchHint> hint = {{1, 5, 0.9f}};
  ASSERT_TRUE(session.prefetch(hint));
  wait_loads(4);
  ASSERT_TRUE(session.set_cursor(0, 1));
  acquire_release(session, 1, {5});
  const json after = ctl_json({"stats"})["models"][0]["scheduler"];
  EXPECT_EQ(after["prefetch_useful"], 1) << after.dump();
  EXPECT_EQ(after["demand_bytes"], before["demand_bytes"]) << after.dump();
  EXPECT_GE(after["bytes_read"].get<uint64_t>(),
            before["bytes_read"].get<uint64_t>() + expert_bytes)
      << after.dump();

  // Client::stats() has the same number; expertctl's text names it with the schema's comment.
  EXPECT_EQ(model_stats().scheduler.demand_bytes, after["demand_bytes"].get<uint64_t>());
  const test::RunResult text = ctl({"stats"});
  ASSERT_EQ(text.status, 0) << text.err;
  EXPECT_NE(text.out.find("demand_bytes"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("bytes read for loads an acquire started"), std::string::npos)
      << text.out;
}

TEST_F(TelemetryTest, CacheLimitCapsTheCacheAndEvictAllEmptiesIt) {
  auto s = client_->attach("m", "telemetry-test");
  ASSERT_TRUE(s) << s.error().message;
  for (uint32_t layer = 0; layer < 4; ++layer) {
    acquire_release(**s, layer, {0, 1, 2, 3, 4, 5, 6, 7});
  }
  ModelStats m = model_stats();
  EXPECT_EQ(m.cache_ready, 32u);
  EXPECT_EQ(m.cache_limit, m.cache_slots);

  ASSERT_TRUE(client_->set_cache_limit("m", 5));
  m = model_stats();
  EXPECT_EQ(m.cache_limit, 5u);
  EXPECT_EQ(m.cache_ready, 5u);
  for (uint32_t layer = 0; layer < 4; ++layer) acquire_release(**s, layer, {0, 1, 2, 3});
  EXPECT_LE(model_stats().cache_ready, 5u);

  const auto too_many = client_->set_cache_limit("m", m.cache_slots + 1);
  ASSERT_FALSE(too_many);
  EXPECT_NE(
      too_many.error().message.find("model 'm': cache limit " + std::to_string(m.cache_slots + 1) +
                                    " slots: the cache has " + std::to_string(m.cache_slots)),
      std::string::npos)
      << too_many.error().message;
  EXPECT_FALSE(client_->set_cache_limit("nope", 1));
  EXPECT_FALSE(client_->evict_all("nope"));

  ASSERT_TRUE(client_->set_cache_limit("m", 0));
  EXPECT_EQ(model_stats().cache_limit, m.cache_slots);
  auto dropped = client_->evict_all("m");
  ASSERT_TRUE(dropped) << dropped.error().message;
  EXPECT_GE(*dropped, 1u);
  EXPECT_EQ(model_stats().cache_ready, 0u);

  // expertctl: a slot count, a size (rounded down to whole slots), evict-all.
  EXPECT_EQ(ctl_json({"set", "cache-limit", "3"})["cache_limit"], 3);
  const json by_size = ctl_json({"set", "cache-limit", std::to_string(2 * m.slot_bytes + 1) + "B"});
  EXPECT_EQ(by_size["cache_limit"], 2);
  EXPECT_EQ(by_size["cache_limit_bytes"], 2 * m.slot_bytes);
  EXPECT_EQ(ctl_json({"set", "cache-limit", "1MiB", "--model", "m"})["model"], "m");
  EXPECT_EQ(ctl_json({"stats"})["models"][0]["cache_limit"],
            std::max<uint64_t>(1, (1 << 20) / m.slot_bytes));
  const test::RunResult bad = ctl({"set", "cache-limit", "1TiB"});
  EXPECT_EQ(bad.status, 1);
  EXPECT_NE(bad.err.find("expertctl set: cache-limit 1TiB: model 'm' has"), std::string::npos)
      << bad.err;
  const test::RunResult wrong_model = ctl({"set", "cache-limit", "2", "--model", "x"});
  EXPECT_EQ(wrong_model.status, 1);
  EXPECT_NE(wrong_model.err.find("model 'x' is not served by this daemon"), std::string::npos)
      << wrong_model.err;
  acquire_release(**s, 0, {0});
  EXPECT_EQ(ctl_json({"evict-all", "m"})["evicted"], 1);
  const test::RunResult text = ctl({"evict-all", "m"});
  EXPECT_EQ(text.status, 0) << text.err;
  EXPECT_EQ(text.out, "evicted 0 experts of model m\n");
}

}  // namespace
}  // namespace expertd::client
