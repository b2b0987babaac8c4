#include "cache/checksums.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>
// The state's definition, so that it can live on the stack (the load path allocates nothing).
#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "base/fd.h"

namespace expertd {

namespace {

constexpr uint32_t kMagic = 0x4b435845;  // "EXCK"
constexpr uint32_t kVersion = 1;

// The header, then one ShardIdentity per shard, then the table.
struct Header {
  uint32_t magic = kMagic;
  uint32_t version = kVersion;
  uint32_t block_count = 0;
  uint32_t expert_count = 0;
  uint32_t shard_count = 0;
  uint32_t reserved = 0;
};

struct ShardIdentity {
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  uint64_t ino = 0;
  bool operator==(const ShardIdentity&) const = default;
};

Result<ShardIdentity> identity_of(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int e = errno;
    return make_error(e, fmt::format("{}: stat: {}", path, std::strerror(e)));
  }
  return ShardIdentity{static_cast<uint64_t>(st.st_size),
                       st.st_mtim.tv_sec * 1'000'000'000ll + st.st_mtim.tv_nsec,
                       static_cast<uint64_t>(st.st_ino)};
}

// Reads exactly [offset, offset + bytes) of `fd` into the hash state, in pieces of `buf`.
Status hash_range(int fd, const std::string& path, uint64_t offset, uint64_t bytes,
                  std::vector<uint8_t>& buf, XXH3_state_t* state) {
  while (bytes > 0) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(bytes, buf.size()));
    const ssize_t n = ::pread(fd, buf.data(), want, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int e = n < 0 ? errno : EIO;
      return make_error(e, fmt::format("{}: read of {} bytes at offset {}: {}", path, want, offset,
                                       n < 0 ? std::strerror(e) : "end of file"));
    }
    XXH3_64bits_update(state, buf.data(), static_cast<size_t>(n));
    offset += static_cast<uint64_t>(n);
    bytes -= static_cast<uint64_t>(n);
  }
  return Ok{};
}

}  // namespace

uint64_t expert_checksum(const uint8_t* slot, std::span<const ExpertSlice> slices,
                         std::span<const SlicePlacement> place) {
  XXH3_state_t state;  // on the stack: the load path allocates nothing
  XXH3_64bits_reset(&state);
  for (size_t i = 0; i < slices.size(); ++i) {
    XXH3_64bits_update(&state, slot + place[i].data_slot_offset, slices[i].bytes);
  }
  return XXH3_64bits_digest(&state);
}

Result<ChecksumManifest> ChecksumManifest::load_or_build(const std::string& dir,
                                                         const std::string& name,
                                                         const GgufModel& model,
                                                         const SliceMap& map, bool* built,
                                                         std::string* write_error) {
  ChecksumManifest m;
  std::string file_name = name;
  for (char& c : file_name) {
    if (c == '/') c = '_';
  }
  m.path_ = dir + "/" + file_name + ".xxh3";
  const size_t entries = static_cast<size_t>(map.block_count()) * map.expert_count();
  Header want;
  want.block_count = map.block_count();
  want.expert_count = map.expert_count();
  want.shard_count = static_cast<uint32_t>(model.shards().size());
  std::vector<ShardIdentity> ids;
  for (const auto& s : model.shards()) {
    ShardIdentity id;
    EXPERTD_TRY_ASSIGN(id, identity_of(s.path()));
    ids.push_back(id);
  }

  // A manifest of these very files: load it.
  if (UniqueFd fd(::open(m.path_.c_str(), O_RDONLY | O_CLOEXEC)); fd.valid()) {
    Header h;
    std::vector<ShardIdentity> had(ids.size());
    m.table_.assign(entries, 0);
    const size_t id_bytes = had.size() * sizeof(ShardIdentity);
    const size_t table_bytes = entries * sizeof(uint64_t);
    if (::pread(fd.get(), &h, sizeof(h), 0) == static_cast<ssize_t>(sizeof(h)) &&
        std::memcmp(&h, &want, sizeof(h)) == 0 &&
        ::pread(fd.get(), had.data(), id_bytes, sizeof(h)) == static_cast<ssize_t>(id_bytes) &&
        had == ids &&
        ::pread(fd.get(), m.table_.data(), table_bytes, static_cast<off_t>(sizeof(h) + id_bytes)) ==
            static_cast<ssize_t>(table_bytes)) {
      *built = false;
      return m;
    }
  }

  // Build it: every expert, read and hashed as the scheduler will hash it in its slot.
  m.table_.assign(entries, 0);
  std::vector<UniqueFd> fds;
  for (const auto& s : model.shards()) {
    fds.emplace_back(::open(s.path().c_str(), O_RDONLY | O_CLOEXEC));
    if (!fds.back().valid()) {
      const int e = errno;
      return make_error(e, fmt::format("{}: open: {}", s.path(), std::strerror(e)));
    }
  }
  std::vector<uint8_t> buf(4u << 20);
  XXH3_state_t state;
  std::array<ExpertSlice, 3> sl{};
  for (const auto& layer : map.layers()) {
    for (uint32_t e = 0; e < map.expert_count(); ++e) {
      const uint32_t n = map.slices(layer.layer, e, sl);
      XXH3_64bits_reset(&state);
      for (uint32_t i = 0; i < n; ++i) {
        EXPERTD_TRY(hash_range(fds[sl[i].shard].get(), model.shards()[sl[i].shard].path(),
                               sl[i].offset, sl[i].bytes, buf, &state));
      }
      m.table_[static_cast<size_t>(layer.layer) * map.expert_count() + e] =
          XXH3_64bits_digest(&state);
    }
  }
  *built = true;

  // Written whole to a temporary file, then renamed: a crash leaves the old manifest or none,
  // never half of one.
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  const std::string tmp = m.path_ + ".tmp";
  UniqueFd out(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0640));
  std::string body(reinterpret_cast<const char*>(&want), sizeof(want));
  body.append(reinterpret_cast<const char*>(ids.data()), ids.size() * sizeof(ShardIdentity));
  body.append(reinterpret_cast<const char*>(m.table_.data()), entries * sizeof(uint64_t));
  if (!out.valid() ||
      ::write(out.get(), body.data(), body.size()) != static_cast<ssize_t>(body.size()) ||
      ::fsync(out.get()) != 0 || ::rename(tmp.c_str(), m.path_.c_str()) != 0) {
    const int e = errno;
    *write_error = fmt::format("{}: cannot write the checksum manifest: {}", m.path_,
                               std::strerror(e != 0 ? e : EIO));
    ::unlink(tmp.c_str());
  }
  return m;
}

}  // namespace expertd
