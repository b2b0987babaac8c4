// Renderings of the daemon's numbers that expertctl and expert-tune share: byte counts for people,
// percentages, and the prefetch telemetry by depth as JSON and as a text table.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "expertd/client.h"

namespace expertd::report {

// "87.5%", or "-" for a rate below 0 (undefined).
std::string percent(double rate);

// The prefetch telemetry by depth as a JSON array: the depths with anything counted, with
// precision and recall (against `acquires`) null where undefined.
nlohmann::ordered_json depths_json(const std::vector<client::PrefetchDepthStats>& depths,
                                   uint64_t acquires);
// The same as text lines under a header, `indent` spaces in; "no prefetch hints" when empty.
std::vector<std::string> depths_table(const std::vector<client::PrefetchDepthStats>& depths,
                                      uint64_t acquires, int indent);

}  // namespace expertd::report
