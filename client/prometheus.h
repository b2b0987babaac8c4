// The daemon's stats (Client::stats()) as Prometheus text exposition, format 0.0.4: every field of
// the schema's Stats, named expertd_*, with HELP from the schema's comments (client/prometheus.cc
// says how the names are made). `expertctl metrics` and expert-serve's /metrics print it.
#pragma once

#include <string>

#include "expertd/client.h"
#include "expertd/result.h"

namespace expertd::client {

// The exposition, or an error naming two fields that would export the same name.
Result<std::string> prometheus_text(const Stats& stats);

}  // namespace expertd::client
