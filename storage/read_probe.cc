#include "storage/read_probe.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <liburing.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>

#include "base/check.h"
#include "base/clock.h"
#include "base/fd.h"
#include "storage/owned_ring.h"

namespace expertd {
namespace {

constexpr uint64_t kPageBytes = 4096;
constexpr uint32_t kMaxQueueDepth = 4096;
// One read's length must fit the CQE's int32 result; keep well inside it.
constexpr uint64_t kMaxReadBytes = uint64_t{1} << 30;

uint64_t align_down(uint64_t v, uint64_t a) { return v / a * a; }
uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// Anonymous, page-aligned, pre-faulted memory.
Result<Mapping> map_buffer(uint64_t bytes) {
  const uint64_t size = align_up(std::max<uint64_t>(bytes, 1), kPageBytes);
  Mapping m =
      Mapping::map(size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (!m.valid()) {
    const int err = errno;
    return make_error(err, fmt::format("read probe: mmap of a {} MiB buffer: {}", size >> 20,
                                       std::strerror(err)));
  }
  return m;
}

// The budget as a deadline and a byte limit.
class BudgetClock {
 public:
  explicit BudgetClock(const ProbeBudget& b)
      : start_ns_(monotonic_ns()),
        deadline_ns_(b.seconds > 0.0 ? start_ns_ + static_cast<uint64_t>(b.seconds * 1e9)
                                     : std::numeric_limits<uint64_t>::max()),
        byte_limit_(b.bytes > 0 ? b.bytes : std::numeric_limits<uint64_t>::max()) {}
  // May a new range start after `bytes_started` bytes?
  bool more(uint64_t bytes_started) const {
    return bytes_started < byte_limit_ && monotonic_ns() < deadline_ns_;
  }
  double elapsed_s() const { return static_cast<double>(monotonic_ns() - start_ns_) / 1e9; }

 private:
  uint64_t start_ns_;
  uint64_t deadline_ns_;
  uint64_t byte_limit_;
};

Status check_budget(const ProbeBudget& b) {
  if (!(b.seconds >= 0.0) || (b.seconds == 0.0 && b.bytes == 0)) {
    return make_error(EINVAL, "read probe: the budget needs a time or a byte limit");
  }
  return Ok{};
}

// Widened extent of a range: [start, end) aligned, and `data_end`, the range's last byte + 1.
struct Extent {
  uint64_t start = 0;
  uint64_t end = 0;
  uint64_t data_end = 0;
};
Extent widen(const ProbeRange& r, uint64_t a) {
  return Extent{align_down(r.offset, a), align_up(r.offset + r.bytes, a), r.offset + r.bytes};
}

uint64_t max_widened_bytes(std::span<const ProbeRange> ranges, uint64_t a) {
  uint64_t m = 0;
  for (const ProbeRange& r : ranges) {
    const Extent e = widen(r, a);
    m = std::max(m, e.end - e.start);
  }
  return m;
}

// An io_uring for one measurement. The loops reap every read before they return, except when the
// ring itself fails (io_uring_enter errors): the kernel then ends the reads still in flight on its
// own, into pinned buffers.
int init_ring(OwnedRing& ring, uint32_t entries) {
  io_uring_params p{};
  p.flags = IORING_SETUP_SUBMIT_ALL | IORING_SETUP_COOP_TASKRUN | IORING_SETUP_SINGLE_ISSUER;
  int rc = ring.init(entries, p);
  if (rc == -EINVAL) {  // an older kernel without those flags
    p = io_uring_params{};
    rc = ring.init(entries, p);
  }
  return rc;
}

// Registered buffers are at most 1 GiB each (the kernel's limit): a destination region is
// registered in pieces of this size, and no read crosses a piece.
constexpr uint64_t kPieceBytes = uint64_t{1} << 30;

// Where each range's widened read lands in a caller's destination region: one range after the
// other at aligned positions, never across a piece, wrapping at the end.
class Placer {
 public:
  Placer(uint8_t* base, uint64_t bytes, uint64_t align) : base_(base), bytes_(bytes), a_(align) {}
  // How many ranges of `widest` bytes fit in the region at least (pieces waste their tails).
  uint64_t capacity(uint64_t widest) const {
    uint64_t n = 0;
    for (uint64_t p = 0; p < bytes_; p += kPieceBytes)
      n += std::min(kPieceBytes, bytes_ - p) / widest;
    return n;
  }
  uint8_t* place(uint64_t widened) {
    pos_ = align_up(pos_, a_);
    const uint64_t piece_end = std::min(align_down(pos_, kPieceBytes) + kPieceBytes, bytes_);
    if (pos_ + widened > piece_end) {
      pos_ = piece_end < bytes_ ? piece_end : 0;
      if (pos_ + widened > std::min(pos_ + kPieceBytes, bytes_)) pos_ = 0;
    }
    uint8_t* p = base_ + pos_;
    pos_ += widened;
    return p;
  }
  uint16_t piece_of(const uint8_t* p) const {
    return static_cast<uint16_t>(static_cast<uint64_t>(p - base_) / kPieceBytes);
  }
  std::vector<iovec> pieces() const {
    std::vector<iovec> v;
    for (uint64_t p = 0; p < bytes_; p += kPieceBytes) {
      v.push_back({base_ + p, std::min(kPieceBytes, bytes_ - p)});
    }
    return v;
  }

 private:
  uint8_t* base_;
  uint64_t bytes_;
  uint64_t a_;
  uint64_t pos_ = 0;
};

}  // namespace

std::string describe_chunk(uint64_t chunk_bytes) {
  if (chunk_bytes == 0) return "whole slice";
  if (chunk_bytes % (1u << 20) == 0) return fmt::format("{} MiB", chunk_bytes >> 20);
  if (chunk_bytes % 1024 == 0) return fmt::format("{} KiB", chunk_bytes >> 10);
  return fmt::format("{} B", chunk_bytes);
}

std::string describe_read_config(const ReadConfig& config) {
  return fmt::format("io_uring QD{} {}", config.queue_depth, describe_chunk(config.chunk_bytes));
}

Result<ReadProbe> ReadProbe::open(std::span<const std::string> paths) {
  ReadProbe p;
  p.files_.reserve(paths.size());
  for (const std::string& path : paths) {
    EXPERTD_TRY_ASSIGN(OpenedFile f, open_data_file(path));
    if (!f.info.direct_io) {
      return make_error(EINVAL, fmt::format("{}: the file system refuses O_DIRECT, so reads would "
                                            "be served from the page cache",
                                            path));
    }
    p.alignment_ = std::max(p.alignment_, f.info.dio_alignment);
    p.files_.push_back(std::move(f));
  }
  return p;
}

void ReadProbe::set_destination(uint8_t* base, uint64_t bytes) {
  EXPERTD_CHECK(base == nullptr || reinterpret_cast<uintptr_t>(base) % kPageBytes == 0);
  dest_ = base;
  dest_bytes_ = base == nullptr ? 0 : bytes;
}

Status ReadProbe::check_destination(uint64_t widest, uint32_t queue_depth) const {
  if (dest_ == nullptr) return Ok{};
  const uint64_t fits = Placer(dest_, dest_bytes_, alignment_).capacity(widest);
  if (fits < uint64_t{queue_depth} + 2) {
    return make_error(EINVAL, fmt::format("read probe: the destination ({} bytes) holds {} ranges "
                                          "of {} bytes; queue depth {} needs {}",
                                          dest_bytes_, fits, widest, queue_depth, queue_depth + 2));
  }
  return Ok{};
}

Status ReadProbe::check_ranges(std::span<const ProbeRange> ranges) const {
  if (ranges.empty()) return make_error(EINVAL, "read probe: no ranges to read");
  for (const ProbeRange& r : ranges) {
    if (r.file >= files_.size() || r.bytes == 0 || r.offset > files_[r.file].info.size_bytes ||
        r.bytes > files_[r.file].info.size_bytes - r.offset ||
        align_up(r.offset + r.bytes, alignment_) - align_down(r.offset, alignment_) >
            kMaxReadBytes) {
      return make_error(EINVAL, fmt::format("read probe: range file {} offset {} bytes {} is "
                                            "outside the files or too large",
                                            r.file, r.offset, r.bytes));
    }
  }
  return Ok{};
}

Result<ProbeResult> ReadProbe::pread_whole(std::span<const ProbeRange> ranges,
                                           const ProbeBudget& budget, size_t first) {
  EXPERTD_TRY(check_budget(budget));
  EXPERTD_TRY(check_ranges(ranges));
  const uint64_t a = alignment_;
  const uint64_t widest = max_widened_bytes(ranges, a);
  EXPERTD_TRY(check_destination(widest, 1));
  std::optional<Mapping> own;
  if (dest_ == nullptr) {
    EXPERTD_TRY_ASSIGN(Mapping b, map_buffer(widest));
    own.emplace(std::move(b));
  }
  Placer placer(dest_, dest_bytes_, a);
  ProbeResult res;
  const BudgetClock clock(budget);
  size_t i = first % ranges.size();
  for (; clock.more(res.bytes); i = (i + 1) % ranges.size()) {
    const ProbeRange& r = ranges[i];
    const Extent e = widen(r, a);
    const int fd = files_[r.file].direct.get();
    uint8_t* dst = own ? own->data() : placer.place(e.end - e.start);
    uint64_t done = 0;
    while (e.start + done < e.data_end) {
      const ssize_t n =
          ::pread(fd, dst + done, e.end - e.start - done, static_cast<off_t>(e.start + done));
      ++res.reads;
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 || (n == 0) ||
          (e.start + done + static_cast<uint64_t>(n) < e.data_end &&
           static_cast<uint64_t>(n) % a != 0)) {
        const int err = n < 0 ? errno : EIO;
        return make_error(
            err, fmt::format("{}: pread O_DIRECT at {} ({} bytes): {}", files_[r.file].info.path,
                             e.start + done, e.end - e.start - done,
                             n < 0 ? std::strerror(err) : "short read"));
      }
      done += static_cast<uint64_t>(n);
    }
    res.bytes_read += done;
    res.bytes += r.bytes;
    ++res.ranges;
  }
  res.seconds = clock.elapsed_s();
  res.next_range = i;
  return res;
}

Result<ProbeResult> ReadProbe::uring(std::span<const ProbeRange> ranges, const ReadConfig& config,
                                     const ProbeBudget& budget, size_t first) {
  EXPERTD_TRY(check_budget(budget));
  EXPERTD_TRY(check_ranges(ranges));
  if (config.queue_depth == 0 || config.queue_depth > kMaxQueueDepth) {
    return make_error(EINVAL, fmt::format("read probe: queue depth {} is outside 1..{}",
                                          config.queue_depth, kMaxQueueDepth));
  }
  const uint64_t a = alignment_;
  const uint32_t qd = config.queue_depth;
  const uint64_t widest = max_widened_bytes(ranges, a);
  const uint64_t chunk = config.chunk_bytes == 0
                             ? widest
                             : std::min(widest, std::max(a, align_down(config.chunk_bytes, a)));
  EXPERTD_TRY(check_destination(widest, qd));
  // Our own buffers: one chunk per read in flight. A destination: each range at its own place.
  std::optional<Mapping> own;
  if (dest_ == nullptr) {
    EXPERTD_TRY_ASSIGN(Mapping b, map_buffer(chunk * qd));
    own.emplace(std::move(b));
  }
  Placer placer(dest_, dest_bytes_, a);

  OwnedRing ring;
  if (const int rc = init_ring(ring, qd); rc < 0) {
    return make_error(
        -rc, fmt::format("read probe: io_uring_queue_init({}): {}", qd, std::strerror(-rc)));
  }
  io_uring* r = ring.get();
  std::vector<int> fds;
  for (const OpenedFile& f : files_) fds.push_back(f.direct.get());
  const bool fixed_files =
      ::io_uring_register_files(r, fds.data(), static_cast<unsigned>(fds.size())) == 0;
  std::vector<iovec> iovs;
  if (own) {
    for (uint32_t i = 0; i < qd; ++i) iovs.push_back({own->data() + i * chunk, chunk});
  } else {
    iovs = placer.pieces();
  }
  // Registration can fail (RLIMIT_MEMLOCK); the loop then reads into plain memory.
  const bool fixed_bufs =
      ::io_uring_register_buffers(r, iovs.data(), static_cast<unsigned>(iovs.size())) == 0;

  // One slot per read in flight; its index is the user_data (and the registered buffer's, for
  // our own buffers).
  struct Slot {
    uint32_t file = 0;
    uint64_t offset = 0;
    uint8_t* dst = nullptr;
    uint32_t len = 0;
    uint32_t needed = 0;  // bytes that must arrive (the rest is widening past the end of file)
  };
  std::vector<Slot> slots(qd);
  std::vector<uint32_t> free_slots(qd);
  for (uint32_t i = 0; i < qd; ++i) free_slots[i] = qd - 1 - i;

  auto prep = [&](uint32_t s) {
    const Slot& sl = slots[s];
    io_uring_sqe* sqe = ::io_uring_get_sqe(r);
    EXPERTD_CHECK_NE(sqe, nullptr);  // at most qd reads in flight on a ring of qd entries
    const int fd = fixed_files ? static_cast<int>(sl.file) : fds[sl.file];
    if (fixed_bufs) {
      const int index = own ? static_cast<int>(s) : placer.piece_of(sl.dst);
      ::io_uring_prep_read_fixed(sqe, fd, sl.dst, sl.len, sl.offset, index);
    } else {
      ::io_uring_prep_read(sqe, fd, sl.dst, sl.len, sl.offset);
    }
    if (fixed_files) sqe->flags |= IOSQE_FIXED_FILE;
    ::io_uring_sqe_set_data64(sqe, s);
  };

  ProbeResult res;
  const BudgetClock clock(budget);
  size_t next_range = first % ranges.size();
  Extent cur{};  // the range being cut into chunks; cur.start == cur.end when none
  uint32_t cur_file = 0;
  uint8_t* cur_dst = nullptr;  // where the next chunk of `cur` lands (destination mode)
  bool stopping = false;
  uint32_t in_flight = 0;
  Status failure = Ok{};  // the first read that failed; the others in flight are drained
  while (true) {
    while (!free_slots.empty() && !stopping) {
      if (cur.start == cur.end) {
        if (!clock.more(res.bytes)) {
          stopping = true;
          break;
        }
        const ProbeRange& pr = ranges[next_range];
        next_range = (next_range + 1) % ranges.size();
        cur = widen(pr, a);
        cur_file = pr.file;
        if (!own) cur_dst = placer.place(cur.end - cur.start);
        res.bytes += pr.bytes;
        ++res.ranges;
      }
      const uint32_t s = free_slots.back();
      free_slots.pop_back();
      const uint64_t len = std::min(chunk, cur.end - cur.start);
      slots[s] = Slot{cur_file, cur.start, own ? own->data() + s * chunk : cur_dst,
                      static_cast<uint32_t>(len),
                      static_cast<uint32_t>(std::min(len, cur.data_end - cur.start))};
      cur.start += len;
      if (!own) cur_dst += len;
      prep(s);
      ++in_flight;
      ++res.reads;
    }
    if (in_flight == 0) break;
    const int rc = ::io_uring_submit_and_wait(r, 1);
    if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
      return make_error(
          -rc, fmt::format("read probe: io_uring_submit_and_wait: {}", std::strerror(-rc)));
    }
    unsigned head;
    unsigned seen = 0;
    io_uring_cqe* cqe;
    io_uring_for_each_cqe(r, head, cqe) {
      ++seen;
      const auto s = static_cast<uint32_t>(::io_uring_cqe_get_data64(cqe));
      Slot& sl = slots[s];
      const int n = cqe->res;
      if (n == -EAGAIN) {
        prep(s);  // retried as is
        ++res.reads;
        continue;
      }
      if (n > 0) res.bytes_read += static_cast<uint64_t>(n);
      if (n > 0 && static_cast<uint32_t>(n) < sl.needed && static_cast<uint64_t>(n) % a == 0) {
        sl.offset += static_cast<uint32_t>(n);  // a short read: the rest, still aligned
        sl.dst += n;
        sl.len -= static_cast<uint32_t>(n);
        sl.needed -= static_cast<uint32_t>(n);
        prep(s);
        ++res.reads;
        continue;
      }
      if ((n <= 0 || static_cast<uint32_t>(n) < sl.needed) && failure) {
        const int err = n < 0 ? -n : EIO;
        failure = make_error(
            err, fmt::format("{}: io_uring read at {} ({} bytes): {}", files_[sl.file].info.path,
                             sl.offset, sl.len, n < 0 ? std::strerror(err) : "short read"));
        stopping = true;
      }
      free_slots.push_back(s);
      --in_flight;
    }
    ::io_uring_cq_advance(r, seen);
  }
  if (!failure) return failure.take_error();
  res.seconds = clock.elapsed_s();
  res.next_range = next_range;
  return res;
}

Result<ProbeResult> ReadProbe::sequential(uint32_t file, uint64_t offset, uint64_t bytes,
                                          const ReadConfig& config, const ProbeBudget& budget,
                                          size_t first) {
  if (file >= files_.size() || config.chunk_bytes == 0 || offset >= files_[file].info.size_bytes) {
    return make_error(EINVAL,
                      "read probe: sequential needs a file, an offset inside it and a "
                      "block size");
  }
  const uint64_t end = std::min(files_[file].info.size_bytes, offset + bytes);
  const uint64_t block = std::max<uint64_t>(align_down(config.chunk_bytes, alignment_), alignment_);
  std::vector<ProbeRange> blocks;
  blocks.reserve((end - offset) / block + 1);
  for (uint64_t pos = align_down(offset, alignment_); pos < end; pos += block) {
    blocks.push_back(ProbeRange{file, pos, std::min(block, end - pos)});
  }
  return uring(blocks, ReadConfig{config.queue_depth, 0}, budget, first);
}

Result<ProbeResult> ReadProbe::mmap_fault(std::span<const ProbeRange> ranges,
                                          const ProbeBudget& budget, size_t first) {
  EXPERTD_TRY(check_budget(budget));
  EXPERTD_TRY(check_ranges(ranges));
  std::vector<Mapping> maps(files_.size());  // unmapped on every way out
  for (const ProbeRange& r : ranges) {
    Mapping& m = maps[r.file];
    if (m.valid()) continue;
    m = Mapping::map(files_[r.file].info.size_bytes, PROT_READ, MAP_PRIVATE,
                     files_[r.file].buffered.get(), 0);
    if (!m.valid()) {
      const int err = errno;
      return make_error(err,
                        fmt::format("{}: mmap: {}", files_[r.file].info.path, std::strerror(err)));
    }
  }
  // Makes the ranges cold: our own page table entries first (fadvise keeps mapped pages), then
  // the files' clean page-cache pages.
  auto drop = [&]() {
    for (uint32_t f = 0; f < maps.size(); ++f) {
      if (!maps[f].valid()) continue;
      (void)::madvise(maps[f].get(), maps[f].size(), MADV_DONTNEED);
      (void)::posix_fadvise(files_[f].buffered.get(), 0, 0, POSIX_FADV_DONTNEED);
    }
  };
  drop();

  ProbeResult res;
  uint64_t sink = 0;
  const BudgetClock clock(budget);
  const size_t start = first % ranges.size();
  size_t i = start;
  for (; clock.more(res.bytes); i = (i + 1) % ranges.size()) {
    if (i == start && res.ranges > 0) drop();  // wrapped: what we read is cached now
    const ProbeRange& r = ranges[i];
    const uint8_t* base = maps[r.file].data();
    for (uint64_t p = align_down(r.offset, kPageBytes); p < r.offset + r.bytes; p += kPageBytes) {
      sink += *static_cast<const volatile uint8_t*>(base + std::max(p, r.offset));
      ++res.reads;
    }
    res.bytes += r.bytes;
    ++res.ranges;
  }
  res.seconds = clock.elapsed_s();
  res.next_range = i;
  res.bytes_read = res.reads * kPageBytes;
  drop();
  // Keeps the loads: the sum is never used otherwise.
  asm volatile("" : : "r"(sink) : "memory");
  return res;
}

std::span<const ReadConfig> default_read_candidates() {
  static constexpr std::array<ReadConfig, 6> kCandidates{{
      {1, 0},
      {4, 0},
      {16, 0},
      {16, 1u << 20},
      {32, 1u << 20},
      {64, 256u << 10},
  }};
  return kCandidates;
}

Result<ProbeChoice> probe_best_read_config(ReadProbe& probe, std::span<const ProbeRange> ranges,
                                           const ProbeOptions& options,
                                           std::span<const ReadConfig> candidates) {
  if (candidates.empty() || options.rounds == 0 || !(options.seconds > 0.0)) {
    return make_error(EINVAL, "read probe: no candidates, rounds or time to probe with");
  }
  ProbeChoice choice;
  for (const ReadConfig& c : candidates) choice.trials.push_back(ProbeTrial{c, {}});
  const double each_s = options.seconds / static_cast<double>(candidates.size() * options.rounds);
  for (uint32_t round = 0; round < options.rounds; ++round) {
    // Odd rounds run the candidates backwards: a rate drifting during the probe then favours
    // none of them (with an even number of rounds, a linear drift cancels out).
    for (size_t k = 0; k < choice.trials.size(); ++k) {
      ProbeTrial& t = choice.trials[round % 2 == 0 ? k : choice.trials.size() - 1 - k];
      EXPERTD_TRY_ASSIGN(const ProbeResult r,
                         probe.uring(ranges, t.config, ProbeBudget{each_s, 0}, choice.next_range));
      choice.next_range = r.next_range;
      t.result.ranges += r.ranges;
      t.result.bytes += r.bytes;
      t.result.bytes_read += r.bytes_read;
      t.result.reads += r.reads;
      t.result.seconds += r.seconds;
    }
  }
  double best = 0.0;
  for (const ProbeTrial& t : choice.trials) best = std::max(best, t.result.gbps());
  const ProbeTrial* pick = nullptr;
  for (const ProbeTrial& t : choice.trials) {
    if (t.result.gbps() < best * (1.0 - options.tie_tolerance)) continue;
    if (pick == nullptr || t.config.queue_depth > pick->config.queue_depth ||
        (t.config.queue_depth == pick->config.queue_depth &&
         t.result.gbps() > pick->result.gbps())) {
      pick = &t;
    }
  }
  EXPERTD_CHECK_NE(pick, nullptr);
  choice.config = pick->config;
  choice.gbps = pick->result.gbps();
  return choice;
}

}  // namespace expertd
