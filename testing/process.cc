#include "testing/process.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "testing/paths.h"
#include "testing/wait.h"

extern char** environ;

namespace expertd::test {

namespace {

int status_of(int st) { return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st); }

// This process's environment with `extra` (NAME=VALUE) added or replacing.
std::vector<std::string> merged_env(const std::vector<std::string>& extra) {
  std::vector<std::string> out;
  auto name_of = [](const std::string& e) { return e.substr(0, e.find('=')); };
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    bool replaced = false;
    for (const auto& x : extra) replaced = replaced || name_of(x) == name_of(entry);
    if (!replaced) out.push_back(entry);
  }
  out.insert(out.end(), extra.begin(), extra.end());
  return out;
}

std::vector<char*> c_strings(std::vector<std::string>& v) {
  std::vector<char*> out;
  for (auto& s : v) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

// Spawns `argv` with stdout and stderr on the given fds; 0 or an errno.
int spawn(std::vector<std::string> argv, const std::vector<std::string>& env, int out_fd,
          int err_fd, pid_t* pid) {
  std::vector<std::string> envs = merged_env(env);
  std::vector<char*> args = c_strings(argv);
  std::vector<char*> envp = c_strings(envs);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, out_fd, 1);
  posix_spawn_file_actions_adddup2(&fa, err_fd, 2);
  const bool search = argv[0].find('/') == std::string::npos;
  const int r = search ? posix_spawnp(pid, args[0], &fa, nullptr, args.data(), envp.data())
                       : posix_spawn(pid, args[0], &fa, nullptr, args.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  return r;
}

}  // namespace

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

RunResult run_command(const std::vector<std::string>& argv, const std::vector<std::string>& env) {
  RunResult r;
  if (argv.empty()) return r;
  char out_tmpl[] = "/tmp/expertd-run-out-XXXXXX";
  char err_tmpl[] = "/tmp/expertd-run-err-XXXXXX";
  const int out_fd = ::mkstemp(out_tmpl);
  const int err_fd = ::mkstemp(err_tmpl);
  if (out_fd >= 0 && err_fd >= 0) {
    pid_t pid = 0;
    const int e = spawn(argv, env, out_fd, err_fd, &pid);
    if (e == 0) {
      int st = 0;
      while (::waitpid(pid, &st, 0) < 0 && errno == EINTR) {
      }
      r.status = status_of(st);
    } else {
      r.err = fmt::format("cannot run {}: {}", argv[0], std::strerror(e));
    }
  }
  if (out_fd >= 0) ::close(out_fd);
  if (err_fd >= 0) ::close(err_fd);
  r.out = read_file(out_tmpl);
  if (r.status >= 0) r.err = read_file(err_tmpl);
  ::unlink(out_tmpl);
  ::unlink(err_tmpl);
  return r;
}

bool socket_listens(const std::string& path) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(fd);
  return ok;
}

Result<std::string> forge_model(const std::string& dir, const std::string& name,
                                const std::string& args) {
  const std::string out = dir + "/" + name + ".gguf";
  std::vector<std::string> argv{bin_path("expert-forge"), "-o", out, "--force"};
  std::istringstream words(args);
  for (std::string w; words >> w;) argv.push_back(w);
  const RunResult r = run_command(argv);
  if (r.status != 0) {
    std::string cmd;
    for (const auto& a : argv) cmd += (cmd.empty() ? "" : " ") + a;
    return make_error(EIO, fmt::format("{} exited with {}:\n{}{}", cmd, r.status, r.out, r.err));
  }
  return out;
}

DaemonProcess::DaemonProcess(std::string dir, std::vector<std::string> args,
                             std::vector<std::string> env)
    : dir_(std::move(dir)), args_(std::move(args)), env_(std::move(env)) {
  for (size_t i = 0; i + 1 < args_.size(); ++i) {
    if (args_[i] == "--socket") socket_ = args_[i + 1];
  }
  log_ = dir_ + "/expertd-1.log";
}

DaemonProcess::~DaemonProcess() { kill9(); }

Status DaemonProcess::spawn() {
  if (pid_ > 0) return make_error(EBUSY, "expertd is already running");
  log_ = fmt::format("{}/expertd-{}.log", dir_, ++starts_);
  const int log_fd = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (log_fd < 0) return make_error(errno, fmt::format("{}: {}", log_, std::strerror(errno)));
  std::vector<std::string> argv{bin_path(binary_)};
  argv.insert(argv.end(), args_.begin(), args_.end());
  const int r = test::spawn(argv, env_, log_fd, log_fd, &pid_);
  ::close(log_fd);
  if (r != 0) {
    pid_ = -1;
    return make_error(r, fmt::format("cannot run {}: {}", argv[0], std::strerror(r)));
  }
  return Ok{};
}

Status DaemonProcess::start(std::chrono::milliseconds timeout) {
  if (Status s = spawn(); !s) return s;
  int exited = -1;
  const bool up = wait_until(
      [&] {
        if (socket_listens(socket_)) return true;
        int st = 0;
        if (::waitpid(pid_, &st, WNOHANG) == pid_) {
          pid_ = -1;
          exited = status_of(st);
          return true;
        }
        return false;
      },
      timeout);
  if (exited >= 0) {
    return make_error(ECHILD, fmt::format("expertd exited ({}) at start:\n{}", exited, log()));
  }
  if (!up) {
    return make_error(ETIMEDOUT, fmt::format("expertd's socket {} did not appear in {} ms:\n{}",
                                             socket_, timeout.count(), log()));
  }
  return Ok{};
}

int DaemonProcess::wait_exit(std::chrono::milliseconds timeout) {
  if (pid_ <= 0) return -1;
  int status = -1;
  wait_until(
      [&] {
        int st = 0;
        if (::waitpid(pid_, &st, WNOHANG) != pid_) return false;
        pid_ = -1;
        status = status_of(st);
        return true;
      },
      timeout);
  return status;
}

int DaemonProcess::stop(std::chrono::milliseconds timeout) {
  if (pid_ <= 0) return -1;
  ::kill(pid_, SIGTERM);
  const int status = wait_exit(timeout);
  if (pid_ > 0) kill9();
  return status;
}

void DaemonProcess::kill9() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

std::string DaemonProcess::log() const { return read_file(log_); }

}  // namespace expertd::test
