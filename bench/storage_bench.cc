// `expert-bench storage`: cold random-expert read bandwidth of the storage engine against raw read
// loops over the same byte ranges, in the same order, into the same memory.
//
//  1. probe_best_read_config() picks the engine's io_uring shape (queue depth, chunk), as the
//     daemon does at start (unless --queue-depth/--chunk override it);
//  2. the engine — ExpertStore + StoreReactor over a real backend, every acquired slot checked
//     against expert-forge's content by verifier threads — acquires experts of a seeded shuffle
//     of the whole model, keeping `--outstanding` acquires waiting, releasing each slot once it
//     is checked;
//  3. the raw loops of storage/read_probe.h read the slices of the same experts in the same
//     order into the engine's arena: pread whole slices, and io_uring over a grid of queue depths
//     and chunk sizes; their best is the disk's ceiling for this access pattern;
//  4. for reference: sequential large-block reads (the device's ceiling) and mmap + page faults
//     (what llama.cpp does by default).
//
// Every method runs in short rounds, taking turns, so a disk whose speed drifts (a shared virtual
// disk does, by a third within a minute) slows all alike. GB/s counts expert bytes (not the
// widening to the DIO alignment) over the method's time. The cache is much smaller than the model,
// every expert is read once per pass, and it is emptied after each engine round (the raw loops
// overwrite the arena), so acquires miss; hits would deliver no disk bytes and are not counted.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_util.h"
#include "bench/commands.h"
#include "cache/shm.h"
#include "cache/store.h"
#include "forge/content.h"
#include "forge/verifier.h"
#include "storage/read_probe.h"

namespace expertd::bench {
namespace {

using Json = nlohmann::ordered_json;

constexpr std::array<uint32_t, 5> kGridQueueDepths = {1, 4, 16, 32, 64};
constexpr std::array<uint64_t, 4> kGridChunks = {256u << 10, 1u << 20, 4u << 20, 0};
constexpr ReadConfig kSequentialConfig{8, 8u << 20};
// Each method's time is cut into rounds of about this length, taken in turns (see run_storage).
constexpr double kRoundSeconds = 0.5;

struct StorageFlags {
  std::string model;
  std::string cache;
  double seconds = 3.0;
  bool json = false;
  std::string backend = "uring";
  uint32_t queue_depth = 0;   // 0: the probe's choice
  std::string chunk;          // empty: the probe's choice
  uint32_t outstanding = 0;   // 0: experts for 2 x queue depth reads, at least 4
  uint32_t rounds = 0;        // 0: one round per kRoundSeconds of --seconds
  std::string grid = "full";  // "full" or "engine" (only the raw loops at the engine's shapes)
  uint64_t seed = 1;
  bool verify = true;
  bool compare_defaults = false;
  double probe_seconds = 1.5;
};

void progress(const std::string& line) { std::fprintf(stderr, "expert-bench: %s\n", line.c_str()); }

// Every expert of the model once, in a seeded random order (Fisher-Yates over a 64-bit Mersenne
// twister with a plain modulo, so the order is the same with every standard library).
std::vector<ExpertKey> shuffled_experts(const SliceMap& map, uint64_t seed) {
  std::vector<ExpertKey> keys;
  for (const MoeLayer& l : map.layers()) {
    for (uint32_t e = 0; e < map.expert_count(); ++e) keys.push_back(ExpertKey{l.layer, e});
  }
  std::mt19937_64 rng(seed);
  for (size_t i = keys.size(); i > 1; --i) std::swap(keys[i - 1], keys[rng() % i]);
  return keys;
}

std::vector<ProbeRange> ranges_of(const SliceMap& map, std::span<const ExpertKey> keys) {
  std::vector<ProbeRange> ranges;
  ranges.reserve(keys.size() * 3);
  std::array<ExpertSlice, 3> s{};
  for (const ExpertKey& k : keys) {
    const uint32_t n = map.slices(k.layer, k.expert, s);
    for (uint32_t i = 0; i < n; ++i)
      ranges.push_back(ProbeRange{s[i].shard, s[i].offset, s[i].bytes});
  }
  return ranges;
}

// Reads the engine issues for an expert of the first MoE layer with chunks of `chunk_bytes`.
uint64_t reads_per_expert(const SliceMap& map, uint64_t chunk_bytes, uint64_t alignment) {
  std::array<ExpertSlice, 3> s{};
  const uint32_t n = map.slices(map.layers().front().layer, 0, s);
  const uint64_t chunk =
      chunk_bytes == 0 ? 0 : std::max(chunk_bytes / alignment * alignment, alignment);
  uint64_t reads = 0;
  for (uint32_t i = 0; i < n; ++i) {
    const uint64_t widened = (s[i].offset + s[i].bytes + alignment - 1) / alignment * alignment -
                             s[i].offset / alignment * alignment;
    reads += chunk == 0 ? 1 : (widened + chunk - 1) / chunk;
  }
  return std::max<uint64_t>(reads, 1);
}

// --- the engine run --------------------------------------------------------------------------

struct VectorSink final : CompletionSink {
  void complete(const Completion& c) override { done.push_back(c); }
  std::vector<Completion> done;
};

// Counts what the engine loaded and keeps the read latencies (bounded).
class LoadStats final : public LoadObserver {
 public:
  LoadStats(const SliceMap& map, size_t max_samples) : map_(map) {
    latencies_ns.reserve(max_samples);
  }
  void loaded(ExpertKey key, uint32_t, const uint8_t*, uint64_t latency_ns) override {
    if (latencies_ns.size() < latencies_ns.capacity()) latencies_ns.push_back(latency_ns);
    expert_bytes += map_.expert_bytes(key.layer);
    ++loads;
  }
  void failed(ExpertKey, int error) override {
    ++failures;
    if (first_error == 0) first_error = error;
  }
  std::vector<uint64_t> latencies_ns;
  uint64_t expert_bytes = 0;
  uint64_t loads = 0;
  uint64_t failures = 0;
  int first_error = 0;

 private:
  const SliceMap& map_;
};

struct EngineOptions {
  BackendKind backend = BackendKind::Uring;
  ReadConfig read;
  uint64_t cache_bytes = 0;
  uint32_t outstanding = 8;
  bool verify = true;
  uint32_t verify_threads = 1;
};

// What driving the engine saw, summed over the drives it covers.
struct Phase {
  double seconds = 0.0;
  uint64_t acquires = 0;
  uint64_t hits = 0;
  uint64_t acquire_errors = 0;
  uint64_t loads = 0;
  uint64_t expert_bytes = 0;  // bytes of the experts loaded (no widening)
  uint64_t bytes_read = 0;    // bytes the backend delivered (widening included)
  uint64_t reads = 0;
  uint64_t checked = 0;                // loads verified after the round
  uint64_t unchecked = 0;              // loads evicted before they could be verified (should be 0)
  std::vector<uint64_t> latencies_ns;  // load start -> READY, one per load
  double gbps() const {
    return seconds > 0.0 ? static_cast<double>(expert_bytes) / seconds / 1e9 : 0.0;
  }
  void add(const Phase& p) {
    seconds += p.seconds;
    acquires += p.acquires;
    hits += p.hits;
    acquire_errors += p.acquire_errors;
    loads += p.loads;
    expert_bytes += p.expert_bytes;
    bytes_read += p.bytes_read;
    reads += p.reads;
    checked += p.checked;
    unchecked += p.unchecked;
    latencies_ns.insert(latencies_ns.end(), p.latencies_ns.begin(), p.latencies_ns.end());
  }
};

// One ExpertStore over its own backend, kept across rounds, driven on the calling thread.
//
// Every load is verified, but not while the clock runs: checking costs about as much CPU per byte
// as the read, and on a small virtual machine busy vCPUs slow the emulated disk itself (measured:
// docs/PERFORMANCE.md), which the raw loops it is compared with would not pay. So a round acquires
// at most as many experts as the cache holds, starting from an empty cache; when its clock stops,
// every READY slot (each expert the round loaded) is checked against expert-forge's content on
// all cores, and the cache is emptied for the next round (the raw loops overwrite the arena).
class EngineBench {
 public:
  static Result<std::unique_ptr<EngineBench>> open(const std::string& model_path,
                                                   const std::vector<ExpertKey>& sequence,
                                                   const EngineOptions& options) {
    std::unique_ptr<EngineBench> b(new EngineBench(sequence, options));
    EXPERTD_TRY(b->init(model_path));
    return b;
  }

  // Acquires experts from the sequence (continuing where the last round stopped) for `seconds`,
  // keeping `outstanding` acquires waiting and releasing each slot as its acquire completes. The
  // round's time ends at its last completion.
  Result<Phase> drive(double seconds, uint32_t outstanding) {
    Phase ph;
    Scheduler& sched = store_->scheduler();
    const SchedulerStats s0 = sched.stats();
    const uint64_t loads0 = stats_->loads;
    const uint64_t bytes0 = stats_->expert_bytes;
    const size_t lat0 = stats_->latencies_ns.size();
    // Loads the cache keeps until the round ends (no eviction, so each can be checked).
    const uint32_t max_acquires = std::max<uint32_t>(1, store_->cache().slot_count());
    const uint64_t start = monotonic_ns();
    const uint64_t deadline = start + static_cast<uint64_t>(seconds * 1e9);
    uint64_t last_completion = start;
    uint32_t waiting = 0;  // acquired, not completed yet
    bool stopping = false;
    while (true) {
      while (!stopping && waiting < outstanding) {
        if (monotonic_ns() >= deadline || ph.acquires >= max_acquires) {
          stopping = true;
          break;
        }
        const ExpertKey key = sequence_[next_ % sequence_.size()];
        const int rc = sched.acquire(0, key, next_++);
        if (rc < 0) return make_error(-rc, fmt::format("acquire: {}", std::strerror(-rc)));
        ++waiting;
        ++ph.acquires;
      }
      if (stopping && waiting == 0) break;
      const int n = reactor_->run_once(50, {});
      if (n < 0) return make_error(-n, fmt::format("reactor: {}", std::strerror(-n)));
      if (!sink_.done.empty()) last_completion = monotonic_ns();
      for (const Completion& c : sink_.done) {
        --waiting;
        if (c.slot < 0) {
          ++ph.acquire_errors;
        } else if (const int rc = sched.release(0, static_cast<uint32_t>(c.slot)); rc < 0) {
          return make_error(-rc, fmt::format("release slot {}: {}", c.slot, std::strerror(-rc)));
        }
      }
      sink_.done.clear();
    }
    ph.seconds = static_cast<double>(last_completion - start) / 1e9;
    const SchedulerStats& s1 = sched.stats();
    ph.hits = s1.hits - s0.hits;
    ph.bytes_read = s1.bytes_read - s0.bytes_read;
    ph.reads = s1.reads - s0.reads;
    ph.loads = stats_->loads - loads0;
    ph.expert_bytes = stats_->expert_bytes - bytes0;
    ph.latencies_ns.assign(stats_->latencies_ns.begin() + static_cast<std::ptrdiff_t>(lat0),
                           stats_->latencies_ns.end());
    if (!verifiers_.empty()) {
      ph.checked = check_resident();
      ph.unchecked = ph.loads > ph.checked ? ph.loads - ph.checked : 0;
    }
    clear_cache();
    return ph;
  }

  std::string backend_name() const { return std::string(backend_->name()); }
  std::string backend_describe() const { return backend_->describe(); }
  const std::string& fallback_reason() const { return fallback_reason_; }
  std::string store_describe() const { return store_->describe(); }
  uint64_t slot_bytes() const { return store_->layouts().slot_bytes(); }
  uint32_t cache_slots() const { return store_->cache().slot_count(); }
  std::span<uint8_t> arena() const { return {store_->arena().data(), store_->arena().size()}; }
  uint64_t load_failures() const { return stats_->failures; }
  uint64_t verify_failures() const {
    uint64_t n = 0;
    for (const auto& v : verifiers_) n += v->failures();
    return n;
  }
  std::string verify_message() const {
    for (const auto& v : verifiers_) {
      if (!v->messages().empty()) return v->messages().front();
    }
    return "";
  }

 private:
  EngineBench(const std::vector<ExpertKey>& sequence, const EngineOptions& options)
      : sequence_(sequence), options_(options) {}

  Status init(const std::string& model_path) {
    EXPERTD_TRY_ASSIGN(GgufModel model, GgufModel::open(model_path));
    std::vector<std::string> paths;
    for (const GgufFile& s : model.shards()) paths.push_back(s.path());
    BackendOptions bo;
    bo.queue_depth = std::max<uint32_t>(64, options_.read.queue_depth);
    bo.pread_threads = std::clamp<uint32_t>(options_.read.queue_depth, 1, 64);
    EXPERTD_TRY_ASSIGN(backend_, make_backend(options_.backend, bo, &fallback_reason_));
    EXPERTD_TRY(backend_->open_files(paths));
    std::vector<uint32_t> files;
    for (uint32_t i = 0; i < paths.size(); ++i) files.push_back(i);

    StoreOptions so;
    so.cache_bytes = options_.cache_bytes;
    so.lock_memory = true;
    so.scheduler.queue_depth = options_.read.queue_depth;
    so.scheduler.chunk_bytes = options_.read.chunk_bytes;
    // The observer is given to the store at creation, before the store's own map exists.
    EXPERTD_TRY_ASSIGN(map_, SliceMap::build(model));
    stats_ = std::make_unique<LoadStats>(map_, 1u << 20);
    EXPERTD_TRY_ASSIGN(store_, ExpertStore::create("bench", std::move(model), *backend_, files, so,
                                                   sink_, stats_.get()));
    const iovec arena{store_->arena().data(), store_->arena().size()};
    EXPERTD_TRY(backend_->register_buffers({&arena, 1}));
    reactor_ = std::make_unique<StoreReactor>(*backend_);
    reactor_->add(store_.get(), 0, static_cast<uint32_t>(paths.size()));
    if (options_.verify) {
      for (uint32_t i = 0; i < options_.verify_threads; ++i) {
        EXPERTD_TRY_ASSIGN(
            auto v, ForgeVerifier::create(store_->model(), store_->slice_map(), store_->layouts()));
        verifiers_.push_back(std::move(v));
      }
    }
    sink_.done.reserve(2 * size_t{options_.outstanding} + 16);
    return Ok{};
  }

  // Checks every READY slot (cache and staging) on verify_threads threads; returns how many.
  uint64_t check_resident() {
    std::vector<std::pair<ExpertKey, uint32_t>> ready;
    for (ExpertCache* c : {&store_->cache(), &store_->staging()}) {
      for (uint32_t slot = c->first_slot(); slot < c->first_slot() + c->slot_count(); ++slot) {
        if (c->state(slot) == SlotState::Ready) ready.emplace_back(c->key(slot), slot);
      }
    }
    std::vector<std::thread> threads;
    for (size_t t = 0; t < verifiers_.size(); ++t) {
      threads.emplace_back([this, &ready, t] {
        for (size_t i = t; i < ready.size(); i += verifiers_.size()) {
          const auto [key, slot] = ready[i];
          verifiers_[t]->loaded(key, slot, store_->slot_data(slot), 0);
        }
      });
    }
    for (std::thread& th : threads) th.join();
    return ready.size();
  }

  // Forgets every cached expert: the next round starts empty (so it can keep all it loads), and
  // the arena may be overwritten by the raw loops without a later hit serving the garbage.
  void clear_cache() {
    for (ExpertCache* c : {&store_->cache(), &store_->staging()}) {
      for (uint32_t slot = c->first_slot(); slot < c->first_slot() + c->slot_count(); ++slot) {
        if (c->state(slot) == SlotState::Ready) (void)c->evict(c->key(slot));
      }
    }
  }

  const std::vector<ExpertKey>& sequence_;
  const EngineOptions options_;
  std::string fallback_reason_;
  SliceMap map_;
  std::unique_ptr<LoadStats> stats_;
  VectorSink sink_;
  std::unique_ptr<ReadBackend> backend_;
  std::unique_ptr<ExpertStore> store_;
  std::unique_ptr<StoreReactor> reactor_;
  std::vector<std::unique_ptr<ForgeVerifier>> verifiers_;  // one per checking thread
  uint64_t next_ = 0;
};

// --- the methods, run in interleaved rounds ---------------------------------------------------

// One measured thing. Its `run` does one round of `seconds`, continuing where the last stopped.
struct Method {
  std::string name;
  std::string kind;  // "raw", "sequential", "mmap", "expertd"
  uint32_t queue_depth = 0;
  uint64_t chunk_bytes = 0;
  std::function<Result<std::pair<uint64_t, double>>(double seconds)> run;  // (bytes, seconds)
  uint64_t bytes = 0;
  double seconds = 0.0;
  std::vector<double> round_gbps;
  double gbps() const { return seconds > 0.0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0; }
};

// A raw read loop over `ranges` that continues where its previous round stopped.
Method raw_method(std::string name, std::string kind, ReadConfig shape,
                  std::function<Result<ProbeResult>(double, size_t)> read) {
  Method m{std::move(name), std::move(kind), shape.queue_depth, shape.chunk_bytes, {}};
  auto cursor = std::make_shared<size_t>(0);
  m.run = [read = std::move(read), cursor](double seconds) -> Result<std::pair<uint64_t, double>> {
    EXPERTD_TRY_ASSIGN(const ProbeResult r, read(seconds, *cursor));
    *cursor = r.next_range;
    return std::pair{r.bytes, r.seconds};
  };
  return m;
}

Json method_json(const Method& m, double best) {
  Json j;
  j["method"] = m.name;
  j["kind"] = m.kind;
  j["queue_depth"] = m.queue_depth;
  j["chunk_bytes"] = m.chunk_bytes;
  j["gbps"] = m.gbps();
  j["ratio"] = best > 0.0 ? m.gbps() / best : 0.0;
  j["round_gbps"] = m.round_gbps;
  j["bytes"] = m.bytes;
  j["seconds"] = m.seconds;
  return j;
}

std::string describe_engine(const ReadConfig& c) {
  return fmt::format("QD{} {}", c.queue_depth, describe_chunk(c.chunk_bytes));
}

double us(uint64_t ns) { return static_cast<double>(ns) / 1000.0; }

int run_storage(const StorageFlags& flags) {
  auto model = GgufModel::open(flags.model);
  if (!model) {
    progress(model.error().message);
    return 1;
  }
  auto map = SliceMap::build(*model);
  if (!map) {
    progress(map.error().message);
    return 1;
  }
  if (map->layers().empty()) {
    progress(flags.model + ": no routed expert tensors");
    return 1;
  }
  std::vector<std::string> paths;
  uint64_t model_bytes = 0;
  for (const GgufFile& s : model->shards()) {
    paths.push_back(s.path());
    model_bytes += s.file_size();
  }
  const MachineInfo machine = describe_machine(flags.model);
  const bool forged = static_cast<bool>(forge_info(*model));
  const bool verify = flags.verify && forged;
  if (flags.verify && !forged) progress("not a forged model: verification skipped");

  uint64_t cache_bytes = std::min(map->total_expert_bytes() / 4, machine.ram_bytes / 4);
  if (!flags.cache.empty()) {
    const auto c = parse_bytes(flags.cache);
    if (!c) {
      progress("--cache " + flags.cache + ": not a size (e.g. 4GiB, 512MiB)");
      return 2;
    }
    cache_bytes = *c;
  }
  std::optional<uint64_t> chunk_flag;
  if (!flags.chunk.empty()) {
    chunk_flag = flags.chunk == "whole" ? std::optional<uint64_t>(0) : parse_bytes(flags.chunk);
    if (!chunk_flag) {
      progress("--chunk " + flags.chunk + ": not a size (e.g. 1MiB) or 'whole'");
      return 2;
    }
  }

  auto probe = ReadProbe::open(paths);
  if (!probe) {
    progress(probe.error().message);
    return 1;
  }
  const std::vector<ExpertKey> sequence = shuffled_experts(*map, flags.seed);
  const std::vector<ProbeRange> ranges = ranges_of(*map, sequence);
  progress(fmt::format(
      "{}: {} ({} MoE layers x {} experts, {} of experts, {} per expert on "
      "average), DIO alignment {}; disk {}",
      flags.model, format_bytes(model_bytes), map->layers().size(), map->expert_count(),
      format_bytes(map->total_expert_bytes()),
      format_bytes(map->total_expert_bytes() / sequence.size()), probe->alignment(), machine.disk));

  // 1. The start-up probe, on a differently shuffled sample, as the daemon would run it.
  const std::vector<ExpertKey> sample = shuffled_experts(*map, flags.seed ^ 0x5eed5eedull);
  const std::vector<ProbeRange> sample_ranges = ranges_of(*map, sample);
  ProbeOptions po;
  po.seconds = flags.probe_seconds;
  // The probe reads into memory like the arena the engine will read into (a sealed, locked
  // memfd of about its size), not into a small buffer of its own; see set_destination().
  uint64_t widest = 0;
  for (const ProbeRange& r : ranges) widest = std::max(widest, r.bytes);
  auto scratch = SharedRegion::create(
      "expert-bench-probe", std::max(cache_bytes, 72 * (widest + 2 * probe->alignment())), true);
  if (!scratch) {
    progress(scratch.error().message);
    return 1;
  }
  probe->set_destination(scratch->data(), scratch->size());
  auto choice = probe_best_read_config(*probe, sample_ranges, po);
  probe->set_destination(nullptr, 0);
  scratch = SharedRegion();
  if (!choice) {
    progress(choice.error().message);
    return 1;
  }
  std::string trials;
  for (const ProbeTrial& t : choice->trials) {
    trials += fmt::format("{}{} {:.2f}", trials.empty() ? "" : ", ", describe_read_config(t.config),
                          t.result.gbps());
  }
  progress(fmt::format("probe ({:.1f} s): {} at {:.2f} GB/s (tried {})", flags.probe_seconds,
                       describe_read_config(choice->config), choice->gbps, trials));
  ReadConfig engine_config = choice->config;
  std::string engine_source = "probe";
  if (flags.queue_depth != 0) engine_config.queue_depth = flags.queue_depth;
  if (chunk_flag) engine_config.chunk_bytes = *chunk_flag;
  if (flags.queue_depth != 0 || chunk_flag) engine_source = "flags";

  // 2. The engine, at the chosen shape and at the scheduler's built-in defaults.
  EngineOptions eo;
  eo.backend = flags.backend == "pread" ? BackendKind::Pread : BackendKind::Uring;
  eo.cache_bytes = cache_bytes;
  eo.verify = verify;
  // Checking runs between rounds, off the clock, on every core.
  eo.verify_threads = std::clamp<uint32_t>(machine.cpus, 1, 8);
  // Enough experts waiting that twice the queue depth of reads is ready to go, and no more:
  // more would only queue in the scheduler and inflate the latency measured.
  auto engine_options = [&](const ReadConfig& config) {
    EngineOptions o = eo;
    o.read = config;
    const uint64_t per_expert = reads_per_expert(*map, config.chunk_bytes, probe->alignment());
    o.outstanding = flags.outstanding != 0
                        ? flags.outstanding
                        : static_cast<uint32_t>(std::max<uint64_t>(
                              4, (2 * uint64_t{config.queue_depth} + per_expert - 1) / per_expert));
    return o;
  };
  const EngineOptions chosen_options = engine_options(engine_config);
  auto engine = EngineBench::open(flags.model, sequence, chosen_options);
  if (!engine) {
    progress("expertd: " + engine.error().message);
    return 1;
  }
  progress(fmt::format("expertd: {}; {}; {} outstanding, verify {}", (*engine)->backend_describe(),
                       (*engine)->store_describe(), chosen_options.outstanding,
                       verify ? fmt::format("on ({} threads)", eo.verify_threads) : "off"));
  if ((*engine)->cache_slots() < 4 * chosen_options.outstanding) {
    progress(
        fmt::format("warning: a round loads at most the cache's {} slots, few against {} "
                    "outstanding: the engine's rounds are short (a larger --cache helps)",
                    (*engine)->cache_slots(), chosen_options.outstanding));
  }
  const SchedulerOptions defaults;
  const ReadConfig default_config{defaults.queue_depth, defaults.chunk_bytes};
  std::unique_ptr<EngineBench> engine_default;
  if (flags.compare_defaults && !(default_config == engine_config)) {
    auto d = EngineBench::open(flags.model, sequence, engine_options(default_config));
    if (!d) {
      progress("expertd (defaults): " + d.error().message);
      return 1;
    }
    engine_default = std::move(*d);
  }

  std::vector<Method> methods;
  Phase engine_phase;
  Phase default_phase;
  auto engine_method = [](std::string name, ReadConfig c, EngineBench& e, uint32_t outstanding,
                          Phase& total) {
    Method m{std::move(name), "expertd", c.queue_depth, c.chunk_bytes, {}};
    m.run = [&e, outstanding, &total](double seconds) -> Result<std::pair<uint64_t, double>> {
      EXPERTD_TRY_ASSIGN(Phase p, e.drive(seconds, outstanding));
      total.add(p);
      return std::pair{p.expert_bytes, p.seconds};
    };
    return m;
  };
  methods.push_back(engine_method(fmt::format("expertd {} {} ({})", (*engine)->backend_name(),
                                              describe_engine(engine_config), engine_source),
                                  engine_config, **engine, chosen_options.outstanding,
                                  engine_phase));
  if (engine_default) {
    methods.push_back(
        engine_method(fmt::format("expertd {} {} (built-in defaults)",
                                  engine_default->backend_name(), describe_engine(default_config)),
                      default_config, *engine_default, engine_options(default_config).outstanding,
                      default_phase));
  }
  // 3. The raw loops over the same ranges; their best is the ceiling. They read into the
  // engine's arena, as the engine does: on a virtual machine the destination pages alone can move
  // the rate by a third (docs/PERFORMANCE.md), which would swamp what is measured here.
  ReadProbe& rp = *probe;
  const uint64_t widened = widest + 2 * rp.alignment();
  const std::span<uint8_t> arena = (*engine)->arena();
  const bool shared = arena.size() >= (kGridQueueDepths.back() + 3) * widened;
  if (shared) {
    rp.set_destination(arena.data(), arena.size());
  } else {
    progress(
        "the arena is too small to share with the raw loops: they read into buffers of their "
        "own (on a VM, compare with care)");
  }
  methods.push_back(raw_method("pread O_DIRECT whole slice", "raw", ReadConfig{1, 0},
                               [&](double s, size_t first) {
                                 return rp.pread_whole(ranges, ProbeBudget{s, 0}, first);
                               }));
  std::vector<ReadConfig> grid;
  if (flags.grid == "full") {
    for (const uint32_t qd : kGridQueueDepths) {
      for (const uint64_t chunk : kGridChunks) grid.push_back(ReadConfig{qd, chunk});
    }
  } else {
    grid.push_back(engine_config);
    if (engine_default) grid.push_back(default_config);
  }
  {
    for (const ReadConfig& c : grid) {
      methods.push_back(
          raw_method(describe_read_config(c), "raw", c, [&rp, &ranges, c](double s, size_t first) {
            return rp.uring(ranges, c, ProbeBudget{s, 0}, first);
          }));
    }
  }
  // 4. References: the device's sequential ceiling, and mmap + page faults.
  uint32_t largest = 0;
  for (uint32_t f = 0; f < rp.file_count(); ++f) {
    if (rp.file(f).size_bytes > rp.file(largest).size_bytes) largest = f;
  }
  methods.push_back(
      raw_method("sequential " + describe_read_config(kSequentialConfig), "sequential",
                 kSequentialConfig, [&rp, largest, arena, shared](double s, size_t first) {
                   // Its blocks are larger than slices: the arena may not hold them.
                   const bool own = shared && arena.size() < (kSequentialConfig.queue_depth + 3) *
                                                                 kSequentialConfig.chunk_bytes;
                   if (own) rp.set_destination(nullptr, 0);
                   auto r = rp.sequential(largest, 0, rp.file(largest).size_bytes,
                                          kSequentialConfig, ProbeBudget{s, 0}, first);
                   if (own) rp.set_destination(arena.data(), arena.size());
                   return r;
                 }));
  methods.push_back(raw_method("mmap + page faults (4 KiB touches)", "mmap", ReadConfig{0, 0},
                               [&](double s, size_t first) {
                                 return rp.mmap_fault(ranges, ProbeBudget{s, 0}, first);
                               }));

  // Rounds: every method runs seconds/rounds per round, in an order rotated each round, so a
  // disk whose speed drifts (a shared virtual disk does) slows every method alike.
  const uint32_t rounds =
      flags.rounds != 0 ? flags.rounds
                        : std::max<uint32_t>(
                              1, static_cast<uint32_t>(std::lround(flags.seconds / kRoundSeconds)));
  const double slice_s = flags.seconds / rounds;
  for (uint32_t round = 0; round < rounds; ++round) {
    const size_t shift = round * methods.size() / rounds;
    for (size_t k = 0; k < methods.size(); ++k) {
      Method& m = methods[(k + shift) % methods.size()];
      auto r = m.run(slice_s);
      if (!r) {
        progress(m.name + ": " + r.error().message);
        return 1;
      }
      m.bytes += r->first;
      m.seconds += r->second;
      m.round_gbps.push_back(r->second > 0 ? static_cast<double>(r->first) / r->second / 1e9 : 0);
      progress(fmt::format("round {}/{} [{}/{}] {}: {:.2f} GB/s", round + 1, rounds, k + 1,
                           methods.size(), m.name, m.round_gbps.back()));
    }
  }
  // Read latency with one expert at a time: no queueing behind other loads.
  auto idle = (*engine)->drive(1.0, 1);
  if (!idle) {
    progress("expertd: " + idle.error().message);
    return 1;
  }

  // --- output
  const Method* best = nullptr;
  const Method* seq = nullptr;
  const Method* mm = nullptr;
  for (const Method& m : methods) {
    if (m.kind == "raw" && (best == nullptr || m.gbps() > best->gbps())) best = &m;
    if (m.kind == "sequential") seq = &m;
    if (m.kind == "mmap") mm = &m;
  }
  const Method& e = methods.front();
  const double ratio = best->gbps() > 0.0 ? e.gbps() / best->gbps() : 0.0;
  // The engine against the raw loop of its own shape: what the engine's machinery costs.
  const Method* same = nullptr;
  for (const Method& m : methods) {
    if (m.kind == "raw" && m.name == describe_read_config(engine_config)) same = &m;
  }
  const double same_ratio = same != nullptr && same->gbps() > 0.0 ? e.gbps() / same->gbps() : 0.0;
  const uint64_t verify_failures =
      (*engine)->verify_failures() + (engine_default ? engine_default->verify_failures() : 0);
  const uint64_t verified = engine_phase.checked + default_phase.checked + idle->checked;
  const uint64_t unchecked = engine_phase.unchecked + default_phase.unchecked + idle->unchecked;
  const uint64_t errors = engine_phase.acquire_errors + default_phase.acquire_errors +
                          idle->acquire_errors + (*engine)->load_failures() +
                          (engine_default ? engine_default->load_failures() : 0);

  std::string table =
      fmt::format("{:<48} {:>7} {:>8}  {}\n", "method", "GB/s", "vs best", "per round");
  for (const Method& m : methods) {
    std::string per_round;
    for (const double g : m.round_gbps) per_round += fmt::format(" {:.2f}", g);
    table += fmt::format("{:<48} {:>7.3f} {:>8.3f} {}\n", m.name, m.gbps(),
                         best->gbps() > 0 ? m.gbps() / best->gbps() : 0.0, per_round);
  }
  const std::string verify_line =
      verify ? fmt::format(
                   "{} failures in {} loads checked byte for byte after their rounds ({} "
                   "not checked: evicted first){}",
                   verify_failures, verified, unchecked,
                   (*engine)->verify_message().empty()
                       ? ""
                       : " (first: " + (*engine)->verify_message() + ")")
             : std::string("skipped (not a forged model, or --no-verify)");
  const std::string summary = fmt::format(
      "best raw: {} at {:.3f} GB/s\n"
      "expertd: {:.3f} GB/s ({} {}, chosen by {}) = {:.3f} of the best raw, {:.3f} of the raw "
      "loop of the same shape\n"
      "expertd: {} experts read in {:.2f} s ({} of {} acquires hit, {} errors); {:.3f} GB/s "
      "read incl. widening in {} reads\n"
      "verify: {}\n"
      "latency, load start -> READY: p50 {:.0f} us, p99 {:.0f} us with {} experts outstanding; "
      "one at a time: p50 {:.0f} us, p99 {:.0f} us\n"
      "sequential ceiling ({}): {:.3f} GB/s; mmap + page faults: {:.3f} GB/s\n"
      "probe: {} at {:.3f} GB/s in {:.1f} s\n",
      best->name, best->gbps(), e.gbps(), (*engine)->backend_name(), describe_engine(engine_config),
      engine_source, ratio, same_ratio, engine_phase.loads, engine_phase.seconds, engine_phase.hits,
      engine_phase.acquires, errors,
      engine_phase.seconds > 0
          ? static_cast<double>(engine_phase.bytes_read) / engine_phase.seconds / 1e9
          : 0.0,
      engine_phase.reads, verify_line, us(percentile(engine_phase.latencies_ns, 50)),
      us(percentile(engine_phase.latencies_ns, 99)), chosen_options.outstanding,
      us(percentile(idle->latencies_ns, 50)), us(percentile(idle->latencies_ns, 99)),
      describe_read_config(kSequentialConfig), seq->gbps(), mm->gbps(),
      describe_read_config(choice->config), choice->gbps, flags.probe_seconds);

  std::FILE* text = flags.json ? stderr : stdout;
  std::fputs(table.c_str(), text);
  std::fputs(summary.c_str(), text);
  if (flags.json) {
    Json j;
    j["raw_gbps"] = best->gbps();
    j["raw_method"] = best->name;
    j["expertd_gbps"] = e.gbps();
    j["ratio"] = ratio;
    j["ratio_same_shape"] = same_ratio;
    j["experts_read"] = engine_phase.loads;
    j["verify_failures"] = verify_failures;
    j["verified"] = verify;
    j["verify_checked"] = verified;
    j["verify_unchecked"] = unchecked;
    j["errors"] = errors;
    Json raw = Json::array();
    for (const Method& m : methods) {
      if (m.kind == "raw") raw.push_back(method_json(m, best->gbps()));
    }
    j["raw_method_table"] = std::move(raw);
    j["seq_gbps"] = seq->gbps();
    j["mmap_gbps"] = mm->gbps();
    j["latency_us_p50"] = us(percentile(engine_phase.latencies_ns, 50));
    j["latency_us_p99"] = us(percentile(engine_phase.latencies_ns, 99));
    j["latency_outstanding"] = chosen_options.outstanding;
    j["idle_latency_us_p50"] = us(percentile(idle->latencies_ns, 50));
    j["idle_latency_us_p99"] = us(percentile(idle->latencies_ns, 99));
    j["engine_queue_depth"] = engine_config.queue_depth;
    j["engine_chunk_bytes"] = engine_config.chunk_bytes;
    j["engine_config_source"] = engine_source;
    j["engine_round_gbps"] = e.round_gbps;
    Json tried = Json::array();
    for (const ProbeTrial& t : choice->trials) {
      tried.push_back({{"queue_depth", t.config.queue_depth},
                       {"chunk_bytes", t.config.chunk_bytes},
                       {"gbps", t.result.gbps()}});
    }
    j["probe"] = {{"queue_depth", choice->config.queue_depth},
                  {"chunk_bytes", choice->config.chunk_bytes},
                  {"gbps", choice->gbps},
                  {"seconds", flags.probe_seconds},
                  {"trials", std::move(tried)}};
    if (engine_default) {
      j["expertd_default_gbps"] = methods[1].gbps();
      j["expertd_default_queue_depth"] = default_config.queue_depth;
      j["expertd_default_chunk_bytes"] = default_config.chunk_bytes;
    }
    j["backend"] = (*engine)->backend_name();
    j["backend_describe"] = (*engine)->backend_describe();
    if (!(*engine)->fallback_reason().empty()) j["backend_fallback"] = (*engine)->fallback_reason();
    j["acquires"] = engine_phase.acquires;
    j["hits"] = engine_phase.hits;
    j["expert_bytes_read"] = engine_phase.expert_bytes;
    j["bytes_read"] = engine_phase.bytes_read;
    j["reads"] = engine_phase.reads;
    j["engine_seconds"] = engine_phase.seconds;
    j["cache_bytes"] = cache_bytes;
    j["cache_slots"] = (*engine)->cache_slots();
    j["model"] = flags.model;
    j["model_bytes"] = model_bytes;
    j["expert_bytes_total"] = map->total_expert_bytes();
    j["experts"] = sequence.size();
    j["slot_bytes"] = (*engine)->slot_bytes();
    j["dio_alignment"] = rp.alignment();
    j["seconds_per_method"] = flags.seconds;
    j["rounds"] = rounds;
    j["grid"] = flags.grid;
    j["seed"] = flags.seed;
    j["date"] = machine.date;
    j["host"] = machine.host;
    j["cpus"] = machine.cpus;
    j["ram_bytes"] = machine.ram_bytes;
    j["kernel"] = machine.kernel;
    j["disk"] = machine.disk;
    std::puts(j.dump(2).c_str());
  }
  return verify_failures > 0 || unchecked > 0 || errors > 0 ? 3 : 0;
}

}  // namespace

void add_storage_command(CLI::App& app, int* exit_code) {
  auto flags = std::make_shared<StorageFlags>();
  CLI::App* cmd = app.add_subcommand(
      "storage",
      "cold random-expert reads: the storage engine against raw pread/io_uring loops over the same "
      "byte ranges (their best is the disk's ceiling), plus sequential and mmap references");
  cmd->add_option("--model", flags->model, "a GGUF model (the first shard of a split one)")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--cache", flags->cache,
                  "expert cache size, e.g. 4GiB, 512MiB (default: 1/4 of the expert bytes, at "
                  "most 1/4 of RAM)");
  cmd->add_option("--seconds", flags->seconds, "seconds per method, over all rounds")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--rounds", flags->rounds,
                  "rounds the methods take turns in, which evens out a disk whose speed drifts "
                  "(default: one per 0.5 s of --seconds)")
      ->check(CLI::Range(1, 1000));
  cmd->add_option("--grid", flags->grid,
                  "raw io_uring loops: 'full' (queue depths 1-64 x chunks 256 KiB-whole slice) or "
                  "'engine' (only the engine's shapes, for a quick paired comparison)")
      ->capture_default_str()
      ->check(CLI::IsMember({"full", "engine"}));
  cmd->add_flag("--json", flags->json,
                "print one JSON object on stdout (the table goes to stderr)");
  cmd->add_option("--backend", flags->backend, "the engine's read backend")
      ->capture_default_str()
      ->check(CLI::IsMember({"uring", "pread"}));
  cmd->add_option("--queue-depth", flags->queue_depth,
                  "the engine's reads in flight (default: what the probe chose)")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--chunk", flags->chunk,
                  "the engine's read size, e.g. 1MiB, or 'whole' for one read per slice "
                  "(default: what the probe chose)");
  cmd->add_option("--outstanding", flags->outstanding,
                  "acquires the engine benchmark keeps waiting (default: enough experts for twice "
                  "the queue depth of reads, at least 4)")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--seed", flags->seed, "seed of the random expert order")->capture_default_str();
  cmd->add_flag("!--no-verify", flags->verify,
                "skip checking every load against expert-forge's content");
  cmd->add_flag("--compare-defaults", flags->compare_defaults,
                "also run the engine at the scheduler's built-in queue depth and chunk size (in an "
                "arena of its own: on a VM its rate is not comparable, see docs/PERFORMANCE.md)");
  cmd->add_option("--probe-seconds", flags->probe_seconds,
                  "time for the start-up probe of queue depth and chunk size")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->callback([flags, exit_code] { *exit_code = run_storage(*flags); });
}

}  // namespace expertd::bench
