// expertctl's daemon subcommands: status, stats, models, pin, unpin, evict, evict-all, set. Each
// connects to expertd's control socket, makes its calls and prints text (or one JSON document with
// --json).
#include <fmt/format.h>

#include <cstdio>
#include <functional>
#include <memory>
#include <string>

#include "base/size.h"
#include "tools/expertctl/commands.h"
#include "tools/expertctl/daemon_util.h"

namespace expertctl {

using expertd::client::Client;
using expertd::client::Stats;
using json = nlohmann::ordered_json;

// ---------------------------------------------------------------------------------------------
// Shared helpers

void add_daemon_options(CLI::App* cmd, DaemonOptions& opts) {
  opts.socket = expertd::client::default_socket();
  cmd->add_option("--socket", opts.socket,
                  "expertd's control socket (default $EXPERTD_SOCKET or "
                  "/run/expertd/expertd.sock)");
  cmd->add_flag("--json", opts.json, "Print one JSON document instead of text");
}

int fail(const DaemonOptions& opts, const std::string& command, const std::string& message) {
  std::fprintf(stderr, "expertctl %s: %s\n", command.c_str(), message.c_str());
  if (opts.json) print_json(json{{"error", message}});
  return 1;
}

std::unique_ptr<Client> connect(const DaemonOptions& opts, const std::string& command) {
  auto c = Client::connect(opts.socket);
  if (!c) {
    fail(opts, command, c.error().message);
    return nullptr;
  }
  return std::move(*c);
}

void print_json(const json& j) {
  std::puts(j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  std::fflush(stdout);
}

std::string human_duration_ms(uint64_t ms) {
  const uint64_t s = ms / 1000;
  if (s < 60) return fmt::format("{:.1f} s", static_cast<double>(ms) / 1000.0);
  if (s < 3600) return fmt::format("{}m{:02}s", s / 60, s % 60);
  if (s < 86400) return fmt::format("{}h{:02}m", s / 3600, s / 60 % 60);
  return fmt::format("{}d{:02}h", s / 86400, s / 3600 % 24);
}

double hit_rate(uint64_t hits, uint64_t misses) {
  const uint64_t n = hits + misses;
  return n == 0 ? -1.0 : static_cast<double>(hits) / static_cast<double>(n);
}

json stats_json(const Stats& s) {
  json j = fields_json(s);
  json models = json::array();
  for (const auto& m : s.models) {
    json mj = fields_json(m);
    mj["scheduler"] = fields_json(m.scheduler);
    mj["layer_hits"] = m.layer_hits;
    mj["layer_misses"] = m.layer_misses;
    mj["read_depth_ns"] = m.read_depth_ns;
    mj["prefetch_depths"] = depths_json(m.prefetch_depths, m.scheduler.acquires);
    mj["hint_precision"] = m.hint_precision;
    mj["shard_loads_failed"] = m.shard_loads_failed;
    mj["shard_read_retries"] = m.shard_read_retries;
    models.push_back(std::move(mj));
  }
  j["models"] = std::move(models);
  json sessions = json::array();
  for (const auto& x : s.sessions) {
    json sj = fields_json(x);
    sj["prefetch_depths"] = depths_json(x.prefetch_depths, x.acquires);
    sessions.push_back(std::move(sj));
  }
  j["sessions"] = std::move(sessions);
  return j;
}

namespace {

// ---------------------------------------------------------------------------------------------
// status

int run_status(const DaemonOptions& o) {
  auto c = connect(o, "status");
  if (!c) return 1;
  auto info = c->info();
  if (!info) return fail(o, "status", info.error().message);
  auto st = c->stats();
  if (!st) return fail(o, "status", st.error().message);
  uint64_t acquires = 0;
  uint64_t hits = 0;
  uint64_t misses = 0;
  for (const auto& m : st->models) {
    acquires += m.scheduler.acquires;
    hits += m.scheduler.hits;
    misses += m.scheduler.acquires - m.scheduler.hits;
  }
  const double rate = hit_rate(hits, misses);
  if (o.json) {
    json j;
    j["socket"] = o.socket;
    j["version"] = info->version;
    j["protocol_version"] = info->protocol_version;
    j["backend"] = info->backend;
    j["backend_detail"] = info->backend_detail;
    j["uptime_ms"] = st->uptime_ms;
    j["models"] = info->models;
    j["sessions"] = st->sessions.size();
    j["acquires"] = acquires;
    j["hits"] = hits;
    j["hit_rate"] = rate < 0 ? json(nullptr) : json(rate);
    j["bytes_read"] = st->bytes_read;
    j["prefetch_depth"] = st->prefetch_depth_auto ? json("auto") : json(st->prefetch_depth);
    json now = json::object();
    for (const auto& m : st->models) now[m.name] = m.prefetch_depth_now;
    j["prefetch_depth_now"] = std::move(now);
    j["queue_depth"] = st->queue_depth;
    j["chunk_bytes"] = st->chunk_bytes;
    j["policy"] = st->policy;
    print_json(j);
    return 0;
  }
  std::string models;
  for (const auto& m : info->models) models += (models.empty() ? "" : ", ") + m;
  fmt::print("expertd {} (protocol {}) at {}\n", info->version, info->protocol_version, o.socket);
  fmt::print("backend    {}\n", info->backend_detail);
  fmt::print("uptime     {}\n", human_duration_ms(st->uptime_ms));
  fmt::print("models     {}\n", models.empty() ? "-" : models);
  fmt::print("sessions   {}\n", st->sessions.size());
  fmt::print("hit rate   {} of {} acquires\n", percent(rate), acquires);
  fmt::print("read       {}\n", human_bytes(st->bytes_read));
  fmt::print("tuning     prefetch depth {}, queue depth {}, chunk {}, policy {}\n",
             prefetch_depth_text(*st), st->queue_depth,
             st->chunk_bytes ? human_bytes(st->chunk_bytes) : std::string("whole slices"),
             st->policy);
  return 0;
}

// ---------------------------------------------------------------------------------------------
// stats

int run_stats(const DaemonOptions& o) {
  auto c = connect(o, "stats");
  if (!c) return 1;
  auto st = c->stats();
  if (!st) return fail(o, "stats", st.error().message);
  if (o.json) {
    print_json(stats_json(*st));
    return 0;
  }
  fmt::print("backend {}; uptime {}; {} reactor loops; read {}\n", st->backend_detail,
             human_duration_ms(st->uptime_ms), st->reactor_loops, human_bytes(st->bytes_read));
  fmt::print(
      "tuning: prefetch depth {}, queue depth {}, policy {}; sessions closed for hostile "
      "requests: {}\n",
      prefetch_depth_text(*st), st->queue_depth, st->policy, st->sessions_closed_hostile);
  for (const auto& m : st->models) {
    const auto& x = m.scheduler;
    fmt::print("\nmodel {}: cache {} / {} slots ready ({} each{}), staging {} slots\n", m.name,
               m.cache_ready, m.cache_slots, human_bytes(m.slot_bytes),
               m.cache_limit < m.cache_slots ? fmt::format("; limited to {}", m.cache_limit) : "",
               m.staging_slots);
    if (!m.file_changed.empty()) fmt::print("  NOT SERVED: {}\n", m.file_changed);
    for (const auto& line : counters_table(x, 2)) fmt::print("{}\n", line);
    for (size_t f = 0; f < m.shard_loads_failed.size(); ++f) {
      const uint64_t retries = f < m.shard_read_retries.size() ? m.shard_read_retries[f] : 0;
      if (m.shard_loads_failed[f] + retries == 0) continue;
      fmt::print("  shard {}: {} loads failed, {} reads retried\n", f, m.shard_loads_failed[f],
                 retries);
    }
    fmt::print("  prefetch depth now {}{}; hint precision estimate by depth:", m.prefetch_depth_now,
               st->prefetch_depth_auto ? " (auto)" : "");
    for (size_t d = 0; d < m.hint_precision.size(); ++d) {
      fmt::print(" {}{}: {}", d + 1, d + 1 == m.hint_precision.size() ? "+" : "",
                 percent(m.hint_precision[d]));
    }
    fmt::print("\n  disk busy {} of active time without prefetch{}\n",
               m.disk_busy < 0 ? std::string("not measured yet") : percent(m.disk_busy),
               st->prefetch_depth_auto
                   ? fmt::format("; auto reads a depth ahead when its hints are right > {}",
                                 percent(m.prefetch_auto_need))
                   : "");
    fmt::print("  prefetch by depth (layers ahead of the cursor):\n");
    for (const auto& line : depths_table(m.prefetch_depths, x.acquires, 2)) {
      fmt::print("{}\n", line);
    }
    fmt::print("  layer  hits       misses     hit rate\n");
    for (size_t l = 0; l < m.layer_hits.size(); ++l) {
      const uint64_t h = m.layer_hits[l];
      const uint64_t mi = l < m.layer_misses.size() ? m.layer_misses[l] : 0;
      if (h + mi == 0) continue;
      fmt::print("  {:>5}  {:<10} {:<10} {}\n", l, h, mi, percent(hit_rate(h, mi)));
    }
  }
  if (!st->sessions.empty()) {
    fmt::print("\nsession  model        client           pid      uid    acquires   holds\n");
    for (const auto& s : st->sessions) {
      fmt::print("{:>7}  {:<12} {:<16} {:<8} {:<6} {:<10} {}\n", s.session, s.model, s.client,
                 s.pid, s.uid, s.acquires, s.holds);
    }
    for (const auto& s : st->sessions) {
      const auto lines = depths_table(s.prefetch_depths, s.acquires, 4);
      if (lines.size() < 2) continue;  // no hints
      fmt::print("\nsession {} prefetch by depth:\n", s.session);
      for (const auto& line : lines) fmt::print("{}\n", line);
    }
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------
// models

int run_models(const DaemonOptions& o) {
  auto c = connect(o, "models");
  if (!c) return 1;
  auto info = c->info();
  if (!info) return fail(o, "models", info.error().message);
  auto st = c->stats();
  if (!st) return fail(o, "models", st.error().message);
  json out = json::array();
  if (!o.json) {
    fmt::print("{:<16} {:<12} {:>6} {:>8} {:>5} {:>12} {:>8}\n", "model", "arch", "layers",
               "experts", "top-k", "slot", "cached");
  }
  for (const auto& name : info->models) {
    auto l = c->open_model(name);
    if (!l) return fail(o, "models", l.error().message);
    uint32_t ready = 0;
    uint32_t slots = 0;
    for (const auto& m : st->models) {
      if (m.name == name) {
        ready = m.cache_ready;
        slots = m.cache_slots;
      }
    }
    uint32_t moe_layers = 0;
    for (uint32_t layer = 0; layer < l->block_count; ++layer) moe_layers += l->has_experts(layer);
    if (o.json) {
      json lj = fields_json(*l);
      lj["moe_layers"] = moe_layers;
      lj["cache_slots"] = slots;
      lj["cache_ready"] = ready;
      out.push_back(std::move(lj));
    } else {
      fmt::print("{:<16} {:<12} {:>6} {:>8} {:>5} {:>12} {:>8}\n", name, l->architecture,
                 l->block_count, l->expert_count, l->top_k, human_bytes(l->slot_bytes),
                 fmt::format("{}/{}", ready, slots));
    }
  }
  if (o.json) print_json(out);
  return 0;
}

// ---------------------------------------------------------------------------------------------
// pin, unpin, evict

struct ExpertOptions {
  DaemonOptions daemon;
  std::string model;
  uint32_t layer = 0;
  uint32_t expert = 0;
};

int run_expert_op(const ExpertOptions& o, const std::string& op) {
  auto c = connect(o.daemon, op);
  if (!c) return 1;
  const expertd::Status st = op == "pin"     ? c->pin(o.model, o.layer, o.expert)
                             : op == "unpin" ? c->unpin(o.model, o.layer, o.expert)
                                             : c->evict(o.model, o.layer, o.expert);
  if (!st) return fail(o.daemon, op, st.error().message);
  if (o.daemon.json) {
    print_json(json{
        {"ok", true}, {"op", op}, {"model", o.model}, {"layer", o.layer}, {"expert", o.expert}});
  } else {
    const char* done = op == "pin" ? "pinned" : op == "unpin" ? "unpinned" : "evicted";
    fmt::print("{} model {} layer {} expert {}\n", done, o.model, o.layer, o.expert);
  }
  return 0;
}

struct EvictAllOptions {
  DaemonOptions daemon;
  std::string model;
};

int run_evict_all(const EvictAllOptions& o) {
  auto c = connect(o.daemon, "evict-all");
  if (!c) return 1;
  auto n = c->evict_all(o.model);
  if (!n) return fail(o.daemon, "evict-all", n.error().message);
  if (o.daemon.json) {
    print_json(json{{"ok", true}, {"op", "evict-all"}, {"model", o.model}, {"evicted", *n}});
  } else {
    fmt::print("evicted {} experts of model {}\n", *n, o.model);
  }
  return 0;
}

void add_expert_command(CLI::App& app, std::function<int()>* run, const std::string& op,
                        const std::string& help) {
  auto opts = std::make_shared<ExpertOptions>();
  CLI::App* cmd = app.add_subcommand(op, help);
  cmd->add_option("model", opts->model, "Model name (as in expertd's configuration)")->required();
  cmd->add_option("layer", opts->layer, "Layer (block) index")->required();
  cmd->add_option("expert", opts->expert, "Expert index")->required();
  add_daemon_options(cmd, opts->daemon);
  cmd->callback([run, opts, op] { *run = [opts, op] { return run_expert_op(*opts, op); }; });
}

// ---------------------------------------------------------------------------------------------
// set

struct SetOptions {
  DaemonOptions daemon;
  std::string knob;
  std::string value;
  std::string model;  // cache-limit only
};

// The model a per-model knob is for: --model, or the only model the daemon serves.
expertd::Result<const expertd::client::ModelStats*> pick_model(const Stats& st,
                                                               const std::string& model) {
  std::string names;
  for (const auto& m : st.models) {
    if (m.name == model || (model.empty() && st.models.size() == 1)) return &m;
    names += (names.empty() ? "" : ", ") + m.name;
  }
  if (model.empty()) {
    return expertd::make_error(EINVAL, fmt::format("name the model with --model (models: {})",
                                                   names.empty() ? "-" : names));
  }
  return expertd::make_error(
      ENOENT, fmt::format("model '{}' is not served by this daemon (models: {})", model, names));
}

// cache-limit: a slot count, or a size (4GiB, 25%: of the model's whole cache) turned into slots.
int run_set_cache_limit(const SetOptions& o) {
  auto c = connect(o.daemon, "set");
  if (!c) return 1;
  auto st = c->stats();
  if (!st) return fail(o.daemon, "set", st.error().message);
  auto m = pick_model(*st, o.model);
  if (!m) return fail(o.daemon, "set", m.error().message);
  const auto& model = **m;
  uint64_t slots = 0;
  const bool plain =
      !o.value.empty() && o.value.find_first_not_of("0123456789") == std::string::npos;
  if (plain) {
    slots = std::stoull(o.value.substr(0, 12));
  } else {
    auto bytes = expertd::parse_size("cache-limit", o.value, model.cache_slots * model.slot_bytes);
    if (!bytes) return fail(o.daemon, "set", bytes.error().message);
    slots = model.slot_bytes ? *bytes / model.slot_bytes : 0;
    if (slots == 0 && *bytes > 0) slots = 1;  // "0" means the whole cache: round a size up
  }
  if (slots > model.cache_slots) {
    return fail(o.daemon, "set",
                fmt::format("cache-limit {}: model '{}' has {} cache slots of {} (0 = all)",
                            o.value, model.name, model.cache_slots, human_bytes(model.slot_bytes)));
  }
  const auto n = static_cast<uint32_t>(slots);
  if (const auto r = c->set_cache_limit(model.name, n); !r) {
    return fail(o.daemon, "set", r.error().message);
  }
  const uint32_t effective = n == 0 ? model.cache_slots : n;
  if (o.daemon.json) {
    print_json(json{{"ok", true},
                    {"knob", o.knob},
                    {"model", model.name},
                    {"value", n},
                    {"cache_limit", effective},
                    {"cache_limit_bytes", uint64_t{effective} * model.slot_bytes}});
  } else {
    fmt::print("cache-limit of model {} set to {} of {} slots ({})\n", model.name, effective,
               model.cache_slots, human_bytes(uint64_t{effective} * model.slot_bytes));
  }
  return 0;
}

int run_set(const SetOptions& o) {
  if (o.knob == "cache-limit") return run_set_cache_limit(o);
  uint32_t number = 0;
  const bool numeric = o.knob == "prefetch-depth" || o.knob == "queue-depth";
  const bool automatic = o.knob == "prefetch-depth" && o.value == "auto";
  if (automatic) {
    number = expertd::client::kPrefetchDepthAuto;
  } else if (numeric) {
    try {
      size_t used = 0;
      const unsigned long v = std::stoul(o.value, &used);
      if (used != o.value.size() || v > UINT32_MAX) throw std::out_of_range(o.value);
      number = static_cast<uint32_t>(v);
    } catch (const std::exception&) {
      return fail(o.daemon, "set",
                  fmt::format("{} '{}': expected a non-negative integer{}", o.knob, o.value,
                              o.knob == "prefetch-depth" ? " or auto" : ""));
    }
  }
  auto c = connect(o.daemon, "set");
  if (!c) return 1;
  const expertd::Status st = o.knob == "prefetch-depth" ? c->set_prefetch_depth(number)
                             : o.knob == "queue-depth"  ? c->set_queue_depth(number)
                                                        : c->set_policy(o.value);
  if (!st) return fail(o.daemon, "set", st.error().message);
  if (o.daemon.json) {
    json j{{"ok", true}, {"knob", o.knob}};
    j["value"] = numeric && !automatic ? json(number) : json(o.value);
    print_json(j);
  } else {
    fmt::print("{} set to {}\n", o.knob, o.value);
  }
  return 0;
}

}  // namespace

void add_daemon_commands(CLI::App& app, std::function<int()>* run) {
  {
    auto opts = std::make_shared<DaemonOptions>();
    CLI::App* cmd = app.add_subcommand("status", "Is expertd up: version, backend, hit rate");
    add_daemon_options(cmd, *opts);
    cmd->callback([run, opts] { *run = [opts] { return run_status(*opts); }; });
  }
  {
    auto opts = std::make_shared<DaemonOptions>();
    CLI::App* cmd =
        app.add_subcommand("stats", "Every counter: per model, per layer and per session");
    add_daemon_options(cmd, *opts);
    cmd->callback([run, opts] { *run = [opts] { return run_stats(*opts); }; });
  }
  {
    auto opts = std::make_shared<DaemonOptions>();
    CLI::App* cmd = app.add_subcommand("models", "The models expertd serves and their layout");
    add_daemon_options(cmd, *opts);
    cmd->callback([run, opts] { *run = [opts] { return run_models(*opts); }; });
  }
  add_expert_command(app, run, "pin", "Keep a cached expert in the cache (never evicted)");
  add_expert_command(app, run, "unpin", "Let a pinned expert be evicted again");
  add_expert_command(app, run, "evict", "Drop a cached expert that nobody holds");
  {
    auto opts = std::make_shared<EvictAllOptions>();
    CLI::App* cmd = app.add_subcommand(
        "evict-all", "Empty a model's cache (all but held and pinned experts) and its history");
    cmd->add_option("model", opts->model, "Model name (as in expertd's configuration)")->required();
    add_daemon_options(cmd, opts->daemon);
    cmd->callback([run, opts] { *run = [opts] { return run_evict_all(*opts); }; });
  }
  {
    auto opts = std::make_shared<SetOptions>();
    CLI::App* cmd = app.add_subcommand("set", "Change a tuning knob of the running daemon");
    cmd->add_option("knob", opts->knob, "prefetch-depth, queue-depth, policy or cache-limit")
        ->required()
        ->check(CLI::IsMember({"prefetch-depth", "queue-depth", "policy", "cache-limit"}));
    cmd->add_option("value", opts->value,
                    "The new value; cache-limit: slots (0 = the whole cache) or a size (512MiB)")
        ->required();
    cmd->add_option("--model", opts->model,
                    "cache-limit: the model (default: the only one the daemon serves)");
    add_daemon_options(cmd, opts->daemon);
    cmd->callback([run, opts] { *run = [opts] { return run_set(*opts); }; });
  }
}

std::string prefetch_depth_text(const Stats& st) {
  if (!st.prefetch_depth_auto) return std::to_string(st.prefetch_depth);
  std::string now;
  for (const auto& m : st.models) {
    now += fmt::format("{}{}{}", now.empty() ? "" : ", ", st.models.size() > 1 ? m.name + " " : "",
                       m.prefetch_depth_now);
  }
  return fmt::format("auto (now {})", now.empty() ? "-" : now);
}

}  // namespace expertctl
