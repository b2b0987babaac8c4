#include "daemon/config.h"

#include <fmt/format.h>
#include <toml++/toml.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <set>

#include "policy/policy.h"

namespace expertd {

Result<BackendKind> parse_backend(const std::string& what, const std::string& value) {
  if (value == "uring" || value == "io_uring") return BackendKind::Uring;
  if (value == "pread") return BackendKind::Pread;
  return make_error(EINVAL, fmt::format("{} '{}': must be 'uring' or 'pread'", what, value));
}

Result<uint32_t> parse_prefetch_depth(const std::string& what, const std::string& value) {
  if (value == "auto") return kPrefetchDepthAutoValue;
  uint64_t v = 0;
  bool digits = !value.empty() && value.size() <= 10;
  for (const char ch : value) {
    digits = digits && std::isdigit(static_cast<unsigned char>(ch));
    if (digits) v = v * 10 + static_cast<uint64_t>(ch - '0');
  }
  if (!digits) {
    return make_error(EINVAL, fmt::format("{} '{}': must be auto or a number of layers 0..{}", what,
                                          value, kMaxPrefetchDepth));
  }
  if (v > kMaxPrefetchDepth) {
    return make_error(EINVAL, fmt::format("{} {}: must be 0..{} (layers ahead) or auto", what, v,
                                          kMaxPrefetchDepth));
  }
  return static_cast<uint32_t>(v);
}

std::string prefetch_depth_name(uint32_t depth) {
  return depth == kPrefetchDepthAutoValue ? std::string("auto") : std::to_string(depth);
}

const char* backend_kind_name(BackendKind kind) {
  return kind == BackendKind::Uring ? "uring" : "pread";
}

namespace {

Error key_error(const std::string& path, const toml::node& node, const std::string& key,
                const std::string& what) {
  const auto& src = node.source();
  return make_error(
      EINVAL, fmt::format("{}:{}:{}: {}: {}", path, src.begin.line, src.begin.column, key, what));
}

template <typename T>
Status read_uint(const std::string& path, const toml::table& t, const char* key, T& out) {
  const toml::node* n = t.get(key);
  if (n == nullptr) return Ok{};
  const auto v = n->value_exact<int64_t>();
  if (!v || *v < 0 || static_cast<uint64_t>(*v) > std::numeric_limits<T>::max()) {
    return key_error(path, *n, key, "must be a non-negative integer");
  }
  out = static_cast<T>(*v);
  return Ok{};
}

Status read_string(const std::string& path, const toml::table& t, const char* key,
                   std::string& out) {
  const toml::node* n = t.get(key);
  if (n == nullptr) return Ok{};
  if (const auto v = n->value<std::string>()) {
    out = *v;
    return Ok{};
  }
  if (const auto i = n->value_exact<int64_t>(); i && *i >= 0) {  // sizes may be plain byte counts
    out = std::to_string(*i);
    return Ok{};
  }
  return key_error(path, *n, key, "must be a string");
}

template <typename T>
Status read_id_list(const std::string& path, const toml::table& t, const char* key,
                    std::vector<T>& out) {
  const toml::node* n = t.get(key);
  if (n == nullptr) return Ok{};
  const toml::array* a = n->as_array();
  if (a == nullptr) return key_error(path, *n, key, "must be an array of integers");
  out.clear();
  for (const auto& e : *a) {
    const auto v = e.value_exact<int64_t>();
    if (!v || *v < 0 || *v > 0xffffffffll) {
      return key_error(path, e, key, "must hold non-negative integers (uids or gids)");
    }
    out.push_back(static_cast<T>(*v));
  }
  return Ok{};
}

}  // namespace

Status load_config_file(const std::string& path, DaemonConfig& c) {
  toml::table t;
  try {
    t = toml::parse_file(path);  // configuration is start-up: exceptions are allowed here
  } catch (const toml::parse_error& e) {
    const bool missing = e.source().begin.line == 0;
    return make_error(missing ? ENOENT : EINVAL,
                      missing ? fmt::format("{}: {}", path, e.description())
                              : fmt::format("{}:{}:{}: {}", path, e.source().begin.line,
                                            e.source().begin.column, e.description()));
  }
  for (const auto& [k, v] : t) {
    const auto known = std::find_if(std::begin(kConfigKeys), std::end(kConfigKeys),
                                    [&](const ConfigKey& key) { return key.key == k.str(); });
    if (known == std::end(kConfigKeys)) {
      std::string names;
      for (const auto& key : kConfigKeys) {
        names += fmt::format("{}{}", names.empty() ? "" : ", ",
                             key.key == "models" ? "[models]" : key.key);
      }
      return key_error(path, v, std::string(k.str()), "unknown key (known: " + names + ")");
    }
  }
  c.config_path = path;
  EXPERTD_TRY(read_string(path, t, "socket", c.socket));
  EXPERTD_TRY(read_string(path, t, "cache", c.cache));
  EXPERTD_TRY(read_string(path, t, "staging", c.staging));
  if (const toml::node* n = t.get("prefetch_depth")) {
    // "auto" or an integer (a quoted integer too, as the flag takes it).
    std::string v;
    if (const auto str = n->value_exact<std::string>()) {
      v = *str;
    } else if (const auto i = n->value_exact<int64_t>(); i && *i >= 0) {
      v = std::to_string(*i);
    } else {
      return key_error(path, *n, "prefetch_depth", "must be \"auto\" or a number of layers");
    }
    const auto& src = n->source();
    EXPERTD_TRY_ASSIGN(
        c.prefetch_depth,
        parse_prefetch_depth(
            fmt::format("{}:{}:{}: prefetch_depth", path, src.begin.line, src.begin.column), v));
  }
  EXPERTD_TRY(read_uint(path, t, "queue_depth", c.queue_depth));
  EXPERTD_TRY(read_uint(path, t, "max_sessions", c.max_sessions));
  EXPERTD_TRY(read_uint(path, t, "acquire_timeout_ms", c.acquire_timeout_ms));
  EXPERTD_TRY(read_uint(path, t, "read_timeout_ms", c.read_timeout_ms));
  EXPERTD_TRY(read_uint(path, t, "reactor_spin_us", c.reactor_spin_us));
  EXPERTD_TRY(read_uint(path, t, "max_connections_per_uid", c.max_connections_per_uid));
  EXPERTD_TRY(read_uint(path, t, "max_sessions_per_uid", c.max_sessions_per_uid));
  EXPERTD_TRY(read_uint(path, t, "idle_timeout_s", c.idle_timeout_s));
  std::string max_frame;
  EXPERTD_TRY(read_string(path, t, "max_frame", max_frame));
  if (!max_frame.empty()) {
    EXPERTD_TRY_ASSIGN(c.max_frame_bytes, parse_size(path + ": max_frame", max_frame, 0));
  }
  std::string chunk;
  EXPERTD_TRY(read_string(path, t, "chunk", chunk));
  if (!chunk.empty() && chunk != "auto") {
    EXPERTD_TRY_ASSIGN(c.chunk_bytes, parse_size(path + ": chunk", chunk, 0));
  }
  std::string backend;
  EXPERTD_TRY(read_string(path, t, "backend", backend));
  if (!backend.empty()) {
    EXPERTD_TRY_ASSIGN(c.backend, parse_backend(path + ": backend", backend));
  }
  EXPERTD_TRY(read_string(path, t, "policy", c.policy));
  for (const char* key : {"lock_memory", "verify", "checksums"}) {
    if (const toml::node* n = t.get(key)) {
      const auto b = n->value_exact<bool>();
      if (!b) return key_error(path, *n, key, "must be true or false");
      const std::string k = key;
      (k == "verify" ? c.verify : k == "checksums" ? c.checksums : c.lock_memory) = *b;
    }
  }
  EXPERTD_TRY(read_string(path, t, "state_directory", c.state_directory));
  EXPERTD_TRY(read_id_list(path, t, "allowed_uids", c.allowed_uids));
  EXPERTD_TRY(read_id_list(path, t, "allowed_gids", c.allowed_gids));
  EXPERTD_TRY(read_id_list(path, t, "admin_gids", c.admin_gids));
  if (const toml::node* n = t.get("models")) {
    const toml::table* m = n->as_table();
    if (m == nullptr) return key_error(path, *n, "models", "must be a table of name = \"path\"");
    for (const auto& [name, p] : *m) {
      const auto v = p.value<std::string>();
      if (!v) {
        return key_error(path, p, fmt::format("models.{}", name.str()),
                         "must be the path of a GGUF file (string)");
      }
      c.models.push_back(ModelConfig{std::string(name.str()), *v});
    }
  }
  return Ok{};
}

Status validate_config(const DaemonConfig& c) {
  if (c.models.empty()) {
    return make_error(EINVAL,
                      "no models configured: add [models] NAME = \"PATH\" to the "
                      "configuration, or pass --model NAME=PATH");
  }
  std::set<std::string> names;
  for (const auto& m : c.models) {
    if (m.name.empty() || m.name.find_first_of(" /\t") != std::string::npos) {
      return make_error(EINVAL, fmt::format("model name '{}': must be non-empty, without spaces "
                                            "or slashes",
                                            m.name));
    }
    if (!names.insert(m.name).second) {
      return make_error(EINVAL, fmt::format("model '{}' is configured twice", m.name));
    }
  }
  const uint64_t usable = usable_memory_bytes();  // reads /proc and /sys: once
  EXPERTD_TRY(parse_size("cache", c.cache, usable));
  EXPERTD_TRY(parse_size("staging", c.staging, usable));
  if (c.socket.empty()) return make_error(EINVAL, "socket: must be a path");
  if (c.prefetch_depth > kMaxPrefetchDepth && c.prefetch_depth != kPrefetchDepthAutoValue) {
    return make_error(EINVAL, fmt::format("prefetch_depth {}: must be 0..{} (layers ahead) or auto",
                                          c.prefetch_depth, kMaxPrefetchDepth));
  }
  if (c.queue_depth > kMaxQueueDepth) {
    return make_error(EINVAL, fmt::format("queue_depth {}: must be 0..{} (0 = probe the disk)",
                                          c.queue_depth, kMaxQueueDepth));
  }
  if (c.max_sessions == 0 || c.max_sessions > 4096) {
    return make_error(EINVAL, fmt::format("max_sessions {}: must be 1..4096", c.max_sessions));
  }
  if (c.acquire_timeout_ms < kMinAcquireTimeoutMs || c.acquire_timeout_ms > kMaxAcquireTimeoutMs) {
    return make_error(EINVAL,
                      fmt::format("acquire_timeout_ms {}: must be {}..{}", c.acquire_timeout_ms,
                                  kMinAcquireTimeoutMs, kMaxAcquireTimeoutMs));
  }
  if (c.read_timeout_ms != 0 &&
      (c.read_timeout_ms < kMinReadTimeoutMs || c.read_timeout_ms > kMaxReadTimeoutMs)) {
    return make_error(EINVAL,
                      fmt::format("read_timeout_ms {}: must be {}..{}, or 0 for no deadline",
                                  c.read_timeout_ms, kMinReadTimeoutMs, kMaxReadTimeoutMs));
  }
  if (c.reactor_spin_us > kMaxReactorSpinUs) {
    return make_error(EINVAL, fmt::format("reactor_spin_us {}: must be 0..{}", c.reactor_spin_us,
                                          kMaxReactorSpinUs));
  }
  if (c.max_connections_per_uid == 0 || c.max_connections_per_uid > kMaxConnections) {
    return make_error(EINVAL, fmt::format("max_connections_per_uid {}: must be 1..{}",
                                          c.max_connections_per_uid, kMaxConnections));
  }
  if (c.max_sessions_per_uid == 0 || c.max_sessions_per_uid > 4096) {
    return make_error(EINVAL, fmt::format("max_sessions_per_uid {}: must be 1..4096 (max_sessions "
                                          "bounds it anyway)",
                                          c.max_sessions_per_uid));
  }
  if (c.idle_timeout_s > 86400) {
    return make_error(
        EINVAL, fmt::format("idle_timeout_s {}: must be 0..86400 (0 = never)", c.idle_timeout_s));
  }
  constexpr uint64_t kMinFrame = 4096, kMaxFrame = 256u << 20;
  if (c.max_frame_bytes < kMinFrame || c.max_frame_bytes > kMaxFrame) {
    return make_error(
        EINVAL, fmt::format("max_frame {}: must be 4KiB..256MiB", human_bytes(c.max_frame_bytes)));
  }
  bool known_policy = c.policy == "default";
  for (const auto p : policy_names()) known_policy |= p == c.policy;
  if (!known_policy) {
    return make_error(EINVAL, fmt::format("policy '{}': unknown (known: default, {})", c.policy,
                                          fmt::join(policy_names(), ", ")));
  }
  return Ok{};
}

}  // namespace expertd
