// The configuration keys do not drift apart: every key the loader accepts (kConfigKeys, the list
// load_config_file checks against) has its flag in `expertd --help` and a documented entry in
// systemd/expertd.toml, which loads cleanly; every flag in --help is a key's or a known
// command-line-only one.
#include <gtest/gtest.h>
#include <toml++/toml.h>

#include <cstdio>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "daemon/config.h"
#include "testing/paths.h"

namespace expertd {
namespace {

// The shipped file, copied into the build's test data (tests/CMakeLists.txt).
const std::string kToml = test::data_path("expertd.toml");

std::string help_text() {
  std::string out;
  FILE* p = ::popen((test::bin_path("expertd") + " --help").c_str(), "r");
  if (p == nullptr) return out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), p)) > 0;) out.append(buf, n);
  EXPECT_EQ(::pclose(p), 0) << out;
  return out;
}

// The flags --help lists: "--name" tokens (CLI11 shows "--lock-memory{false},--no-mlock{false}").
std::set<std::string> help_flags(const std::string& help) {
  std::set<std::string> flags;
  const std::regex flag(R"((^|[\s,!])(--[a-z][a-z0-9-]*))");
  for (std::sregex_iterator it(help.begin(), help.end(), flag), end; it != end; ++it) {
    flags.insert((*it)[2].str());
  }
  return flags;
}

TEST(ConfigKeys, EveryKeyHasAFlagInHelp) {
  const std::string help = help_text();
  const std::set<std::string> flags = help_flags(help);
  std::set<std::string> of_keys;
  for (const auto& k : kConfigKeys) {
    of_keys.insert(std::string(k.flag));
    EXPECT_EQ(flags.count(std::string(k.flag)), 1u)
        << "key " << k.key << ": its flag " << k.flag << " is not in expertd --help:\n"
        << help;
  }
  // Flags without a key: the file itself, logging, help, the version, and --lock-memory's
  // negation.
  const std::set<std::string> cli_only = {"--help", "--version", "--config", "--log-level",
                                          "--no-mlock"};
  for (const auto& f : flags) {
    EXPECT_TRUE(of_keys.count(f) || cli_only.count(f))
        << "flag " << f << " has no key in kConfigKeys (daemon/config.h): add one, with its "
        << "entry in systemd/expertd.toml, or list it here as command-line only";
  }
}

TEST(ConfigKeys, TheShippedFileLoadsAndHoldsEveryKey) {
  DaemonConfig c;
  const auto st = load_config_file(kToml, c);
  ASSERT_TRUE(st) << st.error().message;  // every key in it is one the loader accepts
  const toml::table t = toml::parse_file(kToml);
  for (const auto& k : kConfigKeys) {
    EXPECT_TRUE(t.contains(k.key)) << kToml << ": key " << k.key << " is not documented";
  }
}

// Each key's line sits in a paragraph (lines up to a blank one) that has a comment above it.
TEST(ConfigKeys, EveryKeyInTheShippedFileIsExplained) {
  std::ifstream in(kToml);
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  for (const auto& k : kConfigKeys) {
    const std::string want = k.key == "models" ? "[models]" : std::string(k.key) + " = ";
    size_t at = lines.size();
    for (size_t i = 0; i < lines.size(); ++i) {
      if (lines[i].rfind(want, 0) == 0) at = i;
    }
    ASSERT_LT(at, lines.size()) << kToml << ": no line starts with '" << want << "'";
    bool explained = k.key == "models" && at + 1 < lines.size() && lines[at + 1][0] == '#';
    for (size_t i = at; i-- > 0 && !lines[i].empty() && !explained;) {
      explained = lines[i][0] == '#';
    }
    EXPECT_TRUE(explained) << kToml << ":" << at + 1 << ": key " << k.key
                           << " has no comment explaining it";
  }
}

TEST(ConfigKeys, AnUnknownKeyIsRefusedNamingEveryKnownOne) {
  const std::string path = ::testing::TempDir() + "/config_keys_test.toml";
  std::ofstream(path) << "cach = \"1GiB\"\n";
  DaemonConfig c;
  const auto st = load_config_file(path, c);
  ASSERT_FALSE(st);
  EXPECT_NE(st.error().message.find(path + ":1:8: cach: unknown key (known: socket, "),
            std::string::npos)
      << st.error().message;
  for (const auto& k : kConfigKeys) {
    EXPECT_NE(st.error().message.find(std::string(k.key)), std::string::npos) << k.key;
  }
  std::remove(path.c_str());
}

}  // namespace
}  // namespace expertd
