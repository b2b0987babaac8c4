#include "tune/sweep.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <thread>

#include "base/clock.h"
#include "base/size.h"
#include "client/report.h"
#include "expertd/client.h"
#include "trace/trace.h"
#include "tune/plot.h"
#include "tune/replay.h"

namespace expertd::tune {

namespace {

using client::Client;
using client::ModelStats;
using client::PrefetchDepthStats;
using json = nlohmann::ordered_json;

struct Setting {
  uint32_t depth = 0;
  uint32_t queue_depth = 0;
  std::string cache;         // as given, or "" for the daemon's whole cache
  uint32_t cache_slots = 0;  // 0: the whole cache
  uint64_t cache_bytes = 0;  // what those slots hold
  size_t series = 0;         // (queue depth, cache) combination: one line in the plot
};

struct Point {
  Setting setting;
  uint32_t tokens = 0;
  double stall_ms_p50 = 0;
  double stall_ms_p99 = 0;
  double stall_ms_mean = 0;
  double tokens_per_s = 0;
  double hit_rate = 0;
  double bytes_per_token = 0;
  uint64_t useful_bytes = 0;
  uint64_t wasted_bytes = 0;
  double precision = -1;
  std::vector<PrefetchDepthStats> depths;  // the daemon's, over this setting
  uint64_t acquires = 0;
  std::vector<double> tokens_per_s_runs;  // every run's, in round order (--repeat)
  double compute_s_per_token = 0;
  double read_gbps = 0;  // bytes read / wall time: what the disk delivered at least
  double bound_tokens_per_s = 0;
  double bound_stall_ms = 0;
  // The admission rule's decisions over the setting, and (auto) the depth the daemon used.
  uint64_t prefetch_loads = 0;
  uint64_t prefetch_staged = 0;
  uint64_t prefetch_refused = 0;
  uint64_t prefetch_skipped = 0;
  uint32_t depth_end = 0;              // the depth in use when the replay ended
  uint32_t deepest_loaded = 0;         // the deepest depth any prefetch load came from
  std::vector<double> hint_precision;  // the daemon's estimate per depth at the end
};

struct Bandwidth {
  double gbps = 0;
  std::string source;
};

std::string depth_text(uint32_t depth) {
  return depth == kSweepAutoDepth ? std::string("auto") : std::to_string(depth);
}

std::string setting_label(const Setting& s, bool with_depth) {
  std::string out = with_depth ? fmt::format("depth {}, ", depth_text(s.depth)) : std::string();
  out += fmt::format("queue depth {}", s.queue_depth);
  out += s.cache.empty() ? std::string(", whole cache") : ", cache " + s.cache;
  return out;
}

// The progress line on stderr: rewritten in place on a terminal, one line per setting otherwise.
class Progress {
 public:
  Progress(size_t settings, uint32_t rounds)
      : tty_(::isatty(STDERR_FILENO) == 1), settings_(settings), rounds_(rounds) {}
  void start(size_t i, uint32_t round, const Setting& s) {
    index_ = i;
    label_ = setting_label(s, true);
    if (rounds_ > 1) label_ += fmt::format("; round {}/{}", round + 1, rounds_);
    last_ns_ = 0;
  }
  void token(uint32_t t, uint32_t total) {
    if (!tty_) return;
    const uint64_t now = monotonic_ns();
    if (t != total && now - last_ns_ < 100'000'000) return;
    last_ns_ = now;
    std::fprintf(stderr, "\r\x1b[Ksweep: setting %zu/%zu (%s): token %u/%u", index_ + 1, settings_,
                 label_.c_str(), t, total);
    std::fflush(stderr);
  }
  void finish(const Point& p) {
    std::fprintf(stderr,
                 "%ssweep: setting %zu/%zu (%s): token %u/%u, %.2f tokens/s, stall p50 %.2f ms\n",
                 tty_ ? "\r\x1b[K" : "", index_ + 1, settings_, label_.c_str(), p.tokens, p.tokens,
                 p.tokens_per_s, p.stall_ms_p50);
  }
  void note(const std::string& line) {
    std::fprintf(stderr, "%ssweep: %s\n", tty_ ? "\r\x1b[K" : "", line.c_str());
  }

 private:
  bool tty_;
  size_t settings_;
  uint32_t rounds_;
  size_t index_ = 0;
  std::string label_;
  uint64_t last_ns_ = 0;
};

Result<ModelStats> model_stats(Client& c, const std::string& model) {
  auto st = c.stats();
  if (!st) return st.take_error();
  for (auto& m : st->models) {
    if (m.name == model) return std::move(m);
  }
  return make_error(ENOENT, fmt::format("model '{}' is not served by this daemon", model));
}

// Waits until the model has no read in flight (cancelled prefetches return), then empties its
// cache: the next setting starts cold.
Status settle(Client& c, const std::string& model) {
  const uint64_t deadline = monotonic_ns() + 10'000'000'000ull;
  for (;;) {
    auto m = model_stats(c, model);
    if (!m) return m.take_error();
    if (m->reads_in_flight == 0) break;
    if (monotonic_ns() > deadline) {
      return make_error(ETIMEDOUT, fmt::format("model '{}' still has {} reads in flight after 10 s",
                                               model, m->reads_in_flight));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  auto n = c.evict_all(model);
  if (!n) return n.take_error();
  return Ok{};
}

// What the daemon reads per second with every slot and the whole queue depth busy: prefetch
// hints for distinct cold experts (about 1 GB of them, within 64 layers of the cursor), timed from
// the hints to the last byte.
Result<Bandwidth> measure_bandwidth(Client& c, const std::string& model,
                                    const TraceMapping& mapping, uint32_t queue_depth) {
  constexpr uint64_t kTargetBytes = 1'000'000'000;
  constexpr uint32_t kMaxHints = 1024;  // the daemon queues up to 2048
  constexpr uint32_t kMaxAhead = 64;    // the daemon's largest prefetch depth
  EXPERTD_TRY(c.set_prefetch_depth(kMaxAhead));
  EXPERTD_TRY(settle(c, model));
  ModelStats before;
  EXPERTD_TRY_ASSIGN(before, model_stats(c, model));
  auto session = c.attach(model, "expert-tune sweep (bandwidth)");
  if (!session) return session.take_error();
  const uint32_t first = mapping.key(0, 0).layer;
  std::vector<client::PrefetchHint> hints;
  for (uint32_t i = 1; i < mapping.moe_layers(); ++i) {
    const uint32_t layer = mapping.key(i, 0).layer;
    if (layer - first > kMaxAhead) break;
    for (uint32_t e = 0; e < mapping.experts(); ++e) {
      if (hints.size() >= kMaxHints || hints.size() * before.slot_bytes >= kTargetBytes) break;
      hints.push_back({layer, e, 1.0f});
    }
  }
  if (hints.empty()) return make_error(EINVAL, "the model has one MoE layer: nothing to prefetch");
  EXPERTD_TRY((*session)->set_cursor(0, first));
  const uint64_t t0 = monotonic_ns();
  EXPERTD_TRY((*session)->prefetch(hints));
  // Until every hinted expert is in, or nothing has arrived for 2 s (hints the daemon dropped).
  uint64_t t_last = t0;
  uint64_t bytes = 0;
  uint64_t loads = 0;
  while (loads < hints.size() && monotonic_ns() - t_last < 2'000'000'000ull) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    ModelStats now;
    EXPERTD_TRY_ASSIGN(now, model_stats(c, model));
    const uint64_t b = now.scheduler.bytes_read - before.scheduler.bytes_read;
    loads = now.scheduler.loads_done + now.scheduler.loads_failed - before.scheduler.loads_done -
            before.scheduler.loads_failed;
    if (b != bytes) {
      bytes = b;
      t_last = monotonic_ns();
    }
  }
  EXPERTD_TRY((*session)->detach());
  EXPERTD_TRY(settle(c, model));
  const double seconds = static_cast<double>(t_last - t0) / 1e9;
  if (seconds <= 0 || bytes == 0) return make_error(EIO, "the bandwidth probe read nothing");
  Bandwidth b;
  b.gbps = static_cast<double>(bytes) / seconds / 1e9;
  b.source = fmt::format(
      "measured first: {} cold experts, {:.0f} MB, prefetched by expertd in {:.2f} s at queue "
      "depth {}",
      loads, static_cast<double>(bytes) / 1e6, seconds, queue_depth);
  return b;
}

// Puts the daemon's tuning back as it found it (on every way out of the sweep).
class RestoreTuning {
 public:
  RestoreTuning(Client& c, std::string model, const client::Stats& st, const ModelStats& m)
      : c_(c),
        model_(std::move(model)),
        prefetch_depth_(st.prefetch_depth_auto ? client::kPrefetchDepthAuto : st.prefetch_depth),
        queue_depth_(st.queue_depth),
        cache_limit_(m.cache_limit >= m.cache_slots ? 0 : m.cache_limit) {}
  ~RestoreTuning() {
    (void)c_.set_prefetch_depth(prefetch_depth_);
    (void)c_.set_queue_depth(queue_depth_);
    (void)c_.set_cache_limit(model_, cache_limit_);
  }
  RestoreTuning(const RestoreTuning&) = delete;
  RestoreTuning& operator=(const RestoreTuning&) = delete;

 private:
  Client& c_;
  std::string model_;
  uint32_t prefetch_depth_;
  uint32_t queue_depth_;
  uint32_t cache_limit_;
};

Point summarize(const Setting& s, const ReplayResult& r, const ModelStats& before,
                const ModelStats& after, double compute_s_per_token) {
  Point p;
  p.setting = s;
  p.tokens = r.tokens;
  p.stall_ms_p50 = quantile(r.stall_ns, 0.5) / 1e6;
  p.stall_ms_p99 = quantile(r.stall_ns, 0.99) / 1e6;
  const uint64_t stall = std::accumulate(r.stall_ns.begin(), r.stall_ns.end(), uint64_t{0});
  p.stall_ms_mean = r.tokens ? static_cast<double>(stall) / 1e6 / r.tokens : 0;
  p.tokens_per_s = r.wall_ns ? r.tokens / (static_cast<double>(r.wall_ns) / 1e9) : 0;
  p.acquires = after.scheduler.acquires - before.scheduler.acquires;
  const uint64_t hits = after.scheduler.hits - before.scheduler.hits;
  p.hit_rate = p.acquires ? static_cast<double>(hits) / static_cast<double>(p.acquires) : 0;
  const uint64_t bytes = after.scheduler.bytes_read - before.scheduler.bytes_read;
  p.bytes_per_token = r.tokens ? static_cast<double>(bytes) / r.tokens : 0;
  p.depths = after.prefetch_depths;
  for (size_t i = 0; i < p.depths.size() && i < before.prefetch_depths.size(); ++i) {
    p.depths[i] -= before.prefetch_depths[i];
  }
  PrefetchDepthStats all;
  for (const auto& d : p.depths) all += d;
  p.useful_bytes = all.useful_bytes;
  p.wasted_bytes = all.wasted_bytes;
  p.precision = all.precision();
  p.compute_s_per_token = compute_s_per_token;
  p.read_gbps = r.wall_ns ? static_cast<double>(bytes) / static_cast<double>(r.wall_ns) : 0;
  p.prefetch_loads = after.scheduler.prefetch_loads - before.scheduler.prefetch_loads;
  p.prefetch_staged = after.scheduler.prefetch_staged - before.scheduler.prefetch_staged;
  p.prefetch_refused = after.scheduler.prefetch_refused - before.scheduler.prefetch_refused;
  p.prefetch_skipped = after.scheduler.prefetch_skipped - before.scheduler.prefetch_skipped;
  for (const auto& d : p.depths) {
    if (d.loads > 0) p.deepest_loaded = std::max(p.deepest_loaded, d.depth);
  }
  return p;
}

// At best the reads overlap the compute completely: a token takes the longer of the two.
void set_bound(Point& p, double disk_gbps) {
  const double read_s = p.bytes_per_token / (disk_gbps * 1e9);
  p.bound_tokens_per_s = 1.0 / std::max({read_s, p.compute_s_per_token, 1e-9});
  p.bound_stall_ms = std::max(0.0, read_s - p.compute_s_per_token) * 1e3;
}

json point_json(const Point& p, bool best) {
  const Setting& s = p.setting;
  json precision = json::array();
  for (const double x : p.hint_precision) precision.push_back(x);
  return json{{"depth", s.depth == kSweepAutoDepth ? json("auto") : json(s.depth)},
              {"depth_end", p.depth_end},
              {"deepest_loaded", p.deepest_loaded},
              {"hint_precision", std::move(precision)},
              {"prefetch_loads", p.prefetch_loads},
              {"prefetch_staged", p.prefetch_staged},
              {"prefetch_refused", p.prefetch_refused},
              {"prefetch_skipped", p.prefetch_skipped},
              {"queue_depth", s.queue_depth},
              {"cache", s.cache.empty() ? json(nullptr) : json(s.cache)},
              {"cache_slots", s.cache_slots},
              {"cache_bytes", s.cache_bytes},
              {"tokens", p.tokens},
              {"stall_ms_p50", p.stall_ms_p50},
              {"stall_ms_p99", p.stall_ms_p99},
              {"stall_ms_mean", p.stall_ms_mean},
              {"tokens_per_s", p.tokens_per_s},
              {"tokens_per_s_runs", p.tokens_per_s_runs},
              {"hit_rate", p.hit_rate},
              {"bytes_per_token", p.bytes_per_token},
              {"prefetch_useful_bytes", p.useful_bytes},
              {"prefetch_wasted_bytes", p.wasted_bytes},
              {"prefetch_precision", p.precision < 0 ? json(nullptr) : json(p.precision)},
              {"prefetch_depths", report::depths_json(p.depths, p.acquires)},
              {"bound_tokens_per_s", p.bound_tokens_per_s},
              {"bound_stall_ms", p.bound_stall_ms},
              {"best", best}};
}

// The lines that make the best setting stick: expertd flags, expertd.toml, and at runtime.
struct Apply {
  std::string flags;
  std::vector<std::string> toml;
  std::vector<std::string> expertctl;
};

Apply apply_lines(const Setting& s, const SweepOptions& o, size_t models) {
  Apply a;
  a.flags = fmt::format("--prefetch-depth {}", depth_text(s.depth));
  a.toml.push_back(s.depth == kSweepAutoDepth ? std::string("prefetch_depth = \"auto\"")
                                              : fmt::format("prefetch_depth = {}", s.depth));
  a.expertctl.push_back(fmt::format("expertctl set prefetch-depth {}", depth_text(s.depth)));
  if (!o.queue_depths.empty()) {
    a.flags += fmt::format(" --queue-depth {}", s.queue_depth);
    a.toml.push_back(fmt::format("queue_depth = {}", s.queue_depth));
    a.expertctl.push_back(fmt::format("expertctl set queue-depth {}", s.queue_depth));
  }
  if (!s.cache.empty()) {
    // expertd splits `cache` evenly among its models.
    const std::string total = models > 1 ? fmt::format("{}B", s.cache_bytes * models) : s.cache;
    a.flags += fmt::format(" --cache {}", total);
    a.toml.push_back(fmt::format("cache = \"{}\"", total));
    a.expertctl.push_back(fmt::format("expertctl set cache-limit {} --model {}", s.cache, o.model));
  }
  return a;
}

PlotSpec make_plot(const std::vector<Point>& points, size_t best, const SweepOptions& o,
                   const Bandwidth& bw, uint32_t tokens) {
  PlotSpec spec;
  spec.title = fmt::format("expert-tune sweep: model {}, trace {}", o.model,
                           std::filesystem::path(o.trace).filename().string());
  spec.subtitle = fmt::format(
      "predictor {}, compute {} \u00b5s/layer, {} tokens, disk {:.2f} GB/s; best: {} ({:.1f} "
      "tokens/s)",
      o.predictor, o.compute_us_per_layer, tokens, bw.gbps,
      setting_label(points[best].setting, true), points[best].tokens_per_s);
  spec.bound_label = fmt::format(
      "dashed: bandwidth bound (bytes read per token at {:.2f} GB/s, "
      "overlapped with compute)",
      bw.gbps);
  PlotPanel stall{
      "Stall per token (mean)", "prefetch depth (layers ahead)", "stall per token (ms)", {}, true};
  PlotPanel speed{"Tokens per second", "prefetch depth (layers ahead)", "tokens/s", {}, true};
  size_t series = 0;
  for (const Point& p : points) series = std::max(series, p.setting.series + 1);
  for (size_t i = 0; i < series; ++i) {
    PlotSeries a;
    PlotSeries b;
    for (const Point& p : points) {
      // auto has no place on the depth axis: the table and the JSON show it.
      if (p.setting.series != i || p.setting.depth == kSweepAutoDepth) continue;
      a.label = b.label = setting_label(p.setting, false);
      a.x.push_back(p.setting.depth);
      a.y.push_back(p.stall_ms_mean);
      a.bound.push_back(p.bound_stall_ms);
      b.x.push_back(p.setting.depth);
      b.y.push_back(p.tokens_per_s);
      b.bound.push_back(p.bound_tokens_per_s);
    }
    stall.series.push_back(std::move(a));
    speed.series.push_back(std::move(b));
  }
  spec.panels = {std::move(stall), std::move(speed)};
  return spec;
}

void print_table(const std::vector<Point>& points, size_t best) {
  fmt::print(
      "{:>1} {:>5} {:>5} {:>8} {:>10} {:>10} {:>10} {:>9} {:>8} {:>9} {:>9} {:>9} {:>9} {:>11} "
      "{:>6} {:>7} {:>7} {:>7} {:>7}\n",
      "", "depth", "queue", "cache", "stall p50", "stall p99", "stall mean", "tokens/s", "hit rate",
      "MB/token", "useful MB", "wasted MB", "precision", "bound tok/s", "chose", "loads", "staged",
      "refused", "skipped");
  for (size_t i = 0; i < points.size(); ++i) {
    const Point& p = points[i];
    const Setting& s = p.setting;
    fmt::print(
        "{:>1} {:>5} {:>5} {:>8} {:>7.2f} ms {:>7.2f} ms {:>7.2f} ms {:>9.2f} {:>7.1f}% {:>8.2f} "
        "{:>9.1f} {:>9.1f} {:>9} {:>11.2f} {:>6} {:>7} {:>7} {:>7} {:>7}\n",
        i == best ? "*" : "", depth_text(s.depth), s.queue_depth,
        s.cache.empty() ? "whole" : s.cache, p.stall_ms_p50, p.stall_ms_p99, p.stall_ms_mean,
        p.tokens_per_s, 100 * p.hit_rate, p.bytes_per_token / 1e6,
        static_cast<double>(p.useful_bytes) / 1e6, static_cast<double>(p.wasted_bytes) / 1e6,
        p.precision < 0 ? std::string("-") : fmt::format("{:.1f}%", 100 * p.precision),
        p.bound_tokens_per_s,
        s.depth == kSweepAutoDepth ? fmt::format("{}/{}", p.depth_end, p.deepest_loaded)
                                   : std::string("-"),
        p.prefetch_loads, p.prefetch_staged, p.prefetch_refused, p.prefetch_skipped);
  }
}

// One replay of the trace at one setting, from an empty cache; the daemon's counters around it.
Result<Point> run_setting(Client& c, const SweepOptions& o, const Setting& s,
                          const IndexedTrace& trace, const TraceMapping& mapping,
                          const Predictor& predictor, uint64_t compute_ns, Progress& progress,
                          uint32_t* layers_per_token) {
  for (const Status& st : {c.set_queue_depth(s.queue_depth), c.set_prefetch_depth(s.depth),
                           c.set_cache_limit(o.model, s.cache_slots), settle(c, o.model)}) {
    if (!st) return st.error();
  }
  ModelStats before;
  EXPERTD_TRY_ASSIGN(before, model_stats(c, o.model));
  auto session = c.attach(o.model, "expert-tune sweep");
  if (!session) return session.take_error();
  ReplayOptions ro;
  ro.depth = s.depth == kSweepAutoDepth ? kSweepAutoHintDepth : s.depth;
  ro.compute_ns_per_layer = compute_ns;
  ro.max_tokens = o.max_tokens;
  ro.predictor = &predictor;
  auto r = replay_trace(**session, trace, mapping, ro,
                        [&](uint32_t t, uint32_t total) { progress.token(t, total); });
  if (!r) return r.take_error();
  // What auto mode chose, before settle() resets the estimates with the cache.
  ModelStats end;
  EXPERTD_TRY_ASSIGN(end, model_stats(c, o.model));
  EXPERTD_TRY((*session)->detach());
  session->reset();
  // Prefetched experts nobody used count as wasted once the cache is emptied.
  EXPERTD_TRY(settle(c, o.model));
  ModelStats after;
  EXPERTD_TRY_ASSIGN(after, model_stats(c, o.model));
  *layers_per_token = r->tokens ? static_cast<uint32_t>(r->records / r->tokens) : 0;
  const double compute_s =
      static_cast<double>(compute_ns) * r->records / 1e9 / std::max<uint32_t>(r->tokens, 1);
  Point p = summarize(s, *r, before, after, compute_s);
  p.depth_end = end.prefetch_depth_now;
  p.hint_precision = end.hint_precision;
  return p;
}

int fail(const std::string& message, int status = 1) {
  std::fprintf(stderr, "expert-tune sweep: %s\n", message.c_str());
  return status;
}

}  // namespace

int run_sweep(const SweepOptions& o) {
  if (o.depths.empty()) return fail("--depths: give at least one depth (e.g. 0,1,2,3)", 2);
  for (const uint32_t d : o.depths) {
    if (d > 64 && d != kSweepAutoDepth) {
      return fail(fmt::format("--depths: {} is more than 64 layers ahead", d), 2);
    }
  }
  if (!(o.compute_us_per_layer >= 0) || o.compute_us_per_layer > 1e6) {
    return fail("--compute-us-per-layer: must be 0 to 1000000", 2);
  }
  // The trace and the predictor first: a bad file fails before anything touches the daemon.
  auto loaded = load_trace(o.trace);
  if (!loaded) return fail(loaded.error().message);
  const IndexedTrace trace(std::move(*loaded));
  auto predictor = make_predictor(o.predictor, trace, o.trace, o.seed);
  if (!predictor) return fail(predictor.error().message, 2);

  auto client = Client::connect(o.socket);
  if (!client) return fail(client.error().message);
  Client& c = **client;
  auto layout = c.open_model(o.model);
  if (!layout) return fail(layout.error().message);
  auto mapping = TraceMapping::make(*layout);
  if (!mapping) return fail(mapping.error().message);
  auto stats = c.stats();
  if (!stats) return fail(stats.error().message);
  auto model = model_stats(c, o.model);
  if (!model) return fail(model.error().message);
  const ModelStats initial = *model;

  // The settings: caches outermost (one empty cache each), then queue depths, then depths.
  std::vector<std::string> caches = o.caches;
  if (caches.empty()) caches.push_back("");
  std::vector<uint32_t> queue_depths = o.queue_depths;
  if (queue_depths.empty()) queue_depths.push_back(stats->queue_depth);
  std::vector<Setting> settings;
  size_t series = 0;
  for (const std::string& cache : caches) {
    uint32_t slots = 0;
    if (!cache.empty()) {
      const uint64_t whole = uint64_t{initial.cache_slots} * initial.slot_bytes;
      auto bytes = parse_size("--cache", cache, whole);
      if (!bytes) return fail(bytes.error().message, 2);
      const uint64_t n = initial.slot_bytes ? *bytes / initial.slot_bytes : 0;
      if (n == 0 || n > initial.cache_slots) {
        return fail(fmt::format("--cache {}: {} slots of {}; model '{}' has 1 to {} ({}): start "
                                "expertd with a larger --cache to sweep larger sizes",
                                cache, n, human_bytes(initial.slot_bytes), o.model,
                                initial.cache_slots, human_bytes(whole)),
                    2);
      }
      slots = static_cast<uint32_t>(n);
    }
    for (const uint32_t qd : queue_depths) {
      for (const uint32_t d : o.depths) {
        const uint32_t used = slots ? slots : initial.cache_slots;
        settings.push_back(
            Setting{d, qd, cache, slots, uint64_t{used} * initial.slot_bytes, series});
      }
      ++series;
    }
  }

  RestoreTuning restore(c, o.model, *stats, initial);
  Progress progress(settings.size(), std::max(o.repeat, 1u));
  const uint64_t compute_ns = static_cast<uint64_t>(o.compute_us_per_layer * 1000.0);
  Bandwidth bw;
  if (o.disk_gbps > 0) {
    bw = Bandwidth{o.disk_gbps, "given with --disk-gbps"};
  } else {
    const uint32_t qd = *std::max_element(queue_depths.begin(), queue_depths.end());
    if (auto st = c.set_queue_depth(qd); !st) return fail(st.error().message);
    if (auto st = c.set_cache_limit(o.model, 0); !st) return fail(st.error().message);
    progress.note("measuring the disk's bandwidth through expertd (about 1 GB of reads)");
    auto measured = measure_bandwidth(c, o.model, *mapping, qd);
    if (!measured) return fail("measuring the disk bandwidth: " + measured.error().message);
    bw = *measured;
  }

  // Rounds over all settings, so that a slow spell of the disk or the machine falls on different
  // settings each round; each setting reports its run with the median tokens/s.
  std::vector<std::vector<Point>> runs(settings.size());
  uint32_t layers_per_token = 0;
  for (uint32_t round = 0; round < std::max(o.repeat, 1u); ++round) {
    for (size_t i = 0; i < settings.size(); ++i) {
      progress.start(i, round, settings[i]);
      auto p = run_setting(c, o, settings[i], trace, *mapping, **predictor, compute_ns, progress,
                           &layers_per_token);
      if (!p) return fail(p.error().message);
      progress.finish(*p);
      runs[i].push_back(std::move(*p));
    }
  }
  std::vector<Point> points;
  for (auto& r : runs) {
    std::vector<Point> sorted = r;
    std::sort(sorted.begin(), sorted.end(),
              [](const Point& a, const Point& b) { return a.tokens_per_s < b.tokens_per_s; });
    points.push_back(sorted[sorted.size() / 2]);
    for (const Point& x : r) points.back().tokens_per_s_runs.push_back(x.tokens_per_s);
    // The fastest read of any run, for the bandwidth figure below.
    for (const Point& x : r)
      points.back().read_gbps = std::max(points.back().read_gbps, x.read_gbps);
  }
  // The probe can catch the disk in a slow moment (virtual disks vary from run to run): a setting
  // that read faster proves the disk can, and the bound takes the faster figure.
  if (o.disk_gbps <= 0) {
    size_t fastest = 0;
    for (size_t i = 1; i < points.size(); ++i) {
      if (points[i].read_gbps > points[fastest].read_gbps) fastest = i;
    }
    if (points[fastest].read_gbps > bw.gbps) {
      bw.source = fmt::format("the fastest read rate of the replays ({}); {} at {:.2f} GB/s",
                              setting_label(points[fastest].setting, true), bw.source, bw.gbps);
      bw.gbps = points[fastest].read_gbps;
    } else {
      bw.source += "; no replay read faster";
    }
  }
  for (Point& p : points) set_bound(p, bw.gbps);
  size_t best = 0;
  for (size_t i = 1; i < points.size(); ++i) {
    if (points[i].tokens_per_s > points[best].tokens_per_s) best = i;
  }
  const Apply apply = apply_lines(points[best].setting, o, stats->models.size());
  const uint32_t tokens = points.front().tokens;

  if (!o.plot.empty()) {
    if (auto st = write_svg(o.plot, make_plot(points, best, o, bw, tokens)); !st) {
      return fail(st.error().message);
    }
  }
  if (o.json) {
    json j;
    j["trace"] = o.trace;
    j["model"] = o.model;
    j["predictor"] = (*predictor)->name();
    j["seed"] = o.seed;
    j["repeat"] = std::max(o.repeat, 1u);
    j["compute_us_per_layer"] = o.compute_us_per_layer;
    j["tokens"] = tokens;
    j["layers_per_token"] = layers_per_token;
    j["policy"] = stats->policy;
    j["slot_bytes"] = initial.slot_bytes;
    j["disk_gbps"] = bw.gbps;
    j["disk_gbps_source"] = bw.source;
    json all = json::array();
    for (size_t i = 0; i < points.size(); ++i) all.push_back(point_json(points[i], i == best));
    j["settings"] = std::move(all);
    j["best"] = json{{"index", best},
                     {"flags", apply.flags},
                     {"toml", apply.toml},
                     {"expertctl", apply.expertctl}};
    if (!o.plot.empty()) j["plot"] = o.plot;
    fmt::print("{}\n", j.dump());
    return 0;
  }
  fmt::print(
      "sweep of {} ({} tokens, {} layers each) against model '{}' ({} MoE layers x {} experts, "
      "slot {}, policy {})\n",
      o.trace, tokens, layers_per_token, o.model, mapping->moe_layers(), mapping->experts(),
      human_bytes(initial.slot_bytes), stats->policy);
  fmt::print("predictor {}, compute {} \u00b5s per layer; disk bandwidth {:.2f} GB/s: {}\n\n",
             (*predictor)->name(), o.compute_us_per_layer, bw.gbps, bw.source);
  if (o.repeat > 1) {
    fmt::print(
        "each setting ran {} times, in {} rounds over all settings; the table shows each "
        "one's median run by tokens/s\n\n",
        o.repeat, o.repeat);
  }
  print_table(points, best);
  fmt::print(
      "\nstall: time per token spent waiting in acquire (p50, p99 and mean over the tokens); "
      "MB/token: bytes\nread per token; useful/wasted MB: prefetched bytes later acquired / "
      "evicted unused; bound: tokens/s\nif every read overlapped the compute, 1 / max(MB/token / "
      "disk bandwidth, compute per token).\nauto: expertd chooses the depth from its measured hint "
      "precision (the replay hints {} layers ahead);\nchose: the depth in use at the end / the "
      "deepest any prefetch load came from. loads: prefetch loads;\nstaged: of those, streamed "
      "through the staging ring; refused: denied a cache slot that needed an eviction;\nskipped: "
      "hints not read (calibrated probability below break-even). docs/CACHE.md has the rule.\n",
      kSweepAutoHintDepth);
  const Point& b = points[best];
  fmt::print(
      "\nbest (*): {}: {:.2f} tokens/s, stall p50 {:.2f} ms, p99 {:.2f} ms (bound {:.2f} "
      "tokens/s)\n",
      setting_label(b.setting, true), b.tokens_per_s, b.stall_ms_p50, b.stall_ms_p99,
      b.bound_tokens_per_s);
  fmt::print("  expertd flags:  {}\n", apply.flags);
  for (size_t i = 0; i < apply.toml.size(); ++i) {
    fmt::print("  {}{}\n", i == 0 ? "expertd.toml:   " : "                ", apply.toml[i]);
  }
  for (size_t i = 0; i < apply.expertctl.size(); ++i) {
    fmt::print("  {}{}\n", i == 0 ? "now (runtime):  " : "                ", apply.expertctl[i]);
  }
  if (!o.plot.empty()) fmt::print("plot: {}\n", o.plot);
  return 0;
}

}  // namespace expertd::tune
