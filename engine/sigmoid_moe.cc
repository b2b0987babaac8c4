// DeepSeek-V3's MoE block as llama.cpp's converter writes it, which GLM-4.5 shares (the same keys
// under each architecture's prefix; SigmoidMoe in engine/model.h): a building block of the family
// files engine/families/deepseek3.cc and glm4moe.cc.
#include <fmt/format.h>

#include "engine/family.h"
#include "engine/model.h"
#include "engine/model_read.h"

namespace expertd::engine::detail {
namespace {

constexpr uint64_t kMaxRank = 1 << 16;

}  // namespace

Status read_sigmoid_moe(const GgufModel& g, const ModelParams& p, uint64_t gating_default,
                        SigmoidMoe& m) {
  const std::string_view model = family_info(p.family).name;
  EXPERTD_TRY_ASSIGN(const uint64_t lead, get_u64(g, "leading_dense_block_count", 0, 0, p.n_layer));
  uint64_t n_ff = 0;
  if (lead > 0) {
    EXPERTD_TRY_ASSIGN(n_ff, get_u64(g, "feed_forward_length", {}, 1, kMaxRank * 4));
  }
  EXPERTD_TRY_ASSIGN(const uint64_t n_shared, get_u64(g, "expert_shared_count", 0, 0, 64));
  EXPERTD_TRY_ASSIGN(const double wscale, get_f64(g, "expert_weights_scale", 1.0));
  bool wnorm = false;  // llama.cpp's default when the key is absent
  if (const GgufValue* v = g.find_arch("expert_weights_norm")) {
    const auto b = v->as_bool();
    if (!b) return key_error(g, "expert_weights_norm", "is not a bool");
    wnorm = *b;
  }
  EXPERTD_TRY_ASSIGN(const uint64_t gating,
                     get_u64(g, "expert_gating_func", gating_default, 0, 1000));
  if (gating != kGatingSoftmax && gating != kGatingSigmoid) {
    return key_error(g, "expert_gating_func",
                     fmt::format("= {}: {} routers score with softmax ({}) or sigmoid ({})", gating,
                                 p.architecture, kGatingSoftmax, kGatingSigmoid));
  }
  // Sigmoid routers (DeepSeek-V3, Kimi-K2, GLM-4.5) pick experts from the best groups; a file
  // without the group keys would silently route differently. llama.cpp's converter writes them
  // from the release's n_group / topk_group (1 and 1 for GLM-4.5).
  const bool sig = gating == kGatingSigmoid;
  if (sig && g.find_arch("expert_group_count") == nullptr) {
    return key_error(g, "expert_group_count",
                     fmt::format("is missing; {} routing needs it", model));
  }
  EXPERTD_TRY_ASSIGN(const uint64_t groups, get_u64(g, "expert_group_count", 1, 1, p.n_expert));
  if (p.n_expert % groups != 0) {
    return key_error(g, "expert_group_count",
                     fmt::format("= {} does not divide expert_count {}", groups, p.n_expert));
  }
  if (sig && groups > 1 && g.find_arch("expert_group_used_count") == nullptr) {
    return key_error(g, "expert_group_used_count",
                     fmt::format("is missing; {} routing needs it", model));
  }
  EXPERTD_TRY_ASSIGN(const uint64_t used, get_u64(g, "expert_group_used_count", 1, 1, groups));
  if (used * (p.n_expert / groups) < p.n_expert_used) {
    return key_error(g, "expert_group_used_count",
                     fmt::format("= {}: {} groups of {} experts cannot hold the top-{}", used, used,
                                 p.n_expert / groups, p.n_expert_used));
  }
  m.dense_lead = static_cast<uint32_t>(lead);
  m.n_ff = static_cast<uint32_t>(n_ff);
  m.n_shared = static_cast<uint32_t>(n_shared);
  m.n_group = static_cast<uint32_t>(groups);
  m.n_group_used = static_cast<uint32_t>(used);
  m.sigmoid = sig;
  m.weights_scale = static_cast<float>(wscale);
  m.weights_norm = wnorm;
  return Ok{};
}

Status read_sigmoid_moe_layer(const GgufModel& g, const Sources& src, const std::string& b,
                              const ModelParams& p, const SigmoidMoe& m, uint32_t layer,
                              bool bias_required, SigmoidMoeWeights& w) {
  const uint64_t e = p.n_embd;
  if (layer < m.dense_lead) {
    EXPERTD_TRY_ASSIGN(w.ffn_gate, read_matrix(g, src, b + "ffn_gate.weight", m.n_ff, e));
    EXPERTD_TRY_ASSIGN(w.ffn_up, read_matrix(g, src, b + "ffn_up.weight", m.n_ff, e));
    EXPERTD_TRY_ASSIGN(w.ffn_down, read_matrix(g, src, b + "ffn_down.weight", e, m.n_ff));
    return Ok{};
  }
  // DeepSeek-V2 has no correction bias: selection is by the scores alone.
  if (bias_required || g.find_tensor(b + "exp_probs_b.bias")) {
    EXPERTD_TRY_ASSIGN(w.exp_bias, read_vector(g, src, b + "exp_probs_b.bias", p.n_expert));
  } else {
    w.exp_bias.assign(p.n_expert, 0.0f);
  }
  if (m.n_shared > 0) {
    const uint64_t ff_sh = uint64_t{p.n_ff_exp} * m.n_shared;
    EXPERTD_TRY_ASSIGN(w.shexp_gate, read_matrix(g, src, b + "ffn_gate_shexp.weight", ff_sh, e));
    EXPERTD_TRY_ASSIGN(w.shexp_up, read_matrix(g, src, b + "ffn_up_shexp.weight", ff_sh, e));
    EXPERTD_TRY_ASSIGN(w.shexp_down, read_matrix(g, src, b + "ffn_down_shexp.weight", e, ff_sh));
  }
  return Ok{};
}

}  // namespace expertd::engine::detail
