#include "forge/verifier.h"

#include <fmt/format.h>

#include <array>
#include <cstring>

#include "forge/content.h"

namespace expertd {

Result<std::unique_ptr<ForgeVerifier>> ForgeVerifier::create(const GgufModel& model,
                                                             const SliceMap& map,
                                                             const SlotLayouts& layouts) {
  ForgeInfo info;
  EXPERTD_TRY_ASSIGN(info, forge_info(model));
  auto v = std::make_unique<ForgeVerifier>();
  v->model_ = &model;
  v->map_ = &map;
  v->layouts_ = &layouts;
  v->seed_ = info.seed;
  v->expected_.resize(layouts.slot_bytes());
  v->latencies_.reserve(1 << 20);
  return v;
}

void ForgeVerifier::loaded(ExpertKey key, uint32_t slot, const uint8_t* slot_data,
                           uint64_t latency_ns) {
  if (latencies_.size() < latencies_.capacity()) latencies_.push_back(latency_ns);
  std::array<ExpertSlice, 3> slices{};
  std::array<SlicePlacement, 3> place{};
  const uint32_t n = layouts_->place(key.layer, key.expert, slices, place);
  bool ok = true;
  for (uint32_t i = 0; i < n && ok; ++i) {
    const std::string tensor =
        fmt::format("blk.{}.ffn_{}_exps.weight", key.layer, slice_kind_name(slices[i].kind));
    const auto ref = model_->find_tensor(tensor);
    std::span<uint8_t> want(expected_.data(), slices[i].bytes);
    const Status st =
        ref ? forge_expected_bytes(seed_, *ref->info, slices[i].offset - ref->info->offset, want)
            : Status(make_error(ENOENT, "tensor " + tensor + " missing"));
    if (!st) {
      ok = false;
      if (messages_.size() < 8) messages_.push_back(st.error().message);
      break;
    }
    const uint8_t* got = slot_data + place[i].data_slot_offset;
    if (std::memcmp(got, want.data(), want.size()) != 0) {
      ok = false;
      size_t first = 0;
      while (first < want.size() && got[first] == want[first]) ++first;
      if (messages_.size() < 8) {
        messages_.push_back(
            fmt::format("layer {} expert {} {} (slot {}): first wrong byte at "
                        "slice offset {} (file offset {})",
                        key.layer, key.expert, slice_kind_name(slices[i].kind), slot, first,
                        slices[i].offset + first));
      }
    }
  }
  ++verified_;
  if (!ok) ++failures_;
  if (next_ != nullptr) next_->loaded(key, slot, slot_data, latency_ns);
}

void ForgeVerifier::failed(ExpertKey key, int error) {
  ++load_errors_;
  if (next_ != nullptr) next_->failed(key, error);
}

}  // namespace expertd
