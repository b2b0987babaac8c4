#include "engine/cpu_engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "base/check.h"
#include "engine/cpu_ops.h"
#include "engine/dequant.h"
#include "engine/ds3_cpu_engine.h"
#include "engine/ds4_cpu_engine.h"
#include "engine/routing.h"

namespace expertd::engine {
namespace {

float silu(float x) { return static_cast<float>(x / (1.0 + std::exp(-static_cast<double>(x)))); }

// y[i][r] += b[r] for n rows of b.size() floats, `stride` apart (no-op for an empty bias).
void add_bias(float* y, std::span<const float> b, uint64_t n = 1, uint64_t stride = 0) {
  for (uint64_t i = 0; i < n; ++i) {
    for (uint64_t r = 0; r < b.size(); ++r) y[i * stride + r] += b[r];
  }
}

// Row `expert` of a per-expert bias ([n_expert][len]; empty when the model has none).
std::span<const float> expert_row(const std::vector<float>& b, uint32_t expert, uint64_t len) {
  if (b.empty()) return {};
  return {b.data() + uint64_t{expert} * len, len};
}

// gpt-oss's clamped SwiGLU over n rows of ff on the biased gate and up of `expert`.
void oai_swiglu(const LayerWeights& w, uint32_t expert, float* gate, const float* up, uint64_t n,
                uint64_t ff) {
  const float* bg = w.exp_gate_b.data() + uint64_t{expert} * ff;
  const float* bu = w.exp_up_b.data() + uint64_t{expert} * ff;
  for (uint64_t j = 0; j < n * ff; ++j) {
    const double g = std::min(gate[j] + bg[j % ff], kGptOssLimit);
    const double u = std::clamp(up[j] + bu[j % ff], -kGptOssLimit, kGptOssLimit);
    gate[j] = static_cast<float>((u + 1.0) * g / (1.0 + std::exp(-kGptOssAlpha * g)));
  }
}

// The experts' activation over n rows of n_ff: gate[j] = silu(gate[j]) * up[j], or gpt-oss's
// clamped SwiGLU on the biased gate and up of `expert`.
void expert_activation(const ModelParams& p, const LayerWeights& w, uint32_t expert, float* gate,
                       const float* up, uint64_t n) {
  const uint64_t ff = p.n_ff_exp;
  if (p.act == ExpertAct::ClampedSwiglu) {
    oai_swiglu(w, expert, gate, up, n, ff);
    return;
  }
  for (uint64_t j = 0; j < n * ff; ++j) gate[j] = silu(gate[j]) * up[j];
}

}  // namespace

Result<std::unique_ptr<CpuEngine>> CpuEngine::create(const DenseModel& model, ExpertSource& source,
                                                     const EngineOptions& options) {
  const ModelParams& p = model.params();
  if (family_info(p.family).engine != EngineClass::Generic) {
    return make_error(EINVAL, fmt::format("{}: CpuEngine runs {}, not '{}' (use create_cpu_engine)",
                                          model.path(), family_list([](const FamilyInfo& f) {
                                            return f.engine == EngineClass::Generic;
                                          }),
                                          p.architecture));
  }
  EXPERTD_TRY(check_cpu_model(model));
  EXPERTD_TRY(check_engine_options(p, options, kMaxSequences));
  const uint64_t kv_values =
      uint64_t{options.sequences} * p.n_layer * options.max_context * p.n_head_kv * p.head_dim;
  if (kv_values > (uint64_t{1} << 34)) {  // 64 GiB per cache: a typo, not a plan
    return make_error(EINVAL,
                      fmt::format("KV caches of {} positions for {} sequence(s) need {} GiB",
                                  options.max_context, options.sequences, kv_values * 8 >> 30));
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
  k_cache_.resize(uint64_t{opts_.sequences} * p_.n_layer * opts_.max_context * kv_dim_);
  seq_pos_.assign(opts_.sequences, 0);
  v_cache_.resize(k_cache_.size());
  x_.resize(p_.n_embd);
  xn_.resize(p_.n_embd);
  q_.resize(q_dim);
  k_.resize(kv_dim_);
  v_.resize(kv_dim_);
  att_.resize(q_dim);
  tmp_.resize(p_.n_embd);
  // glm4moe's dense MLP and shared expert are wider than a routed expert.
  const uint64_t ff = std::max<uint64_t>(
      {p_.n_ff_exp, p_.sigmoid_moe.n_ff, uint64_t{p_.n_ff_exp} * p_.sigmoid_moe.n_shared});
  row_.resize(std::max<uint64_t>({p_.n_embd, q_dim, ff}));
  scores_.resize(opts_.max_context + 1);  // + gpt-oss's sink
  acc_.resize(std::max(p_.n_embd, p_.head_dim));
  router_.resize(p_.n_expert);
  probs_.resize(p_.n_expert);
  sel_.resize(p_.n_expert);
  order_.resize(p_.n_expert);
  selected_.resize(p_.n_expert_used);
  weights_.resize(p_.n_expert_used);
  topk_.resize(p_.n_expert_used);
  gate_.resize(ff);
  up_.resize(ff);
  views_.resize(p_.n_expert_used);
  pxn_.resize(p_.n_embd);
  // A batch step is a chunk of one row per sequence.
  chunk_ = std::max(std::min(opts_.prefill_chunk, opts_.max_context), opts_.sequences);
  const uint64_t c = chunk_;
  const uint32_t k = p_.n_expert_used;
  rseq_.resize(c);
  rpos_.resize(c);
  cx_.resize(c * p_.n_embd);
  cxn_.resize(c * p_.n_embd);
  cq_.resize(c * q_dim);
  ck_.resize(c * kv_dim_);
  cv_.resize(c * kv_dim_);
  catt_.resize(c * q_dim);
  ctmp_.resize(c * p_.n_embd);
  clogits_.resize(c * p_.n_expert);
  csel_.resize(c * k);
  cweights_.resize(c * k);
  cout_.resize(c * k * p_.n_embd);
  groups_.reserve(p_.n_expert, c * k);
  exact_.resize(p_.n_expert);
  cgx_.resize(c * p_.n_embd);
  cgate_.resize(c * ff);
  cup_.resize(c * ff);
  cdown_.resize(c * p_.n_embd);
  if (p_.yarn.factor > 0.0) {
    // gpt-oss's config says truncate: false (the GGUF has no key for it).
    inv_freq_ = rope_inv_freq(p_.n_rot, p_.rope_base, p_.yarn, /*truncate=*/false);
    mscale_ = yarn_mscale(p_.yarn.factor);
  }
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
  cpu_head(model_, x_.data(), xn_.data(), logits.data(), row_.data());
  ++pos_;
  ++stats_.tokens;
  stats_.decode_ns += monotonic_ns() - t0;
  return Ok{};
}

void CpuEngine::attention(uint32_t layer) {
  const LayerWeights& w = model_.layer(layer);
  rms_norm(x_.data(), w.attn_norm.data(), xn_.data(), p_.n_embd, p_.rms_eps);
  matvec(w.wq.view(), xn_.data(), q_.data(), row_.data());
  matvec(w.wk.view(), xn_.data(), k_.data(), row_.data());
  matvec(w.wv.view(), xn_.data(), v_.data(), row_.data());
  add_bias(q_.data(), w.bq);
  add_bias(k_.data(), w.bk);
  add_bias(v_.data(), w.bv);
  place_qkv(cur_, layer, pos_, q_.data(), k_.data(), v_.data());
  attend(cur_, layer, pos_, q_.data(), att_.data());
  matvec(w.wo.view(), att_.data(), tmp_.data(), row_.data());
  add_bias(tmp_.data(), w.bo);
  for (uint32_t i = 0; i < p_.n_embd; ++i) x_[i] += tmp_[i];
}

void CpuEngine::place_qkv(uint32_t seq, uint32_t layer, uint32_t pos, float* q_all, float* k_all,
                          const float* v) {
  const LayerWeights& w = model_.layer(layer);
  const uint32_t hd = p_.head_dim;
  for (uint32_t h = 0; h < p_.n_head; ++h) {
    float* q = q_all + uint64_t{h} * hd;
    if (p_.qk_norm) rms_norm(q, w.q_norm.data(), q, hd, p_.rms_eps);
    rotate(q, pos);
  }
  for (uint32_t h = 0; h < p_.n_head_kv; ++h) {
    float* k = k_all + uint64_t{h} * hd;
    if (p_.qk_norm) rms_norm(k, w.k_norm.data(), k, hd, p_.rms_eps);
    rotate(k, pos);
  }
  std::copy_n(k_all, kv_dim_, k_cache_.begin() + static_cast<int64_t>(kv_index(seq, layer, pos)));
  std::copy_n(v, kv_dim_, v_cache_.begin() + static_cast<int64_t>(kv_index(seq, layer, pos)));
}

void CpuEngine::rotate(float* v, uint32_t pos) const {
  if (inv_freq_.empty()) {
    rope(p_.rope, v, p_.n_rot, pos, p_.rope_base);
  } else {
    rope_neox_freqs(v, p_.n_rot, pos, inv_freq_.data(), mscale_);
  }
}

void CpuEngine::attend(uint32_t seq, uint32_t layer, uint32_t pos, const float* q_all, float* att) {
  const uint32_t hd = p_.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  const uint32_t group = p_.n_head / p_.n_head_kv;  // query heads sharing one kv head
  // A sliding layer sees its last swa_window positions (transformers' and llama.cpp's window).
  const uint32_t first = p_.sliding(layer) && pos >= p_.swa_window ? pos + 1 - p_.swa_window : 0;
  const std::vector<float>& sinks = model_.layer(layer).sinks;
  for (uint32_t h = 0; h < p_.n_head; ++h) {
    const float* q = q_all + uint64_t{h} * hd;
    const uint64_t kv_off = uint64_t{h / group} * hd;
    for (uint32_t t = first; t <= pos; ++t) {
      scores_[t] = dot(q, k_cache_.data() + kv_index(seq, layer, t) + kv_off, hd) * scale;
    }
    if (sinks.empty()) {
      softmax(scores_.data() + first, pos + 1 - first);
    } else {
      // gpt-oss's sink: one more logit in the softmax's denominator whose value is dropped.
      scores_[pos + 1] = sinks[h];
      softmax(scores_.data() + first, pos + 2 - first);
    }
    std::fill(acc_.begin(), acc_.begin() + hd, 0.0);
    for (uint32_t t = first; t <= pos; ++t) {
      const float* v = v_cache_.data() + kv_index(seq, layer, t) + kv_off;
      for (uint32_t i = 0; i < hd; ++i) acc_[i] += scores_[t] * static_cast<double>(v[i]);
    }
    for (uint32_t i = 0; i < hd; ++i) att[uint64_t{h} * hd + i] = static_cast<float>(acc_[i]);
  }
}

void CpuEngine::send_hints(uint32_t layer) {
  planner_.from_layer(layer);
  for (uint32_t j = 1; j <= opts_.prefetch_depth && layer + j < p_.n_layer; ++j) {
    const uint32_t next = layer + j;
    if (opts_.script != nullptr && opts_.hints == HintSource::Script) {
      add_scripted_hints(*opts_.script, pos_, layer, next, planner_);
      continue;
    }
    if (p_.dense_layer(next)) continue;  // no experts
    const LayerWeights& w = model_.layer(next);
    rms_norm(x_.data(), w.ffn_norm.data(), pxn_.data(), p_.n_embd, p_.rms_eps);
    matvec(w.gate_inp.view(), pxn_.data(), router_.data(), row_.data());
    add_bias(router_.data(), w.gate_inp_b);
    hint_probs(w, router_.data());
    planner_.add_ranked(next, std::span<const double>(probs_.data(), p_.n_expert));
  }
  const std::span<const ExpertHint> hints = planner_.take(stats_);
  if (hints.empty()) return;
  if (!source_.prefetch(hints)) ++stats_.hint_errors;
}

void CpuEngine::hint_probs(const LayerWeights& w, const float* logits) {
  if (p_.router == RouterKind::Sigmoid) {
    ds3_hint_probs(p_.sigmoid_moe, w.exp_bias, std::span<const float>(logits, p_.n_expert), probs_);
    return;
  }
  softmax_hint_probs(std::span<const float>(logits, p_.n_expert), probs_);
}

void CpuEngine::route(uint32_t layer) {
  const LayerWeights& w = model_.layer(layer);
  const uint32_t k = p_.n_expert_used;
  rms_norm(x_.data(), w.ffn_norm.data(), xn_.data(), p_.n_embd, p_.rms_eps);
  if (p_.dense_layer(layer)) {
    // A dense layer routes nothing: this closes its hints, as routed() does a MoE layer's.
    planner_.routed(layer, {}, stats_, nullptr);
    return;
  }
  if (!take_scripted_route(opts_, pos_, layer, selected_, weights_, stats_)) {
    matvec(w.gate_inp.view(), xn_.data(), router_.data(), row_.data());
    add_bias(router_.data(), w.gate_inp_b);
    select(w, router_.data(), selected_.data(), weights_.data());
  }
  RoutingRecord* rec = log_route(routing_log_, pos_, layer, selected_, weights_);
  planner_.routed(layer, std::span<const uint32_t>(selected_.data(), k), stats_, rec);
}

void CpuEngine::select(const LayerWeights& w, const float* logits, uint32_t* selected,
                       float* weights) {
  const uint32_t k = p_.n_expert_used;
  if (p_.router == RouterKind::Sigmoid) {
    ds3_route(p_.sigmoid_moe, w.exp_bias, std::span<const float>(logits, p_.n_expert), k, probs_,
              sel_, order_, std::span<uint32_t>(selected, k), std::span<float>(weights, k));
    return;
  }
  if (p_.router == RouterKind::TopkSoftmax) {
    // gpt-oss: the top-k logits first, then the softmax over those k alone.
    gptoss_route(std::span<const float>(logits, p_.n_expert), k, probs_, order_, topk_,
                 std::span<uint32_t>(selected, k), std::span<float>(weights, k));
    return;
  }
  softmax_route(std::span<const float>(logits, p_.n_expert), k, p_.norm_topk, probs_, order_,
                std::span<uint32_t>(selected, k), std::span<float>(weights, k));
}

void CpuEngine::mlp(const Matrix& gate, const Matrix& up, const Matrix& down, const float* x,
                    uint32_t n, float* g, float* u, float* out) {
  const uint64_t e = p_.n_embd;
  const uint64_t ff = gate.rows;
  matmul(gate.view(), x, e, g, ff, n, row_.data());
  matmul(up.view(), x, e, u, ff, n, row_.data());
  for (uint64_t j = 0; j < n * ff; ++j) g[j] = silu(g[j]) * u[j];
  matmul(down.view(), g, ff, out, e, n, row_.data());
}

Status CpuEngine::moe(uint32_t layer) {
  const LayerWeights& w = model_.layer(layer);
  if (p_.dense_layer(layer)) {
    mlp(w.ffn_gate, w.ffn_up, w.ffn_down, xn_.data(), 1, gate_.data(), up_.data(), tmp_.data());
    for (uint32_t j = 0; j < p_.n_embd; ++j) x_[j] += tmp_[j];
    return Ok{};
  }
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
    expert_activation(p_, w, ev.expert, gate_.data(), up_.data(), 1);
    matvec(ev.down, gate_.data(), tmp_.data(), row_.data());
    add_bias(tmp_.data(), expert_row(w.exp_down_b, ev.expert, p_.n_embd));
    for (uint32_t j = 0; j < p_.n_embd; ++j) {
      acc_[j] += static_cast<double>(weights_[i]) * static_cast<double>(tmp_[j]);
    }
  }
  EXPERTD_TRY(source_.release(std::span<const ExpertView>(views_.data(), k)));
  if (w.shexp_gate.rows > 0) {
    // glm4moe's shared expert, on the same input, added to the routed experts' sum.
    mlp(w.shexp_gate, w.shexp_up, w.shexp_down, xn_.data(), 1, gate_.data(), up_.data(),
        tmp_.data());
    for (uint32_t j = 0; j < p_.n_embd; ++j) x_[j] += static_cast<float>(acc_[j]) + tmp_[j];
    return Ok{};
  }
  for (uint32_t j = 0; j < p_.n_embd; ++j) x_[j] += static_cast<float>(acc_[j]);
  return Ok{};
}

bool CpuEngine::truncate(uint32_t n) {
  if (n > pos_) return false;
  pos_ = n;
  return true;
}

Status CpuEngine::prefill_chunk(std::span<const uint32_t> tokens, std::span<float> logits) {
  return cpu_prefill_rows(model_, tokens, logits, cur_, pos_,
                          RowsStep{rseq_.data(), rpos_.data(), cx_.data(), xn_.data(), row_.data()},
                          routing_log_, stats_,
                          [this](uint32_t n, uint32_t last) { return rows_forward(n, last); });
}

Status CpuEngine::rows_forward(uint32_t n, uint32_t last) {
  // The rows are one pass over the layers: the planner dedups its hints over all of them, and the
  // daemon's cursor names the pass's last position. It starts at the position before's last
  // layer, so hints for this pass's layers (layer 0's included) target this pass, not the next.
  planner_.begin_token();
  cursor_ = last;
  start_prefill_cursor(source_, last, p_.n_layer, stats_);
  for (uint32_t layer = 0; layer < p_.n_layer; ++layer) {
    prefill_attention(layer, n);
    prefill_hints(layer, n);
    prefill_route(layer, n);
    EXPERTD_TRY(prefill_moe(layer, n));
  }
  return Ok{};
}

Status CpuEngine::select_sequence(uint32_t sequence) {
  EXPERTD_TRY(Engine::select_sequence(sequence));
  switch_sequence(seq_pos_, cur_, pos_, sequence);
  return Ok{};
}

Status CpuEngine::decode_batch(std::span<const BatchRow> rows, std::span<float> logits) {
  return cpu_batch_step(*this, model_, opts_.max_context, rows, logits, seq_pos_, cur_, pos_,
                        RowsStep{rseq_.data(), rpos_.data(), cx_.data(), xn_.data(), row_.data()},
                        stats_,
                        [this](uint32_t n, uint32_t last) { return rows_forward(n, last); });
}

void switch_sequence(std::span<uint32_t> seq_pos, uint32_t& cur, uint32_t& pos, uint32_t sequence) {
  seq_pos[cur] = pos;
  cur = sequence;
  pos = seq_pos[cur];
}

Status cpu_prefill_rows(const DenseModel& model, std::span<const uint32_t> tokens,
                        std::span<float> logits, uint32_t cur, uint32_t& pos, const RowsStep& step,
                        std::vector<RoutingRecord>* log, EngineStats& stats,
                        const std::function<Status(uint32_t n, uint32_t last)>& forward) {
  const auto n = static_cast<uint32_t>(tokens.size());
  const uint64_t e = model.params().n_embd;
  const Matrix& embd = model.token_embd();
  for (uint32_t i = 0; i < n; ++i) {
    dequantize_row(embd.type, embd.bytes.data() + uint64_t{tokens[i]} * embd.row_bytes,
                   step.cx + i * e, e);
    step.seq[i] = cur;
    step.pos[i] = pos + i;
  }
  const size_t logged = log != nullptr ? log->size() : 0;
  EXPERTD_TRY(forward(n, pos + n - 1));
  if (!logits.empty()) {
    cpu_head(model, step.cx + (n - 1) * e, step.xn, logits.data(), step.row);
  }
  pos += n;
  // Token-major routing records (the pass logged them layer by layer), the positions counted.
  finish_prefill_chunk(log, logged, n, stats);
  return Ok{};
}

Status cpu_batch_step(const Engine& engine, const DenseModel& model, uint32_t max_context,
                      std::span<const BatchRow> rows, std::span<float> logits,
                      std::span<uint32_t> seq_pos, uint32_t cur, uint32_t& pos,
                      const RowsStep& step, EngineStats& stats,
                      const std::function<Status(uint32_t n, uint32_t last)>& forward) {
  EXPERTD_TRY(check_batch(engine, rows, logits.size()));
  seq_pos[cur] = pos;  // read back below: a failed step moves no sequence on
  const ModelParams& p = model.params();
  const auto n = static_cast<uint32_t>(rows.size());
  const uint64_t e = p.n_embd;
  const uint64_t v = p.n_vocab;
  EXPERTD_TRY(
      check_batch_room(rows, max_context, [&](uint32_t s) -> uint32_t { return seq_pos[s]; }));
  const uint64_t t0 = monotonic_ns();
  const Matrix& embd = model.token_embd();
  uint32_t last = 0;
  for (uint32_t i = 0; i < n; ++i) {
    step.seq[i] = rows[i].sequence;
    step.pos[i] = seq_pos[rows[i].sequence];
    last = std::max(last, step.pos[i]);
    dequantize_row(embd.type, embd.bytes.data() + uint64_t{rows[i].token} * embd.row_bytes,
                   step.cx + i * e, e);
  }
  const uint64_t experts_before = stats.prefill_experts;
  const Status st = forward(n, last);
  // The pass counts the step's acquires as prefill's; they are the batch's.
  stats.batch_experts += stats.prefill_experts - experts_before;
  stats.prefill_experts = experts_before;
  EXPERTD_TRY(st);
  for (uint32_t i = 0; i < n; ++i) {
    cpu_head(model, step.cx + i * e, step.xn, logits.data() + i * v, step.row);
    ++seq_pos[rows[i].sequence];
  }
  pos = seq_pos[cur];
  count_batch_step(stats, n, t0);
  return Ok{};
}

void CpuEngine::prefill_attention(uint32_t layer, uint32_t n) {
  const LayerWeights& w = model_.layer(layer);
  const uint64_t e = p_.n_embd;
  const uint64_t q_dim = uint64_t{p_.n_head} * p_.head_dim;
  for (uint32_t i = 0; i < n; ++i) {
    rms_norm(cx_.data() + i * e, w.attn_norm.data(), cxn_.data() + i * e, e, p_.rms_eps);
  }
  matmul(w.wq.view(), cxn_.data(), e, cq_.data(), q_dim, n, row_.data());
  matmul(w.wk.view(), cxn_.data(), e, ck_.data(), kv_dim_, n, row_.data());
  matmul(w.wv.view(), cxn_.data(), e, cv_.data(), kv_dim_, n, row_.data());
  add_bias(cq_.data(), w.bq, n, q_dim);
  add_bias(ck_.data(), w.bk, n, kv_dim_);
  add_bias(cv_.data(), w.bv, n, kv_dim_);
  // Every row's k and v go into its sequence's cache first; row i then attends to [0, rpos_[i]].
  for (uint32_t i = 0; i < n; ++i) {
    place_qkv(rseq_[i], layer, rpos_[i], cq_.data() + i * q_dim, ck_.data() + i * kv_dim_,
              cv_.data() + i * kv_dim_);
  }
  for (uint32_t i = 0; i < n; ++i) {
    attend(rseq_[i], layer, rpos_[i], cq_.data() + i * q_dim, catt_.data() + i * q_dim);
  }
  matmul(w.wo.view(), catt_.data(), q_dim, ctmp_.data(), e, n, row_.data());
  add_bias(ctmp_.data(), w.bo, n, e);
  for (uint64_t j = 0; j < uint64_t{n} * e; ++j) cx_[j] += ctmp_[j];
}

void CpuEngine::prefill_hints(uint32_t layer, uint32_t n) {
  // Decode's lookahead over the chunk: the union of every position's candidates, once each.
  const uint64_t e = p_.n_embd;
  planner_.from_layer(layer);
  for (uint32_t j = 1; j <= opts_.prefetch_depth && layer + j < p_.n_layer; ++j) {
    const uint32_t next = layer + j;
    if (opts_.script != nullptr && opts_.hints == HintSource::Script) {
      for (uint32_t i = 0; i < n; ++i)
        add_scripted_hints(*opts_.script, rpos_[i], layer, next, planner_);
      continue;
    }
    if (p_.dense_layer(next)) continue;  // no experts
    const LayerWeights& w = model_.layer(next);
    for (uint32_t i = 0; i < n; ++i) {
      rms_norm(cx_.data() + i * e, w.ffn_norm.data(), cxn_.data() + i * e, e, p_.rms_eps);
    }
    matmul(w.gate_inp.view(), cxn_.data(), e, clogits_.data(), p_.n_expert, n, row_.data());
    add_bias(clogits_.data(), w.gate_inp_b, n, p_.n_expert);
    for (uint32_t i = 0; i < n; ++i) {
      hint_probs(w, clogits_.data() + uint64_t{i} * p_.n_expert);
      planner_.add_ranked(next, std::span<const double>(probs_.data(), p_.n_expert));
    }
  }
  const std::span<const ExpertHint> hints = planner_.take(stats_);
  if (hints.empty()) return;
  if (!source_.prefetch(hints)) ++stats_.hint_errors;
}

void CpuEngine::prefill_route(uint32_t layer, uint32_t n) {
  const LayerWeights& w = model_.layer(layer);
  const uint64_t e = p_.n_embd;
  const uint32_t k = p_.n_expert_used;
  for (uint32_t i = 0; i < n; ++i) {
    rms_norm(cx_.data() + i * e, w.ffn_norm.data(), cxn_.data() + i * e, e, p_.rms_eps);
  }
  if (p_.dense_layer(layer)) {
    planner_.routed(layer, {}, stats_, nullptr);  // closes the dense layer's hints
    return;
  }
  matmul(w.gate_inp.view(), cxn_.data(), e, clogits_.data(), p_.n_expert, n, row_.data());
  add_bias(clogits_.data(), w.gate_inp_b, n, p_.n_expert);
  const size_t logged = routing_log_ != nullptr ? routing_log_->size() : 0;
  for (uint32_t i = 0; i < n; ++i) {
    const std::span<uint32_t> sel(csel_.data() + uint64_t{i} * k, k);
    const std::span<float> wts(cweights_.data() + uint64_t{i} * k, k);
    if (!take_scripted_route(opts_, rpos_[i], layer, sel, wts, stats_)) {
      select(w, clogits_.data() + uint64_t{i} * p_.n_expert, sel.data(), wts.data());
    }
    log_route(routing_log_, rpos_[i], layer, sel, wts);
  }
  groups_.build(std::span<const uint32_t>(csel_.data(), uint64_t{n} * k));
  routed_chunk(planner_, layer, groups_.needed(), stats_, routing_log_, logged);
}

Status run_chunk_experts(ExpertSource& source, uint32_t layer, const ExpertGroups& groups,
                         uint32_t k, uint32_t last_pos, const float* x, uint64_t n_embd,
                         uint64_t n_ff, float* out, const ChunkExperts& scratch,
                         EngineStats& stats) {
  const uint64_t e = n_embd;
  const uint64_t ff = n_ff;
  const std::span<const uint32_t> needed = groups.needed();
  const auto n_needed = static_cast<uint32_t>(needed.size());
  // Every needed expert is hinted before any is acquired, so the daemon loads the later groups
  // while the first ones compute (the cursor is still before this layer, so they target it).
  if (n_needed > k) hint_needed(source, layer, needed, scratch.exact, stats);
  if (!source.set_cursor(last_pos, layer)) ++stats.hint_errors;

  // Held at most top-k at a time: a daemon cache sized for decode never has to hold a layer.
  for (uint32_t g = 0; g < n_needed; g += k) {
    const uint32_t m = std::min(k, n_needed - g);
    const std::span<const uint32_t> group = needed.subspan(g, m);
    const std::span<ExpertView> views = scratch.views.first(m);
    const uint64_t t0 = monotonic_ns();
    EXPERTD_TRY(source.get(layer, group, views));
    stats.stall_ns += monotonic_ns() - t0;
    stats.experts_used += m;
    stats.prefill_experts += m;
    for (uint32_t v = 0; v < m; ++v) {
      const ExpertView& ev = views[v];
      EXPERTD_CHECK_EQ(ev.layer, layer);
      EXPERTD_CHECK_EQ(ev.expert, group[v]);
      const std::span<const uint32_t> slots = groups.slots(group[v]);
      const auto count = static_cast<uint32_t>(slots.size());
      for (uint32_t r = 0; r < count; ++r) {
        std::copy_n(x + uint64_t{slots[r] / k} * e, e, scratch.gx + r * e);
      }
      matmul(ev.gate, scratch.gx, e, scratch.gate, ff, count, scratch.row);
      matmul(ev.up, scratch.gx, e, scratch.up, ff, count, scratch.row);
      if (scratch.gptoss != nullptr) {
        oai_swiglu(*scratch.gptoss, ev.expert, scratch.gate, scratch.up, count, ff);
      } else {
        for (uint64_t j = 0; j < uint64_t{count} * ff; ++j) {
          scratch.gate[j] = silu(scratch.gate[j]) * scratch.up[j];
        }
      }
      matmul(ev.down, scratch.gate, ff, scratch.down, e, count, scratch.row);
      if (scratch.gptoss != nullptr) {
        add_bias(scratch.down, expert_row(scratch.gptoss->exp_down_b, ev.expert, e), count, e);
      }
      for (uint32_t r = 0; r < count; ++r) {
        std::copy_n(scratch.down + r * e, e, out + uint64_t{slots[r]} * e);
      }
    }
    EXPERTD_TRY(source.release(views));
  }
  return Ok{};
}

Status CpuEngine::prefill_moe(uint32_t layer, uint32_t n) {
  const uint32_t k = p_.n_expert_used;
  const uint64_t e = p_.n_embd;
  const LayerWeights& w = model_.layer(layer);
  // glm4moe's dense MLP and shared expert over the chunk: one matmul each, decode()'s results.
  if (p_.dense_layer(layer)) {
    mlp(w.ffn_gate, w.ffn_up, w.ffn_down, cxn_.data(), n, cgate_.data(), cup_.data(), ctmp_.data());
    for (uint64_t j = 0; j < uint64_t{n} * e; ++j) cx_[j] += ctmp_[j];
    return Ok{};
  }
  EXPERTD_TRY(run_chunk_experts(
      source_, layer, groups_, k, cursor_, cxn_.data(), e, p_.n_ff_exp, cout_.data(),
      ChunkExperts{views_, exact_, cgx_.data(), cgate_.data(), cup_.data(), cdown_.data(),
                   row_.data(),
                   p_.act == ExpertAct::ClampedSwiglu ? &model_.layer(layer) : nullptr},
      stats_));
  const bool shared = w.shexp_gate.rows > 0;
  if (shared) {
    mlp(w.shexp_gate, w.shexp_up, w.shexp_down, cxn_.data(), n, cgate_.data(), cup_.data(),
        ctmp_.data());
  }
  // Each position sums its experts in its route's order (then the shared expert), as decode()
  // does.
  for (uint32_t i = 0; i < n; ++i) {
    std::fill(acc_.begin(), acc_.begin() + static_cast<int64_t>(e), 0.0);
    for (uint32_t s = 0; s < k; ++s) {
      const double wt = cweights_[uint64_t{i} * k + s];
      const float* out = cout_.data() + (uint64_t{i} * k + s) * e;
      for (uint64_t j = 0; j < e; ++j) acc_[j] += wt * static_cast<double>(out[j]);
    }
    float* x = cx_.data() + i * e;
    if (shared) {
      const float* sh = ctmp_.data() + i * e;
      for (uint64_t j = 0; j < e; ++j) x[j] += static_cast<float>(acc_[j]) + sh[j];
    } else {
      for (uint64_t j = 0; j < e; ++j) x[j] += static_cast<float>(acc_[j]);
    }
  }
  return Ok{};
}

void cpu_head(const DenseModel& model, const float* x, float* xn, float* logits, float* row) {
  const ModelParams& p = model.params();
  rms_norm(x, model.output_norm().data(), xn, p.n_embd, p.rms_eps);
  matvec(model.output().view(), xn, logits, row);
}

Result<std::unique_ptr<Engine>> create_cpu_engine(const DenseModel& model, ExpertSource& source,
                                                  const EngineOptions& options) {
  switch (family_info(model.params().family).engine) {
    case EngineClass::DeepSeek4: {
      EXPERTD_TRY_ASSIGN(auto e, Ds4CpuEngine::create(model, source, options));
      return std::unique_ptr<Engine>(std::move(e));
    }
    case EngineClass::DeepSeek3: {
      EXPERTD_TRY_ASSIGN(auto e, Ds3CpuEngine::create(model, source, options));
      return std::unique_ptr<Engine>(std::move(e));
    }
    case EngineClass::Generic:
      break;
  }
  EXPERTD_TRY_ASSIGN(auto e, CpuEngine::create(model, source, options));
  return std::unique_ptr<Engine>(std::move(e));
}

}  // namespace expertd::engine
