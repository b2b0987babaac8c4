#include "tools/trace/trace.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <set>

namespace expertd {

std::vector<ExpertKey> Trace::accesses() const {
  std::vector<ExpertKey> out;
  for (const auto& r : records) {
    for (const uint32_t e : r.experts) out.push_back(ExpertKey{r.layer, e});
  }
  return out;
}

namespace {

Result<uint32_t> get_u32(const nlohmann::json& j, const char* key, const std::string& where) {
  const auto it = j.find(key);
  if (it == j.end()) return make_error(EINVAL, fmt::format("{}: missing \"{}\"", where, key));
  if (!it->is_number_unsigned() || it->get<uint64_t>() > 0xffffffffu) {
    return make_error(EINVAL, fmt::format("{}: \"{}\" must be a non-negative integer, found {}",
                                          where, key, it->dump()));
  }
  return static_cast<uint32_t>(it->get<uint64_t>());
}

Result<TraceRecord> parse_record(const std::string& line, const std::string& where) {
  const auto j = nlohmann::json::parse(line, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return make_error(EINVAL, fmt::format("{}: not a JSON object", where));
  }
  TraceRecord r;
  EXPERTD_TRY_ASSIGN(r.token, get_u32(j, "token", where));
  EXPERTD_TRY_ASSIGN(r.layer, get_u32(j, "layer", where));
  const auto ex = j.find("experts");
  if (ex == j.end() || !ex->is_array() || ex->empty()) {
    return make_error(EINVAL, fmt::format("{}: \"experts\" must be a non-empty array", where));
  }
  for (const auto& e : *ex) {
    if (!e.is_number_unsigned() || e.get<uint64_t>() > 0xffffffffu) {
      return make_error(
          EINVAL, fmt::format("{}: expert id {} is not a non-negative integer", where, e.dump()));
    }
    r.experts.push_back(static_cast<uint32_t>(e.get<uint64_t>()));
  }
  const auto w = j.find("weights");
  if (w != j.end()) {
    if (!w->is_array() || w->size() != r.experts.size()) {
      return make_error(EINVAL, fmt::format("{}: \"weights\" must be an array as long as "
                                            "\"experts\"",
                                            where));
    }
    for (const auto& x : *w) {
      if (!x.is_number()) {
        return make_error(EINVAL, fmt::format("{}: weight {} is not a number", where, x.dump()));
      }
      r.weights.push_back(x.get<float>());
    }
  }
  return r;
}

}  // namespace

Result<Trace> load_trace_jsonl(const std::string& path) {
  std::ifstream in(path);
  if (!in) return make_error(ENOENT, fmt::format("{}: cannot open trace", path));
  Trace t;
  std::set<uint32_t> tokens;
  std::string line;
  uint64_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    TraceRecord r;
    EXPERTD_TRY_ASSIGN(r, parse_record(line, fmt::format("{}:{}", path, line_no)));
    t.layers = std::max(t.layers, r.layer + 1);
    for (const uint32_t e : r.experts) t.experts = std::max(t.experts, e + 1);
    tokens.insert(r.token);
    t.records.push_back(std::move(r));
  }
  if (t.records.empty()) return make_error(EINVAL, fmt::format("{}: no trace records", path));
  t.tokens = static_cast<uint32_t>(tokens.size());
  return t;
}

Trace make_synthetic_trace(uint32_t tokens, uint32_t layers, uint32_t experts, uint32_t top_k,
                           uint64_t seed, double reuse) {
  std::mt19937_64 rng(seed);
  Trace t;
  t.layers = layers;
  t.experts = experts;
  t.tokens = tokens;
  top_k = std::min(top_k, experts);
  // Per layer, a random permutation gives each expert its popularity rank; weight 1/(rank+1).
  std::vector<std::vector<double>> weight(layers, std::vector<double>(experts));
  for (auto& w : weight) {
    std::vector<uint32_t> rank(experts);
    std::iota(rank.begin(), rank.end(), 0u);
    std::shuffle(rank.begin(), rank.end(), rng);
    for (uint32_t e = 0; e < experts; ++e) w[e] = 1.0 / (rank[e] + 1.0);
  }
  std::vector<std::vector<uint32_t>> previous(layers);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (uint32_t tok = 0; tok < tokens; ++tok) {
    for (uint32_t l = 0; l < layers; ++l) {
      TraceRecord r;
      r.token = tok;
      r.layer = l;
      for (const uint32_t e : previous[l]) {
        if (r.experts.size() < top_k && u(rng) < reuse) r.experts.push_back(e);
      }
      std::discrete_distribution<uint32_t> pick(weight[l].begin(), weight[l].end());
      while (r.experts.size() < top_k) {
        const uint32_t e = pick(rng);
        if (std::find(r.experts.begin(), r.experts.end(), e) == r.experts.end()) {
          r.experts.push_back(e);
        }
      }
      r.weights.assign(r.experts.size(), 1.0f / static_cast<float>(r.experts.size()));
      previous[l] = r.experts;
      t.records.push_back(std::move(r));
    }
  }
  return t;
}

}  // namespace expertd
