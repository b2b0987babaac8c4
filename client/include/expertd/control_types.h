// The control plane's data: a model's layout and the daemon's counters, as libexpertd-client
// returns them and as the daemon (scheduler, core, RPC) keeps them. One definition each: the plain
// fields of every struct come from the schema (client/expertd.capnp) through the generated
// X-macro lists in expertd/stats_fields.h; only lists and nested structs are written here. What a
// field means is its comment in the schema.
//
// for_each_field(x, f) calls f(name, value, description) for every plain field of x in schema
// order (name in snake_case, value a number or std::string): renderings (expertctl's text and
// JSON) go through it, so a field added to the schema shows up there without more code.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "expertd/stats_fields.h"

namespace expertd::client {

#define EXPERTD_DECLARE_FIELD(type, snake, Camel, desc) type snake{};
#define EXPERTD_ADD_FIELD(type, snake, Camel, desc) \
  if constexpr (!is_key_field(#snake)) snake += o.snake;
#define EXPERTD_SUB_FIELD(type, snake, Camel, desc) \
  if constexpr (!is_key_field(#snake)) snake -= o.snake;
// Counter by counter (keys stay): sums over models, differences of two snapshots.
#define EXPERTD_COUNTER_OPERATORS(Type, FIELDS) \
  Type& operator+=(const Type& o) {             \
    FIELDS(EXPERTD_ADD_FIELD)                   \
    return *this;                               \
  }                                             \
  Type& operator-=(const Type& o) {             \
    FIELDS(EXPERTD_SUB_FIELD)                   \
    return *this;                               \
  }
#define EXPERTD_VISIT_FIELD(type, snake, Camel, desc) f(#snake, x.snake, desc);
#define EXPERTD_FOR_EACH_FIELD(Type, FIELDS)  \
  template <typename F>                       \
  void for_each_field(const Type& x, F&& f) { \
    FIELDS(EXPERTD_VISIT_FIELD)               \
  }

// Fields that say what a record is about rather than count it: += and -= leave them alone.
constexpr bool is_key_field(std::string_view field) { return field == "depth"; }

// setPrefetchDepth's depth for "auto": each model's depth follows its measured hint precision.
inline constexpr uint32_t kPrefetchDepthAuto = 0xffffffffu;

struct ModelLayout {
  EXPERTD_MODEL_LAYOUT_FIELDS(EXPERTD_DECLARE_FIELD)
  struct Slice {  // expert 0's slices of one MoE layer; expert e is at offset + e * stride
    EXPERTD_MODEL_LAYOUT_SLICE_FIELDS(EXPERTD_DECLARE_FIELD)
  };
  std::vector<Slice> slices;  // by layer; within a layer in slot placement order

  // True when `layer` has routed experts (dense layers and layers past the end do not).
  bool has_experts(uint32_t layer) const {
    for (const auto& s : slices) {
      if (s.layer == layer) return true;
    }
    return false;
  }
};

// The read scheduler's counters for one model (cache/scheduler.h counts them).
struct SchedulerStats {
  EXPERTD_SCHEDULER_STATS_FIELDS(EXPERTD_DECLARE_FIELD)
  EXPERTD_COUNTER_OPERATORS(SchedulerStats, EXPERTD_SCHEDULER_STATS_FIELDS)
};

// Prefetch telemetry for one lookahead depth (docs/CACHE.md): `depth` layers ahead of the
// session's cursor when the hint arrived (a hint for the cursor's layer or an earlier one is for
// the next token); depth 8 also counts every deeper hint.
struct PrefetchDepthStats {
  EXPERTD_PREFETCH_DEPTH_STATS_FIELDS(EXPERTD_DECLARE_FIELD)

  // useful / (useful + wasted); -1 before any load has an outcome.
  double precision() const {
    const uint64_t decided = useful + wasted;
    return decided ? static_cast<double>(useful) / static_cast<double>(decided) : -1.0;
  }
  // hinted_acquires / acquires (the model's or the session's acquires); -1 without acquires.
  double recall(uint64_t acquires) const {
    return acquires ? static_cast<double>(hinted_acquires) / static_cast<double>(acquires) : -1.0;
  }
  // Counter by counter (depth stays).
  EXPERTD_COUNTER_OPERATORS(PrefetchDepthStats, EXPERTD_PREFETCH_DEPTH_STATS_FIELDS)
};

struct ModelStats {
  EXPERTD_MODEL_STATS_FIELDS(EXPERTD_DECLARE_FIELD)
  SchedulerStats scheduler;
  std::vector<uint64_t> layer_hits;    // per block layer: acquires served READY
  std::vector<uint64_t> layer_misses;  // per block layer: acquires that waited
  // [i]: ns with exactly i reads in flight since the daemon started (the schema says more)
  std::vector<uint64_t> read_depth_ns;
  std::vector<PrefetchDepthStats> prefetch_depths;  // depths 1..8 (empty from an older daemon)
  std::vector<double> hint_precision;  // the estimate per depth 1..8 (empty from an older daemon)
  std::vector<uint64_t> shard_loads_failed;  // per shard (model file): loads failed on a read
  std::vector<uint64_t> shard_read_retries;  // per shard: reads retried after EIO / early EOF
};

struct SessionStats {
  EXPERTD_SESSION_STATS_FIELDS(EXPERTD_DECLARE_FIELD)
  std::vector<PrefetchDepthStats> prefetch_depths;  // this session's, depths 1..8
};

struct Stats {
  EXPERTD_STATS_FIELDS(EXPERTD_DECLARE_FIELD)
  std::vector<ModelStats> models;
  std::vector<SessionStats> sessions;
};

// f(const char* name, const T& value, const char* description) for each plain field, in schema
// order (lists and nested structs are the caller's).
EXPERTD_FOR_EACH_FIELD(ModelLayout, EXPERTD_MODEL_LAYOUT_FIELDS)
EXPERTD_FOR_EACH_FIELD(ModelLayout::Slice, EXPERTD_MODEL_LAYOUT_SLICE_FIELDS)
EXPERTD_FOR_EACH_FIELD(SchedulerStats, EXPERTD_SCHEDULER_STATS_FIELDS)
EXPERTD_FOR_EACH_FIELD(PrefetchDepthStats, EXPERTD_PREFETCH_DEPTH_STATS_FIELDS)
EXPERTD_FOR_EACH_FIELD(ModelStats, EXPERTD_MODEL_STATS_FIELDS)
EXPERTD_FOR_EACH_FIELD(SessionStats, EXPERTD_SESSION_STATS_FIELDS)
EXPERTD_FOR_EACH_FIELD(Stats, EXPERTD_STATS_FIELDS)

#undef EXPERTD_DECLARE_FIELD
#undef EXPERTD_ADD_FIELD
#undef EXPERTD_SUB_FIELD
#undef EXPERTD_COUNTER_OPERATORS
#undef EXPERTD_VISIT_FIELD
#undef EXPERTD_FOR_EACH_FIELD

}  // namespace expertd::client
