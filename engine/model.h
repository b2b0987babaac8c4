// A model's hyperparameters and dense weights, loaded from GGUF for the engines: Qwen3-MoE
// (`qwen3moe`), Mixtral (`llama` with routed experts; the qwen3moe forward without q/k norms and
// with NORM RoPE), gpt-oss (`gpt-oss`; the same forward with biases, sinks, a sliding window and
// its own router and SwiGLU), GLM-4.5 (`glm4moe`; the same forward with q/k/v biases, partial RoPE
// and DeepSeek-V3's MoE: SigmoidMoe below), DeepSeek-V4 (`deepseek4`, the Ds4* types below) or
// DeepSeek-V3 / Kimi-K2 (`deepseek2`, the Ds3* types). The shared loader is engine/model.cc; what
// each family adds is its family file, engine/families/ (families.h).
//
// DenseModel owns everything except the routed experts: the token embeddings, every layer's norms,
// attention projections and router (ffn_gate_inp), the output norm and head. Matrices keep their
// GGUF encoding (f32, f16, bf16, q8_0, q4_k, q6_k or mxfp4) and are dequantised a row at a time
// while multiplying, so a quantised model costs its file size in memory, not four bytes per weight;
// norm vectors are dequantised once at load. Tensor bytes are read with pread (ByteSource) and
// every tensor's type and shape is checked against the hyperparameters before it is used. Routed
// expert data is never read here: the engine gets experts from an ExpertSource (the daemon).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/family.h"
#include "expertd/result.h"
#include "storage/ggml_types.h"
#include "storage/gguf.h"

namespace expertd::client {
class Client;
}  // namespace expertd::client

namespace expertd::engine {

// DeepSeek-V4's own hyperparameters (llama.cpp's `deepseek4` keys; ModelParams holds the shared
// ones: layers, widths, heads, head_dim, rope dimension count, experts).
enum class Ds4Attention : uint8_t {
  Sliding,     // compress ratio 0: the sliding window only
  Compressed,  // CSA: overlapping windows of `ratio` tokens, the Lightning Indexer picks top-k
  Heavy,       // HCA: non-overlapping windows of `ratio` tokens, every entry attended
};

struct Ds4Params {
  uint32_t q_lora_rank = 0;  // attention.q_lora_rank
  uint32_t o_groups = 0;     // attention.output_group_count
  uint32_t o_lora_rank = 0;  // attention.output_lora_rank
  uint32_t window = 0;       // attention.sliding_window (keys including the current one)
  std::vector<uint32_t> compress_ratio;  // attention.compress_ratios, one per layer
  std::vector<Ds4Attention> attention;   // per layer, from the ratio and the layer's tensors
  double compress_rope_base = 0.0;       // attention.compress_rope_freq_base
  // YaRN on the compressed layers' rope (rope.scaling.type "yarn"); factor 0 = none.
  double yarn_factor = 0.0;
  uint32_t yarn_orig_ctx = 0;
  double yarn_beta_fast = 32.0;
  double yarn_beta_slow = 1.0;
  uint32_t hc = 0;                 // hyper_connection.count: residual streams
  uint32_t hc_iters = 0;           // hyper_connection.sinkhorn_iterations
  float hc_eps = 0.0f;             // hyper_connection.epsilon
  uint32_t hash_layers = 0;        // hash_layer_count: the first layers route by tid2eid[token]
  uint32_t index_heads = 0;        // attention.indexer.head_count
  uint32_t index_dim = 0;          // attention.indexer.key_length
  uint32_t index_topk = 0;         // attention.indexer.top_k
  uint32_t n_shared = 0;           // expert_shared_count
  float weights_scale = 1.0f;      // expert_weights_scale (routed_scaling_factor)
  bool weights_norm = true;        // expert_weights_norm
  std::vector<float> clamp_exp;    // swiglu_clamp_exp per layer (0 = none)
  std::vector<float> clamp_shexp;  // swiglu_clamp_shexp per layer
};

// YaRN context extension of the rope (rope.scaling.type "yarn"; factor 0 = none).
struct Yarn {
  double factor = 0.0;      // rope.scaling.factor
  uint32_t orig_ctx = 0;    // rope.scaling.original_context_length
  double beta_fast = 32.0;  // rope.scaling.yarn_beta_fast
  double beta_slow = 1.0;   // rope.scaling.yarn_beta_slow
};

// DeepSeek-V3's MoE block, which GLM-4.5 (`glm4moe`) shares (the same keys under each
// architecture's prefix): leading dense layers, sigmoid (or softmax) scores with a selection bias
// (exp_probs_b), group-limited top-k, weights renormalised and scaled, shared experts.
struct SigmoidMoe {
  uint32_t dense_lead = 0;     // leading_dense_block_count: layers [0, dense_lead) have a dense MLP
  uint32_t n_ff = 0;           // feed_forward_length: the dense MLP's width
  uint32_t n_shared = 0;       // expert_shared_count
  uint32_t n_group = 1;        // expert_group_count: experts in n_group equal groups
  uint32_t n_group_used = 1;   // expert_group_used_count: the top-k comes from this many groups
  bool sigmoid = true;         // expert_gating_func: sigmoid (V3, GLM) or softmax (V2)
  float weights_scale = 1.0f;  // expert_weights_scale (routed_scaling_factor)
  bool weights_norm = false;   // expert_weights_norm
};

// DeepSeek-V3's own hyperparameters (llama.cpp's `deepseek2` keys). Multi-head latent attention:
// ModelParams::head_dim is the query/key head (attention.key_length_mla = qk_nope + n_rot); keys
// and values are kept as one compressed latent of kv_lora_rank per position plus the shared rope
// key of n_rot.
struct Ds3Params : SigmoidMoe {
  uint32_t q_lora_rank = 0;   // attention.q_lora_rank (0: one attn_q projection, as V2-Lite)
  uint32_t kv_lora_rank = 0;  // attention.kv_lora_rank
  uint32_t qk_nope = 0;       // head_dim - n_rot: the part of a head without rope
  uint32_t v_head_dim = 0;    // attention.value_length_mla
  Yarn yarn;
  // rope.scaling.yarn_log_multiplier, which llama.cpp's converter writes as 0.1 * mscale_all_dim
  // (0 = absent).
  double yarn_log_mul = 0.0;
};

// Which dimensions RoPE rotates together (llama.cpp's rope types): NEOX pairs i with i + n_rot/2
// (Hugging Face's rotate_half), NORM pairs 2i with 2i + 1. llama.cpp's converter permutes a `llama`
// model's q/k rows so that NORM on its file computes what rotate_half did on the original.
enum class RopeType : uint8_t { Neox, Norm };

// The generic engines (CpuEngine, GpuEngine) compose a family from blocks; its family file
// (engine/families/) chooses them in ModelParams. The router of the MoE layers:
enum class RouterKind : uint8_t {
  Softmax,  // softmax over every expert, top-k, renormalised when norm_topk (Qwen3-MoE, Mixtral)
  TopkSoftmax,  // the top-k of the biased logits, then a softmax over those k (gpt-oss)
  // SigmoidMoe (ModelParams::sigmoid_moe): sigmoid scores, a selection bias, group-limited top-k,
  // with the block's dense leading layers and shared experts (GLM-4.5, as DeepSeek-V3's)
  Sigmoid,
};
// The routed experts' activation: silu(gate) * up, or gpt-oss's clamped SwiGLU on the biased
// projections (kGptOssAlpha, kGptOssLimit; the layer's exp_*_b).
enum class ExpertAct : uint8_t { Swiglu, ClampedSwiglu };

struct ModelParams {
  std::string architecture;          // general.architecture (a row of engine/family.h's registry)
  Family family = Family::Qwen3Moe;  // that row's family
  uint32_t n_layer = 0;              // block_count less the MTP blocks (nextn_layers)
  uint32_t n_embd = 0;               // embedding_length
  uint32_t n_head = 0;               // attention.head_count
  uint32_t n_head_kv = 0;            // attention.head_count_kv
  uint32_t head_dim = 0;             // attention.key_length (== value_length)
  uint32_t n_rot = 0;                // rope.dimension_count, else head_dim
  uint32_t n_expert = 0;             // expert_count
  uint32_t n_expert_used = 0;        // expert_used_count
  uint32_t n_ff_exp = 0;             // expert_feed_forward_length
  uint32_t n_vocab = 0;              // rows of token_embd
  uint32_t n_ctx_train = 0;          // context_length
  float rms_eps = 1e-6f;             // attention.layer_norm_rms_epsilon
  double rope_base = 10000.0;        // rope.freq_base
  bool norm_topk = true;             // renormalise the top-k router weights (always, for qwen3moe)
  Ds4Params ds4;                     // deepseek4 only
  Ds3Params ds3;                     // deepseek2 only
  // Mixtral (`llama`): NORM RoPE, no per-head attn_q_norm/attn_k_norm, and n_ff_exp is
  // feed_forward_length.
  RopeType rope = RopeType::Neox;
  bool qk_norm = true;
  bool is_ds4() const { return family == Family::DeepSeek4; }
  bool is_ds3() const { return family == Family::DeepSeek3; }
  // The generic engines' blocks (above), chosen by the family file: gpt-oss's router and
  // activation; GLM-4.5's SigmoidMoe router and MoE block.
  RouterKind router = RouterKind::Softmax;
  ExpertAct act = ExpertAct::Swiglu;
  SigmoidMoe sigmoid_moe;  // router == Sigmoid (DeepSeek-V3 keeps its own in ds3)
  // Attention: the even layers attend to their last `swa_window` positions (gpt-oss); YaRN RoPE
  // (gpt-oss; DeepSeek-V3 keeps its own in ds3). gpt-oss's q/k/v/o biases and sinks, and GLM-4.5's
  // q/k/v biases, are read where the file has them (LayerWeights).
  uint32_t swa_window = 0;  // attention.sliding_window (0: every layer attends to all)
  Yarn yarn;
  // Whether `layer` attends to a sliding window (gpt-oss: even layers, llama.cpp's pattern 2).
  bool sliding(uint32_t layer) const { return swa_window > 0 && layer % 2 == 0; }
  // Whether `layer` has a dense MLP instead of routed experts (SigmoidMoe's leading layers).
  bool dense_layer(uint32_t layer) const {
    return router == RouterKind::Sigmoid && layer < sigmoid_moe.dense_lead;
  }
  // nextn_predict_layers: the MTP (next-n prediction) blocks after the n_layer main ones, as
  // llama.cpp's converter writes DeepSeek-V4's and GLM-4.5's. The engines skip them; their routed
  // experts are in the file and the slice map all the same.
  uint32_t nextn_layers = 0;
};

// gpt-oss's SwiGLU constants (transformers' GptOssExperts and llama.cpp's SWIGLU_OAI_MOE hard-code
// them; the GGUF has no key): out = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with
// g = min(gate, limit).
inline constexpr float kGptOssAlpha = 1.702f;
inline constexpr float kGptOssLimit = 7.0f;

// A 2-D weight in its GGUF encoding: `rows` rows (ne1, output features) of `cols` elements (ne0,
// input features), row r at data + r * row_bytes. Non-owning.
struct WeightView {
  GgmlType type = GgmlType::F32;
  const uint8_t* data = nullptr;
  uint64_t rows = 0;
  uint64_t cols = 0;
  uint64_t row_bytes = 0;
};

// An owned 2-D weight (the bytes as read from the file).
struct Matrix {
  std::string name;
  GgmlType type = GgmlType::F32;
  uint64_t rows = 0;
  uint64_t cols = 0;
  uint64_t row_bytes = 0;
  std::vector<uint8_t> bytes;  // empty when the model was loaded with DenseLoad::Deferred
  // Where the bytes are in the model's files (always set by the loader).
  std::shared_ptr<const ByteSource> file;
  uint64_t offset = 0;

  uint64_t size() const { return row_bytes * rows; }
  WeightView view() const { return WeightView{type, bytes.data(), rows, cols, row_bytes}; }
  // The bytes: `bytes` when loaded, else read from the file into `scratch` (errors name the file
  // and the tensor).
  Result<std::span<const uint8_t>> data(std::vector<uint8_t>& scratch) const;
};

// How DenseModel::load treats the weight matrices. Deferred keeps only where each one is in the
// file (the vectors are read as usual), for the CUDA engines: they read each matrix once, convert
// and upload it, so the host never holds every dense weight at once. On a Mixtral-shaped model
// that is 3.2 GB that a memory cap gives to expertd's cache instead. Only the CUDA engines accept
// a deferred model.
enum class DenseLoad { Eager, Deferred };

// The dense part of SigmoidMoe's layers: a dense layer's MLP, or a MoE layer's selection bias and
// shared experts.
struct SigmoidMoeWeights {
  Matrix ffn_gate, ffn_up, ffn_down;        // dense layers: [n_ff, n_embd] x2, [n_embd, n_ff]
  std::vector<float> exp_bias;              // MoE layers: exp_probs_b (n_expert; zeros if absent)
  Matrix shexp_gate, shexp_up, shexp_down;  // the shared experts
};

// glm4moe's layers use the SigmoidMoeWeights part; the other CpuEngine families leave it empty.
struct LayerWeights : SigmoidMoeWeights {
  std::vector<float> attn_norm;  // n_embd
  Matrix wq;                     // [n_head * head_dim rows, n_embd cols]
  Matrix wk;                     // [n_head_kv * head_dim, n_embd]
  Matrix wv;                     // [n_head_kv * head_dim, n_embd]
  Matrix wo;                     // [n_embd, n_head * head_dim]
  std::vector<float> q_norm;     // head_dim; empty without qk_norm
  std::vector<float> k_norm;     // head_dim; empty without qk_norm
  std::vector<float> ffn_norm;   // n_embd (gpt-oss's and glm4moe's post_attention_norm)
  Matrix gate_inp;               // router: [n_expert, n_embd] (empty on a dense layer)
  // gpt-oss (and glm4moe's q/k/v biases, where the file has them); empty otherwise. The expert
  // biases are dense, not streamed: n_ff_exp * 2 + n_embd floats per expert, under 1% of an MXFP4
  // expert, indexed [expert][row].
  std::vector<float> bq, bk, bv, bo;  // projection biases
  std::vector<float> sinks;           // n_head: each head's sink logit
  std::vector<float> gate_inp_b;      // n_expert
  std::vector<float> exp_gate_b;      // [n_expert][n_ff_exp]
  std::vector<float> exp_up_b;        // [n_expert][n_ff_exp]
  std::vector<float> exp_down_b;      // [n_expert][n_embd]
};

// One DeepSeek-V4 compressor (the attention's, or the indexer's): `coff` = 2 for overlapping (CSA)
// windows, 1 for HCA. Projections are [coff * dim rows, n_embd cols].
struct Ds4Compressor {
  Matrix wkv;
  Matrix wgate;
  std::vector<float> ape;   // [ratio][coff * dim] (position bias within a window)
  std::vector<float> norm;  // dim
  uint32_t coff = 0;
  uint32_t dim = 0;
};

struct Ds4LayerWeights {
  Matrix hc_attn_fn;  // [(2 + hc) * hc rows, hc * n_embd cols]
  std::vector<float> hc_attn_base, hc_attn_scale;
  Matrix hc_ffn_fn;
  std::vector<float> hc_ffn_base, hc_ffn_scale;
  std::vector<float> attn_norm;  // n_embd
  std::vector<float> sinks;      // n_head
  Matrix wq_a;                   // [q_lora_rank, n_embd]
  std::vector<float> q_a_norm;   // q_lora_rank
  Matrix wq_b;                   // [n_head * head_dim, q_lora_rank]
  Matrix wkv;                    // [head_dim, n_embd]
  std::vector<float> kv_norm;    // head_dim
  Matrix wo_a;                   // [o_groups * o_lora_rank, n_head * head_dim / o_groups]
  Matrix wo_b;                   // [n_embd, o_groups * o_lora_rank]
  std::optional<Ds4Compressor> compressor;  // CSA and HCA layers
  std::optional<Ds4Compressor> index_comp;  // CSA layers: the indexer's compressor
  Matrix index_q_b;                         // CSA: [index_heads * index_dim, q_lora_rank]
  Matrix index_proj;                        // CSA: [index_heads, n_embd]
  std::vector<float> ffn_norm;              // n_embd
  Matrix gate_inp;                          // [n_expert, n_embd]
  std::vector<float> exp_bias;              // learned layers: e_score_correction_bias
  std::vector<uint32_t> tid2eid;            // hash layers: [n_vocab][n_expert_used]
  Matrix shexp_gate, shexp_up, shexp_down;  // the shared expert
};

struct Ds3LayerWeights : SigmoidMoeWeights {
  std::vector<float> attn_norm;  // n_embd
  Matrix wq_a;                   // [q_lora_rank, n_embd] (q LoRA)
  std::vector<float> q_a_norm;   // q_lora_rank
  Matrix wq_b;                   // [n_head * head_dim, q_lora_rank]
  Matrix wq;                     // [n_head * head_dim, n_embd] (no q LoRA)
  Matrix wkv_a;                  // [kv_lora_rank + n_rot, n_embd]
  std::vector<float> kv_a_norm;  // kv_lora_rank
  Matrix wk_b;                   // per head h, rows [h * kv_lora_rank, +kv_lora_rank) x qk_nope
  Matrix wv_b;                   // per head h, rows [h * v_head_dim, +v_head_dim) x kv_lora_rank
  Matrix wo;                     // [n_embd, n_head * v_head_dim]
  std::vector<float> ffn_norm;   // n_embd
  Matrix gate_inp;               // MoE layers: [n_expert, n_embd]
};

struct Ds3Weights {
  std::vector<Ds3LayerWeights> layers;
};

struct Ds4Weights {
  Matrix hc_head_fn;  // [hc, hc * n_embd]
  std::vector<float> hc_head_base;
  float hc_head_scale = 1.0f;
  std::vector<Ds4LayerWeights> layers;
};

class DenseModel {
 public:
  DenseModel(DenseModel&&) = default;
  DenseModel& operator=(DenseModel&&) = default;
  DenseModel(const DenseModel&) = delete;
  DenseModel& operator=(const DenseModel&) = delete;

  // Opens `path` (a single file or the first shard of a split model), reads the hyperparameters
  // and every dense weight. Errors name the file and the tensor or key: "model.gguf: tensor
  // blk.3.attn_q.weight: shape [64, 32], expected [64, 64]".
  static Result<DenseModel> load(const std::string& path, DenseLoad how = DenseLoad::Eager);
  // The model expertd serves as `name`: its files come over the socket as read-only fds
  // (Client::model_files), every shard in order, and the dense weights are read through them, so
  // the caller needs no access to the files' paths. path() is then "expertd:NAME/FILE".
  static Result<DenseModel> load_from_daemon(client::Client& client, const std::string& name,
                                             DenseLoad how = DenseLoad::Eager);
  // From an opened GGUF (by path or from fds); `path` names it in messages.
  static Result<DenseModel> load(GgufModel gguf, std::string path,
                                 DenseLoad how = DenseLoad::Eager);

  const ModelParams& params() const { return params_; }
  const GgufModel& gguf() const { return *gguf_; }
  const std::string& path() const { return path_; }
  const Matrix& token_embd() const { return token_embd_; }
  const std::vector<float>& output_norm() const { return output_norm_; }
  // The output head (token_embd when the model ties them).
  const Matrix& output() const { return output_ ? *output_ : token_embd_; }
  const LayerWeights& layer(uint32_t i) const { return layers_[i]; }
  // DeepSeek-V4's weights (nullptr for other architectures).
  const Ds4Weights* ds4() const { return ds4_.get(); }
  // DeepSeek-V3's weights (nullptr for other architectures).
  const Ds3Weights* ds3() const { return ds3_.get(); }
  // Bytes of the dense weights (in their file encoding; for the run summary).
  uint64_t dense_bytes() const;
  // Bytes of them held in memory now (the vectors alone when the matrices are deferred).
  uint64_t dense_bytes_held() const;
  // Whether the matrices were left in the file (DenseLoad::Deferred).
  bool deferred() const { return deferred_; }

 private:
  DenseModel() = default;

  std::string path_;
  std::unique_ptr<GgufModel> gguf_;
  ModelParams params_;
  Matrix token_embd_;
  std::optional<Matrix> output_;
  std::vector<float> output_norm_;
  std::vector<LayerWeights> layers_;
  std::unique_ptr<Ds4Weights> ds4_;
  std::unique_ptr<Ds3Weights> ds3_;
  bool deferred_ = false;

  uint64_t count_bytes(bool held) const;

  friend Status load_ds4(DenseModel& m);
  friend Status load_ds3(DenseModel& m);
};

// The hyperparameters of a GGUF model (exposed for tests and tools). Errors name the missing or
// invalid key.
Result<ModelParams> read_params(const GgufModel& gguf);

// nextn_predict_layers into p.nextn_layers, and n_layer less them (deepseek4, glm4moe).
Status read_nextn(const GgufModel& gguf, ModelParams& p);
// The DeepSeek families' own dense weights (engine/families/deepseek3.cc, deepseek4.cc; their
// FamilyLoader::load_model), and their bytes.
Status load_ds4(DenseModel& m);
uint64_t ds4_dense_bytes(const Ds4Weights& w, bool held);
Status load_ds3(DenseModel& m);
uint64_t ds3_dense_bytes(const Ds3Weights& w, bool held);
// Calls f(Matrix&) for every weight matrix of `w`.
template <typename W, typename F>
void ds4_for_each_matrix(W& w, F&& f) {
  f(w.hc_head_fn);
  for (auto& l : w.layers) {
    for (auto* x :
         {&l.hc_attn_fn, &l.hc_ffn_fn, &l.wq_a, &l.wq_b, &l.wkv, &l.wo_a, &l.wo_b, &l.index_q_b,
          &l.index_proj, &l.gate_inp, &l.shexp_gate, &l.shexp_up, &l.shexp_down}) {
      f(*x);
    }
    for (auto* c : {&l.compressor, &l.index_comp}) {
      if (*c) {
        f((*c)->wkv);
        f((*c)->wgate);
      }
    }
  }
}

}  // namespace expertd::engine
