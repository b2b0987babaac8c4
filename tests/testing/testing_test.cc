// The testing library (testing/): binaries and data are found relative to the running binary (or
// where the environment says), wait_until polls to a deadline, run_command reports what a command
// did, and DaemonProcess and forge_model report failures with what the binaries said.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <string>

#include "testing/expertd_fixture.h"

namespace expertd::test {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;

// Sets an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = ::getenv(name)) old_ = old;
    ::setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(TestingPaths, BinariesAndDataLieBesideTheTestBinary) {
  EXPECT_EQ(fs::path(self_dir()).filename(), "bin");
  EXPECT_EQ(::access(bin_path("expertd").c_str(), X_OK), 0) << bin_path("expertd");
  EXPECT_EQ(::access(bin_path("expert-forge").c_str(), X_OK), 0);
  EXPECT_EQ(fs::path(bin_path("expertd")).parent_path(), fs::path(self_dir()));
  // The build copied the committed fixtures next to bin/.
  const std::string fixture = data_path("qwen3moe-tiny/fixture.json");
  EXPECT_EQ(fixture,
            (fs::path(self_dir()).parent_path() / "fixtures/qwen3moe-tiny/fixture.json").string());
  EXPECT_TRUE(fs::is_regular_file(fixture)) << fixture;
  EXPECT_TRUE(fs::is_regular_file(data_path("check_svg.py")));
  EXPECT_TRUE(fs::is_directory(data_path("fuzz-corpus")));
}

TEST(TestingPaths, TheEnvironmentOverrides) {
  TempDir dir;
  {
    ScopedEnv data("EXPERTD_TEST_DATA", dir.path());
    EXPECT_EQ(data_path("a/b.json"), dir.path() + "/a/b.json");
    ScopedEnv bin("EXPERTD_TEST_BIN_DIR", "/opt/x");
    EXPECT_EQ(bin_path("expertd"), "/opt/x/expertd");
  }
  {
    ScopedEnv traces("EXPERTD_SHARED_TRACES", dir.path());
    EXPECT_EQ(shared_traces_dir(), dir.path());
  }
  {
    ScopedEnv traces("EXPERTD_SHARED_TRACES", dir.path() + "/absent");
    EXPECT_EQ(shared_traces_dir(), std::nullopt);
  }
  {
    ScopedEnv traces("EXPERTD_SHARED_TRACES", "");
    EXPECT_EQ(shared_traces_dir(), std::nullopt);
  }
  EXPECT_NE(find_in_path("sh"), "");
  EXPECT_EQ(find_in_path("no-such-program-expertd"), "");
}

TEST(TestingWait, PollsUntilTheConditionOrTheDeadline) {
  int calls = 0;
  EXPECT_TRUE(wait_until([&] { return ++calls == 5; }, std::chrono::seconds(10)));
  EXPECT_EQ(calls, 5);
  const uint64_t t0 = now_ms();
  EXPECT_FALSE(wait_until([] { return false; }, milliseconds(100)));
  EXPECT_GE(now_ms() - t0, 100u);
  EXPECT_LT(now_ms() - t0, 5000u);
}

TEST(TestingRun, ReportsStatusOutputAndErrors) {
  const RunResult r = run_command({"sh", "-c", "echo out; echo err >&2; echo $EXPERTD_X; exit 3"},
                                  {"EXPERTD_X=given"});
  EXPECT_EQ(r.status, 3);
  EXPECT_EQ(r.out, "out\ngiven\n");
  EXPECT_EQ(r.err, "err\n");
  EXPECT_EQ(run_command({"sh", "-c", "kill -9 $$"}).status, 128 + 9);
  const RunResult missing = run_command({"/nonexistent/expertd"});
  EXPECT_EQ(missing.status, -1);
  EXPECT_NE(missing.err.find("cannot run /nonexistent/expertd"), std::string::npos) << missing.err;
}

TEST(TestingForge, AFailingForgeSaysWhy) {
  TempDir dir;
  const auto ok = forge_model(dir.path(), "m", "--layers 2 --experts 4 --embd 256 --ff 256");
  ASSERT_TRUE(ok) << ok.error().message;
  EXPECT_EQ(*ok, dir.path() + "/m.gguf");
  EXPECT_TRUE(fs::is_regular_file(*ok));
  const auto bad = forge_model(dir.path(), "bad", "--top-k 9 --experts 8");
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message.find("--top-k 9"), std::string::npos) << bad.error().message;
}

TEST(TestingDaemon, StartsStopsAndReportsAFailedStartWithItsLog) {
  TempDir dir;
  const auto model = forge_model(dir.path(), "m", "--layers 2 --experts 4 --embd 256 --ff 256");
  ASSERT_TRUE(model) << model.error().message;
  DaemonProcess d(dir.path(), {"--model", "m=" + *model, "--socket", dir.file("s.sock"), "--cache",
                               "16MiB", "--no-mlock"});
  const Status st = d.start();
  ASSERT_TRUE(st) << st.error().message;
  EXPECT_TRUE(socket_listens(d.socket()));
  EXPECT_GT(d.pid(), 0);
  EXPECT_EQ(d.stop(), 0) << d.log();
  EXPECT_FALSE(socket_listens(d.socket()));
  EXPECT_EQ(d.pid(), -1);

  DaemonProcess bad(dir.path(),
                    {"--model", "x=" + dir.file("nope.gguf"), "--socket", dir.file("b.sock")});
  const Status failed = bad.start();
  ASSERT_FALSE(failed);
  EXPECT_NE(failed.error().message.find("exited (1) at start"), std::string::npos)
      << failed.error().message;
  EXPECT_NE(failed.error().message.find("nope.gguf"), std::string::npos) << failed.error().message;
}

}  // namespace
}  // namespace expertd::test
