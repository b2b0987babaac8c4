#include "client/report.h"

#include <fmt/format.h>

#include "base/size.h"

namespace expertd::report {

namespace {

using json = nlohmann::ordered_json;

json rate_json(double rate) { return rate < 0 ? json(nullptr) : json(rate); }

bool counted(const client::PrefetchDepthStats& d) {
  return d.hints + d.loads + d.useful + d.wasted + d.hinted_acquires > 0;
}

}  // namespace

std::string percent(double rate) {
  return rate < 0 ? std::string("-") : fmt::format("{:.1f}%", 100.0 * rate);
}

json depths_json(const std::vector<client::PrefetchDepthStats>& depths, uint64_t acquires) {
  json out = json::array();
  for (const auto& d : depths) {
    if (!counted(d)) continue;
    out.push_back(json{{"depth", d.depth},
                       {"hints", d.hints},
                       {"loads", d.loads},
                       {"useful", d.useful},
                       {"wasted", d.wasted},
                       {"useful_bytes", d.useful_bytes},
                       {"wasted_bytes", d.wasted_bytes},
                       {"hinted_acquires", d.hinted_acquires},
                       {"precision", rate_json(d.precision())},
                       {"recall", rate_json(d.recall(acquires))}});
  }
  return out;
}

std::vector<std::string> depths_table(const std::vector<client::PrefetchDepthStats>& depths,
                                      uint64_t acquires, int indent) {
  const std::string pad(static_cast<size_t>(indent), ' ');
  constexpr const char* kRow = "{}{:>5} {:>9} {:>8} {:>8} {:>8} {:>11} {:>11} {:>9} {:>7}";
  std::vector<std::string> lines;
  for (const auto& d : depths) {
    if (!counted(d)) continue;
    if (lines.empty()) {
      lines.push_back(fmt::format(kRow, pad, "depth", "hints", "loads", "useful", "wasted",
                                  "useful", "wasted", "precision", "recall"));
    }
    lines.push_back(fmt::format(
        kRow, pad, d.depth == 8 ? std::string("8+") : std::to_string(d.depth), d.hints, d.loads,
        d.useful, d.wasted, human_bytes(d.useful_bytes), human_bytes(d.wasted_bytes),
        percent(d.precision()), percent(d.recall(acquires))));
  }
  if (lines.empty()) lines.push_back(pad + "no prefetch hints");
  return lines;
}

}  // namespace expertd::report
