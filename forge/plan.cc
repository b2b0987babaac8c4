#include "forge/plan.h"

#include <fmt/format.h>

#include <array>
#include <unordered_set>
#include <utility>

#include "base/check.h"
#include "forge/content.h"

namespace expertd {
namespace {

constexpr std::array<GgmlType, 8> kForgeTypes = {GgmlType::F32,  GgmlType::F16,  GgmlType::BF16,
                                                 GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_K,
                                                 GgmlType::Q6_K, GgmlType::MXFP4};

// Bounds that keep every product below 2^63 and every count inside what GgufFile accepts.
constexpr uint64_t kMaxDim = 1u << 20;
constexpr uint64_t kMaxVocab = 1u << 24;
constexpr uint64_t kMinVocab = 258;  // 256 byte tokens + 2 control tokens
constexpr uint32_t kMaxShards = 99999;

Error flag_error(std::string_view flag, auto value, std::string_view what) {
  return make_error(EINVAL, fmt::format("{} {}: {}", flag, value, what));
}

Status check_range(std::string_view flag, uint64_t v, uint64_t lo, uint64_t hi) {
  if (v < lo || v > hi)
    return flag_error(flag, v, fmt::format("must be between {} and {}", lo, hi));
  return Ok{};
}

uint32_t block_elems(GgmlType t) { return ggml_traits(t).block_elems; }

Status check_block(std::string_view what, uint64_t n, GgmlType type, std::string_view type_flag,
                   std::string_view why) {
  const uint32_t b = block_elems(type);
  if (n % b == 0) return Ok{};
  return make_error(EINVAL, fmt::format("{}: must be a multiple of {}, the {} block size ({}{})",
                                        what, b, ggml_type_name(type), type_flag, why));
}

// llama.cpp's general.file_type (enum llama_ftype) for a model whose experts are `t`.
uint32_t llama_file_type(GgmlType t) {
  switch (t) {
    case GgmlType::F32:
      return 0;
    case GgmlType::F16:
      return 1;
    case GgmlType::Q4_0:
      return 2;
    case GgmlType::Q8_0:
      return 7;
    case GgmlType::Q4_K:
      return 15;  // Q4_K_M
    case GgmlType::Q6_K:
      return 18;
    case GgmlType::MXFP4:
      return 38;  // MXFP4_MOE
    case GgmlType::BF16:
      return 32;
    default:
      return 0;
  }
}

// GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others for code points
// from U+0100 on. Returns, in GPT-2 token order, each token's byte and its code point.
std::array<std::pair<uint8_t, uint32_t>, 256> gpt2_byte_tokens() {
  std::array<std::pair<uint8_t, uint32_t>, 256> out{};
  std::array<bool, 256> printable{};
  size_t n = 0;
  for (uint32_t b = 0; b < 256; ++b) {
    printable[b] = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
    if (printable[b]) out[n++] = {static_cast<uint8_t>(b), b};
  }
  uint32_t extra = 0;
  for (uint32_t b = 0; b < 256; ++b) {
    if (!printable[b]) out[n++] = {static_cast<uint8_t>(b), 256 + extra++};
  }
  return out;
}

std::string utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xc0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    s += static_cast<char>(0xe0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    s += static_cast<char>(0x80 | (cp & 0x3f));
  }
  return s;
}

uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

Status validate_deepseek4(const ForgeConfig& c) {
  EXPERTD_TRY(check_range("--q-lora-rank", c.q_lora_rank, 1, kMaxDim));
  EXPERTD_TRY(check_range("--o-groups", c.o_groups, 1, 4096));
  EXPERTD_TRY(check_range("--o-lora-rank", c.o_lora_rank, 1, kMaxDim));
  EXPERTD_TRY(check_range("--window", c.window, 1, 1u << 24));
  EXPERTD_TRY(check_range("--index-heads", c.index_heads, 1, 4096));
  EXPERTD_TRY(check_range("--index-head-dim", c.index_head_dim, 2, 4096));
  EXPERTD_TRY(check_range("--index-topk", c.index_topk, 1, 1u << 24));
  EXPERTD_TRY(check_range("--hash-layers", c.hash_layers, 0, c.layers));
  EXPERTD_TRY(check_range("--hc-mult", c.hc_mult, 1, 64));
  EXPERTD_TRY(check_range("--shared-experts", c.shared_experts, 1, 64));
  EXPERTD_TRY(check_range("--nextn", c.nextn, 0, 16));
  const uint64_t q_dim = uint64_t{c.heads} * c.head_dim;
  if (q_dim % c.o_groups != 0) {
    return flag_error("--o-groups", c.o_groups,
                      fmt::format("must divide --heads x --head-dim ({})", q_dim));
  }
  if (c.rope_dim < 2 || c.rope_dim % 2 != 0 || c.rope_dim > c.head_dim ||
      c.rope_dim > c.index_head_dim) {
    return flag_error("--rope-dim", c.rope_dim,
                      fmt::format("must be even, at least 2 and at most --head-dim ({}) and "
                                  "--index-head-dim ({})",
                                  c.head_dim, c.index_head_dim));
  }
  const uint64_t blocks = uint64_t{c.layers} + c.nextn;
  if (!c.compress_ratios.empty() && c.compress_ratios.size() != blocks) {
    return make_error(EINVAL, fmt::format("--compress-ratios: {} values for {} blocks (--layers "
                                          "{} + --nextn {}); give one per block",
                                          c.compress_ratios.size(), blocks, c.layers, c.nextn));
  }
  // Row lengths (ne0) of the dense tensors, each a whole number of --dense-type blocks.
  const std::string why = "; it is a row length of the attention and shared-expert tensors";
  EXPERTD_TRY(
      check_block(fmt::format("--embd {}", c.embd), c.embd, c.dense_type, "--dense-type", why));
  EXPERTD_TRY(check_block(fmt::format("--q-lora-rank {}", c.q_lora_rank), c.q_lora_rank,
                          c.dense_type, "--dense-type", "; attn_q_b rows are q-lora-rank long"));
  EXPERTD_TRY(check_block(fmt::format("--heads {} x --head-dim {} / --o-groups {} = {}", c.heads,
                                      c.head_dim, c.o_groups, q_dim / c.o_groups),
                          q_dim / c.o_groups, c.dense_type, "--dense-type",
                          "; attn_output_a rows are that long"));
  const uint64_t wo_b = uint64_t{c.o_groups} * c.o_lora_rank;
  EXPERTD_TRY(check_block(
      fmt::format("--o-groups {} x --o-lora-rank {} = {}", c.o_groups, c.o_lora_rank, wo_b), wo_b,
      c.dense_type, "--dense-type", "; attn_output_b rows are that long"));
  const uint64_t shexp = c.ff * c.shared_experts;
  return check_block(
      fmt::format("--ff {} x --shared-experts {} = {}", c.ff, c.shared_experts, shexp), shexp,
      c.dense_type, "--dense-type", "; ffn_down_shexp rows are that long");
}

// Each (what, row length) of the dense tensors a whole number of --dense-type blocks (0: absent).
Status check_dense_rows(const ForgeConfig& c,
                        const std::vector<std::pair<std::string, uint64_t>>& rows) {
  for (const auto& [what, n] : rows) {
    if (n == 0) continue;
    EXPERTD_TRY(check_block(what, n, c.dense_type, "--dense-type",
                            "; it is a row length of the attention or dense MLP tensors"));
  }
  return Ok{};
}

// DeepSeek-V3's MoE block, which GLM-4.5 shares: dense layers, shared experts, expert groups.
Status validate_sigmoid_moe(const ForgeConfig& c) {
  EXPERTD_TRY(check_range("--shared-experts", c.shared_experts, 0, 64));
  EXPERTD_TRY(check_range("--dense-ff", c.dense_ff, 1, kMaxDim));
  if (c.dense_layers >= c.layers) {
    return flag_error(
        "--dense-layers", c.dense_layers,
        fmt::format("must be below --layers ({}): at least one layer has experts", c.layers));
  }
  if (c.expert_groups < 1 || c.experts % c.expert_groups != 0) {
    return flag_error("--expert-groups", c.expert_groups,
                      fmt::format("must divide --experts ({})", c.experts));
  }
  const uint64_t per_group = c.experts / c.expert_groups;
  if (c.groups_used < 1 || c.groups_used > c.expert_groups || c.groups_used * per_group < c.top_k) {
    return flag_error("--groups-used", c.groups_used,
                      fmt::format("must be between 1 and --expert-groups ({}) and hold --top-k "
                                  "({}) experts of {} per group",
                                  c.expert_groups, c.top_k, per_group));
  }
  return Ok{};
}

Status validate_deepseek3(const ForgeConfig& c) {
  EXPERTD_TRY(check_range("--q-lora-rank", c.q_lora_rank, 1, kMaxDim));
  EXPERTD_TRY(check_range("--kv-lora-rank", c.kv_lora_rank, 1, kMaxDim));
  EXPERTD_TRY(check_range("--v-head-dim", c.v_head_dim, 1, 4096));
  EXPERTD_TRY(validate_sigmoid_moe(c));
  if (c.rope_dim < 2 || c.rope_dim % 2 != 0 || c.rope_dim >= c.head_dim) {
    return flag_error(
        "--rope-dim", c.rope_dim,
        fmt::format("must be even, at least 2 and below --head-dim ({})", c.head_dim));
  }
  // Row lengths (ne0) of the dense tensors, each a whole number of --dense-type blocks.
  const uint64_t nope = c.head_dim - c.rope_dim;
  const uint64_t v_dim = uint64_t{c.heads} * c.v_head_dim;
  const uint64_t shexp = c.ff * c.shared_experts;
  const std::vector<std::pair<std::string, uint64_t>> rows = {
      {fmt::format("--embd {}", c.embd), c.embd},
      {fmt::format("--q-lora-rank {}", c.q_lora_rank), c.q_lora_rank},
      {fmt::format("--head-dim {} - --rope-dim {} = {}", c.head_dim, c.rope_dim, nope), nope},
      {fmt::format("--kv-lora-rank {}", c.kv_lora_rank), c.kv_lora_rank},
      {fmt::format("--heads {} x --v-head-dim {} = {}", c.heads, c.v_head_dim, v_dim), v_dim},
      {fmt::format("--dense-ff {}", c.dense_ff), c.dense_ff},
      {fmt::format("--ff {} x --shared-experts {} = {}", c.ff, c.shared_experts, shexp), shexp},
  };
  return check_dense_rows(c, rows);
}

Status validate_glm4moe(const ForgeConfig& c) {
  EXPERTD_TRY(validate_sigmoid_moe(c));
  EXPERTD_TRY(check_range("--nextn", c.nextn, 0, 16));
  if (c.rope_dim < 2 || c.rope_dim % 2 != 0 || c.rope_dim > c.head_dim) {
    return flag_error(
        "--rope-dim", c.rope_dim,
        fmt::format("must be even, at least 2 and at most --head-dim ({})", c.head_dim));
  }
  // Row lengths (ne0) of the dense tensors, each a whole number of --dense-type blocks.
  const uint64_t q_dim = uint64_t{c.heads} * c.head_dim;
  const uint64_t shexp = c.ff * c.shared_experts;
  const std::vector<std::pair<std::string, uint64_t>> rows = {
      {fmt::format("--embd {}", c.embd), c.embd},
      {fmt::format("--heads {} x --head-dim {} = {}", c.heads, c.head_dim, q_dim), q_dim},
      {fmt::format("--dense-ff {}", c.dense_ff), c.dense_ff},
      {fmt::format("--ff {} x --shared-experts {} = {}", c.ff, c.shared_experts, shexp), shexp},
  };
  return check_dense_rows(c, rows);
}

// Blocks in the file: the main layers and, for the families that have them, the MTP blocks.
uint32_t forge_blocks(const ForgeConfig& c) {
  const bool mtp = c.arch == ForgeArch::Deepseek4 || c.arch == ForgeArch::Glm4Moe;
  return c.layers + (mtp ? c.nextn : 0);
}

}  // namespace

std::string_view forge_type_names() { return "f32, f16, bf16, q8_0, q4_0, q4_k, q6_k, mxfp4"; }

engine::Family forge_family(ForgeArch arch) {
  switch (arch) {
    case ForgeArch::Qwen3Moe:
      return engine::Family::Qwen3Moe;
    case ForgeArch::Deepseek4:
      return engine::Family::DeepSeek4;
    case ForgeArch::Mixtral:
      return engine::Family::Mixtral;
    case ForgeArch::Deepseek3:
      return engine::Family::DeepSeek3;
    case ForgeArch::GptOss:
      return engine::Family::GptOss;
    case ForgeArch::Glm4Moe:
      return engine::Family::Glm4Moe;
  }
  return engine::Family::Qwen3Moe;  // unreachable: -Wswitch
}

std::string_view forge_arch_name(ForgeArch arch) {
  return engine::short_name(engine::family_info(forge_family(arch)));
}

std::string_view forge_gguf_arch(ForgeArch arch) {
  return engine::family_info(forge_family(arch)).arch;
}

Result<ForgeArch> parse_forge_arch(std::string_view value) {
  for (const ForgeArch a : kForgeArchs) {
    const engine::FamilyInfo& f = engine::family_info(forge_family(a));
    if (value == f.arch || value == engine::short_name(f)) return a;
  }
  std::string names;
  for (size_t i = 0; i < std::size(kForgeArchs); ++i) {
    if (i > 0) names += i + 1 == std::size(kForgeArchs) ? " or " : ", ";
    names += forge_arch_name(kForgeArchs[i]);
  }
  return flag_error("--arch", value, "must be " + names);
}

std::string forge_arch_names() {
  std::string out;
  for (const ForgeArch a : kForgeArchs) {
    const engine::FamilyInfo& f = engine::family_info(forge_family(a));
    if (!out.empty()) out += ", ";
    out += engine::short_name(f);
    std::string note = f.name == engine::short_name(f) ? "" : std::string(f.name);
    if (!f.alias.empty()) note += fmt::format("{}llama.cpp's {}", note.empty() ? "" : ", ", f.arch);
    if (!note.empty()) out += " (" + note + ")";
  }
  return out;
}

ForgeConfig forge_defaults(ForgeArch arch) {
  ForgeConfig c;
  c.arch = arch;
  if (arch == ForgeArch::Deepseek4) {
    c.experts = 256;
    c.top_k = 6;
    c.embd = 4096;
    c.ff = 2048;
    c.heads = 64;
    c.kv_heads = 1;
    c.head_dim = 512;
    c.dense_type = GgmlType::Q8_0;
  } else if (arch == ForgeArch::Mixtral) {
    c.embd = 4096;
    c.ff = 14336;
    c.heads = 32;
    c.kv_heads = 8;
    c.head_dim = 128;
  } else if (arch == ForgeArch::GptOss) {
    c.experts = 128;
    c.top_k = 4;
    c.embd = 2880;
    c.ff = 2880;
    c.heads = 64;
    c.kv_heads = 8;
    c.head_dim = 64;
  }
  if (arch == ForgeArch::Deepseek3) {
    c.experts = 256;
    c.top_k = 8;
    c.embd = 7168;
    c.ff = 2048;
    c.heads = 128;
    c.kv_heads = 1;
    c.head_dim = 192;
    c.q_lora_rank = 1536;
    c.rope_dim = 64;
    c.dense_type = GgmlType::Q8_0;
  }
  if (arch == ForgeArch::Glm4Moe) {  // GLM-4.5-Air (zai-org/GLM-4.5-Air's config.json)
    c.experts = 128;
    c.top_k = 8;
    c.embd = 4096;
    c.ff = 1408;
    c.heads = 96;
    c.kv_heads = 8;
    c.head_dim = 128;
    c.rope_dim = 64;  // partial_rotary_factor 0.5
    c.dense_layers = 1;
    c.dense_ff = 10944;
    c.shared_experts = 1;
    c.expert_groups = 1;
    c.groups_used = 1;
    c.nextn = 1;
  }
  return c;
}

std::vector<int32_t> deepseek4_default_compress_ratios(uint32_t layers, uint32_t nextn) {
  std::vector<int32_t> r;
  r.reserve(uint64_t{layers} + nextn);
  for (uint32_t i = 0; i < layers; ++i) {
    r.push_back(i >= 2 && (i - 2) % 2 == 1 ? kDs4RatioCsa : kDs4RatioHca);
  }
  for (uint32_t i = 0; i < nextn; ++i) r.push_back(kDs4RatioSliding);
  return r;
}

Result<std::vector<int32_t>> parse_compress_ratios(std::string_view value) {
  std::vector<int32_t> out;
  size_t start = 0;
  while (start <= value.size()) {
    const size_t comma = std::min(value.find(',', start), value.size());
    const std::string_view item = value.substr(start, comma - start);
    if (item == "0" || item == "4" || item == "128") {
      out.push_back(item == "0" ? kDs4RatioSliding : item == "4" ? kDs4RatioCsa : kDs4RatioHca);
    } else {
      return flag_error("--compress-ratios", value,
                        fmt::format("'{}' is not 0, 4 or 128 (a comma-separated list, one per "
                                    "block)",
                                    item));
    }
    start = comma + 1;
  }
  return out;
}

std::vector<int32_t> forge_compress_ratios(const ForgeConfig& c) {
  if (!c.compress_ratios.empty()) return c.compress_ratios;
  return deepseek4_default_compress_ratios(c.layers, c.nextn);
}

Result<GgmlType> parse_forge_type(std::string_view flag, std::string_view value) {
  const auto t = ggml_type_from_name(value);
  if (t) {
    for (const GgmlType f : kForgeTypes) {
      if (f == *t) return *t;
    }
  }
  return flag_error(flag, value, fmt::format("must be one of {}", forge_type_names()));
}

Status validate_forge_config(const ForgeConfig& c) {
  EXPERTD_TRY(check_range("--layers", c.layers, 1, 4096));
  EXPERTD_TRY(check_range("--experts", c.experts, 1, 1u << 16));
  if (c.top_k < 1 || c.top_k > c.experts) {
    return flag_error("--top-k", c.top_k,
                      fmt::format("must be between 1 and --experts ({})", c.experts));
  }
  EXPERTD_TRY(check_range("--embd", c.embd, 1, kMaxDim));
  EXPERTD_TRY(check_range("--ff", c.ff, 1, kMaxDim));
  EXPERTD_TRY(check_range("--heads", c.heads, 1, 4096));
  EXPERTD_TRY(check_range("--kv-heads", c.kv_heads, 1, 4096));
  if (c.arch == ForgeArch::Deepseek4 && c.kv_heads != 1) {
    return flag_error(
        "--kv-heads", c.kv_heads,
        fmt::format("must be 1 for {} (one shared KV head)", forge_arch_name(c.arch)));
  }
  if (c.arch == ForgeArch::Deepseek3 && c.kv_heads != 1) {
    return flag_error(
        "--kv-heads", c.kv_heads,
        fmt::format("must be 1 for {} (one latent KV head)", forge_arch_name(c.arch)));
  }
  if (c.heads % c.kv_heads != 0) {
    return flag_error("--heads", c.heads,
                      fmt::format("must be a multiple of --kv-heads ({})", c.kv_heads));
  }
  EXPERTD_TRY(check_range("--head-dim", c.head_dim, 2, 4096));
  if (c.head_dim % 2 != 0) {
    return flag_error("--head-dim", c.head_dim, "must be even (RoPE rotates pairs)");
  }
  if (c.vocab < kMinVocab || c.vocab > kMaxVocab) {
    return flag_error("--vocab", c.vocab,
                      fmt::format("must be between {} (256 byte tokens and 2 control tokens) and "
                                  "{}",
                                  kMinVocab, kMaxVocab));
  }
  EXPERTD_TRY(check_range("--context", c.context, 1, 1u << 24));
  if (!forge_supports_type(c.expert_type)) {
    return flag_error("--expert-type", ggml_type_name(c.expert_type),
                      fmt::format("must be one of {}", forge_type_names()));
  }
  if (!forge_supports_type(c.dense_type)) {
    return flag_error("--dense-type", ggml_type_name(c.dense_type),
                      fmt::format("must be one of {}", forge_type_names()));
  }
  if (c.alignment < 1 || c.alignment > (1u << 30) || (c.alignment & (c.alignment - 1)) != 0) {
    return flag_error("--alignment", c.alignment, "must be a power of two from 1 to 1073741824");
  }
  const uint32_t blocks = forge_blocks(c);
  if (c.split < 1 || c.split > blocks || c.split > kMaxShards) {
    return flag_error("--split", c.split,
                      fmt::format("must be between 1 and --layers ({}): every shard holds at "
                                  "least one layer",
                                  blocks));
  }
  if (c.output.empty()) return make_error(EINVAL, "-o: an output path is required");

  // Every tensor's ne0 must be a whole number of blocks of its type.
  const std::string embd = fmt::format("--embd {}", c.embd);
  EXPERTD_TRY(check_block(embd, c.embd, c.expert_type, "--expert-type",
                          "; ffn_gate_exps and ffn_up_exps rows are embd long"));
  EXPERTD_TRY(check_block(fmt::format("--ff {}", c.ff), c.ff, c.expert_type, "--expert-type",
                          "; ffn_down_exps rows are ff long"));
  if (c.arch == ForgeArch::Deepseek4) return validate_deepseek4(c);
  if (c.arch == ForgeArch::Deepseek3) return validate_deepseek3(c);
  if (c.arch == ForgeArch::Glm4Moe) return validate_glm4moe(c);
  EXPERTD_TRY(check_block(embd, c.embd, c.dense_type, "--dense-type",
                          "; token_embd and attn_q/k/v rows are embd long"));
  const uint64_t q_dim = uint64_t{c.heads} * c.head_dim;
  EXPERTD_TRY(
      check_block(fmt::format("--heads {} x --head-dim {} = {}", c.heads, c.head_dim, q_dim), q_dim,
                  c.dense_type, "--dense-type", "; attn_output rows are heads x head-dim long"));
  return Ok{};
}

std::vector<std::string> forge_shard_paths(const ForgeConfig& c) {
  if (c.split <= 1) return {c.output};
  std::string prefix = c.output;
  constexpr std::string_view kExt = ".gguf";
  if (prefix.size() > kExt.size() && prefix.ends_with(kExt)) {
    prefix.resize(prefix.size() - kExt.size());
  }
  std::vector<std::string> paths;
  for (uint32_t i = 1; i <= c.split; ++i) paths.push_back(split_path(prefix, i, c.split));
  return paths;
}

ForgeVocab make_forge_vocab(uint64_t vocab_size) {
  EXPERTD_CHECK_GE(vocab_size, kMinVocab);
  ForgeVocab v;
  v.tokens.reserve(vocab_size);
  std::unordered_set<std::string> seen;
  for (const auto& [byte, cp] : gpt2_byte_tokens()) {
    v.tokens.push_back(utf8(cp));
    seen.insert(v.tokens.back());
  }
  // Synthetic tokens merge two earlier tokens into word-like pieces: a left part from the
  // lower-case letters, U+0120 (the byte-level space) and earlier merges; a right part from the
  // letters and earlier merges that do not start with a space. Each comes with its merge, so
  // llama.cpp's BPE both decodes and re-encodes them.
  const std::string space = utf8(256 + 32);
  std::vector<int32_t> left;
  std::vector<int32_t> right;
  for (int32_t id = 0; id < 256; ++id) {
    const std::string& t = v.tokens[id];
    const bool letter = t.size() == 1 && t[0] >= 'a' && t[0] <= 'z';
    if (letter) right.push_back(id);
    if (letter || t == space) left.push_back(id);
  }
  const uint64_t synthetic_end = vocab_size - 2;
  for (uint64_t id = 256; id < synthetic_end; ++id) {
    std::string tok;
    for (uint64_t attempt = 0; attempt < 64 && tok.empty(); ++attempt) {
      const uint64_t h = mix64(id * 0x9e3779b97f4a7c15ull + attempt);
      const int32_t a = left[(h & 0xffffffffu) % left.size()];
      const int32_t b = right[(h >> 32) % right.size()];
      std::string cand = v.tokens[a] + v.tokens[b];
      if (cand.size() > 24 || seen.count(cand) != 0) continue;
      tok = std::move(cand);
      v.merges.push_back(v.tokens[a] + " " + v.tokens[b]);
    }
    const bool merged = !tok.empty();
    if (!merged) tok = fmt::format("<forge_{}>", id);  // unreachable in practice; stays unique
    seen.insert(tok);
    v.tokens.push_back(tok);
    const auto new_id = static_cast<int32_t>(id);
    if (merged) {
      left.push_back(new_id);
      if (!tok.starts_with(space)) right.push_back(new_id);
    }
  }
  v.types.assign(vocab_size, 1);  // LLAMA_TOKEN_TYPE_NORMAL
  v.bos = static_cast<int32_t>(vocab_size - 2);
  v.eos = static_cast<int32_t>(vocab_size - 1);
  v.tokens.push_back("<|endoftext|>");
  v.tokens.push_back("<|im_end|>");
  v.types[v.bos] = 3;  // LLAMA_TOKEN_TYPE_CONTROL
  v.types[v.eos] = 3;
  return v;
}

namespace {

// A tensor the plan adds: llama.cpp's name, the type, ne (ne[0] the row length).
struct TensorSpec {
  std::string name;
  GgmlType type;
  std::vector<uint64_t> ne;
};
using TensorList = std::vector<TensorSpec>;

std::string blk(uint32_t l, std::string_view t, std::string_view suffix = "weight") {
  return fmt::format("blk.{}.{}.{}", l, t, suffix);
}

// llama.cpp's qwen3moe block l; Mixtral's (`llama` with experts) is the same without the per-head
// q/k norms; gpt-oss's (openai-moe) also, with the post-attention norm in place of ffn_norm and
// then, f32 as the converter keeps them, biases on the projections, router and experts and the
// attention sinks.
void qwen3moe_layer(const ForgeConfig& c, uint32_t l, TensorList& out) {
  const uint64_t q_dim = uint64_t{c.heads} * c.head_dim;
  const uint64_t kv_dim = uint64_t{c.kv_heads} * c.head_dim;
  const GgmlType dense = c.dense_type;
  const GgmlType experts = c.expert_type;
  constexpr GgmlType f32 = GgmlType::F32;
  out.push_back({blk(l, "attn_norm"), f32, {c.embd}});
  out.push_back({blk(l, "attn_q"), dense, {c.embd, q_dim}});
  out.push_back({blk(l, "attn_k"), dense, {c.embd, kv_dim}});
  out.push_back({blk(l, "attn_v"), dense, {c.embd, kv_dim}});
  out.push_back({blk(l, "attn_output"), dense, {q_dim, c.embd}});
  if (c.arch == ForgeArch::Qwen3Moe) {
    out.push_back({blk(l, "attn_q_norm"), f32, {c.head_dim}});
    out.push_back({blk(l, "attn_k_norm"), f32, {c.head_dim}});
  }
  const bool gptoss = c.arch == ForgeArch::GptOss;
  out.push_back({blk(l, gptoss ? "post_attention_norm" : "ffn_norm"), f32, {c.embd}});
  out.push_back({blk(l, "ffn_gate_inp"), f32, {c.embd, c.experts}});
  out.push_back({blk(l, "ffn_gate_exps"), experts, {c.embd, c.ff, c.experts}});
  out.push_back({blk(l, "ffn_up_exps"), experts, {c.embd, c.ff, c.experts}});
  out.push_back({blk(l, "ffn_down_exps"), experts, {c.ff, c.embd, c.experts}});
  if (!gptoss) return;
  for (const auto& [name, n] : {std::pair<std::string_view, uint64_t>{"attn_q", q_dim},
                                {"attn_k", kv_dim},
                                {"attn_v", kv_dim},
                                {"attn_output", c.embd},
                                {"ffn_gate_inp", c.experts}}) {
    out.push_back({blk(l, name, "bias"), f32, {n}});
  }
  out.push_back({blk(l, "attn_sinks"), f32, {c.heads}});
  out.push_back({blk(l, "ffn_gate_exps", "bias"), f32, {c.ff, c.experts}});
  out.push_back({blk(l, "ffn_up_exps", "bias"), f32, {c.ff, c.experts}});
  out.push_back({blk(l, "ffn_down_exps", "bias"), f32, {c.embd, c.experts}});
}

// llama.cpp's deepseek4 load_arch_tensors, block l. Norms, hyper-connection, compressor position
// embeddings, sinks, the router and its bias are f32 (as the converter keeps them); the
// projections are --dense-type, the routed experts --expert-type.
void deepseek4_layer(const ForgeConfig& c, uint32_t l, int32_t ratio, TensorList& out) {
  const GgmlType dense = c.dense_type;
  const GgmlType experts = c.expert_type;
  constexpr GgmlType f32 = GgmlType::F32;
  const uint64_t q_dim = uint64_t{c.heads} * c.head_dim;
  const uint64_t hc_dim = uint64_t{c.hc_mult} * c.embd;
  const uint64_t hc_mix = (2 + uint64_t{c.hc_mult}) * c.hc_mult;
  const uint64_t shexp = c.ff * c.shared_experts;
  out.push_back({blk(l, "attn_norm"), f32, {c.embd}});
  out.push_back({blk(l, "attn_sinks"), f32, {c.heads}});
  out.push_back({blk(l, "attn_q_a"), dense, {c.embd, c.q_lora_rank}});
  out.push_back({blk(l, "attn_q_a_norm"), f32, {c.q_lora_rank}});
  out.push_back({blk(l, "attn_q_b"), dense, {c.q_lora_rank, q_dim}});
  out.push_back({blk(l, "attn_kv"), dense, {c.embd, c.head_dim}});
  out.push_back({blk(l, "attn_kv_a_norm"), f32, {c.head_dim}});
  out.push_back(
      {blk(l, "attn_output_a"), dense, {q_dim / c.o_groups, uint64_t{c.o_lora_rank} * c.o_groups}});
  out.push_back({blk(l, "attn_output_b"), dense, {uint64_t{c.o_groups} * c.o_lora_rank, c.embd}});
  if (ratio != kDs4RatioSliding) {
    const uint64_t coff = ratio == kDs4RatioCsa ? 2 : 1;  // CSA compresses overlapping windows
    out.push_back({blk(l, "attn_compressor_kv"), dense, {c.embd, coff * c.head_dim}});
    out.push_back({blk(l, "attn_compressor_gate"), dense, {c.embd, coff * c.head_dim}});
    out.push_back(
        {blk(l, "attn_compressor_ape"), f32, {coff * c.head_dim, static_cast<uint64_t>(ratio)}});
    out.push_back({blk(l, "attn_compressor_norm"), f32, {c.head_dim}});
  }
  if (ratio == kDs4RatioCsa) {
    const uint64_t idx = c.index_head_dim;
    out.push_back({blk(l, "indexer.proj"), dense, {c.embd, c.index_heads}});
    out.push_back({blk(l, "indexer.attn_q_b"), dense, {c.q_lora_rank, c.index_heads * idx}});
    out.push_back({blk(l, "indexer_compressor_kv"), dense, {c.embd, 2 * idx}});
    out.push_back({blk(l, "indexer_compressor_gate"), dense, {c.embd, 2 * idx}});
    out.push_back({blk(l, "indexer_compressor_ape"), f32, {2 * idx, static_cast<uint64_t>(ratio)}});
    out.push_back({blk(l, "indexer_compressor_norm"), f32, {idx}});
  }
  out.push_back({blk(l, "hc_attn_fn"), f32, {hc_dim, hc_mix}});
  out.push_back({blk(l, "hc_attn_base"), f32, {hc_mix}});
  out.push_back({blk(l, "hc_attn_scale"), f32, {3}});
  out.push_back({blk(l, "hc_ffn_fn"), f32, {hc_dim, hc_mix}});
  out.push_back({blk(l, "hc_ffn_base"), f32, {hc_mix}});
  out.push_back({blk(l, "hc_ffn_scale"), f32, {3}});
  out.push_back({blk(l, "ffn_norm"), f32, {c.embd}});
  out.push_back({blk(l, "ffn_gate_inp"), f32, {c.embd, c.experts}});
  if (l < c.hash_layers) {
    out.push_back({blk(l, "ffn_gate_tid2eid"), GgmlType::I32, {c.top_k, c.vocab}});
  } else {
    out.push_back({blk(l, "exp_probs_b", "bias"), f32, {c.experts}});
  }
  out.push_back({blk(l, "ffn_gate_exps"), experts, {c.embd, c.ff, c.experts}});
  out.push_back({blk(l, "ffn_up_exps"), experts, {c.embd, c.ff, c.experts}});
  out.push_back({blk(l, "ffn_down_exps"), experts, {c.ff, c.embd, c.experts}});
  out.push_back({blk(l, "ffn_gate_shexp"), dense, {c.embd, shexp}});
  out.push_back({blk(l, "ffn_up_shexp"), dense, {c.embd, shexp}});
  out.push_back({blk(l, "ffn_down_shexp"), dense, {shexp, c.embd}});
  if (l >= c.layers) {  // an MTP block
    out.push_back({blk(l, "nextn.eh_proj"), dense, {2 * c.embd, c.embd}});
    out.push_back({blk(l, "nextn.enorm"), f32, {c.embd}});
    out.push_back({blk(l, "nextn.hnorm"), f32, {c.embd}});
    out.push_back({blk(l, "nextn.shared_head_norm"), f32, {c.embd}});
  }
}

// The FFN half of DeepSeek-V3's block l, which GLM-4.5's shares: a dense MLP in the first
// dense_layers blocks, else the router, exp_probs_b, the routed experts and the shared experts.
void sigmoid_moe_ffn(const ForgeConfig& c, uint32_t l, TensorList& out) {
  const GgmlType dense = c.dense_type;
  const GgmlType experts = c.expert_type;
  constexpr GgmlType f32 = GgmlType::F32;
  const uint64_t shexp = c.ff * c.shared_experts;
  if (l < c.dense_layers) {
    out.push_back({blk(l, "ffn_gate"), dense, {c.embd, c.dense_ff}});
    out.push_back({blk(l, "ffn_down"), dense, {c.dense_ff, c.embd}});
    out.push_back({blk(l, "ffn_up"), dense, {c.embd, c.dense_ff}});
    return;
  }
  out.push_back({blk(l, "ffn_gate_inp"), f32, {c.embd, c.experts}});
  out.push_back({blk(l, "exp_probs_b", "bias"), f32, {c.experts}});
  out.push_back({blk(l, "ffn_gate_exps"), experts, {c.embd, c.ff, c.experts}});
  out.push_back({blk(l, "ffn_up_exps"), experts, {c.embd, c.ff, c.experts}});
  out.push_back({blk(l, "ffn_down_exps"), experts, {c.ff, c.embd, c.experts}});
  if (c.shared_experts > 0) {
    out.push_back({blk(l, "ffn_gate_shexp"), dense, {c.embd, shexp}});
    out.push_back({blk(l, "ffn_down_shexp"), dense, {shexp, c.embd}});
    out.push_back({blk(l, "ffn_up_shexp"), dense, {c.embd, shexp}});
  }
}

// llama.cpp's deepseek2 load_arch_tensors, block l, for the tensors its converter writes from a
// DeepSeek-V3 checkpoint (the absorbed-MLA split of kv_b into attn_k_b and attn_v_b).
void deepseek3_layer(const ForgeConfig& c, uint32_t l, TensorList& out) {
  const GgmlType dense = c.dense_type;
  constexpr GgmlType f32 = GgmlType::F32;
  const uint64_t q_dim = uint64_t{c.heads} * c.head_dim;
  const uint64_t nope = c.head_dim - c.rope_dim;
  out.push_back({blk(l, "attn_norm"), f32, {c.embd}});
  out.push_back({blk(l, "attn_q_a_norm"), f32, {c.q_lora_rank}});
  out.push_back({blk(l, "attn_kv_a_norm"), f32, {c.kv_lora_rank}});
  out.push_back({blk(l, "attn_q_a"), dense, {c.embd, c.q_lora_rank}});
  out.push_back({blk(l, "attn_q_b"), dense, {c.q_lora_rank, q_dim}});
  out.push_back({blk(l, "attn_kv_a_mqa"), dense, {c.embd, uint64_t{c.kv_lora_rank} + c.rope_dim}});
  out.push_back({blk(l, "attn_k_b"), dense, {nope, c.kv_lora_rank, c.heads}});
  out.push_back({blk(l, "attn_v_b"), dense, {c.kv_lora_rank, c.v_head_dim, c.heads}});
  out.push_back({blk(l, "attn_output"), dense, {uint64_t{c.heads} * c.v_head_dim, c.embd}});
  out.push_back({blk(l, "ffn_norm"), f32, {c.embd}});
  sigmoid_moe_ffn(c, l, out);
}

// llama.cpp's glm4moe block l as its converter writes GLM-4.5 (conversion/glm.py): q/k/v biases
// (f32), optional per-head q/k norms, the post-attention norm, a dense MLP in the first
// dense_layers blocks, else the router, exp_probs_b, the routed and shared experts; an MTP block
// (l >= layers) is a MoE block with its own projection and norms.
void glm4moe_layer(const ForgeConfig& c, uint32_t l, TensorList& out) {
  const GgmlType dense = c.dense_type;
  constexpr GgmlType f32 = GgmlType::F32;
  const uint64_t q_dim = uint64_t{c.heads} * c.head_dim;
  const uint64_t kv_dim = uint64_t{c.kv_heads} * c.head_dim;
  out.push_back({blk(l, "attn_norm"), f32, {c.embd}});
  out.push_back({blk(l, "attn_q"), dense, {c.embd, q_dim}});
  out.push_back({blk(l, "attn_q", "bias"), f32, {q_dim}});
  out.push_back({blk(l, "attn_k"), dense, {c.embd, kv_dim}});
  out.push_back({blk(l, "attn_k", "bias"), f32, {kv_dim}});
  out.push_back({blk(l, "attn_v"), dense, {c.embd, kv_dim}});
  out.push_back({blk(l, "attn_v", "bias"), f32, {kv_dim}});
  out.push_back({blk(l, "attn_output"), dense, {q_dim, c.embd}});
  if (c.qk_norm) {
    out.push_back({blk(l, "attn_q_norm"), f32, {c.head_dim}});
    out.push_back({blk(l, "attn_k_norm"), f32, {c.head_dim}});
  }
  out.push_back({blk(l, "post_attention_norm"), f32, {c.embd}});
  sigmoid_moe_ffn(c, l, out);
  if (l >= c.layers) {  // the MTP block
    out.push_back({blk(l, "nextn.eh_proj"), dense, {2 * c.embd, c.embd}});
    out.push_back({blk(l, "nextn.enorm"), f32, {c.embd}});
    out.push_back({blk(l, "nextn.hnorm"), f32, {c.embd}});
    out.push_back({blk(l, "nextn.shared_head_norm"), f32, {c.embd}});
  }
}

// The keys llama.cpp's converter writes for GLM-4.5 (conversion/glm.py and the base class), with
// GLM-4.5-Air's config where the forge has no flag (rope theta 1e6, rms eps 1e-5, routed scaling
// 1.0, norm_topk_prob true).
void set_glm4moe_metadata(const ForgeConfig& c, GgufWriter& meta) {
  auto key = [&c](std::string_view suffix) {
    return fmt::format("{}.{}", forge_gguf_arch(c.arch), suffix);
  };
  meta.set_u32(key("block_count"), c.layers + c.nextn);
  meta.set_u32(key("context_length"), c.context);
  meta.set_u32(key("embedding_length"), static_cast<uint32_t>(c.embd));
  meta.set_u32(key("feed_forward_length"), static_cast<uint32_t>(c.dense_ff));
  meta.set_u32(key("attention.head_count"), c.heads);
  meta.set_u32(key("attention.head_count_kv"), c.kv_heads);
  meta.set_f32(key("rope.freq_base"), 1e6f);
  meta.set_f32(key("attention.layer_norm_rms_epsilon"), 1e-5f);
  meta.set_u32(key("expert_count"), c.experts);
  meta.set_u32(key("expert_used_count"), c.top_k);
  meta.set_u32(key("expert_group_count"), c.expert_groups);
  meta.set_u32(key("expert_group_used_count"), c.groups_used);
  meta.set_u32(key("attention.key_length"), static_cast<uint32_t>(c.head_dim));
  meta.set_u32(key("attention.value_length"), static_cast<uint32_t>(c.head_dim));
  meta.set_u32(key("rope.dimension_count"), c.rope_dim);
  meta.set_u32(key("expert_feed_forward_length"), static_cast<uint32_t>(c.ff));
  meta.set_u32(key("expert_shared_count"), c.shared_experts);
  meta.set_u32(key("leading_dense_block_count"), c.dense_layers);
  meta.set_u32(key("expert_gating_func"), 2);  // LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
  meta.set_f32(key("expert_weights_scale"), 1.0f);
  meta.set_bool(key("expert_weights_norm"), true);
  if (c.nextn > 0) meta.set_u32(key("nextn_predict_layers"), c.nextn);
}

// The keys llama.cpp's converter writes for DeepSeek-V3 (conversion/deepseek.py,
// DeepseekV2Model), with the release's config where the forge has no flag (routed scaling 2.5,
// YaRN factor 40 over 4096 positions, mscale_all_dim 1).
void set_deepseek3_metadata(const ForgeConfig& c, GgufWriter& meta) {
  auto key = [&c](std::string_view suffix) {
    return fmt::format("{}.{}", forge_gguf_arch(c.arch), suffix);
  };
  meta.set_u32(key("block_count"), c.layers);
  meta.set_u32(key("context_length"), c.context);
  meta.set_u32(key("embedding_length"), static_cast<uint32_t>(c.embd));
  meta.set_u32(key("feed_forward_length"), static_cast<uint32_t>(c.dense_ff));
  meta.set_u32(key("attention.head_count"), c.heads);
  meta.set_u32(key("attention.head_count_kv"), 1);
  meta.set_string(key("rope.scaling.type"), "yarn");
  meta.set_f32(key("rope.scaling.factor"), 40.0f);
  meta.set_u32(key("rope.scaling.original_context_length"), 4096);
  meta.set_f32(key("rope.scaling.yarn_beta_fast"), 32.0f);
  meta.set_f32(key("rope.scaling.yarn_beta_slow"), 1.0f);
  meta.set_f32(key("rope.scaling.yarn_log_multiplier"), 0.1f);
  meta.set_f32(key("rope.freq_base"), 10000.0f);
  meta.set_f32(key("attention.layer_norm_rms_epsilon"), 1e-6f);
  meta.set_u32(key("expert_count"), c.experts);
  meta.set_u32(key("expert_used_count"), c.top_k);
  meta.set_u32(key("expert_group_count"), c.expert_groups);
  meta.set_u32(key("expert_group_used_count"), c.groups_used);
  meta.set_u32(key("expert_gating_func"), 2);  // LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
  meta.set_u32(key("attention.key_length"), c.kv_lora_rank + c.rope_dim);
  meta.set_u32(key("attention.value_length"), c.kv_lora_rank);
  meta.set_u32(key("leading_dense_block_count"), c.dense_layers);
  meta.set_u32(key("vocab_size"), static_cast<uint32_t>(c.vocab));
  meta.set_u32(key("attention.q_lora_rank"), c.q_lora_rank);
  meta.set_u32(key("attention.kv_lora_rank"), c.kv_lora_rank);
  meta.set_u32(key("attention.key_length_mla"), static_cast<uint32_t>(c.head_dim));
  meta.set_u32(key("attention.value_length_mla"), c.v_head_dim);
  meta.set_u32(key("expert_feed_forward_length"), static_cast<uint32_t>(c.ff));
  meta.set_u32(key("expert_shared_count"), c.shared_experts);
  meta.set_f32(key("expert_weights_scale"), 2.5f);
  meta.set_bool(key("expert_weights_norm"), true);
  meta.set_u32(key("rope.dimension_count"), c.rope_dim);
}

// The keys llama.cpp's converter writes for Mixtral (conversion/llama.py): the experts' width is
// feed_forward_length, and the head size is embd / heads unless key_length says otherwise.
void set_mixtral_metadata(const ForgeConfig& c, GgufWriter& meta) {
  auto key = [&c](std::string_view suffix) {
    return fmt::format("{}.{}", forge_gguf_arch(c.arch), suffix);
  };
  meta.set_u32(key("block_count"), c.layers);
  meta.set_u32(key("context_length"), c.context);
  meta.set_u32(key("embedding_length"), static_cast<uint32_t>(c.embd));
  meta.set_u32(key("feed_forward_length"), static_cast<uint32_t>(c.ff));
  meta.set_u32(key("attention.head_count"), c.heads);
  meta.set_u32(key("attention.head_count_kv"), c.kv_heads);
  if (c.head_dim * c.heads != c.embd) {
    meta.set_u32(key("attention.key_length"), static_cast<uint32_t>(c.head_dim));
    meta.set_u32(key("attention.value_length"), static_cast<uint32_t>(c.head_dim));
  }
  meta.set_f32(key("rope.freq_base"), 1e6f);
  meta.set_f32(key("attention.layer_norm_rms_epsilon"), 1e-5f);
  meta.set_u32(key("expert_count"), c.experts);
  meta.set_u32(key("expert_used_count"), c.top_k);
  meta.set_u32(key("vocab_size"), static_cast<uint32_t>(c.vocab));
  meta.set_u32(key("rope.dimension_count"), static_cast<uint32_t>(c.head_dim));
}

// The shape keys qwen3moe and gpt-oss share, in the order qwen3moe's forge has always written.
void set_moe_shape_keys(std::string_view arch, const ForgeConfig& c, GgufWriter& meta) {
  auto key = [arch](std::string_view suffix) { return fmt::format("{}.{}", arch, suffix); };
  meta.set_u32(key("block_count"), c.layers);
  meta.set_u32(key("context_length"), c.context);
  meta.set_u32(key("embedding_length"), static_cast<uint32_t>(c.embd));
  meta.set_u32(key("feed_forward_length"), static_cast<uint32_t>(c.ff));
  meta.set_u32(key("expert_feed_forward_length"), static_cast<uint32_t>(c.ff));
  meta.set_u32(key("attention.head_count"), c.heads);
  meta.set_u32(key("attention.head_count_kv"), c.kv_heads);
  meta.set_u32(key("attention.key_length"), static_cast<uint32_t>(c.head_dim));
  meta.set_u32(key("attention.value_length"), static_cast<uint32_t>(c.head_dim));
}

// The keys llama.cpp's converter writes for gpt-oss (conversion/gpt_oss.py), with gpt-oss-120b's
// values where the forge has no flag (YaRN factor 32 over 4096, theta 150000).
void set_gptoss_metadata(const ForgeConfig& c, GgufWriter& meta) {
  auto key = [&c](std::string_view suffix) {
    return fmt::format("{}.{}", forge_gguf_arch(c.arch), suffix);
  };
  set_moe_shape_keys(forge_gguf_arch(c.arch), c, meta);
  meta.set_u32(key("attention.sliding_window"), c.window);
  meta.set_f32(key("attention.layer_norm_rms_epsilon"), 1e-5f);
  meta.set_f32(key("rope.freq_base"), 150000.0f);
  meta.set_string(key("rope.scaling.type"), "yarn");
  meta.set_f32(key("rope.scaling.factor"), 32.0f);
  meta.set_u32(key("rope.scaling.original_context_length"), 4096);
  meta.set_u32(key("expert_count"), c.experts);
  meta.set_u32(key("expert_used_count"), c.top_k);
}

void set_qwen3moe_metadata(const ForgeConfig& c, GgufWriter& meta) {
  auto key = [&c](std::string_view suffix) {
    return fmt::format("{}.{}", forge_gguf_arch(c.arch), suffix);
  };
  set_moe_shape_keys(forge_gguf_arch(c.arch), c, meta);
  meta.set_f32(key("attention.layer_norm_rms_epsilon"), 1e-6f);
  meta.set_f32(key("rope.freq_base"), 1e6f);
  meta.set_u32(key("expert_count"), c.experts);
  meta.set_u32(key("expert_used_count"), c.top_k);
}

// The keys llama.cpp's converter writes for DeepSeek-V4 (conversion/deepseek.py), with
// DeepseekV4Config's values where the forge has no flag.
void set_deepseek4_metadata(const ForgeConfig& c, GgufWriter& meta) {
  auto key = [&c](std::string_view suffix) {
    return fmt::format("{}.{}", forge_gguf_arch(c.arch), suffix);
  };
  const uint32_t blocks = c.layers + c.nextn;
  meta.set_u32(key("block_count"), blocks);
  meta.set_u32(key("context_length"), c.context);
  meta.set_u32(key("embedding_length"), static_cast<uint32_t>(c.embd));
  meta.set_u32(key("attention.head_count"), c.heads);
  meta.set_u32(key("attention.head_count_kv"), c.kv_heads);
  meta.set_string(key("rope.scaling.type"), "yarn");
  meta.set_f32(key("rope.scaling.factor"), 16.0f);
  meta.set_u32(key("rope.scaling.original_context_length"), 65536);
  meta.set_f32(key("rope.scaling.yarn_beta_fast"), 32.0f);
  meta.set_f32(key("rope.scaling.yarn_beta_slow"), 1.0f);
  meta.set_f32(key("rope.freq_base"), 10000.0f);
  meta.set_f32(key("attention.layer_norm_rms_epsilon"), 1e-6f);
  meta.set_u32(key("expert_count"), c.experts);
  meta.set_u32(key("expert_used_count"), c.top_k);
  meta.set_u32(key("expert_gating_func"), 4);  // LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS
  meta.set_u32(key("attention.key_length"), static_cast<uint32_t>(c.head_dim));
  meta.set_u32(key("attention.value_length"), static_cast<uint32_t>(c.head_dim));
  meta.set_u32(key("rope.dimension_count"), c.rope_dim);
  meta.set_u32(key("attention.q_lora_rank"), c.q_lora_rank);
  meta.set_u32(key("attention.sliding_window"), c.window);
  meta.set_u32(key("expert_feed_forward_length"), static_cast<uint32_t>(c.ff));
  meta.set_u32(key("expert_shared_count"), c.shared_experts);
  meta.set_f32(key("expert_weights_scale"), 1.5f);
  meta.set_bool(key("expert_weights_norm"), true);
  const std::vector<float> clamp(blocks, 10.0f);  // swiglu_limit
  meta.set_array(key("swiglu_clamp_exp"), std::span<const float>(clamp));
  meta.set_array(key("swiglu_clamp_shexp"), std::span<const float>(clamp));
  meta.set_u32(key("attention.indexer.head_count"), c.index_heads);
  meta.set_u32(key("attention.indexer.key_length"), c.index_head_dim);
  meta.set_u32(key("attention.indexer.top_k"), c.index_topk);
  meta.set_u32(key("attention.output_group_count"), c.o_groups);
  meta.set_u32(key("attention.output_lora_rank"), c.o_lora_rank);
  const std::vector<int32_t> ratios = forge_compress_ratios(c);
  meta.set_array(key("attention.compress_ratios"), std::span<const int32_t>(ratios));
  meta.set_f32(key("attention.compress_rope_freq_base"), 160000.0f);
  meta.set_u32(key("hyper_connection.count"), c.hc_mult);
  meta.set_u32(key("hyper_connection.sinkhorn_iterations"), 20);
  meta.set_f32(key("hyper_connection.epsilon"), 1e-6f);
  meta.set_u32(key("hash_layer_count"), c.hash_layers);
  meta.set_u32(key("embedding_length_out"), static_cast<uint32_t>(c.hc_mult * c.embd));
  if (c.nextn > 0) meta.set_u32(key("nextn_predict_layers"), c.nextn);
}

}  // namespace

Result<std::vector<ForgeShard>> plan_forge_model(const ForgeConfig& c) {
  const std::vector<std::string> paths = forge_shard_paths(c);
  const uint32_t n = c.split;
  const bool ds4 = c.arch == ForgeArch::Deepseek4;
  const uint32_t blocks = forge_blocks(c);
  const std::vector<int32_t> ratios = ds4 ? forge_compress_ratios(c) : std::vector<int32_t>{};
  EXPERTD_CHECK_EQ(ratios.size(), ds4 ? blocks : 0u);

  // Tensors: token_embd, then the blocks in contiguous groups, then the output head.
  const GgmlType dense = c.dense_type;
  constexpr GgmlType f32 = GgmlType::F32;
  const TensorList head = {{"token_embd.weight", dense, {c.embd, c.vocab}}};
  TensorList tail;
  if (ds4) {
    const uint64_t hc_dim = uint64_t{c.hc_mult} * c.embd;
    tail.push_back({"output_hc_fn.weight", f32, {hc_dim, c.hc_mult}});
    tail.push_back({"output_hc_base.weight", f32, {c.hc_mult}});
    tail.push_back({"output_hc_scale.weight", f32, {1}});
  }
  tail.push_back({"output_norm.weight", f32, {c.embd}});
  tail.push_back({"output.weight", dense, {c.embd, c.vocab}});
  std::vector<TensorList> shard_tensors(n);
  shard_tensors[0] = head;
  for (uint32_t s = 0; s < n; ++s) {
    const auto first = static_cast<uint32_t>(uint64_t{s} * blocks / n);
    const auto end = static_cast<uint32_t>(uint64_t{s + 1} * blocks / n);
    for (uint32_t l = first; l < end; ++l) {
      if (ds4) {
        deepseek4_layer(c, l, ratios[l], shard_tensors[s]);
      } else if (c.arch == ForgeArch::Deepseek3) {
        deepseek3_layer(c, l, shard_tensors[s]);
      } else if (c.arch == ForgeArch::Glm4Moe) {
        glm4moe_layer(c, l, shard_tensors[s]);
      } else {
        qwen3moe_layer(c, l, shard_tensors[s]);
      }
    }
  }
  shard_tensors[n - 1].insert(shard_tensors[n - 1].end(), tail.begin(), tail.end());
  uint64_t tensor_count = 0;
  for (const TensorList& t : shard_tensors) tensor_count += t.size();

  std::vector<ForgeShard> shards;
  shards.reserve(n);
  for (uint32_t s = 0; s < n; ++s) shards.push_back(ForgeShard{paths[s], GgufWriter(c.alignment)});

  // Model metadata, first shard only (as llama.cpp's gguf-split does).
  GgufWriter& meta = shards[0].writer;
  const std::string_view arch = forge_arch_name(c.arch);
  meta.set_string("general.architecture", forge_gguf_arch(c.arch));
  meta.set_string("general.name", c.name.empty()
                                      ? fmt::format("forge-{}-{}L-{}x{}-{}", arch, c.layers,
                                                    c.experts, c.ff, ggml_type_name(c.expert_type))
                                      : c.name);
  meta.set_u32("general.file_type", llama_file_type(c.expert_type));
  meta.set_u32("general.quantization_version", 2);
  if (ds4) {
    set_deepseek4_metadata(c, meta);
  } else if (c.arch == ForgeArch::Mixtral) {
    set_mixtral_metadata(c, meta);
  } else if (c.arch == ForgeArch::Deepseek3) {
    set_deepseek3_metadata(c, meta);
  } else if (c.arch == ForgeArch::GptOss) {
    set_gptoss_metadata(c, meta);
  } else if (c.arch == ForgeArch::Glm4Moe) {
    set_glm4moe_metadata(c, meta);
  } else {
    set_qwen3moe_metadata(c, meta);
  }

  const ForgeVocab vocab = make_forge_vocab(c.vocab);
  meta.set_string("tokenizer.ggml.model", "gpt2");
  meta.set_string("tokenizer.ggml.pre", "qwen2");
  meta.set_array("tokenizer.ggml.tokens", std::span<const std::string>(vocab.tokens));
  meta.set_array("tokenizer.ggml.token_type", std::span<const int32_t>(vocab.types));
  meta.set_array("tokenizer.ggml.merges", std::span<const std::string>(vocab.merges));
  meta.set_u32("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(vocab.bos));
  meta.set_u32("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(vocab.eos));
  meta.set_u32("tokenizer.ggml.padding_token_id", static_cast<uint32_t>(vocab.bos));
  meta.set_bool("tokenizer.ggml.add_bos_token", false);

  for (uint32_t s = 0; s < n; ++s) {
    GgufWriter& w = shards[s].writer;
    w.set_u64(kForgeSeedKey, c.seed);
    w.set_u32(kForgeVersionKey, kForgeVersion);
    if (n > 1) {
      w.set_u16("split.no", static_cast<uint16_t>(s));
      w.set_u16("split.count", static_cast<uint16_t>(n));
      w.set_i32("split.tensors.count", static_cast<int32_t>(tensor_count));
    }
    for (const TensorSpec& t : shard_tensors[s]) {
      EXPERTD_TRY(w.add_tensor(t.name, t.type, std::span<const uint64_t>(t.ne)));
    }
  }
  return shards;
}

}  // namespace expertd
