// Running the project's binaries as a user would: a command with its output captured, a model
// forged with expert-forge, and the real expertd as a child process on a temporary socket. No
// gtest here, so benchmarks link it too (expertd_testing_core).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

#include "expertd/result.h"

namespace expertd::test {

struct RunResult {
  int status = -1;  // the exit status; 128 + the signal when killed; -1 when it did not start
  std::string out;  // everything it wrote to stdout
  std::string err;  // and to stderr
};

// Runs `argv` (argv[0] a path, or a name looked up in $PATH) to its end. `env` entries are
// NAME=VALUE, added to (or replacing those of) this process's environment for the child.
RunResult run_command(const std::vector<std::string>& argv,
                      const std::vector<std::string>& env = {});

// True when something accepts connections on the Unix socket `path`.
bool socket_listens(const std::string& path);

// Writes a model with expert-forge (the one next to this binary): DIR/NAME.gguf, from the
// forge's options in `args` (separated by spaces). Returns its path, or an error with what the
// forge said.
Result<std::string> forge_model(const std::string& dir, const std::string& name,
                                const std::string& args);

// The expertd binary as a child process. Its stdout and stderr go to DIR/expertd-N.log, N
// counting the starts.
class DaemonProcess {
 public:
  // `args` follow the binary; the socket is the one after "--socket", if any. `env` as for
  // run_command.
  DaemonProcess(std::string dir, std::vector<std::string> args, std::vector<std::string> env = {});
  ~DaemonProcess();  // SIGKILL, if it still runs
  DaemonProcess(const DaemonProcess&) = delete;
  DaemonProcess& operator=(const DaemonProcess&) = delete;

  // Starts it and returns at once.
  Status spawn();
  // Starts it and waits until its socket accepts connections. The error says why not and
  // carries its log (it exited, or the socket did not appear within `timeout`).
  Status start(std::chrono::milliseconds timeout = std::chrono::seconds(20));
  // Waits up to `timeout` for it to exit: the exit status (128 + signal), or -1 if it runs on.
  int wait_exit(std::chrono::milliseconds timeout);
  // SIGTERM, then the exit status; -1 when it had to be killed after `timeout`.
  int stop(std::chrono::milliseconds timeout = std::chrono::seconds(20));
  void kill9();

  // Runs another binary of the build instead of expertd, e.g. "expertd-test" (test hooks).
  void set_binary(std::string name) { binary_ = std::move(name); }

  const std::string& socket() const { return socket_; }
  pid_t pid() const { return pid_; }
  const std::string& log_path() const { return log_; }
  std::string log() const;

 private:
  std::string binary_ = "expertd";
  std::string dir_;
  std::vector<std::string> args_;
  std::vector<std::string> env_;
  std::string socket_;
  std::string log_;
  int starts_ = 0;
  pid_t pid_ = -1;
};

// The whole of a file; empty when it cannot be read.
std::string read_file(const std::string& path);

}  // namespace expertd::test
