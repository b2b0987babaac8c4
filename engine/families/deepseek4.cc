// DeepSeek-V4 (`deepseek4`) hyperparameters and dense weights, as llama.cpp's converter writes them
// (conversion/deepseek.py, src/models/deepseek4.cpp): names, shapes and key names are its.
#include <fmt/format.h>

#include <cmath>
#include <cstring>

#include "engine/dequant.h"
#include "engine/families/families.h"

namespace expertd::engine {
namespace {

using detail::key_error;

using detail::get_f64;
using detail::get_u64;
using detail::read_floats;
using detail::read_matrix;
using detail::read_vector;
using detail::Sources;

constexpr uint64_t kMaxRank = 1 << 16;
using detail::kGatingSqrtSoftplus;

// A per-layer array key (or one scalar for every layer), at least n_layer long.
Result<std::vector<double>> per_layer(const GgufModel& g, std::string_view suffix, uint32_t n_layer,
                                      std::optional<double> fallback) {
  const GgufValue* v = g.find_arch(suffix);
  if (v == nullptr) {
    if (!fallback) return key_error(g, suffix, "is missing");
    return std::vector<double>(n_layer, *fallback);
  }
  if (const GgufArray* a = v->as_array()) {
    if (a->count < n_layer) {
      return key_error(
          g, suffix, fmt::format("has {} entries, shorter than block_count {}", a->count, n_layer));
    }
    std::vector<double> out(n_layer);
    for (uint32_t i = 0; i < n_layer; ++i) {
      const auto x = a->float_at(i);
      if (!x || !std::isfinite(*x) || *x < 0) {
        return key_error(g, suffix, fmt::format("entry {} is not a number >= 0", i));
      }
      out[i] = *x;
    }
    return out;
  }
  const auto x = v->as_f64();
  if (!x || !std::isfinite(*x) || *x < 0) return key_error(g, suffix, "is not a number >= 0");
  return std::vector<double>(n_layer, *x);
}

bool has_tensor(const GgufModel& g, const std::string& name) {
  return g.find_tensor(name).has_value();
}

Result<Ds4Compressor> read_compressor(const GgufModel& g, const Sources& src,
                                      const std::string& prefix, uint32_t coff, uint32_t dim,
                                      uint32_t ratio, uint64_t n_embd) {
  Ds4Compressor c;
  c.coff = coff;
  c.dim = dim;
  EXPERTD_TRY_ASSIGN(c.wkv,
                     read_matrix(g, src, prefix + "_kv.weight", uint64_t{coff} * dim, n_embd));
  EXPERTD_TRY_ASSIGN(c.wgate,
                     read_matrix(g, src, prefix + "_gate.weight", uint64_t{coff} * dim, n_embd));
  EXPERTD_TRY_ASSIGN(c.ape,
                     read_floats(g, src, prefix + "_ape.weight", ratio, uint64_t{coff} * dim));
  EXPERTD_TRY_ASSIGN(c.norm, read_vector(g, src, prefix + "_norm.weight", dim));
  return c;
}

Result<std::vector<uint32_t>> read_tid2eid(const GgufModel& g, const Sources& src,
                                           const std::string& name, const ModelParams& p) {
  const auto ref = g.find_tensor(name);
  if (!ref) {
    return make_error(ENOENT,
                      fmt::format("{}: tensor {} is missing (hash layer {} of {} routes by "
                                  "it)",
                                  g.meta().path(), name, name.substr(4, name.find('.', 4) - 4),
                                  p.ds4.hash_layers));
  }
  const GgufTensorInfo& t = *ref->info;
  const std::string& file = g.shards()[ref->shard].path();
  if (t.type != GgmlType::I32) {
    return make_error(EINVAL, fmt::format("{}: tensor {}: type {}, expected i32", file, name,
                                          ggml_type_name(t.type)));
  }
  if (t.ne[0] != p.n_expert_used || t.ne[1] != p.n_vocab || t.ne[2] != 1 || t.ne[3] != 1) {
    return make_error(
        EINVAL, fmt::format("{}: tensor {}: shape [{}, {}, {}, {}], expected [{}, {}]", file, name,
                            t.ne[0], t.ne[1], t.ne[2], t.ne[3], p.n_expert_used, p.n_vocab));
  }
  std::vector<uint8_t> bytes(t.bytes);
  EXPERTD_TRY(src.files[ref->shard]->read_exact(t.offset, bytes));
  std::vector<uint32_t> out(uint64_t{p.n_vocab} * p.n_expert_used);
  if (bytes.size() != out.size() * 4) {
    return make_error(EINVAL, fmt::format("{}: tensor {}: {} bytes, expected {}", file, name,
                                          bytes.size(), out.size() * 4));
  }
  for (size_t i = 0; i < out.size(); ++i) {
    int32_t x;
    std::memcpy(&x, bytes.data() + i * 4, 4);
    if (x < 0 || static_cast<uint32_t>(x) >= p.n_expert) {
      return make_error(EINVAL, fmt::format("{}: tensor {}: token {} maps to expert {}, outside "
                                            "[0, {})",
                                            file, name, i / p.n_expert_used, x, p.n_expert));
    }
    out[i] = static_cast<uint32_t>(x);
  }
  return out;
}

}  // namespace

Status read_ds4_params(const GgufModel& g, ModelParams& p) {
  Ds4Params& d = p.ds4;
  if (p.n_head_kv != 1) {
    return Error{EINVAL,
                 fmt::format("{}: {} = {}: deepseek4 attention has one shared KV head",
                             g.meta().path(), g.arch_key("attention.head_count_kv"), p.n_head_kv)};
  }
  const uint32_t n_all = p.n_layer;
  EXPERTD_TRY(read_nextn(g, p));
  EXPERTD_TRY_ASSIGN(const uint64_t qlr, get_u64(g, "attention.q_lora_rank", {}, 1, kMaxRank));
  EXPERTD_TRY_ASSIGN(const uint64_t og,
                     get_u64(g, "attention.output_group_count", {}, 1, p.n_head));
  EXPERTD_TRY_ASSIGN(const uint64_t olr, get_u64(g, "attention.output_lora_rank", {}, 1, kMaxRank));
  if (p.n_head % og != 0) {
    return key_error(g, "attention.output_group_count",
                     fmt::format("= {} does not divide {} heads", og, p.n_head));
  }
  EXPERTD_TRY_ASSIGN(const uint64_t window,
                     get_u64(g, "attention.sliding_window", {}, 1, uint64_t{1} << 24));
  EXPERTD_TRY_ASSIGN(const std::vector<double> ratios,
                     per_layer(g, "attention.compress_ratios", n_all, std::nullopt));
  if (g.find_arch("attention.compress_ratios") != nullptr &&
      g.find_arch("attention.compress_ratios")->as_array() == nullptr) {
    return key_error(g, "attention.compress_ratios", "is not an array");
  }
  EXPERTD_TRY_ASSIGN(const double crb, get_f64(g, "attention.compress_rope_freq_base", {}));
  EXPERTD_TRY_ASSIGN(const uint64_t hc, get_u64(g, "hyper_connection.count", {}, 1, 64));
  EXPERTD_TRY_ASSIGN(const uint64_t hc_iters,
                     get_u64(g, "hyper_connection.sinkhorn_iterations", {}, 1, 1000));
  EXPERTD_TRY_ASSIGN(const double hc_eps, get_f64(g, "hyper_connection.epsilon", {}));
  EXPERTD_TRY_ASSIGN(const uint64_t hash, get_u64(g, "hash_layer_count", 0, 0, p.n_layer));
  EXPERTD_TRY_ASSIGN(const uint64_t ih, get_u64(g, "attention.indexer.head_count", {}, 1, 4096));
  EXPERTD_TRY_ASSIGN(const uint64_t idim, get_u64(g, "attention.indexer.key_length", {}, 2, 4096));
  EXPERTD_TRY_ASSIGN(const uint64_t itopk,
                     get_u64(g, "attention.indexer.top_k", {}, 1, uint64_t{1} << 24));
  EXPERTD_TRY_ASSIGN(const uint64_t n_shared, get_u64(g, "expert_shared_count", 0, 0, 16));
  EXPERTD_TRY_ASSIGN(const double wscale, get_f64(g, "expert_weights_scale", 1.0));
  EXPERTD_TRY_ASSIGN(const uint64_t gating, get_u64(g, "expert_gating_func", {}, 0, 1000));
  if (gating != kGatingSqrtSoftplus) {
    return key_error(g, "expert_gating_func",
                     fmt::format("= {}: deepseek4 routers score with sqrtsoftplus ({})", gating,
                                 kGatingSqrtSoftplus));
  }
  bool wnorm = true;
  if (const GgufValue* v = g.find_arch("expert_weights_norm")) {
    const auto b = v->as_bool();
    if (!b) return key_error(g, "expert_weights_norm", "is not a bool");
    wnorm = *b;
  }
  EXPERTD_TRY_ASSIGN(const std::vector<double> clamp_exp,
                     per_layer(g, "swiglu_clamp_exp", n_all, 0.0));
  EXPERTD_TRY_ASSIGN(std::vector<double> clamp_sh, per_layer(g, "swiglu_clamp_shexp", n_all, -1.0));
  if (g.find_arch("swiglu_clamp_shexp") == nullptr) clamp_sh = clamp_exp;
  if (p.n_rot > p.head_dim || p.n_rot > idim || p.n_rot % 2 != 0) {
    return key_error(g, "rope.dimension_count",
                     fmt::format("= {} must be even and at most head_dim {} and the indexer's "
                                 "key_length {}",
                                 p.n_rot, p.head_dim, idim));
  }
  EXPERTD_TRY_ASSIGN(const Yarn yarn, detail::read_yarn(g));
  d.yarn_factor = yarn.factor;
  d.yarn_orig_ctx = yarn.orig_ctx;
  d.yarn_beta_fast = yarn.beta_fast;
  d.yarn_beta_slow = yarn.beta_slow;
  d.q_lora_rank = static_cast<uint32_t>(qlr);
  d.o_groups = static_cast<uint32_t>(og);
  d.o_lora_rank = static_cast<uint32_t>(olr);
  d.window = static_cast<uint32_t>(window);
  d.compress_rope_base = crb;
  d.hc = static_cast<uint32_t>(hc);
  d.hc_iters = static_cast<uint32_t>(hc_iters);
  d.hc_eps = static_cast<float>(hc_eps);
  d.hash_layers = static_cast<uint32_t>(hash);
  d.index_heads = static_cast<uint32_t>(ih);
  d.index_dim = static_cast<uint32_t>(idim);
  d.index_topk = static_cast<uint32_t>(itopk);
  d.n_shared = static_cast<uint32_t>(n_shared);
  d.weights_scale = static_cast<float>(wscale);
  d.weights_norm = wnorm;
  d.compress_ratio.clear();
  d.attention.clear();
  for (uint32_t i = 0; i < p.n_layer; ++i) {
    const double r = ratios[i];
    if (r != std::floor(r) || r > 1 << 20 || (r != 0 && r < 2)) {
      return key_error(g, "attention.compress_ratios",
                       fmt::format("entry {} = {} is not 0 or an integer >= 2", i, r));
    }
    d.compress_ratio.push_back(static_cast<uint32_t>(r));
    // CSA layers carry the Lightning Indexer; HCA layers compress without one.
    d.attention.push_back(r == 0 ? Ds4Attention::Sliding
                          : has_tensor(g, fmt::format("blk.{}.indexer.proj.weight", i))
                              ? Ds4Attention::Compressed
                              : Ds4Attention::Heavy);
    d.clamp_exp.push_back(static_cast<float>(clamp_exp[i]));
    d.clamp_shexp.push_back(static_cast<float>(clamp_sh[i]));
  }
  return Ok{};
}

Status load_ds4(DenseModel& m) {
  const GgufModel& g = m.gguf();
  const ModelParams& p = m.params();
  const Ds4Params& d = p.ds4;
  EXPERTD_TRY_ASSIGN(
      Sources src, detail::open_sources(g, m.deferred() ? DenseLoad::Deferred : DenseLoad::Eager));
  auto w = std::make_unique<Ds4Weights>();
  const uint64_t e = p.n_embd;
  const uint64_t hc_dim = uint64_t{d.hc} * e;
  const uint64_t mix = uint64_t{2 + d.hc} * d.hc;
  const uint64_t q_dim = uint64_t{p.n_head} * p.head_dim;
  const uint64_t ff_sh = uint64_t{p.n_ff_exp} * d.n_shared;
  EXPERTD_TRY_ASSIGN(w->hc_head_fn, read_matrix(g, src, "output_hc_fn.weight", d.hc, hc_dim));
  EXPERTD_TRY_ASSIGN(w->hc_head_base, read_vector(g, src, "output_hc_base.weight", d.hc));
  EXPERTD_TRY_ASSIGN(const std::vector<float> hs, read_vector(g, src, "output_hc_scale.weight", 1));
  w->hc_head_scale = hs[0];
  w->layers.resize(p.n_layer);
  for (uint32_t i = 0; i < p.n_layer; ++i) {
    Ds4LayerWeights& l = w->layers[i];
    const std::string b = fmt::format("blk.{}.", i);
    EXPERTD_TRY_ASSIGN(l.hc_attn_fn, read_matrix(g, src, b + "hc_attn_fn.weight", mix, hc_dim));
    EXPERTD_TRY_ASSIGN(l.hc_attn_base, read_vector(g, src, b + "hc_attn_base.weight", mix));
    EXPERTD_TRY_ASSIGN(l.hc_attn_scale, read_vector(g, src, b + "hc_attn_scale.weight", 3));
    EXPERTD_TRY_ASSIGN(l.hc_ffn_fn, read_matrix(g, src, b + "hc_ffn_fn.weight", mix, hc_dim));
    EXPERTD_TRY_ASSIGN(l.hc_ffn_base, read_vector(g, src, b + "hc_ffn_base.weight", mix));
    EXPERTD_TRY_ASSIGN(l.hc_ffn_scale, read_vector(g, src, b + "hc_ffn_scale.weight", 3));
    EXPERTD_TRY_ASSIGN(l.attn_norm, read_vector(g, src, b + "attn_norm.weight", e));
    EXPERTD_TRY_ASSIGN(l.sinks, read_vector(g, src, b + "attn_sinks.weight", p.n_head));
    EXPERTD_TRY_ASSIGN(l.wq_a, read_matrix(g, src, b + "attn_q_a.weight", d.q_lora_rank, e));
    EXPERTD_TRY_ASSIGN(l.q_a_norm, read_vector(g, src, b + "attn_q_a_norm.weight", d.q_lora_rank));
    EXPERTD_TRY_ASSIGN(l.wq_b, read_matrix(g, src, b + "attn_q_b.weight", q_dim, d.q_lora_rank));
    EXPERTD_TRY_ASSIGN(l.wkv, read_matrix(g, src, b + "attn_kv.weight", p.head_dim, e));
    EXPERTD_TRY_ASSIGN(l.kv_norm, read_vector(g, src, b + "attn_kv_a_norm.weight", p.head_dim));
    EXPERTD_TRY_ASSIGN(l.wo_a,
                       read_matrix(g, src, b + "attn_output_a.weight",
                                   uint64_t{d.o_groups} * d.o_lora_rank, q_dim / d.o_groups));
    EXPERTD_TRY_ASSIGN(l.wo_b, read_matrix(g, src, b + "attn_output_b.weight", e,
                                           uint64_t{d.o_groups} * d.o_lora_rank));
    const uint32_t ratio = d.compress_ratio[i];
    if (d.attention[i] != Ds4Attention::Sliding) {
      const bool csa = d.attention[i] == Ds4Attention::Compressed;
      EXPERTD_TRY_ASSIGN(l.compressor, read_compressor(g, src, b + "attn_compressor", csa ? 2 : 1,
                                                       p.head_dim, ratio, e));
      if (csa) {
        EXPERTD_TRY_ASSIGN(l.index_comp, read_compressor(g, src, b + "indexer_compressor", 2,
                                                         d.index_dim, ratio, e));
        EXPERTD_TRY_ASSIGN(l.index_q_b,
                           read_matrix(g, src, b + "indexer.attn_q_b.weight",
                                       uint64_t{d.index_heads} * d.index_dim, d.q_lora_rank));
        EXPERTD_TRY_ASSIGN(l.index_proj,
                           read_matrix(g, src, b + "indexer.proj.weight", d.index_heads, e));
      }
    }
    EXPERTD_TRY_ASSIGN(l.ffn_norm, read_vector(g, src, b + "ffn_norm.weight", e));
    EXPERTD_TRY_ASSIGN(l.gate_inp, read_matrix(g, src, b + "ffn_gate_inp.weight", p.n_expert, e));
    if (i < d.hash_layers) {
      EXPERTD_TRY_ASSIGN(l.tid2eid, read_tid2eid(g, src, b + "ffn_gate_tid2eid.weight", p));
    } else {
      EXPERTD_TRY_ASSIGN(l.exp_bias, read_vector(g, src, b + "exp_probs_b.bias", p.n_expert));
    }
    if (d.n_shared > 0) {
      EXPERTD_TRY_ASSIGN(l.shexp_gate, read_matrix(g, src, b + "ffn_gate_shexp.weight", ff_sh, e));
      EXPERTD_TRY_ASSIGN(l.shexp_up, read_matrix(g, src, b + "ffn_up_shexp.weight", ff_sh, e));
      EXPERTD_TRY_ASSIGN(l.shexp_down, read_matrix(g, src, b + "ffn_down_shexp.weight", e, ff_sh));
    }
  }
  m.ds4_ = std::move(w);
  return Ok{};
}

uint64_t ds4_dense_bytes(const Ds4Weights& w, bool held) {
  auto vec = [](const std::vector<float>& v) { return v.size() * sizeof(float); };
  uint64_t n = vec(w.hc_head_base);
  ds4_for_each_matrix(w, [&](const Matrix& m) { n += held ? m.bytes.size() : m.size(); });
  for (const Ds4LayerWeights& l : w.layers) {
    for (const auto* c : {&l.compressor, &l.index_comp}) {
      if (*c) n += vec((*c)->ape);
    }
    n += vec(l.attn_norm) + vec(l.ffn_norm) + vec(l.q_a_norm) + vec(l.kv_norm) + vec(l.sinks) +
         vec(l.exp_bias) + l.tid2eid.size() * sizeof(uint32_t);
  }
  return n;
}

const FamilyLoader kDeepSeek4Loader{
    .read_params = read_ds4_params,
    .load_model = load_ds4,
};

}  // namespace expertd::engine
