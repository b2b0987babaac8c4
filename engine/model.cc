#include "engine/model.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>

#include "engine/dequant.h"
#include "engine/families/families.h"
#include "engine/model_read.h"
#include "expertd/client.h"

namespace expertd::engine {
namespace {

// Bounds on the hyperparameters, far above any real model, so a hostile file cannot make the
// engine allocate without limit before a tensor shape check would catch it.
constexpr uint64_t kMaxLayers = 1024;
constexpr uint64_t kMaxEmbd = 1 << 16;
constexpr uint64_t kMaxHeads = 1024;
constexpr uint64_t kMaxHeadDim = 1024;
constexpr uint64_t kMaxExperts = 1 << 14;
constexpr uint64_t kMaxExpertsUsed = 64;

}  // namespace

namespace detail {

Error key_error(const GgufModel& g, std::string_view suffix, const std::string& what) {
  return Error{EINVAL, fmt::format("{}: {} {}", g.meta().path(), g.arch_key(suffix), what)};
}

Result<uint64_t> get_u64(const GgufModel& g, std::string_view suffix,
                         std::optional<uint64_t> fallback, uint64_t lo, uint64_t hi) {
  const GgufValue* v = g.find_arch(suffix);
  std::optional<uint64_t> x = fallback;
  if (v != nullptr) x = v->as_u64();
  if (!x) {
    return make_error(EINVAL, fmt::format("{}: {} is {}", g.meta().path(), g.arch_key(suffix),
                                          v == nullptr ? "missing" : "not an unsigned integer"));
  }
  if (*x < lo || *x > hi) {
    return make_error(EINVAL, fmt::format("{}: {} = {} is outside [{}, {}]", g.meta().path(),
                                          g.arch_key(suffix), *x, lo, hi));
  }
  return *x;
}

Result<double> get_f64(const GgufModel& g, std::string_view suffix,
                       std::optional<double> fallback) {
  const GgufValue* v = g.find_arch(suffix);
  std::optional<double> x = fallback;
  if (v != nullptr) x = v->as_f64();
  if (!x || !(*x > 0.0) || !std::isfinite(*x)) {
    return make_error(EINVAL, fmt::format("{}: {} is {}", g.meta().path(), g.arch_key(suffix),
                                          v == nullptr ? "missing" : "not a positive number"));
  }
  return *x;
}

Result<Yarn> read_yarn(const GgufModel& g) {
  Yarn y;
  const GgufValue* v = g.find_arch("rope.scaling.type");
  if (v == nullptr) return y;
  const std::string* type = v->as_string();
  if (type == nullptr || (*type != "yarn" && *type != "none")) {
    return make_error(EINVAL,
                      fmt::format("{}: {} {}", g.meta().path(), g.arch_key("rope.scaling.type"),
                                  type == nullptr ? "is not a string"
                                                  : fmt::format("= '{}': {} supports yarn "
                                                                "or none",
                                                                *type, g.architecture())));
  }
  if (*type == "none") return y;
  EXPERTD_TRY_ASSIGN(y.factor, get_f64(g, "rope.scaling.factor", {}));
  EXPERTD_TRY_ASSIGN(const uint64_t octx,
                     get_u64(g, "rope.scaling.original_context_length", {}, 1, uint64_t{1} << 32));
  y.orig_ctx = static_cast<uint32_t>(octx);
  EXPERTD_TRY_ASSIGN(y.beta_fast, get_f64(g, "rope.scaling.yarn_beta_fast", 32.0));
  EXPERTD_TRY_ASSIGN(y.beta_slow, get_f64(g, "rope.scaling.yarn_beta_slow", 1.0));
  return y;
}

Result<Sources> open_sources(const GgufModel& g, DenseLoad how) {
  Sources src;
  src.defer_matrices = how == DenseLoad::Deferred;
  if (!g.sources().empty()) {
    src.files = g.sources();
    return src;
  }
  for (const GgufFile& shard : g.shards()) {
    EXPERTD_TRY_ASSIGN(auto s, open_file_source(shard.path()));
    src.files.push_back(std::move(s));
  }
  return src;
}

namespace {

// `planes` > 1: a 3-D tensor ne [cols, rows, planes], read as one matrix of planes * rows rows.
Result<Matrix> read_tensor(const GgufModel& g, const Sources& src, const std::string& name,
                           uint64_t rows, uint64_t cols, bool defer, uint64_t planes = 1) {
  const auto ref = g.find_tensor(name);
  if (!ref)
    return make_error(ENOENT, fmt::format("{}: tensor {} is missing", g.meta().path(), name));
  const GgufTensorInfo& t = *ref->info;
  const std::string& file = g.shards()[ref->shard].path();
  if (t.ne[0] != cols || t.ne[1] != rows || t.ne[2] != planes || t.ne[3] != 1) {
    return make_error(
        EINVAL, fmt::format("{}: tensor {}: shape [{}, {}, {}, {}], expected [{}, {}{}]", file,
                            name, t.ne[0], t.ne[1], t.ne[2], t.ne[3], cols, rows,
                            planes == 1 ? std::string() : fmt::format(", {}", planes)));
  }
  rows *= planes;
  if (auto st = dequant_check(t.type, cols); !st) {
    return make_error(st.error().code,
                      fmt::format("{}: tensor {}: {}", file, name, st.error().message));
  }
  Matrix m;
  m.name = name;
  m.type = t.type;
  m.rows = rows;
  m.cols = cols;
  m.row_bytes = *ggml_row_bytes(t.type, cols);
  if (m.row_bytes * rows != t.bytes) {
    return make_error(EINVAL, fmt::format("{}: tensor {}: {} bytes, expected {}", file, name,
                                          t.bytes, m.row_bytes * rows));
  }
  m.file = src.files[ref->shard];
  m.offset = t.offset;
  if (defer) return m;
  m.bytes.resize(t.bytes);
  EXPERTD_TRY(m.file->read_exact(t.offset, m.bytes));
  return m;
}

}  // namespace

Result<Matrix> read_matrix(const GgufModel& g, const Sources& src, const std::string& name,
                           uint64_t rows, uint64_t cols) {
  return read_tensor(g, src, name, rows, cols, src.defer_matrices);
}

Result<Matrix> read_matrices(const GgufModel& g, const Sources& src, const std::string& name,
                             uint64_t n, uint64_t rows, uint64_t cols) {
  return read_tensor(g, src, name, rows, cols, src.defer_matrices, n);
}

Result<std::vector<float>> read_vector(const GgufModel& g, const Sources& src,
                                       const std::string& name, uint64_t n) {
  EXPERTD_TRY_ASSIGN(Matrix m, read_tensor(g, src, name, 1, n, /*defer=*/false));
  std::vector<float> v(n);
  dequantize_row(m.type, m.bytes.data(), v.data(), n);
  return v;
}

Result<std::vector<float>> read_floats(const GgufModel& g, const Sources& src,
                                       const std::string& name, uint64_t rows, uint64_t cols) {
  EXPERTD_TRY_ASSIGN(Matrix m, read_tensor(g, src, name, rows, cols, /*defer=*/false));
  std::vector<float> v(rows * cols);
  for (uint64_t r = 0; r < rows; ++r) {
    dequantize_row(m.type, m.bytes.data() + r * m.row_bytes, v.data() + r * cols, cols);
  }
  return v;
}

}  // namespace detail

namespace {

// The routed experts are read by the daemon, not here, but a layer without them would fail only
// at its first token: each layer needs merged gate and up (or a fused gate_up) and down tensors.
Status check_expert_tensors(const GgufModel& g, const std::string& blk) {
  const bool fused = g.find_tensor(blk + "ffn_gate_up_exps.weight").has_value();
  for (const char* kind : {"gate", "up", "down"}) {
    if (fused && std::string_view(kind) != "down") continue;
    const std::string name = blk + "ffn_" + kind + "_exps.weight";
    if (g.find_tensor(name)) continue;
    if (g.find_tensor(blk + "ffn_" + kind + ".0.weight")) {
      return make_error(ENOTSUP, fmt::format("{}: tensor {} is missing: the experts are one tensor "
                                             "each ({}ffn_{}.0.weight, llama.cpp's early Mixtral "
                                             "layout, which llama.cpp no longer loads either); "
                                             "convert the model again",
                                             g.meta().path(), name, blk, kind));
    }
    return make_error(ENOENT, fmt::format("{}: tensor {} is missing", g.meta().path(), name));
  }
  return Ok{};
}

}  // namespace

using detail::get_f64;
using detail::get_u64;

const FamilyLoader& family_loader(Family family) {
  switch (family) {
    case Family::Qwen3Moe:
      return kQwen3MoeLoader;
    case Family::Mixtral:
      return kMixtralLoader;
    case Family::GptOss:
      return kGptOssLoader;
    case Family::Glm4Moe:
      return kGlm4MoeLoader;
    case Family::DeepSeek3:
      return kDeepSeek3Loader;
    case Family::DeepSeek4:
      return kDeepSeek4Loader;
  }
  return kQwen3MoeLoader;  // unreachable: -Wswitch makes a new Family a compile error here
}

Status read_nextn(const GgufModel& g, ModelParams& p) {
  EXPERTD_TRY_ASSIGN(const uint64_t nextn, get_u64(g, "nextn_predict_layers", 0, 0, p.n_layer - 1));
  // As llama.cpp: next-n (MTP) blocks are the last `nextn` blocks; a file converted without them
  // may still carry the key, so they count only when the first one's projection is there.
  if (nextn > 0 &&
      g.find_tensor(fmt::format("blk.{}.nextn.eh_proj.weight", p.n_layer - nextn)).has_value()) {
    p.nextn_layers = static_cast<uint32_t>(nextn);
  }
  p.n_layer -= p.nextn_layers;
  return Ok{};
}

using detail::read_matrix;
using detail::read_vector;
using detail::Sources;

Result<ModelParams> read_params(const GgufModel& g) {
  ModelParams p;
  p.architecture = g.architecture();
  const FamilyInfo* family = find_family(p.architecture);
  if (family == nullptr) {
    return make_error(ENOTSUP, fmt::format("{}: architecture '{}': the engine runs {}",
                                           g.meta().path(), p.architecture, family_list()));
  }
  p.family = family->family;
  const FamilyLoader& loader = family_loader(p.family);
  if (loader.check != nullptr) EXPERTD_TRY(loader.check(g));
  const bool mla = loader.mla_head;
  EXPERTD_TRY_ASSIGN(const uint64_t n_layer, get_u64(g, "block_count", {}, 1, kMaxLayers));
  EXPERTD_TRY_ASSIGN(const uint64_t n_embd, get_u64(g, "embedding_length", {}, 1, kMaxEmbd));
  EXPERTD_TRY_ASSIGN(const uint64_t n_head, get_u64(g, "attention.head_count", {}, 1, kMaxHeads));
  EXPERTD_TRY_ASSIGN(const uint64_t n_head_kv,
                     get_u64(g, "attention.head_count_kv", n_head, 1, n_head));
  if (n_head % n_head_kv != 0) {
    return make_error(EINVAL, fmt::format("{}: {} heads do not group over {} kv heads",
                                          g.meta().path(), n_head, n_head_kv));
  }
  EXPERTD_TRY_ASSIGN(const uint64_t head_dim,
                     get_u64(g, mla ? "attention.key_length_mla" : "attention.key_length",
                             n_embd / n_head, 2, kMaxHeadDim));
  EXPERTD_TRY_ASSIGN(const uint64_t v_dim,
                     get_u64(g, mla ? "attention.value_length_mla" : "attention.value_length",
                             head_dim, 2, kMaxHeadDim));
  if (v_dim != head_dim && !mla) {
    return make_error(ENOTSUP, fmt::format("{}: key_length {} != value_length {}", g.meta().path(),
                                           head_dim, v_dim));
  }
  EXPERTD_TRY_ASSIGN(const uint64_t n_rot,
                     get_u64(g, "rope.dimension_count", head_dim, 2, head_dim));
  if (n_rot % 2 != 0) {
    return make_error(EINVAL,
                      fmt::format("{}: rope.dimension_count {} is odd", g.meta().path(), n_rot));
  }
  EXPERTD_TRY_ASSIGN(const uint64_t n_expert, get_u64(g, "expert_count", {}, 1, kMaxExperts));
  EXPERTD_TRY_ASSIGN(const uint64_t n_used,
                     get_u64(g, "expert_used_count", {}, 1, std::min(n_expert, kMaxExpertsUsed)));
  const bool ff_exp_key =
      !loader.ff_from_dense_key || g.find_arch("expert_feed_forward_length") != nullptr;
  EXPERTD_TRY_ASSIGN(const uint64_t n_ff,
                     get_u64(g, ff_exp_key ? "expert_feed_forward_length" : "feed_forward_length",
                             {}, 1, kMaxEmbd * 16));
  EXPERTD_TRY_ASSIGN(const uint64_t n_ctx, get_u64(g, "context_length", 4096, 1, 1ull << 24));
  EXPERTD_TRY_ASSIGN(const double eps, get_f64(g, "attention.layer_norm_rms_epsilon", {}));
  EXPERTD_TRY_ASSIGN(const double base, get_f64(g, "rope.freq_base", 10000.0));
  p.n_layer = static_cast<uint32_t>(n_layer);
  p.n_embd = static_cast<uint32_t>(n_embd);
  p.n_head = static_cast<uint32_t>(n_head);
  p.n_head_kv = static_cast<uint32_t>(n_head_kv);
  p.head_dim = static_cast<uint32_t>(head_dim);
  p.n_rot = static_cast<uint32_t>(n_rot);
  p.n_expert = static_cast<uint32_t>(n_expert);
  p.n_expert_used = static_cast<uint32_t>(n_used);
  p.n_ff_exp = static_cast<uint32_t>(n_ff);
  p.n_ctx_train = static_cast<uint32_t>(n_ctx);
  p.rms_eps = static_cast<float>(eps);
  p.rope_base = base;
  p.norm_topk = true;  // llama.cpp's qwen3moe graph always renormalises the top-k weights
  if (loader.read_params != nullptr) EXPERTD_TRY(loader.read_params(g, p));
  return p;
}

Result<DenseModel> DenseModel::load(const std::string& path, DenseLoad how) {
  EXPERTD_TRY_ASSIGN(GgufModel g, GgufModel::open(path));
  return load(std::move(g), path, how);
}

Result<DenseModel> DenseModel::load_from_daemon(client::Client& client, const std::string& name,
                                                DenseLoad how) {
  EXPERTD_TRY_ASSIGN(std::vector<client::ModelFile> files, client.model_files(name));
  std::vector<std::unique_ptr<ByteSource>> sources;
  for (client::ModelFile& f : files) {
    // Messages name the file as the daemon serves it: "expertd:NAME/FILE".
    EXPERTD_TRY_ASSIGN(auto src,
                       fd_source(fmt::format("expertd:{}/{}", name, f.name), std::move(f.fd)));
    sources.push_back(std::move(src));
  }
  EXPERTD_TRY_ASSIGN(GgufModel g, GgufModel::from_sources(std::move(sources)));
  std::string display = g.meta().path();
  return load(std::move(g), std::move(display), how);
}

Result<DenseModel> DenseModel::load(GgufModel g, std::string path, DenseLoad how) {
  DenseModel m;
  m.path_ = std::move(path);
  m.deferred_ = how == DenseLoad::Deferred;
  m.gguf_ = std::make_unique<GgufModel>(std::move(g));
  const GgufModel& gg = *m.gguf_;
  EXPERTD_TRY_ASSIGN(m.params_, read_params(gg));
  ModelParams& p = m.params_;

  EXPERTD_TRY_ASSIGN(Sources src, detail::open_sources(gg, how));
  const auto embd = gg.find_tensor("token_embd.weight");
  if (!embd)
    return make_error(ENOENT, fmt::format("{}: tensor token_embd.weight is missing", m.path_));
  if (embd->info->ne[1] == 0 || embd->info->ne[1] > (1u << 24)) {
    return make_error(EINVAL,
                      fmt::format("{}: token_embd.weight has {} rows", m.path_, embd->info->ne[1]));
  }
  p.n_vocab = static_cast<uint32_t>(embd->info->ne[1]);
  const uint64_t e = p.n_embd;
  const uint64_t q_dim = uint64_t{p.n_head} * p.head_dim;
  const uint64_t kv_dim = uint64_t{p.n_head_kv} * p.head_dim;
  EXPERTD_TRY_ASSIGN(m.token_embd_, read_matrix(gg, src, "token_embd.weight", p.n_vocab, e));
  EXPERTD_TRY_ASSIGN(m.output_norm_, read_vector(gg, src, "output_norm.weight", e));
  if (gg.find_tensor("output.weight")) {
    EXPERTD_TRY_ASSIGN(m.output_, read_matrix(gg, src, "output.weight", p.n_vocab, e));
  }
  const FamilyLoader& loader = family_loader(p.family);
  if (loader.load_model != nullptr) {
    EXPERTD_TRY(loader.load_model(m));
    return m;
  }
  m.layers_.resize(p.n_layer);
  for (uint32_t i = 0; i < p.n_layer; ++i) {
    LayerWeights& l = m.layers_[i];
    const std::string b = fmt::format("blk.{}.", i);
    EXPERTD_TRY_ASSIGN(l.attn_norm, read_vector(gg, src, b + "attn_norm.weight", e));
    EXPERTD_TRY_ASSIGN(l.wq, read_matrix(gg, src, b + "attn_q.weight", q_dim, e));
    EXPERTD_TRY_ASSIGN(l.wk, read_matrix(gg, src, b + "attn_k.weight", kv_dim, e));
    EXPERTD_TRY_ASSIGN(l.wv, read_matrix(gg, src, b + "attn_v.weight", kv_dim, e));
    EXPERTD_TRY_ASSIGN(l.wo, read_matrix(gg, src, b + "attn_output.weight", e, q_dim));
    if (p.qk_norm) {
      EXPERTD_TRY_ASSIGN(l.q_norm, read_vector(gg, src, b + "attn_q_norm.weight", p.head_dim));
      EXPERTD_TRY_ASSIGN(l.k_norm, read_vector(gg, src, b + "attn_k_norm.weight", p.head_dim));
    }
    EXPERTD_TRY_ASSIGN(l.ffn_norm, read_vector(gg, src, b + loader.ffn_norm + ".weight", e));
    if (!p.dense_layer(i)) {
      EXPERTD_TRY_ASSIGN(l.gate_inp,
                         read_matrix(gg, src, b + "ffn_gate_inp.weight", p.n_expert, e));
      EXPERTD_TRY(check_expert_tensors(gg, b));
    }
    if (loader.load_layer != nullptr) EXPERTD_TRY(loader.load_layer(gg, src, b, p, i, l));
  }
  return m;
}

uint64_t DenseModel::dense_bytes() const { return count_bytes(/*held=*/false); }
uint64_t DenseModel::dense_bytes_held() const { return count_bytes(/*held=*/true); }

uint64_t DenseModel::count_bytes(bool held) const {
  auto mat = [held](const Matrix& m) { return held ? m.bytes.size() : m.size(); };
  uint64_t n = mat(token_embd_) + output_norm_.size() * sizeof(float);
  if (output_) n += mat(*output_);
  if (ds4_) n += ds4_dense_bytes(*ds4_, held);
  if (ds3_) n += ds3_dense_bytes(*ds3_, held);
  for (const LayerWeights& l : layers_) {
    for (const Matrix* x : {&l.wq, &l.wk, &l.wv, &l.wo, &l.gate_inp, &l.ffn_gate, &l.ffn_up,
                            &l.ffn_down, &l.shexp_gate, &l.shexp_up, &l.shexp_down}) {
      n += mat(*x);
    }
    n += (l.attn_norm.size() + l.q_norm.size() + l.k_norm.size() + l.ffn_norm.size()) *
         sizeof(float);
    for (const auto* v : {&l.bq, &l.bk, &l.bv, &l.bo, &l.sinks, &l.gate_inp_b, &l.exp_gate_b,
                          &l.exp_up_b, &l.exp_down_b, &l.exp_bias}) {
      n += v->size() * sizeof(float);
    }
  }
  return n;
}

Result<std::span<const uint8_t>> Matrix::data(std::vector<uint8_t>& scratch) const {
  if (!bytes.empty() || size() == 0) return std::span<const uint8_t>(bytes);
  if (!file) return make_error(EINVAL, fmt::format("tensor {}: no bytes and no file", name));
  scratch.resize(size());
  if (auto st = file->read_exact(offset, scratch); !st) {
    return make_error(st.error().code, fmt::format("tensor {}: {}", name, st.error().message));
  }
  return std::span<const uint8_t>(scratch.data(), scratch.size());
}

}  // namespace expertd::engine
