// The deterministic content of a forged model: every byte of every tensor is a pure function of
// the forge seed, the tensor (name, type, shape) and the byte's position, so any byte range of a
// file written by expert-forge can be recomputed from the opened file alone and compared.
//
// Content is generated per block: block i of tensor T depends only on (seed, hash(T.name), i), so
// random access costs one block of generation at each end of the range. A "block" is the ggml
// block of a quantized type, and a group of 4 elements of a plain type (f32, f16, bf16).
//
// Values are meant for a real forward pass: matrices are noise of amplitude ~sqrt(3/ne0) (unit
// variance outputs for unit variance inputs), tensors named *norm.weight are 1 + noise of
// amplitude 1/16; deepseek4's hyper-connection scales are 1 + noise of 1/16, its
// hyper-connection mixers and bases, compressor position embeddings, attention sinks and routing
// biases noise of 1/128. Quantized blocks carry finite, positive f16 scales (mxfp4: e8m0
// exponents) chosen so the dequantised values land within about +-1.25 x amplitude. docs/FORGE.md
// specifies the function exactly.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "expertd/result.h"
#include "storage/ggml_types.h"
#include "storage/gguf.h"

namespace expertd {

// The content function's version, stored in every forged file; a change to the bytes the function
// produces must bump it.
inline constexpr uint32_t kForgeVersion = 1;
inline constexpr std::string_view kForgeSeedKey = "expertd.forge.seed";        // u64
inline constexpr std::string_view kForgeVersionKey = "expertd.forge.version";  // u32

struct ForgeInfo {
  uint64_t seed = 0;
  uint32_t version = 0;
  // `<arch>.expert_count` of the model, 0 when absent: the range of the hash-routing tables
  // (deepseek4's ffn_gate_tid2eid), the one content that depends on more than the tensor.
  uint32_t expert_count = 0;
};

// The forge parameters of a file (or of a model's first shard). Errors "PATH: not a forged model"
// without the keys, and name the version when it is not kForgeVersion.
Result<ForgeInfo> forge_info(const GgufFile& file);
Result<ForgeInfo> forge_info(const GgufModel& model);

// Types the content function can generate: f32, f16, bf16, q4_0, q8_0, q4_k, q6_k, mxfp4 (and i32
// for hash-routing tables only, see forge_is_hash_table).
bool forge_supports_type(GgmlType type);

// deepseek4's blk.N.ffn_gate_tid2eid.weight: i32 [top_k, vocab], each row (a token) top_k
// distinct experts in [0, expert_count).
bool forge_is_hash_table(std::string_view name);

// What a tensor's values look like: center + noise in [-amplitude, +amplitude].
struct ForgeValueRange {
  float center = 0.0f;
  float amplitude = 0.0f;
};
ForgeValueRange forge_value_range(std::string_view name, uint64_t ne0);

// Writes into `out` the bytes [byte_offset, byte_offset + out.size()) of tensor `t` (only its
// name, type, n_dims and ne are used) as expert-forge wrote them with `seed`. Errors when the
// range runs past the tensor or the type is not supported. A hash-routing table needs the
// model's `expert_count` (an error when it is 0); every other tensor ignores it.
Status forge_expected_bytes(uint64_t seed, const GgufTensorInfo& t, uint64_t byte_offset,
                            std::span<uint8_t> out, uint32_t expert_count = 0);

}  // namespace expertd
