#include "forge/plan.h"

#include <fmt/format.h>

#include <array>
#include <unordered_set>

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

}  // namespace

std::string_view forge_type_names() { return "f32, f16, bf16, q8_0, q4_0, q4_k, q6_k, mxfp4"; }

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
  if (c.split < 1 || c.split > c.layers || c.split > kMaxShards) {
    return flag_error("--split", c.split,
                      fmt::format("must be between 1 and --layers ({}): every shard holds at "
                                  "least one layer",
                                  c.layers));
  }
  if (c.output.empty()) return make_error(EINVAL, "-o: an output path is required");

  // Every tensor's ne0 must be a whole number of blocks of its type.
  const std::string embd = fmt::format("--embd {}", c.embd);
  EXPERTD_TRY(check_block(embd, c.embd, c.expert_type, "--expert-type",
                          "; ffn_gate_exps and ffn_up_exps rows are embd long"));
  EXPERTD_TRY(check_block(fmt::format("--ff {}", c.ff), c.ff, c.expert_type, "--expert-type",
                          "; ffn_down_exps rows are ff long"));
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

Result<std::vector<ForgeShard>> plan_forge_model(const ForgeConfig& c) {
  const std::vector<std::string> paths = forge_shard_paths(c);
  const uint32_t n = c.split;
  const uint64_t q_dim = uint64_t{c.heads} * c.head_dim;
  const uint64_t kv_dim = uint64_t{c.kv_heads} * c.head_dim;

  std::vector<ForgeShard> shards;
  shards.reserve(n);
  for (uint32_t s = 0; s < n; ++s) shards.push_back(ForgeShard{paths[s], GgufWriter(c.alignment)});

  // Model metadata, first shard only (as llama.cpp's gguf-split does).
  GgufWriter& meta = shards[0].writer;
  const std::string arch = "qwen3moe";
  auto key = [&](std::string_view suffix) { return fmt::format("{}.{}", arch, suffix); };
  meta.set_string("general.architecture", arch);
  meta.set_string("general.name", c.name.empty()
                                      ? fmt::format("forge-{}-{}L-{}x{}-{}", arch, c.layers,
                                                    c.experts, c.ff, ggml_type_name(c.expert_type))
                                      : c.name);
  meta.set_u32("general.file_type", llama_file_type(c.expert_type));
  meta.set_u32("general.quantization_version", 2);
  meta.set_u32(key("block_count"), c.layers);
  meta.set_u32(key("context_length"), c.context);
  meta.set_u32(key("embedding_length"), static_cast<uint32_t>(c.embd));
  meta.set_u32(key("feed_forward_length"), static_cast<uint32_t>(c.ff));
  meta.set_u32(key("expert_feed_forward_length"), static_cast<uint32_t>(c.ff));
  meta.set_u32(key("attention.head_count"), c.heads);
  meta.set_u32(key("attention.head_count_kv"), c.kv_heads);
  meta.set_u32(key("attention.key_length"), static_cast<uint32_t>(c.head_dim));
  meta.set_u32(key("attention.value_length"), static_cast<uint32_t>(c.head_dim));
  meta.set_f32(key("attention.layer_norm_rms_epsilon"), 1e-6f);
  meta.set_f32(key("rope.freq_base"), 1e6f);
  meta.set_u32(key("expert_count"), c.experts);
  meta.set_u32(key("expert_used_count"), c.top_k);

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

  // Tensors: token_embd, then the layers in contiguous groups, then output_norm and output.
  const uint64_t tensor_count = 3 + uint64_t{c.layers} * 12;
  for (uint32_t s = 0; s < n; ++s) {
    GgufWriter& w = shards[s].writer;
    w.set_u64(kForgeSeedKey, c.seed);
    w.set_u32(kForgeVersionKey, kForgeVersion);
    if (n > 1) {
      w.set_u16("split.no", static_cast<uint16_t>(s));
      w.set_u16("split.count", static_cast<uint16_t>(n));
      w.set_i32("split.tensors.count", static_cast<int32_t>(tensor_count));
    }
  }
  auto add = [](GgufWriter& w, std::string_view name, GgmlType type,
                std::initializer_list<uint64_t> ne) -> Status {
    return w.add_tensor(name, type, std::span<const uint64_t>(ne.begin(), ne.size()));
  };
  const GgmlType dense = c.dense_type;
  const GgmlType experts = c.expert_type;
  constexpr GgmlType f32 = GgmlType::F32;
  EXPERTD_TRY(add(shards[0].writer, "token_embd.weight", dense, {c.embd, c.vocab}));
  for (uint32_t s = 0; s < n; ++s) {
    GgufWriter& w = shards[s].writer;
    const uint32_t first = static_cast<uint32_t>(uint64_t{s} * c.layers / n);
    const uint32_t end = static_cast<uint32_t>(uint64_t{s + 1} * c.layers / n);
    for (uint32_t l = first; l < end; ++l) {
      auto blk = [l](std::string_view t) { return fmt::format("blk.{}.{}.weight", l, t); };
      EXPERTD_TRY(add(w, blk("attn_norm"), f32, {c.embd}));
      EXPERTD_TRY(add(w, blk("attn_q"), dense, {c.embd, q_dim}));
      EXPERTD_TRY(add(w, blk("attn_k"), dense, {c.embd, kv_dim}));
      EXPERTD_TRY(add(w, blk("attn_v"), dense, {c.embd, kv_dim}));
      EXPERTD_TRY(add(w, blk("attn_output"), dense, {q_dim, c.embd}));
      EXPERTD_TRY(add(w, blk("attn_q_norm"), f32, {c.head_dim}));
      EXPERTD_TRY(add(w, blk("attn_k_norm"), f32, {c.head_dim}));
      EXPERTD_TRY(add(w, blk("ffn_norm"), f32, {c.embd}));
      EXPERTD_TRY(add(w, blk("ffn_gate_inp"), f32, {c.embd, c.experts}));
      EXPERTD_TRY(add(w, blk("ffn_gate_exps"), experts, {c.embd, c.ff, c.experts}));
      EXPERTD_TRY(add(w, blk("ffn_up_exps"), experts, {c.embd, c.ff, c.experts}));
      EXPERTD_TRY(add(w, blk("ffn_down_exps"), experts, {c.ff, c.embd, c.experts}));
    }
  }
  GgufWriter& last = shards[n - 1].writer;
  EXPERTD_TRY(add(last, "output_norm.weight", f32, {c.embd}));
  EXPERTD_TRY(add(last, "output.weight", dense, {c.embd, c.vocab}));
  return shards;
}

}  // namespace expertd
