// The CUDA engine for DeepSeek-V3 / Kimi-K2 (`deepseek2`): the forward of Ds3CpuEngine (the
// specification, engine/ds3_cpu_engine.h) on the GPU, one token per decode().
//
// Device: every dense weight in its GGUF encoding (read by the fused matvec kernels of
// kernels/matvec.cuh as they read experts), the norm vectors and router biases as f32, the latent
// KV cache (kv_lora_rank + n_rot floats per position and layer) and every activation. Per token:
// the q LoRA and latent projections, RMSNorms, adjacent-pair RoPE, attn_k_b absorbed into the
// queries and attn_v_b applied to the latent outputs (batched matvecs, one job per head), the MLA
// attention of kernels/ds3.cuh, the dense MLP or the routed and shared experts (SwiGLU, the MoE
// sum).
//
// Host: the routing decision. Each MoE layer copies its router logits (and the lookahead layers')
// back and synchronises once; the group-limited top-k, the weights and the hints are the CPU
// engine's own code (ds3_route, ds3_hint_probs), so routing records, hint streams and stats are
// Ds3CpuEngine's. That sync is also where the previous layer's expert holds are given back.
// Experts reach the device through GpuExperts (in place from the registered arena, or a VRAM
// tier), as in GpuEngine.
//
// prefill() runs chunks layer by layer (prefill_chunk below).
//
// Sequences (EngineOptions::sequences, at most GpuEngine::kMaxSequences): each has its own latent
// and rope-key cache of max_context positions on the device; decode(), prefill(), truncate(),
// reset() and position() act on the selected one. decode_batch() runs one step of several layer
// by layer, as GpuEngine's: each row's attention (over its own sequence's cache) and routing as
// decode() computes them, into the row's own buffers, one sync and one hint message per layer for
// all the rows; then each distinct (layer, expert) of the step acquired once (ascending, top-k at
// a time) and applied to every row routing to it with decode()'s kernels, launched in decode()'s
// batch sizes (so the matvec picks the same plan), and each row combined as decode() combines it.
// Each row's logits are those of its sequence decoded alone, to the bit, while a step reads each
// expert once for all its rows. An engine of one sequence decodes the rows in turn.
//
// decode() allocates nothing unless a routing log is attached (decode_batch() allocates only
// its checks' small vectors). Not thread-safe.
#pragma once

#include <memory>
#include <string>

#include "engine/engine.h"
#include "engine/expert_source.h"
#include "engine/gpu_engine.h"
#include "engine/model.h"

namespace expertd::engine {

class Ds3GpuEngine final : public Engine {
 public:
  // `model` (a deepseek2 model) and `source` must outlive the engine. Uploads the dense weights
  // (errors name the tensor whose type the kernels do not read, or the bytes wanted when VRAM is
  // short) and registers the source's host memory.
  static Result<std::unique_ptr<Ds3GpuEngine>> create(const DenseModel& model, ExpertSource& source,
                                                      const EngineOptions& options,
                                                      const GpuOptions& gpu);
  ~Ds3GpuEngine() override;

  Status decode(uint32_t token, std::span<float> logits) override;
  // Forgets the selected sequence.
  void reset() override;
  // The cache holds positions independently: any prefix can be kept.
  bool truncate(uint32_t n) override;
  uint32_t position() const override;
  uint32_t sequences() const override;
  Status select_sequence(uint32_t sequence) override;
  uint32_t selected_sequence() const override;
  // One step of distinct sequences, each row's logits its sequence's decode() to the bit; a row
  // whose sequence's cache is full is refused naming the sequence, before anything runs.
  Status decode_batch(std::span<const BatchRow> rows, std::span<float> logits) override;
  const EngineStats& stats() const override;
  const ModelParams& params() const override;
  const EngineOptions& options() const override;
  void set_routing_log(std::vector<RoutingRecord>* log) override;
  std::string name() const override { return "gpu"; }
  std::string description() const override;

  struct Impl;

 private:
  EngineStats& mutable_stats() override;
  // Layer by layer over a chunk: each position's attention and routing as decode() computes them
  // (the same kernels in the same order, so the logits are decode()'s to the bit), but every
  // layer's experts hinted exactly for the whole chunk once its routing is known, so each is read
  // once per chunk rather than once per position.
  uint32_t prefill_chunk_size() const override;
  Status prefill_chunk(std::span<const uint32_t> tokens, std::span<float> logits) override;
  explicit Ds3GpuEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace expertd::engine
