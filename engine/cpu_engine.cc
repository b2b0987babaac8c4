#include "engine/cpu_engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "base/check.h"
#include "engine/cpu_ops.h"
#include "engine/dequant.h"
#include "engine/ds4_cpu_engine.h"

namespace expertd::engine {
namespace {

float silu(float x) { return static_cast<float>(x / (1.0 + std::exp(-static_cast<double>(x)))); }

}  // namespace

Result<std::unique_ptr<CpuEngine>> CpuEngine::create(const DenseModel& model, ExpertSource& source,
                                                     const EngineOptions& options) {
  const ModelParams& p = model.params();
  if (p.architecture != "qwen3moe") {
    return make_error(EINVAL, fmt::format("{}: CpuEngine runs qwen3moe, not '{}' (use "
                                          "create_cpu_engine)",
                                          model.path(), p.architecture));
  }
  EXPERTD_TRY(check_engine_options(p, options));
  const uint64_t kv_values = uint64_t{p.n_layer} * options.max_context * p.n_head_kv * p.head_dim;
  if (kv_values > (uint64_t{1} << 34)) {  // 64 GiB per cache: a typo, not a plan
    return make_error(EINVAL, fmt::format("a KV cache of {} positions needs {} GiB",
                                          options.max_context, kv_values * 8 >> 30));
  }
  return std::unique_ptr<CpuEngine>(new CpuEngine(model, source, options));
}

CpuEngine::CpuEngine(const DenseModel& model, ExpertSource& source, const EngineOptions& options)
    : model_(model),
      source_(source),
      p_(model.params()),
      opts_(options),
      planner_(model.params(), options) {
  if (opts_.prefetch_width == 0) opts_.prefetch_width = p_.n_expert_used;
  kv_dim_ = uint64_t{p_.n_head_kv} * p_.head_dim;
  const uint64_t q_dim = uint64_t{p_.n_head} * p_.head_dim;
  k_cache_.resize(uint64_t{p_.n_layer} * opts_.max_context * kv_dim_);
  v_cache_.resize(k_cache_.size());
  x_.resize(p_.n_embd);
  xn_.resize(p_.n_embd);
  q_.resize(q_dim);
  k_.resize(kv_dim_);
  v_.resize(kv_dim_);
  att_.resize(q_dim);
  tmp_.resize(p_.n_embd);
  row_.resize(std::max<uint64_t>({p_.n_embd, q_dim, p_.n_ff_exp}));
  scores_.resize(opts_.max_context);
  acc_.resize(std::max(p_.n_embd, p_.head_dim));
  router_.resize(p_.n_expert);
  probs_.resize(p_.n_expert);
  order_.resize(p_.n_expert);
  selected_.resize(p_.n_expert_used);
  weights_.resize(p_.n_expert_used);
  gate_.resize(p_.n_ff_exp);
  up_.resize(p_.n_ff_exp);
  views_.resize(p_.n_expert_used);
  pxn_.resize(p_.n_embd);
}

std::string CpuEngine::description() const {
  return "CPU reference engine (f32, f64 accumulation)";
}

Status CpuEngine::decode(uint32_t token, std::span<float> logits) {
  EXPERTD_TRY(check_decode(p_, opts_, pos_, token, logits.size()));
  const uint64_t t0 = monotonic_ns();
  const Matrix& embd = model_.token_embd();
  dequantize_row(embd.type, embd.bytes.data() + uint64_t{token} * embd.row_bytes, x_.data(),
                 p_.n_embd);
  planner_.begin_token();
  for (uint32_t layer = 0; layer < p_.n_layer; ++layer) {
    if (!source_.set_cursor(pos_, layer)) ++stats_.hint_errors;
    attention(layer);
    send_hints(layer);
    route(layer);
    EXPERTD_TRY(moe(layer));
  }
  rms_norm(x_.data(), model_.output_norm().data(), xn_.data(), p_.n_embd, p_.rms_eps);
  matvec(model_.output().view(), xn_.data(), logits.data(), row_.data());
  ++pos_;
  ++stats_.tokens;
  stats_.decode_ns += monotonic_ns() - t0;
  return Ok{};
}

void CpuEngine::attention(uint32_t layer) {
  const LayerWeights& w = model_.layer(layer);
  const uint32_t hd = p_.head_dim;
  rms_norm(x_.data(), w.attn_norm.data(), xn_.data(), p_.n_embd, p_.rms_eps);
  matvec(w.wq.view(), xn_.data(), q_.data(), row_.data());
  matvec(w.wk.view(), xn_.data(), k_.data(), row_.data());
  matvec(w.wv.view(), xn_.data(), v_.data(), row_.data());
  for (uint32_t h = 0; h < p_.n_head; ++h) {
    float* q = q_.data() + uint64_t{h} * hd;
    rms_norm(q, w.q_norm.data(), q, hd, p_.rms_eps);
    rope_neox(q, p_.n_rot, pos_, p_.rope_base);
  }
  for (uint32_t h = 0; h < p_.n_head_kv; ++h) {
    float* k = k_.data() + uint64_t{h} * hd;
    rms_norm(k, w.k_norm.data(), k, hd, p_.rms_eps);
    rope_neox(k, p_.n_rot, pos_, p_.rope_base);
  }
  std::copy(k_.begin(), k_.end(), k_cache_.begin() + static_cast<int64_t>(kv_index(layer, pos_)));
  std::copy(v_.begin(), v_.end(), v_cache_.begin() + static_cast<int64_t>(kv_index(layer, pos_)));

  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  const uint32_t group = p_.n_head / p_.n_head_kv;  // query heads sharing one kv head
  for (uint32_t h = 0; h < p_.n_head; ++h) {
    const float* q = q_.data() + uint64_t{h} * hd;
    const uint64_t kv_off = uint64_t{h / group} * hd;
    for (uint32_t t = 0; t <= pos_; ++t) {
      scores_[t] = dot(q, k_cache_.data() + kv_index(layer, t) + kv_off, hd) * scale;
    }
    softmax(scores_.data(), pos_ + 1);
    std::fill(acc_.begin(), acc_.begin() + hd, 0.0);
    for (uint32_t t = 0; t <= pos_; ++t) {
      const float* v = v_cache_.data() + kv_index(layer, t) + kv_off;
      for (uint32_t i = 0; i < hd; ++i) acc_[i] += scores_[t] * static_cast<double>(v[i]);
    }
    for (uint32_t i = 0; i < hd; ++i) att_[uint64_t{h} * hd + i] = static_cast<float>(acc_[i]);
  }
  matvec(w.wo.view(), att_.data(), tmp_.data(), row_.data());
  for (uint32_t i = 0; i < p_.n_embd; ++i) x_[i] += tmp_[i];
}

void CpuEngine::send_hints(uint32_t layer) {
  planner_.from_layer(layer);
  for (uint32_t j = 1; j <= opts_.prefetch_depth && layer + j < p_.n_layer; ++j) {
    const uint32_t next = layer + j;
    if (opts_.script != nullptr && opts_.hints == HintSource::Script) {
      add_scripted_hints(*opts_.script, pos_, layer, next, planner_);
      continue;
    }
    const LayerWeights& w = model_.layer(next);
    rms_norm(x_.data(), w.ffn_norm.data(), pxn_.data(), p_.n_embd, p_.rms_eps);
    matvec(w.gate_inp.view(), pxn_.data(), router_.data(), row_.data());
    for (uint32_t e = 0; e < p_.n_expert; ++e) probs_[e] = router_[e];
    softmax(probs_.data(), p_.n_expert);
    planner_.add_ranked(next, std::span<const double>(probs_.data(), p_.n_expert));
  }
  const std::span<const ExpertHint> hints = planner_.take(stats_);
  if (hints.empty()) return;
  if (!source_.prefetch(hints)) ++stats_.hint_errors;
}

void CpuEngine::route(uint32_t layer) {
  const LayerWeights& w = model_.layer(layer);
  const uint32_t k = p_.n_expert_used;
  rms_norm(x_.data(), w.ffn_norm.data(), xn_.data(), p_.n_embd, p_.rms_eps);
  if (!take_scripted_route(opts_, pos_, layer, selected_, weights_, stats_)) {
    matvec(w.gate_inp.view(), xn_.data(), router_.data(), row_.data());
    for (uint32_t e = 0; e < p_.n_expert; ++e) probs_[e] = router_[e];
    softmax(probs_.data(), p_.n_expert);
    top_indices(std::span<const double>(probs_), order_, k);
    double sum = 0.0;
    for (uint32_t i = 0; i < k; ++i) sum += probs_[order_[i]];
    for (uint32_t i = 0; i < k; ++i) {
      selected_[i] = order_[i];
      const double pr = probs_[order_[i]];
      weights_[i] = static_cast<float>(p_.norm_topk ? pr / sum : pr);
    }
  }
  RoutingRecord* rec = log_route(routing_log_, pos_, layer, selected_, weights_);
  planner_.routed(layer, std::span<const uint32_t>(selected_.data(), k), stats_, rec);
}

Status CpuEngine::moe(uint32_t layer) {
  const uint32_t k = p_.n_expert_used;
  const uint64_t t0 = monotonic_ns();
  EXPERTD_TRY(source_.get(layer, std::span<const uint32_t>(selected_.data(), k),
                          std::span<ExpertView>(views_.data(), k)));
  stats_.stall_ns += monotonic_ns() - t0;
  stats_.experts_used += k;
  std::fill(acc_.begin(), acc_.begin() + p_.n_embd, 0.0);
  for (uint32_t i = 0; i < k; ++i) {
    const ExpertView& ev = views_[i];
    EXPERTD_CHECK_EQ(ev.layer, layer);
    EXPERTD_CHECK_EQ(ev.expert, selected_[i]);
    matvec(ev.gate, xn_.data(), gate_.data(), row_.data());
    matvec(ev.up, xn_.data(), up_.data(), row_.data());
    for (uint32_t j = 0; j < p_.n_ff_exp; ++j) gate_[j] = silu(gate_[j]) * up_[j];
    matvec(ev.down, gate_.data(), tmp_.data(), row_.data());
    for (uint32_t j = 0; j < p_.n_embd; ++j) {
      acc_[j] += static_cast<double>(weights_[i]) * static_cast<double>(tmp_[j]);
    }
  }
  EXPERTD_TRY(source_.release(std::span<const ExpertView>(views_.data(), k)));
  for (uint32_t j = 0; j < p_.n_embd; ++j) x_[j] += static_cast<float>(acc_[j]);
  return Ok{};
}

Result<std::unique_ptr<Engine>> create_cpu_engine(const DenseModel& model, ExpertSource& source,
                                                  const EngineOptions& options) {
  if (model.params().is_ds4()) {
    EXPERTD_TRY_ASSIGN(auto e, Ds4CpuEngine::create(model, source, options));
    return std::unique_ptr<Engine>(std::move(e));
  }
  EXPERTD_TRY_ASSIGN(auto e, CpuEngine::create(model, source, options));
  return std::unique_ptr<Engine>(std::move(e));
}

}  // namespace expertd::engine
