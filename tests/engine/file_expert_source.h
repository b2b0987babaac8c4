// Test-only ExpertSource that reads experts straight from the GGUF (pread through the slice map).
// The product path never does this (experts come from expertd); tests of the forward math use it
// to tell a wrong computation from a wrong delivery.
#pragma once

#include <map>
#include <utility>
#include <vector>

#include "engine/expert_source.h"
#include "storage/slice_map.h"

namespace expertd::engine::test {

class FileExpertSource final : public ExpertSource {
 public:
  static Result<std::unique_ptr<FileExpertSource>> open(const DenseModel& model) {
    EXPERTD_TRY_ASSIGN(SliceMap map, SliceMap::build(model.gguf()));
    std::unique_ptr<FileExpertSource> s(new FileExpertSource(model, std::move(map)));
    for (const GgufFile& shard : model.gguf().shards()) {
      EXPERTD_TRY_ASSIGN(auto src, open_file_source(shard.path()));
      s->files_.push_back(std::move(src));
    }
    return s;
  }

  Status get(uint32_t layer, std::span<const uint32_t> experts,
             std::span<ExpertView> out) override {
    const ModelParams& p = model_.params();
    for (size_t i = 0; i < experts.size(); ++i) {
      std::array<ExpertSlice, 3> slices{};
      const uint32_t n = map_.slices(layer, experts[i], slices);
      if (n != 3) return make_error(EINVAL, "test source: expected gate, up and down slices");
      auto& held = held_[{layer, experts[i]}];
      held.resize(3);
      ExpertView v{layer, experts[i], {}, {}, {}, 0};
      for (uint32_t j = 0; j < 3; ++j) {
        const ExpertSlice& s = slices[j];
        held[j].resize(s.bytes);
        EXPERTD_TRY(files_[s.shard]->read_exact(s.offset, held[j]));
        const WeightView w{s.type, held[j].data(), s.ne1, s.ne0, s.bytes / s.ne1};
        (s.kind == SliceKind::Gate ? v.gate : s.kind == SliceKind::Up ? v.up : v.down) = w;
      }
      if (v.gate.rows != p.n_ff_exp || v.down.rows != p.n_embd) {
        return make_error(EINVAL, "test source: unexpected expert shape");
      }
      out[i] = v;
    }
    gets_ += experts.size();
    return Ok{};
  }
  Status release(std::span<const ExpertView> views) override {
    releases_ += views.size();
    return Ok{};
  }
  Status prefetch(std::span<const ExpertHint> hints) override {
    hints_.insert(hints_.end(), hints.begin(), hints.end());
    return Ok{};
  }
  Status set_cursor(uint32_t token, uint32_t layer) override {
    cursor_ = {token, layer};
    return Ok{};
  }

  uint64_t gets() const { return gets_; }
  uint64_t releases() const { return releases_; }
  const std::vector<ExpertHint>& hints() const { return hints_; }
  std::pair<uint32_t, uint32_t> cursor() const { return cursor_; }

 private:
  FileExpertSource(const DenseModel& model, SliceMap map) : model_(model), map_(std::move(map)) {}

  const DenseModel& model_;
  SliceMap map_;
  std::vector<std::unique_ptr<ByteSource>> files_;
  std::map<std::pair<uint32_t, uint32_t>, std::vector<std::vector<uint8_t>>> held_;
  uint64_t gets_ = 0;
  uint64_t releases_ = 0;
  std::vector<ExpertHint> hints_;
  std::pair<uint32_t, uint32_t> cursor_{0, 0};
};

}  // namespace expertd::engine::test
