// The expertd process as systemd runs it: READY=1, STATUS= and WATCHDOG=1 on a NOTIFY_SOCKET the
// test listens on, SIGHUP reloading the tunables, SIGTERM draining to exit 0, and a bad
// configuration failing the start with one clear message.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace fs = std::filesystem;

struct TempDir {
  TempDir() {
    char t[] = "/tmp/expertd-proc-XXXXXX";
    path = ::mkdtemp(t);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string path;
};

std::string read_file(const std::string& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A daemon child with its stderr in a file and a NOTIFY_SOCKET datagram listener.
class Daemon {
 public:
  Daemon(const TempDir& dir, std::vector<std::string> args, bool watchdog) : dir_(dir) {
    notify_path_ = dir.path + "/notify.sock";
    ::unlink(notify_path_.c_str());
    notify_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::snprintf(a.sun_path, sizeof(a.sun_path), "%s", notify_path_.c_str());
    EXPECT_EQ(::bind(notify_, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    log_path_ = dir.path + "/expertd.log";
    pid_ = ::fork();
    if (pid_ == 0) {
      const int fd = ::open(log_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fd, 2);
      ::setenv("NOTIFY_SOCKET", notify_path_.c_str(), 1);
      if (watchdog) ::setenv("WATCHDOG_USEC", "400000", 1);
      std::vector<char*> argv;
      std::string bin = EXPERTD_BIN;
      argv.push_back(bin.data());
      for (auto& s : args) argv.push_back(s.data());
      argv.push_back(nullptr);
      ::execv(bin.c_str(), argv.data());
      ::_exit(127);
    }
  }
  ~Daemon() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    ::close(notify_);
  }
  // Notify messages received within `ms`, until one contains `want` (empty: collect all).
  std::vector<std::string> messages(int ms, const std::string& want = "") {
    std::vector<std::string> out;
    const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    while (std::chrono::steady_clock::now() < end) {
      pollfd p{notify_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      char buf[4096];
      const ssize_t n = ::recv(notify_, buf, sizeof(buf), 0);
      if (n <= 0) continue;
      out.emplace_back(buf, static_cast<size_t>(n));
      if (!want.empty() && out.back().find(want) != std::string::npos) break;
    }
    return out;
  }
  int wait_exit(int ms) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    while (std::chrono::steady_clock::now() < end) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return -1;
  }
  pid_t pid() const { return pid_; }
  std::string log() const { return read_file(log_path_); }

 private:
  const TempDir& dir_;
  std::string notify_path_;
  std::string log_path_;
  int notify_ = -1;
  pid_t pid_ = -1;
};

std::string forge(const TempDir& dir) {
  const std::string out = dir.path + "/m.gguf";
  const std::string cmd = std::string(EXPERT_FORGE_BIN) + " -o " + out +
                          " --layers 2 --experts 4 --embd 256 --ff 256 --seed 2 >/dev/null 2>&1";
  EXPECT_EQ(std::system(cmd.c_str()), 0);
  return out;
}

bool contains(const std::vector<std::string>& msgs, const std::string& what) {
  for (const auto& m : msgs) {
    if (m.find(what) != std::string::npos) return true;
  }
  return false;
}

TEST(ExpertdProcess, NotifiesReadyStatusAndWatchdogThenDrainsOnSigterm) {
  TempDir dir;
  const std::string model = forge(dir);
  Daemon d(
      dir,
      {"--model", "m=" + model, "--socket", dir.path + "/s.sock", "--cache", "16MiB", "--no-mlock"},
      true);
  const auto ready = d.messages(15000, "READY=1");
  ASSERT_TRUE(contains(ready, "READY=1")) << d.log();
  EXPECT_TRUE(fs::exists(dir.path + "/s.sock"));
  EXPECT_EQ(fs::status(dir.path + "/s.sock").permissions() & fs::perms::all,
            fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read |
                fs::perms::group_write)
      << "the socket is created with mode 0660";
  const auto later = d.messages(1500);
  int watchdogs = 0;
  for (const auto& m : later) watchdogs += m.find("WATCHDOG=1") != std::string::npos;
  EXPECT_GE(watchdogs, 3) << "WATCHDOG_USEC=400000: pings at least every 200 ms";
  EXPECT_TRUE(contains(ready, "STATUS=") || contains(later, "STATUS="));
  ASSERT_EQ(::kill(d.pid(), SIGTERM), 0);
  EXPECT_EQ(d.wait_exit(15000), 0) << d.log();
  EXPECT_NE(d.log().find("expertd stopped"), std::string::npos) << d.log();
}

TEST(ExpertdProcess, SighupReloadsTunablesFromTheFile) {
  TempDir dir;
  const std::string model = forge(dir);
  const std::string conf = dir.path + "/expertd.toml";
  auto write_conf = [&](int depth, const char* policy) {
    std::ofstream(conf) << "socket = \"" << dir.path << "/s.sock\"\ncache = \"16MiB\"\n"
                        << "lock_memory = false\nprefetch_depth = " << depth << "\npolicy = \""
                        << policy << "\"\n[models]\nm = \"" << model << "\"\n";
  };
  write_conf(2, "cyclic");
  Daemon d(dir, {"--config", conf}, false);
  ASSERT_TRUE(contains(d.messages(15000, "READY=1"), "READY=1")) << d.log();
  write_conf(5, "lru");
  ASSERT_EQ(::kill(d.pid(), SIGHUP), 0);
  const auto msgs = d.messages(5000, "READY=1");
  EXPECT_TRUE(contains(msgs, "RELOADING=1"));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const std::string log = d.log();
  EXPECT_NE(log.find("tuning: prefetch depth 5"), std::string::npos) << log;
  EXPECT_NE(log.find("tuning: cache policy lru"), std::string::npos) << log;
  // A broken file on reload keeps the running settings and says why.
  std::ofstream(conf) << "prefetch_depth = \"deep\"\n";
  ASSERT_EQ(::kill(d.pid(), SIGHUP), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_NE(d.log().find("keeping the current settings"), std::string::npos) << d.log();
  ASSERT_EQ(::kill(d.pid(), SIGTERM), 0);
  EXPECT_EQ(d.wait_exit(15000), 0);
}

TEST(ExpertdProcess, FlagsOverrideTheFile) {
  TempDir dir;
  const std::string model = forge(dir);
  const std::string conf = dir.path + "/expertd.toml";
  // Each of these keys alone would fail the start (max_sessions) or show in the log.
  std::ofstream(conf) << "socket = \"" << dir.path << "/s.sock\"\ncache = \"16MiB\"\n"
                      << "lock_memory = true\nverify = true\nmax_sessions = 0\nchunk = \"4MiB\"\n"
                      << "[models]\nm = \"" << model << "\"\n";
  Daemon d(dir,
           {"--config", conf, "--max-sessions", "8", "--lock-memory=false", "--verify=false",
            "--chunk", "auto"},
           false);
  ASSERT_TRUE(contains(d.messages(15000, "READY=1"), "READY=1")) << d.log();
  ASSERT_EQ(::kill(d.pid(), SIGTERM), 0);
  EXPECT_EQ(d.wait_exit(15000), 0);
  const std::string log = d.log();
  // Not asked to lock: neither locked nor a warning that locking failed.
  EXPECT_EQ(log.find("arena mlocked"), std::string::npos) << log;
  EXPECT_EQ(log.find("arena not locked:"), std::string::npos) << log;
  EXPECT_EQ(log.find("verify:"), std::string::npos) << log;  // no verifier
}

struct BadStart {
  std::string name;
  std::vector<std::string> args;
  std::string conf;      // written to expertd.toml and passed with --config when not empty
  std::string expected;  // in the one error line
};

TEST(ExpertdProcess, BadConfigurationFailsTheStartWithOneClearMessage) {
  TempDir dir;
  const std::string model = forge(dir);
  const std::string bad_model = dir.path + "/bad.gguf";
  std::ofstream(bad_model) << "GGUF but not really";
  const std::vector<BadStart> cases = {
      {"no model", {"--socket", dir.path + "/a.sock"}, "", "no models configured"},
      {"bad model", {"--model", "x=" + bad_model}, "", bad_model},
      {"missing file", {"--model", "x=" + dir.path + "/nope.gguf"}, "", "nope.gguf"},
      {"bad size", {"--model", "m=" + model, "--cache", "lots"}, "", "cache 'lots'"},
      {"bad policy", {"--model", "m=" + model, "--policy", "mru"}, "", "policy 'mru'"},
      {"bad chunk", {"--model", "m=" + model, "--chunk", "lots"}, "", "--chunk 'lots'"},
      {"bad max sessions",
       {"--model", "m=" + model, "--max-sessions", "0"},
       "",
       "max_sessions 0: must be 1..4096"},
      {"bad key", {}, "cache = \"1GiB\"\nprefetch = 3\n", "prefetch: unknown key"},
      {"bad type", {}, "queue_depth = \"many\"\n", "queue_depth: must be a non-negative"},
      {"bad toml", {}, "cache = \n", "expertd.toml:1"},
  };
  for (const auto& c : cases) {
    auto args = c.args;
    if (!c.conf.empty()) {
      std::ofstream(dir.path + "/expertd.toml") << c.conf;
      args.push_back("--config");
      args.push_back(dir.path + "/expertd.toml");
    }
    Daemon d(dir, args, false);
    EXPECT_EQ(d.wait_exit(15000), 1) << c.name;
    const std::string log = d.log();
    EXPECT_NE(log.find(c.expected), std::string::npos) << c.name << ": " << log;
    EXPECT_LE(std::count(log.begin(), log.end(), '\n'), 1) << c.name << ": " << log;
  }
}

}  // namespace
