#include "engine/gpu_engine.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "engine/dequant.h"
#include "engine/ds4_gpu_engine.h"
#include "engine/vram_tier.h"
#include "kernels/attention.cuh"
#include "kernels/check.h"
#include "kernels/combine.cuh"
#include "kernels/cuda_raii.h"
#include "kernels/matvec.cuh"
#include "kernels/norm.cuh"
#include "kernels/rope.cuh"
#include "kernels/routing.cuh"
#include "kernels/swiglu.cuh"
#include "storage/ggml_types.h"
#include "storage/slice_map.h"

namespace expertd::engine {
namespace {

constexpr uint64_t kAlign = 256;  // device sub-allocation alignment

uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

std::string gib(uint64_t bytes) {
  return fmt::format("{:.2f} GiB", static_cast<double>(bytes) / (uint64_t{1} << 30));
}

using cuda::CublasHandle;
using cuda::CudaEvent;
using cuda::CudaStream;
using cuda::DeviceBytes;
using cuda::HostRegistration;
using cuda::PinnedBytes;

// Where one expert's projections sit in a device slot (or, in place, in the mapped arena).
struct ExpertPtrs {
  const void* gate = nullptr;
  const void* up = nullptr;
  const void* down = nullptr;
};

struct DevLayer {
  float* wqkv = nullptr;  // [q_dim + 2 kv_dim rows][n_embd]
  float* wo = nullptr;    // [n_embd][q_dim]
  float* attn_norm = nullptr;
  float* q_norm = nullptr;
  float* k_norm = nullptr;
  float* ffn_norm = nullptr;
  float* router = nullptr;  // [n_expert][n_embd]
};

}  // namespace

bool cuda_device_available(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    if (why != nullptr) {
      *why = e != cudaSuccess ? fmt::format("no CUDA device: {} ({})", cudaGetErrorName(e),
                                            cudaGetErrorString(e))
                              : std::string("no CUDA device: the driver reports none");
    }
    return false;
  }
  return true;
}

struct GpuEngine::Impl {
  const DenseModel& model;
  ExpertSource& source;
  const ModelParams& p;
  EngineOptions opts;
  GpuOptions gpu;
  HintPlanner planner;
  EngineStats stats;
  std::vector<RoutingRecord>* routing_log = nullptr;
  uint32_t pos = 0;
  std::string device_name;
  uint64_t dense_device_bytes = 0;

  // The CUDA resources. Members are destroyed last to first, after ~Impl's body has synchronised
  // both streams and given the daemon's holds back, so this order is the teardown order, bottom
  // up: the events; then the arena's registration (no copy or in-place kernel reads through it
  // any more); then the cuBLAS handle and the streams (nothing is enqueued on them); then the
  // pinned mirrors and the device memory the streams' work used.
  DeviceBytes dense_mem;  // the dense weights, as f32
  DeviceBytes work_mem;   // activations, the KV cache and the routing buffers
  DeviceBytes tier_mem;   // the VRAM tier's slots
  PinnedBytes host_mem;   // pinned mirrors of the routing results and logits
  CudaStream copy;
  CudaStream compute;
  CublasHandle blas;       // on `compute`
  HostRegistration arena;  // the source's host memory; empty when it could not be registered
  CudaEvent copy_end;      // the copy timing of one step, on `copy`
  CudaEvent copy_start;
  std::vector<CudaEvent> use_event;    // per VRAM tier slot: its last reader completed
  std::vector<CudaEvent> ready_event;  // per VRAM tier slot: its copy completed
  bool copy_timing = false;

  std::vector<DevLayer> layers;
  float* embd = nullptr;    // [n_vocab][n_embd]
  float* output = nullptr;  // [n_vocab][n_embd] (== embd when tied)
  float* output_norm = nullptr;
  float* k_cache = nullptr;  // [layer][pos][kv_dim]
  float* v_cache = nullptr;
  float* x = nullptr;    // residual stream
  float* xn = nullptr;   // normalised MoE input
  float* pxn = nullptr;  // [depth][n_embd] normalised inputs of the lookahead routers
  float* qkv = nullptr;
  float* att = nullptr;
  float* rlogits = nullptr;       // [1 + depth][n_expert]
  uint32_t* d_experts = nullptr;  // [1 + depth][k]
  float* d_weights = nullptr;     // [1 + depth][k]
  float* d_probs = nullptr;       // [1 + depth][n_expert]
  float* gu = nullptr;            // [2k][n_ff]: gate outputs then up outputs
  float* h = nullptr;             // [k][n_ff]
  float* eo = nullptr;            // [k][n_embd]
  float* d_logits = nullptr;      // [n_vocab]
  uint32_t* h_experts = nullptr;  // pinned mirrors
  float* h_weights = nullptr;
  float* h_probs = nullptr;
  float* h_logits = nullptr;

  // Host memory of the source, registered (arena): device address = dev_base + (host - host_base).
  const uint8_t* host_base = nullptr;
  uint64_t host_bytes = 0;
  uint8_t* dev_base = nullptr;

  // VRAM tier.
  std::unique_ptr<VramTier> tier;
  uint64_t slot_bytes = 0;
  std::vector<ExpertPtrs> slot_ptrs;  // per slot: where the projections landed
  // Holds to give back: demand holds (after the next compute sync) and prefetch holds (after
  // their slot's copy event).
  std::vector<ExpertView> demand_holds;
  struct PrefetchHold {
    ExpertView view;
    uint32_t slot;
  };
  std::vector<PrefetchHold> prefetch_holds;

  // The expert projections' types and row sizes, per layer (from the GGUF's slice map).
  struct Proj {
    GgmlType type = GgmlType::F32;
    uint64_t row_bytes = 0;
  };
  struct LayerShape {
    Proj gate, up, down;
    bool present = false;
  };
  std::vector<LayerShape> shapes;

  // Per-layer scratch on the host.
  std::vector<uint32_t> selected;
  std::vector<float> weights;
  std::vector<ExpertView> views;
  std::vector<ExpertPtrs> ptrs;
  std::vector<uint32_t> used_slots;
  std::vector<uint32_t> missing;
  std::vector<uint32_t> missing_index;
  std::vector<uint8_t> ready_flags;
  std::vector<uint32_t> candidates;
  std::vector<ExpertHint> last_hints;  // this layer's hints, for the VRAM prefetch

  Impl(const DenseModel& m, ExpertSource& s, const EngineOptions& o, const GpuOptions& g)
      : model(m), source(s), p(m.params()), opts(o), gpu(g), planner(m.params(), o) {}
  ~Impl();

  Status init();
  Status upload_dense();
  Status setup_tier();
  Status attention(uint32_t layer);
  Status route_and_hint(uint32_t layer);
  Status moe(uint32_t layer);
  Status prefetch_into_vram(uint32_t layer);
  Status copy_expert(const ExpertView& v, uint32_t slot, bool demand);
  Status release_demand_holds();
  Status release_finished_prefetch_holds(bool all);
  Status gemv(const float* w, uint32_t rows, uint32_t cols, const float* in, float* out,
              float beta);
  Result<ExpertPtrs> in_place(const ExpertView& v) const;
  uint64_t kv_index(uint32_t layer, uint32_t p_) const {
    return (uint64_t{layer} * opts.max_context + p_) * p.n_head_kv * p.head_dim;
  }
  uint32_t lookahead(uint32_t layer) const {
    if (opts.hints != HintSource::Router || opts.prefetch_depth == 0) return 0;
    return std::min(opts.prefetch_depth, p.n_layer - 1 - layer);
  }
};

GpuEngine::Impl::~Impl() {
  // The streams' work reads the held experts' bytes and every buffer: it must be done before a
  // hold is given back or an owner goes. A failed sync is ignored: a destructor cannot report it,
  // and it fails only on a sticky error, after which the device runs nothing more. The owners then
  // go in member order (see the CUDA resources above).
  if (compute.valid()) (void)cudaStreamSynchronize(compute.get());
  if (copy.valid()) (void)cudaStreamSynchronize(copy.get());
  for (const ExpertView& v : demand_holds) (void)source.release(std::span<const ExpertView>(&v, 1));
  for (const PrefetchHold& held : prefetch_holds) {
    (void)source.release(std::span<const ExpertView>(&held.view, 1));
  }
}

Status GpuEngine::Impl::init() {
  std::string why;
  if (!cuda_device_available(&why)) return make_error(ENODEV, why);
  EXPERTD_CUDA_TRY(cudaSetDevice(gpu.device));
  cudaDeviceProp prop{};
  EXPERTD_CUDA_TRY(cudaGetDeviceProperties(&prop, gpu.device));
  device_name =
      fmt::format("{} (sm_{}{}, {})", prop.name, prop.major, prop.minor, gib(prop.totalGlobalMem));
  EXPERTD_TRY_ASSIGN(compute, CudaStream::create(cudaStreamNonBlocking));
  EXPERTD_TRY_ASSIGN(copy, CudaStream::create(cudaStreamNonBlocking));
  EXPERTD_TRY_ASSIGN(blas, CublasHandle::create(compute.get()));
  EXPERTD_CUBLAS_TRY(cublasSetPointerMode(blas.get(), CUBLAS_POINTER_MODE_HOST));
  EXPERTD_CUBLAS_TRY(cublasSetMathMode(blas.get(), CUBLAS_PEDANTIC_MATH));  // true f32, no TF32
  EXPERTD_TRY_ASSIGN(copy_start, CudaEvent::create(cudaEventDefault));
  EXPERTD_TRY_ASSIGN(copy_end, CudaEvent::create(cudaEventDefault));
  if (p.n_expert > 1024 || p.n_expert_used > 64) {
    return make_error(EINVAL, fmt::format("the GPU engine routes at most top-64 of 1024 experts; "
                                          "the model has top-{} of {}",
                                          p.n_expert_used, p.n_expert));
  }
  EXPERTD_TRY(upload_dense());

  // Activations, KV cache and the routing buffers.
  const uint32_t k = p.n_expert_used;
  const uint32_t d = opts.prefetch_depth;
  const uint64_t q_dim = uint64_t{p.n_head} * p.head_dim;
  const uint64_t kv_dim = uint64_t{p.n_head_kv} * p.head_dim;
  const uint64_t kv_values = uint64_t{p.n_layer} * opts.max_context * kv_dim;
  struct Part {
    void** dst;
    uint64_t bytes;
  };
  const Part parts[] = {
      {reinterpret_cast<void**>(&k_cache), kv_values * 4},
      {reinterpret_cast<void**>(&v_cache), kv_values * 4},
      {reinterpret_cast<void**>(&x), uint64_t{p.n_embd} * 4},
      {reinterpret_cast<void**>(&xn), uint64_t{p.n_embd} * 4},
      {reinterpret_cast<void**>(&pxn), uint64_t{std::max(d, 1u)} * p.n_embd * 4},
      {reinterpret_cast<void**>(&qkv), (q_dim + 2 * kv_dim) * 4},
      {reinterpret_cast<void**>(&att), q_dim * 4},
      {reinterpret_cast<void**>(&rlogits), uint64_t{1 + d} * p.n_expert * 4},
      {reinterpret_cast<void**>(&d_experts), uint64_t{1 + d} * k * 4},
      {reinterpret_cast<void**>(&d_weights), uint64_t{1 + d} * k * 4},
      {reinterpret_cast<void**>(&d_probs), uint64_t{1 + d} * p.n_expert * 4},
      {reinterpret_cast<void**>(&gu), 2 * uint64_t{k} * p.n_ff_exp * 4},
      {reinterpret_cast<void**>(&h), uint64_t{k} * p.n_ff_exp * 4},
      {reinterpret_cast<void**>(&eo), uint64_t{k} * p.n_embd * 4},
      {reinterpret_cast<void**>(&d_logits), uint64_t{p.n_vocab} * 4},
  };
  uint64_t total = 0;
  for (const Part& part : parts) total += align_up(part.bytes, kAlign);
  Result<DeviceBytes> work = DeviceBytes::alloc(total);
  if (!work) {
    return make_error(ENOMEM, fmt::format("cannot allocate {} of device memory for the KV cache "
                                          "({} positions) and activations on {}",
                                          gib(total), opts.max_context, device_name));
  }
  work_mem = std::move(*work);
  uint8_t* base = work_mem.get();
  for (const Part& part : parts) {
    *part.dst = base;
    base += align_up(part.bytes, kAlign);
  }
  const uint64_t host_total =
      (uint64_t{1 + d} * k * 2 + uint64_t{1 + d} * p.n_expert + p.n_vocab) * 4;
  EXPERTD_TRY_ASSIGN(host_mem, PinnedBytes::alloc(host_total));
  h_experts = host_mem.get<uint32_t>();
  h_weights = reinterpret_cast<float*>(h_experts + uint64_t{1 + d} * k);
  h_probs = h_weights + uint64_t{1 + d} * k;
  h_logits = h_probs + uint64_t{1 + d} * p.n_expert;

  // The source's host memory, registered once (read-only: the arena is mapped PROT_READ).
  const std::span<const uint8_t> hm = source.host_memory();
  if (!hm.empty()) {
    Result<HostRegistration> reg = HostRegistration::create(
        hm.data(), hm.size(), cudaHostRegisterReadOnly | cudaHostRegisterMapped);
    if (!reg) {
      if (gpu.tier == GpuOptions::Tier::InPlace) {
        return make_error(EIO, fmt::format("in-place mode: registering the daemon's arena ({}) "
                                           "failed: {}",
                                           gib(hm.size()), reg.error().message));
      }
    } else {
      arena = std::move(*reg);
      host_base = hm.data();
      host_bytes = hm.size();
      void* dev = nullptr;
      EXPERTD_CUDA_TRY(cudaHostGetDevicePointer(&dev, const_cast<uint8_t*>(hm.data()), 0));
      dev_base = static_cast<uint8_t*>(dev);
    }
  } else if (gpu.tier == GpuOptions::Tier::InPlace) {
    return make_error(EINVAL,
                      "in-place mode needs an expert source with registrable host memory "
                      "(the daemon's arena)");
  }
  EXPERTD_TRY(setup_tier());

  selected.resize(k);
  weights.resize(k);
  views.resize(k);
  ptrs.resize(k);
  missing.reserve(k);
  missing_index.reserve(k);
  ready_flags.resize(p.n_expert);
  return Ok{};
}

Status GpuEngine::Impl::upload_dense() {
  const uint64_t q_dim = uint64_t{p.n_head} * p.head_dim;
  const uint64_t kv_dim = uint64_t{p.n_head_kv} * p.head_dim;
  const uint64_t e = p.n_embd;
  const bool tied = &model.output() == &model.token_embd();
  const uint64_t per_layer = align_up((q_dim + 2 * kv_dim) * e * 4, kAlign) +
                             align_up(e * q_dim * 4, kAlign) + 2 * align_up(e * 4, kAlign) +
                             2 * align_up(uint64_t{p.head_dim} * 4, kAlign) +
                             align_up(uint64_t{p.n_expert} * e * 4, kAlign);
  const uint64_t table = align_up(uint64_t{p.n_vocab} * e * 4, kAlign);
  dense_device_bytes = per_layer * p.n_layer + table * (tied ? 1 : 2) + align_up(e * 4, kAlign);
  size_t free_b = 0;
  size_t total_b = 0;
  EXPERTD_CUDA_TRY(cudaMemGetInfo(&free_b, &total_b));
  if (dense_device_bytes + (uint64_t{256} << 20) > free_b) {
    return make_error(ENOMEM,
                      fmt::format("{}: the dense weights need {} of device memory as f32, "
                                  "{} is free on {}",
                                  model.path(), gib(dense_device_bytes), gib(free_b), device_name));
  }
  Result<DeviceBytes> dense = DeviceBytes::alloc(dense_device_bytes);
  if (!dense) {
    return make_error(ENOMEM, fmt::format("cannot allocate {} for the dense weights on {}",
                                          gib(dense_device_bytes), device_name));
  }
  dense_mem = std::move(*dense);
  uint8_t* cursor = dense_mem.get();
  auto take = [&](uint64_t bytes) {
    float* out = reinterpret_cast<float*>(cursor);
    cursor += align_up(bytes, kAlign);
    return out;
  };
  std::vector<float> host;
  // Dequantises `m` (rows x cols) into host[offset_rows...] as f32.
  auto dequant_into = [&](const Matrix& m, uint64_t first_row) -> Status {
    EXPERTD_TRY(dequant_check(m.type, m.cols));
    for (uint64_t r = 0; r < m.rows; ++r) {
      dequantize_row(m.type, m.bytes.data() + r * m.row_bytes,
                     host.data() + (first_row + r) * m.cols, m.cols);
    }
    return Ok{};
  };
  auto upload = [&](float* dst, const float* src, uint64_t count) -> Status {
    EXPERTD_CUDA_TRY(cudaMemcpy(dst, src, count * 4, cudaMemcpyHostToDevice));
    return Ok{};
  };
  auto upload_matrix = [&](const Matrix& m, float* dst) -> Status {
    host.resize(m.rows * m.cols);
    EXPERTD_TRY(dequant_into(m, 0));
    return upload(dst, host.data(), host.size());
  };
  embd = take(uint64_t{p.n_vocab} * e * 4);
  EXPERTD_TRY(upload_matrix(model.token_embd(), embd));
  if (tied) {
    output = embd;
  } else {
    output = take(uint64_t{p.n_vocab} * e * 4);
    EXPERTD_TRY(upload_matrix(model.output(), output));
  }
  output_norm = take(e * 4);
  EXPERTD_TRY(upload(output_norm, model.output_norm().data(), e));
  layers.resize(p.n_layer);
  for (uint32_t l = 0; l < p.n_layer; ++l) {
    const LayerWeights& w = model.layer(l);
    DevLayer& d = layers[l];
    d.wqkv = take((q_dim + 2 * kv_dim) * e * 4);
    host.resize((q_dim + 2 * kv_dim) * e);
    EXPERTD_TRY(dequant_into(w.wq, 0));
    EXPERTD_TRY(dequant_into(w.wk, q_dim));
    EXPERTD_TRY(dequant_into(w.wv, q_dim + kv_dim));
    EXPERTD_TRY(upload(d.wqkv, host.data(), host.size()));
    d.wo = take(e * q_dim * 4);
    EXPERTD_TRY(upload_matrix(w.wo, d.wo));
    d.attn_norm = take(e * 4);
    EXPERTD_TRY(upload(d.attn_norm, w.attn_norm.data(), e));
    d.ffn_norm = take(e * 4);
    EXPERTD_TRY(upload(d.ffn_norm, w.ffn_norm.data(), e));
    d.q_norm = take(uint64_t{p.head_dim} * 4);
    EXPERTD_TRY(upload(d.q_norm, w.q_norm.data(), p.head_dim));
    d.k_norm = take(uint64_t{p.head_dim} * 4);
    EXPERTD_TRY(upload(d.k_norm, w.k_norm.data(), p.head_dim));
    d.router = take(uint64_t{p.n_expert} * e * 4);
    EXPERTD_TRY(upload_matrix(w.gate_inp, d.router));
  }
  return Ok{};
}

Status GpuEngine::Impl::setup_tier() {
  // A device slot holds one expert's gate, up and down bytes, each 256-aligned, plus room for
  // the padding a daemon slot may place between them (copied as one span when it fits).
  EXPERTD_TRY_ASSIGN(const SliceMap map, SliceMap::build(model.gguf()));
  shapes.resize(p.n_layer);
  uint64_t expert_bytes = 0;
  for (const MoeLayer& ml : map.layers()) {
    if (ml.layer >= p.n_layer) continue;
    LayerShape& sh = shapes[ml.layer];
    uint64_t sum = 0;
    for (uint32_t i = 0; i < ml.slice_count; ++i) {
      const ExpertSlice& es = ml.expert0[i];
      if (!expert_type_supported(es.type)) {
        return make_error(EINVAL, fmt::format("{}: layer {} {} experts are {}, which the GPU "
                                              "kernels do not read",
                                              model.path(), ml.layer, slice_kind_name(es.kind),
                                              ggml_type_name(es.type)));
      }
      const uint64_t rb = es.bytes / es.ne1;
      switch (es.kind) {
        case SliceKind::Gate:
          sh.gate = {es.type, rb};
          break;
        case SliceKind::Up:
          sh.up = {es.type, rb};
          break;
        case SliceKind::GateUp:
          sh.gate = sh.up = {es.type, rb};
          break;
        case SliceKind::Down:
          sh.down = {es.type, rb};
          break;
      }
      sum += align_up(es.bytes, kAlign);
    }
    sh.present = true;
    expert_bytes = std::max(expert_bytes, sum);
  }
  if (expert_bytes == 0) {
    return make_error(EINVAL, fmt::format("{}: no routed expert tensors", model.path()));
  }
  slot_bytes = align_up(expert_bytes + 3 * 4096, kAlign);
  const uint64_t all = uint64_t{p.n_layer} * p.n_expert;
  uint64_t slots = 0;
  switch (gpu.tier) {
    case GpuOptions::Tier::InPlace:
      return Ok{};
    case GpuOptions::Tier::Experts:
      slots = gpu.value;
      break;
    case GpuOptions::Tier::Bytes:
      slots = gpu.value / slot_bytes;
      break;
    case GpuOptions::Tier::Auto: {
      size_t free_b = 0;
      size_t total_b = 0;
      EXPERTD_CUDA_TRY(cudaMemGetInfo(&free_b, &total_b));
      slots = std::min<uint64_t>(all, free_b / 2 / slot_bytes);
      break;
    }
  }
  slots = std::min(slots, all);
  if (slots < p.n_expert_used) {
    return make_error(EINVAL, fmt::format("a VRAM tier of {} experts cannot hold one layer's "
                                          "top-{} ({} per expert); use --vram-experts 0 for the "
                                          "in-place mode",
                                          slots, p.n_expert_used, gib(slot_bytes)));
  }
  Result<DeviceBytes> slots_mem = DeviceBytes::alloc(slots * slot_bytes);
  if (!slots_mem) {
    size_t free_b = 0;
    size_t total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    return make_error(ENOMEM,
                      fmt::format("a VRAM tier of {} experts needs {}; {} is free on {}", slots,
                                  gib(slots * slot_bytes), gib(free_b), device_name));
  }
  tier_mem = std::move(*slots_mem);
  tier = std::make_unique<VramTier>(static_cast<uint32_t>(slots), p.n_layer, p.n_expert);
  ready_event.resize(slots);
  use_event.resize(slots);
  slot_ptrs.resize(slots);
  for (uint64_t s = 0; s < slots; ++s) {
    EXPERTD_TRY_ASSIGN(ready_event[s], CudaEvent::create(cudaEventDisableTiming));
    EXPERTD_TRY_ASSIGN(use_event[s], CudaEvent::create(cudaEventDisableTiming));
  }
  return Ok{};
}

Status GpuEngine::Impl::gemv(const float* w, uint32_t rows, uint32_t cols, const float* in,
                             float* out, float beta) {
  // Row-major [rows][cols] is column-major [cols x rows]: y = A^T x.
  const float alpha = 1.0f;
  EXPERTD_CUBLAS_TRY(cublasSgemv(blas.get(), CUBLAS_OP_T, static_cast<int>(cols),
                                 static_cast<int>(rows), &alpha, w, static_cast<int>(cols), in, 1,
                                 &beta, out, 1));
  return Ok{};
}

Status GpuEngine::Impl::attention(uint32_t layer) {
  const DevLayer& w = layers[layer];
  const uint32_t hd = p.head_dim;
  const uint64_t q_dim = uint64_t{p.n_head} * hd;
  const uint64_t kv_dim = uint64_t{p.n_head_kv} * hd;
  float* q = qkv;
  float* k = qkv + q_dim;
  float* v = k + kv_dim;
  EXPERTD_CUDA_TRY(kernels::rms_norm(x, w.attn_norm, xn, 1, p.n_embd, p.rms_eps, compute.get()));
  EXPERTD_TRY(gemv(w.wqkv, static_cast<uint32_t>(q_dim + 2 * kv_dim), p.n_embd, xn, qkv, 0.0f));
  EXPERTD_CUDA_TRY(kernels::rms_norm(q, w.q_norm, q, p.n_head, hd, p.rms_eps, compute.get()));
  EXPERTD_CUDA_TRY(kernels::rms_norm(k, w.k_norm, k, p.n_head_kv, hd, p.rms_eps, compute.get()));
  const float base = static_cast<float>(p.rope_base);
  EXPERTD_CUDA_TRY(kernels::rope_neox(q, p.n_head, hd, p.n_rot, pos, base, compute.get()));
  EXPERTD_CUDA_TRY(kernels::rope_neox(k, p.n_head_kv, hd, p.n_rot, pos, base, compute.get()));
  EXPERTD_CUDA_TRY(cudaMemcpyAsync(k_cache + kv_index(layer, pos), k, kv_dim * 4,
                                   cudaMemcpyDeviceToDevice, compute.get()));
  EXPERTD_CUDA_TRY(cudaMemcpyAsync(v_cache + kv_index(layer, pos), v, kv_dim * 4,
                                   cudaMemcpyDeviceToDevice, compute.get()));
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  EXPERTD_CUDA_TRY(kernels::decode_attention(q, k_cache + kv_index(layer, 0),
                                             v_cache + kv_index(layer, 0), att, p.n_head,
                                             p.n_head_kv, hd, pos + 1, scale, compute.get()));
  // x += Wo att (beta = 1 accumulates into the residual stream).
  return gemv(w.wo, p.n_embd, static_cast<uint32_t>(q_dim), att, x, 1.0f);
}

Status GpuEngine::Impl::route_and_hint(uint32_t layer) {
  const uint32_t k = p.n_expert_used;
  const uint32_t d = lookahead(layer);
  EXPERTD_CUDA_TRY(
      kernels::rms_norm(x, layers[layer].ffn_norm, xn, 1, p.n_embd, p.rms_eps, compute.get()));
  EXPERTD_TRY(gemv(layers[layer].router, p.n_expert, p.n_embd, xn, rlogits, 0.0f));
  for (uint32_t j = 1; j <= d; ++j) {
    float* in = pxn + uint64_t{j - 1} * p.n_embd;
    EXPERTD_CUDA_TRY(kernels::rms_norm(x, layers[layer + j].ffn_norm, in, 1, p.n_embd, p.rms_eps,
                                       compute.get()));
    EXPERTD_TRY(gemv(layers[layer + j].router, p.n_expert, p.n_embd, in,
                     rlogits + uint64_t{j} * p.n_expert, 0.0f));
  }
  EXPERTD_CUDA_TRY(kernels::router_topk(rlogits, 1 + d, p.n_expert, k, p.norm_topk, d_experts,
                                        d_weights, d_probs, compute.get()));
  EXPERTD_CUDA_TRY(cudaMemcpyAsync(h_experts, d_experts, uint64_t{k} * 4, cudaMemcpyDeviceToHost,
                                   compute.get()));
  EXPERTD_CUDA_TRY(cudaMemcpyAsync(h_weights, d_weights, uint64_t{k} * 4, cudaMemcpyDeviceToHost,
                                   compute.get()));
  if (d > 0) {
    EXPERTD_CUDA_TRY(cudaMemcpyAsync(h_probs, d_probs + p.n_expert, uint64_t{d} * p.n_expert * 4,
                                     cudaMemcpyDeviceToHost, compute.get()));
  }
  EXPERTD_CUDA_TRY(cudaStreamSynchronize(compute.get()));
  // Everything launched before (the previous layer's experts among it) has finished.
  EXPERTD_TRY(release_demand_holds());
  EXPERTD_TRY(release_finished_prefetch_holds(false));
  if (copy_timing) {
    float ms = 0.0f;
    if (cudaEventQuery(copy_end.get()) == cudaSuccess) {
      EXPERTD_CUDA_TRY(cudaEventElapsedTime(&ms, copy_start.get(), copy_end.get()));
      stats.copy_ns += static_cast<uint64_t>(static_cast<double>(ms) * 1e6);
      copy_timing = false;
    }
  }

  // Hints for the next layers.
  planner.from_layer(layer);
  if (opts.prefetch_depth > 0) {
    if (opts.hints == HintSource::Script && opts.script != nullptr) {
      for (uint32_t j = 1; j <= opts.prefetch_depth && layer + j < p.n_layer; ++j) {
        add_scripted_hints(*opts.script, pos, layer, layer + j, planner);
      }
    } else {
      for (uint32_t j = 1; j <= d; ++j) {
        planner.add_ranked(
            layer + j, std::span<const float>(h_probs + uint64_t{j - 1} * p.n_expert, p.n_expert));
      }
    }
    const std::span<const ExpertHint> hints = planner.take(stats);
    last_hints.assign(hints.begin(), hints.end());
    if (!hints.empty() && !source.prefetch(hints)) ++stats.hint_errors;
  }

  // The routing decision: computed, or the script's.
  const ScriptedRoute* scripted = opts.script != nullptr ? opts.script->find(pos, layer) : nullptr;
  if (scripted != nullptr) {
    std::copy(scripted->experts.begin(), scripted->experts.end(), selected.begin());
    std::copy(scripted->weights.begin(), scripted->weights.end(), weights.begin());
    std::memcpy(h_weights, weights.data(), uint64_t{k} * 4);
    EXPERTD_CUDA_TRY(cudaMemcpyAsync(d_weights, h_weights, uint64_t{k} * 4, cudaMemcpyHostToDevice,
                                     compute.get()));
    ++stats.scripted_routes;
  } else {
    for (uint32_t i = 0; i < k; ++i) {
      if (h_experts[i] >= p.n_expert) {
        return make_error(EIO, fmt::format("layer {}: the router kernel chose expert {} of {}",
                                           layer, h_experts[i], p.n_expert));
      }
      selected[i] = h_experts[i];
      weights[i] = h_weights[i];
    }
  }
  RoutingRecord* rec = nullptr;
  if (routing_log != nullptr) {
    routing_log->push_back(RoutingRecord{pos, layer, selected, weights, {}});
    rec = &routing_log->back();
  }
  planner.routed(layer, selected, stats, rec);
  return Ok{};
}

Result<ExpertPtrs> GpuEngine::Impl::in_place(const ExpertView& v) const {
  ExpertPtrs out;
  const WeightView* parts[3] = {&v.gate, &v.up, &v.down};
  const void** dst[3] = {&out.gate, &out.up, &out.down};
  for (int i = 0; i < 3; ++i) {
    const uint8_t* ptr = parts[i]->data;
    const uint64_t bytes = parts[i]->rows * parts[i]->row_bytes;
    if (!arena.valid() || ptr < host_base || ptr + bytes > host_base + host_bytes) {
      return make_error(EINVAL, fmt::format("layer {} expert {}: the held expert lies outside the "
                                            "registered arena",
                                            v.layer, v.expert));
    }
    *dst[i] = dev_base + (ptr - host_base);
  }
  return out;
}

Status GpuEngine::Impl::copy_expert(const ExpertView& v, uint32_t slot, bool demand) {
  auto* dst = tier_mem.get() + uint64_t{slot} * slot_bytes;
  const WeightView* parts[3] = {&v.gate, &v.up, &v.down};
  const uint8_t* lo = parts[0]->data;
  const uint8_t* hi = lo;
  for (const WeightView* w : parts) {
    lo = std::min(lo, w->data);
    hi = std::max(hi, w->data + w->rows * w->row_bytes);
  }
  // The copy may start only when the slot's previous readers are done.
  EXPERTD_CUDA_TRY(cudaStreamWaitEvent(copy.get(), use_event[slot].get(), 0));
  ExpertPtrs& sp = slot_ptrs[slot];
  const bool in_arena = arena.valid() && lo >= host_base && hi <= host_base + host_bytes;
  if (in_arena && static_cast<uint64_t>(hi - lo) <= slot_bytes) {
    // One span: the expert's slices as they lie in the daemon's slot.
    EXPERTD_CUDA_TRY(cudaMemcpyAsync(dst, lo, static_cast<uint64_t>(hi - lo),
                                     cudaMemcpyHostToDevice, copy.get()));
    sp.gate = dst + (v.gate.data - lo);
    sp.up = dst + (v.up.data - lo);
    sp.down = dst + (v.down.data - lo);
    stats.copy_bytes += static_cast<uint64_t>(hi - lo);
    if (demand) stats.demand_copy_bytes += static_cast<uint64_t>(hi - lo);
  } else {
    uint64_t off = 0;
    const void** dsts[3] = {&sp.gate, &sp.up, &sp.down};
    for (int i = 0; i < 3; ++i) {
      const uint64_t bytes = parts[i]->rows * parts[i]->row_bytes;
      EXPERTD_CUDA_TRY(
          cudaMemcpyAsync(dst + off, parts[i]->data, bytes, cudaMemcpyHostToDevice, copy.get()));
      *dsts[i] = dst + off;
      off += align_up(bytes, kAlign);
      stats.copy_bytes += bytes;
      if (demand) stats.demand_copy_bytes += bytes;
    }
  }
  EXPERTD_CUDA_TRY(cudaEventRecord(ready_event[slot].get(), copy.get()));
  return Ok{};
}

Status GpuEngine::Impl::moe(uint32_t layer) {
  const uint32_t k = p.n_expert_used;
  // Pins left by a layer that failed half-way (a successful one leaves none).
  for (const uint32_t slot : used_slots) tier->unpin(slot);
  used_slots.clear();
  if (!tier) {
    const uint64_t t0 = monotonic_ns();
    EXPERTD_TRY(source.get(layer, selected, views));
    stats.stall_ns += monotonic_ns() - t0;
    for (uint32_t i = 0; i < k; ++i) {
      demand_holds.push_back(views[i]);
      auto pp = in_place(views[i]);
      if (!pp) return pp.error();
      ptrs[i] = *pp;
    }
  } else {
    missing.clear();
    missing_index.clear();
    for (uint32_t i = 0; i < k; ++i) {
      const uint32_t slot = tier->find(layer, selected[i]);
      if (slot == VramTier::kNone) {
        missing.push_back(selected[i]);
        missing_index.push_back(i);
        continue;
      }
      ++stats.vram_hits;
      if (tier->take_prefetched(slot)) ++stats.vram_prefetch_used;
      tier->pin(slot);
      used_slots.push_back(slot);
      ptrs[i] = slot_ptrs[slot];
      EXPERTD_CUDA_TRY(cudaStreamWaitEvent(compute.get(), ready_event[slot].get(), 0));
    }
    if (!missing.empty()) {
      stats.vram_misses += missing.size();
      const uint64_t t0 = monotonic_ns();
      EXPERTD_TRY(source.get(layer, missing, std::span<ExpertView>(views.data(), missing.size())));
      stats.stall_ns += monotonic_ns() - t0;
      for (size_t j = 0; j < missing.size(); ++j) demand_holds.push_back(views[j]);
      if (!copy_timing) EXPERTD_CUDA_TRY(cudaEventRecord(copy_start.get(), copy.get()));
      for (size_t j = 0; j < missing.size(); ++j) {
        const uint32_t slot = tier->insert(layer, missing[j], false);
        if (slot == VramTier::kNone) {
          return make_error(EIO, fmt::format("layer {}: every VRAM slot is pinned", layer));
        }
        tier->pin(slot);
        used_slots.push_back(slot);
        if (auto st = copy_expert(views[j], slot, true); !st) {
          tier->erase(slot);
          return st;
        }
        EXPERTD_CUDA_TRY(cudaStreamWaitEvent(compute.get(), ready_event[slot].get(), 0));
        ptrs[missing_index[j]] = slot_ptrs[slot];
      }
      EXPERTD_CUDA_TRY(cudaEventRecord(copy_end.get(), copy.get()));
      copy_timing = true;
    }
  }
  stats.experts_used += k;

  // gate and up of every expert, SwiGLU, down, the weighted sum into x.
  const LayerShape& sh = shapes[layer];
  if (!sh.present) return make_error(EINVAL, fmt::format("layer {} has no routed experts", layer));
  const uint64_t ff = p.n_ff_exp;
  const uint32_t per = kernels::kMaxBatch;
  if (sh.gate.type == sh.up.type && sh.gate.row_bytes == sh.up.row_bytes && 2 * k <= per) {
    kernels::MatvecBatch b;
    b.count = 2 * k;
    for (uint32_t i = 0; i < k; ++i) {
      b.w[i] = ptrs[i].gate;
      b.x[i] = xn;
      b.y[i] = gu + i * ff;
      b.w[k + i] = ptrs[i].up;
      b.x[k + i] = xn;
      b.y[k + i] = gu + (k + i) * ff;
    }
    EXPERTD_CUDA_TRY(kernels::matvec_batched(sh.gate.type, b, sh.gate.row_bytes,
                                             static_cast<uint32_t>(ff), p.n_embd, compute.get()));
  } else {
    for (uint32_t i = 0; i < k; ++i) {
      EXPERTD_CUDA_TRY(kernels::matvec(sh.gate.type, ptrs[i].gate, sh.gate.row_bytes,
                                       static_cast<uint32_t>(ff), p.n_embd, xn, gu + i * ff,
                                       compute.get()));
      EXPERTD_CUDA_TRY(kernels::matvec(sh.up.type, ptrs[i].up, sh.up.row_bytes,
                                       static_cast<uint32_t>(ff), p.n_embd, xn, gu + (k + i) * ff,
                                       compute.get()));
    }
  }
  EXPERTD_CUDA_TRY(kernels::swiglu(gu, gu + k * ff, h, k * ff, compute.get()));
  for (uint32_t first = 0; first < k; first += per) {
    kernels::MatvecBatch b;
    b.count = std::min(per, k - first);
    for (uint32_t j = 0; j < b.count; ++j) {
      const uint32_t i = first + j;
      b.w[j] = ptrs[i].down;
      b.x[j] = h + i * ff;
      b.y[j] = eo + uint64_t{i} * p.n_embd;
    }
    EXPERTD_CUDA_TRY(kernels::matvec_batched(sh.down.type, b, sh.down.row_bytes, p.n_embd,
                                             static_cast<uint32_t>(ff), compute.get()));
  }
  EXPERTD_CUDA_TRY(kernels::moe_combine(eo, d_weights, x, k, p.n_embd, compute.get()));
  for (const uint32_t slot : used_slots) {
    EXPERTD_CUDA_TRY(cudaEventRecord(use_event[slot].get(), compute.get()));
    tier->unpin(slot);
  }
  used_slots.clear();
  return Ok{};
}

Status GpuEngine::Impl::prefetch_into_vram(uint32_t layer) {
  if (!tier) return Ok{};
  // The experts hinted for the next layers that the daemon holds READY: acquire (a host hit)
  // and copy ahead of their layer, on the copy stream, behind this layer's demand copies.
  const uint32_t k = p.n_expert_used;
  uint32_t budget = tier->capacity() > 2 * k ? tier->capacity() - 2 * k : 0;
  for (uint32_t j = 1; j <= opts.prefetch_depth && layer + j < p.n_layer && budget > 0; ++j) {
    const uint32_t next = layer + j;
    candidates.clear();
    for (const ExpertHint& hint : last_hints) {
      if (hint.layer == next && !tier->contains(next, hint.expert))
        candidates.push_back(hint.expert);
    }
    if (candidates.empty()) continue;
    source.host_ready(next, candidates, std::span<uint8_t>(ready_flags.data(), candidates.size()));
    for (size_t i = 0; i < candidates.size() && budget > 0; ++i) {
      if (ready_flags[i] == 0) continue;
      ExpertView v;
      if (!source.get(next, std::span<const uint32_t>(&candidates[i], 1),
                      std::span<ExpertView>(&v, 1))) {
        continue;  // evicted meanwhile: a hint, not a failure
      }
      const uint32_t slot = tier->insert(next, candidates[i], true);
      if (slot == VramTier::kNone) {
        EXPERTD_TRY(source.release(std::span<const ExpertView>(&v, 1)));
        return Ok{};
      }
      if (auto st = copy_expert(v, slot, false); !st) {
        tier->erase(slot);
        (void)source.release(std::span<const ExpertView>(&v, 1));
        return st;
      }
      prefetch_holds.push_back(PrefetchHold{v, slot});
      ++stats.vram_prefetches;
      --budget;
    }
  }
  return Ok{};
}

Status GpuEngine::Impl::release_demand_holds() {
  if (demand_holds.empty()) return Ok{};
  Status st = source.release(demand_holds);
  demand_holds.clear();
  return st;
}

Status GpuEngine::Impl::release_finished_prefetch_holds(bool all) {
  Status result = Ok{};
  size_t kept = 0;
  for (size_t i = 0; i < prefetch_holds.size(); ++i) {
    PrefetchHold& held = prefetch_holds[i];
    const cudaError_t q = all ? cudaSuccess : cudaEventQuery(ready_event[held.slot].get());
    if (q == cudaErrorNotReady) {
      prefetch_holds[kept++] = held;
      continue;
    }
    if (q != cudaSuccess) {
      cudaGetLastError();
      result = cuda::cuda_error(q, "cudaEventQuery(ready_event[slot])", __FILE__, __LINE__);
    }
    auto st = source.release(std::span<const ExpertView>(&held.view, 1));
    if (!st && result) result = std::move(st);
  }
  prefetch_holds.resize(kept);
  return result;
}

// --- GpuEngine ---------------------------------------------------------------------------------

GpuEngine::GpuEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GpuEngine::~GpuEngine() = default;

Result<std::unique_ptr<GpuEngine>> GpuEngine::create(const DenseModel& model, ExpertSource& source,
                                                     const EngineOptions& options,
                                                     const GpuOptions& gpu) {
  const ModelParams& p = model.params();
  if (p.architecture != "qwen3moe") {
    return make_error(ENOTSUP, fmt::format("{}: the CUDA engine runs qwen3moe; '{}' runs on the "
                                           "CPU engine (--cpu)",
                                           model.path(), p.architecture));
  }
  EXPERTD_TRY(check_engine_options(p, options));
  auto impl = std::make_unique<Impl>(model, source, options, gpu);
  EXPERTD_TRY(impl->init());
  return std::unique_ptr<GpuEngine>(new GpuEngine(std::move(impl)));
}

Result<std::unique_ptr<Engine>> create_gpu_engine(const DenseModel& model, ExpertSource& source,
                                                  const EngineOptions& options,
                                                  const GpuOptions& gpu) {
  if (model.params().is_ds4()) {
    EXPERTD_TRY_ASSIGN(std::unique_ptr<Ds4GpuEngine> e,
                       Ds4GpuEngine::create(model, source, options, gpu));
    return std::unique_ptr<Engine>(std::move(e));
  }
  EXPERTD_TRY_ASSIGN(std::unique_ptr<GpuEngine> e, GpuEngine::create(model, source, options, gpu));
  return std::unique_ptr<Engine>(std::move(e));
}

Status GpuEngine::decode(uint32_t token, std::span<float> logits) {
  Impl& m = *impl_;
  const ModelParams& p = m.p;
  EXPERTD_TRY(check_decode(p, m.opts, m.pos, token, logits.size()));
  const uint64_t t0 = monotonic_ns();
  EXPERTD_CUDA_TRY(cudaMemcpyAsync(m.x, m.embd + uint64_t{token} * p.n_embd, uint64_t{p.n_embd} * 4,
                                   cudaMemcpyDeviceToDevice, m.compute.get()));
  m.planner.begin_token();
  for (uint32_t layer = 0; layer < p.n_layer; ++layer) {
    if (!m.source.set_cursor(m.pos, layer)) ++m.stats.hint_errors;
    EXPERTD_TRY(m.attention(layer));
    EXPERTD_TRY(m.route_and_hint(layer));
    EXPERTD_TRY(m.moe(layer));
    EXPERTD_TRY(m.prefetch_into_vram(layer));
  }
  EXPERTD_CUDA_TRY(
      kernels::rms_norm(m.x, m.output_norm, m.xn, 1, p.n_embd, p.rms_eps, m.compute.get()));
  EXPERTD_TRY(m.gemv(m.output, p.n_vocab, p.n_embd, m.xn, m.d_logits, 0.0f));
  EXPERTD_CUDA_TRY(cudaMemcpyAsync(m.h_logits, m.d_logits, uint64_t{p.n_vocab} * 4,
                                   cudaMemcpyDeviceToHost, m.compute.get()));
  EXPERTD_CUDA_TRY(cudaStreamSynchronize(m.compute.get()));
  EXPERTD_TRY(m.release_demand_holds());
  EXPERTD_TRY(m.release_finished_prefetch_holds(false));
  std::memcpy(logits.data(), m.h_logits, uint64_t{p.n_vocab} * 4);
  ++m.pos;
  ++m.stats.tokens;
  m.stats.decode_ns += monotonic_ns() - t0;
  return Ok{};
}

void GpuEngine::reset() { impl_->pos = 0; }
uint32_t GpuEngine::position() const { return impl_->pos; }
const EngineStats& GpuEngine::stats() const { return impl_->stats; }
void GpuEngine::set_routing_log(std::vector<RoutingRecord>* log) { impl_->routing_log = log; }
uint32_t GpuEngine::vram_slots() const { return impl_->tier ? impl_->tier->capacity() : 0; }
uint64_t GpuEngine::vram_slot_bytes() const { return impl_->slot_bytes; }

std::string GpuEngine::description() const {
  const Impl& m = *impl_;
  std::string tier =
      m.tier ? fmt::format("VRAM expert tier of {} experts ({})", m.tier->capacity(),
                           gib(uint64_t{m.tier->capacity()} * m.slot_bytes))
             : std::string("in-place experts (kernels read the daemon's pinned arena over PCIe)");
  return fmt::format("CUDA engine on {}: dense weights {} as f32 (cuBLAS), {}{}", m.device_name,
                     gib(m.dense_device_bytes), tier,
                     m.arena.valid() ? "" : "; arena not registered: pageable copies");
}

}  // namespace expertd::engine
