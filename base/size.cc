#include "base/size.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cctype>
#include <cmath>
#include <string>
#include <utility>

namespace expertd {

uint64_t physical_memory_bytes() {
  return static_cast<uint64_t>(::sysconf(_SC_PHYS_PAGES)) *
         static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
}

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
