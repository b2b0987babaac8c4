#include "engine/family.h"

#include <array>

namespace expertd::engine {
namespace {

// clang-format off
constexpr std::array kFamilies = {
    // family, arch, name, alias, file,
    //     models, note, engine class, capabilities
    FamilyInfo{Family::Qwen3Moe, "qwen3moe", "Qwen3-MoE", "", "qwen3moe",
               "Qwen3-30B-A3B, Qwen3-235B-A22B", "", EngineClass::Generic,
               {.cpu_batched_prefill = true, .cuda = true, .cuda_batched_prefill = true,
                .prefix_truncate = true, .cuda_prefix_truncate = true,
                .hash_hints = false, .mtp_blocks = false, .cpu_batched_decode = true,
                .cuda_batched_decode = true}},
    FamilyInfo{Family::Mixtral, "llama", "Mixtral", "mixtral", "mixtral",
               "Mixtral-8x7B, Mixtral-8x22B", "with routed experts (llama.expert_count)",
               EngineClass::Generic,
               {.cpu_batched_prefill = true, .cuda = true, .cuda_batched_prefill = true,
                .prefix_truncate = true, .cuda_prefix_truncate = true,
                .hash_hints = false, .mtp_blocks = false, .cpu_batched_decode = true,
                .cuda_batched_decode = true}},
    FamilyInfo{Family::GptOss, "gpt-oss", "gpt-oss", "", "gpt_oss",
               "gpt-oss-20b, gpt-oss-120b", "", EngineClass::Generic,
               {.cpu_batched_prefill = true, .cuda = true, .cuda_batched_prefill = true,
                .prefix_truncate = true, .cuda_prefix_truncate = true,
                .hash_hints = false, .mtp_blocks = false, .cpu_batched_decode = true,
                .cuda_batched_decode = true}},
    FamilyInfo{Family::Glm4Moe, "glm4moe", "GLM-4.5", "", "glm4moe",
               "GLM-4.5, GLM-4.5-Air, GLM-4.6", "", EngineClass::Generic,
               {.cpu_batched_prefill = true, .cuda = true, .cuda_batched_prefill = true,
                .prefix_truncate = true, .cuda_prefix_truncate = true,
                .hash_hints = false, .mtp_blocks = true, .cpu_batched_decode = true,
                .cuda_batched_decode = true}},
    FamilyInfo{Family::DeepSeek3, "deepseek2", "DeepSeek-V3", "deepseek3", "deepseek3",
               "DeepSeek-V3, DeepSeek-R1, Kimi-K2", "", EngineClass::DeepSeek3,
               {.cpu_batched_prefill = true, .cuda = true, .cuda_batched_prefill = true,
                .prefix_truncate = true, .cuda_prefix_truncate = true,
                .hash_hints = false, .mtp_blocks = false, .cpu_batched_decode = true,
                .cuda_batched_decode = true}},
    FamilyInfo{Family::DeepSeek4, "deepseek4", "DeepSeek-V4", "", "deepseek4",
               "DeepSeek-V4-Flash", "", EngineClass::DeepSeek4,
               {.cpu_batched_prefill = true, .cuda = true, .cuda_batched_prefill = true,
                .prefix_truncate = true, .cuda_prefix_truncate = true,
                .hash_hints = true, .mtp_blocks = true, .cpu_batched_decode = true,
                .cuda_batched_decode = true}},
};
// clang-format on

}  // namespace

std::span<const FamilyInfo> families() { return kFamilies; }

const FamilyInfo* find_family(std::string_view arch) {
  for (const FamilyInfo& f : kFamilies) {
    if (f.arch == arch) return &f;
  }
  return nullptr;
}

const FamilyInfo& family_info(Family family) {
  for (const FamilyInfo& f : kFamilies) {
    if (f.family == family) return f;
  }
  return kFamilies[0];  // unreachable: every enumerator has a row (family_test checks)
}

const FamilyInfo* find_family_by_name(std::string_view name) {
  for (const FamilyInfo& f : kFamilies) {
    if (f.arch == name || (!f.alias.empty() && f.alias == name)) return &f;
  }
  return nullptr;
}

std::string_view short_name(const FamilyInfo& f) { return f.alias.empty() ? f.arch : f.alias; }

std::string family_list(bool (*accept)(const FamilyInfo&)) {
  std::string out;
  for (const FamilyInfo& f : kFamilies) {
    if (accept != nullptr && !accept(f)) continue;
    if (!out.empty()) out += ", ";
    out += std::string(f.arch);
    if (f.arch != f.name) out += " (" + std::string(f.name) + ")";
  }
  return out;
}

std::string family_list() { return family_list(nullptr); }

}  // namespace expertd::engine
