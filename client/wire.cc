#include "client/wire.h"

#include <string>
#include <type_traits>
#include <vector>

namespace expertd::wire {

// The elements of lists and of other structs (declared first: the lists find them by ordinary
// lookup).
static void fill(const client::SchedulerStats& from, rpc::SchedulerStats::Builder to);
static void fill(const client::PrefetchDepthStats& from, rpc::PrefetchDepthStats::Builder to);
static void fill(const client::ModelLayout::Slice& from, rpc::ModelLayout::Slice::Builder to);
static void fill(const client::ModelStats& from, rpc::ModelStats::Builder to);
static client::SchedulerStats read(rpc::SchedulerStats::Reader from);
static client::PrefetchDepthStats read(rpc::PrefetchDepthStats::Reader from);
static client::ModelLayout::Slice read(rpc::ModelLayout::Slice::Reader from);
static client::ModelStats read(rpc::ModelStats::Reader from);
static uint64_t read(uint64_t from) { return from; }
static double read(double from) { return from; }

namespace {

// A plain field as a builder's setter takes it, and as a reader's getter gives it.
kj::StringPtr to_wire(const std::string& s) { return kj::StringPtr(s.c_str(), s.size()); }
template <typename T>
T to_wire(T v) {
  return v;
}
std::string from_wire(capnp::Text::Reader t) { return std::string(t.cStr(), t.size()); }
template <typename T>
T from_wire(T v) {
  return v;
}

#define EXPERTD_SET_FIELD(type, snake, Camel, desc) to.set##Camel(to_wire(from.snake));
#define EXPERTD_GET_FIELD(type, snake, Camel, desc) to.snake = from_wire(from.get##Camel());

// A list: each element filled in place (structs) or set (numbers).
template <typename T, typename List>
void fill_list(const std::vector<T>& from, List to) {
  for (uint i = 0; i < from.size(); ++i) {
    if constexpr (std::is_arithmetic_v<T>) {
      to.set(i, from[i]);
    } else {
      fill(from[i], to[i]);
    }
  }
}

template <typename T, typename List>
std::vector<T> read_list(List from) {
  std::vector<T> to;
  to.reserve(from.size());
  for (auto x : from) to.push_back(read(x));
  return to;
}

}  // namespace

void fill(const client::SchedulerStats& from, rpc::SchedulerStats::Builder to) {
  EXPERTD_SCHEDULER_STATS_FIELDS(EXPERTD_SET_FIELD)
}

void fill(const client::PrefetchDepthStats& from, rpc::PrefetchDepthStats::Builder to) {
  EXPERTD_PREFETCH_DEPTH_STATS_FIELDS(EXPERTD_SET_FIELD)
}

void fill(const client::ModelLayout::Slice& from, rpc::ModelLayout::Slice::Builder to) {
  EXPERTD_MODEL_LAYOUT_SLICE_FIELDS(EXPERTD_SET_FIELD)
}

void fill(const client::ModelStats& from, rpc::ModelStats::Builder to) {
  EXPERTD_MODEL_STATS_FIELDS(EXPERTD_SET_FIELD)
  fill(from.scheduler, to.initScheduler());
  fill_list(from.layer_hits, to.initLayerHits(static_cast<uint>(from.layer_hits.size())));
  fill_list(from.read_depth_ns, to.initReadDepthNs(static_cast<uint>(from.read_depth_ns.size())));
  fill_list(from.layer_misses, to.initLayerMisses(static_cast<uint>(from.layer_misses.size())));
  fill_list(from.prefetch_depths,
            to.initPrefetchDepths(static_cast<uint>(from.prefetch_depths.size())));
  fill_list(from.hint_precision,
            to.initHintPrecision(static_cast<uint>(from.hint_precision.size())));
  fill_list(from.shard_loads_failed,
            to.initShardLoadsFailed(static_cast<uint>(from.shard_loads_failed.size())));
  fill_list(from.shard_read_retries,
            to.initShardReadRetries(static_cast<uint>(from.shard_read_retries.size())));
}

client::SchedulerStats read(rpc::SchedulerStats::Reader from) {
  client::SchedulerStats to;
  EXPERTD_SCHEDULER_STATS_FIELDS(EXPERTD_GET_FIELD)
  return to;
}

client::PrefetchDepthStats read(rpc::PrefetchDepthStats::Reader from) {
  client::PrefetchDepthStats to;
  EXPERTD_PREFETCH_DEPTH_STATS_FIELDS(EXPERTD_GET_FIELD)
  return to;
}

client::ModelLayout::Slice read(rpc::ModelLayout::Slice::Reader from) {
  client::ModelLayout::Slice to;
  EXPERTD_MODEL_LAYOUT_SLICE_FIELDS(EXPERTD_GET_FIELD)
  return to;
}

client::ModelStats read(rpc::ModelStats::Reader from) {
  client::ModelStats to;
  EXPERTD_MODEL_STATS_FIELDS(EXPERTD_GET_FIELD)
  to.scheduler = read(from.getScheduler());
  to.layer_hits = read_list<uint64_t>(from.getLayerHits());
  to.read_depth_ns = read_list<uint64_t>(from.getReadDepthNs());
  to.layer_misses = read_list<uint64_t>(from.getLayerMisses());
  to.prefetch_depths = read_list<client::PrefetchDepthStats>(from.getPrefetchDepths());
  to.hint_precision = read_list<double>(from.getHintPrecision());
  to.shard_loads_failed = read_list<uint64_t>(from.getShardLoadsFailed());
  to.shard_read_retries = read_list<uint64_t>(from.getShardReadRetries());
  // A daemon before the field existed sends 0: the whole cache.
  if (to.cache_limit == 0) to.cache_limit = to.cache_slots;
  return to;
}

void fill(const client::ModelLayout& from, rpc::ModelLayout::Builder to) {
  EXPERTD_MODEL_LAYOUT_FIELDS(EXPERTD_SET_FIELD)
  fill_list(from.slices, to.initSlices(static_cast<uint>(from.slices.size())));
}

void fill(const client::SessionStats& from, rpc::SessionStats::Builder to) {
  EXPERTD_SESSION_STATS_FIELDS(EXPERTD_SET_FIELD)
  fill_list(from.prefetch_depths,
            to.initPrefetchDepths(static_cast<uint>(from.prefetch_depths.size())));
}

void fill(const client::Stats& from, rpc::Stats::Builder to) {
  EXPERTD_STATS_FIELDS(EXPERTD_SET_FIELD)
  fill_list(from.models, to.initModels(static_cast<uint>(from.models.size())));
  fill_list(from.sessions, to.initSessions(static_cast<uint>(from.sessions.size())));
}

client::ModelLayout read(rpc::ModelLayout::Reader from) {
  client::ModelLayout to;
  EXPERTD_MODEL_LAYOUT_FIELDS(EXPERTD_GET_FIELD)
  to.slices = read_list<client::ModelLayout::Slice>(from.getSlices());
  return to;
}

client::SessionStats read(rpc::SessionStats::Reader from) {
  client::SessionStats to;
  EXPERTD_SESSION_STATS_FIELDS(EXPERTD_GET_FIELD)
  to.prefetch_depths = read_list<client::PrefetchDepthStats>(from.getPrefetchDepths());
  return to;
}

client::Stats read(rpc::Stats::Reader from) {
  client::Stats to;
  EXPERTD_STATS_FIELDS(EXPERTD_GET_FIELD)
  to.models = read_list<client::ModelStats>(from.getModels());
  to.sessions = read_list<client::SessionStats>(from.getSessions());
  return to;
}

}  // namespace expertd::wire
