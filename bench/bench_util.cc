#include "bench/bench_util.h"

#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>

namespace expertd::bench {

std::optional<uint64_t> parse_bytes(std::string_view text) {
  size_t digits = 0;
  while (digits < text.size() &&
         ((text[digits] >= '0' && text[digits] <= '9') || text[digits] == '.')) {
    ++digits;
  }
  if (digits == 0) return std::nullopt;
  double value = 0.0;
  const std::string number(text.substr(0, digits));
  const auto [end, ec] = std::from_chars(number.data(), number.data() + number.size(), value);
  if (ec != std::errc() || end != number.data() + number.size()) return std::nullopt;
  std::string unit(text.substr(digits));
  std::transform(unit.begin(), unit.end(), unit.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  struct Unit {
    std::string_view name;
    double scale;
  };
  static constexpr std::array<Unit, 14> kUnits{{
      {"", 1.0},
      {"b", 1.0},
      {"k", 0x1p10},
      {"kib", 0x1p10},
      {"kb", 1e3},
      {"m", 0x1p20},
      {"mib", 0x1p20},
      {"mb", 1e6},
      {"g", 0x1p30},
      {"gib", 0x1p30},
      {"gb", 1e9},
      {"t", 0x1p40},
      {"tib", 0x1p40},
      {"tb", 1e12},
  }};
  for (const Unit& u : kUnits) {
    if (unit != u.name) continue;
    const double bytes = std::round(value * u.scale);
    if (!(bytes >= 0.0 && bytes < 0x1p63)) return std::nullopt;
    return static_cast<uint64_t>(bytes);
  }
  return std::nullopt;
}

std::string format_bytes(uint64_t bytes) {
  const auto b = static_cast<double>(bytes);
  if (bytes >= (uint64_t{1} << 30)) return fmt::format("{:.2f} GiB", b / 0x1p30);
  if (bytes >= (uint64_t{1} << 20)) return fmt::format("{:.1f} MiB", b / 0x1p20);
  if (bytes >= (uint64_t{1} << 10)) return fmt::format("{:.0f} KiB", b / 0x1p10);
  return fmt::format("{} B", bytes);
}

uint64_t percentile(std::span<const uint64_t> values, double p) {
  if (values.empty()) return 0;
  std::vector<uint64_t> v(values.begin(), values.end());
  std::sort(v.begin(), v.end());
  const double rank = std::ceil(p / 100.0 * static_cast<double>(v.size()));
  const size_t i = rank <= 1.0 ? 0 : static_cast<size_t>(rank) - 1;
  return v[std::min(i, v.size() - 1)];
}

namespace {

std::string read_line(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  while (!line.empty() && (line.back() == ' ' || line.back() == '\n')) line.pop_back();
  return line;
}

// "vda (virtio, 4096 KiB max request, scheduler [mq-deadline], non-rotational)".
std::string describe_disk(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return "unknown";
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path dev =
      fs::canonical(fmt::format("/sys/dev/block/{}:{}", major(st.st_dev), minor(st.st_dev)), ec);
  if (ec) return "unknown (not a block device: tmpfs, overlay or network file system?)";
  if (!fs::exists(dev / "queue") && fs::exists(dev.parent_path() / "queue")) {
    dev = dev.parent_path();  // a partition: the queue belongs to the disk
  }
  std::string model = read_line(dev / "device" / "model");
  if (model.empty()) {
    const std::string driver = fs::read_symlink(dev / "device" / "driver", ec).filename();
    model = ec ? "unknown model" : driver;
  }
  const std::string rotational = read_line(dev / "queue" / "rotational");
  return fmt::format("{} ({}, {} KiB max request, scheduler {}, {})", dev.filename().string(),
                     model, read_line(dev / "queue" / "max_sectors_kb"),
                     read_line(dev / "queue" / "scheduler"),
                     rotational == "0" ? "non-rotational" : "rotational");
}

}  // namespace

MachineInfo describe_machine(const std::string& path) {
  MachineInfo m;
  std::array<char, 256> host{};
  if (::gethostname(host.data(), host.size() - 1) == 0) m.host = host.data();
  const time_t now = ::time(nullptr);
  tm local{};
  ::localtime_r(&now, &local);
  std::array<char, 64> date{};
  ::strftime(date.data(), date.size(), "%Y-%m-%dT%H:%M:%S%z", &local);
  m.date = date.data();
  m.cpus = static_cast<uint32_t>(std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN)));
  m.ram_bytes = static_cast<uint64_t>(::sysconf(_SC_PHYS_PAGES)) *
                static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  utsname u{};
  if (::uname(&u) == 0) m.kernel = u.release;
  m.disk = describe_disk(path);
  return m;
}

}  // namespace expertd::bench
