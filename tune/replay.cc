#include "tune/replay.h"

#include <fmt/format.h>
#include <time.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>

#include "base/clock.h"

namespace expertd::tune {

namespace {

constexpr uint64_t pack(uint32_t token, uint32_t layer) {
  return (static_cast<uint64_t>(token) << 32) | layer;
}

// splitmix64: a tiny, well-mixed generator; seeded per prediction so that every setting of a sweep
// draws the same noise whatever order it runs in.
class SplitMix {
 public:
  explicit SplitMix(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

 private:
  uint64_t state_;
};

float weight_of(const TraceRecord& r, size_t k) {
  return k < r.weights.size() ? std::clamp(r.weights[k], 0.0f, 1.0f) : 1.0f;
}

class OraclePredictor final : public Predictor {
 public:
  explicit OraclePredictor(const IndexedTrace& t) : trace_(t) {}
  std::string name() const override { return "oracle"; }
  void predict(size_t target, uint32_t, std::vector<Prediction>& out) const override {
    const TraceRecord& r = trace_.records()[target];
    for (size_t k = 0; k < r.experts.size(); ++k) out.push_back({r.experts[k], weight_of(r, k)});
  }

 private:
  const IndexedTrace& trace_;
};

class NoisyPredictor final : public Predictor {
 public:
  NoisyPredictor(const IndexedTrace& t, double recall, uint64_t seed)
      : trace_(t), recall_(recall), seed_(seed) {}
  std::string name() const override { return fmt::format("noisy:{}", recall_); }
  void predict(size_t target, uint32_t depth, std::vector<Prediction>& out) const override {
    const TraceRecord& r = trace_.records()[target];
    SplitMix rng(seed_ ^ (target * 0xD1B54A32D192ED03ull) ^ (uint64_t{depth} << 48));
    const size_t first = out.size();
    const uint32_t n = trace_.trace().experts;
    auto taken = [&](uint32_t e) {
      if (std::find(r.experts.begin(), r.experts.end(), e) != r.experts.end()) return true;
      for (size_t i = first; i < out.size(); ++i) {
        if (out[i].expert == e) return true;
      }
      return false;
    };
    for (size_t k = 0; k < r.experts.size(); ++k) {
      if (rng.uniform() < recall_) {
        out.push_back({r.experts[k], weight_of(r, k)});
        continue;
      }
      // A wrong expert in the true one's place (with its score: the predictor cannot tell).
      if (n <= r.experts.size() + (out.size() - first)) continue;  // no wrong one left
      uint32_t e = static_cast<uint32_t>(rng.next() % n);
      while (taken(e)) e = (e + 1) % n;
      out.push_back({e, weight_of(r, k)});
    }
  }

 private:
  const IndexedTrace& trace_;
  double recall_;
  uint64_t seed_;
};

class RecordedPredictor final : public Predictor {
 public:
  explicit RecordedPredictor(const IndexedTrace& t) : trace_(t) {}
  std::string name() const override { return "recorded"; }
  void predict(size_t target, uint32_t depth, std::vector<Prediction>& out) const override {
    const auto& predicted = trace_.records()[target].predicted;
    const auto it = predicted.find(depth);
    if (it == predicted.end()) return;
    for (const uint32_t e : it->second) out.push_back({e, 1.0f});
  }

 private:
  const IndexedTrace& trace_;
};

// Holds the CPU's attention like a GPU kernel would not: sleep most of the time (the daemon may
// need this core), spin the last 50 µs for an exact end.
void wait_until(uint64_t deadline_ns) {
  for (;;) {
    const uint64_t now = monotonic_ns();
    if (now >= deadline_ns) return;
    const uint64_t left = deadline_ns - now;
    if (left > 100'000) {
      const uint64_t sleep_ns = left - 50'000;
      timespec ts{static_cast<time_t>(sleep_ns / 1'000'000'000),
                  static_cast<long>(sleep_ns % 1'000'000'000)};
      ::nanosleep(&ts, nullptr);
    }
  }
}

}  // namespace

Result<TraceMapping> TraceMapping::make(const client::ModelLayout& layout) {
  TraceMapping m;
  for (uint32_t l = 0; l < layout.block_count; ++l) {
    if (layout.has_experts(l)) m.moe_layers_.push_back(l);
  }
  if (m.moe_layers_.empty() || layout.expert_count == 0) {
    return make_error(EINVAL, fmt::format("model '{}' has no MoE layers", layout.name));
  }
  m.experts_ = layout.expert_count;
  return m;
}

IndexedTrace::IndexedTrace(Trace trace) : trace_(std::move(trace)) {
  keys_.reserve(trace_.records.size());
  for (const auto& r : trace_.records) keys_.push_back(pack(r.token, r.layer));
}

int64_t IndexedTrace::ahead(size_t i, uint32_t n) const {
  const TraceRecord& r = trace_.records[i];
  const uint64_t layers = std::max(trace_.layers, 1u);
  const uint64_t pos = uint64_t{r.token} * layers + r.layer + n;
  const uint64_t key =
      pack(static_cast<uint32_t>(pos / layers), static_cast<uint32_t>(pos % layers));
  const auto it =
      std::lower_bound(keys_.begin() + static_cast<std::ptrdiff_t>(i), keys_.end(), key);
  return it != keys_.end() && *it == key ? it - keys_.begin() : -1;
}

size_t IndexedTrace::end_of_tokens(uint32_t tokens) const {
  const auto& recs = trace_.records;
  if (tokens == 0 || recs.empty()) return recs.size();
  size_t end = 0;
  uint32_t seen = 0;
  for (; end < recs.size(); ++end) {
    if (end == 0 || recs[end].token != recs[end - 1].token) {
      if (seen == tokens) break;
      ++seen;
    }
  }
  return end;
}

Result<std::unique_ptr<Predictor>> make_predictor(std::string_view spec, const IndexedTrace& trace,
                                                  const std::string& trace_path, uint64_t seed) {
  if (spec == "oracle") return std::unique_ptr<Predictor>(new OraclePredictor(trace));
  if (spec == "recorded") {
    for (const auto& r : trace.records()) {
      if (!r.predicted.empty()) return std::unique_ptr<Predictor>(new RecordedPredictor(trace));
    }
    return make_error(EINVAL,
                      fmt::format("{}: --predictor recorded: no record has \"predicted\" lists "
                                  "(record them with the engine, or use oracle or noisy:RECALL)",
                                  trace_path));
  }
  constexpr std::string_view kNoisy = "noisy:";
  if (spec.substr(0, kNoisy.size()) == kNoisy) {
    const std::string_view v = spec.substr(kNoisy.size());
    double recall = -1;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), recall);
    if (ec == std::errc() && end == v.data() + v.size() && recall >= 0.0 && recall <= 1.0) {
      return std::unique_ptr<Predictor>(new NoisyPredictor(trace, recall, seed));
    }
  }
  return make_error(EINVAL, fmt::format("--predictor '{}': expected oracle, noisy:RECALL (RECALL "
                                        "from 0 to 1, e.g. noisy:0.7) or recorded",
                                        spec));
}

Result<ReplayResult> replay_trace(client::Session& session, const IndexedTrace& trace,
                                  const TraceMapping& mapping, const ReplayOptions& options,
                                  const ReplayProgress& progress) {
  const auto& recs = trace.records();
  const size_t end = trace.end_of_tokens(options.max_tokens);
  uint32_t tokens = 0;
  for (size_t i = 0; i < end; ++i) tokens += i == 0 || recs[i].token != recs[i - 1].token;

  std::vector<client::SlotView> views(256);  // a record lists at most 255 experts
  std::vector<client::PrefetchHint> hints;
  std::vector<Prediction> predictions;
  std::vector<uint32_t> experts;
  ReplayResult out;
  out.stall_ns.reserve(tokens);
  const uint64_t t0 = monotonic_ns();
  for (size_t i = 0; i < end; ++i) {
    const TraceRecord& r = recs[i];
    if (i == 0 || r.token != recs[i - 1].token) {
      if (progress) progress(static_cast<uint32_t>(out.stall_ns.size()), tokens);
      out.stall_ns.push_back(0);
    }
    const uint32_t layer = mapping.key(r.layer, 0).layer;
    EXPERTD_TRY(session.set_cursor(r.token, layer));
    hints.clear();
    for (uint32_t d = 1; options.predictor != nullptr && d <= options.depth; ++d) {
      const int64_t k = trace.ahead(i, d);
      if (k < 0 || static_cast<size_t>(k) >= end) continue;
      predictions.clear();
      options.predictor->predict(static_cast<size_t>(k), d, predictions);
      for (const Prediction& p : predictions) {
        const ExpertKey key = mapping.key(recs[static_cast<size_t>(k)].layer, p.expert);
        hints.push_back({key.layer, key.expert, std::clamp(p.score, 0.0f, 1.0f)});
      }
    }
    if (!hints.empty()) EXPERTD_TRY(session.prefetch(hints));
    experts.clear();
    for (const uint32_t e : r.experts) {
      const uint32_t m = mapping.key(r.layer, e).expert;
      if (std::find(experts.begin(), experts.end(), m) == experts.end()) experts.push_back(m);
    }
    const uint64_t a = monotonic_ns();
    EXPERTD_TRY(session.acquire(layer, experts, {views.data(), experts.size()}));
    const uint64_t b = monotonic_ns();
    out.stall_ns.back() += b - a;
    if (options.compute_ns_per_layer > 0) wait_until(b + options.compute_ns_per_layer);
    EXPERTD_TRY(session.release({views.data(), experts.size()}));
  }
  out.wall_ns = monotonic_ns() - t0;
  out.tokens = static_cast<uint32_t>(out.stall_ns.size());
  out.records = end;
  if (progress) progress(tokens, tokens);
  return out;
}

double quantile(std::vector<uint64_t> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const double rank = std::ceil(q * static_cast<double>(values.size()));
  const size_t i = static_cast<size_t>(std::clamp(rank, 1.0, static_cast<double>(values.size())));
  return static_cast<double>(values[i - 1]);
}

}  // namespace expertd::tune
