// expertctl: the command-line client of expertd. `inspect` and `tokenize` work offline on GGUF
// files; the daemon subcommands talk to expertd over its control socket.
#include <CLI/CLI.hpp>
#include <functional>
#include <string>

#include "tools/expertctl/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"expertctl: inspect MoE models and control the expertd daemon"};
  app.set_version_flag("--version", std::string("expertctl ") + EXPERTD_VERSION);
  app.require_subcommand(1);
  std::function<int()> run;
  expertctl::add_inspect_command(app, &run);
  expertctl::add_daemon_commands(app, &run);
  expertctl::add_top_command(app, &run);
  expertctl::add_metrics_command(app, &run);
  expertctl::add_tokenize_command(app, &run);
  CLI11_PARSE(app, argc, argv);
  return run ? run() : 2;
}
