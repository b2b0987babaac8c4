#include "daemon/core.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sched.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <random>

#include "base/check.h"
#include "cache/checksums.h"

namespace expertd {

namespace {

constexpr uint32_t kRequestCapacity = 512;
constexpr uint32_t kCompletionCapacity = 512;
constexpr uint64_t kCommandTag = 1ull << 40;
constexpr uint64_t kSessionTag = 1ull << 41;  // | session id
constexpr uint32_t kRequestBudget = 1024;     // entries taken from one ring per loop

void drain_eventfd(int fd) {
  uint64_t v = 0;
  while (::read(fd, &v, sizeof(v)) == sizeof(v)) {
  }
}

void ring_eventfd(int fd) {
  const uint64_t one = 1;
  // A full counter (EAGAIN) still means "readable": nothing is lost.
  [[maybe_unused]] const ssize_t n = ::write(fd, &one, sizeof(one));
}

}  // namespace

// Routes a model's completions to the sessions' rings.
class DaemonCore::Sink final : public CompletionSink {
 public:
  Sink(DaemonCore& core, uint32_t model) : core_(core), model_(model) {}
  void complete(const Completion& c) override { core_.deliver(model_, c); }

 private:
  DaemonCore& core_;
  uint32_t model_;
};

struct DaemonCore::Model {
  std::string name;
  std::unique_ptr<Sink> sink;
  std::unique_ptr<ExpertStore> store;
  std::unique_ptr<LoadChecker> verifier;
  ChecksumManifest checksums;  // with config.checksums: what the scheduler checks loads against
  uint32_t first_file = 0;
  uint32_t file_count = 0;
  std::vector<uint64_t> layer_hits;
  std::vector<uint64_t> layer_misses;
  uint64_t verify_failures_logged = 0;
  uint64_t failures_logged = 0;  // the scheduler's failed loads already offered to the log
  // Why the model is no longer served (its file changed), empty while it is.
  std::string file_changed;
};

struct DaemonCore::Session {
  uint32_t id = 0;
  uint32_t model = 0;
  ClientIdentity who;
  SharedRegion region;
  UniqueFd request_fd;     // eventfd: the client rings us (watched while the session is open)
  UniqueFd completion_fd;  // eventfd: we ring the client
  // These point into `region`.
  abi::SessionHeader* header = nullptr;
  abi::RingHeader* req = nullptr;
  abi::Request* req_entries = nullptr;
  abi::RingHeader* comp = nullptr;
  abi::CompletionEntry* comp_entries = nullptr;
  uint32_t comp_tail = 0;       // ours: the client cannot move it
  uint32_t req_head = 0;        // ours
  uint32_t outstanding = 0;     // acquires not yet completed
  std::vector<uint32_t> holds;  // per slot of the model's arena
  uint32_t hold_count = 0;
  bool comp_dirty = false;
  bool closed = false;
  uint64_t acquires = 0;
  uint64_t prefetches = 0;
  uint64_t releases = 0;
};

// ---------------------------------------------------------------------------------------------
// Creation

Result<std::unique_ptr<DaemonCore>> DaemonCore::create(const DaemonConfig& config,
                                                       const LoadCheckerFactory& make_checker,
                                                       const BackendWrapper& wrap_backend) {
  EXPERTD_TRY(validate_config(config));
  std::unique_ptr<DaemonCore> core(new DaemonCore());
  core->config_ = config;

  std::vector<GgufModel> opened;
  std::vector<std::string> paths;
  for (const auto& m : config.models) {
    auto model = GgufModel::open(m.path);
    if (!model) {
      return make_error(model.error().code,
                        fmt::format("model '{}': {}", m.name, model.error().message));
    }
    std::vector<ShardFile> files;
    for (const auto& s : model->shards()) {
      struct stat st {};
      if (::stat(s.path().c_str(), &st) != 0) {
        const int e = errno;
        return make_error(
            e, fmt::format("model '{}': {}: stat: {}", m.name, s.path(), std::strerror(e)));
      }
      files.push_back(
          ShardFile{s.path(), st.st_dev, st.st_ino,
                    FileIdentity{st.st_dev, st.st_ino, static_cast<uint64_t>(st.st_size),
                                 st.st_mtim.tv_sec * 1'000'000'000ll + st.st_mtim.tv_nsec,
                                 st.st_ctim.tv_sec * 1'000'000'000ll + st.st_ctim.tv_nsec}});
      paths.push_back(s.path());
    }
    core->model_files_.push_back(std::move(files));
    opened.push_back(std::move(*model));
    core->model_names_.push_back(m.name);
  }

  BackendOptions bo;
  bo.queue_depth = std::max<uint32_t>(config.queue_depth ? config.queue_depth : 32, 64);
  // One watch per session's request doorbell, one for the command eventfd, and a few spare for
  // other fds of the daemon's own, so that max_sessions sessions always get theirs.
  bo.max_watches = config.max_sessions + 4;
  auto backend = make_backend(config.backend, bo, &core->fallback_reason_);
  if (!backend) return backend.take_error();
  core->io_ = std::move(*backend);
  if (wrap_backend) core->io_ = wrap_backend(std::move(core->io_));
  if (!core->fallback_reason_.empty()) spdlog::warn("{}", core->fallback_reason_);
  EXPERTD_TRY(core->io_->open_files(paths));

  // Percentages are of the memory this process may use: RAM, or its cgroup's limit when lower.
  const uint64_t ram = physical_memory_bytes();
  const CgroupMemoryLimit cgroup = cgroup_memory_limit();
  const uint64_t usable = usable_memory_bytes(cgroup);
  uint64_t cache_bytes = 0;
  uint64_t staging_bytes = 0;
  EXPERTD_TRY_ASSIGN(cache_bytes, parse_size("cache", config.cache, usable));
  EXPERTD_TRY_ASSIGN(staging_bytes, parse_size("staging", config.staging, usable));
  if (usable != ram && (config.cache.ends_with('%') || config.staging.ends_with('%'))) {
    spdlog::info(
        "memory: cache {} and staging {} are of the memory cgroup's limit {} ({}), not "
        "of the machine's {}",
        config.cache, config.staging, human_bytes(usable), cgroup.file, human_bytes(ram));
  }
  const uint64_t per_model_cache = cache_bytes / config.models.size();
  const uint64_t per_model_staging = staging_bytes / config.models.size();
  uint64_t arena_bytes = 0;  // the models' cache and staging slots, summed in the loop below
  {
    // One token of one session needs its top-k experts of a layer held at once: a smaller cache
    // could only stall. Checked before the read probe, which takes seconds.
    uint32_t file = 0;
    for (uint32_t i = 0; i < opened.size(); ++i) {
      SliceMap map;
      EXPERTD_TRY_ASSIGN(map, SliceMap::build(opened[i]));
      uint32_t alignment = 512;
      for (uint32_t s = 0; s < opened[i].shards().size(); ++s) {
        alignment = std::max(alignment, core->io_->file(file + s).dio_alignment);
      }
      file += static_cast<uint32_t>(opened[i].shards().size());
      const uint64_t slot_bytes = SlotLayouts(map, alignment, page_bytes()).slot_bytes();
      const uint64_t experts = uint64_t{map.expert_count()} * map.layers().size();
      const uint64_t need = std::max<uint64_t>(map.top_k(), 1);  // no key: one slot
      if (slot_bytes != 0) {
        // The arena as ExpertStore sizes it below: no more cache slots than experts, and the
        // staging ring's 2..experts slots.
        arena_bytes += std::min(per_model_cache / slot_bytes, experts) * slot_bytes +
                       std::clamp<uint64_t>(per_model_staging / slot_bytes, 2,
                                            std::max<uint64_t>(experts, 2)) *
                           slot_bytes;
      }
      if (slot_bytes != 0 && std::min(per_model_cache / slot_bytes, experts) < need) {
        return make_error(EINVAL,
                          fmt::format("model '{}': a cache of {} holds {} of its experts "
                                      "({} a slot); one token needs {} (its top-k) at "
                                      "once: give --cache at least {}",
                                      config.models[i].name, human_bytes(per_model_cache),
                                      per_model_cache / slot_bytes, human_bytes(slot_bytes), need,
                                      human_bytes(need * slot_bytes * config.models.size())));
      }
    }
  }

  if (arena_bytes + kCgroupHeadroomBytes > usable) {
    // The arena's pages are locked (mlock) or pinned (io_uring's registered buffers, with or
    // without mlock), so the kernel cannot swap them: past the memory this process may use it
    // kills the daemon. (The arena is what the models need: a --cache above their size is not.)
    const std::string where = usable == ram ? fmt::format("the machine's RAM {}", human_bytes(ram))
                                            : fmt::format("the memory cgroup's limit {} ({})",
                                                          human_bytes(usable), cgroup.file);
    return make_error(
        ENOMEM,
        fmt::format("the arena (cache {} + staging {} as the models use them: {}) leaves less "
                    "than {} for expertd itself under {}: it is locked or pinned in memory "
                    "(mlock, io_uring's registered buffers), so the kernel would kill expertd "
                    "rather than swap it; give a smaller --cache (a percentage is of that memory)",
                    human_bytes(cache_bytes), human_bytes(staging_bytes), human_bytes(arena_bytes),
                    human_bytes(kCgroupHeadroomBytes), where));
  }

  const ReadConfig read = core->choose_read_config(opened, paths);

  core->reactor_ = std::make_unique<StoreReactor>(*core->io_);
  uint32_t file = 0;
  std::vector<iovec> buffers;
  for (uint32_t i = 0; i < opened.size(); ++i) {
    auto m = std::make_unique<Model>();
    m->name = config.models[i].name;
    m->sink = std::make_unique<Sink>(*core, i);
    m->first_file = file;
    m->file_count = static_cast<uint32_t>(opened[i].shards().size());
    std::vector<uint32_t> files(m->file_count);
    for (uint32_t s = 0; s < m->file_count; ++s) files[s] = file + s;
    file += m->file_count;

    StoreOptions so;
    so.cache_bytes = per_model_cache;
    so.policy = config.policy;
    so.lock_memory = config.lock_memory;
    so.scheduler.queue_depth = read.queue_depth;
    so.scheduler.chunk_bytes = read.chunk_bytes;
    so.scheduler.prefetch_depth = config.prefetch_depth;
    so.scheduler.max_sessions = config.max_sessions;
    so.scheduler.acquire_timeout_ns = uint64_t{config.acquire_timeout_ms} * 1'000'000;
    so.scheduler.read_timeout_ns = uint64_t{config.read_timeout_ms} * 1'000'000;
    // Staging slots: the configured bytes, at least 2 slots (one streams while one is held).
    SliceMap probe_map;
    EXPERTD_TRY_ASSIGN(probe_map, SliceMap::build(opened[i]));
    uint32_t alignment = 512;
    for (const uint32_t f : files)
      alignment = std::max(alignment, core->io_->file(f).dio_alignment);
    const uint64_t slot_bytes = SlotLayouts(probe_map, alignment, page_bytes()).slot_bytes();
    const uint64_t experts = uint64_t{probe_map.expert_count()} * probe_map.layers().size();
    so.staging_slots = static_cast<uint32_t>(std::clamp<uint64_t>(
        slot_bytes ? per_model_staging / slot_bytes : 2, 2, std::max<uint64_t>(experts, 2)));

    // The verifier (verify mode) observes loads; it needs the store's layouts, so it is wired
    // after creation through a forwarding observer.
    auto store = ExpertStore::create(m->name, std::move(opened[i]), *core->io_, files, so, *m->sink,
                                     nullptr);
    if (!store) {
      return make_error(store.error().code,
                        fmt::format("model '{}': {}", m->name, store.error().message));
    }
    m->store = std::move(*store);
    {
      // Each session reserves its top-k at attach (docs/CACHE.md "Reservations"). A warning, not
      // a refusal: max_sessions bounds every model's sessions together, and attach refuses the
      // session that does not fit with the numbers.
      const Scheduler& sched = m->store->scheduler();
      const uint64_t top_k = std::max<uint32_t>(m->store->slice_map().top_k(), 1);
      const uint64_t need = top_k * config.max_sessions;
      if (sched.capacity() < need) {
        spdlog::warn(
            "model '{}': {} slots ({} cache + {} staging) hold the top-k ({}) of {} sessions, "
            "not max_sessions {} ({} slots): attach refuses sessions beyond {}",
            m->name, sched.capacity(), m->store->cache().slot_count(),
            m->store->staging().slot_count(), top_k, sched.capacity() / top_k, config.max_sessions,
            need, sched.capacity() / top_k);
      }
    }
    if (config.verify) {
      if (!make_checker) {
        return make_error(EINVAL,
                          fmt::format("model '{}': --verify: this build has no verifier", m->name));
      }
      auto v = make_checker(*m->store);
      if (!v) {
        return make_error(EINVAL,
                          fmt::format("model '{}': --verify: {}", m->name, v.error().message));
      }
      m->verifier = std::move(*v);
      m->store->scheduler().set_observer(m->verifier.get());
    }
    if (config.checksums) {
      bool built = false;
      std::string write_error;
      const uint64_t t0 = monotonic_ns();
      auto manifest =
          ChecksumManifest::load_or_build(config.state_directory, m->name, m->store->model(),
                                          m->store->slice_map(), &built, &write_error);
      if (!manifest) {
        return make_error(manifest.error().code, fmt::format("model '{}': checksums: {}", m->name,
                                                             manifest.error().message));
      }
      m->checksums = std::move(*manifest);
      if (!write_error.empty()) spdlog::warn("model '{}': {}", m->name, write_error);
      spdlog::info("model '{}': checksums: {} {} ({} experts, {:.1f} s)", m->name,
                   built ? "built" : "loaded", m->checksums.path(),
                   m->store->slice_map().layers().size() * m->store->slice_map().expert_count(),
                   static_cast<double>(monotonic_ns() - t0) / 1e9);
      m->store->scheduler().set_checksums(m->checksums.table());
    }
    m->layer_hits.assign(m->store->slice_map().block_count(), 0);
    m->layer_misses.assign(m->store->slice_map().block_count(), 0);
    spdlog::info("{}", m->store->describe());
    if (!m->store->arena().locked() && config.lock_memory) {
      spdlog::warn("model '{}': arena not locked: {}", m->name, m->store->arena().lock_error());
    }
    buffers.push_back(iovec{m->store->arena().data(), m->store->arena().size()});
    core->reactor_->add(m->store.get(), m->first_file, m->file_count);
    core->models_.push_back(std::move(m));
  }
  if (auto st = core->io_->register_buffers(buffers); !st) {
    spdlog::warn("backend: {}", st.error().message);
  }
  spdlog::info("backend: {}", core->io_->describe());

  core->command_fd_ = UniqueFd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!core->command_fd_.valid()) {
    const int err = errno;
    return make_error(err, fmt::format("eventfd for the command queue: {}", std::strerror(err)));
  }
  EXPERTD_TRY(core->io_->watch(core->command_fd_.get(), kCommandTag));
  core->commands_.resize(kMaxCommands);
  core->sessions_.resize(config.max_sessions);
  core->start_ns_ = monotonic_ns();
  core->refresh_status();
  return core;
}

ReadConfig DaemonCore::choose_read_config(const std::vector<GgufModel>& models,
                                          const std::vector<std::string>& paths) {
  if (config_.queue_depth != 0) {
    read_choice_ = fmt::format("{} (configured)",
                               describe_read_config({config_.queue_depth, config_.chunk_bytes}));
    return ReadConfig{config_.queue_depth, config_.chunk_bytes};
  }
  const ReadConfig fallback{32, 1u << 20};
  if (io_->name() != "io_uring") {
    read_choice_ = fmt::format("{} (default: the probe measures io_uring shapes)",
                               describe_read_config(fallback));
    return fallback;
  }
  // A sample of the experts' slices in a seeded random order: the access pattern of decoding.
  std::vector<ProbeRange> ranges;
  uint32_t file_base = 0;
  for (const auto& m : models) {
    auto map = SliceMap::build(m);
    if (map) {
      std::array<ExpertSlice, 3> sl{};
      for (const auto& layer : map->layers()) {
        for (uint32_t e = 0; e < map->expert_count(); ++e) {
          const uint32_t n = map->slices(layer.layer, e, sl);
          for (uint32_t i = 0; i < n; ++i) {
            ranges.push_back({file_base + sl[i].shard, sl[i].offset, sl[i].bytes});
          }
        }
      }
    }
    file_base += static_cast<uint32_t>(m.shards().size());
  }
  std::mt19937_64 rng(1);
  std::shuffle(ranges.begin(), ranges.end(), rng);
  if (ranges.size() > 4096) ranges.resize(4096);
  auto probe = ReadProbe::open(paths);
  Result<ProbeChoice> choice =
      probe ? probe_best_read_config(*probe, ranges) : Result<ProbeChoice>(probe.take_error());
  if (!choice) {
    spdlog::warn("read probe failed ({}); using {}", choice.error().message,
                 describe_read_config(fallback));
    read_choice_ = describe_read_config(fallback) + " (default: the probe failed)";
    return fallback;
  }
  std::string tried;
  for (const auto& t : choice->trials) {
    tried += fmt::format("{}{} {:.2f}", tried.empty() ? "" : ", ", describe_read_config(t.config),
                         t.result.gbps());
  }
  read_choice_ = fmt::format("{} at {:.2f} GB/s (probed; tried {})",
                             describe_read_config(choice->config), choice->gbps, tried);
  spdlog::info("read probe: {}", read_choice_);
  return choice->config;
}

DaemonCore::~DaemonCore() { stop(); }

std::string DaemonCore::backend_name() const { return std::string(io_->name()); }

// ---------------------------------------------------------------------------------------------
// Thread and commands

std::vector<DaemonCore::FileIdentity> DaemonCore::shard_identities(uint32_t model) const {
  std::vector<FileIdentity> out;
  for (const ShardFile& f : model_files_[model]) out.push_back(f.identity);
  return out;
}

ExpertStore& DaemonCore::store(uint32_t model) {
  EXPERTD_CHECK(!running_.load());
  return *models_[model]->store;
}

Status DaemonCore::start() {
  if (running_.exchange(true)) return Ok{};
  stop_ = false;
  last_progress_ms_ = monotonic_ms();
  thread_ = std::thread([this] { run(); });
  return Ok{};
}

void DaemonCore::stop() {
  if (!running_.load()) return;
  stop_ = true;
  ring_eventfd(command_fd_.get());
  if (thread_.joinable()) thread_.join();
  running_ = false;
}

bool DaemonCore::post(std::function<void(DaemonCore&)> fn) {
  {
    std::lock_guard<std::mutex> lock(command_mu_);
    const uint32_t queued = command_tail_ - command_head_;
    EXPERTD_CHECK_LE(queued, kMaxCommands);
    if (queued == kMaxCommands || stop_.load()) return false;
    commands_[command_tail_ % kMaxCommands] = std::move(fn);  // a move: the slot allocates nothing
    ++command_tail_;
    commands_queued_.fetch_add(1, std::memory_order_relaxed);
  }
  ring_eventfd(command_fd_.get());
  return true;
}

void DaemonCore::run_commands() {
  // Every loop: one load and no lock while nothing is queued. A post() after this load is seen
  // next loop (its eventfd write makes the wait return at once).
  uint32_t n = commands_queued_.load(std::memory_order_relaxed);
  // Only the commands queued now: one that posts another does not keep the loop here. Each runs
  // outside the lock, so it may post() itself.
  for (; n > 0; --n) {
    std::function<void(DaemonCore&)> fn;
    {
      std::lock_guard<std::mutex> lock(command_mu_);
      EXPERTD_CHECK_NE(command_tail_, command_head_);  // commands_queued_ counted it
      EXPERTD_CHECK_LE(command_tail_ - command_head_, kMaxCommands);
      auto& slot = commands_[command_head_ % kMaxCommands];
      fn = std::move(slot);
      slot = nullptr;  // a moved-from std::function is only "valid but unspecified"
      ++command_head_;
      commands_queued_.fetch_sub(1, std::memory_order_relaxed);
    }
    fn(*this);
  }
}

void DaemonCore::run() {
  std::array<IoEvent, 64> fd_events{};
  uint64_t last_status_ms = 0;
  uint64_t last_request_ns = 0;
  while (!stop_.load(std::memory_order_relaxed)) {
    run_commands();
    bool busy = false;
    for (auto& s : sessions_) {
      if (s && !s->closed) busy |= poll_session(*s);
    }
    flush_completions();
    // A client that just asked usually asks again soon (the next layer's acquire, a release):
    // stay awake for spin_ns after the last request, so its next round trip needs no wake-up of
    // a sleeping reactor (tens of microseconds on a VM whose idle vCPU halted). Each idle turn
    // yields the CPU, so a client sharing it is not starved by the spin.
    int timeout = 0;
    if (busy) {
      last_request_ns = monotonic_ns();
    } else if (config_.reactor_spin_us != 0 &&
               monotonic_ns() - last_request_ns < uint64_t{config_.reactor_spin_us} * 1000) {
      sched_yield();
    } else {
      timeout = arm_sleep() ? 100 : 0;
    }
    const int n = reactor_->run_once(timeout, fd_events);
    for (auto& s : sessions_) {
      if (s && !s->closed) s->req->waiting.value.store(0, std::memory_order_relaxed);
    }
    // Acquires that waited their deadline for a slot (at most one reactor sleep late).
    const uint64_t now_ns = monotonic_ns();
    for (auto& m : models_) m->store->scheduler().expire(now_ns);
    if (n < 0) {
      spdlog::error("reactor: backend wait failed: {}", std::strerror(-n));
      continue;  // no progress stamp: the watchdog notices a reactor that keeps failing
    }
    for (int i = 0; i < n; ++i) {
      const uint64_t tag = fd_events[static_cast<size_t>(i)].tag;
      if (tag == kCommandTag) {
        drain_eventfd(command_fd_.get());
      } else if (tag & kSessionTag) {
        const uint64_t id = tag & ~kSessionTag;
        EXPERTD_CHECK_LT(id, sessions_.size());  // our own tag (attach)
        // A session detached in this loop may still have an event in this batch.
        if (sessions_[id]) drain_eventfd(sessions_[id]->request_fd.get());
      }
    }
    log_failed_loads();
    flush_completions();
    reactor_loops_.store(reactor_loops_.load(std::memory_order_relaxed) + 1,
                         std::memory_order_relaxed);
    const uint64_t ms = monotonic_ms();
    last_progress_ms_.store(ms, std::memory_order_relaxed);
    if (ms - last_status_ms >= 1000) {
      for (uint32_t i = 0; i < models_.size(); ++i) check_files(i);
      refresh_status();
      last_status_ms = ms;
    }
  }
  // Drain: reads in flight finish (their slots become READY or FREE), then sessions go.
  run_commands();
  if (!reactor_->drain(10'000)) spdlog::warn("shutdown: reads still in flight after 10 s");
  refresh_status();
  for (const auto& m : models_) {
    if (m->verifier) {
      spdlog::info("model '{}': verify: {} loads checked, {} differ", m->name,
                   m->verifier->verified(), m->verifier->failures());
    }
  }
  for (auto& s : sessions_) {
    if (s) detach(s->id, "daemon shutting down");
  }
}

Error DaemonCore::unknown_model(std::string_view name) const {
  // A client's name is echoed back at most 64 bytes long (cut on a UTF-8 boundary): a megabyte of
  // name must not come back as a megabyte of error.
  constexpr size_t kShown = 64;
  std::string shown(name.substr(0, kShown));
  if (name.size() > kShown) {
    while (!shown.empty() && (static_cast<unsigned char>(shown.back()) & 0xC0) == 0x80) {
      shown.pop_back();
    }
    if (!shown.empty() && static_cast<unsigned char>(shown.back()) >= 0xC0) shown.pop_back();
    shown += fmt::format("... ({} bytes)", name.size());
  }
  return make_error(ENOENT, fmt::format("model '{}' is not served by this daemon (models: {})",
                                        shown, fmt::join(model_names_, ", ")));
}

// ---------------------------------------------------------------------------------------------
// Sessions

Result<Attachment> DaemonCore::attach(const std::string& model_name, const ClientIdentity& who) {
  uint32_t model = 0;
  while (model < models_.size() && models_[model]->name != model_name) ++model;
  if (model == models_.size()) {
    return unknown_model(model_name);
  }
  if (!models_[model]->file_changed.empty()) {
    return make_error(ESTALE, models_[model]->file_changed);
  }
  uint32_t id = 0;
  uint32_t of_uid = 0;
  for (const auto& s : sessions_) of_uid += s && s->who.uid == who.uid ? 1 : 0;
  const uint32_t per_uid = std::min(config_.max_sessions_per_uid, config_.max_sessions);
  if (!who.admin && of_uid >= per_uid) {
    return make_error(EBUSY, fmt::format("uid {} has {} sessions attached, its limit "
                                         "(max_sessions_per_uid {})",
                                         who.uid, of_uid, per_uid));
  }
  while (id < sessions_.size() && sessions_[id]) ++id;
  if (id == sessions_.size()) {
    return make_error(EBUSY, fmt::format("all {} sessions are in use (max_sessions {})",
                                         sessions_.size(), sessions_.size()));
  }
  // The session's reservation (docs/CACHE.md "Reservations"): refused now, with the numbers, when
  // the slots cannot hold one more top-k beside the others'.
  Scheduler& sched = models_[model]->store->scheduler();
  const uint32_t top_k = std::max<uint32_t>(models_[model]->store->slice_map().top_k(), 1);
  if (uint64_t{sched.reserved()} + top_k > sched.capacity()) {
    ExpertStore& st = *models_[model]->store;
    const uint32_t attached = sched.reserved() / top_k;
    const uint32_t pinned = st.cache().pinned_count();
    return make_error(
        EBUSY,
        fmt::format("model '{}': no room for another session: its {} slots ({} cache + {} "
                    "staging{}) hold the top-k ({}) of {} sessions, and {} are attached; "
                    "{} sessions need at least {} slots of {} (--cache, --staging)",
                    model_name, sched.capacity(), st.cache().limit(), st.staging().slot_count(),
                    pinned ? fmt::format(" - {} pinned", pinned) : std::string(), top_k,
                    sched.capacity() / top_k, attached, attached + 1,
                    uint64_t{attached + 1} * top_k, human_bytes(st.layouts().slot_bytes())));
  }
  auto s = std::make_unique<Session>();
  s->id = id;
  s->model = model;
  s->who = who;
  const abi::SessionLayout layout = abi::session_layout(kRequestCapacity, kCompletionCapacity);
  EXPERTD_TRY_ASSIGN(s->region, SharedRegion::create(fmt::format("expertd-session-{}", id),
                                                     layout.bytes, false, true));
  std::memset(s->region.data(), 0, s->region.size());
  uint8_t* base = s->region.data();
  s->header = reinterpret_cast<abi::SessionHeader*>(base);
  s->req = reinterpret_cast<abi::RingHeader*>(base + layout.request_ring_offset);
  s->req_entries = reinterpret_cast<abi::Request*>(s->req + 1);
  s->comp = reinterpret_cast<abi::RingHeader*>(base + layout.completion_ring_offset);
  s->comp_entries = reinterpret_cast<abi::CompletionEntry*>(s->comp + 1);
  s->header->magic = abi::kSessionMagic;
  s->header->version = abi::kProtocolVersion;
  s->header->session_id = id;
  s->header->max_op = abi::kOpUnkeep;
  s->header->request_ring_offset = layout.request_ring_offset;
  s->header->completion_ring_offset = layout.completion_ring_offset;
  s->header->region_bytes = s->region.size();
  s->req->capacity = kRequestCapacity;
  s->req->entry_bytes = sizeof(abi::Request);
  s->comp->capacity = kCompletionCapacity;
  s->comp->entry_bytes = sizeof(abi::CompletionEntry);
  for (UniqueFd* fd : {&s->request_fd, &s->completion_fd}) {
    *fd = UniqueFd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!fd->valid()) {
      const int err = errno;
      return make_error(err, fmt::format("eventfd: {}", std::strerror(err)));
    }
  }
  s->holds.assign(models_[model]->store->slot_count(), 0);

  const ExpertStore& store = *models_[model]->store;
  Attachment a;
  a.session = id;
  a.arena_fd = dup_fd(store.arena().fd());
  a.slot_table_fd = dup_fd(store.slot_table().fd());
  a.session_fd = dup_fd(s->region.fd());
  a.request_doorbell = dup_fd(s->request_fd.get());
  a.completion_doorbell = dup_fd(s->completion_fd.get());
  for (const UniqueFd* fd : {&a.arena_fd, &a.slot_table_fd, &a.session_fd, &a.request_doorbell,
                             &a.completion_doorbell}) {
    if (!fd->valid()) {
      const int err = errno;
      return make_error(err, fmt::format("dup of a session fd: {}", std::strerror(err)));
    }
  }
  // Last: no failure after it can leave the fd of a session that never was watched, or a
  // reservation nobody holds.
  EXPERTD_CHECK(sched.reserve_session(id, top_k));  // checked above, on this thread
  if (auto st = io_->watch(s->request_fd.get(), kSessionTag | id); !st) {
    sched.drop_session(id);
    return st.take_error();
  }
  a.acquire_timeout_ms = config_.acquire_timeout_ms;
  a.read_timeout_ms = config_.read_timeout_ms;
  a.arena_bytes = store.arena().size();
  a.slot_table_bytes = store.slot_table().size();
  a.session_bytes = s->region.size();
  a.request_capacity = kRequestCapacity;
  a.completion_capacity = kCompletionCapacity;
  spdlog::info("session {}: attached to model '{}' by {} (pid {}, uid {})", id, model_name,
               who.name.empty() ? "a client" : who.name, who.pid, who.uid);
  sessions_[id] = std::move(s);
  return a;
}

void DaemonCore::detach(uint32_t id, const char* why) {
  if (id >= sessions_.size() || !sessions_[id]) return;
  Session& s = *sessions_[id];
  Scheduler& sched = models_[s.model]->store->scheduler();
  sched.drop_session(id);
  uint32_t released = 0;
  for (uint32_t slot = 0; slot < s.holds.size(); ++slot) {
    for (; s.holds[slot] > 0; --s.holds[slot]) {
      (void)sched.release(id, slot);
      ++released;
    }
  }
  if (!s.closed) (void)io_->unwatch(s.request_fd.get());  // close_session() unwatched it
  spdlog::info("session {}: detached ({}); {} holds released", id, why, released);
  sessions_[id].reset();
}

void DaemonCore::close_session(Session& s, int reason, const std::string& why) {
  if (s.closed) return;
  s.closed = true;
  ++sessions_closed_hostile_;
  spdlog::warn("session {} (pid {}, {}): closed: {}", s.id, s.who.pid, s.who.name, why);
  s.header->closed.store(reason, std::memory_order_release);
  ring_eventfd(s.completion_fd.get());  // wake a sleeping client so it sees the closure
  // Holds and waiting acquires go now; the region stays mapped until the client detaches.
  Scheduler& sched = models_[s.model]->store->scheduler();
  sched.drop_session(s.id);
  for (uint32_t slot = 0; slot < s.holds.size(); ++slot) {
    for (; s.holds[slot] > 0; --s.holds[slot]) (void)sched.release(s.id, slot);
  }
  s.hold_count = 0;
  (void)io_->unwatch(s.request_fd.get());
}

bool DaemonCore::poll_session(Session& s) {
  const uint32_t tail = s.req->tail.value.load(std::memory_order_acquire);
  const uint32_t available = tail - s.req_head;
  if (available == 0) return false;
  if (available > kRequestCapacity) {
    close_session(s, -EPROTO,
                  fmt::format("request ring tail {} is {} entries ahead of head {} (capacity {})",
                              tail, available, s.req_head, kRequestCapacity));
    return false;
  }
  const uint32_t n = std::min(available, kRequestBudget);
  EXPERTD_CHECK_LE(n, kRequestCapacity);  // available was checked against it above
  for (uint32_t i = 0; i < n && !s.closed; ++i) {
    abi::Request r;
    // Copy once; the client may rewrite the entry while we look at it.
    std::memcpy(&r, &s.req_entries[s.req_head & (kRequestCapacity - 1)], sizeof(r));
    ++s.req_head;
    handle_request(s, r);
  }
  // Release: the client may reuse the entries we consumed.
  s.req->head.value.store(s.req_head, std::memory_order_release);
  return true;
}

void DaemonCore::handle_request(Session& s, const abi::Request& r) {
  Model& m = *models_[s.model];
  Scheduler& sched = m.store->scheduler();
  const SliceMap& map = m.store->slice_map();
  const bool valid_key = r.expert < map.expert_count() && map.find_layer(r.layer) != nullptr;
  switch (r.op) {
    case abi::kOpAcquire: {
      if (!valid_key) {
        return close_session(s, -EINVAL,
                             fmt::format("acquire of layer {} expert {}: no such expert "
                                         "(the model has {} experts in MoE layers)",
                                         r.layer, r.expert, map.expert_count()));
      }
      const uint32_t unread = s.comp_tail - s.comp->head.value.load(std::memory_order_acquire);
      if (s.outstanding + std::min(unread, kCompletionCapacity) >= kCompletionCapacity) {
        return close_session(s, -ENOBUFS,
                             fmt::format("acquire flood: {} acquires outstanding and {} "
                                         "completions unread exceed the completion ring ({})",
                                         s.outstanding, unread, kCompletionCapacity));
      }
      ++s.outstanding;
      ++s.acquires;
      const int32_t slot = m.store->cache().lookup({r.layer, r.expert});
      const bool hit =
          slot >= 0 && m.store->cache().state(static_cast<uint32_t>(slot)) == SlotState::Ready;
      ++(hit ? m.layer_hits : m.layer_misses)[r.layer];
      (void)sched.acquire(s.id, {r.layer, r.expert}, r.tag);
      return;
    }
    case abi::kOpPrefetch:
      if (!valid_key || !std::isfinite(r.score) || r.score < 0.0f || r.score > 1.0f) {
        return close_session(s, -EINVAL,
                             fmt::format("prefetch of layer {} expert {} score {}: out of range",
                                         r.layer, r.expert, r.score));
      }
      if ((r.flags & ~abi::kPrefetchExact) != 0) {
        return close_session(s, -EINVAL,
                             fmt::format("prefetch of layer {} expert {}: unknown flags {:#x}",
                                         r.layer, r.expert, r.flags));
      }
      ++s.prefetches;
      (void)sched.prefetch(s.id, {r.layer, r.expert}, r.score,
                           (r.flags & abi::kPrefetchExact) != 0);
      return;
    case abi::kOpRelease:
      if (r.arg >= s.holds.size() || s.holds[r.arg] == 0) {
        return close_session(
            s, -EINVAL, fmt::format("release of slot {}, which this session does not hold", r.arg));
      }
      EXPERTD_CHECK_GT(s.hold_count, 0);  // holds[r.arg] > 0 is counted in it
      --s.holds[r.arg];
      --s.hold_count;
      ++s.releases;
      // Before the release: a demand waiting for a slot, retried by it, may take this one.
      if ((r.flags & abi::kReleaseClientCopy) != 0 && m.store->cache().owns(r.arg)) {
        m.store->cache().set_client_copy(r.arg);
      }
      (void)sched.release(s.id, r.arg);
      return;
    case abi::kOpUnkeep:
      if (!valid_key) {
        return close_session(
            s, -EINVAL,
            fmt::format("unkeep of layer {} expert {}: out of range", r.layer, r.expert));
      }
      m.store->cache().clear_client_copy({r.layer, r.expert});
      return;
    case abi::kOpCursor:
      if (r.layer >= map.block_count()) {
        return close_session(
            s, -EINVAL,
            fmt::format("cursor at layer {}: the model has {} layers", r.layer, map.block_count()));
      }
      sched.set_cursor(s.id, r.arg, r.layer);
      return;
    default:
      return close_session(s, -EINVAL, fmt::format("unknown request op {}", r.op));
  }
}

void DaemonCore::deliver(uint32_t model, const Completion& c) {
  EXPERTD_CHECK_LT(c.session, sessions_.size());  // the scheduler only knows ids attach() gave
  Session* s = sessions_[c.session].get();
  if (s == nullptr || s->closed || s->model != model) {
    // drop_session() unlinks waiting acquires, so this is only reachable for a session closed
    // between an acquire and its immediate completion; the hold is returned at once.
    if (c.slot >= 0) (void)models_[model]->store->scheduler().release(c.session, c.slot);
    return;
  }
  // One completion per acquire of an open session: handle_request() counted it, and admitted it
  // only while outstanding + unread stayed below the ring's capacity.
  EXPERTD_CHECK_GT(s->outstanding, 0);
  EXPERTD_CHECK_LE(s->outstanding, kCompletionCapacity);
  --s->outstanding;
  abi::CompletionEntry e{c.tag, c.slot, c.generation, c.key.layer, c.key.expert};
  s->comp_entries[s->comp_tail & (kCompletionCapacity - 1)] = e;
  ++s->comp_tail;
  s->comp->tail.value.store(s->comp_tail, std::memory_order_release);
  if (c.slot >= 0) {
    EXPERTD_CHECK_LT(static_cast<uint32_t>(c.slot), s->holds.size());  // a slot of its model
    ++s->holds[static_cast<uint32_t>(c.slot)];
    ++s->hold_count;
  }
  s->comp_dirty = true;
}

void DaemonCore::flush_completions() {
  bool any = false;
  for (auto& s : sessions_) any |= s && s->comp_dirty;
  if (!any) return;
  // Orders our tail stores before reading the clients' waiting flags (pairs with the client's
  // fence between setting waiting and re-checking the ring).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  for (auto& s : sessions_) {
    if (!s || !s->comp_dirty) continue;
    s->comp_dirty = false;
    if (s->comp->waiting.value.load(std::memory_order_relaxed) != 0)
      ring_eventfd(s->completion_fd.get());
  }
}

bool DaemonCore::arm_sleep() {
  for (auto& s : sessions_) {
    if (s && !s->closed) s->req->waiting.value.store(1, std::memory_order_relaxed);
  }
  // Orders the waiting stores before re-reading the tails (pairs with the client's fence
  // between publishing a request and reading `waiting`).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  for (auto& s : sessions_) {
    if (s && !s->closed && s->req->tail.value.load(std::memory_order_acquire) != s->req_head) {
      return false;
    }
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// Control-plane queries (reactor thread)

Result<std::vector<ModelFileFd>> DaemonCore::open_model_files(const std::string& model,
                                                              uint32_t first, uint32_t max,
                                                              uint32_t* shard_count) const {
  const auto it = std::find(model_names_.begin(), model_names_.end(), model);
  if (it == model_names_.end()) {
    return unknown_model(model);
  }
  const std::vector<ShardFile>& files = model_files_[it - model_names_.begin()];
  *shard_count = static_cast<uint32_t>(files.size());
  if (first >= files.size()) {
    return make_error(EINVAL, fmt::format("model '{}' has {} files: there is no file {}", model,
                                          files.size(), first));
  }
  std::vector<ModelFileFd> out;
  for (uint32_t i = first; i < files.size() && out.size() < max; ++i) {
    const ShardFile& f = files[i];
    ModelFileFd m;
    m.shard = i;
    m.path = f.path;
    m.name = f.path.substr(f.path.find_last_of('/') + 1);  // npos + 1 == 0: no directory
    m.fd = UniqueFd(::open(f.path.c_str(), O_RDONLY | O_CLOEXEC));
    struct stat st {};
    if (!m.fd.valid() || ::fstat(m.fd.get(), &st) != 0) {
      const int e = errno;
      return make_error(
          e, fmt::format("model '{}': {}: cannot open: {}", model, f.path, std::strerror(e)));
    }
    if (st.st_dev != f.dev || st.st_ino != f.ino) {
      return make_error(ESTALE, fmt::format("model '{}': {} was replaced since expertd opened it; "
                                            "restart expertd to serve the new file",
                                            model, f.path));
    }
    m.bytes = static_cast<uint64_t>(st.st_size);
    out.push_back(std::move(m));
  }
  return out;
}

Result<ModelLayout> DaemonCore::open_model(const std::string& name) const {
  for (const auto& m : models_) {
    if (m->name != name) continue;
    if (!m->file_changed.empty()) return make_error(ESTALE, m->file_changed);
    const ExpertStore& st = *m->store;
    const SliceMap& map = st.slice_map();
    ModelLayout l;
    l.name = name;
    l.architecture = st.model().architecture();
    l.block_count = map.block_count();
    l.expert_count = map.expert_count();
    l.top_k = map.top_k();
    l.alignment = st.layouts().alignment();
    l.slot_bytes = st.layouts().slot_bytes();
    l.slot_count = st.slot_count();
    for (const auto& layer : map.layers()) {
      for (uint32_t i = 0; i < layer.slice_count; ++i) {
        const ExpertSlice& s = layer.expert0[i];
        l.slices.push_back(ModelLayout::Slice{layer.layer, std::string(slice_kind_name(s.kind)),
                                              s.shard, s.offset, layer.expert_stride[i], s.bytes,
                                              std::string(ggml_type_name(s.type)), s.ne0, s.ne1});
      }
    }
    return l;
  }
  return unknown_model(name);
}

DaemonStats DaemonCore::stats() const {
  DaemonStats d;
  d.backend = std::string(io_->name());
  d.backend_detail = io_->describe() + "; reads: " + read_choice_;
  if (!fallback_reason_.empty()) d.backend_detail += " [" + fallback_reason_ + "]";
  d.uptime_ms = (monotonic_ns() - start_ns_) / 1'000'000;
  d.reactor_loops = reactor_loops();
  d.policy = config_.policy;
  d.sessions_closed_hostile = sessions_closed_hostile_;
  for (const auto& m : models_) {
    const Scheduler& sched = m->store->scheduler();
    d.queue_depth = sched.options().queue_depth;
    d.chunk_bytes = sched.options().chunk_bytes;
    d.prefetch_depth_auto = sched.prefetch_depth_auto();
    d.prefetch_depth =
        d.prefetch_depth_auto ? kPrefetchAutoMaxDepth : sched.options().prefetch_depth;
    d.bytes_read += sched.stats().bytes_read;
    ModelStats ms;
    ms.name = m->name;
    ms.scheduler = sched.stats();
    ms.prefetch_depths.assign(sched.depths().begin(), sched.depths().end());
    ms.prefetch_depth_now = sched.prefetch_depth_now();
    ms.disk_busy = sched.disk_busy();
    ms.prefetch_auto_need = sched.prefetch_auto_need();
    for (uint32_t b = 0; b < kPrefetchDepthBuckets; ++b) {
      ms.hint_precision.push_back(sched.precision_estimate(b));
    }
    ms.cache_slots = m->store->cache().slot_count();
    ms.cache_limit = m->store->cache().limit();
    ms.cache_ready = m->store->cache().ready_count();
    ms.staging_slots = m->store->staging().slot_count();
    ms.slot_bytes = m->store->layouts().slot_bytes();
    ms.layer_hits = m->layer_hits;
    ms.layer_misses = m->layer_misses;
    ms.reads_in_flight = sched.reads_in_flight();
    ms.read_depth_ns = sched.read_depth_ns(monotonic_ns());
    ms.reserved_slots = sched.reserved();
    ms.shard_loads_failed.assign(sched.shard_loads_failed().begin(),
                                 sched.shard_loads_failed().end());
    ms.shard_read_retries.assign(sched.shard_read_retries().begin(),
                                 sched.shard_read_retries().end());
    ms.file_changed = m->file_changed;
    d.models.push_back(std::move(ms));
  }
  for (const auto& s : sessions_) {
    if (!s) continue;
    const PrefetchDepths& depths = models_[s->model]->store->scheduler().session_depths(s->id);
    d.sessions.push_back(
        SessionStats{s->id, models_[s->model]->name, s->who.name, s->who.pid, s->who.uid,
                     s->acquires, s->prefetches, s->releases, s->hold_count,
                     std::vector<PrefetchDepthStats>(depths.begin(), depths.end())});
  }
  return d;
}

Status DaemonCore::set_prefetch_depth(uint32_t depth) {
  if (depth > kMaxPrefetchDepth && depth != kPrefetchDepthAuto) {
    return make_error(
        EINVAL, fmt::format("prefetch depth {}: must be 0..{} or auto", depth, kMaxPrefetchDepth));
  }
  for (auto& m : models_) m->store->scheduler().set_prefetch_depth(depth);
  config_.prefetch_depth = depth;
  spdlog::info("tuning: prefetch depth {}", prefetch_depth_name(depth));
  return Ok{};
}

Status DaemonCore::set_queue_depth(uint32_t depth) {
  if (depth == 0 || depth > io_->queue_depth()) {
    return make_error(EINVAL,
                      fmt::format("queue depth {}: must be 1..{}", depth, io_->queue_depth()));
  }
  for (auto& m : models_) m->store->scheduler().set_queue_depth(depth);
  config_.queue_depth = depth;
  spdlog::info("tuning: queue depth {}", depth);
  return Ok{};
}

Status DaemonCore::set_policy(const std::string& policy) {
  for (auto& m : models_) EXPERTD_TRY(m->store->set_policy(policy));
  config_.policy = policy;
  spdlog::info("tuning: cache policy {}", policy);
  return Ok{};
}

Status DaemonCore::pin(const std::string& model, uint32_t layer, uint32_t expert, bool pinned) {
  for (auto& m : models_) {
    if (m->name != model) continue;
    const int32_t slot = m->store->cache().lookup({layer, expert});
    const bool newly =
        pinned && slot >= 0 && !m->store->cache().pinned(static_cast<uint32_t>(slot));
    const Scheduler& sched = m->store->scheduler();
    if (newly && sched.capacity() <= sched.reserved()) {
      // A pinned slot serves no reservation (docs/CACHE.md "Reservations").
      return make_error(EBUSY,
                        fmt::format("model '{}': cannot pin layer {} expert {}: the "
                                    "attached sessions reserve {} of the {} unpinned slots",
                                    model, layer, expert, sched.reserved(), sched.capacity()));
    }
    if (!m->store->cache().set_pinned({layer, expert}, pinned)) {
      return make_error(ENOENT, fmt::format("model '{}' layer {} expert {} is not in the cache "
                                            "(acquire it first)",
                                            model, layer, expert));
    }
    return Ok{};
  }
  return make_error(ENOENT, fmt::format("model '{}' is not served by this daemon", model));
}

Status DaemonCore::evict(const std::string& model, uint32_t layer, uint32_t expert) {
  for (auto& m : models_) {
    if (m->name != model) continue;
    if (!m->store->cache().evict({layer, expert})) {
      return make_error(EBUSY, fmt::format("model '{}' layer {} expert {}: not cached, or held, "
                                           "pinned or loading",
                                           model, layer, expert));
    }
    return Ok{};
  }
  return make_error(ENOENT, fmt::format("model '{}' is not served by this daemon", model));
}

Status DaemonCore::set_cache_limit(const std::string& model, uint32_t slots) {
  for (auto& m : models_) {
    if (m->name != model) continue;
    ExpertCache& cache = m->store->cache();
    if (slots > cache.slot_count()) {
      return make_error(EINVAL, fmt::format("model '{}': cache limit {} slots: the cache has {} "
                                            "slots of {} KiB (0 = all of them)",
                                            model, slots, cache.slot_count(),
                                            m->store->layouts().slot_bytes() / 1024));
    }
    // The sessions' reservations must still fit (docs/CACHE.md "Reservations").
    const Scheduler& sched = m->store->scheduler();
    const uint32_t limit = slots == 0 ? cache.slot_count() : slots;
    const uint64_t room = uint64_t{limit} + m->store->staging().slot_count();
    if (room < uint64_t{sched.reserved()} + cache.pinned_count()) {
      return make_error(EBUSY, fmt::format("model '{}': cache limit {} slots: the attached "
                                           "sessions reserve {} slots (their top-k each) and {} "
                                           "are pinned, and {} + {} staging slots cannot hold them",
                                           model, limit, sched.reserved(), cache.pinned_count(),
                                           limit, m->store->staging().slot_count()));
    }
    const uint32_t evicted = cache.set_limit(slots);
    spdlog::info("tuning: model '{}' cache limit {} of {} slots ({} evicted)", model, cache.limit(),
                 cache.slot_count(), evicted);
    return Ok{};
  }
  return make_error(ENOENT, fmt::format("model '{}' is not served by this daemon", model));
}

Result<uint32_t> DaemonCore::evict_all(const std::string& model) {
  for (auto& m : models_) {
    if (m->name != model) continue;
    const uint32_t n = m->store->evict_all();
    // The hint precision estimates are history too: a new predictor starts from the prior.
    m->store->scheduler().reset_estimates();
    spdlog::info(
        "model '{}': evicted {} experts (all but held and pinned); policy history and hint "
        "precision estimates reset",
        model, n);
    return n;
  }
  return make_error(ENOENT, fmt::format("model '{}' is not served by this daemon", model));
}

// ---------------------------------------------------------------------------------------------
// Disk faults and files changed under the daemon (reactor thread; error paths only)

void DaemonCore::check_files(uint32_t model) {
  Model& m = *models_[model];
  if (!m.file_changed.empty()) return;
  for (const ShardFile& f : model_files_[model]) {
    struct statx sx {};
    std::string what;
    if (::statx(AT_FDCWD, f.path.c_str(), AT_STATX_SYNC_AS_STAT,
                STATX_INO | STATX_SIZE | STATX_MTIME, &sx) != 0) {
      const int e = errno;
      if (e != ENOENT) continue;  // e.g. EACCES on a directory: not a change of the file
      what = "was removed";
    } else {
      const dev_t dev = makedev(sx.stx_dev_major, sx.stx_dev_minor);
      const int64_t mtime_ns = sx.stx_mtime.tv_sec * 1'000'000'000ll + sx.stx_mtime.tv_nsec;
      if (dev != f.dev || sx.stx_ino != f.ino) {
        what = fmt::format("was replaced (inode {} is now {})", f.ino, sx.stx_ino);
      } else if (sx.stx_size != f.identity.bytes) {
        what = fmt::format("changed size ({} bytes, now {})", f.identity.bytes, sx.stx_size);
      } else if (mtime_ns != f.identity.mtime_ns) {
        what = "was modified in place (its mtime changed)";
      } else {
        continue;
      }
    }
    // Stop serving it: what the cache holds came from the old file, and what the new file holds
    // may be half written. Held experts stay mapped until released, but no acquire is answered
    // from the cache again.
    m.file_changed = fmt::format(
        "model '{}': {} {} since expertd opened it; the model is not served until expertd is "
        "restarted (systemctl restart expertd)",
        m.name, f.path, what);
    spdlog::error("{}", m.file_changed);
    m.store->scheduler().set_unavailable(ESTALE);
    const uint32_t dropped = m.store->evict_all();
    spdlog::info("model '{}': {} cached experts of the old file dropped", m.name, dropped);
    return;
  }
}

void DaemonCore::log_failed_loads() {
  for (uint32_t i = 0; i < models_.size(); ++i) {
    Model& m = *models_[i];
    const Scheduler& sched = m.store->scheduler();
    const uint64_t total = sched.failures();
    if (total == m.failures_logged) continue;  // the steady state: one compare per model
    if (total - m.failures_logged > Scheduler::kFailureRing) {
      load_failure_log_.skip(total - m.failures_logged - Scheduler::kFailureRing);
      m.failures_logged = total - Scheduler::kFailureRing;
    }
    for (; m.failures_logged < total; ++m.failures_logged) {
      if (!load_failure_log_.allow()) continue;
      const LoadFailure& f = sched.failure(m.failures_logged);
      const std::string why = f.error == -ETIME
                                  ? fmt::format(
                                        "not back after read_timeout_ms {} (a stalled device or "
                                        "file system; the read was asked to cancel)",
                                        config_.read_timeout_ms)
                                  : std::string(std::strerror(-f.error));
      spdlog::error(
          "model '{}': load of layer {} expert {} failed: {}: read of {} bytes at offset {}: {} "
          "(after {} retries){}",
          m.name, f.key.layer, f.key.expert, io_->file(f.file).path, f.len, f.offset, why,
          f.retries, load_failure_log_.suppressed_note("failed load", "failed loads"));
    }
    check_files(i);  // a file replaced or cut short shows first as failed reads
  }
}

void DaemonCore::refresh_status() {
  // Verify mode only, and only when a load differed since the last refresh: a log line (which
  // allocates) is worth it then.
  for (auto& m : models_) {
    if (!m->verifier) continue;
    const uint64_t failures = m->verifier->failures();
    if (failures > m->verify_failures_logged) {
      spdlog::error("model '{}': verify: {} of {} loads differ from the forged content; first: {}",
                    m->name, failures, m->verifier->verified(),
                    m->verifier->messages().empty() ? "-" : m->verifier->messages().front());
      m->verify_failures_logged = failures;
    }
  }
  uint64_t acquires = 0;
  uint64_t hits = 0;
  uint64_t ready = 0;
  for (const auto& m : models_) {
    acquires += m->store->scheduler().stats().acquires;
    hits += m->store->scheduler().stats().hits;
    ready += m->store->cache().ready_count();
  }
  uint32_t sessions = 0;
  for (const auto& s : sessions_) sessions += s ? 1 : 0;
  const double rate = acquires ? 100.0 * static_cast<double>(hits) / acquires : 0.0;
  // Formatted into a fixed buffer (truncated if it were ever longer): the reactor allocates
  // nothing here.
  std::array<char, sizeof(status_)> line;
  const auto r = fmt::format_to_n(line.data(), line.size(),
                                  "backend {}, {} experts cached, hit rate {:.1f}%, {} sessions",
                                  io_->name(), ready, rate, sessions);
  const size_t len = std::min(r.size, line.size());
  std::lock_guard<std::mutex> lock(status_mu_);
  std::memcpy(status_.data(), line.data(), len);
  status_len_ = len;
}

std::string DaemonCore::status_line() const {
  std::lock_guard<std::mutex> lock(status_mu_);
  return std::string(status_.data(), status_len_);
}

}  // namespace expertd
