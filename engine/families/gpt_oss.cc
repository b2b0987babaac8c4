// gpt-oss (`gpt-oss`; gpt-oss-20b, gpt-oss-120b) as llama.cpp's converter writes it: the generic
// engines' forward with q/k/v/o, router and expert biases, attention sinks, a sliding window on
// the even layers, the router's softmax over the top-k logits (engine/routing.h gptoss_route), the
// clamped SwiGLU (kGptOssAlpha, kGptOssLimit) and YaRN RoPE.
#include <fmt/format.h>

#include "engine/families/families.h"

namespace expertd::engine {
namespace {

using detail::get_u64;

Status read_gptoss_params(const GgufModel& g, ModelParams& p) {
  p.router = RouterKind::TopkSoftmax;
  p.act = ExpertAct::ClampedSwiglu;
  p.qk_norm = false;
  EXPERTD_TRY_ASSIGN(const uint64_t window,
                     get_u64(g, "attention.sliding_window", {}, 1, uint64_t{1} << 24));
  p.swa_window = static_cast<uint32_t>(window);
  EXPERTD_TRY_ASSIGN(p.yarn, detail::read_yarn(g));
  return Ok{};
}

Status load_gptoss_layer(const GgufModel& g, const detail::Sources& src, const std::string& b,
                         const ModelParams& p, uint32_t /*layer*/, LayerWeights& l) {
  using detail::read_floats;
  using detail::read_vector;
  const uint64_t q_dim = uint64_t{p.n_head} * p.head_dim;
  const uint64_t kv_dim = uint64_t{p.n_head_kv} * p.head_dim;
  EXPERTD_TRY_ASSIGN(l.bq, read_vector(g, src, b + "attn_q.bias", q_dim));
  EXPERTD_TRY_ASSIGN(l.bk, read_vector(g, src, b + "attn_k.bias", kv_dim));
  EXPERTD_TRY_ASSIGN(l.bv, read_vector(g, src, b + "attn_v.bias", kv_dim));
  EXPERTD_TRY_ASSIGN(l.bo, read_vector(g, src, b + "attn_output.bias", p.n_embd));
  EXPERTD_TRY_ASSIGN(l.sinks, read_vector(g, src, b + "attn_sinks.weight", p.n_head));
  EXPERTD_TRY_ASSIGN(l.gate_inp_b, read_vector(g, src, b + "ffn_gate_inp.bias", p.n_expert));
  EXPERTD_TRY_ASSIGN(l.exp_gate_b,
                     read_floats(g, src, b + "ffn_gate_exps.bias", p.n_expert, p.n_ff_exp));
  EXPERTD_TRY_ASSIGN(l.exp_up_b,
                     read_floats(g, src, b + "ffn_up_exps.bias", p.n_expert, p.n_ff_exp));
  EXPERTD_TRY_ASSIGN(l.exp_down_b,
                     read_floats(g, src, b + "ffn_down_exps.bias", p.n_expert, p.n_embd));
  return Ok{};
}

}  // namespace

const FamilyLoader kGptOssLoader{
    .read_params = read_gptoss_params,
    .ffn_norm = "post_attention_norm",
    .load_layer = load_gptoss_layer,
};

}  // namespace expertd::engine
