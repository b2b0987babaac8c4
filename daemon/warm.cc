#include "daemon/warm.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string_view>
#include <vector>

#include "cache/store.h"
#include "client/include/expertd/protocol.h"

namespace expertd {

namespace {

constexpr uint32_t kManifestMagic = 0x4d575845;  // "EXWM"
// Bump on any change of the manifest, or of what a slot's bytes mean that the layout digest does
// not cover.
constexpr uint32_t kWarmVersion = 1;
constexpr uint32_t kMaxShards = 64;
constexpr size_t kMaxModelName = 255;
constexpr int kAllSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL;
// Manifest::arena_fill: how the arena's pages were written.
// Plain: written through the daemon's own mapping (pread, io_uring without registered buffers) or
// by a daemon whose arena pages are all dirty; the pages stay in the memfd.
constexpr uint32_t kFillPlain = 0;
// An io_uring daemon older than the fix of docs/RELIABILITY.md "Warm restart": pages written only
// by READ_FIXED were clean, and page-cache invalidation after that daemon's exit could drop them
// (the successor read zeros). Trusted only with the checksum manifest.
constexpr uint32_t kFillUringCleanPages = 1;
// io_uring into an arena populated with write faults (SharedRegion::create): every page dirty.
constexpr uint32_t kFillUringDirtyPages = 2;

struct ShardRecord {
  uint64_t dev;
  uint64_t ino;
  uint64_t bytes;
  int64_t mtime_ns;
  int64_t ctime_ns;
};

// Plain data, written once by its daemon, read by the next; every field is compared, never used
// as a size or an index before it is.
struct Manifest {
  uint32_t magic;
  uint32_t version;
  uint32_t abi_version;  // the slot table's format
  uint32_t shard_count;
  char model[kMaxModelName + 1];  // NUL-terminated
  uint64_t slot_bytes;
  uint64_t layout_digest;
  uint32_t layers;
  uint32_t experts;
  // Of the daemon that wrote it: a successor's may differ (another cache size).
  uint32_t slot_count;
  uint32_t arena_fill;  // kFill*: how the arena's pages were written (see restore_model)
  uint64_t arena_bytes;
  ShardRecord shards[kMaxShards];
};

uint64_t fnv(uint64_t h, uint64_t v) {
  for (int i = 0; i < 8; ++i) {
    h ^= (v >> (8 * i)) & 0xff;
    h *= 0x100000001b3ull;
  }
  return h;
}

// Where every expert's slices come from and land: equal digests mean a slot's bytes mean the same.
uint64_t layout_digest(const ExpertStore& store) {
  uint64_t h = 0xcbf29ce484222325ull;
  h = fnv(h, store.layouts().slot_bytes());
  h = fnv(h, store.layouts().alignment());
  std::array<ExpertSlice, 3> slices{};
  std::array<SlicePlacement, 3> place{};
  for (const MoeLayer& l : store.slice_map().layers()) {
    for (uint32_t e = 0; e < store.slice_map().expert_count(); ++e) {
      const uint32_t n = store.layouts().place(l.layer, e, slices, place);
      h = fnv(fnv(h, l.layer), n);
      for (uint32_t i = 0; i < n; ++i) {
        h = fnv(h, slices[i].shard);
        h = fnv(h, static_cast<uint64_t>(slices[i].kind));
        h = fnv(h, static_cast<uint64_t>(slices[i].type));
        h = fnv(h, slices[i].offset);
        h = fnv(h, slices[i].bytes);
        h = fnv(h, place[i].read_slot_offset);
        h = fnv(h, place[i].data_slot_offset);
        h = fnv(h, place[i].read_bytes);
      }
    }
  }
  return h;
}

// This daemon's manifest of model `i`; nullopt (and why) when it does not fit one.
std::optional<Manifest> describe(DaemonCore& core, uint32_t i, std::string* why) {
  const std::string& name = core.model_names()[i];
  const auto ids = core.shard_identities(i);
  if (name.size() > kMaxModelName || ids.size() > kMaxShards) {
    *why = fmt::format("the name is {} bytes and it has {} shards (at most {} and {})", name.size(),
                       ids.size(), kMaxModelName, kMaxShards);
    return std::nullopt;
  }
  const ExpertStore& store = core.store(i);
  Manifest m{};
  m.magic = kManifestMagic;
  m.version = kWarmVersion;
  m.abi_version = abi::kProtocolVersion;
  m.shard_count = static_cast<uint32_t>(ids.size());
  std::memcpy(m.model, name.data(), name.size());
  m.slot_bytes = store.layouts().slot_bytes();
  m.layout_digest = layout_digest(store);
  m.layers = store.slice_map().block_count();
  m.experts = store.slice_map().expert_count();
  m.slot_count = store.slot_count();
  m.arena_fill = core.backend_name() == "io_uring" ? kFillUringDirtyPages : kFillPlain;
  m.arena_bytes = store.arena().size();
  for (size_t s = 0; s < ids.size(); ++s) {
    m.shards[s] =
        ShardRecord{ids[s].dev, ids[s].ino, ids[s].bytes, ids[s].mtime_ns, ids[s].ctime_ns};
  }
  return m;
}

// Why `old` does not describe what `now` does, or empty when it does.
std::string mismatch(const Manifest& old, const Manifest& now) {
  if (old.version != now.version || old.abi_version != now.abi_version) {
    return fmt::format(
        "it was written by another version (manifest {}, slot table {}; this "
        "daemon's are {} and {})",
        old.version, old.abi_version, now.version, now.abi_version);
  }
  if (old.shard_count != now.shard_count) {
    return fmt::format("it had {} shard files, now {}", old.shard_count, now.shard_count);
  }
  for (uint32_t s = 0; s < now.shard_count; ++s) {
    const ShardRecord& a = old.shards[s];
    const ShardRecord& b = now.shards[s];
    if (a.dev != b.dev || a.ino != b.ino) {
      return fmt::format("shard {} is another file now (inode {} became {})", s, a.ino, b.ino);
    }
    if (a.bytes != b.bytes || a.mtime_ns != b.mtime_ns || a.ctime_ns != b.ctime_ns) {
      return fmt::format(
          "shard {} changed since its experts were cached (size {} -> {}, "
          "mtime or ctime differ)",
          s, a.bytes, b.bytes);
    }
  }
  if (old.slot_bytes != now.slot_bytes || old.layout_digest != now.layout_digest ||
      old.layers != now.layers || old.experts != now.experts) {
    return fmt::format("the slot layout differs (slot {} -> {} bytes, digest {:016x} -> {:016x})",
                       old.slot_bytes, now.slot_bytes, old.layout_digest, now.layout_digest);
  }
  return {};
}

// Ok when the fd is a fully sealed memfd of at least `min_bytes`; else why not.
Status check_sealed(const UniqueFd& fd, const char* what, uint64_t min_bytes) {
  const int seals = ::fcntl(fd.get(), F_GET_SEALS);
  if (seals < 0 || (seals & kAllSeals) != kAllSeals) {
    return make_error(EINVAL, fmt::format("the {} is not a sealed memfd (seals {:#x})", what,
                                          seals < 0 ? 0 : seals));
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0 || static_cast<uint64_t>(st.st_size) < min_bytes) {
    return make_error(EINVAL, fmt::format("the {} is {} bytes, less than the {} it needs", what,
                                          static_cast<uint64_t>(st.st_size), min_bytes));
  }
  return Ok{};
}

struct Group {
  UniqueFd manifest, arena, slots;
};

// Whether a byte of `key`'s slices in the old arena's slot at `slot_offset` lies in a hole of the
// arena's memfd: a page the kernel dropped reads back as zeros, never as the expert's bytes
// (docs/RELIABILITY.md, "Warm restart": how io_uring's fixed reads once left such pages). tmpfs
// answers SEEK_HOLE from its page cache: a page swapped out counts as data. An lseek that fails
// counts as a hole (the expert is read again rather than trusted).
bool bytes_missing(int arena_fd, const ExpertStore& store, ExpertKey key, uint64_t slot_offset) {
  std::array<ExpertSlice, 3> slices{};
  std::array<SlicePlacement, 3> place{};
  const uint32_t n = store.layouts().place(key.layer, key.expert, slices, place);
  for (uint32_t s = 0; s < n; ++s) {
    const uint64_t begin = slot_offset + place[s].data_slot_offset;
    const off_t hole = ::lseek(arena_fd, static_cast<off_t>(begin), SEEK_HOLE);
    if (hole < 0 || static_cast<uint64_t>(hole) < begin + slices[s].bytes) return true;
  }
  return false;
}

// Copies one model's READY slots; the error says why it starts cold.
Result<uint64_t> restore_model(DaemonCore& core, Group& g, std::string* model) {
  if (!g.manifest.valid() || !g.arena.valid() || !g.slots.valid()) {
    return make_error(EINVAL, "the manifest, the arena or the slot table is missing");
  }
  EXPERTD_TRY(check_sealed(g.manifest, "manifest", sizeof(Manifest)));
  Manifest old{};
  {
    const Mapping m = Mapping::map(sizeof(Manifest), PROT_READ, MAP_SHARED, g.manifest.get(), 0);
    if (!m.valid()) return make_error(errno, "cannot map the manifest");
    std::memcpy(&old, m.data(), sizeof(old));  // one snapshot: every check reads this copy
  }
  if (old.magic != kManifestMagic) return make_error(EINVAL, "the manifest's magic is wrong");
  old.model[kMaxModelName] = '\0';
  *model = old.model;
  uint32_t index = 0;
  const auto& names = core.model_names();
  while (index < names.size() && names[index] != *model) ++index;
  if (index == names.size()) return make_error(ENOENT, "this daemon does not serve it");
  std::string why;
  const auto now = describe(core, index, &why);
  if (!now) return make_error(EINVAL, why);
  why = mismatch(old, *now);
  if (!why.empty()) return make_error(ESTALE, why);

  // A daemon before the fix of docs/RELIABILITY.md "Warm restart" (its io_uring arena's pages
  // could be dropped after it exited, reading back as zeros): its arena is taken over only when
  // every expert is checked against the checksum manifest as it is copied in (adopt()).
  if (old.arena_fill == kFillUringCleanPages && !core.store(index).scheduler().has_checksums()) {
    return make_error(EINVAL,
                      "an io_uring daemon of an earlier version filled it, whose pages may have "
                      "been dropped since; without checksums (--checksums) it is not trusted "
                      "(docs/SYSTEMD.md, Warm restart)");
  }
  // Sizes come from the manifest, checked against the memfds (sealed: they cannot shrink under
  // the copy) and against each other before anything is mapped.
  if (old.slot_count == 0 || old.arena_bytes / old.slot_bytes < old.slot_count) {
    return make_error(EINVAL, fmt::format("the manifest's {} slots of {} bytes do not fit its "
                                          "arena of {} bytes",
                                          old.slot_count, old.slot_bytes, old.arena_bytes));
  }
  EXPERTD_TRY(check_sealed(g.arena, "arena", old.arena_bytes));
  const uint64_t table_bytes = abi::slot_table_bytes(old.slot_count);
  EXPERTD_TRY(check_sealed(g.slots, "slot table", table_bytes));
  const Mapping table = Mapping::map(table_bytes, PROT_READ, MAP_SHARED, g.slots.get(), 0);
  if (!table.valid()) return make_error(errno, "cannot map the slot table");
  abi::SlotTableHeader header{};
  std::memcpy(&header, table.data(), sizeof(header));
  if (header.magic != abi::kSlotTableMagic || header.version != abi::kProtocolVersion ||
      header.slot_count != old.slot_count || header.slot_bytes != old.slot_bytes ||
      header.arena_bytes != old.arena_bytes) {
    return make_error(EINVAL, "the slot table's header does not match the manifest");
  }
  const auto* entries = reinterpret_cast<const abi::SlotEntry*>(table.data() + sizeof(header));
  ExpertStore& store = core.store(index);
  // The slots to copy, decided before the arena is mapped: a fault on a hole fills it (with zeros).
  std::vector<uint8_t> take(old.slot_count, 0);
  uint64_t missing_count = 0;
  for (uint32_t i = 0; i < old.slot_count; ++i) {
    // LOADING or FREE slots hold no whole expert (a crash mid-read leaves LOADING).
    if (entries[i].state.load(std::memory_order_acquire) != abi::kSlotReady) continue;
    const ExpertKey key{entries[i].layer, entries[i].expert};
    const bool valid = store.slice_map().find_layer(key.layer) != nullptr &&
                       key.expert < store.slice_map().expert_count();
    if (valid && bytes_missing(g.arena.get(), store, key, uint64_t{i} * old.slot_bytes)) {
      ++missing_count;
      continue;
    }
    take[i] = 1;  // adopt() checks the key
  }
  // Populated in one call: a page fault per 4 KiB page made the copy several times slower.
  const Mapping arena =
      Mapping::map(old.arena_bytes, PROT_READ, MAP_SHARED | MAP_POPULATE, g.arena.get(), 0);
  if (!arena.valid()) return make_error(errno, "cannot map the arena");
  uint64_t copied = 0;
  for (uint32_t i = 0; i < old.slot_count; ++i) {
    if (take[i] == 0) continue;
    const ExpertKey key{entries[i].layer, entries[i].expert};
    if (store.adopt(key, arena.data() + static_cast<uint64_t>(i) * old.slot_bytes)) ++copied;
  }
  if (missing_count > 0) {
    spdlog::warn(
        "warm restart: model '{}': {} experts handed over had pages missing from the arena "
        "(holes: dropped by the kernel) and were not taken over (docs/RELIABILITY.md, Warm "
        "restart)",
        *model, missing_count);
  }
  const uint64_t mismatches = store.scheduler().stats().checksum_mismatches;
  if (mismatches > 0) {
    spdlog::warn(
        "warm restart: model '{}': {} experts handed over failed their checksum and were "
        "dropped (docs/RELIABILITY.md, Warm restart)",
        *model, mismatches);
  }
  return copied;
}

}  // namespace

PassedFds take_passed_fds(const std::string& socket_path) {
  PassedFds out;
  char** names = nullptr;
  const int n = sd_listen_fds_with_names(1, &names);
  for (int i = 0; i < n; ++i) {
    const int fd = SD_LISTEN_FDS_START + i;
    ::fcntl(fd, F_SETFD, FD_CLOEXEC);
    UniqueFd owned(fd);
    const std::string name = names != nullptr && names[i] != nullptr ? names[i] : "";
    if (!out.listen.valid() && sd_is_socket_unix(fd, SOCK_STREAM, 1, socket_path.c_str(), 0) > 0) {
      out.listen = std::move(owned);
    } else if (name.rfind("warm.", 0) == 0) {
      out.warm.push_back(NamedFd{name, std::move(owned)});
    } else {
      out.ignored.push_back(name);
    }
  }
  if (names != nullptr) {
    for (int i = 0; i < n; ++i) std::free(names[i]);
    std::free(names);
  }
  return out;
}

WarmRestore restore_warm(DaemonCore& core, std::vector<NamedFd> passed) {
  WarmRestore r;
  if (passed.empty()) return r;
  // "warm.<i>.<role>": group by i; an index beyond the fds passed is nonsense and is dropped.
  std::vector<Group> groups(passed.size());
  for (NamedFd& f : passed) {
    const std::string_view rest = std::string_view(f.name).substr(5);
    const size_t dot = rest.find('.');
    uint32_t i = 0;
    bool ok = dot != std::string_view::npos && dot > 0 && dot < 4;
    for (size_t k = 0; ok && k < dot; ++k) {
      ok = rest[k] >= '0' && rest[k] <= '9';
      i = i * 10 + static_cast<uint32_t>(rest[k] - '0');
    }
    if (!ok || i >= groups.size()) {
      spdlog::warn("warm restart: ignoring the passed fd '{:.64}' (not warm.<n>.<role>)", f.name);
      continue;
    }
    const std::string_view role = rest.substr(dot + 1);
    UniqueFd* slot = role == "manifest" ? &groups[i].manifest
                     : role == "arena"  ? &groups[i].arena
                     : role == "slots"  ? &groups[i].slots
                                        : nullptr;
    if (slot == nullptr || slot->valid()) {
      spdlog::warn("warm restart: ignoring the passed fd '{:.64}' (unknown or repeated)", f.name);
      continue;
    }
    *slot = std::move(f.fd);
  }
  const uint64_t start = monotonic_ns();
  for (uint32_t i = 0; i < groups.size(); ++i) {
    Group& g = groups[i];
    if (!g.manifest.valid() && !g.arena.valid() && !g.slots.valid()) continue;
    std::string model = fmt::format("warm.{}", i);
    const auto copied = restore_model(core, g, &model);
    if (!copied) {
      spdlog::warn("warm restart: model '{:.64}': {}; it starts cold", model,
                   copied.error().message);
      continue;
    }
    ++r.models;
    r.experts += *copied;
    uint32_t index = 0;
    while (core.model_names()[index] != model) ++index;
    r.bytes += *copied * core.store(index).layouts().slot_bytes();
    spdlog::info("warm restart: model '{}': {} cached experts taken over", model, *copied);
  }
  const uint64_t ms = (monotonic_ns() - start) / 1'000'000;
  spdlog::info("warm restart: {} model(s), {} experts, {} MiB copied in {} ms", r.models, r.experts,
               r.bytes >> 20, ms);
  return r;
}

WarmExport WarmExport::create(DaemonCore& core) {
  WarmExport out;
  for (uint32_t i = 0; i < core.model_names().size(); ++i) {
    std::string why;
    const auto m = describe(core, i, &why);
    if (!m) {
      spdlog::warn("warm restart: model '{:.64}' cannot be handed on: {}", core.model_names()[i],
                   why);
      continue;
    }
    auto region =
        SharedRegion::create("expertd-warm-" + core.model_names()[i], sizeof(Manifest), false);
    if (!region) {
      spdlog::warn("warm restart: model '{}': {}", core.model_names()[i], region.error().message);
      continue;
    }
    std::memcpy(region->data(), &*m, sizeof(Manifest));
    const ExpertStore& store = core.store(i);
    out.models_.push_back(
        Model{i, std::move(*region), store.arena().fd(), store.slot_table().fd()});
  }
  return out;
}

std::vector<NamedFd> WarmExport::fds() const {
  std::vector<NamedFd> out;
  for (const Model& m : models_) {
    const std::pair<const char*, int> parts[] = {
        {"manifest", m.manifest.fd()}, {"arena", m.arena_fd}, {"slots", m.slots_fd}};
    for (const auto& [role, fd] : parts) {
      out.push_back(NamedFd{fmt::format("warm.{}.{}", m.index, role),
                            UniqueFd(::fcntl(fd, F_DUPFD_CLOEXEC, 3))});
    }
  }
  return out;
}

}  // namespace expertd
