#include "testing/expected_bytes.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "forge/content.h"

namespace expertd::test {

ExpectedBytes::ExpectedBytes(const std::string& path) {
  auto m = GgufModel::open(path);
  EXPECT_TRUE(m) << m.error().message;
  if (!m) return;
  model_ = std::move(*m);
  auto info = forge_info(model_);
  EXPECT_TRUE(info) << info.error().message;
  if (info) seed_ = info->seed;
}

namespace {

// The forged bytes of slice `s` of view `v` into `want`; "" or why they cannot be had.
std::string expected(const GgufModel& model, uint64_t seed, const client::SlotView& v,
                     const client::SliceView& s, std::vector<uint8_t>& want) {
  const std::string name = fmt::format("blk.{}.ffn_{}_exps.weight", v.layer, s.info->kind);
  const auto ref = model.find_tensor(name);
  if (!ref) return "no tensor " + name;
  want.resize(s.bytes);
  const uint64_t in_tensor = s.info->offset - ref->info->offset + v.expert * s.info->stride;
  const auto st = forge_expected_bytes(seed, *ref->info, in_tensor, want);
  return st ? std::string() : st.error().message;
}

}  // namespace

uint64_t ExpectedBytes::wrong_bytes(const client::SlotView& v) const {
  if (v.slice_count == 0) return UINT64_MAX;
  uint64_t wrong = 0;
  std::vector<uint8_t> want;
  for (uint32_t i = 0; i < v.slice_count; ++i) {
    const client::SliceView& s = v.slices[i];
    if (!expected(model_, seed_, v, s, want).empty()) return UINT64_MAX;
    for (uint64_t b = 0; b < s.bytes; ++b) wrong += want[b] != s.data[b];
  }
  return wrong;
}

std::string ExpectedBytes::difference(const client::SlotView& v) const {
  if (v.slice_count == 0) return "no slices";
  std::vector<uint8_t> want;
  for (uint32_t i = 0; i < v.slice_count; ++i) {
    const client::SliceView& s = v.slices[i];
    const std::string why = expected(model_, seed_, v, s, want);
    if (!why.empty()) return why;
    if (std::memcmp(want.data(), s.data, s.bytes) != 0) {
      return fmt::format("layer {} expert {} slice {}: bytes differ from the forged content",
                         v.layer, v.expert, s.info->kind);
    }
  }
  return {};
}

}  // namespace expertd::test
