#include "tools/trace/trace.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
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

}  // namespace expertd
