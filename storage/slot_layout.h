// Where an expert's slices land inside an arena slot.
//
// O_DIRECT reads must start and end on the file's DIO alignment A, so each slice is read widened
// to [align_down(offset), align_up(offset + bytes)) into an A-aligned place in the slot; its data
// then starts `sub = offset % A` bytes in. Slices are laid out one after another; the slot size is
// the largest layer's total, rounded up to the page size. Clients receive these layouts (via RPC)
// to find a slice's bytes in a slot they hold.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "storage/slice_map.h"

namespace expertd {

struct SlicePlacement {
  uint64_t read_slot_offset = 0;  // where the widened read lands (A-aligned)
  uint64_t data_slot_offset = 0;  // where the slice's first byte lands (read_slot_offset + sub)
  uint64_t read_bytes = 0;        // widened length (multiple of A)
};

class SlotLayouts {
 public:
  // `alignment` is the largest DIO alignment over the model's files (a power of two).
  //
  // Expert e's slice starts at offset0 + e*stride, so its misalignment `sub` can differ per
  // expert; placements are therefore computed per (layer, expert) by place(), and the per-layer
  // maximum sizes the slot.
  SlotLayouts(const SliceMap& map, uint32_t alignment, uint64_t page_bytes);

  uint32_t alignment() const { return alignment_; }
  uint64_t slot_bytes() const { return slot_bytes_; }
  // Placements of (layer, expert)'s slices; slices() order. Returns the slice count.
  uint32_t place(uint32_t layer, uint32_t expert, std::span<ExpertSlice, 3> slices,
                 std::span<SlicePlacement, 3> out) const;

 private:
  const SliceMap& map_;
  uint32_t alignment_;
  uint64_t slot_bytes_ = 0;
};

}  // namespace expertd
