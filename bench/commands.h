// The subcommands of expert-bench, one file each. An add_*_command registers its subcommand (flags
// and help) on the top-level app; when the subcommand is chosen, its callback runs the benchmark
// and stores the process exit status in *exit_code.
#pragma once

#include <CLI/CLI.hpp>

namespace expertd::bench {

// `storage`: the storage engine's cold read bandwidth against raw read loops (storage_bench.cc).
void add_storage_command(CLI::App& app, int* exit_code);

// `ipc`: shared-memory acquire+release round trip against a Cap'n Proto RPC round trip
// (ipc_bench.cc).
void add_ipc_command(CLI::App& app, int* exit_code);

}  // namespace expertd::bench
