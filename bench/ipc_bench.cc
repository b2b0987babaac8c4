// `expert-bench ipc`: the round trip of the data plane against the control plane, on one daemon.
//
//  - shm: acquire + release of one already-cached expert through the session's shared-memory
//    rings (libexpertd-client's Session::acquire into a caller-provided view, then release), the
//    path an engine takes for every expert of every token;
//  - rpc: an empty Cap'n Proto call (Expertd.ping) on the same control socket, i.e. what every
//    acquire would cost if it went through RPC.
//
// Without --socket it starts its own expertd (the binary next to expert-bench) on a small model
// it forges with expert-forge in a temporary directory, and stops it (SIGTERM) at the end. The
// two methods are measured in alternating rounds so that drift (frequency scaling, a noisy
// neighbour) falls on both alike. Reports p50/p99 in microseconds and rpc p50 / shm p50.
#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "base/fd.h"
#include "bench/bench_util.h"
#include "bench/commands.h"
#include "expertd/client.h"

extern char** environ;

namespace expertd::bench {
namespace {

using Json = nlohmann::ordered_json;
using client::Client;
using client::Session;
using client::SlotView;

struct IpcFlags {
  std::string socket;
  std::string model;
  bool json = false;
  uint32_t iterations = 100'000;
  uint32_t rounds = 10;
  uint32_t spin_us = 50;
};

uint64_t now_ns() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

std::string dir_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

bool socket_listens(const std::string& path) {
  const UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return false;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
  return ::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
}

int spawn_wait(const std::vector<std::string>& argv, const std::string& log) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  posix_spawn_file_actions_addopen(&fa, 2, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  pid_t pid = 0;
  const int r = posix_spawn(&pid, args[0], &fa, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (r != 0) return -1;
  int st = 0;
  ::waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

// An expertd of our own: forged model, temporary socket, stopped (SIGTERM) on destruction.
class OwnDaemon {
 public:
  ~OwnDaemon() {
    if (pid_ > 0) {
      ::kill(pid_, SIGTERM);
      int st = 0;
      ::waitpid(pid_, &st, 0);
    }
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  // Returns an empty string on success, else why not.
  std::string start() {
    char self[4096];
    const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n <= 0) return "cannot find my own binary (/proc/self/exe)";
    self[n] = 0;
    const std::string bin = dir_of(self);
    const std::string expertd = bin + "/expertd";
    const std::string forge = bin + "/expert-forge";
    for (const auto& b : {expertd, forge}) {
      if (::access(b.c_str(), X_OK) != 0) {
        return fmt::format("{} not found (build it, or pass --socket)", b);
      }
    }
    char tmpl[] = "/tmp/expert-bench-ipc-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) return fmt::format("mkdtemp: {}", std::strerror(errno));
    dir_ = tmpl;
    socket_ = dir_ + "/expertd.sock";
    log_ = dir_ + "/expertd.log";
    const std::string model = dir_ + "/bench.gguf";
    if (spawn_wait(
            {forge, "--layers", "4", "--experts", "8", "--embd", "256", "--ff", "512", "-o", model},
            log_) != 0) {
      return "expert-forge failed: " + slurp();
    }
    std::vector<std::string> argv{expertd, "--model", "bench=" + model, "--socket",
                                  socket_, "--cache", "64MiB",          "--no-mlock"};
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 2, log_.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    const int r = posix_spawn(&pid_, args[0], &fa, nullptr, args.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    if (r != 0) return fmt::format("posix_spawn {}: {}", expertd, std::strerror(r));
    for (int i = 0; i < 2000; ++i) {
      if (socket_listens(socket_)) return "";
      int st = 0;
      if (::waitpid(pid_, &st, WNOHANG) == pid_) {
        pid_ = -1;
        return "expertd exited at start:\n" + slurp();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return "expertd's socket did not appear in 20 s:\n" + slurp();
  }

  // SIGTERM and the exit status.
  int stop() {
    if (pid_ <= 0) return -1;
    ::kill(pid_, SIGTERM);
    int st = 0;
    ::waitpid(pid_, &st, 0);
    pid_ = -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  }

  const std::string& socket() const { return socket_; }
  const std::string& model() const { return model_name_; }

 private:
  std::string slurp() const {
    std::string s;
    if (FILE* f = std::fopen(log_.c_str(), "r")) {
      char buf[4096];
      size_t n = 0;
      while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) s.append(buf, n);
      std::fclose(f);
    }
    return s;
  }

  std::string dir_;
  std::string socket_;
  std::string log_;
  std::string model_name_ = "bench";
  pid_t pid_ = -1;
};

struct Latencies {
  std::vector<uint64_t> shm_ns;
  std::vector<uint64_t> rpc_ns;
};

// Alternating rounds of each method; the first round of each is a warm-up and not kept.
std::string measure(Client& c, Session& s, uint32_t layer, const IpcFlags& f, Latencies& out) {
  const uint32_t expert = 0;
  std::array<SlotView, 1> view{};
  // Load it once: every later acquire is a hit.
  if (auto st = s.acquire(layer, {&expert, 1}, view); !st) return st.error().message;
  if (auto st = s.release(view[0].slot); !st) return st.error().message;

  const uint32_t per_round = std::max<uint32_t>(1, f.iterations / f.rounds);
  out.shm_ns.reserve(uint64_t{per_round} * f.rounds);
  out.rpc_ns.reserve(uint64_t{per_round} * f.rounds / 10 + 1);
  for (uint32_t round = 0; round <= f.rounds; ++round) {
    const bool keep = round > 0;
    for (uint32_t i = 0; i < per_round; ++i) {
      const uint64_t t0 = now_ns();
      if (auto st = s.acquire(layer, {&expert, 1}, view); !st) return st.error().message;
      if (auto st = s.release(view[0].slot); !st) return st.error().message;
      const uint64_t t1 = now_ns();
      if (keep) out.shm_ns.push_back(t1 - t0);
    }
    // RPC round trips are ~10-100x slower: a tenth as many keeps the rounds similar in length.
    for (uint32_t i = 0; i < per_round / 10 + 1; ++i) {
      const uint64_t t0 = now_ns();
      if (auto st = c.ping(); !st) return st.error().message;
      const uint64_t t1 = now_ns();
      if (keep) out.rpc_ns.push_back(t1 - t0);
    }
  }
  return "";
}

double us(uint64_t ns) { return static_cast<double>(ns) / 1000.0; }

int run_ipc(const IpcFlags& f) {
  OwnDaemon own;
  std::string socket = f.socket;
  std::string model = f.model;
  if (socket.empty()) {
    const std::string err = own.start();
    if (!err.empty()) {
      std::fprintf(stderr, "expert-bench ipc: %s\n", err.c_str());
      return 1;
    }
    socket = own.socket();
    model = own.model();
  }
  auto c = Client::connect(socket);
  if (!c) {
    std::fprintf(stderr, "expert-bench ipc: %s\n", c.error().message.c_str());
    return 1;
  }
  if (model.empty()) {
    auto info = (*c)->info();
    if (!info || info->models.empty()) {
      std::fprintf(stderr, "expert-bench ipc: the daemon serves no model (pass --model)\n");
      return 1;
    }
    model = info->models.front();
  }
  auto s = (*c)->attach(model, "expert-bench ipc");
  if (!s) {
    std::fprintf(stderr, "expert-bench ipc: %s\n", s.error().message.c_str());
    return 1;
  }
  (*s)->set_spin_us(f.spin_us);
  uint32_t layer = 0;
  while (layer < (*s)->layout().block_count && !(*s)->layout().has_experts(layer)) ++layer;

  Latencies lat;
  if (const std::string err = measure(**c, **s, layer, f, lat); !err.empty()) {
    std::fprintf(stderr, "expert-bench ipc: %s\n", err.c_str());
    return 1;
  }
  s->reset();
  c->reset();
  int daemon_exit = 0;
  if (f.socket.empty()) daemon_exit = own.stop();

  const uint64_t shm50 = percentile(lat.shm_ns, 50);
  const uint64_t shm99 = percentile(lat.shm_ns, 99);
  const uint64_t rpc50 = percentile(lat.rpc_ns, 50);
  const uint64_t rpc99 = percentile(lat.rpc_ns, 99);
  const double speedup = shm50 ? static_cast<double>(rpc50) / static_cast<double>(shm50) : 0;
  const MachineInfo machine = describe_machine("/tmp");

  FILE* table = f.json ? stderr : stdout;
  fmt::print(table, "expert-bench ipc: {} on {} ({} CPUs, kernel {})\n", socket, machine.host,
             machine.cpus, machine.kernel);
  fmt::print(table, "{:<44} {:>10} {:>10} {:>10}\n", "round trip", "p50 us", "p99 us", "samples");
  fmt::print(table, "{:<44} {:>10.2f} {:>10.2f} {:>10}\n",
             "shm rings: acquire + release, cached expert", us(shm50), us(shm99),
             lat.shm_ns.size());
  fmt::print(table, "{:<44} {:>10.2f} {:>10.2f} {:>10}\n", "Cap'n Proto RPC: ping", us(rpc50),
             us(rpc99), lat.rpc_ns.size());
  fmt::print(table, "speedup (rpc p50 / shm p50): {:.1f}x  (goal: shm p50 <= 5 us, >= 10x)\n",
             speedup);
  if (f.json) {
    Json j;
    j["benchmark"] = "ipc";
    j["socket"] = socket;
    j["model"] = model;
    j["own_daemon"] = f.socket.empty();
    j["iterations"] = lat.shm_ns.size();
    j["rpc_iterations"] = lat.rpc_ns.size();
    j["spin_us"] = f.spin_us;
    j["shm_rtt_us_p50"] = us(shm50);
    j["shm_rtt_us_p99"] = us(shm99);
    j["rpc_rtt_us_p50"] = us(rpc50);
    j["rpc_rtt_us_p99"] = us(rpc99);
    j["speedup"] = speedup;
    j["machine"] = {{"host", machine.host},
                    {"date", machine.date},
                    {"cpus", machine.cpus},
                    {"ram_bytes", machine.ram_bytes},
                    {"kernel", machine.kernel}};
    std::puts(j.dump().c_str());
  }
  if (daemon_exit != 0) {
    std::fprintf(stderr, "expert-bench ipc: expertd exited with status %d\n", daemon_exit);
    return 1;
  }
  return 0;
}

}  // namespace

void add_ipc_command(CLI::App& app, int* exit_code) {
  auto flags = std::make_shared<IpcFlags>();
  CLI::App* cmd = app.add_subcommand(
      "ipc",
      "round trip of acquire+release of a cached expert over the shared-memory rings against a "
      "Cap'n Proto RPC round trip (ping) on the same daemon");
  cmd->add_option("--socket", flags->socket,
                  "a running expertd's socket (default: start one on a forged model)");
  cmd->add_option("--model", flags->model, "the model to attach to (default: the first served)");
  cmd->add_flag("--json", flags->json,
                "print one JSON object on stdout (the table goes to stderr)");
  cmd->add_option("--iterations", flags->iterations, "shm round trips measured")
      ->capture_default_str()
      ->check(CLI::Range(10u, 100'000'000u));
  cmd->add_option("--rounds", flags->rounds, "alternating rounds of the two methods")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1000u));
  cmd->add_option("--spin-us", flags->spin_us,
                  "microseconds the client spins for a completion before sleeping")
      ->capture_default_str();
  cmd->callback([flags, exit_code] { *exit_code = run_ipc(*flags); });
}

}  // namespace expertd::bench
