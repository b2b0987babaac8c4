// Byte sizes as people write and read them: "4GiB", "512MiB", "25%" in, "1.50 MiB" out.
#pragma once

#include <cstdint>
#include <string>

#include "expertd/result.h"

namespace expertd {

// The machine's RAM.
uint64_t physical_memory_bytes();

// The memory limit of the cgroup this process runs in: cgroup v2's memory.max, the lowest from its
// cgroup up to the root, or cgroup v1's memory.limit_in_bytes (which is already hierarchical).
// `root` prefixes /proc/self/cgroup and /sys/fs/cgroup (tests give a fake tree). limit 0: none
// (no memory controller, "max", or v1's "unlimited" near 2^63); `file` is where the limit was read.
struct CgroupMemoryLimit {
  uint64_t limit = 0;
  std::string file;
};
CgroupMemoryLimit cgroup_memory_limit(const std::string& root = "");

// The memory this process may use: RAM, or its cgroup's limit when lower (the base of "25%" sizes:
// in a container or a systemd slice with MemoryMax=, 25% of the machine could exceed the limit).
uint64_t usable_memory_bytes(const CgroupMemoryLimit& cgroup);
uint64_t usable_memory_bytes();  // with this process's cgroup_memory_limit()

// Parses "4GiB", "512MiB", "1.5G", "4096", "2GB" (powers of 1000 for KB/MB/GB/TB, of 1024
// otherwise) or "25%" of `total_bytes`. The error names `what` and the value
// ("cache '4XB': unknown unit (examples: 4GiB, 512MiB, 25%)").
Result<uint64_t> parse_size(const std::string& what, const std::string& value,
                            uint64_t total_bytes);

// "512 B", "1.50 MiB", "2.00 GiB".
std::string human_bytes(uint64_t bytes);

}  // namespace expertd
