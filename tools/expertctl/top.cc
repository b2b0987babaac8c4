// `expertctl top`: a live view of a running expertd, redrawn in place every second: hit rate,
// read bandwidth, queue depth and reads in flight, prefetch usefulness, sessions, and per model a
// heat strip of every layer's hit rate. `q` (or Ctrl-C) quits; the terminal is put in raw mode
// while it runs and restored on every way out. `--once` prints a single frame (cumulative numbers)
// and exits; `--json` prints each frame's numbers as one JSON line instead.
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tools/expertctl/commands.h"
#include "tools/expertctl/daemon_util.h"

namespace expertctl {
namespace {

using expertd::client::Stats;
using json = nlohmann::ordered_json;

// Set by SIGINT/SIGTERM/SIGHUP; the refresh loop polls it (a handler can only talk through a
// lock-free global).
std::atomic<bool> g_quit{false};
static_assert(std::atomic<bool>::is_always_lock_free);
extern "C" void on_quit_signal(int) { g_quit.store(true, std::memory_order_relaxed); }

// Raw keyboard input (no line buffering, no echo) for as long as it lives. Signals still work.
class RawTerminal {
 public:
  RawTerminal() {
    if (::isatty(STDIN_FILENO) != 1 || ::tcgetattr(STDIN_FILENO, &saved_) != 0) return;
    termios raw = saved_;
    raw.c_lflag &= ~static_cast<tcflag_t>(ICANON | ECHO);
    raw.c_cc[VMIN] = 0;
    raw.c_cc[VTIME] = 0;
    active_ = ::tcsetattr(STDIN_FILENO, TCSAFLUSH, &raw) == 0;
  }
  ~RawTerminal() {
    if (active_) ::tcsetattr(STDIN_FILENO, TCSAFLUSH, &saved_);
  }
  RawTerminal(const RawTerminal&) = delete;
  RawTerminal& operator=(const RawTerminal&) = delete;
  bool active() const { return active_; }

 private:
  termios saved_{};
  bool active_ = false;
};

// The alternate screen with the cursor hidden, for as long as it lives.
class Screen {
 public:
  explicit Screen(bool enable) : enabled_(enable) {
    if (enabled_) std::fputs("\x1b[?1049h\x1b[?25l", stdout);
  }
  ~Screen() {
    if (enabled_) std::fputs("\x1b[?25h\x1b[?1049l", stdout);
    std::fflush(stdout);
  }
  Screen(const Screen&) = delete;
  Screen& operator=(const Screen&) = delete;

 private:
  bool enabled_;
};

struct TopOptions {
  DaemonOptions daemon;
  bool once = false;
  double interval_s = 1.0;
  bool no_color = false;
};

// Eight heights, 0% to 100% hit rate; '·' for a layer without acquires.
constexpr const char* kLevels[] = {"▁", "▂", "▃", "▄", "▅", "▆", "▇", "█"};
constexpr const char* kNoData = "·";

std::string heat_cell(double rate, bool color) {
  if (rate < 0) return kNoData;
  const int level = std::clamp(static_cast<int>(std::floor(rate * 8.0)), 0, 7);
  if (!color) return kLevels[level];
  const char* c = rate >= 0.9 ? "\x1b[32m" : rate >= 0.5 ? "\x1b[33m" : "\x1b[31m";
  return fmt::format("{}{}\x1b[0m", c, kLevels[level]);
}

uint64_t delta(uint64_t now, uint64_t before) { return now >= before ? now - before : now; }

const expertd::client::ModelStats* find_model(const Stats* s, const std::string& name) {
  if (s == nullptr) return nullptr;
  for (const auto& m : s->models) {
    if (m.name == name) return &m;
  }
  return nullptr;
}

// Per layer hit rate over the interval when the layer had acquires in it, else since start.
std::vector<double> layer_rates(const expertd::client::ModelStats& m,
                                const expertd::client::ModelStats* prev) {
  std::vector<double> rates(m.layer_hits.size(), -1.0);
  for (size_t l = 0; l < m.layer_hits.size(); ++l) {
    const uint64_t hits = m.layer_hits[l];
    const uint64_t misses = l < m.layer_misses.size() ? m.layer_misses[l] : 0;
    rates[l] = hit_rate(hits, misses);
    if (prev != nullptr && l < prev->layer_hits.size() && l < prev->layer_misses.size()) {
      const uint64_t dh = delta(hits, prev->layer_hits[l]);
      const uint64_t dm = delta(misses, prev->layer_misses[l]);
      if (dh + dm > 0) rates[l] = hit_rate(dh, dm);
    }
  }
  return rates;
}

// The scheduler's counters summed over the models, and what top shows besides.
struct Totals : expertd::client::SchedulerStats {
  uint32_t reads_in_flight = 0;
  std::vector<expertd::client::PrefetchDepthStats> depths;  // summed over the models
};

Totals totals(const Stats& s) {
  Totals t;
  for (const auto& m : s.models) {
    static_cast<expertd::client::SchedulerStats&>(t) += m.scheduler;
    t.reads_in_flight += m.reads_in_flight;
    if (t.depths.size() < m.prefetch_depths.size()) t.depths.resize(m.prefetch_depths.size());
    for (size_t i = 0; i < m.prefetch_depths.size(); ++i) {
      t.depths[i].depth = m.prefetch_depths[i].depth;
      t.depths[i] += m.prefetch_depths[i];
    }
  }
  return t;
}

// Prefetch loads evicted, cancelled or dropped unacquired. An older daemon without the telemetry by
// depth: every load not (yet) acquired.
uint64_t wasted_loads(const Totals& t) {
  if (t.depths.empty()) return t.prefetch_loads - std::min(t.prefetch_useful, t.prefetch_loads);
  uint64_t n = 0;
  for (const auto& d : t.depths) n += d.wasted;
  return n;
}

// The prefetch telemetry of the frame: over the interval when there is one, else since start;
// with the acquires its recall is relative to.
struct DepthWindow {
  std::vector<expertd::client::PrefetchDepthStats> depths;
  uint64_t acquires = 0;
};

DepthWindow depth_window(const Stats& cur, const Stats* prev) {
  const Totals t = totals(cur);
  DepthWindow w{t.depths, t.acquires};
  if (prev == nullptr) return w;
  const Totals p = totals(*prev);
  if (p.acquires > t.acquires || p.depths.size() != t.depths.size()) return w;  // a restart
  w.acquires = t.acquires - p.acquires;
  for (size_t i = 0; i < w.depths.size(); ++i) w.depths[i] -= p.depths[i];
  return w;
}

// The numbers of one frame: over the last interval when there is one, else since the start.
struct Rates {
  double hit_rate = -1;  // interval
  double hit_rate_total = -1;
  double acquires_per_s = 0;
  double read_gb_per_s = 0;
  bool interval = false;
};

Rates rates(const Stats& cur, const Stats* prev, double dt_s) {
  Rates r;
  const Totals t = totals(cur);
  r.hit_rate_total = hit_rate(t.hits, t.acquires - t.hits);
  if (prev != nullptr && dt_s > 0) {
    const Totals p = totals(*prev);
    const uint64_t da = delta(t.acquires, p.acquires);
    const uint64_t dh = delta(t.hits, p.hits);
    r.hit_rate = hit_rate(dh, da - std::min(dh, da));
    r.acquires_per_s = static_cast<double>(da) / dt_s;
    r.read_gb_per_s = static_cast<double>(delta(cur.bytes_read, prev->bytes_read)) / dt_s / 1e9;
    r.interval = true;
  } else {
    const double up_s = static_cast<double>(cur.uptime_ms) / 1000.0;
    r.hit_rate = r.hit_rate_total;
    r.acquires_per_s = up_s > 0 ? static_cast<double>(t.acquires) / up_s : 0;
    r.read_gb_per_s = up_s > 0 ? static_cast<double>(cur.bytes_read) / up_s / 1e9 : 0;
  }
  return r;
}

std::string pct(double rate) {
  return rate < 0 ? std::string("   -  ") : fmt::format("{:5.1f}%", 100.0 * rate);
}

std::vector<std::string> render(const Stats& cur, const Stats* prev, double dt_s,
                                const TopOptions& o, bool color, int width) {
  std::vector<std::string> lines;
  const Rates r = rates(cur, prev, dt_s);
  const Totals t = totals(cur);
  const char* span = r.interval ? "/s" : "/s avg";
  lines.push_back(fmt::format("expertd at {} | {} | up {} | {} sessions{}", o.daemon.socket,
                              cur.backend, human_duration_ms(cur.uptime_ms), cur.sessions.size(),
                              o.once ? "" : "   (q quits)"));
  const std::string hit =
      r.interval ? fmt::format("{} now  {} total", pct(r.hit_rate), pct(r.hit_rate_total))
                 : fmt::format("{} since start", pct(r.hit_rate_total));
  lines.push_back(fmt::format("hit rate  {}   acquires {:.0f}{}", hit, r.acquires_per_s, span));
  lines.push_back(fmt::format(
      "read      {:.2f} GB{}   total {}   queue depth {}   reads in "
      "flight {}",
      r.read_gb_per_s, span, human_bytes(cur.bytes_read), cur.queue_depth, t.reads_in_flight));
  const uint64_t wasted = wasted_loads(t);
  lines.push_back(fmt::format(
      "prefetch  depth {}   hints {}   loads {}   useful {} ({})   "
      "wasted {}   dropped {}   cancelled {}",
      prefetch_depth_text(cur), t.prefetch_hints, t.prefetch_loads, t.prefetch_useful,
      pct(t.prefetch_loads
              ? static_cast<double>(t.prefetch_useful) / static_cast<double>(t.prefetch_loads)
              : -1.0),
      wasted, t.prefetch_dropped, t.prefetch_cancelled));
  const DepthWindow w = depth_window(cur, prev);
  for (const auto& line : depths_table(w.depths, w.acquires, 10)) lines.push_back(line);
  lines.push_back("");
  const size_t per_row = static_cast<size_t>(std::clamp(width - 12, 16, 128));
  for (const auto& m : cur.models) {
    lines.push_back(
        fmt::format("model {}: {} / {} cache slots ready ({} each), {} staging, "
                    "policy {}",
                    m.name, m.cache_ready, m.cache_slots, human_bytes(m.slot_bytes),
                    m.staging_slots, cur.policy));
    const auto heat = layer_rates(m, find_model(prev, m.name));
    for (size_t first = 0; first < heat.size(); first += per_row) {
      std::string row = fmt::format("  L{:<4}  ", first);
      for (size_t l = first; l < std::min(heat.size(), first + per_row); ++l) {
        row += heat_cell(heat[l], color);
      }
      lines.push_back(row);
    }
  }
  lines.push_back(fmt::format("  heat: per layer hit rate, {} 0% .. {} 100%, {} no acquires",
                              kLevels[0], kLevels[7], kNoData));
  if (!cur.sessions.empty()) {
    lines.push_back("");
    lines.push_back("session  client               pid       model         acquires    holds");
    for (const auto& s : cur.sessions) {
      lines.push_back(fmt::format("{:>7}  {:<20} {:<9} {:<12} {:>9} {:>8}", s.session,
                                  s.client.substr(0, 20), s.pid, s.model, s.acquires, s.holds));
    }
  }
  return lines;
}

json frame_json(const Stats& cur, const Stats* prev, double dt_s) {
  const Rates r = rates(cur, prev, dt_s);
  const Totals t = totals(cur);
  json j;
  j["interval"] = r.interval;
  j["hit_rate"] = r.hit_rate < 0 ? json(nullptr) : json(r.hit_rate);
  j["hit_rate_total"] = r.hit_rate_total < 0 ? json(nullptr) : json(r.hit_rate_total);
  j["acquires_per_s"] = r.acquires_per_s;
  j["read_gb_per_s"] = r.read_gb_per_s;
  j["queue_depth"] = cur.queue_depth;
  j["reads_in_flight"] = t.reads_in_flight;
  j["prefetch_useful"] = t.prefetch_useful;
  j["prefetch_wasted"] = wasted_loads(t);
  const DepthWindow w = depth_window(cur, prev);
  j["prefetch_depths"] = depths_json(w.depths, w.acquires);
  json models = json::array();
  for (const auto& m : cur.models) {
    json heat = json::array();
    for (const double x : layer_rates(m, find_model(prev, m.name))) {
      heat.push_back(x < 0 ? json(nullptr) : json(x));
    }
    models.push_back(json{{"name", m.name}, {"layer_hit_rate", heat}});
  }
  j["models"] = std::move(models);
  return j;
}

int terminal_width() {
  winsize ws{};
  if (::ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
  return 100;
}

// Waits up to `ms` for a key; true when the user asked to quit.
bool wait_for_quit(int ms, bool keyboard) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (!g_quit.load(std::memory_order_relaxed)) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                          until - std::chrono::steady_clock::now())
                          .count();
    if (left <= 0) return false;
    pollfd p{keyboard ? STDIN_FILENO : -1, POLLIN, 0};
    const int r = ::poll(&p, 1, static_cast<int>(left));
    if (r > 0 && (p.revents & POLLIN)) {
      char c = 0;
      if (::read(STDIN_FILENO, &c, 1) == 1 && (c == 'q' || c == 'Q' || c == 3 || c == 27)) {
        return true;
      }
    }
  }
  return true;
}

int run_top(const TopOptions& o) {
  auto c = connect(o.daemon, "top");
  if (!c) return 1;
  if (o.once) {
    auto st = c->stats();
    if (!st) return fail(o.daemon, "top", st.error().message);
    if (o.daemon.json) {
      print_json(frame_json(*st, nullptr, 0));
    } else {
      const bool color = !o.no_color && ::isatty(STDOUT_FILENO) == 1;
      for (const auto& line : render(*st, nullptr, 0, o, color, terminal_width())) {
        std::puts(line.c_str());
      }
    }
    return 0;
  }

  struct sigaction sa {};
  sa.sa_handler = on_quit_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: poll() returns at once
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGHUP, &sa, nullptr);

  const bool tty = ::isatty(STDOUT_FILENO) == 1 && !o.daemon.json;
  const bool color = tty && !o.no_color;
  RawTerminal raw;
  std::optional<Stats> prev;
  auto prev_time = std::chrono::steady_clock::now();
  std::string error;
  {
    Screen screen(tty);
    const int interval_ms = static_cast<int>(std::max(0.1, o.interval_s) * 1000.0);
    while (true) {
      auto st = c->stats();
      const auto now = std::chrono::steady_clock::now();
      if (!st) {
        error = st.error().message;
        break;
      }
      const double dt = std::chrono::duration<double>(now - prev_time).count();
      const Stats* before = prev ? &*prev : nullptr;
      if (o.daemon.json) {
        print_json(frame_json(*st, before, dt));
      } else {
        std::string out = tty ? "\x1b[H" : "";
        for (const auto& line : render(*st, before, dt, o, color, terminal_width())) {
          out += line;
          out += tty ? "\x1b[K\n" : "\n";
        }
        out += tty ? "\x1b[J" : "\n";
        std::fputs(out.c_str(), stdout);
        std::fflush(stdout);
      }
      prev = std::move(*st);
      prev_time = now;
      if (wait_for_quit(interval_ms, raw.active())) break;
    }
  }
  // Reported once the screen and the terminal are back to normal.
  return error.empty() ? 0 : fail(o.daemon, "top", error);
}

}  // namespace

void add_top_command(CLI::App& app, std::function<int()>* run) {
  auto opts = std::make_shared<TopOptions>();
  CLI::App* cmd = app.add_subcommand(
      "top", "Live view: hit rate, GB/s read, queue depth, prefetch, per-layer heat (q quits)");
  add_daemon_options(cmd, opts->daemon);
  cmd->add_flag("--once", opts->once, "Print one frame (numbers since the start) and exit");
  cmd->add_option("--interval", opts->interval_s, "Seconds between refreshes (default 1)");
  cmd->add_flag("--no-color", opts->no_color, "No ANSI colours in the heat strip");
  cmd->callback([run, opts] { *run = [opts] { return run_top(*opts); }; });
}

}  // namespace expertctl
