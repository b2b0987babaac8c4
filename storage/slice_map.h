// The expert slice map: for every MoE layer and routed expert, where the bytes of its gate, up and
// down projections (or fused gate_up) sit in the GGUF shards.
//
// Expert e of a merged 3-D tensor [ne0, ne1, n_expert] occupies [offset + e*nb2, +nb2) where
// nb2 = ne1 * row_bytes(ne0). Shared experts (`*_shexp`) and layers without expert tensors
// (dense first layers) are not in the map. Built once from a GgufModel; immutable after.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "expertd/result.h"
#include "storage/ggml_types.h"
#include "storage/gguf.h"

namespace expertd {

enum class SliceKind : uint8_t { Gate = 0, Up = 1, Down = 2, GateUp = 3 };
std::string_view slice_kind_name(SliceKind kind);  // "gate", "up", "down", "gate_up"

struct ExpertSlice {
  uint32_t shard = 0;
  SliceKind kind = SliceKind::Gate;
  GgmlType type = GgmlType::F32;
  uint64_t offset = 0;  // absolute byte offset in the shard file
  uint64_t bytes = 0;
  uint64_t ne0 = 0;  // row length (input features)
  uint64_t ne1 = 0;  // rows (output features)
};

// The slices of one layer's expert tensors (one per kind present, at most 3).
struct MoeLayer {
  uint32_t layer = 0;
  uint32_t slice_count = 0;                 // 2 (gate_up + down) or 3 (gate, up, down)
  std::array<ExpertSlice, 3> expert0{};     // the slices of expert 0
  std::array<uint64_t, 3> expert_stride{};  // bytes between consecutive experts (nb2)
};

class SliceMap {
 public:
  static Result<SliceMap> build(const GgufModel& model);

  uint32_t block_count() const { return block_count_; }  // all layers, dense ones included
  uint32_t expert_count() const { return expert_count_; }
  uint32_t top_k() const { return top_k_; }  // <arch>.expert_used_count, 0 when absent
  const std::vector<MoeLayer>& layers() const { return layers_; }
  // The MoeLayer of `layer`, or nullptr for a layer without routed experts.
  const MoeLayer* find_layer(uint32_t layer) const;

  // The slices of (layer, expert), in kind order. Empty for an unknown layer or expert.
  // Writes up to 3 slices into `out` and returns how many.
  uint32_t slices(uint32_t layer, uint32_t expert, std::span<ExpertSlice, 3> out) const;
  uint64_t expert_bytes(uint32_t layer) const;  // every expert of a layer has the same size
  uint64_t min_expert_bytes() const { return min_expert_bytes_; }
  uint64_t max_expert_bytes() const { return max_expert_bytes_; }
  uint64_t total_expert_bytes() const { return total_expert_bytes_; }

 private:
  uint32_t block_count_ = 0;
  uint32_t expert_count_ = 0;
  uint32_t top_k_ = 0;
  std::vector<MoeLayer> layers_;
  std::vector<int32_t> layer_index_;  // block -> index into layers_, -1 when dense
  uint64_t min_expert_bytes_ = 0;
  uint64_t max_expert_bytes_ = 0;
  uint64_t total_expert_bytes_ = 0;
};

}  // namespace expertd
