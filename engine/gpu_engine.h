// The CUDA engine: the qwen3moe, Mixtral (`llama`), GLM-4.5 (`glm4moe`) and gpt-oss forward of
// CpuEngine on the GPU, with dense weights in VRAM (dequantised to f32 at load; cuBLAS does their
// GEMVs), the decode kernels of kernels/, and the routed experts streamed from an ExpertSource (the
// daemon's pinned arena) through a VRAM tier.
//
// glm4moe: the q/k/v biases are added after the fused q/k/v GEMV; the q/k norms and the NEOX RoPE
// (on the first n_rot dimensions of each head) are the qwen3moe kernels. Its FFN half is
// Ds3GpuEngine's (DeepSeek-V3's MoE block, engine/gpu_experts.h): dense MLPs and the shared expert
// in their GGUF encoding (run_mlp), routed experts with run_experts' kernels, and the routing on
// the host with the CPU engine's ds3_route / ds3_hint_probs after one copy of the router logits
// per layer. Its prefill() runs layer by layer over each chunk, the experts grouped by expert.
//
// gpt-oss: the q/k/v biases as glm4moe's, the output bias after the Wo GEMV, YaRN's frequencies
// (kernels::rope_neox_freqs), the sliding window and sinks in the decode attention kernel, the
// router bias, the routing on the host (gpu::HostRouter: the softmax over the top-k logits), the
// experts' biases and clamped SwiGLU as run_experts applies them (gpu::OaiExperts). Prefill as
// glm4moe's.
//
// Experts: the source's host memory (the daemon's arena mapping) is cudaHostRegister'ed once,
// read-only and mapped. With a VRAM tier (GpuOptions::tier != InPlace) the engine keeps its own
// device slots, replaced by the daemon's policy (VramTier): a routed expert found there is a VRAM
// hit; a miss is acquired from the daemon and, when the policy admits it, copied host->VRAM on a
// copy stream (the compute stream waits on the copy's event, and the daemon's hold is released,
// as a client copy, once the copy has completed); when the policy refuses it the kernels read it
// in place from the registered arena for this use. A slot is overwritten
// only after an event recorded behind its last reader. In the in-place mode the matvec kernels
// read the pinned arena slot directly over PCIe and the hold is released when they finished.
//
// Router-driven prefetch: as in CpuEngine, after a layer's attention the next `depth` routers are
// applied to the residual stream (on the GPU, in the same kernels as the routing itself) and the
// top candidates are sent to the source as hints. Then, once the layer's experts are launched,
// hinted experts the daemon already holds READY (its slot table) are acquired and copied into the
// VRAM tier ahead of their layer.
//
// Every CUDA and cuBLAS call is checked (kernels/check.h): errors name the call, file and line.
// Not thread-safe.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "engine/engine.h"

namespace expertd::engine {

struct GpuOptions {
  enum class Tier { Auto, InPlace, Experts, Bytes };
  Tier tier = Tier::Auto;  // Auto: half the free device memory, at most every expert
  uint64_t value = 0;      // experts (Tier::Experts) or bytes (Tier::Bytes)
  int device = 0;
  // Tiers that act as one: an expert copied into the VRAM tier is released to the daemon as a
  // client copy (abi::kReleaseClientCopy), so its host slot is the daemon's first victim and the
  // host cache holds other experts (and kOpUnkeep when the tier evicts it). Off by default: on the
  // H200 a 32-expert tier against the Mixtral shape's 64 experts a token churned, the marked host
  // copies went first and were soon wanted again, and decode read 4-8x the bytes of independent
  // tiers (docs/ENGINE.md "Tiers that act as one").
  bool coordinate = false;
  // The VRAM tier's replacement policy (policy/policy.h names); empty: VramTier::kDefaultPolicy.
  std::string policy;
  // How the chunked prefill multiplies an expert by its rows (qwen3moe, Mixtral). F32: the
  // expert dequantised to an f32 copy and f32 SGEMMs, the numbers decode() computes. Bf16: the
  // expert dequantised to bf16 (half the copy's bytes), the rows rounded to bf16, and bf16
  // tensor-core GEMMs accumulating in f32; within the tolerance GpuPrefillGemm's test gives
  // (docs/ENGINE.md "Prefill GEMMs").
  enum class PrefillGemm { F32, Bf16 };
  PrefillGemm prefill_gemm = PrefillGemm::F32;
  // Fill the VRAM tier when the engine is created, as llama.cpp loads the experts of its GPU
  // layers (-ngl, -ncmoe) at model load: whole layers' experts from the last MoE layer back, read
  // through the source, until the tier is full (GpuExperts::preload; docs/ENGINE.md "Preloading
  // the VRAM tier"). Off here, so an engine made in a test starts with an empty tier; expert-run
  // and expert-serve turn it on unless told --no-vram-preload.
  bool preload = false;
  // Called after each layer preloaded: experts so far, of how many, and their bytes so far.
  std::function<void(uint32_t experts, uint32_t of, uint64_t bytes)> preload_progress;
};

// --prefill-gemm: "f32" or "bf16". Errors name the flag and the value.
Result<GpuOptions::PrefillGemm> parse_prefill_gemm(const std::string& text);

// --vram-experts: "auto" (half the free device memory), a number of experts ("0" = the in-place
// mode) or a size with a unit (8G, 512M, 4GiB). Errors name the flag and the value.
Result<GpuOptions> parse_vram_experts(const std::string& text);

// Whether a CUDA device can be used. False on a build without CUDA, or with no device; *why then
// says why ("no CUDA device: cudaErrorNoDevice (no CUDA-capable device is detected)").
bool cuda_device_available(std::string* why);

class GpuEngine final : public Engine {
 public:
  // `model` and `source` must outlive the engine. Uploads the dense weights (errors name the
  // tensor and the bytes wanted when VRAM is short) and registers the source's host memory.
  static Result<std::unique_ptr<GpuEngine>> create(const DenseModel& model, ExpertSource& source,
                                                   const EngineOptions& options,
                                                   const GpuOptions& gpu);
  ~GpuEngine() override;

  Status decode(uint32_t token, std::span<float> logits) override;
  void reset() override;
  // Any n <= position(): the KV cache is per position.
  bool truncate(uint32_t n) override;
  uint32_t position() const override;
  // Sequences (EngineOptions::sequences, at most kMaxSequences): a KV cache of max_context
  // positions each. decode_batch() runs every row layer by layer: each row's attention and
  // routing as decode() computes them (glm4moe's and gpt-oss's on the host, glm4moe's leading
  // dense layers' MLP per row), every row's lookahead hints of the layer in one message, then each
  // distinct (layer, expert) of the step acquired once, top-k at a time, and applied to every row
  // routing to it with decode()'s kernels (gpt-oss's expert biases and clamped SwiGLU; glm4moe's
  // shared expert per row), so a row's logits are those of the sequence decoded alone, to the bit.
  // An engine of one sequence decodes the rows in turn (Engine's default).
  static constexpr uint32_t kMaxSequences = 64;
  uint32_t sequences() const override;
  Status select_sequence(uint32_t sequence) override;
  uint32_t selected_sequence() const override;
  Status decode_batch(std::span<const BatchRow> rows, std::span<float> logits) override;
  const EngineStats& stats() const override;
  const ModelParams& params() const override;
  const EngineOptions& options() const override;
  void set_routing_log(std::vector<RoutingRecord>* log) override;
  std::string name() const override { return "gpu"; }
  std::string description() const override;

  // Device slots of the VRAM tier (0 in the in-place mode) and the bytes of one.
  uint32_t vram_slots() const;
  uint64_t vram_slot_bytes() const;

  struct Impl;

 private:
  EngineStats& mutable_stats() override;
  // prefill(): chunks of options().prefill_chunk positions (fewer when its scratch did not fit: see
  // description()): per layer, attention as GEMMs over the chunk, the chunk's routes fetched
  // once, every needed expert hinted, then acquired top-k at a time and applied to all its rows
  // as GEMMs on a dequantised f32 copy. Only the last position's logits are computed.
  uint32_t prefill_chunk_size() const override;
  Status prefill_chunk(std::span<const uint32_t> tokens, std::span<float> logits) override;
  explicit GpuEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The CUDA engine for `model`'s architecture: GpuEngine for qwen3moe, llama and glm4moe,
// Ds4GpuEngine for deepseek4 (engine/ds4_gpu_engine.h), Ds3GpuEngine for deepseek2
// (engine/ds3_gpu_engine.h); GpuEngine's error for any other.
Result<std::unique_ptr<Engine>> create_gpu_engine(const DenseModel& model, ExpertSource& source,
                                                  const EngineOptions& options,
                                                  const GpuOptions& gpu);

}  // namespace expertd::engine
