#include "storage/ggml_types.h"

#include <array>
#include <cctype>
#include <string>

#include "base/check.h"

namespace expertd {
namespace {

// Block sizes and bytes follow ggml's block_* structs (ggml-common.h).
constexpr std::array<GgmlTypeTraits, 42> kTypes = {{
    {0, "f32", 1, 4, false},         {1, "f16", 1, 2, false},
    {2, "q4_0", 32, 18, false},      {3, "q4_1", 32, 20, false},
    {4, "q4_2", 32, 0, true},        {5, "q4_3", 32, 0, true},
    {6, "q5_0", 32, 22, false},      {7, "q5_1", 32, 24, false},
    {8, "q8_0", 32, 34, false},      {9, "q8_1", 32, 36, false},
    {10, "q2_k", 256, 84, false},    {11, "q3_k", 256, 110, false},
    {12, "q4_k", 256, 144, false},   {13, "q5_k", 256, 176, false},
    {14, "q6_k", 256, 210, false},   {15, "q8_k", 256, 292, false},
    {16, "iq2_xxs", 256, 66, false}, {17, "iq2_xs", 256, 74, false},
    {18, "iq3_xxs", 256, 98, false}, {19, "iq1_s", 256, 50, false},
    {20, "iq4_nl", 32, 18, false},   {21, "iq3_s", 256, 110, false},
    {22, "iq2_s", 256, 82, false},   {23, "iq4_xs", 256, 136, false},
    {24, "i8", 1, 1, false},         {25, "i16", 1, 2, false},
    {26, "i32", 1, 4, false},        {27, "i64", 1, 8, false},
    {28, "f64", 1, 8, false},        {29, "iq1_m", 256, 56, false},
    {30, "bf16", 1, 2, false},       {31, "q4_0_4_4", 32, 0, true},
    {32, "q4_0_4_8", 32, 0, true},   {33, "q4_0_8_8", 32, 0, true},
    {34, "tq1_0", 256, 54, false},   {35, "tq2_0", 256, 66, false},
    {36, "iq4_nl_4_4", 32, 0, true}, {37, "iq4_nl_4_8", 32, 0, true},
    {38, "iq4_nl_8_8", 32, 0, true}, {39, "mxfp4", 32, 17, false},
    {40, "nvfp4", 64, 36, false},    {41, "q1_0", 128, 18, false},
}};

constexpr bool table_is_indexed_by_id() {
  for (size_t i = 0; i < kTypes.size(); ++i) {
    if (kTypes[i].id != i) return false;
  }
  return true;
}
static_assert(table_is_indexed_by_id(), "kTypes[i].id must equal i");

}  // namespace

std::optional<GgmlTypeTraits> ggml_type_traits(uint32_t id) {
  if (id >= kTypes.size()) return std::nullopt;
  return kTypes[id];
}

const GgmlTypeTraits& ggml_traits(GgmlType type) {
  const auto id = static_cast<uint32_t>(type);
  EXPERTD_CHECK_LT(id, kTypes.size());
  EXPERTD_CHECK(!kTypes[id].removed);
  return kTypes[id];
}

std::string_view ggml_type_name(GgmlType type) { return ggml_traits(type).name; }

std::optional<GgmlType> ggml_type_from_name(std::string_view name) {
  std::string lower(name);
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (const auto& t : kTypes) {
    if (!t.removed && t.name == lower) return static_cast<GgmlType>(t.id);
  }
  return std::nullopt;
}

std::optional<uint64_t> ggml_row_bytes(GgmlType type, uint64_t ne0) {
  const auto& t = ggml_traits(type);
  if (ne0 % t.block_elems != 0) return std::nullopt;
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(ne0 / t.block_elems, uint64_t{t.block_bytes}, &bytes)) {
    return std::nullopt;
  }
  return bytes;
}

uint32_t ggml_type_id_limit() { return static_cast<uint32_t>(kTypes.size()); }

}  // namespace expertd
