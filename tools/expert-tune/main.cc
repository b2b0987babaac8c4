// expert-tune: storage tuning from routing traces.
//   simulate  offline cache simulation of a trace: a policy's hits against Belady's optimum
//   replay    replays a trace against a running expertd (real reads), printing hit rate and GB/s
//   sweep     replays it once per prefetch depth x queue depth x cache size, with the compute time
//             between layers, and reports stalls, tokens/s and the bandwidth bound (sweep.h)
//   import    converts a raw routing log (vLLM hooks) into a canonical trace
//   convert   converts a trace between JSON Lines and the binary form (.etrace)
//   synth     writes a generated trace with realistic locality (trace/synth.h)
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <numeric>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "cache/scheduler.h"
#include "engine/family.h"
#include "expertd/client.h"
#include "policy/policy.h"
#include "trace/synth.h"
#include "trace/trace.h"
#include "tune/batch.h"
#include "tune/replay.h"
#include "tune/sweep.h"

namespace {

using expertd::ExpertKey;
using expertd::Trace;

// The trace to use: a file, or the shared Mixtral trace when present, or a generated one.
expertd::Result<Trace> load_or_generate(const std::string& path, uint32_t layers, uint32_t experts,
                                        uint32_t top_k, uint32_t tokens, std::string* label) {
  if (!path.empty()) {
    *label = path;
    return expertd::load_trace(path);
  }
  // The model's shape with the locality calibrated on real Mixtral traces (trace/synth.h).
  expertd::SynthParams p = expertd::SynthParams::mixtral(tokens);
  p.layers = layers;
  p.experts = experts;
  p.top_k = top_k;
  *label = fmt::format(
      "generated ({} tokens, {} layers, {} experts, top-{}, Mixtral-like locality: zipf {}, "
      "keep {})",
      tokens, layers, experts, top_k, p.zipf_s, p.keep);
  return expertd::synthesize_trace(p, 1);
}

std::vector<uint32_t> parse_list(const std::string& s) {
  std::vector<uint32_t> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(static_cast<uint32_t>(std::stoul(item)));
  return out;
}

struct SimulateOptions {
  std::string trace;
  std::string cache_experts = "64";
  std::string policy = "default";
  std::string hints = "none";
  uint64_t seed = 1;
  bool json = false;
};

// The policy's hits beside the references that bound what it could do on this trace: LRU (the
// floor to beat), Belady's MIN with bypass (no policy can do better), the goal between them, and
// the best fixed set in hindsight (what frequency alone can reach).
int run_simulate(const SimulateOptions& o) {
  auto trace = expertd::load_trace(o.trace);
  if (!trace) {
    std::fprintf(stderr, "expert-tune simulate: %s\n", trace.error().message.c_str());
    return 1;
  }
  std::vector<uint32_t> sizes;
  try {
    sizes = parse_list(o.cache_experts);
  } catch (...) {
    std::fprintf(stderr, "expert-tune simulate: --cache-experts '%s': expected N or N,N,...\n",
                 o.cache_experts.c_str());
    return 2;
  }
  auto hints = expertd::parse_sim_hints(o.hints);
  if (!hints) {
    std::fprintf(stderr, "expert-tune simulate: --hints: %s\n", hints.error().message.c_str());
    return 2;
  }
  hints->seed = o.seed;
  const std::string policy(o.policy == "default" ? expertd::kDefaultPolicy : o.policy);
  const auto acc = trace->accesses();
  const auto statics = expertd::static_hindsight(sizes, acc);
  if (!o.json) {
    fmt::print("trace {}: {} tokens, {} layers, {} experts, {} accesses\n", o.trace, trace->tokens,
               trace->layers, trace->experts, acc.size());
    fmt::print("policy {}{}, hints {}; goal = (lru + belady) / 2\n", policy,
               o.policy == "default" ? " (the default)" : "", o.hints);
    fmt::print("{:>8} {:>9} {:>8} {:>9} {:>7} {:>12} {:>7} {:>7} {:>5} {:>7}\n", "cache",
               "accesses", "hits", "hit rate", "lru", "belady hits", "belady", "goal", "met",
               "static");
  }
  for (size_t n = 0; n < sizes.size(); ++n) {
    const expertd::PolicyShape shape{sizes[n], trace->layers, trace->experts};
    const auto r = expertd::simulate_policy(policy, shape, acc, *hints);
    if (!r) {
      std::fprintf(stderr, "expert-tune simulate: %s\n", r.error().message.c_str());
      return 2;
    }
    const auto lru = expertd::simulate_policy("lru", shape, acc);
    if (!lru) {
      std::fprintf(stderr, "expert-tune simulate: %s\n", lru.error().message.c_str());
      return 2;
    }
    const auto b = expertd::simulate_belady(sizes[n], acc);
    const double goal = (lru->hit_rate() + b.hit_rate()) / 2;
    const bool met = r->hit_rate() >= goal;
    const double st = statics[n].result.hit_rate();
    if (o.json) {
      fmt::print(
          "{{\"cache_experts\":{},\"policy\":\"{}\",\"hints\":\"{}\",\"accesses\":{},"
          "\"hits\":{},\"hit_rate\":{:.6f},\"lru_hits\":{},\"lru_hit_rate\":{:.6f},"
          "\"belady_hits\":{},\"belady_hit_rate\":{:.6f},\"goal_hit_rate\":{:.6f},"
          "\"goal_met\":{},\"static_hits\":{},\"static_hit_rate\":{:.6f}}}\n",
          sizes[n], policy, o.hints, r->accesses, r->hits, r->hit_rate(), lru->hits,
          lru->hit_rate(), b.hits, b.hit_rate(), goal, met, statics[n].result.hits, st);
    } else {
      fmt::print(
          "{:>8} {:>9} {:>8} {:>8.1f}% {:>6.1f}% {:>12} {:>6.1f}% {:>6.1f}% {:>5} {:>6.1f}%\n",
          sizes[n], r->accesses, r->hits, 100 * r->hit_rate(), 100 * lru->hit_rate(), b.hits,
          100 * b.hit_rate(), 100 * goal, met ? "yes" : "no", 100 * st);
    }
  }
  return 0;
}

struct BatchOptions {
  std::vector<std::string> traces;
  std::string streams = "1,2,4,8";
  std::string cache_experts = "64,128";
  std::string policy = "default";
  uint32_t synth_tokens = 512;
  uint64_t seed = 1;
  bool json = false;
};

// Sequences decoded together, offline (tune/batch.h): per stream count and cache size, the reads
// per generated token through the policy and Belady's optimum, and the factor batching divides
// them by against one stream.
int run_batch(const BatchOptions& o) {
  std::vector<Trace> traces;
  std::string source;
  for (const std::string& path : o.traces) {
    auto t = expertd::load_trace(path);
    if (!t) {
      std::fprintf(stderr, "expert-tune batch: %s\n", t.error().message.c_str());
      return 1;
    }
    traces.push_back(std::move(*t));
    source += (source.empty() ? "" : " + ") + path;
  }
  if (traces.empty()) {
    traces.push_back(
        expertd::synthesize_trace(expertd::SynthParams::mixtral(o.synth_tokens), o.seed));
    source = fmt::format("a generated Mixtral-shaped trace ({} tokens, seed {})", o.synth_tokens,
                         o.seed);
  }
  std::vector<uint32_t> streams;
  std::vector<uint32_t> sizes;
  try {
    streams = parse_list(o.streams);
    sizes = parse_list(o.cache_experts);
  } catch (...) {
    std::fprintf(stderr,
                 "expert-tune batch: --streams '%s' / --cache-experts '%s': expected N or "
                 "N,N,...\n",
                 o.streams.c_str(), o.cache_experts.c_str());
    return 2;
  }
  const std::string policy(o.policy == "default" ? expertd::kDefaultPolicy : o.policy);
  auto r = expertd::tune::simulate_batches(traces, streams, sizes, policy);
  if (!r) {
    std::fprintf(stderr, "expert-tune batch: %s\n", r.error().message.c_str());
    return 2;
  }
  // The factor against one stream at the same capacity (when 1 is among the stream counts).
  auto alone = [&](uint32_t capacity) -> const expertd::tune::BatchSimResult* {
    for (const auto& x : *r)
      if (x.streams == 1 && x.capacity == capacity) return &x;
    return nullptr;
  };
  if (!o.json) {
    fmt::print("{}; policy {}\n", source, policy);
    fmt::print("{:>7} {:>6} {:>7} {:>11} {:>14} {:>13} {:>7} {:>14} {:>7}\n", "streams", "cache",
               "tokens", "uses/token", "distinct/layer", "reads/token", "factor", "belady r/token",
               "factor");
  }
  for (const auto& x : *r) {
    const auto* one = alone(x.capacity);
    const double f = one && x.misses ? one->misses_per_token() / x.misses_per_token() : 0.0;
    const double fb =
        one && x.belady_misses ? one->belady_misses_per_token() / x.belady_misses_per_token() : 0.0;
    const double uses = x.tokens ? static_cast<double>(x.routed) / x.tokens : 0.0;
    if (o.json) {
      fmt::print(
          "{{\"streams\":{},\"cache_experts\":{},\"policy\":\"{}\",\"steps\":{},\"tokens\":{},"
          "\"uses_per_token\":{:.4f},\"distinct_per_layer\":{:.4f},\"reads_per_token\":{:.4f},"
          "\"read_factor\":{:.4f},\"belady_reads_per_token\":{:.4f},\"belady_factor\":{:.4f}}}\n",
          x.streams, x.capacity, policy, x.steps, x.tokens, uses, x.distinct_per_layer(),
          x.misses_per_token(), f, x.belady_misses_per_token(), fb);
    } else {
      fmt::print("{:>7} {:>6} {:>7} {:>11.2f} {:>14.2f} {:>13.2f} {:>6.2f}x {:>14.2f} {:>6.2f}x\n",
                 x.streams, x.capacity, x.tokens, uses, x.distinct_per_layer(),
                 x.misses_per_token(), f, x.belady_misses_per_token(), fb);
    }
  }
  return 0;
}

struct ReplayOptions {
  std::string socket = expertd::client::default_socket();
  std::string model;
  std::string trace;
  uint32_t depth = 2;
  uint32_t tokens = 0;  // 0: all
  bool json = false;
};

int run_replay(const ReplayOptions& o) {
  auto fail = [](const std::string& m) {
    std::fprintf(stderr, "expert-tune replay: %s\n", m.c_str());
    return 1;
  };
  auto client = expertd::client::Client::connect(o.socket);
  if (!client) return fail(client.error().message);
  auto session = (*client)->attach(o.model, "expert-tune replay");
  if (!session) return fail(session.error().message);
  const auto& layout = (*session)->layout();
  auto mapping = expertd::tune::TraceMapping::make(layout);
  if (!mapping) return fail(mapping.error().message);
  std::string label;
  auto loaded = load_or_generate(o.trace, mapping->moe_layers(), layout.expert_count,
                                 std::max(layout.top_k, 1u), o.tokens ? o.tokens : 64, &label);
  if (!loaded) return fail(loaded.error().message);
  const expertd::tune::IndexedTrace trace(std::move(*loaded));
  auto oracle = expertd::tune::make_predictor("oracle", trace, label, 0);
  if (!oracle) return fail(oracle.error().message);
  auto before = (*client)->stats();
  if (!before) return fail(before.error().message);
  expertd::tune::ReplayOptions ro;
  ro.depth = o.depth;
  ro.max_tokens = o.tokens;
  ro.predictor = oracle->get();
  auto r = expertd::tune::replay_trace(**session, trace, *mapping, ro);
  if (!r) return fail(r.error().message);
  auto after = (*client)->stats();
  if (!after) return fail(after.error().message);
  const auto& m0 = before->models;
  const auto& m1 = after->models;
  uint64_t acquires = 0, hits = 0, bytes = 0, useful = 0, loads = 0;
  for (size_t i = 0; i < m1.size() && i < m0.size(); ++i) {
    if (m1[i].name != o.model) continue;
    acquires = m1[i].scheduler.acquires - m0[i].scheduler.acquires;
    hits = m1[i].scheduler.hits - m0[i].scheduler.hits;
    bytes = m1[i].scheduler.bytes_read - m0[i].scheduler.bytes_read;
    useful = m1[i].scheduler.prefetch_useful - m0[i].scheduler.prefetch_useful;
    loads = m1[i].scheduler.prefetch_loads - m0[i].scheduler.prefetch_loads;
  }
  const double seconds = static_cast<double>(r->wall_ns) / 1e9;
  const uint64_t stall_ns = std::accumulate(r->stall_ns.begin(), r->stall_ns.end(), uint64_t{0});
  const uint32_t tokens = r->tokens;
  const double hit_rate = acquires ? static_cast<double>(hits) / acquires : 0.0;
  const double gbps = seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0;
  const double stall_ms = tokens ? static_cast<double>(stall_ns) / 1e6 / tokens : 0.0;
  if (o.json) {
    fmt::print(
        "{{\"trace\":\"{}\",\"tokens\":{},\"acquires\":{},\"hits\":{},\"hit_rate\":{:.6f},"
        "\"bytes_read\":{},\"seconds\":{:.6f},\"gbps\":{:.4f},\"stall_ms_per_token\":{:.4f},"
        "\"prefetch_depth\":{},\"prefetch_loads\":{},\"prefetch_useful\":{}}}\n",
        label, tokens, acquires, hits, hit_rate, bytes, seconds, gbps, stall_ms, o.depth, loads,
        useful);
  } else {
    fmt::print("replayed {} tokens of {} against model '{}' (prefetch depth {})\n", tokens, label,
               o.model, o.depth);
    fmt::print("  acquires {}, hits {} ({:.1f}%: READY when asked)\n", acquires, hits,
               100 * hit_rate);
    fmt::print("  read {:.1f} MB in {:.2f} s: {:.2f} GB/s; stall {:.2f} ms/token\n",
               static_cast<double>(bytes) / 1e6, seconds, gbps, stall_ms);
    fmt::print("  prefetch loads {}, useful {}\n", loads, useful);
  }
  return 0;
}

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

struct ImportOptions {
  std::string raw;
  std::string out;
  bool binary = false;
};

int run_import(const ImportOptions& o) {
  auto trace = expertd::import_raw_log(o.raw);
  if (!trace) {
    std::fprintf(stderr, "expert-tune import: %s\n", trace.error().message.c_str());
    return 1;
  }
  const bool binary = o.binary || ends_with(o.out, ".etrace");
  const auto st = binary ? expertd::write_trace_binary(o.out, *trace)
                         : expertd::write_trace_jsonl(o.out, *trace);
  if (!st) {
    std::fprintf(stderr, "expert-tune import: %s\n", st.error().message.c_str());
    return 1;
  }
  fmt::print("{}: {} records, {} tokens, {} layers, {} experts -> {} ({})\n", o.raw,
             trace->records.size(), trace->tokens, trace->layers, trace->experts, o.out,
             binary ? "binary" : "JSON Lines");
  return 0;
}

struct ConvertOptions {
  std::string in;
  std::string out;
};

int run_convert(const ConvertOptions& o) {
  const bool binary = ends_with(o.out, ".etrace");
  if (!binary && !ends_with(o.out, ".jsonl")) {
    std::fprintf(stderr,
                 "expert-tune convert: %s: the output's extension picks the form: .etrace "
                 "(binary) or .jsonl (JSON Lines)\n",
                 o.out.c_str());
    return 2;
  }
  auto trace = expertd::load_trace(o.in);
  if (!trace) {
    std::fprintf(stderr, "expert-tune convert: %s\n", trace.error().message.c_str());
    return 1;
  }
  const auto st = binary ? expertd::write_trace_binary(o.out, *trace)
                         : expertd::write_trace_jsonl(o.out, *trace);
  if (!st) {
    std::fprintf(stderr, "expert-tune convert: %s\n", st.error().message.c_str());
    return 1;
  }
  fmt::print("{}: {} records -> {} ({})\n", o.in, trace->records.size(), o.out,
             binary ? "binary" : "JSON Lines");
  return 0;
}

struct SynthOptions {
  // The Mixtral shape is named as the family registry names Mixtral.
  std::string shape{
      expertd::engine::short_name(expertd::engine::family_info(expertd::engine::Family::Mixtral))};
  std::string out;
  uint32_t tokens = 256;
  uint64_t seed = 1;
  uint32_t layers = 0;  // 0: the shape's
  uint32_t experts = 0;
  uint32_t top_k = 0;
  double zipf = -1;  // < 0: the shape's
  double keep = -1;
};

int run_synth(const SynthOptions& o) {
  expertd::SynthParams p;
  const std::string mixtral = SynthOptions{}.shape;
  if (o.shape == mixtral) {
    p = expertd::SynthParams::mixtral(o.tokens);
  } else if (o.shape == "wide") {
    p = expertd::SynthParams::wide(o.tokens);
  } else {
    std::fprintf(stderr, "expert-tune synth: --shape %s: must be %s or wide\n", o.shape.c_str(),
                 mixtral.c_str());
    return 2;
  }
  if (o.layers > 0) p.layers = o.layers;
  if (o.experts > 0) p.experts = o.experts;
  if (o.top_k > 0) p.top_k = o.top_k;
  if (o.zipf >= 0) p.zipf_s = o.zipf;
  if (o.keep >= 0) p.keep = o.keep;
  if (p.tokens == 0 || p.top_k > p.experts || p.keep > 1) {
    std::fprintf(stderr,
                 "expert-tune synth: need --tokens > 0, --top-k <= --experts and --keep <= 1\n");
    return 2;
  }
  const bool binary = ends_with(o.out, ".etrace");
  if (!binary && !ends_with(o.out, ".jsonl")) {
    std::fprintf(stderr,
                 "expert-tune synth: %s: the output's extension picks the form: .etrace "
                 "(binary) or .jsonl (JSON Lines)\n",
                 o.out.c_str());
    return 2;
  }
  const Trace t = expertd::synthesize_trace(p, o.seed);
  const auto st =
      binary ? expertd::write_trace_binary(o.out, t) : expertd::write_trace_jsonl(o.out, t);
  if (!st) {
    std::fprintf(stderr, "expert-tune synth: %s\n", st.error().message.c_str());
    return 1;
  }
  const expertd::TraceLocality m = expertd::measure_locality(t);
  fmt::print(
      "{}: {} tokens x {} layers, top-{} of {} experts (zipf {}, keep {}, seed {}): {:.0f}% of "
      "experts reused from the previous token, layer popularity {:.2f} .. {:.2f}\n",
      o.out, p.tokens, p.layers, p.top_k, p.experts, p.zipf_s, p.keep, o.seed, 100 * m.reuse,
      m.top_share, m.bottom_share);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"expert-tune: tune expertd's cache and prefetch from routing traces"};
  app.set_version_flag("--version", std::string("expert-tune ") + EXPERTD_VERSION);
  app.require_subcommand(1);
  std::function<int()> run;

  SimulateOptions sim;
  auto* s = app.add_subcommand("simulate",
                               "Offline cache simulation of a trace (no daemon): a policy's hits "
                               "against Belady's optimum");
  s->add_option("--trace", sim.trace, "Trace: canonical JSON Lines or binary (.etrace)")
      ->required();
  s->add_option("--cache-experts", sim.cache_experts, "Capacity in experts: N or N,N,...");
  s->add_option("--policy", sim.policy, "default (cyclic-hint), cyclic-hint, cyclic, lru or fifo");
  s->add_option("--hints", sim.hints,
                "Router hints fed to the policy before each layer: none (default), oracle:D (the "
                "recorded experts of the next D layers) or noisy:R:D (each right with "
                "probability R, e.g. noisy:0.8:2); they change replacement and admission only, "
                "nothing is prefetched");
  s->add_option("--seed", sim.seed, "Seed of the noisy hints (default 1)");
  s->add_flag("--json", sim.json, "One JSON object per capacity");
  s->callback([&] { run = [&] { return run_simulate(sim); }; });

  BatchOptions bat;
  auto* b = app.add_subcommand(
      "batch",
      "Offline (no daemon): N streams of a trace decoded together, each step reading the union of "
      "its rows' experts through one cache; reads per token against one stream");
  b->add_option("--trace", bat.traces,
                "Trace(s): canonical JSON Lines or binary (.etrace), decoded one after another and "
                "cut into the streams (default: a generated Mixtral-shaped trace)");
  b->add_option("--streams", bat.streams, "Sequences decoded together: N or N,N,... (1,2,4,8)");
  b->add_option("--cache-experts", bat.cache_experts, "Cache capacity in experts: N or N,N,...");
  b->add_option("--policy", bat.policy, "default (cyclic-hint), cyclic-hint, cyclic, lru or fifo");
  b->add_option("--synth-tokens", bat.synth_tokens,
                "Tokens of the generated trace when no --trace is given (512)");
  b->add_option("--seed", bat.seed, "Seed of the generated trace (1)");
  b->add_flag("--json", bat.json, "One JSON object per (streams, cache)");
  b->callback([&] { run = [&] { return run_batch(bat); }; });

  ReplayOptions rep;
  auto* r = app.add_subcommand("replay", "Replay a trace against a running expertd (real reads)");
  r->add_option("--socket", rep.socket, "expertd's control socket");
  r->add_option("--model", rep.model, "Model name as configured in expertd")->required();
  r->add_option(
      "--trace", rep.trace,
      "Trace (JSON Lines or binary .etrace); without it a trace with realistic locality is "
      "generated");
  r->add_option("--depth", rep.depth, "Oracle prefetch depth in layers ahead (2)");
  r->add_option("--tokens", rep.tokens, "Replay only the first N tokens");
  r->add_flag("--json", rep.json, "One JSON object");
  r->callback([&] { run = [&] { return run_replay(rep); }; });

  expertd::tune::SweepOptions sw;
  sw.socket = expertd::client::default_socket();
  auto* w = app.add_subcommand(
      "sweep",
      "Replay a trace against a running expertd for every prefetch depth x queue depth x cache "
      "size, with compute time between layers: stalls, tokens/s, bandwidth bound, best setting");
  w->add_option("--socket", sw.socket, "expertd's control socket");
  w->add_option("--model", sw.model, "Model name as configured in expertd")->required();
  w->add_option("--trace", sw.trace, "Trace: canonical JSON Lines or binary (.etrace)")->required();
  std::vector<std::string> sweep_depths;
  w->add_option("--depths", sweep_depths,
                "Prefetch depths in layers ahead, or auto: expertd chooses from its measured hint "
                "precision (default 0,1,2,3,auto)")
      ->delimiter(',');
  w->add_option("--queue-depths", sw.queue_depths,
                "Reads in flight to try, e.g. 8,32 (default: the daemon's)")
      ->delimiter(',');
  w->add_option("--cache", sw.caches,
                "Cache sizes to try, e.g. 256MiB,1GiB or 50% of the model's cache (default: the "
                "daemon's whole cache); needs expertd started with at least the largest")
      ->delimiter(',');
  w->add_option("--compute-us-per-layer", sw.compute_us_per_layer,
                "GPU time per layer the experts are held, in microseconds (default 100)");
  w->add_option("--predictor", sw.predictor,
                "Hints: oracle (default), noisy:RECALL (e.g. noisy:0.7) or recorded (the trace's "
                "\"predicted\" lists)");
  w->add_option("--seed", sw.seed, "Seed of the noisy predictor (default 1)");
  w->add_option("--max-tokens", sw.max_tokens, "Replay only the first N tokens of the trace");
  w->add_option("--repeat", sw.repeat,
                "Run every setting N times, in N rounds over all settings, and report the run "
                "with the median tokens/s (for noisy machines; default 1)");
  w->add_option("--disk-gbps", sw.disk_gbps,
                "Disk bandwidth for the bound in GB/s (default: measured through expertd first)");
  w->add_option("--plot", sw.plot, "Write an SVG plot of stall and tokens/s against depth");
  w->add_flag("--json", sw.json, "One JSON document");
  w->callback([&] {
    run = [&] {
      if (!sweep_depths.empty()) sw.depths.clear();
      for (const std::string& d : sweep_depths) {
        uint32_t v = 0;
        const auto [end, ec] = std::from_chars(d.data(), d.data() + d.size(), v);
        if (d == "auto") {
          v = expertd::tune::kSweepAutoDepth;
        } else if (ec != std::errc() || end != d.data() + d.size()) {
          std::fprintf(stderr,
                       "expert-tune sweep: --depths '%s': expected a number of layers or auto\n",
                       d.c_str());
          return 2;
        }
        sw.depths.push_back(v);
      }
      return expertd::tune::run_sweep(sw);
    };
  });

  ImportOptions imp;
  auto* i = app.add_subcommand("import", "Convert a raw routing log into a canonical trace");
  i->add_option("--raw", imp.raw,
                "Raw log: JSON Lines of {layer, token_idx|token_pos, experts, gating_probs}")
      ->required();
  i->add_option("-o,--output", imp.out, "Output trace (.jsonl, or binary with --binary/.etrace)")
      ->required();
  i->add_flag("--binary", imp.binary, "Write the binary form (.etrace)");
  i->callback([&] { run = [&] { return run_import(imp); }; });

  ConvertOptions conv;
  auto* c = app.add_subcommand("convert", "Convert a trace between JSON Lines and binary");
  c->add_option("input", conv.in, "Input trace (either form; binary is recognised by its magic)")
      ->required();
  c->add_option("-o,--output", conv.out, "Output trace: .etrace (binary) or .jsonl (JSON Lines)")
      ->required();
  c->callback([&] { run = [&] { return run_convert(conv); }; });

  SynthOptions syn;
  auto* y = app.add_subcommand(
      "synth",
      "Write a generated trace with realistic locality (per-layer Zipf-like popularity, "
      "reuse between consecutive tokens), deterministic for a seed");
  y->add_option("-o,--output", syn.out, "Output trace: .etrace (binary) or .jsonl (JSON Lines)")
      ->required();
  y->add_option("--shape", syn.shape,
                SynthOptions{}.shape +
                    " (32 layers, top-2 of 8, calibrated to real Mixtral traces; default) or "
                    "wide (48 layers, top-8 of 128)");
  y->add_option("--tokens", syn.tokens, "Tokens (default 256)");
  y->add_option("--seed", syn.seed, "Seed (default 1)");
  y->add_option("--layers", syn.layers, "Override the shape's layers");
  y->add_option("--experts", syn.experts, "Override the shape's experts per layer");
  y->add_option("--top-k", syn.top_k, "Override the shape's experts per token");
  y->add_option("--zipf", syn.zipf, "Popularity exponent: rank r weighs 1/(r+1)^zipf");
  y->add_option("--keep", syn.keep, "Chance that each of the previous token's experts is kept");
  y->callback([&] { run = [&] { return run_synth(syn); }; });

  CLI11_PARSE(app, argc, argv);
  return run ? run() : 2;
}
