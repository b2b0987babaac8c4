#include "testing/expertd_fixture.h"

namespace expertd::test {

std::string forge(const std::string& dir, const std::string& name, const std::string& args) {
  const auto path = forge_model(dir, name, args);
  EXPECT_TRUE(path) << path.error().message;
  return path ? *path : dir + "/" + name + ".gguf";
}

void ForgedDaemonTest::SetUp() {
  model_ = forge(dir_.path(), "m", "--layers 4 --experts 8 --embd 256 --ff 512");
  daemon_ = std::make_unique<Daemon>(
      dir_.path(),
      std::vector<std::string>{"--model", "m=" + model_, "--socket", dir_.path() + "/expertd.sock",
                               "--cache", "64MiB", "--no-mlock"});
  ASSERT_TRUE(daemon_->start());
}

void ForgedDaemonTest::TearDown() {
  if (daemon_ && daemon_->pid() > 0) {
    const std::string log = daemon_->log();
    EXPECT_EQ(daemon_->stop(), 0) << log;
  }
}

::testing::AssertionResult Daemon::start() {
  const Status s = p_.start();
  if (!s) return ::testing::AssertionFailure() << s.error().message;
  return ::testing::AssertionSuccess();
}

}  // namespace expertd::test
