#include "client/report.h"

#include <fmt/format.h>

#include <algorithm>

#include "base/size.h"

namespace expertd::report {

namespace {

using json = nlohmann::ordered_json;

json rate_json(double rate) { return rate < 0 ? json(nullptr) : json(rate); }

// Anything counted at this depth (its key, the depth, aside).
bool counted(const client::PrefetchDepthStats& d) {
  bool any = false;
  client::for_each_field(d, [&](const char* name, uint64_t value, const char*) {
    any = any || (!client::is_key_field(name) && value != 0);
  });
  return any;
}

}  // namespace

std::string percent(double rate) {
  return rate < 0 ? std::string("-") : fmt::format("{:.1f}%", 100.0 * rate);
}

std::string counter_text(std::string_view name, uint64_t value) {
  const bool bytes = name.ends_with("bytes") || name.starts_with("bytes_");
  return bytes ? human_bytes(value) : std::to_string(value);
}

std::vector<std::string> counters_table(const client::SchedulerStats& s, int indent) {
  size_t width = 0;
  client::for_each_field(s, [&](const char* name, uint64_t, const char*) {
    width = std::max(width, std::string_view(name).size());
  });
  std::vector<std::string> lines;
  client::for_each_field(s, [&](const char* name, uint64_t value, const char* what) {
    lines.push_back(fmt::format("{:{}}{:<{}} {:>12}  {}", "", indent, name, width,
                                counter_text(name, value), what));
  });
  return lines;
}

json depths_json(const std::vector<client::PrefetchDepthStats>& depths, uint64_t acquires) {
  json out = json::array();
  for (const auto& d : depths) {
    if (!counted(d)) continue;
    json j = fields_json(d);
    j["precision"] = rate_json(d.precision());
    j["recall"] = rate_json(d.recall(acquires));
    out.push_back(std::move(j));
  }
  return out;
}

std::vector<std::string> depths_table(const std::vector<client::PrefetchDepthStats>& depths,
                                      uint64_t acquires, int indent) {
  // Columns: every field (the deepest bucket as "8+", bytes for people), precision, recall.
  std::vector<std::vector<std::string>> rows(1);
  client::for_each_field(client::PrefetchDepthStats{},
                         [&](const char* name, uint64_t, const char*) { rows[0].push_back(name); });
  rows[0].insert(rows[0].end(), {"precision", "recall"});
  for (const auto& d : depths) {
    if (!counted(d)) continue;
    auto& row = rows.emplace_back();
    client::for_each_field(d, [&](const char* name, uint64_t value, const char*) {
      row.push_back(client::is_key_field(name) && value == 8 ? std::string("8+")
                                                             : counter_text(name, value));
    });
    row.insert(row.end(), {percent(d.precision()), percent(d.recall(acquires))});
  }
  const std::string pad(static_cast<size_t>(indent), ' ');
  if (rows.size() == 1) return {pad + "no prefetch hints"};
  std::vector<size_t> widths(rows[0].size(), 0);
  for (const auto& row : rows) {
    for (size_t c = 0; c < row.size(); ++c) widths[c] = std::max(widths[c], row[c].size());
  }
  std::vector<std::string> lines;
  for (const auto& row : rows) {
    std::string line = pad;
    for (size_t c = 0; c < row.size(); ++c) {
      line += fmt::format("{}{:>{}}", c ? "  " : "", row[c], widths[c]);
    }
    lines.push_back(std::move(line));
  }
  return lines;
}

}  // namespace expertd::report
