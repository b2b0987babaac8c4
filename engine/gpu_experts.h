// Internal to the CUDA engines (GpuEngine, Ds4GpuEngine, Ds3GpuEngine): how routed experts reach
// the device, and the dense-weight upload helpers the DeepSeek engines share (DevMat, Carver).
// Owns the registration of the source's host memory (the daemon's arena, read-only and mapped),
// the VRAM tier's device slots with their copy/use events and bookkeeping (VramTier, replaced by
// the daemon's policy), and the holds on the source's experts that are still to be given back.
//
// In place (no tier): acquire() gets the experts from the source and hands out the mapped device
// addresses of their bytes in the registered arena; the kernels read them over PCIe. With a tier:
// a routed expert found in a slot is a VRAM hit (the compute stream waits on the slot's copy
// event); a miss is acquired from the source and, if the tier's policy admits it, copied
// host->VRAM on the copy stream, and the compute stream waits on that copy. A miss the policy
// refuses (worth less than every resident; or every slot pinned) is read in place from the
// registered arena for this use only, as the in-place mode does, and displaces nothing; without a
// registered arena the tier admits every miss. A slot is overwritten only after the copy stream
// waited on an event recorded behind its last reader (finish_layer()); the layer being computed
// pins its slots, so it never evicts its own experts: top-k slots are all a layer ever needs.
//
// Holds: demand holds are given back by release_demand_holds(), which the owner calls after a
// sync of the compute stream (every kernel that read them has completed, and every copy they
// waited for); prefetch holds when their slot's copy event has completed. Holds of experts
// copied into the tier go back as client copies (ExpertSource::release_kept, unless
// GpuOptions::coordinate is off), so the daemon evicts those first. The owner must synchronise
// both streams before this goes: the destructor gives back every hold still held.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/cpu_ops.h"
#include "engine/engine.h"
#include "engine/expert_source.h"
#include "engine/gpu_engine.h"
#include "engine/model.h"
#include "engine/vram_tier.h"
#include "kernels/check.h"
#include "kernels/cuda_raii.h"
#include "storage/ggml_types.h"

namespace expertd::engine::gpu {

inline constexpr uint64_t kAlign = 256;  // device sub-allocation alignment

inline uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// cudaStreamSynchronize(stream), its wait added to stats.sync_ns (the GPU-side share of a token).
cudaError_t timed_sync(cudaStream_t stream, EngineStats& stats);

std::string gib(uint64_t bytes);

// A dense weight in VRAM, in its GGUF encoding.
struct DevMat {
  GgmlType type = GgmlType::F32;
  const uint8_t* data = nullptr;
  uint32_t rows = 0;
  uint32_t cols = 0;
  uint64_t row_bytes = 0;
};

// Sub-allocates one device buffer: a first pass (counting) sums the aligned sizes, a second
// (after alloc) hands out the addresses and uploads.
class Carver {
 public:
  bool counting() const { return base_ == nullptr; }
  uint64_t total() const { return total_; }
  void start(uint8_t* base) {
    base_ = base;
    total_ = 0;
  }
  // `bytes` of device memory, filled from `src` when it is not null.
  uint8_t* take(uint64_t bytes, const void* src = nullptr) {
    uint8_t* out = base_ == nullptr ? nullptr : base_ + total_;
    total_ += align_up(std::max<uint64_t>(bytes, 1), kAlign);
    if (out != nullptr && src != nullptr && error_ == cudaSuccess) {
      error_ = cudaMemcpy(out, src, bytes, cudaMemcpyHostToDevice);
    }
    return out;
  }
  template <typename T>
  T* take_n(uint64_t n, const T* src = nullptr) {
    return reinterpret_cast<T*>(take(n * sizeof(T), src));
  }
  cudaError_t error() const { return error_; }

 private:
  uint8_t* base_ = nullptr;
  uint64_t total_ = 0;
  cudaError_t error_ = cudaSuccess;
};

// One device allocation sub-allocated by `carve` (Status(Carver&)), run twice: to count, then, in
// what `alloc` (Result<DeviceBytes>(uint64_t bytes)) made of the count, to hand out the addresses
// and upload.
template <typename Carve, typename Alloc>
Result<cuda::DeviceBytes> carve_device(Carve&& carve, Alloc&& alloc) {
  Carver c;
  EXPERTD_TRY(carve(c));
  EXPERTD_TRY_ASSIGN(cuda::DeviceBytes mem, alloc(c.total()));
  c.start(mem.get());
  EXPERTD_TRY(carve(c));
  EXPERTD_CUDA_TRY(c.error());
  return mem;
}

// `bytes` of device memory for the caches and activations of `positions` (zeroed); the error
// names the size, the positions and the device.
Result<cuda::DeviceBytes> alloc_work(uint64_t bytes, uint32_t positions,
                                     const std::string& device_name);

// Takes `m` from `c` as it is in the file (its bytes uploaded unless counting; a deferred model's
// read through `scratch`) and describes it in `dst`; errors name the tensor whose type the kernels
// do not read or whose size they do not take.
Status carve_matrix(Carver& c, const DenseModel& model, const Matrix& m, DevMat& dst,
                    std::vector<uint8_t>& scratch);

// The dense half of a SigmoidMoe layer (DeepSeek-V3's and GLM-4.5's) on the device, in its GGUF
// encoding: a dense layer's MLP, or a MoE layer's shared experts (absent: rows == 0).
struct DevSigmoidMoe {
  DevMat ffn_gate, ffn_up, ffn_down;
  DevMat shexp_gate, shexp_up, shexp_down;
};

// Takes layer `layer`'s half from `c` (carve_matrix's errors): the dense MLP when layer <
// d.dense_lead, else the shared experts when d.n_shared > 0.
Status carve_sigmoid_moe(Carver& c, const DenseModel& model, const SigmoidMoe& d, uint32_t layer,
                         const SigmoidMoeWeights& w, DevSigmoidMoe& dst,
                         std::vector<uint8_t>& scratch);

// The SwiGLU MLP of DeepSeek-V3's and GLM-4.5's dense layers and shared experts on x:
// y = down(silu(gate x) * up x); g and u hold gate.rows floats. Enqueued on `stream`.
Status run_mlp(const DevMat& gate, const DevMat& up, const DevMat& down, const float* x, float* g,
               float* u, float* y, cudaStream_t stream);

// Routing on the host, as the CPU engines route (so routing records, hints and counters are
// theirs): DeepSeek-V3's MoE block (ds3_route, ds3_hint_probs: Ds3GpuEngine, GpuEngine's
// glm4moe) or gpt-oss's (the softmax over the top-k logits; hints ranked by the softmax over all).
// The engine computes the routers it needs on the device (computes(), looks_ahead()), copies
// their logits back and synchronises; route() then does the rest on the host.
struct HostRouter {
  HostRouter(const ModelParams& p, const SigmoidMoe& d, const EngineOptions& opts);
  // Whether the engine computes layer `layer`'s router at `pos` (a MoE layer the script does
  // not route), and layer + j's for the lookahead (a MoE layer, router-ranked hints).
  bool computes(uint32_t pos, uint32_t layer) const;
  bool looks_ahead(uint32_t layer, uint32_t j) const;
  // From the logits copied back (row 0 the layer's, row j layer + j's where looks_ahead; with
  // any router bias added): the hints for the next prefetch_depth layers (ranked from the logits,
  // or the script's) sent through `hints_to` and kept in last_hints; then, unless `layer` is
  // dense, its experts and weights (the script's route, else the family's) into
  // selected/weights, logged to `log` and counted.
  void route(uint32_t pos, uint32_t layer, const float* logits, HintPlanner& planner,
             EngineStats& stats, ExpertSource& hints_to, std::vector<RoutingRecord>* log);
  // The routing decision alone, no hints (route() ends with it; prefill decides each row of a
  // chunk with it): the script's route, else the family's from row 0 of `logits`, into
  // selected/weights, logged to `log` and counted.
  void decide(uint32_t pos, uint32_t layer, const float* logits, HintPlanner& planner,
              EngineStats& stats, std::vector<RoutingRecord>* log);
  // A prefill chunk's routing at `layer` (the layer-by-layer prefills of Ds3GpuEngine and
  // GpuEngine's glm4moe / gpt-oss): rows [0, n) at positions pos0.. decided from their logits
  // (row i at logits + i * stride), each row's experts and weights into routes / route_weights
  // ([n][k]), then the layer's distinct experts (ascending, into `hints`) hinted exactly and at
  // once through `hints_to` and counted (prefill_experts, prefill_hints), then the next layers'
  // (decode's lookahead over the rows: row i's logits for layer + j at logits + i * stride + j *
  // ahead where looks_ahead; the planner's union, prefill_lookahead_hints). At most `budget`
  // hints in all (the daemon's slots, GpuExperts::hint_budget): the first min(hints, budget) of
  // `hints` are sent, the rest held back (prefill_hints_held) for run_experts_by_rows to send as
  // its acquires leave room (RowsHints). `seen` (n_expert flags) is scratch. Errors: a route
  // outside the experts.
  Status route_chunk(uint32_t pos0, uint32_t layer, uint32_t n, const float* logits,
                     uint64_t stride, uint64_t ahead, uint64_t budget, HintPlanner& planner,
                     EngineStats& stats, ExpertSource& hints_to, std::vector<RoutingRecord>* log,
                     std::span<uint32_t> routes, std::span<float> route_weights,
                     std::vector<uint8_t>& seen, std::vector<ExpertHint>& hints);

  const ModelParams& p;
  const SigmoidMoe& d;
  const EngineOptions& opts;
  bool gptoss = false;  // gpt-oss's routing (p.router == RouterKind::TopkSoftmax)
  std::vector<std::span<const float>> bias;  // per layer: exp_probs_b (the engine fills it)
  std::vector<uint32_t> selected;            // the layer's experts (k)
  std::vector<float> weights;                // and their weights
  std::vector<ExpertHint> last_hints;        // route()'s hints, for GpuExperts::prefetch
  // The planner's candidates for layers layer+1..layer+depth from one position's lookahead
  // logits (layer + j's at logits + j * ahead), or the script's; not sent (route() sends them;
  // a batched decode step adds every row's, then sends them as one message).
  void add_lookahead(uint32_t pos, uint32_t layer, const float* logits, uint64_t ahead,
                     HintPlanner& planner);
  std::vector<double> probs, sel;  // n_expert scratch
  std::vector<uint32_t> order;
};

// `bytes` of device memory for a model's dense weights (`what` says how they are stored), after
// checking that they fit with 256 MiB to spare; errors name the model, both sizes and the device.
Result<cuda::DeviceBytes> alloc_dense(uint64_t bytes, std::string_view what,
                                      const std::string& model_path,
                                      const std::string& device_name);

// The engine's source as its hints should see it: prefetch() passes on only hints for experts the
// VRAM tier lacks (a hint for a VRAM-resident expert would have the daemon read back from disk
// the host copy it was allowed to drop); everything else goes straight to the source.
class TierHintFilter final : public ForwardingSource {
 public:
  explicit TierHintFilter(ExpertSource& inner) : ForwardingSource(inner) {}
  void set_tier(const VramTier* tier, size_t max_hints) {
    tier_ = tier;
    kept_.reserve(max_hints);
  }
  Status prefetch(std::span<const ExpertHint> hints) override;

 private:
  const VramTier* tier_ = nullptr;
  std::vector<ExpertHint> kept_;
};

// Where one expert's projections sit in a device slot (or, in place, in the mapped arena).
struct ExpertPtrs {
  const void* gate = nullptr;
  const void* up = nullptr;
  const void* down = nullptr;
};

class GpuExperts {
 public:
  // The expert projections' types and row sizes of one layer (from the GGUF's slice map).
  struct Proj {
    GgmlType type = GgmlType::F32;
    uint64_t row_bytes = 0;
  };
  struct LayerShape {
    Proj gate, up, down;
    bool present = false;
  };

  // `source` and `stats` must outlive this; `compute` and `copy` are the owner's streams.
  GpuExperts(const DenseModel& model, ExpertSource& source, const GpuOptions& gpu,
             EngineStats& stats, cudaStream_t compute, cudaStream_t copy);
  ~GpuExperts();
  GpuExperts(const GpuExperts&) = delete;
  GpuExperts& operator=(const GpuExperts&) = delete;

  // Registers the source's host memory, reads the experts' shapes and sizes the VRAM tier
  // (errors name the cause: an unregistrable arena in place, a tier too small or too large), then
  // preloads it when GpuOptions::preload says so.
  Status init(const std::string& device_name);
  // Fills the VRAM tier's free slots (GpuOptions::preload): the experts of whole MoE layers, the
  // last layer first (as llama.cpp's -ncmoe keeps its last layers' experts on the GPU), acquired
  // from the source top-k at a time (within the session's reservation), copied in, and released
  // as client copies (the VRAM copy is the one kept). No-op without a tier. Counted in
  // stats.vram_preloaded, vram_preload_bytes and vram_preload_ns, not in the copy counters;
  // GpuOptions::preload_progress is called after each layer. An expert the source refuses (a
  // daemon out of slots, a read error) stops the preload there, not the engine: description()
  // says where and why. A failed copy is an error.
  Status preload();
  // A prefill chunk's sweep of the layers (VramTier::begin_sweep): while it runs, acquire(layer)
  // advances it, and the tier's residents of the layer computed and later ones are not victims.
  // Only for a chunk whose rows between them route to about every expert of a layer (rows x
  // top-k >= experts): one of few rows wants few of a later layer's residents, and the policy
  // weighs those as in decode. Use TierSweep.
  void begin_sweep(uint32_t rows) {
    if (tier_ && uint64_t{rows} * p_.n_expert_used >= p_.n_expert) tier_->begin_sweep();
  }
  void end_sweep() {
    if (tier_) tier_->end_sweep();
  }

  // The device addresses of `experts` of `layer` (out[i] for experts[i]); the compute stream is
  // made to wait for any copy they need. Time in the source's get() is added to stats.stall_ns
  // and to *waited_ns. The tier slots used stay pinned until finish_layer().
  Status acquire(uint32_t layer, std::span<const uint32_t> experts, std::span<ExpertPtrs> out,
                 uint64_t* waited_ns);
  // After the kernels reading the acquired experts were enqueued on the compute stream: records
  // the slots' use events and unpins them.
  Status finish_layer();
  // The experts hinted for layers layer+1..layer+depth that the source holds ready in host
  // memory: acquired and copied into the tier ahead of their layer (no-op in place).
  Status prefetch(uint32_t layer, uint32_t depth, uint32_t n_layer,
                  std::span<const ExpertHint> hints);
  // Gives back the demand holds: only after a compute-stream sync behind their readers.
  Status release_demand_holds();
  // Demand holds not given back yet (prefill syncs once a row's misses bring them to top-k).
  size_t demand_holds() const { return demand_holds_.size(); }
  // Gives back the prefetch holds whose copies completed (all of them when `all`).
  Status release_finished_prefetch_holds(bool all);
  // Adds the last demand copies' time to stats.copy_ns once their end event has completed.
  Status account_copy_time();
  // After a sync of the compute stream (everything launched before has finished, the previous
  // layer's experts among it): the demand holds and finished prefetch holds go back, and the copy
  // time is accounted.
  Status synced();
  // The compute stream synchronised (the wait counted in sync_ns), then synced().
  Status sync_compute();
  // The end of every CUDA engine's head: out.size() logits copied from `device` through the
  // pinned `host` buffer on the compute stream, the stream synchronised (counted in sync_ns), the
  // demand and finished prefetch holds given back, then the logits into `out`.
  Status logits_to_host(const float* device, float* host, std::span<float> out);
  // Samples both tiers into stats.tiers_*: distinct experts in VRAM or the source's host memory,
  // and the sum of their capacities (nothing in place, or when the source does not say).
  void measure_tiers();

  // Where the engine sends its hints (every source.prefetch of the engine goes here): the source
  // less the experts already in VRAM.
  ExpertSource& hint_source() { return hints_; }
  // Hints a prefill may have outstanding at once: kHintFill of the source's host slots (the
  // daemon's cache and staging, its slot table), at least top-k; UINT64_MAX when the source does
  // not say. A hint beyond what the cache keeps until its acquire is read, evicted unused and read
  // again (DeepSeek-V4's prefill read 1.8x its experts' bytes for that).
  static constexpr double kHintFill = 0.85;
  uint64_t hint_budget() const;
  // A prefill layer's exact hints kept within `budget` outstanding: hints[sent, acquired + budget)
  // sent now through hint_source() (the first call with acquired 0, then one after each group's
  // acquires), `sent` and stats.prefill_hints advanced.
  void hint_within(std::span<const ExpertHint> hints, size_t acquired, uint64_t budget,
                   size_t& sent, EngineStats& stats);

  const LayerShape& shape(uint32_t layer) const { return shapes_[layer]; }
  bool has_tier() const { return tier_ != nullptr; }
  uint32_t slots() const { return tier_ ? tier_->capacity() : 0; }
  uint64_t slot_bytes() const { return slot_bytes_; }
  // Where the experts are computed from, for the engines' description(): the VRAM tier (its size,
  // policy, and whether it is coordinated with the daemon), or in place in the arena.
  std::string description() const;
  bool arena_registered() const { return arena_.valid(); }

 private:
  Status setup_tier(const std::string& device_name);
  // Which counters a copy's bytes go to: copy_bytes (and demand_copy_bytes for a demand copy),
  // or vram_preload_bytes.
  enum class Copy { Demand, Prefetch, Preload };
  Status copy_expert(const ExpertView& v, uint32_t slot, Copy kind);
  void count_copy(uint64_t bytes, Copy kind);
  Status give_back(std::span<const ExpertView> views, bool kept);
  // Coordinated tiers: tells the source the tier no longer keeps `evicted` (no-op when empty).
  Status unkeep(const VramTier::Entry& evicted);
  Result<ExpertPtrs> in_place(const ExpertView& v) const;

  const DenseModel& model_;
  ExpertSource& source_;
  const ModelParams& p_;
  GpuOptions gpu_;
  EngineStats& stats_;
  cudaStream_t compute_;
  cudaStream_t copy_;

  // Destroyed last to first after the destructor's body gave the holds back: the events, the
  // registration (no copy or in-place kernel reads through it any more: the owner synchronised),
  // then the tier's device memory.
  cuda::DeviceBytes tier_mem_;
  cuda::HostRegistration arena_;  // the source's host memory; empty when it was not registered
  cuda::CudaEvent copy_end_;      // the copy timing of one step, on `copy`
  cuda::CudaEvent copy_start_;
  std::vector<cuda::CudaEvent> use_event_;    // per slot: its last reader completed
  std::vector<cuda::CudaEvent> ready_event_;  // per slot: its copy completed
  bool copy_timing_ = false;

  // Host memory of the source, registered: device address = dev_base_ + (host - host_base_).
  const uint8_t* host_base_ = nullptr;
  uint64_t host_bytes_ = 0;
  uint8_t* dev_base_ = nullptr;

  std::unique_ptr<VramTier> tier_;
  std::string preload_note_;  // why preload() stopped short, when it did
  TierHintFilter hints_;
  uint64_t slot_bytes_ = 0;
  std::vector<ExpertPtrs> slot_ptrs_;  // per slot: where the projections landed
  std::vector<LayerShape> shapes_;
  std::vector<ExpertView> demand_holds_;
  std::vector<uint8_t> demand_kept_;  // per demand hold: 1 when its expert was copied in
  struct PrefetchHold {
    ExpertView view;
    uint32_t slot;
  };
  std::vector<PrefetchHold> prefetch_holds_;

  // Per-layer scratch.
  std::vector<ExpertView> views_;
  std::vector<uint32_t> used_slots_;
  std::vector<uint32_t> missing_;
  std::vector<uint32_t> missing_index_;
  std::vector<uint8_t> ready_flags_;
  std::vector<uint32_t> candidates_;
  std::vector<uint8_t> host_resident_;  // measure_tiers(): [layer][expert]
};

// The sweep of one prefill chunk over the layers, ended however the chunk ends.
class TierSweep {
 public:
  TierSweep(GpuExperts& experts, size_t rows) : experts_(experts) {
    experts_.begin_sweep(static_cast<uint32_t>(rows));
  }
  ~TierSweep() { experts_.end_sweep(); }
  TierSweep(const TierSweep&) = delete;
  TierSweep& operator=(const TierSweep&) = delete;

 private:
  GpuExperts& experts_;
};

// The routed experts of one layer on `x` (n_embd): gate and up of each (batched when they share a
// type), SwiGLU (clamped at `clamp` as DeepSeek-V4's; 0: none), down; expert i's output at
// out + i * n_embd. gu: [2k][n_ff] (gate outputs, then up), h: [k][n_ff]. Enqueued on `stream`.
// With `oai` (gpt-oss): gate and up get their experts' biases and gpt-oss's clamped SwiGLU
// (kernels::oai_swiglu), and down its bias, instead.
struct OaiExperts {
  const float* gate_b = nullptr;       // [n_expert][n_ff], device
  const float* up_b = nullptr;         // [n_expert][n_ff]
  const float* down_b = nullptr;       // [n_expert][n_embd]
  std::span<const uint32_t> selected;  // the expert of each of `experts` (host)
};
Status run_experts(const GpuExperts::LayerShape& shape, std::span<const ExpertPtrs> experts,
                   uint32_t n_ff, uint32_t n_embd, const float* x, float clamp, float* gu, float* h,
                   float* out, cudaStream_t stream, const OaiExperts* oai = nullptr);

// A SigmoidMoe layer's experts on x (Ds3GpuEngine, GpuEngine's glm4moe): the routed `selected`
// acquired from `experts` (into ptrs), run (run_experts) and weighted by the device `weights`,
// plus the shared experts of `m` where it has them (run_mlp), summed into y (ds4_moe_sum, as the
// CPU engines sum them). Scratch: gu [2k][n_ff_exp], h [k][n_ff_exp], eo [k][n_embd]; g, u the
// shared experts' width; shared n_embd.
struct SigmoidMoeScratch {
  float* gu = nullptr;
  float* h = nullptr;
  float* eo = nullptr;
  float* g = nullptr;
  float* u = nullptr;
  float* shared = nullptr;
};
Status run_sigmoid_moe(GpuExperts& experts, uint32_t layer, std::span<const uint32_t> selected,
                       std::span<ExpertPtrs> ptrs, const DevSigmoidMoe& m, const ModelParams& p,
                       const float* x, const float* weights, const SigmoidMoeScratch& s, float* y,
                       EngineStats& stats, cudaStream_t stream);

// A chunk's rows through their routed experts, grouped by expert (every CUDA prefill: GpuEngine's
// chunk and layer-by-layer ones, Ds3GpuEngine's, Ds4GpuEngine's): eo[r][j] (row-major
// [n][k][n_embd]) = SwiGLU expert routes[r * k + j] applied to row r of xn (rows `stride` floats
// apart). Each distinct expert is acquired once, in ascending order, top-k at a time, and applied
// to all its rows as cuBLAS GEMMs on a copy dequantised into `w`; the compute stream is
// synchronised after each group and the holds given back, so a cache sized for decode is enough.
// Counts the experts in experts_used. The scratch is sized for the chunk: device_floats() floats
// on the device (xe .. w) and host_words() pinned words (h_index), d_index the device copy of
// h_index, groups reserved for the chunk's rows * k slots; xeh and hgh (bf16_values() together)
// only for RowsOptions::bf16.
struct RowsScratch {
  float* xe = nullptr;           // [rows][n_embd] one expert's rows
  float* hg = nullptr;           // [rows][n_ff_exp] gate, then the SwiGLU
  float* hu = nullptr;           // [rows][n_ff_exp] up
  float* down = nullptr;         // [rows][n_embd] one expert's outputs
  float* w = nullptr;            // [n_ff_exp * n_embd] one projection, dequantised (f32 or bf16)
  __nv_bfloat16* xeh = nullptr;  // RowsOptions::bf16: [rows][n_embd] xe as bf16
  __nv_bfloat16* hgh = nullptr;  // RowsOptions::bf16: [rows][n_ff_exp] the SwiGLU as bf16
  uint32_t* d_index = nullptr;   // [rows * k] gathered rows by expert, then [rows * k] output slots
  uint32_t* h_index = nullptr;   // pinned mirror of d_index
  ExpertGroups groups;           // the layer's route slots by expert (built from the routes)
  static uint64_t device_floats(const ModelParams& p, uint64_t rows) {
    return rows * p.n_embd * 2 + rows * p.n_ff_exp * 2 + uint64_t{p.n_ff_exp} * p.n_embd;
  }
  static uint64_t host_words(const ModelParams& p, uint64_t rows) {
    return rows * p.n_expert_used * 2;
  }
  // The bf16 values of xeh plus hgh.
  static uint64_t bf16_values(const ModelParams& p, uint64_t rows) {
    return rows * (uint64_t{p.n_embd} + p.n_ff_exp);
  }
};
// The layer's exact hints, one per distinct expert in ascending order (as run_experts_by_rows
// acquires them), of which the caller has sent `sent`: run_experts_by_rows sends the rest as its
// groups' acquires leave room, keeping at most `budget` sent and not yet acquired
// (GpuExperts::hint_within), so a hinted expert is not evicted before its acquire.
struct RowsHints {
  std::span<const ExpertHint> exact;
  size_t sent = 0;
  uint64_t budget = UINT64_MAX;
};
struct RowsOptions {
  // gpt-oss: each expert's biases added and its clamped SwiGLU applied to all its rows at once, as
  // run_experts does to one row (`selected` unused).
  const OaiExperts* oai = nullptr;
  // DeepSeek-V4: its SwiGLU (kernels::ds4_swiglu) with the layer's clamp, as run_experts does.
  std::optional<float> ds4_clamp;
  // The three projections with bf16 operands, f32 results and accumulation (tensor cores;
  // GpuOptions::PrefillGemm::Bf16): the rows and the SwiGLU rounded to bf16, each projection
  // dequantised into w as bf16. Counted in prefill_bf16_gemms.
  bool bf16 = false;
  RowsHints* hints = nullptr;
  // Called with each group of experts before its acquire, and after it with the nanoseconds the
  // acquire waited (DeepSeek-V4's hash and learned layers' counts).
  std::function<void(std::span<const uint32_t> group)> before_acquire;
  std::function<void(std::span<const uint32_t> group, uint64_t waited)> acquired;
};
Status run_experts_by_rows(GpuExperts& experts, cublasHandle_t blas, uint32_t layer, uint32_t n,
                           std::span<const uint32_t> routes, const float* xn, uint64_t stride,
                           std::span<ExpertPtrs> ptrs, const ModelParams& p, RowsScratch& s,
                           float* eo, EngineStats& stats, cudaStream_t stream,
                           const RowsOptions& options = {});
// run_sigmoid_moe over a chunk's rows: the routed experts by run_experts_by_rows (into eo), then
// per row its shared experts (s.g, s.u, s.shared) and the sum weighted by weights[r] (device,
// [n][k]) into y, added to row r of x (x and xn rows `stride` floats apart), in decode's order.
// `hints`: the layer's exact hints for run_experts_by_rows to top up.
Status run_sigmoid_moe_rows(GpuExperts& experts, cublasHandle_t blas, uint32_t layer, uint32_t n,
                            std::span<const uint32_t> routes, const float* weights,
                            const DevSigmoidMoe& m, const ModelParams& p, const float* xn, float* x,
                            uint64_t stride, std::span<ExpertPtrs> ptrs, RowsScratch& rows,
                            float* eo, const SigmoidMoeScratch& s, float* y, EngineStats& stats,
                            cudaStream_t stream, RowsHints* hints = nullptr);

// out[rows][out_cols] (= beta out +) in[rows][in_cols] w^T, w row-major [out_cols][in_cols]: the
// f32 cuBLAS GEMM every CUDA engine's prefill runs (the handle's math mode decides TF32: pedantic).
Status sgemm_rows(cublasHandle_t blas, const float* w, uint32_t out_cols, uint32_t in_cols,
                  const float* in, uint32_t rows, float* out, float beta = 0.0f);
// The same with rows `w_stride`, `in_stride` and `out_stride` floats apart.
Status sgemm_rows(cublasHandle_t blas, const float* w, uint64_t w_stride, uint32_t out_cols,
                  uint32_t in_cols, const float* in, uint64_t in_stride, uint32_t rows, float* out,
                  uint64_t out_stride, float beta);
// sgemm_rows' layout (beta 0) with bf16 w and in, f32 out and accumulation: tensor cores.
Status gemm_bf16_rows(cublasHandle_t blas, const __nv_bfloat16* w, uint32_t out_cols,
                      uint32_t in_cols, const __nv_bfloat16* in, uint32_t rows, float* out);

// out[r][0, m.rows) = m in[r][0, m.cols) (+ beta out[r]) for rows r of a chunk (rows `in_stride`
// and `out_stride` floats apart), for a dense matrix of any file type: f32 multiplied as it is,
// any other type dequantised a tile of whole rows at a time into `tile` (at most `tile_floats`
// floats) and multiplied tile by tile, so the scratch bounds the memory, not the matrix. The f32
// cuBLAS GEMM of sgemm_rows on `blas`'s stream, which must be `stream`. A prefill's dense
// projections: the weights read once per chunk rather than once per row.
Status dense_rows(cublasHandle_t blas, const DevMat& m, const float* in, uint64_t in_stride,
                  uint32_t rows, float* out, uint64_t out_stride, float* tile, uint64_t tile_floats,
                  cudaStream_t stream, float beta = 0.0f);
// The tile dense_rows needs for `m` (0 for f32, which needs none), at most `cap` floats.
uint64_t dense_rows_tile(const DevMat& m, uint64_t cap);
// The layer-by-layer prefills (Ds3GpuEngine's MLA, GpuEngine's for GLM-4.5 and gpt-oss) run a
// chunk's attention projections as dense_rows GEMMs from this many rows; fewer run decode()'s
// attention row by row. Dequantising a matrix for a GEMM costs about what eight rows' matvecs read.
inline constexpr uint32_t kDenseGemmRows = 8;

// The routed experts of one layer of a batched decode step (every CUDA engine's decode_batch):
// the rows' routes ([rows][k], row by row) grouped by expert, the distinct experts acquired once
// each, ascending, top-k at a time (what a cache sized for decode holds), and each group's uses
// handed to the engine, which applies them with decode()'s kernels. A group's holds go back
// (GpuExperts::sync_compute) before the next group's acquire. Counts the distinct experts in
// experts_used (as a prefill chunk and the CPU engines' steps count them) and batch_experts.
struct StepUse {
  uint32_t expert;  // index into the group's ExpertPtrs
  uint32_t row;
  uint32_t slot;  // the row's route slot (0..k)
};
class StepExperts {
 public:
  void reserve(uint32_t n_expert, uint64_t slots);
  // `before_acquire(group)` and `acquired(group, waited ns)`, when set, surround each acquire
  // (DeepSeek-V4's hash / learned counters); `run(uses)` gets a group's uses, row by row, with
  // their experts at ptrs[use.expert] (the ids at group[use.expert]). `ptrs` holds at least k.
  Status run(
      GpuExperts& experts, uint32_t layer, std::span<const uint32_t> routes, uint32_t k,
      std::span<ExpertPtrs> ptrs, EngineStats& stats,
      const std::function<Status(std::span<const uint32_t> group, std::span<const StepUse> uses)>&
          apply,
      const std::function<void(std::span<const uint32_t> group)>& before_acquire = {},
      const std::function<void(std::span<const uint32_t> group, uint64_t waited)>& acquired = {});

 private:
  ExpertGroups groups_;  // the step's route slots by expert
  std::vector<StepUse> uses_;
};

}  // namespace expertd::engine::gpu
