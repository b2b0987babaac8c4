#include "engine/ds4_cpu_engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "base/check.h"
#include "engine/cpu_engine.h"
#include "engine/cpu_ops.h"
#include "engine/dequant.h"
#include "engine/routing.h"

namespace expertd::engine {
namespace {

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
float silu(float x) { return static_cast<float>(x / (1.0 + std::exp(-static_cast<double>(x)))); }

// x / sqrt(mean(x^2) + eps), without a weight (transformers' DeepseekV4UnweightedRMSNorm).
void rms_norm_plain(float* x, size_t n, float eps) {
  double ss = 0.0;
  for (size_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const double r = 1.0 / std::sqrt(ss / static_cast<double>(n) + eps);
  for (size_t i = 0; i < n; ++i) x[i] = static_cast<float>(x[i] * r);
}

// SwiGLU with DeepSeek-V4's clamp, in place in `gate`: gate <= limit, up in [-limit, limit]
// (limit 0: none).
void swiglu(float* gate, const float* up, uint64_t n, float limit) {
  for (uint64_t j = 0; j < n; ++j) {
    float g = gate[j];
    float u = up[j];
    if (limit > 0) {
      g = std::min(g, limit);
      u = std::clamp(u, -limit, limit);
    }
    gate[j] = silu(g) * u;
  }
}

}  // namespace

// Inverse frequencies of the rope pairs: base^(-2i/dim), or YaRN's blend of interpolated and
// extrapolated frequencies (transformers' _compute_yarn_parameters with truncate; DeepSeek-V4
// keeps the attention factor at 1).
std::vector<double> ds4_inv_freq(uint32_t dim, double base, const Ds4Params* yarn) {
  if (yarn == nullptr) return rope_inv_freq(dim, base, Yarn{});
  return rope_inv_freq(
      dim, base,
      Yarn{yarn->yarn_factor, yarn->yarn_orig_ctx, yarn->yarn_beta_fast, yarn->yarn_beta_slow});
}

Status check_ds4_engine(const DenseModel& model, const EngineOptions& options,
                        uint32_t max_sequences) {
  const ModelParams& p = model.params();
  if (!p.is_ds4() || model.ds4() == nullptr) {
    return make_error(EINVAL, fmt::format("{}: architecture '{}' is not {}", model.path(),
                                          p.architecture, family_info(Family::DeepSeek4).arch));
  }
  EXPERTD_TRY(check_engine_options(p, options, max_sequences));
  if (uint64_t{p.n_layer} * options.max_context * p.head_dim * options.sequences >
      (uint64_t{1} << 34)) {
    return make_error(EINVAL,
                      fmt::format("a context of {} positions for {} sequence(s) is too large",
                                  options.max_context, options.sequences));
  }
  return Ok{};
}

Result<std::unique_ptr<Ds4CpuEngine>> Ds4CpuEngine::create(const DenseModel& model,
                                                           ExpertSource& source,
                                                           const EngineOptions& options) {
  EXPERTD_TRY(check_cpu_model(model));
  EXPERTD_TRY(check_ds4_engine(model, options, CpuEngine::kMaxSequences));
  return std::unique_ptr<Ds4CpuEngine>(new Ds4CpuEngine(model, source, options));
}

Ds4CpuEngine::Ds4CpuEngine(const DenseModel& model, ExpertSource& source,
                           const EngineOptions& options)
    : model_(model),
      source_(source),
      p_(model.params()),
      d_(model.params().ds4),
      w_(*model.ds4()),
      opts_(options),
      planner_(model.params(), options) {
  if (opts_.prefetch_width == 0) opts_.prefetch_width = p_.n_expert_used;
  const uint32_t hc = d_.hc;
  const uint64_t e = p_.n_embd;
  const uint64_t q_dim = uint64_t{p_.n_head} * p_.head_dim;
  inv_freq_main_ = ds4_inv_freq(p_.n_rot, p_.rope_base, nullptr);
  inv_freq_compress_ = ds4_inv_freq(p_.n_rot, d_.compress_rope_base, &d_);
  uint32_t max_entries = 0;
  uint32_t max_ratio = 1;
  std::vector<LayerState> layers(p_.n_layer);
  for (uint32_t i = 0; i < p_.n_layer; ++i) {
    LayerState& s = layers[i];
    s.window.resize(uint64_t{d_.window} * p_.head_dim);
    const Ds4LayerWeights& l = w_.layers[i];
    const uint32_t ratio = d_.compress_ratio[i];
    auto init = [&](CompState& c, const Ds4Compressor& w) {
      c.coff = w.coff;
      c.dim = w.dim;
      c.kv.resize(uint64_t{ratio} * w.coff * w.dim);
      c.gate.resize(c.kv.size());
      c.prev_kv.resize(uint64_t{ratio} * w.dim);
      c.prev_gate.resize(c.prev_kv.size());
      c.entries.resize(uint64_t{opts_.max_context / ratio + 1} * w.dim);
    };
    if (l.compressor) {
      init(s.comp, *l.compressor);
      max_entries = std::max(max_entries, opts_.max_context / ratio + 1);
      max_ratio = std::max(max_ratio, ratio);
    }
    if (l.index_comp) init(s.index, *l.index_comp);
  }
  const uint32_t cdim = std::max(p_.head_dim, d_.index_dim);
  const uint64_t ff_sh = uint64_t{p_.n_ff_exp} * std::max(1u, d_.n_shared);
  streams_.resize(hc * e);
  flat_.resize(hc * e);
  mixes_.resize(uint64_t{2 + hc} * hc);
  pre_.resize(hc);
  post_.resize(hc);
  comb_.resize(uint64_t{hc} * hc);
  collapsed_.resize(e);
  xn_.resize(e);
  qr_.resize(d_.q_lora_rank);
  q_.resize(q_dim);
  kv_.resize(p_.head_dim);
  att_.resize(q_dim);
  grouped_.resize(uint64_t{d_.o_groups} * d_.o_lora_rank);
  out_.resize(e);
  proj_.resize(2 * uint64_t{cdim});
  entry_.resize(cdim);
  slots_.resize(2 * uint64_t{max_ratio});
  iq_.resize(uint64_t{d_.index_heads} * d_.index_dim);
  iw_.resize(d_.index_heads);
  iscore_.resize(max_entries);
  iorder_.resize(max_entries);
  chosen_.resize(max_entries);
  scores_.resize(d_.window + max_entries);
  acc_.resize(std::max<uint64_t>(e, p_.head_dim));
  row_.resize(std::max<uint64_t>(
      {hc * e, q_dim, d_.q_lora_rank, ff_sh, e, uint64_t{d_.o_groups} * d_.o_lora_rank}));
  router_.resize(p_.n_expert);
  probs_.resize(p_.n_expert);
  sel_.resize(p_.n_expert);
  order_.resize(p_.n_expert);
  selected_.resize(p_.n_expert_used);
  weights_.resize(p_.n_expert_used);
  ready_.resize(p_.n_expert_used);
  gate_.resize(ff_sh);
  up_.resize(ff_sh);
  tmp_.resize(e);
  views_.resize(p_.n_expert_used);
  hash_hints_.reserve(uint64_t{d_.hash_layers} * p_.n_expert);
  chunk_ = std::min(opts_.prefill_chunk, opts_.max_context);
  const uint64_t c = std::max(chunk_, opts_.sequences);
  const uint32_t k = p_.n_expert_used;
  rseq_.resize(c);
  rpos_.resize(c);
  rtok_.resize(opts_.sequences);
  cstreams_.resize(c * hc * e);
  cpost_.resize(c * hc);
  ccomb_.resize(c * hc * hc);
  cxn_.resize(c * e);
  csel_.resize(c * k);
  cweights_.resize(c * k);
  cout_.resize(c * k * e);
  cmoe_.resize(c * e);
  groups_.reserve(p_.n_expert, c * k);
  exact_.resize(p_.n_expert);
  hash_mark_.resize(p_.n_expert);
  cgx_.resize(c * e);
  cgate_.resize(c * ff_sh);
  cup_.resize(c * ff_sh);
  cdown_.resize(c * e);
  std::vector<Checkpoint> checkpoints(kCheckpoints);
  for (Checkpoint& cp : checkpoints) {
    cp.layers.resize(p_.n_layer);
    for (uint32_t i = 0; i < p_.n_layer; ++i) {
      const LayerState& s = layers[i];
      LayerCheckpoint& lc = cp.layers[i];
      lc.window.resize(s.window.size());
      for (auto [from, to] : {std::pair{&s.comp, &lc.comp}, std::pair{&s.index, &lc.index}}) {
        to->kv.resize(from->kv.size());
        to->gate.resize(from->gate.size());
        to->prev_kv.resize(from->prev_kv.size());
        to->prev_gate.resize(from->prev_gate.size());
      }
    }
  }
  seqs_.resize(opts_.sequences);
  for (Sequence& q : seqs_) {
    q.layers = layers;
    q.fed.resize(opts_.max_context);
    q.checkpoints = checkpoints;
  }
  seq_pos_.assign(opts_.sequences, 0);
  s_ = &seqs_[0];
}

namespace {

// A layer's running attention state, from a LayerState to its checkpoint or back (both have
// window, comp and index; the compressors' entries are not copied: append-only, the count says
// how many are valid). Sizes match: the checkpoints are allocated like the state.
template <typename From, typename To>
void copy_running(const From& from, To& to) {
  std::copy(from.window.begin(), from.window.end(), to.window.begin());
  auto comp = [](const auto& f, auto& t) {
    std::copy(f.kv.begin(), f.kv.end(), t.kv.begin());
    std::copy(f.gate.begin(), f.gate.end(), t.gate.begin());
    std::copy(f.prev_kv.begin(), f.prev_kv.end(), t.prev_kv.begin());
    std::copy(f.prev_gate.begin(), f.prev_gate.end(), t.prev_gate.begin());
    t.has_prev = f.has_prev;
    t.count = f.count;
  };
  comp(from.comp, to.comp);
  comp(from.index, to.index);
}

}  // namespace

int Ds4CheckpointSlots::pick(uint32_t at) const {
  int slot = -1;
  for (uint32_t i = 0; i < kCount; ++i) {
    if (valid_[i] && pos_[i] == at) return -1;
  }
  for (uint32_t i = 0; i < kCount; ++i) {
    if (!valid_[i]) return static_cast<int>(i);
    if (slot < 0 || pos_[i] < pos_[slot]) slot = static_cast<int>(i);
  }
  return slot;
}

void Ds4CheckpointSlots::hold(int slot, uint32_t at) {
  valid_[slot] = 1;
  pos_[slot] = at;
}

int Ds4CheckpointSlots::latest_at_or_before(uint32_t n) {
  int best = -1;
  for (uint32_t i = 0; i < kCount; ++i) {
    if (!valid_[i]) continue;
    if (pos_[i] > n) {
      valid_[i] = 0;
    } else if (best < 0 || pos_[i] > pos_[best]) {
      best = static_cast<int>(i);
    }
  }
  return best;
}

void Ds4CpuEngine::save_checkpoint() {
  const int slot = s_->saved.pick(pos_);
  if (slot < 0) return;
  for (uint32_t i = 0; i < p_.n_layer; ++i) {
    copy_running(s_->layers[i], s_->checkpoints[slot].layers[i]);
  }
  s_->saved.hold(slot, pos_);
}

void Ds4CpuEngine::restore_checkpoint(int slot) {
  for (uint32_t i = 0; i < p_.n_layer; ++i) {
    copy_running(s_->checkpoints[slot].layers[i], s_->layers[i]);
  }
  pos_ = s_->saved.pos(slot);
}

bool Ds4CpuEngine::truncate(uint32_t n) {
  if (n == pos_) return true;
  if (n > pos_) return false;
  // The latest checkpoint at or before n (position 0 is the reset state).
  const int best = s_->saved.latest_at_or_before(n);
  const uint32_t end = n;
  if (best >= 0) {
    restore_checkpoint(best);
  } else {
    reset();  // position 0; the sequence's fed ids are kept
  }
  // Feed [pos_, n) again, in prefill chunks; `fed` holds their ids (prefill_chunk rewrites them
  // with themselves). Only n is kept as a checkpoint: the chunk ends on the way would push out
  // the older ones.
  replaying_ = true;
  while (pos_ < end) {
    const uint32_t m = std::min(chunk_, end - pos_);
    const std::vector<uint32_t> ids(s_->fed.begin() + pos_, s_->fed.begin() + pos_ + m);
    refed_ += m;
    if (!prefill_chunk(ids, {})) {
      replaying_ = false;
      reset();
      return false;
    }
  }
  replaying_ = false;
  if (pos_ > 0) save_checkpoint();
  return true;
}

std::string Ds4CpuEngine::description() const {
  return fmt::format("CPU reference engine, {} (f32, f64 accumulation)",
                     family_info(Family::DeepSeek4).arch);
}

void Ds4CpuEngine::reset() {
  pos_ = 0;
  s_->saved.clear();
  for (LayerState& s : s_->layers) {
    s.comp.count = s.index.count = 0;
    s.comp.has_prev = s.index.has_prev = false;
  }
}

void Ds4CpuEngine::rope(float* v, uint32_t dim, uint32_t pos, bool compress, bool inverse) const {
  const std::vector<double>& f = compress ? inv_freq_compress_ : inv_freq_main_;
  rope_pairs(v + (dim - p_.n_rot), f, pos, inverse);  // heads are [nope | rope]
}

Status Ds4CpuEngine::decode(uint32_t token, std::span<float> logits) {
  EXPERTD_TRY(check_decode(p_, opts_, pos_, token, logits.size()));
  const uint64_t t0 = monotonic_ns();
  embed(token, streams_.data());
  planner_.begin_token();
  hint_hash_layers(token);
  for (uint32_t layer = 0; layer < p_.n_layer; ++layer) {
    if (!source_.set_cursor(pos_, layer)) ++stats_.hint_errors;
    const Ds4LayerWeights& l = w_.layers[layer];
    hc_mix(l.hc_attn_fn, l.hc_attn_base, l.hc_attn_scale);
    attention(layer);
    hc_expand(out_.data());
    hc_mix(l.hc_ffn_fn, l.hc_ffn_base, l.hc_ffn_scale);
    send_hints(layer);
    route(layer, token);
    EXPERTD_TRY(moe(layer));
    hc_expand(out_.data());
  }
  head(logits);
  s_->fed[pos_] = token;
  ++pos_;
  if (pos_ % kCheckpointEvery == 0) save_checkpoint();
  ++stats_.tokens;
  stats_.decode_ns += monotonic_ns() - t0;
  return Ok{};
}

void Ds4CpuEngine::head(std::span<float> logits) {
  // Collapse the streams, then the output norm and head.
  const uint64_t e = p_.n_embd;
  std::copy(streams_.begin(), streams_.end(), flat_.begin());
  rms_norm_plain(flat_.data(), flat_.size(), p_.rms_eps);
  matvec(w_.hc_head_fn.view(), flat_.data(), mixes_.data(), row_.data());
  std::fill(acc_.begin(), acc_.begin() + static_cast<int64_t>(e), 0.0);
  for (uint32_t i = 0; i < d_.hc; ++i) {
    const double pre =
        sigmoid(static_cast<double>(mixes_[i]) * w_.hc_head_scale + w_.hc_head_base[i]) + d_.hc_eps;
    for (uint64_t j = 0; j < e; ++j) acc_[j] += pre * streams_[i * e + j];
  }
  for (uint64_t j = 0; j < e; ++j) collapsed_[j] = static_cast<float>(acc_[j]);
  rms_norm(collapsed_.data(), model_.output_norm().data(), xn_.data(), e, p_.rms_eps);
  matvec(model_.output().view(), xn_.data(), logits.data(), row_.data());
}

void Ds4CpuEngine::hc_mix(const Matrix& fn, const std::vector<float>& base,
                          const std::vector<float>& scale) {
  const uint32_t hc = d_.hc;
  const uint64_t e = p_.n_embd;
  std::copy(streams_.begin(), streams_.end(), flat_.begin());
  rms_norm_plain(flat_.data(), flat_.size(), p_.rms_eps);
  matvec(fn.view(), flat_.data(), mixes_.data(), row_.data());
  for (uint32_t i = 0; i < hc; ++i) {
    pre_[i] = sigmoid(static_cast<double>(mixes_[i]) * scale[0] + base[i]) + d_.hc_eps;
    post_[i] = 2.0 * sigmoid(static_cast<double>(mixes_[hc + i]) * scale[1] + base[hc + i]);
  }
  // comb: a softmax over each row, then Sinkhorn-Knopp (columns first, then rows and columns).
  for (uint32_t i = 0; i < hc; ++i) {
    double* row = comb_.data() + uint64_t{i} * hc;
    for (uint32_t j = 0; j < hc; ++j) {
      const uint32_t k = 2 * hc + i * hc + j;
      row[j] = static_cast<double>(mixes_[k]) * scale[2] + base[k];
    }
    softmax(row, hc);
    for (uint32_t j = 0; j < hc; ++j) row[j] += d_.hc_eps;
  }
  auto normalise_columns = [&] {
    for (uint32_t j = 0; j < hc; ++j) {
      double s = 0.0;
      for (uint32_t i = 0; i < hc; ++i) s += comb_[i * hc + j];
      for (uint32_t i = 0; i < hc; ++i) comb_[i * hc + j] /= s + d_.hc_eps;
    }
  };
  normalise_columns();
  for (uint32_t it = 1; it < d_.hc_iters; ++it) {
    for (uint32_t i = 0; i < hc; ++i) {
      double s = 0.0;
      for (uint32_t j = 0; j < hc; ++j) s += comb_[i * hc + j];
      for (uint32_t j = 0; j < hc; ++j) comb_[i * hc + j] /= s + d_.hc_eps;
    }
    normalise_columns();
  }
  std::fill(acc_.begin(), acc_.begin() + static_cast<int64_t>(e), 0.0);
  for (uint32_t i = 0; i < hc; ++i) {
    for (uint64_t j = 0; j < e; ++j) acc_[j] += pre_[i] * streams_[i * e + j];
  }
  for (uint64_t j = 0; j < e; ++j) collapsed_[j] = static_cast<float>(acc_[j]);
}

void Ds4CpuEngine::hc_expand(const float* out) {
  const uint32_t hc = d_.hc;
  const uint64_t e = p_.n_embd;
  // flat_ is free here: the new streams are built in it, then copied back.
  for (uint32_t i = 0; i < hc; ++i) {
    for (uint64_t j = 0; j < e; ++j) {
      double v = post_[i] * out[j];
      for (uint32_t k = 0; k < hc; ++k) v += comb_[uint64_t{k} * hc + i] * streams_[k * e + j];
      flat_[i * e + j] = static_cast<float>(v);
    }
  }
  std::copy(flat_.begin(), flat_.end(), streams_.begin());
}

void Ds4CpuEngine::compress(const Ds4Compressor& w, CompState& s, uint32_t ratio) {
  const uint32_t dim = s.dim;
  const uint64_t width = uint64_t{s.coff} * dim;
  const uint32_t j = pos_ % ratio;
  float* kv = s.kv.data() + j * width;
  float* gate = s.gate.data() + j * width;
  matvec(w.wkv.view(), xn_.data(), kv, row_.data());
  matvec(w.wgate.view(), xn_.data(), gate, row_.data());
  for (uint64_t c = 0; c < width; ++c) gate[c] += w.ape[j * width + c];
  if (j != ratio - 1) return;
  // The window is complete: one entry, a softmax over the window (per channel) of the gates
  // weighting the projections. Overlapping windows (coff 2) also take the previous window's first
  // half; this window's second half is its own.
  const uint64_t own = s.coff == 2 ? dim : 0;  // this window's half
  const uint32_t n_prev = s.coff == 2 && s.has_prev ? ratio : 0;
  for (uint32_t c = 0; c < dim; ++c) {
    double mx = -INFINITY;
    for (uint32_t t = 0; t < n_prev; ++t) mx = std::max(mx, double{s.prev_gate[t * dim + c]});
    for (uint32_t t = 0; t < ratio; ++t) mx = std::max(mx, double{s.gate[t * width + own + c]});
    double sum = 0.0;
    double acc = 0.0;
    for (uint32_t t = 0; t < n_prev; ++t) {
      const double x = std::exp(s.prev_gate[t * dim + c] - mx);
      sum += x;
      acc += x * s.prev_kv[t * dim + c];
    }
    for (uint32_t t = 0; t < ratio; ++t) {
      const double x = std::exp(s.gate[t * width + own + c] - mx);
      sum += x;
      acc += x * s.kv[t * width + own + c];
    }
    entry_[c] = static_cast<float>(acc / sum);
  }
  if (s.coff == 2) {  // keep this window's first half for the next entry
    for (uint32_t t = 0; t < ratio; ++t) {
      std::copy_n(s.kv.data() + t * width, dim, s.prev_kv.data() + uint64_t{t} * dim);
      std::copy_n(s.gate.data() + t * width, dim, s.prev_gate.data() + uint64_t{t} * dim);
    }
    s.has_prev = true;
  }
  float* out = s.entries.data() + uint64_t{s.count} * dim;
  rms_norm(entry_.data(), w.norm.data(), out, dim, p_.rms_eps);
  rope(out, dim, s.count * ratio, /*compress=*/true, /*inverse=*/false);
  ++s.count;
}

void Ds4CpuEngine::select_entries(uint32_t layer) {
  // The Lightning Indexer: score every compressed entry with Σ_h w_h · relu(q_h · k) and keep the
  // top index_topk.
  const Ds4LayerWeights& l = w_.layers[layer];
  CompState& s = s_->layers[layer].index;
  const uint32_t di = d_.index_dim;
  matvec(l.index_q_b.view(), qr_.data(), iq_.data(), row_.data());
  for (uint32_t h = 0; h < d_.index_heads; ++h) {
    rope(iq_.data() + uint64_t{h} * di, di, pos_, /*compress=*/true, /*inverse=*/false);
  }
  matvec(l.index_proj.view(), xn_.data(), iw_.data(), row_.data());
  const double head_scale = 1.0 / std::sqrt(static_cast<double>(d_.index_heads));
  const double softmax_scale = 1.0 / std::sqrt(static_cast<double>(di));
  const uint32_t n = s.count;
  for (uint32_t t = 0; t < n; ++t) {
    const float* k = s.entries.data() + uint64_t{t} * di;
    double score = 0.0;
    for (uint32_t h = 0; h < d_.index_heads; ++h) {
      const double qk = dot(iq_.data() + uint64_t{h} * di, k, di);
      score += (qk > 0 ? qk * softmax_scale : 0.0) * (iw_[h] * head_scale);
    }
    iscore_[t] = score;
  }
  const uint32_t keep = std::min(n, d_.index_topk);
  std::iota(iorder_.begin(), iorder_.begin() + n, 0u);
  std::partial_sort(iorder_.begin(), iorder_.begin() + keep, iorder_.begin() + n,
                    [&](uint32_t a, uint32_t b) {
                      return iscore_[a] > iscore_[b] || (iscore_[a] == iscore_[b] && a < b);
                    });
  std::copy_n(iorder_.begin(), keep, chosen_.begin());
}

void Ds4CpuEngine::attention(uint32_t layer) {
  const Ds4LayerWeights& l = w_.layers[layer];
  LayerState& st = s_->layers[layer];
  const uint32_t hd = p_.head_dim;
  const Ds4Attention type = d_.attention[layer];
  const bool compress = type != Ds4Attention::Sliding;
  rms_norm(collapsed_.data(), l.attn_norm.data(), xn_.data(), p_.n_embd, p_.rms_eps);
  matvec(l.wq_a.view(), xn_.data(), qr_.data(), row_.data());
  rms_norm(qr_.data(), l.q_a_norm.data(), qr_.data(), d_.q_lora_rank, p_.rms_eps);
  matvec(l.wq_b.view(), qr_.data(), q_.data(), row_.data());
  for (uint32_t h = 0; h < p_.n_head; ++h) {
    float* q = q_.data() + uint64_t{h} * hd;
    rms_norm_plain(q, hd, p_.rms_eps);
    rope(q, hd, pos_, compress, false);
  }
  matvec(l.wkv.view(), xn_.data(), kv_.data(), row_.data());
  rms_norm(kv_.data(), l.kv_norm.data(), kv_.data(), hd, p_.rms_eps);
  rope(kv_.data(), hd, pos_, compress, false);
  std::copy(kv_.begin(), kv_.end(),
            st.window.begin() + static_cast<int64_t>((pos_ % d_.window) * hd));

  // The compressed entries this position attends: all of an HCA layer's, the indexer's choice of
  // a CSA layer's.
  uint32_t n_entries = 0;
  const float* entries = nullptr;
  if (compress) {
    const uint32_t ratio = d_.compress_ratio[layer];
    compress_into(layer, ratio);
    entries = st.comp.entries.data();
    if (type == Ds4Attention::Compressed) {
      select_entries(layer);
      n_entries = std::min(st.comp.count, d_.index_topk);
    } else {
      n_entries = st.comp.count;
      std::iota(chosen_.begin(), chosen_.begin() + n_entries, 0u);
    }
  }
  const uint32_t first = pos_ + 1 > d_.window ? pos_ + 1 - d_.window : 0;
  const uint32_t n_window = pos_ + 1 - first;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  for (uint32_t h = 0; h < p_.n_head; ++h) {
    const float* q = q_.data() + uint64_t{h} * hd;
    auto key = [&](uint32_t i) -> const float* {
      return i < n_window ? st.window.data() + uint64_t{(first + i) % d_.window} * hd
                          : entries + uint64_t{chosen_[i - n_window]} * hd;
    };
    const uint32_t n = n_window + n_entries;
    const double sink = l.sinks[h];
    double mx = sink;
    for (uint32_t i = 0; i < n; ++i) {
      scores_[i] = dot(q, key(i), hd) * scale;
      mx = std::max(mx, scores_[i]);
    }
    double sum = std::exp(sink - mx);
    for (uint32_t i = 0; i < n; ++i) {
      scores_[i] = std::exp(scores_[i] - mx);
      sum += scores_[i];
    }
    std::fill(acc_.begin(), acc_.begin() + hd, 0.0);
    for (uint32_t i = 0; i < n; ++i) {
      const float* v = key(i);  // K = V
      const double pr = scores_[i] / sum;
      for (uint32_t c = 0; c < hd; ++c) acc_[c] += pr * v[c];
    }
    float* o = att_.data() + uint64_t{h} * hd;
    for (uint32_t c = 0; c < hd; ++c) o[c] = static_cast<float>(acc_[c]);
    rope(o, hd, pos_, compress, /*inverse=*/true);
  }
  // Grouped output projection: group g's heads through rows [g * o_lora_rank, ...) of wo_a.
  const uint64_t gin = uint64_t{p_.n_head} * hd / d_.o_groups;
  const WeightView wo_a = l.wo_a.view();
  for (uint32_t g = 0; g < d_.o_groups; ++g) {
    WeightView part = wo_a;
    part.data += uint64_t{g} * d_.o_lora_rank * wo_a.row_bytes;
    part.rows = d_.o_lora_rank;
    matvec(part, att_.data() + g * gin, grouped_.data() + uint64_t{g} * d_.o_lora_rank,
           row_.data());
  }
  matvec(l.wo_b.view(), grouped_.data(), out_.data(), row_.data());
}

void Ds4CpuEngine::compress_into(uint32_t layer, uint32_t ratio) {
  const Ds4LayerWeights& l = w_.layers[layer];
  LayerState& st = s_->layers[layer];
  compress(*l.compressor, st.comp, ratio);
  if (l.index_comp) compress(*l.index_comp, st.index, ratio);
}

void Ds4CpuEngine::hint_hash_layers(uint32_t token) {
  if (!opts_.hash_hints || d_.hash_layers == 0) return;
  hash_hints_.clear();
  const uint32_t k = p_.n_expert_used;
  for (uint32_t layer = 0; layer < d_.hash_layers; ++layer) {
    const uint32_t* ex = w_.layers[layer].tid2eid.data() + uint64_t{token} * k;
    for (uint32_t i = 0; i < k; ++i) hash_hints_.push_back(ExpertHint{layer, ex[i], 1.0f, true});
  }
  stats_.hash_hints += hash_hints_.size();
  if (!source_.prefetch(hash_hints_)) ++stats_.hint_errors;
}

void Ds4CpuEngine::send_hints(uint32_t layer) {
  add_lookahead(layer);
  flush_hints();
}

void Ds4CpuEngine::add_lookahead(uint32_t layer) {
  planner_.from_layer(layer);
  for (uint32_t j = 1; j <= opts_.prefetch_depth && layer + j < p_.n_layer; ++j) {
    const uint32_t next = layer + j;
    if (next < d_.hash_layers) continue;  // hinted exactly at the token
    if (opts_.script != nullptr && opts_.hints == HintSource::Script) {
      add_scripted_hints(*opts_.script, pos_, layer, next, planner_);
      continue;
    }
    // The next layer's router on this layer's MoE input, through the next layer's norm.
    const Ds4LayerWeights& w = w_.layers[next];
    rms_norm(collapsed_.data(), w.ffn_norm.data(), tmp_.data(), p_.n_embd, p_.rms_eps);
    matvec(w.gate_inp.view(), tmp_.data(), router_.data(), row_.data());
    ds4_hint_probs(w, router_, probs_);
    planner_.add_ranked(next, std::span<const double>(probs_.data(), p_.n_expert));
  }
}

void Ds4CpuEngine::flush_hints() {
  const std::span<const ExpertHint> hints = planner_.take(stats_);
  if (hints.empty()) return;
  if (!source_.prefetch(hints)) ++stats_.hint_errors;
}

void Ds4CpuEngine::route(uint32_t layer, uint32_t token) {
  const uint32_t k = p_.n_expert_used;
  route_position(layer, token);
  RoutingRecord* rec = routing_log_ != nullptr ? &routing_log_->back() : nullptr;
  if (layer >= d_.hash_layers) {
    planner_.routed(layer, std::span<const uint32_t>(selected_.data(), k), stats_, rec);
  }
}

void Ds4CpuEngine::route_position(uint32_t layer, uint32_t token) {
  const Ds4LayerWeights& l = w_.layers[layer];
  const uint32_t k = p_.n_expert_used;
  const bool hash = layer < d_.hash_layers;
  rms_norm(collapsed_.data(), l.ffn_norm.data(), xn_.data(), p_.n_embd, p_.rms_eps);
  if (!take_scripted_route(opts_, pos_, layer, selected_, weights_, stats_)) {
    matvec(l.gate_inp.view(), xn_.data(), router_.data(), row_.data());
    ds4_route(d_, l, hash, token, router_, k, probs_, sel_, order_, selected_, weights_);
  }
  log_route(routing_log_, pos_, layer, selected_, weights_);
}

Status Ds4CpuEngine::moe(uint32_t layer) {
  const Ds4LayerWeights& l = w_.layers[layer];
  const uint32_t k = p_.n_expert_used;
  const bool hash = layer < d_.hash_layers;
  const std::span<const uint32_t> experts(selected_.data(), k);
  source_.host_ready(layer, experts, ready_);
  const uint64_t t0 = monotonic_ns();
  EXPERTD_TRY(source_.get(layer, experts, std::span<ExpertView>(views_.data(), k)));
  const uint64_t waited = monotonic_ns() - t0;
  stats_.stall_ns += waited;
  stats_.experts_used += k;
  const uint64_t ready = static_cast<uint64_t>(std::count(ready_.begin(), ready_.end(), 1));
  (hash ? stats_.hash_experts : stats_.learned_experts) += k;
  (hash ? stats_.hash_ready : stats_.learned_ready) += ready;
  (hash ? stats_.hash_stall_ns : stats_.learned_stall_ns) += waited;

  const uint64_t e = p_.n_embd;
  std::fill(acc_.begin(), acc_.begin() + static_cast<int64_t>(e), 0.0);
  for (uint32_t i = 0; i < k; ++i) {
    const ExpertView& ev = views_[i];
    EXPERTD_CHECK_EQ(ev.layer, layer);
    EXPERTD_CHECK_EQ(ev.expert, selected_[i]);
    matvec(ev.gate, xn_.data(), gate_.data(), row_.data());
    matvec(ev.up, xn_.data(), up_.data(), row_.data());
    swiglu(gate_.data(), up_.data(), p_.n_ff_exp, d_.clamp_exp[layer]);
    matvec(ev.down, gate_.data(), tmp_.data(), row_.data());
    for (uint64_t j = 0; j < e; ++j) acc_[j] += static_cast<double>(weights_[i]) * tmp_[j];
  }
  EXPERTD_TRY(source_.release(std::span<const ExpertView>(views_.data(), k)));
  if (d_.n_shared > 0) {
    matvec(l.shexp_gate.view(), xn_.data(), gate_.data(), row_.data());
    matvec(l.shexp_up.view(), xn_.data(), up_.data(), row_.data());
    swiglu(gate_.data(), up_.data(), l.shexp_gate.rows, d_.clamp_shexp[layer]);
    matvec(l.shexp_down.view(), gate_.data(), tmp_.data(), row_.data());
    for (uint64_t j = 0; j < e; ++j) acc_[j] += tmp_[j];
  }
  for (uint64_t j = 0; j < e; ++j) out_[j] = static_cast<float>(acc_[j]);
  return Ok{};
}

Status Ds4CpuEngine::prefill_chunk(std::span<const uint32_t> tokens, std::span<float> logits) {
  const auto n = static_cast<uint32_t>(tokens.size());
  const uint64_t se = uint64_t{d_.hc} * p_.n_embd;  // one position's streams
  const uint32_t p0 = pos_;
  for (uint32_t i = 0; i < n; ++i) {
    embed(tokens[i], cstreams_.data() + i * se);
    rseq_[i] = cur_;
    rpos_[i] = p0 + i;
  }
  const size_t logged = routing_log_ != nullptr ? routing_log_->size() : 0;
  EXPERTD_TRY(forward_rows(tokens, p0 + n - 1));
  if (!logits.empty()) {
    std::copy_n(cstreams_.data() + (n - 1) * se, se, streams_.data());
    head(logits);
  }
  pos_ = p0 + n;
  std::copy(tokens.begin(), tokens.end(), s_->fed.begin() + p0);
  if (!replaying_) save_checkpoint();
  // Token-major routing records (the chunk logged them layer by layer), the positions counted.
  finish_prefill_chunk(routing_log_, logged, n, stats_);
  return Ok{};
}

void Ds4CpuEngine::embed(uint32_t token, float* streams) const {
  const uint64_t e = p_.n_embd;
  const Matrix& embd = model_.token_embd();
  dequantize_row(embd.type, embd.bytes.data() + uint64_t{token} * embd.row_bytes, streams, e);
  for (uint32_t h = 1; h < d_.hc; ++h) std::copy_n(streams, e, streams + h * e);
}

Status Ds4CpuEngine::forward_rows(std::span<const uint32_t> tokens, uint32_t last) {
  const auto n = static_cast<uint32_t>(tokens.size());
  const uint32_t hc = d_.hc;
  const uint64_t e = p_.n_embd;
  const uint64_t se = hc * e;  // one position's streams
  const uint32_t k = p_.n_expert_used;
  // The pass is one pass over the layers (see CpuEngine::prefill_chunk): the cursor names its
  // last position and starts before layer 0, so the hints below target this pass.
  planner_.begin_token();
  start_prefill_cursor(source_, last, p_.n_layer, stats_);
  const bool hash_hints = opts_.hash_hints && d_.hash_layers > 0;
  if (hash_hints) {
    hint_hash_layer(source_, w_, 0, p_.n_expert_used, tokens, hash_mark_, hash_hints_, stats_);
  }
  // The per-position code works on s_ at pos_: each row's sequence and position in turn, the
  // selected sequence's put back whatever happens.
  const uint32_t selected_pos = pos_;
  auto at_row = [&](uint32_t i) {
    s_ = &seqs_[rseq_[i]];
    pos_ = rpos_[i];
  };
  auto back = [&] {
    s_ = &seqs_[cur_];
    pos_ = selected_pos;
  };
  for (uint32_t layer = 0; layer < p_.n_layer; ++layer) {
    const Ds4LayerWeights& l = w_.layers[layer];
    if (hash_hints && layer + 1 < d_.hash_layers) {  // one hash layer ahead
      hint_hash_layer(source_, w_, layer + 1, p_.n_expert_used, tokens, hash_mark_, hash_hints_,
                      stats_);
    }
    // Row by row: the attention's running state (window, compressors) advances one position at
    // a time, in each row's own sequence. This layer's routing records start at layer_first.
    const size_t layer_first = routing_log_ != nullptr ? routing_log_->size() : 0;
    for (uint32_t i = 0; i < n; ++i) {
      at_row(i);
      std::copy_n(cstreams_.data() + i * se, se, streams_.data());
      hc_mix(l.hc_attn_fn, l.hc_attn_base, l.hc_attn_scale);
      attention(layer);
      hc_expand(out_.data());
      hc_mix(l.hc_ffn_fn, l.hc_ffn_base, l.hc_ffn_scale);
      add_lookahead(layer);
      route_position(layer, tokens[i]);
      std::copy_n(streams_.data(), se, cstreams_.data() + i * se);
      std::copy_n(post_.data(), hc, cpost_.data() + uint64_t{i} * hc);
      std::copy_n(comb_.data(), uint64_t{hc} * hc, ccomb_.data() + uint64_t{i} * hc * hc);
      std::copy_n(xn_.data(), e, cxn_.data() + i * e);
      std::copy_n(selected_.data(), k, csel_.data() + uint64_t{i} * k);
      std::copy_n(weights_.data(), k, cweights_.data() + uint64_t{i} * k);
    }
    back();
    flush_hints();
    groups_.build(std::span<const uint32_t>(csel_.data(), uint64_t{n} * k));
    if (layer >= d_.hash_layers) {
      routed_chunk(planner_, layer, groups_.needed(), stats_, routing_log_, layer_first);
    }
    EXPERTD_TRY(prefill_moe(layer, n, last));
    // Each position's MoE output (in out_) goes into its streams with its own post and comb.
    for (uint32_t i = 0; i < n; ++i) {
      std::copy_n(cstreams_.data() + i * se, se, streams_.data());
      std::copy_n(cpost_.data() + uint64_t{i} * hc, hc, post_.data());
      std::copy_n(ccomb_.data() + uint64_t{i} * hc * hc, uint64_t{hc} * hc, comb_.data());
      hc_expand(cmoe_.data() + i * e);
      std::copy_n(streams_.data(), se, cstreams_.data() + i * se);
    }
  }
  return Ok{};
}

Status Ds4CpuEngine::select_sequence(uint32_t sequence) {
  EXPERTD_TRY(Engine::select_sequence(sequence));
  switch_sequence(seq_pos_, cur_, pos_, sequence);
  s_ = &seqs_[cur_];
  return Ok{};
}

Status Ds4CpuEngine::decode_batch(std::span<const BatchRow> rows, std::span<float> logits) {
  EXPERTD_TRY(check_batch(*this, rows, logits.size()));
  const auto n = static_cast<uint32_t>(rows.size());
  seq_pos_[cur_] = pos_;
  EXPERTD_TRY(check_batch_room(rows, opts_.max_context,
                               [&](uint32_t s) -> uint32_t { return seq_pos_[s]; }));
  const uint64_t t0 = monotonic_ns();
  const uint64_t se = uint64_t{d_.hc} * p_.n_embd;
  uint32_t last = 0;
  for (uint32_t i = 0; i < n; ++i) {
    rseq_[i] = rows[i].sequence;
    rpos_[i] = seq_pos_[rows[i].sequence];
    rtok_[i] = rows[i].token;
    last = std::max(last, rpos_[i]);
    embed(rows[i].token, cstreams_.data() + i * se);
  }
  const uint64_t experts_before = stats_.prefill_experts;
  const Status st = forward_rows(std::span<const uint32_t>(rtok_.data(), n), last);
  // The pass counts the step's acquires as prefill's; they are the batch's.
  stats_.batch_experts += stats_.prefill_experts - experts_before;
  stats_.prefill_experts = experts_before;
  EXPERTD_TRY(st);
  // Each row's head, and its sequence moved on as decode() moves it (its id kept, a checkpoint
  // every kCheckpointEvery positions).
  for (uint32_t i = 0; i < n; ++i) {
    std::copy_n(cstreams_.data() + i * se, se, streams_.data());
    head(logits.subspan(uint64_t{i} * p_.n_vocab, p_.n_vocab));
    s_ = &seqs_[rseq_[i]];
    pos_ = rpos_[i];
    s_->fed[pos_] = rtok_[i];
    ++pos_;
    if (pos_ % kCheckpointEvery == 0) save_checkpoint();
    seq_pos_[rseq_[i]] = pos_;
  }
  s_ = &seqs_[cur_];
  pos_ = seq_pos_[cur_];
  count_batch_step(stats_, n, t0);
  return Ok{};
}

Status Ds4CpuEngine::prefill_moe(uint32_t layer, uint32_t n, uint32_t last) {
  const Ds4LayerWeights& l = w_.layers[layer];
  const uint32_t k = p_.n_expert_used;
  const uint64_t e = p_.n_embd;
  const uint64_t ff = p_.n_ff_exp;
  const bool hash = layer < d_.hash_layers;
  const std::span<const uint32_t> needed = groups_.needed();
  const auto n_needed = static_cast<uint32_t>(needed.size());
  // Learned layers: every needed expert hinted before any is acquired (hash layers were hinted
  // at the chunk's start).
  if (!hash && n_needed > k) hint_needed(source_, layer, needed, exact_, stats_);
  if (!source_.set_cursor(last, layer)) ++stats_.hint_errors;

  // Held at most top-k at a time, as in CpuEngine::prefill_moe.
  for (uint32_t g = 0; g < n_needed; g += k) {
    const uint32_t m = std::min(k, n_needed - g);
    const std::span<const uint32_t> group = needed.subspan(g, m);
    source_.host_ready(layer, group, std::span<uint8_t>(ready_.data(), m));
    const uint64_t t0 = monotonic_ns();
    EXPERTD_TRY(source_.get(layer, group, std::span<ExpertView>(views_.data(), m)));
    const uint64_t waited = monotonic_ns() - t0;
    stats_.stall_ns += waited;
    stats_.experts_used += m;
    stats_.prefill_experts += m;
    const auto ready = static_cast<uint64_t>(std::count(ready_.begin(), ready_.begin() + m, 1));
    (hash ? stats_.hash_experts : stats_.learned_experts) += m;
    (hash ? stats_.hash_ready : stats_.learned_ready) += ready;
    (hash ? stats_.hash_stall_ns : stats_.learned_stall_ns) += waited;
    for (uint32_t v = 0; v < m; ++v) {
      const ExpertView& ev = views_[v];
      EXPERTD_CHECK_EQ(ev.layer, layer);
      EXPERTD_CHECK_EQ(ev.expert, group[v]);
      const std::span<const uint32_t> slots = groups_.slots(group[v]);
      const auto count = static_cast<uint32_t>(slots.size());
      for (uint32_t r = 0; r < count; ++r) {
        std::copy_n(cxn_.data() + uint64_t{slots[r] / k} * e, e, cgx_.data() + r * e);
      }
      matmul(ev.gate, cgx_.data(), e, cgate_.data(), ff, count, row_.data());
      matmul(ev.up, cgx_.data(), e, cup_.data(), ff, count, row_.data());
      swiglu(cgate_.data(), cup_.data(), uint64_t{count} * ff, d_.clamp_exp[layer]);
      matmul(ev.down, cgate_.data(), ff, cdown_.data(), e, count, row_.data());
      for (uint32_t r = 0; r < count; ++r) {
        std::copy_n(cdown_.data() + r * e, e, cout_.data() + uint64_t{slots[r]} * e);
      }
    }
    EXPERTD_TRY(source_.release(std::span<const ExpertView>(views_.data(), m)));
  }
  if (d_.n_shared > 0) {
    const uint64_t sff = l.shexp_gate.rows;
    matmul(l.shexp_gate.view(), cxn_.data(), e, cgate_.data(), sff, n, row_.data());
    matmul(l.shexp_up.view(), cxn_.data(), e, cup_.data(), sff, n, row_.data());
    swiglu(cgate_.data(), cup_.data(), uint64_t{n} * sff, d_.clamp_shexp[layer]);
    matmul(l.shexp_down.view(), cgate_.data(), sff, cdown_.data(), e, n, row_.data());
  }
  // Each position sums its experts in its route's order, then the shared expert, as decode()
  // does.
  for (uint32_t i = 0; i < n; ++i) {
    std::fill(acc_.begin(), acc_.begin() + static_cast<int64_t>(e), 0.0);
    for (uint32_t s = 0; s < k; ++s) {
      const double wt = cweights_[uint64_t{i} * k + s];
      const float* out = cout_.data() + (uint64_t{i} * k + s) * e;
      for (uint64_t j = 0; j < e; ++j) acc_[j] += wt * out[j];
    }
    if (d_.n_shared > 0) {
      for (uint64_t j = 0; j < e; ++j) acc_[j] += cdown_[i * e + j];
    }
    for (uint64_t j = 0; j < e; ++j) cmoe_[i * e + j] = static_cast<float>(acc_[j]);
  }
  return Ok{};
}

}  // namespace expertd::engine
