// What the tests share (gtest side of the testing library): the real expertd as a child process
// on a temporary socket, forged models, and the paths and helpers of the gtest-free core
// (paths.h, temp_dir.h, wait.h, process.h), re-exported for the tests' convenience.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "testing/paths.h"
#include "testing/process.h"
#include "testing/temp_dir.h"
#include "testing/wait.h"

namespace expertd::test {

// Writes a forged model DIR/NAME.gguf (expert-forge options in `args`) and returns its path; a
// failing forge fails the test (EXPECT) and says why.
std::string forge(const std::string& dir, const std::string& name, const std::string& args);

// Why a test of the shared traces skips:
//   const auto dir = shared_traces_dir();
//   if (!dir) GTEST_SKIP() << kNoSharedTraces;
inline constexpr const char* kNoSharedTraces =
    "the shared Mixtral traces are absent (set EXPERTD_SHARED_TRACES to their directory; the "
    "generated-trace twin of this test checks the same claims)";

// The expertd binary as a child process, for gtest: start() is an AssertionResult.
class Daemon {
 public:
  // `env` entries are NAME=VALUE added to this process's environment for the child.
  Daemon(const std::string& dir, std::vector<std::string> args, std::vector<std::string> env = {})
      : p_(dir, std::move(args), std::move(env)) {}

  // Starts expertd and waits (up to 20 s) until its socket accepts connections.
  ::testing::AssertionResult start();
  // Runs another binary of the build, e.g. "expertd-test" (with the test hooks).
  void set_binary(std::string name) { p_.set_binary(std::move(name)); }
  // SIGTERM, then the exit status (-1 when it had to be killed after 20 s).
  int stop() { return p_.stop(); }
  void kill9() { p_.kill9(); }

  const std::string& socket() const { return p_.socket(); }
  pid_t pid() const { return p_.pid(); }
  std::string log() const { return p_.log(); }
  DaemonProcess& process() { return p_; }

 private:
  DaemonProcess p_;
};

// A test with one forged model "m" (4 layers of 8 experts) served by a real expertd (a 64 MiB
// cache, no mlock) started in SetUp; TearDown stops it and requires exit status 0.
class ForgedDaemonTest : public ::testing::Test {
 protected:
  void SetUp() override;
  void TearDown() override;

  TempDir dir_;
  std::string model_;
  std::unique_ptr<Daemon> daemon_;
};

}  // namespace expertd::test
