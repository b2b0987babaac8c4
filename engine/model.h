// A Qwen3-MoE model's hyperparameters and dense weights, loaded from GGUF for the CPU reference
// engine.
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
#include <string>
#include <vector>

#include "expertd/result.h"
#include "storage/ggml_types.h"
#include "storage/gguf.h"

namespace expertd::engine {

struct ModelParams {
  std::string architecture;    // "qwen3moe"
  uint32_t n_layer = 0;        // block_count
  uint32_t n_embd = 0;         // embedding_length
  uint32_t n_head = 0;         // attention.head_count
  uint32_t n_head_kv = 0;      // attention.head_count_kv
  uint32_t head_dim = 0;       // attention.key_length (== value_length)
  uint32_t n_rot = 0;          // rope.dimension_count, else head_dim
  uint32_t n_expert = 0;       // expert_count
  uint32_t n_expert_used = 0;  // expert_used_count
  uint32_t n_ff_exp = 0;       // expert_feed_forward_length
  uint32_t n_vocab = 0;        // rows of token_embd
  uint32_t n_ctx_train = 0;    // context_length
  float rms_eps = 1e-6f;       // attention.layer_norm_rms_epsilon
  double rope_base = 10000.0;  // rope.freq_base
  bool norm_topk = true;       // renormalise the top-k router weights (always, for qwen3moe)
};

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
  std::vector<uint8_t> bytes;

  WeightView view() const { return WeightView{type, bytes.data(), rows, cols, row_bytes}; }
};

struct LayerWeights {
  std::vector<float> attn_norm;  // n_embd
  Matrix wq;                     // [n_head * head_dim rows, n_embd cols]
  Matrix wk;                     // [n_head_kv * head_dim, n_embd]
  Matrix wv;                     // [n_head_kv * head_dim, n_embd]
  Matrix wo;                     // [n_embd, n_head * head_dim]
  std::vector<float> q_norm;     // head_dim
  std::vector<float> k_norm;     // head_dim
  std::vector<float> ffn_norm;   // n_embd
  Matrix gate_inp;               // router: [n_expert, n_embd]
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
  static Result<DenseModel> load(const std::string& path);

  const ModelParams& params() const { return params_; }
  const GgufModel& gguf() const { return *gguf_; }
  const std::string& path() const { return path_; }
  const Matrix& token_embd() const { return token_embd_; }
  const std::vector<float>& output_norm() const { return output_norm_; }
  // The output head (token_embd when the model ties them).
  const Matrix& output() const { return output_ ? *output_ : token_embd_; }
  const LayerWeights& layer(uint32_t i) const { return layers_[i]; }
  // Bytes of dense weights held (for the run summary).
  uint64_t dense_bytes() const;

 private:
  DenseModel() = default;

  std::string path_;
  std::unique_ptr<GgufModel> gguf_;
  ModelParams params_;
  Matrix token_embd_;
  std::optional<Matrix> output_;
  std::vector<float> output_norm_;
  std::vector<LayerWeights> layers_;
};

// The hyperparameters of a GGUF model (exposed for tests and tools). Errors name the missing or
// invalid key.
Result<ModelParams> read_params(const GgufModel& gguf);

}  // namespace expertd::engine
