// DeepSeek-V3 / Kimi-K2 (`deepseek2`; DeepSeek-V3, DeepSeek-R1, Kimi-K2) hyperparameters and dense
// weights, as llama.cpp's converter writes them (conversion/deepseek.py, DeepseekV2Model): names,
// shapes and key names are its. Multi-head latent attention (MLA) and the SigmoidMoe block
// (engine/sigmoid_moe.cc); the engines are Ds3CpuEngine and Ds3GpuEngine.
// attn_k_b and attn_v_b are kv_b_proj split per head for the absorbed attention: k_b transposed
// (ne [qk_nope, kv_lora_rank, n_head]), v_b as is (ne [kv_lora_rank, v_head_dim, n_head]).
#include <fmt/format.h>

#include "engine/families/families.h"

namespace expertd::engine {
namespace {

using detail::key_error;

using detail::get_f64;
using detail::get_u64;
using detail::read_matrices;
using detail::read_matrix;
using detail::read_vector;
using detail::Sources;

constexpr uint64_t kMaxRank = 1 << 16;

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
  EXPERTD_TRY(detail::read_sigmoid_moe(g, p, detail::kGatingSoftmax, d));
  EXPERTD_TRY_ASSIGN(d.yarn, detail::read_yarn(g));
  if (d.yarn.factor > 0 && g.find_arch("rope.scaling.yarn_log_multiplier") != nullptr) {
    EXPERTD_TRY_ASSIGN(d.yarn_log_mul, get_f64(g, "rope.scaling.yarn_log_multiplier", {}));
  }
  d.q_lora_rank = static_cast<uint32_t>(qlr);
  d.kv_lora_rank = static_cast<uint32_t>(kvlr);
  d.qk_nope = p.head_dim - p.n_rot;
  d.v_head_dim = static_cast<uint32_t>(vd);
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

const FamilyLoader kDeepSeek3Loader{
    .mla_head = true,
    .read_params = read_ds3_params,
    .load_model = load_ds3,
};

}  // namespace expertd::engine
