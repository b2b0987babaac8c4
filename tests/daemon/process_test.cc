// The expertd process as systemd runs it: READY=1, STATUS= and WATCHDOG=1 on a NOTIFY_SOCKET the
// test listens on, SIGHUP reloading the tunables, SIGTERM draining to exit 0, and a bad
// configuration failing the start with one clear message.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "testing/expertd_fixture.h"

namespace {

namespace fs = std::filesystem;
using expertd::test::TempDir;
using std::chrono::milliseconds;

// A daemon child (testing's DaemonProcess: its output in a log file) with a NOTIFY_SOCKET
// datagram listener.
class Daemon {
 public:
  Daemon(const TempDir& dir, std::vector<std::string> args, bool watchdog)
      : notify_path_(dir.file("notify.sock")),
        p_(dir.path(), std::move(args), env(notify_path_, watchdog)) {
    ::unlink(notify_path_.c_str());
    notify_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::snprintf(a.sun_path, sizeof(a.sun_path), "%s", notify_path_.c_str());
    EXPECT_EQ(::bind(notify_, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    const auto st = p_.spawn();
    EXPECT_TRUE(st) << st.error().message;
  }
  ~Daemon() {
    p_.kill9();
    ::close(notify_);
  }
  // Notify messages received within `ms`, until one contains `want` (empty: collect all).
  std::vector<std::string> messages(int ms, const std::string& want = "") {
    std::vector<std::string> out;
    const auto end = std::chrono::steady_clock::now() + milliseconds(ms);
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
  int wait_exit(int ms) { return p_.wait_exit(milliseconds(ms)); }
  // Waits (up to `ms`) until the log contains `text`.
  bool log_shows(const std::string& text, int ms = 10'000) {
    return expertd::test::wait_until([&] { return log().find(text) != std::string::npos; },
                                     milliseconds(ms));
  }
  pid_t pid() const { return p_.pid(); }
  std::string log() const { return p_.log(); }

 private:
  static std::vector<std::string> env(const std::string& notify, bool watchdog) {
    std::vector<std::string> e{"NOTIFY_SOCKET=" + notify};
    if (watchdog) e.push_back("WATCHDOG_USEC=400000");
    return e;
  }

  std::string notify_path_;
  expertd::test::DaemonProcess p_;
  int notify_ = -1;
};

std::string forge(const TempDir& dir) {
  return expertd::test::forge(dir.path(), "m",
                              "--layers 2 --experts 4 --embd 256 --ff 256 --seed 2");
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
  Daemon d(dir,
           {"--model", "m=" + model, "--socket", dir.path() + "/s.sock", "--cache", "16MiB",
            "--no-mlock"},
           true);
  const auto ready = d.messages(15000, "READY=1");
  ASSERT_TRUE(contains(ready, "READY=1")) << d.log();
  EXPECT_TRUE(fs::exists(dir.path() + "/s.sock"));
  EXPECT_EQ(fs::status(dir.path() + "/s.sock").permissions() & fs::perms::all,
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
  const std::string conf = dir.path() + "/expertd.toml";
  auto write_conf = [&](int depth, const char* policy) {
    std::ofstream(conf) << "socket = \"" << dir.path() << "/s.sock\"\ncache = \"16MiB\"\n"
                        << "lock_memory = false\nprefetch_depth = " << depth << "\npolicy = \""
                        << policy << "\"\n[models]\nm = \"" << model << "\"\n";
  };
  write_conf(2, "default");  // the default policy by name
  Daemon d(dir, {"--config", conf}, false);
  ASSERT_TRUE(contains(d.messages(15000, "READY=1"), "READY=1")) << d.log();
  write_conf(5, "lru");
  ASSERT_EQ(::kill(d.pid(), SIGHUP), 0);
  const auto msgs = d.messages(5000, "READY=1");
  EXPECT_TRUE(contains(msgs, "RELOADING=1"));
  EXPECT_TRUE(d.log_shows("tuning: prefetch depth 5")) << d.log();
  EXPECT_TRUE(d.log_shows("tuning: cache policy lru")) << d.log();
  write_conf(5, "cyclic-hint");
  ASSERT_EQ(::kill(d.pid(), SIGHUP), 0);
  EXPECT_TRUE(d.log_shows("tuning: cache policy cyclic-hint")) << d.log();
  // Back to the default, automatic depth.
  std::ofstream(conf) << "socket = \"" << dir.path() << "/s.sock\"\ncache = \"16MiB\"\n"
                      << "lock_memory = false\nprefetch_depth = \"auto\"\n[models]\nm = \"" << model
                      << "\"\n";
  ASSERT_EQ(::kill(d.pid(), SIGHUP), 0);
  EXPECT_TRUE(d.log_shows("tuning: prefetch depth auto")) << d.log();
  EXPECT_TRUE(d.log_shows("reload: tunables applied (prefetch_depth auto")) << d.log();
  // A broken file on reload keeps the running settings and says why.
  std::ofstream(conf) << "prefetch_depth = \"deep\"\n";
  ASSERT_EQ(::kill(d.pid(), SIGHUP), 0);
  EXPECT_TRUE(d.log_shows("keeping the current settings")) << d.log();
  ASSERT_EQ(::kill(d.pid(), SIGTERM), 0);
  EXPECT_EQ(d.wait_exit(15000), 0);
}

TEST(ExpertdProcess, FlagsOverrideTheFile) {
  TempDir dir;
  const std::string model = forge(dir);
  const std::string conf = dir.path() + "/expertd.toml";
  // Each of these keys alone would fail the start (max_sessions) or show in the log.
  std::ofstream(conf) << "socket = \"" << dir.path() << "/s.sock\"\ncache = \"16MiB\"\n"
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
  const std::string bad_model = dir.path() + "/bad.gguf";
  std::ofstream(bad_model) << "GGUF but not really";
  const std::vector<BadStart> cases = {
      {"no model", {"--socket", dir.path() + "/a.sock"}, "", "no models configured"},
      {"bad model",
       {"--model", "x=" + bad_model, "--socket", dir.path() + "/a.sock"},
       "",
       bad_model},
      {"missing file",
       {"--model", "x=" + dir.path() + "/nope.gguf", "--socket", dir.path() + "/a.sock"},
       "",
       "nope.gguf"},
      {"bad size", {"--model", "m=" + model, "--cache", "lots"}, "", "cache 'lots'"},
      {"bad policy", {"--model", "m=" + model, "--policy", "mru"}, "", "policy 'mru'"},
      {"bad chunk", {"--model", "m=" + model, "--chunk", "lots"}, "", "--chunk 'lots'"},
      {"bad max sessions",
       {"--model", "m=" + model, "--max-sessions", "0"},
       "",
       "max_sessions 0: must be 1..4096"},
      {"acquire deadline too short",
       {"--model", "m=" + model, "--acquire-timeout-ms", "5"},
       "",
       "acquire_timeout_ms 5: must be 100..600000"},
      {"acquire deadline too long in the file",
       {"--model", "m=" + model},
       "acquire_timeout_ms = 700000\n",
       "acquire_timeout_ms 700000: must be 100..600000"},
      {"read deadline too short",
       {"--model", "m=" + model, "--read-timeout-ms", "50"},
       "",
       "read_timeout_ms 50: must be 1000..3600000, or 0 for no deadline"},
      {"read deadline too long in the file",
       {"--model", "m=" + model},
       "read_timeout_ms = 7200000\n",
       "read_timeout_ms 7200000: must be 1000..3600000, or 0 for no deadline"},
      {"reactor spin too long",
       {"--model", "m=" + model, "--reactor-spin-us", "100001"},
       "",
       "reactor_spin_us 100001: must be 0..100000"},
      {"reactor spin too long in the file",
       {"--model", "m=" + model},
       "reactor_spin_us = 200000\n",
       "reactor_spin_us 200000: must be 0..100000"},
      {"no connections per uid",
       {"--model", "m=" + model, "--max-connections-per-uid", "0"},
       "",
       "max_connections_per_uid 0: must be 1..256"},
      {"no sessions per uid",
       {"--model", "m=" + model},
       "max_sessions_per_uid = 0\n",
       "max_sessions_per_uid 0: must be 1..4096"},
      {"tiny frame",
       {"--model", "m=" + model, "--max-frame", "100"},
       "",
       "max_frame 100 B: must be 4KiB..256MiB"},
      {"idle for days",
       {"--model", "m=" + model},
       "idle_timeout_s = 999999\n",
       "idle_timeout_s 999999: must be 0..86400"},
      {"admin gid by name",
       {"--model", "m=" + model},
       "admin_gids = [\"wheel\"]\n",
       "admin_gids: must hold non-negative integers"},
      {"bad key", {}, "cache = \"1GiB\"\nprefetch = 3\n", "prefetch: unknown key"},
      {"bad type", {}, "queue_depth = \"many\"\n", "queue_depth: must be a non-negative"},
      {"bad toml", {}, "cache = \n", "expertd.toml:1"},
      // Found by the chaos run (issue 14): each was accepted without a word.
      {"bool cache", {"--model", "m=" + model}, "cache = true\n", "cache: must be a string"},
      {"bool depth", {"--model", "m=" + model}, "queue_depth = true\n", "queue_depth: must be"},
      {"cache of one byte",
       {"--model", "m=" + model, "--cache", "1", "--socket", dir.path() + "/c.sock"},
       "",
       "one token needs 2 (its top-k) at once: give --cache at least"},
      {"cache of nothing",
       {"--model", "m=" + model, "--cache", "0", "--socket", dir.path() + "/c.sock"},
       "",
       "holds 0 of its experts"},
      {"bogus log level",
       {"--model", "m=" + model, "--log-level", "bogus"},
       "",
       "--log-level 'bogus': must be"},
      {"model twice",
       {"--model", "m=" + model, "--model", "m=" + bad_model},
       "",
       "the name 'm' is given twice"},
      {"deep prefetch",
       {"--model", "m=" + model, "--prefetch-depth", "65"},
       "",
       "--prefetch-depth 65: must be 0..64 (layers ahead) or auto"},
      {"wordy prefetch",
       {"--model", "m=" + model, "--prefetch-depth", "deep"},
       "",
       "--prefetch-depth 'deep': must be auto or a number of layers 0..64"},
      {"wordy prefetch in the file",
       {"--model", "m=" + model},
       "prefetch_depth = \"Auto\"\n",
       "expertd.toml:1:18: prefetch_depth 'Auto': must be auto or a number of layers 0..64"},
      {"negative prefetch in the file",
       {"--model", "m=" + model},
       "prefetch_depth = -1\n",
       "prefetch_depth: must be \"auto\" or a number of layers"},
      {"deep prefetch in the file",
       {"--model", "m=" + model},
       "prefetch_depth = 1000\n",
       "prefetch_depth 1000: must be 0..64"},
      {"deep queue",
       {"--model", "m=" + model, "--queue-depth", "100000"},
       "",
       "queue_depth 100000: must be 0..4096"},
      {"socket under a file",
       {"--model", "m=" + model, "--socket", model + "/x.sock"},
       "",
       model + " is not a directory"},
      {"socket path is a file",
       {"--model", "m=" + model, "--socket", model},
       "",
       "the path exists and is not a socket"},
      {"socket path too long",
       {"--model", "m=" + model, "--socket", dir.path() + "/" + std::string(120, 's')},
       "",
       "a Unix socket's is at most 107"},
  };
  for (const auto& c : cases) {
    auto args = c.args;
    if (!c.conf.empty()) {
      std::ofstream(dir.path() + "/expertd.toml") << c.conf;
      args.push_back("--config");
      args.push_back(dir.path() + "/expertd.toml");
    }
    Daemon d(dir, args, false);
    EXPECT_EQ(d.wait_exit(15000), 1) << c.name;
    const std::string log = d.log();
    EXPECT_NE(log.find(c.expected), std::string::npos) << c.name << ": " << log;
    EXPECT_LE(std::count(log.begin(), log.end(), '\n'), 1) << c.name << ": " << log;
  }
}

// A memory cgroup (a container, a systemd slice with MemoryMax=): an arena the kernel cannot swap
// (locked, or pinned by io_uring's registered buffers) beyond its limit would get expertd killed,
// so the start is refused with the numbers; a percentage is of the limit, not of the machine.
// Needs root to make the cgroup (v2, or v1's memory controller).
class MemoryCgroup {
 public:
  explicit MemoryCgroup(uint64_t limit) {
    const std::string name = "expertd-test-" + std::to_string(::getpid());
    if (fs::exists("/sys/fs/cgroup/cgroup.controllers")) {
      dir_ = "/sys/fs/cgroup/" + name;
      limit_file_ = "memory.max";
    } else if (fs::exists("/sys/fs/cgroup/memory")) {
      dir_ = "/sys/fs/cgroup/memory/" + name;
      limit_file_ = "memory.limit_in_bytes";
    } else {
      why_ = "no cgroup v2 and no v1 memory controller";
      return;
    }
    std::error_code ec;
    fs::create_directory(dir_, ec);
    if (ec) {
      why_ = "cannot create " + dir_ + ": " + ec.message();
      dir_.clear();
      return;
    }
    std::ofstream(dir_ + "/" + limit_file_) << limit;
    std::ifstream in(dir_ + "/" + limit_file_);
    uint64_t read = 0;
    if (!(in >> read) || read != limit) why_ = dir_ + ": the memory limit could not be set";
  }
  ~MemoryCgroup() {
    if (!dir_.empty()) ::rmdir(dir_.c_str());
  }
  const std::string& why_not() const { return why_; }
  std::string limit_path() const { return dir_ + "/" + limit_file_; }
  // expertd with `args`, moved into this cgroup before it starts (a shell that joins, then execs).
  expertd::test::RunResult run_expertd(const std::vector<std::string>& args) const {
    std::string cmd = "echo $$ > " + dir_ + "/cgroup.procs && exec timeout -s TERM 5 " +
                      expertd::test::bin_path("expertd");
    for (const auto& a : args) cmd += " '" + a + "'";
    return expertd::test::run_command({"/bin/sh", "-c", cmd});
  }

 private:
  std::string dir_;
  std::string limit_file_;
  std::string why_;
};

TEST(ExpertdProcess, AMemoryCgroupBoundsTheCacheAndItsPercentages) {
  if (::geteuid() != 0) GTEST_SKIP() << "making a memory cgroup needs root";
  MemoryCgroup cg(256ull << 20);
  if (!cg.why_not().empty()) GTEST_SKIP() << cg.why_not();
  TempDir dir;
  const std::string model = forge(dir);
  // 128 experts of 1.6 MiB: a 240 MiB cache holds them all, about 205 MiB of arena.
  const std::string big_model = expertd::test::forge(
      dir.path(), "big", "--layers 4 --experts 32 --embd 512 --ff 1024 --seed 3");
  const expertd::test::RunResult big =
      cg.run_expertd({"--model", "m=" + big_model, "--socket", dir.path() + "/a.sock", "--cache",
                      "240MiB", "--staging", "4MiB", "--queue-depth", "8", "--no-mlock"});
  EXPECT_NE(big.status, 0);
  const std::string refused = big.out + big.err;
  EXPECT_NE(refused.find("the arena (cache 240.00 MiB + staging 4.00 MiB as the models use them: "),
            std::string::npos)
      << refused;
  EXPECT_NE(refused.find(") leaves less than 64.00 MiB for expertd itself under the memory "
                         "cgroup's limit 256.00 MiB (" +
                         cg.limit_path() + ")"),
            std::string::npos)
      << refused;
  // The same cache for a 4 MB model is a 4 MB arena: no reason to refuse it.
  const expertd::test::RunResult small =
      cg.run_expertd({"--model", "m=" + model, "--socket", dir.path() + "/c.sock", "--cache",
                      "240MiB", "--staging", "4MiB", "--queue-depth", "8", "--no-mlock"});
  EXPECT_NE((small.out + small.err).find("expertd ready"), std::string::npos)
      << small.out << small.err;
  // The default cache, 25%: of the 256 MiB limit, not of the machine. Stopped by timeout's SIGTERM.
  const expertd::test::RunResult fits =
      cg.run_expertd({"--model", "m=" + model, "--socket", dir.path() + "/b.sock", "--staging",
                      "4MiB", "--queue-depth", "8", "--no-mlock", "--log-level", "info"});
  const std::string log = fits.out + fits.err;
  EXPECT_NE(log.find("memory: cache 25% and staging 4MiB are of the memory cgroup's limit 256.00 "
                     "MiB (" +
                     cg.limit_path() + ")"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("expertd ready"), std::string::npos) << log;
}

}  // namespace
