// expert-chaos-client: one client of expertd that checks every byte it is given. It attaches to a
// model, acquires random experts of random layers (top-k at a time, optionally with prefetch hints
// and a cursor, optionally keeping the last batch held), compares each slice with the bytes of the
// GGUF file at the slice's offset (read with pread from the files the daemon passes, modelFiles),
// and releases. The chaos suite (tests/chaos/clients_test.cc) and scripts/soak.sh run it as a
// separate process so that it can be SIGKILLed anywhere.
//
// Output: "attached" on stdout once attached (the chaos test reads it to know where a kill
// landed), then at the end one JSON line: acquires, experts, bytes_verified, wrong_bytes, errors,
// reconnects, p50_us, p99_us, max_us, the first few errors. --latencies FILE appends every
// acquire's latency in µs (uint32, native order) for a caller that merges several clients. Exit
// status: 1 if any byte was wrong, 2 on bad options, else 0 (errors are counted, not fatal: the
// caller decides what it expected).
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "base/clock.h"
#include "expertd/client.h"

namespace {

using expertd::client::Client;
using expertd::client::Session;
using expertd::client::SlotView;

std::atomic<bool> g_stop{false};

void on_signal(int) { g_stop.store(true); }

struct Options {
  std::string socket = expertd::client::default_socket();
  std::string model;
  std::string name = "chaos";
  double seconds = 10;
  uint64_t iterations = 0;
  uint64_t seed = 1;
  uint32_t top_k = 0;
  bool prefetch = false;
  bool hold = false;
  bool reconnect = false;
  std::string latencies;
};

struct Tally {
  uint64_t acquires = 0;
  uint64_t experts = 0;
  uint64_t bytes_verified = 0;
  uint64_t wrong_bytes = 0;
  uint64_t errors = 0;
  uint64_t reconnects = 0;
  std::vector<uint32_t> latency_us;
  std::vector<std::string> first_errors;

  void error(const std::string& what) {
    ++errors;
    if (first_errors.size() < 5) first_errors.push_back(what);
  }
};

// One attachment: the client, its session and the model's files.
struct Attached {
  std::unique_ptr<Client> client;
  std::unique_ptr<Session> session;
  std::vector<expertd::client::ModelFile> files;
  std::vector<uint32_t> layers;  // the layers with routed experts
};

expertd::Result<Attached> attach(const Options& o) {
  Attached a;
  auto c = Client::connect(o.socket);
  if (!c) return c.take_error();
  a.client = std::move(*c);
  auto s = a.client->attach(o.model, o.name);
  if (!s) return s.take_error();
  a.session = std::move(*s);
  auto f = a.client->model_files(o.model);
  if (!f) return f.take_error();
  a.files = std::move(*f);
  const auto& layout = a.session->layout();
  for (uint32_t l = 0; l < layout.block_count; ++l) {
    if (layout.has_experts(l)) a.layers.push_back(l);
  }
  if (a.layers.empty()) return expertd::make_error(EINVAL, "the model has no routed experts");
  return a;
}

// Compares every slice of `v` with the file's bytes; counts the bytes that differ.
void verify(const Attached& a, const SlotView& v, std::vector<uint8_t>& buf, Tally& t) {
  for (uint32_t i = 0; i < v.slice_count; ++i) {
    const auto& s = v.slices[i];
    const uint64_t offset = s.info->offset + uint64_t{v.expert} * s.info->stride;
    if (s.info->shard >= a.files.size()) {
      t.error(fmt::format("slice in shard {} of {}", s.info->shard, a.files.size()));
      continue;
    }
    buf.resize(s.bytes);
    const ssize_t n =
        ::pread(a.files[s.info->shard].fd.get(), buf.data(), s.bytes, static_cast<off_t>(offset));
    if (n != static_cast<ssize_t>(s.bytes)) {
      t.error(fmt::format("pread {} at {}: {}", a.files[s.info->shard].name, offset,
                          n < 0 ? std::strerror(errno) : "short"));
      continue;
    }
    t.bytes_verified += s.bytes;
    if (std::memcmp(buf.data(), s.data, s.bytes) == 0) continue;
    uint64_t wrong = 0;
    for (uint64_t b = 0; b < s.bytes; ++b) wrong += buf[b] != s.data[b];
    t.wrong_bytes += wrong;
    t.error(fmt::format("layer {} expert {} slice {}: {} wrong bytes", v.layer, v.expert,
                        s.info->kind, wrong));
  }
}

uint32_t percentile(std::vector<uint32_t> v, double p) {
  if (v.empty()) return 0;
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())));
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(i), v.end());
  return v[i];
}

int run(const Options& o) {
  Tally t;
  std::mt19937_64 rng(o.seed);
  const uint64_t end_ns = expertd::monotonic_ns() + static_cast<uint64_t>(o.seconds * 1e9);
  auto time_left = [&] {
    return !g_stop.load() && expertd::monotonic_ns() < end_ns &&
           (o.iterations == 0 || t.acquires < o.iterations);
  };
  std::vector<uint8_t> buf;
  std::vector<SlotView> held;
  bool announced = false;
  while (time_left()) {
    auto a = attach(o);
    if (!a) {
      t.error(a.error().message);
      if (!o.reconnect) break;
      // The daemon restarts: try again shortly, until the time is up.
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      ++t.reconnects;
      continue;
    }
    if (!announced) {
      std::puts("attached");
      std::fflush(stdout);
      announced = true;
    }
    const auto& layout = a->session->layout();
    const uint32_t k =
        std::max(1u, std::min(o.top_k ? o.top_k : layout.top_k, layout.expert_count));
    std::vector<uint32_t> all(layout.expert_count);
    for (uint32_t e = 0; e < layout.expert_count; ++e) all[e] = e;
    uint32_t token = 0;
    bool broken = false;
    while (!broken && time_left()) {
      const uint32_t layer = a->layers[rng() % a->layers.size()];
      std::shuffle(all.begin(), all.end(), rng);
      std::vector<uint32_t> experts(all.begin(), all.begin() + k);
      if (o.prefetch) {
        const uint32_t next = a->layers[(layer + 1) % a->layers.size()];
        std::vector<expertd::client::PrefetchHint> hints;
        for (uint32_t i = 0; i < k; ++i) {
          hints.push_back({next, static_cast<uint32_t>(rng() % layout.expert_count), 0.5f});
        }
        if (auto s = a->session->set_cursor(token++, layer); !s) t.error(s.error().message);
        if (auto s = a->session->prefetch(hints); !s) t.error(s.error().message);
      }
      const uint64_t t0 = expertd::monotonic_ns();
      auto views = a->session->acquire(layer, experts);
      const uint64_t us = (expertd::monotonic_ns() - t0) / 1000;
      if (!views) {
        t.error(views.error().message);
        // A closed session or a daemon gone: attach again (or stop).
        broken = views.error().message.find("went away") != std::string::npos ||
                 views.error().message.find("closed session") != std::string::npos;
        continue;
      }
      ++t.acquires;
      t.experts += views->size();
      if (t.latency_us.size() < (1u << 24)) {
        t.latency_us.push_back(static_cast<uint32_t>(std::min<uint64_t>(us, UINT32_MAX)));
      }
      for (const auto& v : *views) verify(*a, v, buf, t);
      if (!held.empty()) {
        if (auto s = a->session->release(held); !s) t.error(s.error().message);
        held.clear();
      }
      if (o.hold && rng() % 2 == 0) {
        held = std::move(*views);  // kept until the next acquire: a kill may find it held
      } else if (auto s = a->session->release(*views); !s) {
        t.error(s.error().message);
      }
    }
    held.clear();  // the session goes with `a`: the daemon releases what it still holds
    if (!broken || !o.reconnect) break;
    ++t.reconnects;
  }
  if (!o.latencies.empty()) {
    if (FILE* f = std::fopen(o.latencies.c_str(), "ab")) {
      std::fwrite(t.latency_us.data(), sizeof(uint32_t), t.latency_us.size(), f);
      std::fclose(f);
    }
  }
  nlohmann::ordered_json j;
  j["name"] = o.name;
  j["acquires"] = t.acquires;
  j["experts"] = t.experts;
  j["bytes_verified"] = t.bytes_verified;
  j["wrong_bytes"] = t.wrong_bytes;
  j["errors"] = t.errors;
  j["reconnects"] = t.reconnects;
  j["p50_us"] = percentile(t.latency_us, 0.50);
  j["p99_us"] = percentile(t.latency_us, 0.99);
  j["max_us"] =
      t.latency_us.empty() ? 0u : *std::max_element(t.latency_us.begin(), t.latency_us.end());
  j["first_errors"] = t.first_errors;
  std::puts(j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  std::fflush(stdout);
  return t.wrong_bytes ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"expert-chaos-client: acquire random experts and check every byte against the file"};
  app.set_version_flag("--version", std::string("expert-chaos-client ") + EXPERTD_VERSION);
  Options o;
  app.add_option("--socket", o.socket, "expertd's control socket (default $EXPERTD_SOCKET)");
  app.add_option("--model", o.model, "The model's name")->required();
  app.add_option("--name", o.name, "The client name the daemon shows");
  app.add_option("--seconds", o.seconds, "Run this long (default 10)");
  app.add_option("--iterations", o.iterations, "Stop after this many acquires (default: none)");
  app.add_option("--seed", o.seed, "Random seed");
  app.add_option("--top-k", o.top_k, "Experts per acquire (default: the model's top-k)");
  app.add_flag("--prefetch", o.prefetch, "Send a cursor and hints for the next layer");
  app.add_flag("--hold", o.hold, "Keep every other batch held until the next acquire");
  app.add_flag("--reconnect", o.reconnect, "Attach again when the daemon goes away (restarts)");
  app.add_option("--latencies", o.latencies, "Append every acquire's latency (uint32 µs) here");
  CLI11_PARSE(app, argc, argv);
  std::signal(SIGTERM, on_signal);
  std::signal(SIGINT, on_signal);
  return run(o);
}
