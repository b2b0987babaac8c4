// Content checksums of a model's experts (docs/STORAGE.md "Content checksums"): one XXH3-64 per
// (layer, expert) over the expert's slices' bytes, in SliceMap::slices() order (the widening
// around them is not hashed). A ChecksumManifest owns the table for one model; it is built once by
// reading every expert and kept in a state directory, keyed by the model files' identity (size,
// mtime, inode of each shard), so a later start loads it instead of reading the model again. The
// scheduler checks each load against it before the expert becomes READY.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "expertd/result.h"
#include "storage/expert_key.h"
#include "storage/gguf.h"
#include "storage/slice_map.h"
#include "storage/slot_layout.h"

namespace expertd {

// The checksum of an expert as it lies in a slot: its slices at their placements. No allocation.
uint64_t expert_checksum(const uint8_t* slot, std::span<const ExpertSlice> slices,
                         std::span<const SlicePlacement> place);

class ChecksumManifest {
 public:
  ChecksumManifest() = default;

  // DIR/NAME.xxh3 when it exists and was built from these very files; otherwise reads every expert
  // of the model (pread), and writes the manifest there (a temporary file renamed into place).
  // `*built` says which happened. A manifest that cannot be written is still returned (and
  // `*write_error` says why), so this run checks its loads all the same.
  static Result<ChecksumManifest> load_or_build(const std::string& dir, const std::string& name,
                                                const GgufModel& model, const SliceMap& map,
                                                bool* built, std::string* write_error);

  // The path it was loaded from or written to.
  const std::string& path() const { return path_; }
  // Per (layer * expert_count + expert); 0 for layers without routed experts.
  std::span<const uint64_t> table() const { return table_; }

 private:
  std::string path_;
  std::vector<uint64_t> table_;
};

}  // namespace expertd
