#include "engine/ds3_cpu_engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "base/check.h"
#include "base/clock.h"
#include "engine/cpu_engine.h"
#include "engine/cpu_ops.h"
#include "engine/dequant.h"
#include "engine/routing.h"

namespace expertd::engine {
namespace {

float silu(float x) { return static_cast<float>(x / (1.0 + std::exp(-static_cast<double>(x)))); }

// A view of rows [first, first + n) of w.
WeightView rows_of(const Matrix& m, uint64_t first, uint64_t n) {
  WeightView v = m.view();
  v.data += first * v.row_bytes;
  v.rows = n;
  return v;
}

}  // namespace

std::vector<double> ds3_inv_freq(const ModelParams& p) {
  const Ds3Params& d = p.ds3;
  return rope_inv_freq(p.n_rot, p.rope_base, d.yarn);
}

double ds3_kq_scale(const ModelParams& p) {
  const Ds3Params& d = p.ds3;
  double mscale = 1.0;
  if (d.yarn.factor > 1.0 && d.yarn_log_mul > 0.0) {
    mscale = 1.0 + d.yarn_log_mul * std::log(d.yarn.factor);
  }
  return mscale * mscale / std::sqrt(static_cast<double>(p.head_dim));
}

Status check_ds3_engine(const DenseModel& model, const EngineOptions& options,
                        uint32_t max_sequences) {
  const ModelParams& p = model.params();
  if (!p.is_ds3() || model.ds3() == nullptr) {
    return make_error(EINVAL, fmt::format("{}: architecture '{}' is not {}", model.path(),
                                          p.architecture, family_info(Family::DeepSeek3).arch));
  }
  EXPERTD_TRY(check_engine_options(p, options, max_sequences));
  const uint64_t per_pos = uint64_t{p.ds3.kv_lora_rank} + p.n_rot;
  if (uint64_t{p.n_layer} * options.max_context * per_pos * options.sequences >
      (uint64_t{1} << 34)) {
    return make_error(EINVAL,
                      fmt::format("a context of {} positions for {} sequence(s) is too large",
                                  options.max_context, options.sequences));
  }
  return Ok{};
}

Result<std::unique_ptr<Ds3CpuEngine>> Ds3CpuEngine::create(const DenseModel& model,
                                                           ExpertSource& source,
                                                           const EngineOptions& options) {
  EXPERTD_TRY(check_cpu_model(model));
  EXPERTD_TRY(check_ds3_engine(model, options, CpuEngine::kMaxSequences));
  return std::unique_ptr<Ds3CpuEngine>(new Ds3CpuEngine(model, source, options));
}

Ds3CpuEngine::Ds3CpuEngine(const DenseModel& model, ExpertSource& source,
                           const EngineOptions& options)
    : model_(model),
      source_(source),
      p_(model.params()),
      d_(model.params().ds3),
      w_(*model.ds3()),
      opts_(options),
      planner_(model.params(), options) {
  if (opts_.prefetch_width == 0) opts_.prefetch_width = p_.n_expert_used;
  const uint64_t e = p_.n_embd;
  const uint64_t ctx = opts_.max_context;
  const uint64_t lat = d_.kv_lora_rank;
  const uint64_t q_dim = uint64_t{p_.n_head} * p_.head_dim;
  const uint64_t ff =
      std::max<uint64_t>(d_.n_ff, uint64_t{p_.n_ff_exp} * std::max(1u, d_.n_shared));
  inv_freq_ = ds3_inv_freq(p_);
  kq_scale_ = ds3_kq_scale(p_);
  const uint64_t seqs = opts_.sequences;
  latent_.resize(seqs * p_.n_layer * ctx * lat);
  krope_.resize(seqs * p_.n_layer * ctx * p_.n_rot);
  seq_pos_.assign(opts_.sequences, 0);
  x_.resize(e);
  xn_.resize(e);
  qa_.resize(d_.q_lora_rank);
  q_.resize(q_dim);
  kva_.resize(lat + p_.n_rot);
  qabs_.resize(lat);
  olat_.resize(lat);
  oacc_.resize(lat);
  att_.resize(uint64_t{p_.n_head} * d_.v_head_dim);
  scores_.resize(ctx);
  out_.resize(e);
  acc_.resize(e);
  row_.resize(std::max<uint64_t>({e, q_dim, d_.q_lora_rank, lat, d_.qk_nope, ff, att_.size()}));
  router_.resize(p_.n_expert);
  probs_.resize(p_.n_expert);
  sel_.resize(p_.n_expert);
  order_.resize(p_.n_expert);
  selected_.resize(p_.n_expert_used);
  weights_.resize(p_.n_expert_used);
  gate_.resize(ff);
  up_.resize(ff);
  tmp_.resize(e);
  views_.resize(p_.n_expert_used);
  chunk_ = std::min(opts_.prefill_chunk, opts_.max_context);
  const uint64_t c = std::max(chunk_, opts_.sequences);
  const uint32_t k = p_.n_expert_used;
  rseq_.resize(c);
  rpos_.resize(c);
  cx_.resize(c * e);
  cxn_.resize(c * e);
  csel_.resize(c * k);
  cweights_.resize(c * k);
  cout_.resize(c * k * e);
  groups_.reserve(p_.n_expert, c * k);
  exact_.resize(p_.n_expert);
  cgx_.resize(c * e);
  cgate_.resize(c * p_.n_ff_exp);
  cup_.resize(c * p_.n_ff_exp);
  cdown_.resize(c * e);
}

std::string Ds3CpuEngine::description() const {
  return fmt::format("CPU reference engine, {} (f32, f64 accumulation)",
                     family_info(Family::DeepSeek3).arch);
}

bool Ds3CpuEngine::truncate(uint32_t n) {
  if (n > pos_) return false;
  pos_ = n;
  return true;
}

Status Ds3CpuEngine::decode(uint32_t token, std::span<float> logits) {
  EXPERTD_TRY(check_decode(p_, opts_, pos_, token, logits.size()));
  const uint64_t t0 = monotonic_ns();
  const uint64_t e = p_.n_embd;
  const Matrix& embd = model_.token_embd();
  dequantize_row(embd.type, embd.bytes.data() + uint64_t{token} * embd.row_bytes, x_.data(), e);
  planner_.begin_token();
  for (uint32_t layer = 0; layer < p_.n_layer; ++layer) {
    const Ds3LayerWeights& l = w_.layers[layer];
    rms_norm(x_.data(), l.attn_norm.data(), xn_.data(), e, p_.rms_eps);
    attention(cur_, layer, pos_);
    for (uint64_t j = 0; j < e; ++j) x_[j] += out_[j];
    rms_norm(x_.data(), l.ffn_norm.data(), xn_.data(), e, p_.rms_eps);
    if (!source_.set_cursor(pos_, layer)) ++stats_.hint_errors;
    planner_.from_layer(layer);
    add_lookahead(layer, pos_, x_.data());
    flush_hints();
    if (layer < d_.dense_lead) {
      // A dense layer routes nothing: this closes its hints, as routed() does a MoE layer's.
      planner_.routed(layer, {}, stats_, nullptr);
      mlp(l.ffn_gate.view(), l.ffn_up.view(), l.ffn_down.view(), /*add=*/false);
    } else {
      route(layer, pos_, selected_, weights_);
      planner_.routed(layer, selected_, stats_,
                      routing_log_ != nullptr ? &routing_log_->back() : nullptr);
      EXPERTD_TRY(moe(layer));
    }
    for (uint64_t j = 0; j < e; ++j) x_[j] += out_[j];
  }
  cpu_head(model_, x_.data(), xn_.data(), logits.data(), row_.data());
  ++pos_;
  ++stats_.tokens;
  stats_.decode_ns += monotonic_ns() - t0;
  return Ok{};
}

void Ds3CpuEngine::attention(uint32_t seq, uint32_t layer, uint32_t pos) {
  const Ds3LayerWeights& l = w_.layers[layer];
  const uint32_t hd = p_.head_dim;
  const uint32_t nope = d_.qk_nope;
  const uint64_t lat = d_.kv_lora_rank;
  if (d_.q_lora_rank > 0) {
    matvec(l.wq_a.view(), xn_.data(), qa_.data(), row_.data());
    rms_norm(qa_.data(), l.q_a_norm.data(), qa_.data(), d_.q_lora_rank, p_.rms_eps);
    matvec(l.wq_b.view(), qa_.data(), q_.data(), row_.data());
  } else {
    matvec(l.wq.view(), xn_.data(), q_.data(), row_.data());
  }
  // This position's latent and rope key go straight into the cache.
  matvec(l.wkv_a.view(), xn_.data(), kva_.data(), row_.data());
  float* c = latent_.data() + cache_pos(seq, layer, pos) * lat;
  float* kr = krope_.data() + cache_pos(seq, layer, pos) * p_.n_rot;
  rms_norm(kva_.data(), l.kv_a_norm.data(), c, lat, p_.rms_eps);
  std::copy_n(kva_.data() + lat, p_.n_rot, kr);
  rope_pairs(kr, inv_freq_, pos);
  const float* lat0 = latent_.data() + cache_pos(seq, layer, 0) * lat;
  const float* kr0 = krope_.data() + cache_pos(seq, layer, 0) * p_.n_rot;
  const uint32_t n = pos + 1;
  for (uint32_t h = 0; h < p_.n_head; ++h) {
    float* qh = q_.data() + uint64_t{h} * hd;
    rope_pairs(qh + nope, inv_freq_, pos);
    // Absorb k_b into the query: its key part becomes a vector in the latent space.
    matvec(rows_of(l.wk_b, h * lat, lat), qh, qabs_.data(), row_.data());
    for (uint32_t t = 0; t < n; ++t) {
      scores_[t] = (dot(qabs_.data(), lat0 + t * lat, lat) +
                    dot(qh + nope, kr0 + uint64_t{t} * p_.n_rot, p_.n_rot)) *
                   kq_scale_;
    }
    softmax(scores_.data(), n);
    std::fill(oacc_.begin(), oacc_.end(), 0.0);
    for (uint32_t t = 0; t < n; ++t) {
      const float* ct = lat0 + t * lat;
      for (uint64_t j = 0; j < lat; ++j) oacc_[j] += scores_[t] * ct[j];
    }
    for (uint64_t j = 0; j < lat; ++j) olat_[j] = static_cast<float>(oacc_[j]);
    matvec(rows_of(l.wv_b, uint64_t{h} * d_.v_head_dim, d_.v_head_dim), olat_.data(),
           att_.data() + uint64_t{h} * d_.v_head_dim, row_.data());
  }
  matvec(l.wo.view(), att_.data(), out_.data(), row_.data());
}

void Ds3CpuEngine::mlp(const WeightView& gate, const WeightView& up, const WeightView& down,
                       bool add) {
  matvec(gate, xn_.data(), gate_.data(), row_.data());
  matvec(up, xn_.data(), up_.data(), row_.data());
  for (uint64_t j = 0; j < gate.rows; ++j) gate_[j] = silu(gate_[j]) * up_[j];
  matvec(down, gate_.data(), add ? tmp_.data() : out_.data(), row_.data());
  if (add) {
    for (uint64_t j = 0; j < p_.n_embd; ++j) out_[j] += tmp_[j];
  }
}

void Ds3CpuEngine::add_lookahead(uint32_t layer, uint32_t pos, const float* x) {
  for (uint32_t j = 1; j <= opts_.prefetch_depth && layer + j < p_.n_layer; ++j) {
    const uint32_t next = layer + j;
    if (next < d_.dense_lead) continue;  // no experts
    if (opts_.script != nullptr && opts_.hints == HintSource::Script) {
      add_scripted_hints(*opts_.script, pos, layer, next, planner_);
      continue;
    }
    // The next layer's router on this layer's residual, through the next layer's norm.
    const Ds3LayerWeights& w = w_.layers[next];
    rms_norm(x, w.ffn_norm.data(), tmp_.data(), p_.n_embd, p_.rms_eps);
    matvec(w.gate_inp.view(), tmp_.data(), router_.data(), row_.data());
    ds3_hint_probs(d_, w.exp_bias, router_, probs_);
    planner_.add_ranked(next, std::span<const double>(probs_.data(), p_.n_expert));
  }
}

void Ds3CpuEngine::flush_hints() {
  const std::span<const ExpertHint> hints = planner_.take(stats_);
  if (!hints.empty() && !source_.prefetch(hints)) ++stats_.hint_errors;
}

void Ds3CpuEngine::route(uint32_t layer, uint32_t pos, std::span<uint32_t> sel,
                         std::span<float> wts) {
  const Ds3LayerWeights& l = w_.layers[layer];
  if (!take_scripted_route(opts_, pos, layer, sel, wts, stats_)) {
    matvec(l.gate_inp.view(), xn_.data(), router_.data(), row_.data());
    ds3_route(d_, l.exp_bias, router_, p_.n_expert_used, probs_, sel_, order_, sel, wts);
  }
  log_route(routing_log_, pos, layer, sel, wts);
}

Status Ds3CpuEngine::moe(uint32_t layer) {
  const Ds3LayerWeights& l = w_.layers[layer];
  const uint32_t k = p_.n_expert_used;
  const std::span<const uint32_t> experts(selected_.data(), k);
  const uint64_t t0 = monotonic_ns();
  EXPERTD_TRY(source_.get(layer, experts, std::span<ExpertView>(views_.data(), k)));
  stats_.stall_ns += monotonic_ns() - t0;
  stats_.experts_used += k;
  const uint64_t e = p_.n_embd;
  std::fill(acc_.begin(), acc_.end(), 0.0);
  for (uint32_t i = 0; i < k; ++i) {
    const ExpertView& ev = views_[i];
    EXPERTD_CHECK_EQ(ev.layer, layer);
    EXPERTD_CHECK_EQ(ev.expert, selected_[i]);
    matvec(ev.gate, xn_.data(), gate_.data(), row_.data());
    matvec(ev.up, xn_.data(), up_.data(), row_.data());
    for (uint64_t j = 0; j < p_.n_ff_exp; ++j) gate_[j] = silu(gate_[j]) * up_[j];
    matvec(ev.down, gate_.data(), tmp_.data(), row_.data());
    for (uint64_t j = 0; j < e; ++j) acc_[j] += static_cast<double>(weights_[i]) * tmp_[j];
  }
  EXPERTD_TRY(source_.release(std::span<const ExpertView>(views_.data(), k)));
  for (uint64_t j = 0; j < e; ++j) out_[j] = static_cast<float>(acc_[j]);
  if (d_.n_shared > 0) {
    mlp(l.shexp_gate.view(), l.shexp_up.view(), l.shexp_down.view(), /*add=*/true);
  }
  return Ok{};
}

Status Ds3CpuEngine::prefill_chunk(std::span<const uint32_t> tokens, std::span<float> logits) {
  return cpu_prefill_rows(model_, tokens, logits, cur_, pos_,
                          RowsStep{rseq_.data(), rpos_.data(), cx_.data(), xn_.data(), row_.data()},
                          routing_log_, stats_,
                          [this](uint32_t n, uint32_t last) { return rows_forward(n, last); });
}

Status Ds3CpuEngine::rows_forward(uint32_t n, uint32_t last) {
  const uint64_t e = p_.n_embd;
  const uint32_t k = p_.n_expert_used;
  // One pass over the layers, as qwen3moe's prefill: hints dedup over the rows, and the cursor
  // starts at the position before's last layer so this pass's hints target this pass.
  planner_.begin_token();
  cursor_ = last;
  start_prefill_cursor(source_, last, p_.n_layer, stats_);
  for (uint32_t layer = 0; layer < p_.n_layer; ++layer) {
    const Ds3LayerWeights& l = w_.layers[layer];
    planner_.from_layer(layer);
    for (uint32_t i = 0; i < n; ++i) {
      float* x = cx_.data() + i * e;
      rms_norm(x, l.attn_norm.data(), xn_.data(), e, p_.rms_eps);
      attention(rseq_[i], layer, rpos_[i]);
      for (uint64_t j = 0; j < e; ++j) x[j] += out_[j];
      add_lookahead(layer, rpos_[i], x);
      rms_norm(x, l.ffn_norm.data(), cxn_.data() + i * e, e, p_.rms_eps);
      if (layer < d_.dense_lead) {
        std::copy_n(cxn_.data() + i * e, e, xn_.data());
        mlp(l.ffn_gate.view(), l.ffn_up.view(), l.ffn_down.view(), /*add=*/false);
        for (uint64_t j = 0; j < e; ++j) x[j] += out_[j];
      }
    }
    flush_hints();
    if (layer < d_.dense_lead) {
      planner_.routed(layer, {}, stats_, nullptr);  // closes the dense layer's hints
      continue;
    }
    for (uint32_t i = 0; i < n; ++i) {
      std::copy_n(cxn_.data() + i * e, e, xn_.data());
      route(layer, rpos_[i], std::span<uint32_t>(csel_.data() + uint64_t{i} * k, k),
            std::span<float>(cweights_.data() + uint64_t{i} * k, k));
    }
    groups_.build(std::span<const uint32_t>(csel_.data(), uint64_t{n} * k));
    routed_chunk(planner_, layer, groups_.needed(), stats_, routing_log_,
                 routing_log_ != nullptr ? routing_log_->size() - n : 0);
    EXPERTD_TRY(prefill_moe(layer, n));
  }
  return Ok{};
}

Status Ds3CpuEngine::select_sequence(uint32_t sequence) {
  EXPERTD_TRY(Engine::select_sequence(sequence));
  switch_sequence(seq_pos_, cur_, pos_, sequence);
  return Ok{};
}

Status Ds3CpuEngine::decode_batch(std::span<const BatchRow> rows, std::span<float> logits) {
  return cpu_batch_step(*this, model_, opts_.max_context, rows, logits, seq_pos_, cur_, pos_,
                        RowsStep{rseq_.data(), rpos_.data(), cx_.data(), xn_.data(), row_.data()},
                        stats_,
                        [this](uint32_t n, uint32_t last) { return rows_forward(n, last); });
}

Status Ds3CpuEngine::prefill_moe(uint32_t layer, uint32_t n) {
  const Ds3LayerWeights& l = w_.layers[layer];
  const uint32_t k = p_.n_expert_used;
  const uint64_t e = p_.n_embd;
  EXPERTD_TRY(run_chunk_experts(source_, layer, groups_, k, cursor_, cxn_.data(), e, p_.n_ff_exp,
                                cout_.data(),
                                ChunkExperts{views_, exact_, cgx_.data(), cgate_.data(),
                                             cup_.data(), cdown_.data(), row_.data()},
                                stats_));
  // Each position sums its experts in its route's order, then adds the shared experts, as moe().
  for (uint32_t i = 0; i < n; ++i) {
    std::fill(acc_.begin(), acc_.end(), 0.0);
    for (uint32_t s = 0; s < k; ++s) {
      const double wt = cweights_[uint64_t{i} * k + s];
      const float* o = cout_.data() + (uint64_t{i} * k + s) * e;
      for (uint64_t j = 0; j < e; ++j) acc_[j] += wt * static_cast<double>(o[j]);
    }
    for (uint64_t j = 0; j < e; ++j) out_[j] = static_cast<float>(acc_[j]);
    if (d_.n_shared > 0) {
      std::copy_n(cxn_.data() + i * e, e, xn_.data());
      mlp(l.shexp_gate.view(), l.shexp_up.view(), l.shexp_down.view(), /*add=*/true);
    }
    float* x = cx_.data() + i * e;
    for (uint64_t j = 0; j < e; ++j) x[j] += out_[j];
  }
  return Ok{};
}

}  // namespace expertd::engine
