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
#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
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
#include "testing/paths.h"
#include "testing/process.h"
#include "testing/temp_dir.h"

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

// An expertd of our own (testing's DaemonProcess): forged model, temporary socket, stopped
// (SIGTERM) at the end.
class OwnDaemon {
 public:
  // Returns an empty string on success, else why not.
  std::string start() {
    for (const char* b : {"expertd", "expert-forge"}) {
      const std::string path = test::bin_path(b);
      if (::access(path.c_str(), X_OK) != 0) {
        return fmt::format("{} not found (build it, or pass --socket)", path);
      }
    }
    if (dir_.path().empty()) return fmt::format("mkdtemp: {}", std::strerror(errno));
    const auto model =
        test::forge_model(dir_.path(), "bench", "--layers 4 --experts 8 --embd 256 --ff 512");
    if (!model) return model.error().message;
    daemon_ = std::make_unique<test::DaemonProcess>(
        dir_.path(),
        std::vector<std::string>{"--model", "bench=" + *model, "--socket",
                                 dir_.file("expertd.sock"), "--cache", "64MiB", "--no-mlock"});
    const Status st = daemon_->start();
    return st ? "" : st.error().message;
  }

  // SIGTERM and the exit status.
  int stop() { return daemon_ ? daemon_->stop() : -1; }

  const std::string& socket() const { return daemon_->socket(); }
  const std::string& model() const { return model_name_; }

 private:
  test::TempDir dir_{"expert-bench-ipc"};
  std::unique_ptr<test::DaemonProcess> daemon_;
  std::string model_name_ = "bench";
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
