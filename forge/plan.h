// What expert-forge writes: the checked configuration of a synthetic llama.cpp `qwen3moe`,
// `deepseek4`, Mixtral (`llama` with routed experts), DeepSeek-V3 (`deepseek2`), gpt-oss or GLM-4.5
// (`glm4moe`) model and, from
// it, one GgufWriter per shard holding the model's metadata and tensor infos (llama.cpp's names,
// types and shapes). The tensor data comes from forge/content.h.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "engine/family.h"
#include "expertd/result.h"
#include "storage/ggml_types.h"
#include "storage/gguf_writer.h"

namespace expertd {

// The families the forge writes; their names are the registry's (engine/family.h).
enum class ForgeArch : uint8_t { Qwen3Moe, Deepseek4, Mixtral, Deepseek3, GptOss, Glm4Moe };
inline constexpr ForgeArch kForgeArchs[] = {ForgeArch::Qwen3Moe, ForgeArch::Deepseek4,
                                            ForgeArch::Mixtral,  ForgeArch::Deepseek3,
                                            ForgeArch::GptOss,   ForgeArch::Glm4Moe};
engine::Family forge_family(ForgeArch arch);
// The family's short name (--arch): its registry alias, else its architecture.
std::string_view forge_arch_name(ForgeArch arch);
// general.architecture (the registry's arch: Mixtral's is `llama`, DeepSeek-V3's `deepseek2`).
std::string_view forge_gguf_arch(ForgeArch arch);
// --arch: a short name or an architecture.
Result<ForgeArch> parse_forge_arch(std::string_view value);
// "qwen3moe (Qwen3-MoE), mixtral (Mixtral, llama.cpp's llama), ..." for --help and errors.
std::string forge_arch_names();

// deepseek4's compressed-attention ratios per block (0 sliding window only, 4 CSA with the
// indexer, 128 HCA).
inline constexpr int32_t kDs4RatioSliding = 0;
inline constexpr int32_t kDs4RatioCsa = 4;
inline constexpr int32_t kDs4RatioHca = 128;

// The defaults below are qwen3moe's; forge_defaults(Deepseek4) gives DeepseekV4Config's,
// forge_defaults(Mixtral) Mixtral-8x7B's, forge_defaults(GptOss) gpt-oss-120b's,
// forge_defaults(Glm4Moe) GLM-4.5-Air's.
struct ForgeConfig {
  ForgeArch arch = ForgeArch::Qwen3Moe;
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

  // deepseek4 only (kv_heads must be 1: one shared KV head; head_dim is key and value length).
  uint32_t q_lora_rank = 1024;
  uint32_t o_groups = 8;
  uint32_t o_lora_rank = 1024;
  uint32_t rope_dim = 64;
  uint32_t window = 128;  // sliding window (gpt-oss's too: its even layers)
  uint32_t index_heads = 64;
  uint32_t index_head_dim = 128;
  uint32_t index_topk = 512;
  uint32_t hash_layers = 3;  // blocks 0 .. hash_layers-1 route by token id (ffn_gate_tid2eid)
  uint32_t hc_mult = 4;      // hyper-connection streams
  uint32_t shared_experts = 1;
  uint32_t nextn = 0;  // MTP blocks after the `layers` main ones (glm4moe's too)
  // One per block (layers + nextn); empty: deepseek4_default_compress_ratios.
  std::vector<int32_t> compress_ratios;

  // deepseek3 only (kv_heads must be 1: MLA's one latent; head_dim is the query/key head, qk_nope
  // + rope_dim; q_lora_rank, rope_dim and shared_experts above apply too).
  uint32_t kv_lora_rank = 512;
  uint32_t v_head_dim = 128;
  uint32_t dense_layers = 3;  // leading blocks with a dense MLP instead of experts
  uint64_t dense_ff = 18432;  // their MLP width
  uint32_t expert_groups = 8;
  uint32_t groups_used = 4;  // groups the top-k is chosen from

  // glm4moe: the DeepSeek-V3 MoE fields above (dense_layers, dense_ff, shared_experts,
  // expert_groups, groups_used) and rope_dim (partial RoPE) and nextn apply, with GLM's own
  // defaults; kv_heads is free (GQA) and head_dim is key and value length.
  bool qk_norm = false;  // GLM-4.5's per-head q/k norms (GLM-4.5-Air has none)
};

// The defaults of `arch`: qwen3moe's as above; deepseek4's those of transformers'
// DeepseekV4Config (256 experts, top 6, embd 4096, ff 2048, 64 heads of 512, one KV head) with
// the q8_0 dense type of llama.cpp's converter; mixtral's Mixtral-8x7B's (8 experts, top 2, embd
// 4096, ff 14336, 32 heads of 128, 8 KV heads); deepseek3's DeepSeek-V3's (256 experts in 8
// groups, top 8 from 4 groups, embd 7168, ff 2048, 128 heads of 128 + 64 rope, q LoRA 1536,
// kv LoRA 512, 3 dense layers of 18432); gpt-oss's gpt-oss-120b's (128 experts, top 4, embd 2880,
// ff 2880, 64 heads of 64, 8 KV heads); glm4moe's GLM-4.5-Air's (128 experts, top 8, embd 4096,
// ff 1408, 96 heads of 128 with 8 KV heads and 64 rotary dimensions, one dense layer of 10944, one
// shared expert, one expert group, one MTP block, no q/k norms). Layers, vocab, context and the
// rest are shared.
ForgeConfig forge_defaults(ForgeArch arch);

// transformers' default schedule: blocks 0 and 1 HCA, then CSA and HCA alternating from block 2
// on (block i >= 2 is CSA when i - 2 is odd); the `nextn` MTP blocks after them sliding only.
std::vector<int32_t> deepseek4_default_compress_ratios(uint32_t layers, uint32_t nextn);

// Parses --compress-ratios: comma-separated, each 0, 4 or 128.
Result<std::vector<int32_t>> parse_compress_ratios(std::string_view value);

// The compress ratios the model gets: config.compress_ratios, or the default schedule.
std::vector<int32_t> forge_compress_ratios(const ForgeConfig& config);

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
// shard ends with output_norm and output (after output_hc_* for deepseek4). Every shard of a split
// model carries split.no, split.count and split.tensors.count, and every shard carries the forge
// seed and version.
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
