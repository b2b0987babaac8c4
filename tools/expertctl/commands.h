// expertctl's subcommands. Each registers itself on the CLI11 app and runs when selected;
// main() wires them together.
#pragma once

#include <functional>

#include <CLI/CLI.hpp>

namespace expertctl {

// Registers `inspect`; once parsing selects it, `*run` is set to the function that runs it.
void add_inspect_command(CLI::App& app, std::function<int()>* run);

}  // namespace expertctl
