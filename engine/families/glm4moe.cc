// GLM-4.5 (`glm4moe`; GLM-4.5, GLM-4.5-Air, GLM-4.6) as llama.cpp's converter writes it
// (conversion/glm.py): the generic engines' forward with q/k/v biases, optional per-head q/k norms,
// partial NEOX RoPE, the post-attention norm before the FFN, and DeepSeek-V3's MoE block
// (SigmoidMoe: engine/sigmoid_moe.cc) with its leading dense layers and shared expert. Its MTP
// blocks are skipped (read_nextn).
#include <fmt/format.h>

#include <tuple>

#include "engine/families/families.h"

namespace expertd::engine {
namespace {

using detail::key_error;

Status read_glm4moe_params(const GgufModel& g, ModelParams& p) {
  p.router = RouterKind::Sigmoid;
  EXPERTD_TRY(read_nextn(g, p));
  // llama.cpp requires the shared expert count for glm4moe (every GLM-4.5 has one).
  if (g.find_arch("expert_shared_count") == nullptr) {
    return key_error(g, "expert_shared_count", "is missing; GLM-4.5's MoE needs it");
  }
  // llama.cpp scores GLM-4.5's router with sigmoid when the gating key is absent.
  EXPERTD_TRY(detail::read_sigmoid_moe(g, p, detail::kGatingSigmoid, p.sigmoid_moe));
  EXPERTD_TRY_ASSIGN(const Yarn yarn, detail::read_yarn(g));
  if (yarn.factor > 0) {
    return key_error(g, "rope.scaling.type",
                     "= yarn: the engine runs glm4moe without RoPE scaling");
  }
  // The first layer's q norm says whether the model has them (GLM-4.5 does, GLM-4.5-Air not);
  // the loader then needs them in every layer.
  p.qk_norm = g.find_tensor("blk.0.attn_q_norm.weight").has_value();
  return Ok{};
}

// glm4moe's q/k/v biases (every GLM-4.5 has them; llama.cpp reads them where the file has them)
// and its SigmoidMoe part: the dense MLP of a leading layer, or the selection bias and shared
// expert of a MoE layer.
Status load_glm4moe_layer(const GgufModel& g, const detail::Sources& src, const std::string& b,
                          const ModelParams& p, uint32_t layer, LayerWeights& l) {
  const uint64_t q_dim = uint64_t{p.n_head} * p.head_dim;
  const uint64_t kv_dim = uint64_t{p.n_head_kv} * p.head_dim;
  for (auto [name, v, n] :
       {std::tuple{"attn_q.bias", &l.bq, q_dim}, std::tuple{"attn_k.bias", &l.bk, kv_dim},
        std::tuple{"attn_v.bias", &l.bv, kv_dim}}) {
    if (!g.find_tensor(b + name)) continue;
    EXPERTD_TRY_ASSIGN(*v, detail::read_vector(g, src, b + name, n));
  }
  return detail::read_sigmoid_moe_layer(g, src, b, p, p.sigmoid_moe, layer, /*bias_required=*/true,
                                        l);
}

}  // namespace

const FamilyLoader kGlm4MoeLoader{
    .read_params = read_glm4moe_params,
    .ffn_norm = "post_attention_norm",
    .load_layer = load_glm4moe_layer,
};

}  // namespace expertd::engine
