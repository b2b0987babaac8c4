// Opening a data file for the read backends, and probing how its direct-I/O reads must be aligned.
//
// The alignment comes from, in order: statx(STATX_DIOALIGN) (Linux 6.1+; the larger of the offset
// and memory alignments), the logical block size of the block device holding the file (sysfs),
// and finally 4096, which every Linux block device accepts. FileInfo::alignment_source says which.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "base/fd.h"
#include "expertd/result.h"
#include "storage/reader.h"

namespace expertd {

// An owned file descriptor: move-only, closed exactly once by the destructor.
struct DioAlignment {
  uint32_t bytes = 4096;           // a power of two
  const char* source = "default";  // "statx", "logical block size" or "default"
};

// Never fails: a probe that cannot answer falls through to the next source.
DioAlignment probe_dio_alignment(int fd);

// One data file opened for both kinds of reads.
struct OpenedFile {
  UniqueFd direct;    // O_DIRECT; a second buffered fd when the file system refuses O_DIRECT
  UniqueFd buffered;  // page-cache reads at any alignment
  FileInfo info;
};

// Opens `path` read-only twice (O_DIRECT and buffered, both O_CLOEXEC), reads its size and probes
// the DIO alignment. The error names the path and the failing call.
Result<OpenedFile> open_data_file(const std::string& path);

}  // namespace expertd
