// What expertctl's daemon subcommands share: the --socket/--json options, connecting, and the
// one way errors are reported (a line on stderr, and {"error": ...} on stdout with --json).
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/size.h"
#include "client/report.h"
#include "expertd/client.h"

namespace expertctl {

struct DaemonOptions {
  std::string socket;
  bool json = false;
};

// Adds --socket (default $EXPERTD_SOCKET or /run/expertd/expertd.sock) and --json to `cmd`.
void add_daemon_options(CLI::App* cmd, DaemonOptions& opts);

// Reports `message` as the failure of `command`; returns the exit status (1).
int fail(const DaemonOptions& opts, const std::string& command, const std::string& message);

// Connects, or reports why not and returns null.
std::unique_ptr<expertd::client::Client> connect(const DaemonOptions& opts,
                                                 const std::string& command);

// Prints one JSON document on stdout.
void print_json(const nlohmann::ordered_json& j);

// The daemon's prefetch depth as status, stats and top show it: the fixed depth, or "auto (now
// D)" with each model's chosen depth.
std::string prefetch_depth_text(const expertd::client::Stats& st);

using expertd::human_bytes;
using expertd::report::counters_table;
using expertd::report::depths_json;
using expertd::report::depths_table;
using expertd::report::fields_json;
using expertd::report::percent;
std::string human_duration_ms(uint64_t ms);
// hits / (hits + misses) in [0, 1]; -1 with no acquires.
double hit_rate(uint64_t hits, uint64_t misses);

nlohmann::ordered_json stats_json(const expertd::client::Stats& s);

}  // namespace expertctl
