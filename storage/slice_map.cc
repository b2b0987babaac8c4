#include "storage/slice_map.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>
#include <regex>

namespace expertd {

std::string_view slice_kind_name(SliceKind kind) {
  switch (kind) {
    case SliceKind::Gate:
      return "gate";
    case SliceKind::Up:
      return "up";
    case SliceKind::Down:
      return "down";
    case SliceKind::GateUp:
      return "gate_up";
  }
  return "invalid";
}

namespace {

struct Found {
  const GgufTensorInfo* info = nullptr;
  uint32_t shard = 0;
};

Error map_error(const GgufModel& m, std::string_view what) {
  return make_error(EINVAL, fmt::format("{}: slice map: {}", m.meta().path(), what));
}

}  // namespace

Result<SliceMap> SliceMap::build(const GgufModel& model) {
  static const std::regex re(R"(^blk\.([0-9]+)\.ffn_(gate|up|down|gate_up)_exps\.weight$)");
  // layer -> kind -> tensor
  std::map<uint32_t, std::array<Found, 4>> by_layer;
  for (uint32_t s = 0; s < model.shards().size(); ++s) {
    for (const auto& t : model.shards()[s].tensors()) {
      std::smatch m;
      if (!std::regex_match(t.name, m, re)) continue;
      const unsigned long layer = std::stoul(m[1].str());
      if (layer > std::numeric_limits<uint32_t>::max()) {
        return map_error(model, fmt::format("tensor '{}': layer number too large", t.name));
      }
      const std::string k = m[2].str();
      const SliceKind kind = k == "gate"   ? SliceKind::Gate
                             : k == "up"   ? SliceKind::Up
                             : k == "down" ? SliceKind::Down
                                           : SliceKind::GateUp;
      by_layer[static_cast<uint32_t>(layer)][static_cast<size_t>(kind)] = Found{&t, s};
    }
  }

  SliceMap map;
  if (const GgufValue* v = model.find_arch("block_count")) {
    map.block_count_ = static_cast<uint32_t>(std::min<uint64_t>(v->as_u64().value_or(0), 1u << 20));
  }
  if (const GgufValue* v = model.find_arch("expert_count")) {
    map.expert_count_ =
        static_cast<uint32_t>(std::min<uint64_t>(v->as_u64().value_or(0), 1u << 20));
  }
  if (const GgufValue* v = model.find_arch("expert_used_count")) {
    map.top_k_ = static_cast<uint32_t>(std::min<uint64_t>(v->as_u64().value_or(0), 1u << 20));
  }
  if (by_layer.empty()) return map;  // a dense model: no routed experts
  if (map.expert_count_ == 0) {
    return map_error(model, fmt::format("expert tensors present but {} is missing or 0",
                                        model.arch_key("expert_count")));
  }
  const uint32_t last_layer = by_layer.rbegin()->first;
  if (map.block_count_ == 0) map.block_count_ = last_layer + 1;
  if (last_layer >= map.block_count_) {
    return map_error(model, fmt::format("layer {} has expert tensors but {} is {}", last_layer,
                                        model.arch_key("block_count"), map.block_count_));
  }

  map.layer_index_.assign(map.block_count_, -1);
  map.min_expert_bytes_ = std::numeric_limits<uint64_t>::max();
  for (const auto& [layer, kinds] : by_layer) {
    MoeLayer ml;
    ml.layer = layer;
    const bool fused = kinds[static_cast<size_t>(SliceKind::GateUp)].info != nullptr;
    const bool split = kinds[0].info != nullptr || kinds[1].info != nullptr;
    if (fused && split) {
      return map_error(model, fmt::format("layer {} has both ffn_gate_up_exps and separate "
                                          "ffn_gate/ffn_up_exps",
                                          layer));
    }
    std::vector<SliceKind> want;
    if (fused) {
      want = {SliceKind::GateUp, SliceKind::Down};
    } else {
      want = {SliceKind::Gate, SliceKind::Up, SliceKind::Down};
    }
    uint64_t per_expert = 0;
    for (const SliceKind kind : want) {
      const Found& f = kinds[static_cast<size_t>(kind)];
      if (f.info == nullptr) {
        return map_error(model, fmt::format("layer {} lacks blk.{}.ffn_{}_exps.weight", layer,
                                            layer, slice_kind_name(kind)));
      }
      // GgufModel::open checked n_dims == 3, ne[2] == expert_count and that the tensor lies
      // inside its file; nb[2] is the size of one expert's slice.
      ExpertSlice s;
      s.shard = f.shard;
      s.kind = kind;
      s.type = f.info->type;
      s.offset = f.info->offset;
      s.bytes = f.info->nb[2];
      s.ne0 = f.info->ne[0];
      s.ne1 = f.info->ne[1];
      ml.expert0[ml.slice_count] = s;
      ml.expert_stride[ml.slice_count] = f.info->nb[2];
      ++ml.slice_count;
      per_expert += s.bytes;
    }
    map.layer_index_[layer] = static_cast<int32_t>(map.layers_.size());
    map.layers_.push_back(ml);
    map.min_expert_bytes_ = std::min(map.min_expert_bytes_, per_expert);
    map.max_expert_bytes_ = std::max(map.max_expert_bytes_, per_expert);
    map.total_expert_bytes_ += per_expert * map.expert_count_;
  }
  return map;
}

const MoeLayer* SliceMap::find_layer(uint32_t layer) const {
  if (layer >= layer_index_.size() || layer_index_[layer] < 0) return nullptr;
  return &layers_[static_cast<size_t>(layer_index_[layer])];
}

uint32_t SliceMap::slices(uint32_t layer, uint32_t expert, std::span<ExpertSlice, 3> out) const {
  const MoeLayer* ml = find_layer(layer);
  if (ml == nullptr || expert >= expert_count_) return 0;
  for (uint32_t i = 0; i < ml->slice_count; ++i) {
    out[i] = ml->expert0[i];
    out[i].offset += ml->expert_stride[i] * expert;
  }
  return ml->slice_count;
}

uint64_t SliceMap::expert_bytes(uint32_t layer) const {
  const MoeLayer* ml = find_layer(layer);
  if (ml == nullptr) return 0;
  uint64_t total = 0;
  for (uint32_t i = 0; i < ml->slice_count; ++i) total += ml->expert0[i].bytes;
  return total;
}

}  // namespace expertd
