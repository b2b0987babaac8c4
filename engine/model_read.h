// Reading hyperparameters and dense tensors from a GGUF model, checked: the helpers the shared
// loader (engine/model.cc) and the family files (engine/families/) share. Every error names the
// file and the key or tensor. Internal to the engine.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/model.h"
#include "expertd/result.h"
#include "storage/gguf.h"

namespace expertd::engine::detail {

// EINVAL naming the file and `<arch>.<suffix>`: "m.gguf: glm4moe.expert_count is missing".
Error key_error(const GgufModel& g, std::string_view suffix, const std::string& what);

// `<arch>.<suffix>` as an unsigned integer in [lo, hi]; `fallback` when the key is absent (an
// error when there is none).
Result<uint64_t> get_u64(const GgufModel& g, std::string_view suffix,
                         std::optional<uint64_t> fallback, uint64_t lo, uint64_t hi);
// `<arch>.<suffix>` as a positive finite number.
Result<double> get_f64(const GgufModel& g, std::string_view suffix, std::optional<double> fallback);

// Shard readers for a load: the model's own when it came from open fds (GgufModel::sources(), e.g.
// expertd's), else each shard opened once by path.
struct Sources {
  std::vector<std::shared_ptr<const ByteSource>> files;
  bool defer_matrices = false;  // read_matrix records where a matrix is instead of reading it
};
Result<Sources> open_sources(const GgufModel& g, DenseLoad how);

// A 2-D tensor of `rows` x `cols` (GGUF ne [cols, rows]) in its file encoding, which must be one
// the engine dequantises; its bytes are left in the file when `src.defer_matrices`.
Result<Matrix> read_matrix(const GgufModel& g, const Sources& src, const std::string& name,
                           uint64_t rows, uint64_t cols);
// A 3-D tensor of n matrices of rows x cols (GGUF ne [cols, rows, n]) as one matrix of n * rows
// rows: matrix i is rows [i * rows, (i + 1) * rows).
Result<Matrix> read_matrices(const GgufModel& g, const Sources& src, const std::string& name,
                             uint64_t n, uint64_t rows, uint64_t cols);
// `<arch>.rope.scaling.*` when the type is "yarn" (none when absent or "none"; another type is an
// error naming the architecture, which supports only these).
Result<Yarn> read_yarn(const GgufModel& g);
// A tensor of `n` elements (ne [n]) as floats.
Result<std::vector<float>> read_vector(const GgufModel& g, const Sources& src,
                                       const std::string& name, uint64_t n);
// A 2-D tensor of rows x cols as floats (small tensors: the hc mixes, position biases).
Result<std::vector<float>> read_floats(const GgufModel& g, const Sources& src,
                                       const std::string& name, uint64_t rows, uint64_t cols);

// llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_* (expert_gating_func).
inline constexpr uint64_t kGatingSoftmax = 1;
inline constexpr uint64_t kGatingSigmoid = 2;
inline constexpr uint64_t kGatingSqrtSoftplus = 4;

// The SigmoidMoe keys under the file's architecture (engine/sigmoid_moe.cc): leading dense layers,
// shared experts, scaling, scoring (`gating_default` when expert_gating_func is absent: llama.cpp's
// default for the architecture) and the groups, checked against p's experts.
Status read_sigmoid_moe(const GgufModel& g, const ModelParams& p, uint64_t gating_default,
                        SigmoidMoe& m);

// The SigmoidMoe part of layer `layer` (block prefix `b`, "blk.N."; engine/sigmoid_moe.cc): a dense
// layer's ffn_gate/up/down, or a MoE layer's exp_probs_b.bias (zeros when absent unless
// `bias_required`) and shared experts. The router and the routed experts are not read here.
Status read_sigmoid_moe_layer(const GgufModel& g, const Sources& src, const std::string& b,
                              const ModelParams& p, const SigmoidMoe& m, uint32_t layer,
                              bool bias_required, SigmoidMoeWeights& w);

}  // namespace expertd::engine::detail
