// What expert-forge writes: the checked configuration of a synthetic llama.cpp `qwen3moe` model
// and, from it, one GgufWriter per shard holding the model's metadata and tensor infos. The
// tensor data comes from forge/content.h.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "expertd/result.h"
#include "storage/ggml_types.h"
#include "storage/gguf_writer.h"

namespace expertd {

struct ForgeConfig {
  uint32_t layers = 4;
  uint32_t experts = 8;
  uint32_t top_k = 2;
  uint64_t embd = 256;
  uint64_t ff = 512;  // per expert
  uint32_t heads = 8;
  uint32_t kv_heads = 4;
  uint64_t head_dim = 32;
  uint64_t vocab = 1024;
  uint32_t context = 4096;
  GgmlType expert_type = GgmlType::Q8_0;
  GgmlType dense_type = GgmlType::F16;
  uint64_t alignment = 32;
  uint32_t split = 1;
  uint64_t seed = 1;
  std::string name;    // general.name; a description of the shape when empty
  std::string output;  // -o: the file, or the base of the shard names when split > 1
};

// The types the forge offers on its command line, in the order its help lists them.
std::string_view forge_type_names();  // "f32, f16, bf16, q8_0, q4_0, q4_k, q6_k, mxfp4"
// Parses a --expert-type / --dense-type value; the error names the flag and the value.
Result<GgmlType> parse_forge_type(std::string_view flag, std::string_view value);

// Checks every field against the others; the error names the flag and its value, e.g.
// "--embd 100: must be a multiple of 32, the q8_0 block size (--expert-type)".
Status validate_forge_config(const ForgeConfig& config);

// The output files: `output` itself, or NAME-00001-of-0000N.gguf ... for split N where NAME is
// `output` without its .gguf suffix.
std::vector<std::string> forge_shard_paths(const ForgeConfig& config);

struct ForgeShard {
  std::string path;
  GgufWriter writer;  // metadata and tensor infos set; nothing written yet
};

// The shards of the model (config must be valid): shard 1 holds the model metadata, the
// tokenizer and token_embd; layers are spread over the shards in contiguous groups; the last
// shard ends with output_norm and output. Every shard of a split model carries split.no,
// split.count and split.tensors.count, and every shard carries the forge seed and version.
Result<std::vector<ForgeShard>> plan_forge_model(const ForgeConfig& config);

// The byte-level GPT-2 tokenizer the forge writes: 256 byte tokens in GPT-2 order, synthetic
// merged tokens (each with its merge), then <|endoftext|> (bos) and <|im_end|> (eos) as control
// tokens. Exposed for tests.
struct ForgeVocab {
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  std::vector<std::string> merges;
  int32_t bos = 0;
  int32_t eos = 0;
};
ForgeVocab make_forge_vocab(uint64_t vocab_size);

}  // namespace expertd
