// expertctl's daemon subcommands (status, stats, models, pin, unpin, evict, set, top --once) run
// as a user would, against the real expertd binary; and expert-bench ipc end to end.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <numeric>
#include <regex>
#include <sstream>
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
using test::RunResult;
using test::TempDir;

class ExpertctlTest : public test::ForgedDaemonTest {
 protected:
  test::RunResult ctl(std::vector<std::string> args) {
    return test::expertctl(daemon_->socket(), std::move(args));
  }
  json ctl_json(std::vector<std::string> args) {
    return test::expertctl_json(daemon_->socket(), std::move(args));
  }

  // Acquires and releases every expert of `layer` through a client session.
  void touch(Client& c, uint32_t layer) {
    auto s = c.attach("m", "expertctl-test");
    ASSERT_TRUE(s) << s.error().message;
    std::vector<uint32_t> experts(8);
    std::iota(experts.begin(), experts.end(), 0u);
    auto v = (*s)->acquire(layer, experts);
    ASSERT_TRUE(v) << v.error().message;
    ASSERT_TRUE((*s)->release(*v));
  }
};

TEST_F(ExpertctlTest, StatusModelsAndStatsAsJson) {
  const json status = ctl_json({"status"});
  EXPECT_EQ(status["protocol_version"], 1);
  EXPECT_EQ(status["models"], json::array({"m"}));
  EXPECT_EQ(status["sessions"], 0);
  EXPECT_TRUE(status["hit_rate"].is_null());

  const json models = ctl_json({"models"});
  ASSERT_EQ(models.size(), 1u);
  EXPECT_EQ(models[0]["name"], "m");
  EXPECT_EQ(models[0]["architecture"], "qwen3moe");
  EXPECT_EQ(models[0]["block_count"], 4);
  EXPECT_EQ(models[0]["expert_count"], 8);
  EXPECT_EQ(models[0]["cache_ready"], 0);

  auto c = Client::connect(daemon_->socket());
  ASSERT_TRUE(c) << c.error().message;
  touch(**c, 1);
  touch(**c, 1);
  const json stats = ctl_json({"stats"});
  ASSERT_EQ(stats["models"].size(), 1u);
  const json& m = stats["models"][0];
  EXPECT_EQ(m["name"], "m");
  EXPECT_EQ(m["scheduler"]["acquires"], 16);
  EXPECT_EQ(m["scheduler"]["hits"], 8);
  EXPECT_EQ(m["cache_ready"], 8);
  EXPECT_EQ(m["layer_hits"], json::array({0, 8, 0, 0}));
  EXPECT_EQ(m["layer_misses"], json::array({0, 8, 0, 0}));
  // The 8 misses were read: time with at least one read in flight, none with more than the
  // queue allows, and the list ends at the most reads there have been at once.
  const auto depth_ns = m["read_depth_ns"].get<std::vector<uint64_t>>();
  ASSERT_GE(depth_ns.size(), 2u);
  EXPECT_LE(depth_ns.size(), stats["queue_depth"].get<size_t>() + 1);
  EXPECT_GT(depth_ns.back(), 0u);
  EXPECT_GT(depth_ns[0], 0u);  // the idle time before and after

  // Text output too, and $EXPERTD_SOCKET as the default socket.
  ::setenv("EXPERTD_SOCKET", daemon_->socket().c_str(), 1);
  const RunResult text = test::run_command({test::bin_path("expertctl"), "status"});
  ::unsetenv("EXPERTD_SOCKET");
  EXPECT_EQ(text.status, 0) << text.err;
  EXPECT_NE(text.out.find("hit rate   50.0% of 16 acquires"), std::string::npos) << text.out;
}

// The daemon's CPU time (user + system) in seconds, from /proc/PID/stat.
double cpu_seconds(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(f)), {});
  // Fields after the command's closing parenthesis: state is field 3, utime 14, stime 15.
  std::istringstream rest(stat.substr(stat.rfind(')') + 2));
  std::vector<std::string> fields{std::istream_iterator<std::string>(rest), {}};
  EXPECT_GT(fields.size(), 13u) << stat;
  if (fields.size() <= 13) return -1;
  return static_cast<double>(std::stoull(fields[11]) + std::stoull(fields[12])) /
         static_cast<double>(::sysconf(_SC_CLK_TCK));
}

// The reactor polls the rings for a while after a request (reactor_spin_us) but sleeps once the
// clients go quiet: an idle daemon with a session attached burns no core.
TEST_F(ExpertctlTest, TheReactorSleepsOnceClientsGoQuiet) {
  auto c = Client::connect(daemon_->socket());
  ASSERT_TRUE(c) << c.error().message;
  auto s = (*c)->attach("m", "expertctl-test");
  ASSERT_TRUE(s) << s.error().message;
  for (uint32_t layer = 0; layer < 4; ++layer) {
    const std::vector<uint32_t> experts{0, 1};
    auto v = (*s)->acquire(layer, experts);
    ASSERT_TRUE(v) << v.error().message;
    ASSERT_TRUE((*s)->release(*v));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const double before = cpu_seconds(daemon_->pid());
  std::this_thread::sleep_for(std::chrono::seconds(2));
  const double used = cpu_seconds(daemon_->pid()) - before;
  // A spinning reactor would use the whole 2 s; a sleeping one wakes every 100 ms for its
  // deadlines and once a second for its status.
  EXPECT_LT(used, 0.2) << "expertd used " << used << " s of CPU in 2 s idle";
}

TEST_F(ExpertctlTest, PinUnpinAndEvict) {
  auto c = Client::connect(daemon_->socket());
  ASSERT_TRUE(c) << c.error().message;
  touch(**c, 0);

  const json pinned = ctl_json({"pin", "m", "0", "3"});
  EXPECT_EQ(pinned["ok"], true);
  EXPECT_EQ(pinned["op"], "pin");

  RunResult refused = ctl({"evict", "m", "0", "3", "--json"});
  EXPECT_EQ(refused.status, 1);
  EXPECT_EQ(json::parse(refused.out)["error"],
            "model 'm' layer 0 expert 3: not cached, or held, pinned or loading");
  EXPECT_NE(refused.err.find("expertctl evict: model 'm' layer 0 expert 3"), std::string::npos)
      << refused.err;

  EXPECT_EQ(ctl_json({"unpin", "m", "0", "3"})["ok"], true);
  EXPECT_EQ(ctl_json({"evict", "m", "0", "3"})["ok"], true);
  EXPECT_EQ(ctl_json({"stats"})["models"][0]["cache_ready"], 7);

  const RunResult text = ctl({"evict", "m", "0", "4"});
  EXPECT_EQ(text.status, 0) << text.err;
  EXPECT_EQ(text.out, "evicted model m layer 0 expert 4\n");

  const RunResult unknown = ctl({"pin", "nope", "0", "0"});
  EXPECT_EQ(unknown.status, 1);
  EXPECT_NE(unknown.err.find("model 'nope' is not served by this daemon"), std::string::npos)
      << unknown.err;
}

TEST_F(ExpertctlTest, SetTuningKnobs) {
  EXPECT_EQ(ctl_json({"set", "prefetch-depth", "5"})["value"], 5);
  EXPECT_EQ(ctl_json({"set", "policy", "lru"})["value"], "lru");
  EXPECT_EQ(ctl_json({"set", "queue-depth", "8"})["value"], 8);
  const json status = ctl_json({"status"});
  EXPECT_EQ(status["prefetch_depth"], 5);
  EXPECT_EQ(status["policy"], "lru");
  EXPECT_EQ(status["queue_depth"], 8);

  const RunResult bad = ctl({"set", "queue-depth", "0"});
  EXPECT_EQ(bad.status, 1);
  EXPECT_NE(bad.err.find("expertctl set: queue depth 0: must be 1.."), std::string::npos)
      << bad.err;
  const RunResult nan = ctl({"set", "prefetch-depth", "many"});
  EXPECT_EQ(nan.status, 1);
  EXPECT_NE(nan.err.find("prefetch-depth 'many': expected a non-negative integer"),
            std::string::npos)
      << nan.err;
  const RunResult policy = ctl({"set", "policy", "random-guess"});
  EXPECT_EQ(policy.status, 1);
  EXPECT_FALSE(policy.err.empty());
}

TEST_F(ExpertctlTest, TopOnceShowsTheHeatStrip) {
  auto c = Client::connect(daemon_->socket());
  ASSERT_TRUE(c) << c.error().message;
  touch(**c, 0);  // layer 0: 8 misses, then 8 hits: 50%
  touch(**c, 0);
  touch(**c, 2);  // layer 2: 8 misses: 0%
  const RunResult r = ctl({"top", "--once"});
  ASSERT_EQ(r.status, 0) << r.err;
  // Layers 0..3: half, none acquired, all misses, none acquired.
  EXPECT_NE(r.out.find("L0     ▅·▁·"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("hit rate   33.3% since start"), std::string::npos) << r.out;
  // The queue depth is what the daemon's start-up probe chose for this disk.
  EXPECT_TRUE(std::regex_search(r.out, std::regex("queue depth [0-9]+   reads in flight [0-9]+")))
      << r.out;
  EXPECT_EQ(r.out.find("\x1b["), std::string::npos) << "no escapes when not a terminal";
  // The daemon's default depth is automatic: top says so and what it chose (not a number alone).
  EXPECT_NE(r.out.find("prefetch  depth auto (now "), std::string::npos) << r.out;

  const json j = ctl_json({"top", "--once"});
  EXPECT_EQ(j["models"][0]["layer_hit_rate"], json::parse("[0.5, null, 0.0, null]"));
}

TEST(ExpertctlNoDaemon, SaysSoClearly) {
  TempDir dir;
  const std::string sock = dir.path() + "/absent.sock";
  const std::vector<std::vector<std::string>> commands = {
      {"status"}, {"stats"}, {"models"}, {"top", "--once"}, {"evict", "m", "0", "0"}};
  for (const auto& cmd : commands) {
    std::vector<std::string> argv{test::bin_path("expertctl")};
    argv.insert(argv.end(), cmd.begin(), cmd.end());
    argv.insert(argv.end(), {"--socket", sock});
    const RunResult r = test::run_command(argv);
    EXPECT_EQ(r.status, 1) << cmd[0];
    EXPECT_EQ(r.err, "expertctl " + cmd[0] + ": cannot connect to expertd at " + sock +
                         ": No such file or directory (is expertd running?)\n");
  }
}

#ifdef EXPERTD_HAVE_EXPERT_BENCH
TEST(ExpertBenchIpc, StartsItsOwnDaemonAndReports) {
  const RunResult r = test::run_command(
      {test::bin_path("expert-bench"), "ipc", "--iterations", "2000", "--rounds", "2", "--json"});
  ASSERT_EQ(r.status, 0) << r.err;
  const json j = json::parse(r.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  for (const char* key :
       {"shm_rtt_us_p50", "shm_rtt_us_p99", "rpc_rtt_us_p50", "rpc_rtt_us_p99", "speedup"}) {
    EXPECT_TRUE(j[key].is_number()) << key;
    EXPECT_GT(j[key].get<double>(), 0.0) << key;
  }
  EXPECT_EQ(j["iterations"], 2000);
}
#endif

}  // namespace
}  // namespace expertd::client
