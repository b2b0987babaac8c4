// The table of ggml tensor types as GGUF files store them: id, name, block size (elements) and
// block bytes. Ids are ggml's (ggml.h `enum ggml_type`); removed ids (Q4_2, Q4_3, the in-file
// repacked Q4_0_x_y and IQ4_NL_x_y) stay in the table marked removed so a file that uses one
// gets an error naming the type rather than "unknown".
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string_view>

namespace expertd {

enum class GgmlType : uint32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q8_1 = 9,
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  Q8_K = 15,
  IQ2_XXS = 16,
  IQ2_XS = 17,
  IQ3_XXS = 18,
  IQ1_S = 19,
  IQ4_NL = 20,
  IQ3_S = 21,
  IQ2_S = 22,
  IQ4_XS = 23,
  I8 = 24,
  I16 = 25,
  I32 = 26,
  I64 = 27,
  F64 = 28,
  IQ1_M = 29,
  BF16 = 30,
  TQ1_0 = 34,
  TQ2_0 = 35,
  MXFP4 = 39,
  NVFP4 = 40,
  Q1_0 = 41,
};

struct GgmlTypeTraits {
  uint32_t id;
  std::string_view name;  // ggml's lower-case name, e.g. "q4_k"
  uint32_t block_elems;   // elements per block (1 for plain types)
  uint32_t block_bytes;   // bytes per block
  bool removed;           // the id once existed and is no longer valid in files
};

// Traits of a type id read from a file; nullopt for an id ggml never had.
std::optional<GgmlTypeTraits> ggml_type_traits(uint32_t id);

// Traits of a valid (known, not removed) type. Asserts on a removed type.
const GgmlTypeTraits& ggml_traits(GgmlType type);

// ggml's lower-case name for a type, e.g. "q8_0"; "type#N" never arises for valid types.
std::string_view ggml_type_name(GgmlType type);

// Parse a lower-case (or upper-case) type name; nullopt when unknown or removed.
std::optional<GgmlType> ggml_type_from_name(std::string_view name);

// Bytes of one row of `ne0` elements, or nullopt if ne0 is not a multiple of the block size
// (or the byte count overflows 64 bits).
std::optional<uint64_t> ggml_row_bytes(GgmlType type, uint64_t ne0);

// Number of ids (removed and valid) in the table, for iteration by tests.
uint32_t ggml_type_id_limit();

// The types the engines compute with: the CPU dequantisers (engine/dequant.cc, which also convert
// the dense weights) and the GPU kernels (kernels/) implement exactly these, so a routed expert's
// tensors must have one of them. The one list both check; adding a type means both implement it.
inline constexpr std::array kExpertTypes = {GgmlType::F32,  GgmlType::F16,  GgmlType::BF16,
                                            GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K,
                                            GgmlType::MXFP4};

constexpr bool expert_type_supported(GgmlType type) {
  for (const GgmlType t : kExpertTypes) {
    if (t == type) return true;
  }
  return false;
}

}  // namespace expertd
