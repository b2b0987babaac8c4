// Byte sizes and the memory they are taken of: parse_size, and the cgroup memory limit read from
// fake /proc and /sys trees laid out as cgroup v1 and v2 lay them out.
#include "base/size.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace expertd {
namespace {

namespace fs = std::filesystem;

class FakeRoot {
 public:
  FakeRoot() {
    char tmpl[] = "/tmp/expertd-cgroup-XXXXXX";
    root_ = ::mkdtemp(tmpl);
  }
  ~FakeRoot() { fs::remove_all(root_); }
  void write(const std::string& path, const std::string& text) const {
    fs::create_directories(fs::path(root_ + path).parent_path());
    std::ofstream(root_ + path) << text;
  }
  const std::string& path() const { return root_; }

 private:
  std::string root_;
};

TEST(ParseSize, UnitsPercentagesAndErrorsThatNameTheValue) {
  EXPECT_EQ(*parse_size("cache", "4GiB", 0), 4ull << 30);
  EXPECT_EQ(*parse_size("cache", "2GB", 0), 2'000'000'000ull);
  EXPECT_EQ(*parse_size("cache", "25%", 1000), 250u);
  auto bad = parse_size("cache", "4XB", 0);
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.error().message, "cache '4XB': unknown unit (examples: 4GiB, 512MiB, 25%)");
}

TEST(CgroupMemoryLimit, V2TakesTheLowestLimitUpTheTree) {
  FakeRoot r;
  r.write("/proc/self/cgroup", "0::/system.slice/expertd.service\n");
  r.write("/sys/fs/cgroup/system.slice/expertd.service/memory.max", "max\n");
  r.write("/sys/fs/cgroup/system.slice/memory.max", "268435456\n");
  const CgroupMemoryLimit l = cgroup_memory_limit(r.path());
  EXPECT_EQ(l.limit, 256ull << 20);
  EXPECT_EQ(l.file, r.path() + "/sys/fs/cgroup/system.slice/memory.max");
  // A tighter limit on the leaf wins.
  r.write("/sys/fs/cgroup/system.slice/expertd.service/memory.max", "134217728\n");
  EXPECT_EQ(cgroup_memory_limit(r.path()).limit, 128ull << 20);
}

TEST(CgroupMemoryLimit, V1ReadsTheMemoryControllersLimit) {
  FakeRoot r;
  r.write("/proc/self/cgroup", "12:pids:/x\n7:memory:/bench\n1:name=systemd:/x\n");
  r.write("/sys/fs/cgroup/memory/bench/memory.limit_in_bytes", "167772160\n");
  const CgroupMemoryLimit l = cgroup_memory_limit(r.path());
  EXPECT_EQ(l.limit, 160ull << 20);
  EXPECT_EQ(l.file, r.path() + "/sys/fs/cgroup/memory/bench/memory.limit_in_bytes");
}

TEST(CgroupMemoryLimit, NoLimitIsZero) {
  FakeRoot r;
  // v1's "unlimited" (2^63 - 1 rounded down to a page), v2's "max", a root cgroup, no file.
  r.write("/proc/self/cgroup", "7:memory:/\n");
  r.write("/sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
  EXPECT_EQ(cgroup_memory_limit(r.path()).limit, 0u);
  r.write("/proc/self/cgroup", "0::/user.slice\n");
  r.write("/sys/fs/cgroup/user.slice/memory.max", "max\n");
  EXPECT_EQ(cgroup_memory_limit(r.path()).limit, 0u);
  r.write("/proc/self/cgroup", "0::/\n");
  EXPECT_EQ(cgroup_memory_limit(r.path()).limit, 0u);
  EXPECT_EQ(cgroup_memory_limit(r.path() + "/nowhere").limit, 0u);
  // The real machine: whatever it is, never above RAM once taken as usable memory.
  EXPECT_LE(usable_memory_bytes(), physical_memory_bytes());
  EXPECT_GT(usable_memory_bytes(), 0u);
}

}  // namespace
}  // namespace expertd
