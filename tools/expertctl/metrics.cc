// `expertctl metrics`: the daemon's stats as Prometheus text exposition (client/prometheus.cc),
// for node_exporter's textfile collector (--output writes the file atomically) or a scrape
// wrapper.
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>

#include "base/fd.h"
#include "client/prometheus.h"
#include "tools/expertctl/commands.h"
#include "tools/expertctl/daemon_util.h"

namespace expertctl {
namespace {

using expertd::client::prometheus_text;

// Writes `text` to `path` as the textfile collector needs: a temporary file in the same
// directory, then rename(2), so a reader sees the old file or the new one, never half of one.
expertd::Status write_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = fmt::format("{}.tmp.{}", path, ::getpid());
  expertd::UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd.valid()) {
    return expertd::make_error(errno,
                               fmt::format("cannot create {}: {}", tmp, std::strerror(errno)));
  }
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd.get(), text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int e = n < 0 ? errno : EIO;
      ::unlink(tmp.c_str());
      return expertd::make_error(e, fmt::format("cannot write {}: {}", tmp, std::strerror(e)));
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd.get()) != 0 || ::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    return expertd::make_error(
        e, fmt::format("cannot replace {} with {}: {}", path, tmp, std::strerror(e)));
  }
  return expertd::Ok{};
}

struct MetricsOptions {
  DaemonOptions daemon;
  std::string output;
};

int run_metrics(const MetricsOptions& o) {
  auto c = connect(o.daemon, "metrics");
  if (!c) return 1;
  auto st = c->stats();
  if (!st) return fail(o.daemon, "metrics", st.error().message);
  const auto text = prometheus_text(*st);
  if (!text) return fail(o.daemon, "metrics", text.error().message);
  if (o.output.empty()) {
    std::fwrite(text->data(), 1, text->size(), stdout);
    std::fflush(stdout);
    return 0;
  }
  if (auto w = write_atomically(o.output, *text); !w) {
    return fail(o.daemon, "metrics", w.error().message);
  }
  return 0;
}

}  // namespace

void add_metrics_command(CLI::App& app, std::function<int()>* run) {
  auto opts = std::make_shared<MetricsOptions>();
  CLI::App* cmd = app.add_subcommand(
      "metrics",
      "Every stats counter in Prometheus text format (node_exporter's textfile collector)");
  opts->daemon.socket = expertd::client::default_socket();
  cmd->add_option("--socket", opts->daemon.socket,
                  "expertd's control socket (default $EXPERTD_SOCKET or "
                  "/run/expertd/expertd.sock)");
  cmd->add_option("--output", opts->output,
                  "Write to FILE atomically (a temporary file renamed over it), e.g. "
                  "/var/lib/prometheus/node-exporter/expertd.prom; default: stdout");
  cmd->callback([run, opts] { *run = [opts] { return run_metrics(*opts); }; });
}

}  // namespace expertctl
