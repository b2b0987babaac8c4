// expert-bench: measurements of expertd's parts against what the machine can do. One subcommand
// per part (bench/commands.h); each prints a table, or with --json one object for scripts.
#include <CLI/CLI.hpp>
#include <string>

#include "bench/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"expert-bench: measure expertd against the machine's ceilings"};
  app.set_version_flag("--version", std::string("expert-bench ") + EXPERTD_VERSION);
  app.require_subcommand(1);
  int exit_code = 0;
  expertd::bench::add_storage_command(app, &exit_code);
  expertd::bench::add_ipc_command(app, &exit_code);
  CLI11_PARSE(app, argc, argv);
  return exit_code;
}
