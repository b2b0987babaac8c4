#include "testing/expertd_fixture.h"

namespace expertd::test {

std::string forge(const std::string& dir, const std::string& name, const std::string& args) {
  const auto path = forge_model(dir, name, args);
  EXPECT_TRUE(path) << path.error().message;
  return path ? *path : dir + "/" + name + ".gguf";
}

::testing::AssertionResult Daemon::start() {
  const Status s = p_.start();
  if (!s) return ::testing::AssertionFailure() << s.error().message;
  return ::testing::AssertionSuccess();
}

}  // namespace expertd::test
