// Test support for the client and control-plane tests: a temporary directory, forged models, and
// the real expertd binary run as a child process on a temporary socket.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "base/fd.h"

extern char** environ;

namespace expertd::test {

inline uint64_t now_ms() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/expertd-client-XXXXXX";
    path_ = ::mkdtemp(tmpl);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Writes a forged model NAME.gguf in `dir` and returns its path.
inline std::string forge(const std::string& dir, const std::string& name, const std::string& args) {
  const std::string out = dir + "/" + name + ".gguf";
  const std::string cmd =
      std::string(EXPERT_FORGE_BIN) + " -o " + out + " --force " + args + " >/dev/null 2>&1";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  return out;
}

// True when something accepts connections on `path`.
inline bool socket_listens(const std::string& path) {
  const UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return false;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
  return ::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
}

// Runs `argv` and returns its exit status and everything it wrote to stdout (stderr goes to
// `err` when given).
struct RunResult {
  int status = -1;
  std::string out;
  std::string err;
};
inline RunResult run_command(const std::vector<std::string>& argv) {
  RunResult r;
  char out_tmpl[] = "/tmp/expertd-run-out-XXXXXX";
  char err_tmpl[] = "/tmp/expertd-run-err-XXXXXX";
  const UniqueFd out_fd(::mkstemp(out_tmpl));
  const UniqueFd err_fd(::mkstemp(err_tmpl));
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, out_fd.get(), 1);
  posix_spawn_file_actions_adddup2(&fa, err_fd.get(), 2);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  if (posix_spawn(&pid, args[0], &fa, nullptr, args.data(), environ) == 0) {
    int st = 0;
    ::waitpid(pid, &st, 0);
    r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  }
  posix_spawn_file_actions_destroy(&fa);
  auto slurp = [](const char* path) {
    std::ifstream f(path);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  };
  r.out = slurp(out_tmpl);
  r.err = slurp(err_tmpl);
  ::unlink(out_tmpl);
  ::unlink(err_tmpl);
  return r;
}

// The expertd binary as a child process. Its stderr goes to a log file in `dir`.
class Daemon {
 public:
  // `env` entries are NAME=VALUE added to this process's environment for the child.
  Daemon(const std::string& dir, std::vector<std::string> args, std::vector<std::string> env = {})
      : dir_(dir), args_(std::move(args)), env_(std::move(env)) {
    for (size_t i = 0; i + 1 < args_.size(); ++i) {
      if (args_[i] == "--socket") socket_ = args_[i + 1];
    }
    log_ = dir_ + "/expertd-" + std::to_string(++starts_) + ".log";
  }
  ~Daemon() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  const std::string& socket() const { return socket_; }
  pid_t pid() const { return pid_; }

  // Starts expertd and waits (up to 20 s) until its socket accepts connections.
  ::testing::AssertionResult start() {
    log_ = dir_ + "/expertd-" + std::to_string(++starts_) + ".log";
    const UniqueFd log_fd(::open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    std::vector<std::string> argv{EXPERTD_BIN};
    argv.insert(argv.end(), args_.begin(), args_.end());
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    std::vector<std::string> env_strings;
    for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
    for (const auto& e : env_) env_strings.push_back(e);
    std::vector<char*> envp;
    for (auto& e : env_strings) envp.push_back(e.data());
    envp.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, log_fd.get(), 2);
    const int r = posix_spawn(&pid_, args[0], &fa, nullptr, args.data(), envp.data());
    posix_spawn_file_actions_destroy(&fa);
    if (r != 0) return ::testing::AssertionFailure() << "posix_spawn expertd: " << strerror(r);
    const uint64_t deadline = now_ms() + 20'000;
    while (now_ms() < deadline) {
      if (socket_listens(socket_)) return ::testing::AssertionSuccess();
      int st = 0;
      if (::waitpid(pid_, &st, WNOHANG) == pid_) {
        pid_ = -1;
        return ::testing::AssertionFailure() << "expertd exited at start:\n" << log();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return ::testing::AssertionFailure() << "expertd's socket did not appear:\n" << log();
  }

  // SIGTERM, then the exit status (-1 when it had to be killed after 20 s).
  int stop() {
    if (pid_ <= 0) return -1;
    ::kill(pid_, SIGTERM);
    const uint64_t deadline = now_ms() + 20'000;
    int st = 0;
    while (now_ms() < deadline) {
      if (::waitpid(pid_, &st, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
    return -1;
  }

  void kill9() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  std::string log() const {
    std::ifstream f(log_);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }

 private:
  std::string dir_;
  std::vector<std::string> args_;
  std::vector<std::string> env_;
  std::string socket_;
  std::string log_;
  int starts_ = 0;
  pid_t pid_ = -1;
};

}  // namespace expertd::test
