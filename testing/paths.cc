#include "testing/paths.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>

namespace expertd::test {

namespace fs = std::filesystem;

namespace {

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

}  // namespace

std::string self_dir() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return ".";
  return exe.parent_path().string();
}

std::string bin_path(std::string_view name) {
  const auto dir = env("EXPERTD_TEST_BIN_DIR");
  return (dir && !dir->empty() ? *dir : self_dir()) + "/" + std::string(name);
}

std::string data_path(std::string_view rel) {
  const auto dir = env("EXPERTD_TEST_DATA");
  const fs::path base =
      dir && !dir->empty() ? fs::path(*dir) : fs::path(self_dir()) / "../fixtures";
  return (base / rel).lexically_normal().string();
}

std::optional<std::string> shared_traces_dir() {
  const auto set = env("EXPERTD_SHARED_TRACES");
  const fs::path dir = set ? fs::path(*set) : fs::path(self_dir()) / "../../../shared/traces";
  if (dir.empty()) return std::nullopt;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return std::nullopt;
  return dir.lexically_normal().string();
}

std::string find_in_path(std::string_view name) {
  const auto path = env("PATH");
  if (!path) return "";
  size_t start = 0;
  while (start <= path->size()) {
    size_t end = path->find(':', start);
    if (end == std::string::npos) end = path->size();
    const std::string dir = end > start ? path->substr(start, end - start) : ".";
    const std::string candidate = dir + "/" + std::string(name);
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
    start = end + 1;
  }
  return "";
}

}  // namespace expertd::test
