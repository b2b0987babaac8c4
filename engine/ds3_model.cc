// DeepSeek-V3 / Kimi-K2 (`deepseek2`) hyperparameters and dense weights, as llama.cpp's converter
// writes them (conversion/deepseek.py, DeepseekV2Model): names, shapes and key names are its. Also
// the MoE keys and layer weights GLM-4.5 (`glm4moe`, conversion/glm.py) shares with it.
// attn_k_b and attn_v_b are kv_b_proj split per head for the absorbed attention: k_b transposed
// (ne [qk_nope, kv_lora_rank, n_head]), v_b as is (ne [kv_lora_rank, v_head_dim, n_head]).
#include <fmt/format.h>

#include "engine/model.h"
#include "engine/model_read.h"

namespace expertd::engine {
namespace {

using detail::get_f64;
using detail::get_u64;
using detail::read_matrices;
using detail::read_matrix;
using detail::read_vector;
using detail::Sources;

constexpr uint64_t kMaxRank = 1 << 16;
// llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_*.
constexpr uint64_t kGatingSoftmax = 1;
constexpr uint64_t kGatingSigmoid = 2;

Error key_error(const GgufModel& g, std::string_view suffix, const std::string& what) {
  return Error{EINVAL, fmt::format("{}: {} {}", g.meta().path(), g.arch_key(suffix), what)};
}

// The SigmoidMoe keys under g's prefix. `family` names the architecture and `model` the release
// whose routing needs the group keys; `gating` is the scoring when expert_gating_func is absent
// (llama.cpp's default per architecture).
Status read_sigmoid_moe(const GgufModel& g, const ModelParams& p, std::string_view family,
                        std::string_view model, uint64_t gating_default, SigmoidMoe& m) {
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
                                 family, kGatingSoftmax, kGatingSigmoid));
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

}  // namespace

Status read_ds3_params(const GgufModel& g, ModelParams& p) {
  Ds3Params& d = p.ds3;
  if (p.n_head_kv != 1) {
    return key_error(
        g, "attention.head_count_kv",
        fmt::format("= {}: deepseek2 files hold MLA as one latent KV head (1)", p.n_head_kv));
  }
  if (p.n_rot >= p.head_dim) {
    return key_error(
        g, "rope.dimension_count",
        fmt::format("= {} leaves no non-rope part of the {}-wide query head", p.n_rot, p.head_dim));
  }
  EXPERTD_TRY_ASSIGN(const uint64_t qlr, get_u64(g, "attention.q_lora_rank", 0, 0, kMaxRank));
  EXPERTD_TRY_ASSIGN(const uint64_t kvlr, get_u64(g, "attention.kv_lora_rank", {}, 1, kMaxRank));
  EXPERTD_TRY_ASSIGN(const uint64_t vd, get_u64(g, "attention.value_length_mla", {}, 1, kMaxRank));
  // Files from before the gating key are DeepSeek-V2's, which gate with softmax (as llama.cpp
  // assumes).
  EXPERTD_TRY(read_sigmoid_moe(g, p, "deepseek2", "DeepSeek-V3", kGatingSoftmax, d));
  EXPERTD_TRY_ASSIGN(d.yarn, detail::read_yarn(g, "deepseek2"));
  if (d.yarn.factor > 0 && g.find_arch("rope.scaling.yarn_log_multiplier") != nullptr) {
    EXPERTD_TRY_ASSIGN(d.yarn_log_mul, get_f64(g, "rope.scaling.yarn_log_multiplier", {}));
  }
  d.q_lora_rank = static_cast<uint32_t>(qlr);
  d.kv_lora_rank = static_cast<uint32_t>(kvlr);
  d.qk_nope = p.head_dim - p.n_rot;
  d.v_head_dim = static_cast<uint32_t>(vd);
  return Ok{};
}

Status read_glm4moe_params(const GgufModel& g, ModelParams& p) {
  // llama.cpp requires the shared expert count for glm4moe (every GLM-4.5 has one).
  if (g.find_arch("expert_shared_count") == nullptr) {
    return key_error(g, "expert_shared_count", "is missing; GLM-4.5's MoE needs it");
  }
  // llama.cpp scores GLM-4.5's router with sigmoid when the gating key is absent.
  EXPERTD_TRY(read_sigmoid_moe(g, p, "glm4moe", "GLM-4.5", kGatingSigmoid, p.glm));
  EXPERTD_TRY_ASSIGN(const Yarn yarn, detail::read_yarn(g, "glm4moe"));
  if (yarn.factor > 0) {
    return key_error(g, "rope.scaling.type",
                     "= yarn: the engine runs glm4moe without RoPE scaling");
  }
  // The first layer's q norm says whether the model has them (GLM-4.5 does, GLM-4.5-Air not);
  // the loader then needs them in every layer.
  p.qk_norm = g.find_tensor("blk.0.attn_q_norm.weight").has_value();
  return Ok{};
}

Status detail::read_sigmoid_moe_layer(const GgufModel& g, const Sources& src, const std::string& b,
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

Status load_ds3(DenseModel& m) {
  const GgufModel& g = m.gguf();
  const ModelParams& p = m.params();
  const Ds3Params& d = p.ds3;
  EXPERTD_TRY_ASSIGN(
      Sources src, detail::open_sources(g, m.deferred() ? DenseLoad::Deferred : DenseLoad::Eager));
  auto w = std::make_unique<Ds3Weights>();
  const uint64_t e = p.n_embd;
  const uint64_t q_dim = uint64_t{p.n_head} * p.head_dim;
  w->layers.resize(p.n_layer);
  for (uint32_t i = 0; i < p.n_layer; ++i) {
    Ds3LayerWeights& l = w->layers[i];
    const std::string b = fmt::format("blk.{}.", i);
    EXPERTD_TRY_ASSIGN(l.attn_norm, read_vector(g, src, b + "attn_norm.weight", e));
    if (d.q_lora_rank > 0) {
      EXPERTD_TRY_ASSIGN(l.wq_a, read_matrix(g, src, b + "attn_q_a.weight", d.q_lora_rank, e));
      EXPERTD_TRY_ASSIGN(l.q_a_norm,
                         read_vector(g, src, b + "attn_q_a_norm.weight", d.q_lora_rank));
      EXPERTD_TRY_ASSIGN(l.wq_b, read_matrix(g, src, b + "attn_q_b.weight", q_dim, d.q_lora_rank));
    } else {
      EXPERTD_TRY_ASSIGN(l.wq, read_matrix(g, src, b + "attn_q.weight", q_dim, e));
    }
    EXPERTD_TRY_ASSIGN(l.wkv_a, read_matrix(g, src, b + "attn_kv_a_mqa.weight",
                                            uint64_t{d.kv_lora_rank} + p.n_rot, e));
    EXPERTD_TRY_ASSIGN(l.kv_a_norm,
                       read_vector(g, src, b + "attn_kv_a_norm.weight", d.kv_lora_rank));
    if (!g.find_tensor(b + "attn_k_b.weight") && g.find_tensor(b + "attn_kv_b.weight")) {
      // llama.cpp's converter wrote the joint kv_b before it split it for MLA (early 2025 files).
      return make_error(ENOTSUP, fmt::format("{}: tensor {}attn_k_b.weight is missing: the file "
                                             "has {}attn_kv_b.weight (converted before llama.cpp "
                                             "split it for MLA); convert the model again",
                                             g.meta().path(), b, b));
    }
    EXPERTD_TRY_ASSIGN(
        l.wk_b, read_matrices(g, src, b + "attn_k_b.weight", p.n_head, d.kv_lora_rank, d.qk_nope));
    EXPERTD_TRY_ASSIGN(l.wv_b, read_matrices(g, src, b + "attn_v_b.weight", p.n_head, d.v_head_dim,
                                             d.kv_lora_rank));
    EXPERTD_TRY_ASSIGN(
        l.wo, read_matrix(g, src, b + "attn_output.weight", e, uint64_t{p.n_head} * d.v_head_dim));
    EXPERTD_TRY_ASSIGN(l.ffn_norm, read_vector(g, src, b + "ffn_norm.weight", e));
    if (i >= d.dense_lead) {
      EXPERTD_TRY_ASSIGN(l.gate_inp, read_matrix(g, src, b + "ffn_gate_inp.weight", p.n_expert, e));
    }
    EXPERTD_TRY(detail::read_sigmoid_moe_layer(g, src, b, p, d, i, /*bias_required=*/false, l));
  }
  m.ds3_ = std::move(w);
  return Ok{};
}

uint64_t ds3_dense_bytes(const Ds3Weights& w, bool held) {
  auto vec = [](const std::vector<float>& v) { return v.size() * sizeof(float); };
  uint64_t n = 0;
  for (const Ds3LayerWeights& l : w.layers) {
    for (const Matrix* x :
         {&l.wq_a, &l.wq_b, &l.wq, &l.wkv_a, &l.wk_b, &l.wv_b, &l.wo, &l.ffn_gate, &l.ffn_up,
          &l.ffn_down, &l.gate_inp, &l.shexp_gate, &l.shexp_up, &l.shexp_down}) {
      n += held ? x->bytes.size() : x->size();
    }
    n += vec(l.attn_norm) + vec(l.q_a_norm) + vec(l.kv_a_norm) + vec(l.ffn_norm) + vec(l.exp_bias);
  }
  return n;
}

}  // namespace expertd::engine
