// ReadProbe: what the disk can do for a given access pattern, measured with plain read loops that
// share nothing with the storage engine, so the engine can be compared with (and tuned to) them.
//
// Every method reads a list of byte ranges (expert slices) in the list's order, from `first` on,
// cold: the O_DIRECT methods bypass the page cache; the mmap method drops the ranges' cached pages
// first. A method runs until its budget (time or bytes) is spent, wrapping around the list when it
// is short, then finishes the ranges it started (ProbeResult::next_range says where a later call
// continues, so interleaved runs of several methods all read the list in order); GB/s counts the
// ranges' own bytes (not the widening to the DIO alignment) over the time from the first read to
// the last completion, so the engine's "expert bytes delivered per second" is directly comparable.
//
// Methods:
//  - pread_whole: synchronous pread(2) of each whole range (widened), one at a time;
//  - uring: io_uring with `queue_depth` reads in flight, each range cut into `chunk_bytes` pieces
//    (0 = one read per range), into registered buffers with registered files — a tight loop;
//  - sequential: io_uring over one contiguous region in large blocks (the device's ceiling);
//  - mmap_fault: a read-only private mapping touched one 4 KiB page at a time (page faults and the
//    kernel's read-around: what llama.cpp does by default).
//
// probe_best_read_config() runs a few io_uring (queue depth, chunk) candidates briefly and returns
// the best: the daemon calls it at start to choose its read shape per device.
//
// A ReadProbe owns its file descriptors; each method owns its ring and buffers for its duration
// only. Single-threaded. Methods allocate at their start, never per read.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "expertd/result.h"
#include "storage/file_probe.h"
#include "storage/reader.h"

namespace expertd {

// A byte range of file `file` (an index into the paths given to ReadProbe::open).
struct ProbeRange {
  uint32_t file = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;  // > 0
};

// When a method stops starting new ranges: whichever limit is reached first; 0 = no such limit
// (at least one must be set). A started range is always finished.
struct ProbeBudget {
  double seconds = 3.0;
  uint64_t bytes = 0;
};

// The shape of io_uring reads: reads in flight, and the piece each range is cut into.
struct ReadConfig {
  uint32_t queue_depth = 32;
  uint64_t chunk_bytes = 1 << 20;  // 0 = the whole (widened) range in one read
  friend bool operator==(const ReadConfig&, const ReadConfig&) = default;
};

// "io_uring QD32 1 MiB", "io_uring QD4 whole slice".
std::string describe_read_config(const ReadConfig& config);
// "256 KiB", "1 MiB", "whole slice".
std::string describe_chunk(uint64_t chunk_bytes);

struct ProbeResult {
  uint64_t ranges = 0;      // ranges read whole
  uint64_t bytes = 0;       // their bytes
  uint64_t bytes_read = 0;  // bytes the reads delivered (widening included; pages for mmap)
  uint64_t reads = 0;       // read requests (pages touched for mmap)
  double seconds = 0.0;
  size_t next_range = 0;  // the index after the last range started (mod the list's size)
  double gbps() const { return seconds > 0.0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0; }
};

class ReadProbe {
 public:
  // Opens every path (O_DIRECT and buffered) and probes its DIO alignment; the error names the
  // path. A file system without O_DIRECT is refused: the probe would measure the page cache.
  static Result<ReadProbe> open(std::span<const std::string> paths);

  ReadProbe(ReadProbe&&) = default;
  ReadProbe& operator=(ReadProbe&&) = default;
  ReadProbe(const ReadProbe&) = delete;
  ReadProbe& operator=(const ReadProbe&) = delete;

  uint32_t file_count() const { return static_cast<uint32_t>(files_.size()); }
  const FileInfo& file(uint32_t index) const { return files_[index].info; }
  // The largest DIO alignment over the files: every widened read uses it.
  uint32_t alignment() const { return alignment_; }

  // Makes pread_whole and uring read into [base, base + bytes) — e.g. the arena of the engine
  // under test, so that both write the same memory — instead of buffers of their own. Ranges land
  // one after another at aligned places, wrapping, so a method's memory footprint is the engine's
  // (on virtual machines, where the destination pages alone can change the rate by a third, this
  // is what makes the comparison fair). `base` is page-aligned; the region must hold
  // queue depth + 2 of the widest ranges; its contents are overwritten. nullptr: own buffers.
  void set_destination(uint8_t* base, uint64_t bytes);

  Result<ProbeResult> pread_whole(std::span<const ProbeRange> ranges, const ProbeBudget& budget,
                                  size_t first = 0);
  Result<ProbeResult> uring(std::span<const ProbeRange> ranges, const ReadConfig& config,
                            const ProbeBudget& budget, size_t first = 0);
  // Reads [offset, offset + bytes) of `file` in `config.chunk_bytes` blocks (> 0), wrapping;
  // `first` and next_range count blocks.
  Result<ProbeResult> sequential(uint32_t file, uint64_t offset, uint64_t bytes,
                                 const ReadConfig& config, const ProbeBudget& budget,
                                 size_t first = 0);
  // Drops the files' clean cached pages first, and again when it wraps and when it is done.
  Result<ProbeResult> mmap_fault(std::span<const ProbeRange> ranges, const ProbeBudget& budget,
                                 size_t first = 0);

 private:
  ReadProbe() = default;
  Status check_ranges(std::span<const ProbeRange> ranges) const;
  Status check_destination(uint64_t widest, uint32_t queue_depth) const;

  std::vector<OpenedFile> files_;
  uint32_t alignment_ = 512;
  uint8_t* dest_ = nullptr;  // not owned
  uint64_t dest_bytes_ = 0;
};

struct ProbeTrial {
  ReadConfig config;
  ProbeResult result;
};

struct ProbeChoice {
  ReadConfig config;
  double gbps = 0.0;
  std::vector<ProbeTrial> trials;  // every candidate, in candidate order (rounds summed)
  size_t next_range = 0;           // where the trials stopped reading `ranges`
};

struct ProbeOptions {
  double seconds = 1.5;  // in all, shared equally by the candidates and rounds
  uint32_t rounds = 2;   // candidates take turns, forwards then backwards, so drift is shared
  // A candidate this close (relative) to the best with more reads in flight wins: a deeper queue
  // rides out late wake-ups of the reactor when the CPUs are busy, a shallow one runs dry. (On a
  // 2-vCPU VM one busy core cost QD4 whole-slice reads 15% and QD32 1 MiB reads nothing;
  // docs/PERFORMANCE.md.) The probe itself runs on an idle machine and cannot see this.
  double tie_tolerance = 0.03;
};

// The default candidates: a spread of queue depths and chunk sizes, whole slices included, with
// at most about 32 MiB in flight for slices of up to 2 MiB (more only delays demand reads queued
// behind prefetches).
std::span<const ReadConfig> default_read_candidates();

// Runs each candidate on `ranges` (a sample of the expert slices) and returns the best. The trials
// read the ranges one after the other (each continues where the previous one stopped), so no
// range is read twice before the list wraps.
Result<ProbeChoice> probe_best_read_config(
    ReadProbe& probe, std::span<const ProbeRange> ranges, const ProbeOptions& options = {},
    std::span<const ReadConfig> candidates = default_read_candidates());

}  // namespace expertd
