#include "storage/file_probe.h"

// No <sys/stat.h> here: glibc 2.36's struct statx lacks the stx_dio_* fields, and its definition
// would clash with <linux/stat.h>'s, which has them. statx is called through syscall(2).
#include <fcntl.h>
#include <fmt/format.h>
#include <linux/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

namespace expertd {

namespace {

bool is_power_of_two(uint64_t v) { return v != 0 && (v & (v - 1)) == 0; }

// statx on an open fd; returns -errno.
int statx_fd(int fd, unsigned mask, struct statx* out) {
  std::memset(out, 0, sizeof(*out));
  long rc = ::syscall(SYS_statx, fd, "", AT_EMPTY_PATH, mask, out);
  return rc == 0 ? 0 : -errno;
}

// Reads a small decimal number from a sysfs file; 0 when missing or malformed.
uint64_t read_sysfs_number(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "re");
  if (f == nullptr) return 0;
  unsigned long long value = 0;
  int matched = std::fscanf(f, "%llu", &value);
  std::fclose(f);
  return matched == 1 ? value : 0;
}

// The logical block size of the block device MAJ:MIN (a partition reads its parent's queue/).
uint32_t logical_block_size(uint32_t major, uint32_t minor) {
  const std::string dev = fmt::format("/sys/dev/block/{}:{}", major, minor);
  uint64_t size = read_sysfs_number(dev + "/queue/logical_block_size");
  if (size == 0) size = read_sysfs_number(dev + "/../queue/logical_block_size");
  return is_power_of_two(size) && size <= (1u << 16) ? static_cast<uint32_t>(size) : 0;
}

}  // namespace

DioAlignment probe_dio_alignment(int fd) {
  struct statx st;
  if (statx_fd(fd, STATX_DIOALIGN, &st) == 0) {
    // stx_dio_offset_align == 0 means the file supports no direct I/O: fall through.
    const uint32_t align = std::max(st.stx_dio_offset_align, st.stx_dio_mem_align);
    if ((st.stx_mask & STATX_DIOALIGN) != 0 && st.stx_dio_offset_align != 0 &&
        is_power_of_two(align)) {
      return {align, "statx"};
    }
    const uint32_t lbs = logical_block_size(st.stx_dev_major, st.stx_dev_minor);
    if (lbs != 0) return {lbs, "logical block size"};
  }
  return {};
}

namespace {
Error open_error(const std::string& path, const char* what, int err) {
  return make_error(err, fmt::format("{}: {}: {}", path, what, std::strerror(err)));
}
}  // namespace

Result<OpenedFile> open_data_file(const std::string& path) {
  OpenedFile file;
  file.buffered = UniqueFd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!file.buffered.valid()) return open_error(path, "open", errno);
  file.direct = UniqueFd(::open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC));
  if (!file.direct.valid()) {
    const int err = errno;
    // EINVAL: the file system has no O_DIRECT (tmpfs before 6.6, some FUSE). Keep serving.
    if (err != EINVAL) return open_error(path, "open O_DIRECT", err);
    file.direct = UniqueFd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!file.direct.valid()) return open_error(path, "open", errno);
    file.info.direct_io = false;
  }
  struct statx st;
  if (int rc = statx_fd(file.buffered.get(), STATX_SIZE | STATX_TYPE, &st); rc < 0) {
    return make_error(-rc, fmt::format("{}: statx: {}", path, std::strerror(-rc)));
  }
  if ((st.stx_mode & S_IFMT) != S_IFREG) {
    return make_error(EINVAL, fmt::format("{}: not a regular file", path));
  }
  const DioAlignment align = probe_dio_alignment(file.direct.get());
  file.info.path = path;
  file.info.size_bytes = st.stx_size;
  file.info.dio_alignment = align.bytes;
  file.info.alignment_source = align.source;
  return file;
}

}  // namespace expertd
