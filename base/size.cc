#include "base/size.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cctype>
#include <cmath>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>

namespace expertd {

uint64_t physical_memory_bytes() {
  return static_cast<uint64_t>(::sysconf(_SC_PHYS_PAGES)) *
         static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
}

namespace {

// A limit file's value: bytes, or 0 for none ("max", v1's page-rounded 2^63 - 1, unreadable).
uint64_t read_limit(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text) || text == "max") return 0;
  try {
    size_t used = 0;
    const unsigned long long v = std::stoull(text, &used);
    if (used != text.size() || v >= (1ull << 62)) return 0;
    return v;
  } catch (...) {
    return 0;
  }
}

}  // namespace

CgroupMemoryLimit cgroup_memory_limit(const std::string& root) {
  // Lines "ID:CONTROLLERS:PATH": v2's is "0::/a/b", v1's memory controller "N:memory:/a/b" (or
  // listed with others, "N:memory,xyz:/a/b").
  std::ifstream in(root + "/proc/self/cgroup");
  std::string line;
  std::string v2_path;
  std::string v1_path;
  bool have_v2 = false;
  bool have_v1 = false;
  while (std::getline(in, line)) {
    const size_t a = line.find(':');
    const size_t b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1);
    const std::string path = line.substr(b + 1);
    if (line.substr(0, a) == "0" && controllers.empty()) {
      v2_path = path;
      have_v2 = true;
    }
    std::stringstream list(controllers);
    for (std::string c; std::getline(list, c, ',');) {
      if (c == "memory") {
        v1_path = path;
        have_v1 = true;
      }
    }
  }
  CgroupMemoryLimit best;
  if (have_v1) {
    const std::string file = root + "/sys/fs/cgroup/memory" +
                             (v1_path == "/" ? std::string() : v1_path) + "/memory.limit_in_bytes";
    if (const uint64_t v = read_limit(file)) best = {v, file};
  }
  if (have_v2) {
    // A child's memory.max does not show its ancestors' limits: the lowest on the way up binds.
    std::string path = v2_path;
    while (!path.empty() && path != "/") {
      const std::string file = root + "/sys/fs/cgroup" + path + "/memory.max";
      const uint64_t v = read_limit(file);
      if (v != 0 && (best.limit == 0 || v < best.limit)) best = {v, file};
      path = path.substr(0, path.rfind('/'));
    }
  }
  return best;
}

uint64_t usable_memory_bytes(const CgroupMemoryLimit& cgroup) {
  const uint64_t ram = physical_memory_bytes();
  return cgroup.limit != 0 && cgroup.limit < ram ? cgroup.limit : ram;
}

uint64_t usable_memory_bytes() { return usable_memory_bytes(cgroup_memory_limit()); }

Result<uint64_t> parse_size(const std::string& what, const std::string& value,
                            uint64_t total_bytes) {
  auto bad = [&](const char* why) {
    return make_error(EINVAL,
                      fmt::format("{} '{}': {} (examples: 4GiB, 512MiB, 25%)", what, value, why));
  };
  size_t i = 0;
  while (i < value.size() &&
         (std::isdigit(static_cast<unsigned char>(value[i])) || value[i] == '.')) {
    ++i;
  }
  if (i == 0) return bad("not a size");
  double number = 0;
  try {
    number = std::stod(value.substr(0, i));
  } catch (...) {
    return bad("not a number");
  }
  std::string unit = value.substr(i);
  while (!unit.empty() && unit.front() == ' ') unit.erase(unit.begin());
  for (char& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  double mult = 1;
  if (unit.empty() || unit == "B") {
    mult = 1;
  } else if (unit == "%") {
    if (number > 100) return bad("a percentage above 100");
    return static_cast<uint64_t>(static_cast<double>(total_bytes) * number / 100.0);
  } else {
    static const std::pair<const char*, double> units[] = {
        {"K", 1024.0},          {"KIB", 1024.0},          {"KB", 1e3},
        {"M", 1048576.0},       {"MIB", 1048576.0},       {"MB", 1e6},
        {"G", 1073741824.0},    {"GIB", 1073741824.0},    {"GB", 1e9},
        {"T", 1099511627776.0}, {"TIB", 1099511627776.0}, {"TB", 1e12}};
    bool found = false;
    for (const auto& [name, m] : units) {
      if (unit == name) {
        mult = m;
        found = true;
      }
    }
    if (!found) return bad("unknown unit");
  }
  const double bytes = number * mult;
  if (!std::isfinite(bytes) || bytes >= 1.8e19) return bad("too large");
  return static_cast<uint64_t>(bytes);
}

std::string human_bytes(uint64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  return u == 0 ? fmt::format("{} B", b) : fmt::format("{:.2f} {}", v, units[u]);
}

}  // namespace expertd
