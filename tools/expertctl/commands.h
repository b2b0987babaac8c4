// expertctl's subcommands. Each registers itself on the CLI11 app and runs when selected;
// main() wires them together.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace expertctl {

// Registers `inspect`; once parsing selects it, `*run` is set to the function that runs it.
void add_inspect_command(CLI::App& app, std::function<int()>* run);

// Registers the daemon subcommands: status, stats, models, pin, unpin, evict, evict-all, set
// (daemon_commands.cc). Each has --socket and --json.
void add_daemon_commands(CLI::App& app, std::function<int()>* run);

// Registers `top`, the live view (top.cc).
void add_top_command(CLI::App& app, std::function<int()>* run);

// Registers `metrics`, the stats in Prometheus text format (metrics.cc).
void add_metrics_command(CLI::App& app, std::function<int()>* run);

// Registers `tokenize`, text to token ids with a GGUF's tokenizer, offline (tokenize.cc).
void add_tokenize_command(CLI::App& app, std::function<int()>* run);

}  // namespace expertctl
