// A temporary directory under /tmp (short, so Unix socket paths in it fit), removed with
// everything in it when the owner goes.
#pragma once

#include <string>

namespace expertd::test {

class TempDir {
 public:
  // /tmp/PREFIX-XXXXXX. An empty path() means mkdtemp failed.
  explicit TempDir(const std::string& prefix = "expertd-test");
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  // path() + "/" + name.
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace expertd::test
