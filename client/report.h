// Renderings of the daemon's numbers that expertctl and expert-tune share: byte counts for people,
// percentages, every plain field of a struct as JSON, the scheduler's counters as text, and the
// prefetch telemetry by depth as JSON and as a text table. The fields come from the schema's lists
// (client::for_each_field): a field added to client/expertd.capnp shows up here by itself.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "expertd/client.h"

namespace expertd::report {

// "87.5%", or "-" for a rate below 0 (undefined).
std::string percent(double rate);

// Every plain field of `x` (numbers and text), by its snake_case name, in schema order.
template <typename T>
nlohmann::ordered_json fields_json(const T& x) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  client::for_each_field(
      x, [&](const char* name, const auto& value, const char*) { j[name] = value; });
  return j;
}

// A counter for people: a byte count (a field named *bytes* or bytes_*) as "1.5 MiB", else the
// number.
std::string counter_text(std::string_view name, uint64_t value);

// The scheduler's counters as text lines, `indent` spaces in: name, value, what it counts.
std::vector<std::string> counters_table(const client::SchedulerStats& s, int indent);

// The prefetch telemetry by depth as a JSON array: the depths with anything counted, every field
// plus precision and recall (against `acquires`), null where undefined.
nlohmann::ordered_json depths_json(const std::vector<client::PrefetchDepthStats>& depths,
                                   uint64_t acquires);
// The same as a text table under a header, `indent` spaces in; "no prefetch hints" when empty.
std::vector<std::string> depths_table(const std::vector<client::PrefetchDepthStats>& depths,
                                      uint64_t acquires, int indent);

}  // namespace expertd::report
