// The CUDA engine for DeepSeek-V4 (`deepseek4`): the forward of Ds4CpuEngine (the specification,
// engine/ds4_cpu_engine.h) on the GPU, one token per decode(), or one per sequence per
// decode_batch().
//
// Device: every dense weight in its GGUF encoding (the fused matvec kernels of kernels/matvec.cuh
// read them as they read experts), the norm vectors and biases as f32, the sliding-window K=V
// ring, the compressors' window buffers and entries, and every activation. The per-token work is
// kernels/ds4.cuh (HyperConnection mixes and Sinkhorn, RMSNorm, interleaved RoPE, the compressor's
// window softmax, the Lightning Indexer's scores and top-k, attention with sinks, clamped SwiGLU,
// the MoE sum) and kernels/matvec.cuh (every projection, the routed and shared experts).
//
// Host: the routing decision. Each layer copies its router logits (and the lookahead layers') back
// and synchronises once; sqrtsoftplus, hash or learned top-k, the weights and the hints are the
// CPU engine's own code (ds4_route, ds4_hint_probs), so routing records, hint streams and stats
// are those of Ds4CpuEngine. That sync is also where the previous layer's expert holds are given
// back. Experts reach the device through GpuExperts (in place from the registered arena, or a VRAM
// tier), as in GpuEngine.
//
// prefill() is Ds4CpuEngine::prefill on the device: layer by layer over a chunk of
// EngineOptions::prefill_chunk positions whose mHC streams, FFN-site post/comb mixes and MoE inputs
// stay on the device for the whole chunk. The attention sublayer is decode()'s code run position by
// position (its window, compressors and indexer are running state); the chunk's router logits come
// back in one copy per layer and are routed on the host; the routed experts are acquired once per
// chunk and layer in groups of at most top-k and applied to all their positions as dequantised f32
// cuBLAS GEMMs (the clamped SwiGLU between); each position sums its route slots in decode()'s
// order. The chunk scratch is allocated at create().
//
// truncate(n) works for any n (prefix reuse), as Ds4CpuEngine's: the sliding-window ring and the
// compressors' open windows cannot be cut back, so the engine keeps kCheckpoints device copies of
// that running state (at the end of every prefill chunk, every kCheckpointEvery decoded positions
// and at the last cut; the running buffers of every layer are one contiguous region, so a
// checkpoint is one device-to-device copy on the compute stream), restores the last one at or
// before n and feeds the positions from there to n again through prefill, from the ids it keeps on
// the host. The emitted compressed entries are append-only: a checkpoint keeps their counts. The
// checkpoints are sized at create(); truncate() allocates nothing. The state it leaves is the one a
// fresh engine reaches through the same calls (the kernels are deterministic), not decode()'s to
// the bit: prefill's expert GEMMs round differently from decode's fused matvecs.
//
// Sequences (EngineOptions::sequences, at most GpuEngine::kMaxSequences): each has its own
// position, window ring, compressors and entries, checkpoints and fed ids on the device, all sized
// at create(); decode(), prefill(), truncate(), reset() and position() act on the selected one.
// decode_batch() runs one step of several sequences layer by layer: each row's mHC mixes, attention
// (on its own sequence's state) and routers as decode() runs them, on the row's own buffers
// (allocated only for sequences > 1), one sync per layer for every row's router logits; then each
// distinct routed expert of the step's layer is acquired once (ascending, top-k at a time) and
// applied to every row routing to it with decode()'s launches (same job counts and shapes), and
// each row's shared expert, MoE sum, expansion and head are decode()'s. So each row's logits are
// its sequence's decode() alone, to the bit. The hash layers' experts of all the rows' tokens are
// hinted once per step, the learned layers' lookahead for all the rows in one message per layer.
//
// decode(), prefill() and truncate() allocate nothing unless a routing log is attached
// (decode_batch() allocates only its checks' small vectors). Not thread-safe.
#pragma once

#include <memory>
#include <string>

#include "engine/ds4_cpu_engine.h"
#include "engine/engine.h"
#include "engine/expert_source.h"
#include "engine/gpu_engine.h"
#include "engine/model.h"

namespace expertd::engine {

class Ds4GpuEngine final : public Engine {
 public:
  // `model` (a deepseek4 model) and `source` must outlive the engine. Uploads the dense weights
  // (errors name the tensor whose type the kernels do not read, or the bytes wanted when VRAM is
  // short) and registers the source's host memory.
  static Result<std::unique_ptr<Ds4GpuEngine>> create(const DenseModel& model, ExpertSource& source,
                                                      const EngineOptions& options,
                                                      const GpuOptions& gpu);
  ~Ds4GpuEngine() override;

  Status decode(uint32_t token, std::span<float> logits) override;
  // Any n <= position(): restores a checkpoint and feeds the rest (see above). False, with the
  // engine reset, when feeding fails (an expert read or a device error); false, unchanged, for
  // n > position().
  bool truncate(uint32_t n) override;
  // Checkpoints kept, and the decoded positions between two (Ds4CpuEngine's policy).
  static constexpr uint32_t kCheckpoints = Ds4CheckpointSlots::kCount;
  static constexpr uint32_t kCheckpointEvery = Ds4CheckpointSlots::kEvery;
  // Positions truncate() fed again (for tests and the run summary).
  uint64_t refed_positions() const;
  void reset() override;
  uint32_t position() const override;
  const EngineStats& stats() const override;
  const ModelParams& params() const override;
  const EngineOptions& options() const override;
  uint32_t sequences() const override;
  Status select_sequence(uint32_t sequence) override;
  uint32_t selected_sequence() const override;
  // One step of distinct sequences (see above); refuses a row whose sequence's context is full,
  // before anything runs. The selected sequence is unchanged. After an error, reset the rows'
  // sequences. An engine of one sequence decodes the row (Engine::decode_batch).
  Status decode_batch(std::span<const BatchRow> rows, std::span<float> logits) override;
  void set_routing_log(std::vector<RoutingRecord>* log) override;
  std::string name() const override { return "gpu"; }
  std::string description() const override;

  // Device slots of the VRAM tier (0 in the in-place mode) and the bytes of one.
  uint32_t vram_slots() const;
  uint64_t vram_slot_bytes() const;

  struct Impl;

 private:
  EngineStats& mutable_stats() override;
  uint32_t prefill_chunk_size() const override;
  Status prefill_chunk(std::span<const uint32_t> tokens, std::span<float> logits) override;
  explicit Ds4GpuEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace expertd::engine
