#include "storage/slot_layout.h"

#include <algorithm>

#include "base/check.h"

namespace expertd {

SlotLayouts::SlotLayouts(const SliceMap& map, uint32_t alignment, uint64_t page_bytes)
    : map_(map), alignment_(alignment) {
  EXPERTD_CHECK_GT(alignment, 0);
  EXPERTD_CHECK_EQ((alignment & (alignment - 1)), 0);
  // The worst case of any expert: each slice may need up to A-1 extra bytes in front and behind.
  for (const auto& layer : map.layers()) {
    uint64_t bytes = 0;
    for (uint32_t i = 0; i < layer.slice_count; ++i) {
      const uint64_t a = alignment;
      bytes += (layer.expert0[i].bytes + 2 * (a - 1)) / a * a;
    }
    slot_bytes_ = std::max(slot_bytes_, bytes);
  }
  slot_bytes_ = (slot_bytes_ + page_bytes - 1) / page_bytes * page_bytes;
}

uint32_t SlotLayouts::place(uint32_t layer, uint32_t expert, std::span<ExpertSlice, 3> slices,
                            std::span<SlicePlacement, 3> out) const {
  const uint32_t n = map_.slices(layer, expert, slices);
  const uint64_t a = alignment_;
  uint64_t pos = 0;
  for (uint32_t i = 0; i < n; ++i) {
    const uint64_t start = slices[i].offset / a * a;
    const uint64_t end = (slices[i].offset + slices[i].bytes + a - 1) / a * a;
    out[i].read_slot_offset = pos;
    out[i].data_slot_offset = pos + (slices[i].offset - start);
    out[i].read_bytes = end - start;
    pos += end - start;
  }
  EXPERTD_CHECK_LE(pos, slot_bytes_);
  return n;
}

}  // namespace expertd
