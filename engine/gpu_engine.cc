#include "engine/gpu_engine.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>

#include "engine/cpu_ops.h"
#include "engine/dequant.h"
#include "engine/ds3_gpu_engine.h"
#include "engine/ds4_gpu_engine.h"
#include "engine/gpu_experts.h"
#include "engine/routing.h"
#include "kernels/attention.cuh"
#include "kernels/check.h"
#include "kernels/combine.cuh"
#include "kernels/cuda_raii.h"
#include "kernels/dequant.cuh"
#include "kernels/ds4.cuh"
#include "kernels/matvec.cuh"
#include "kernels/norm.cuh"
#include "kernels/prefill.cuh"
#include "kernels/rope.cuh"
#include "kernels/routing.cuh"
#include "kernels/swiglu.cuh"
#include "storage/ggml_types.h"

namespace expertd::engine {
namespace {

using cuda::CublasHandle;
using cuda::CudaStream;
using cuda::DeviceBytes;
using cuda::PinnedBytes;
using gpu::align_up;
using gpu::Carver;
using gpu::ExpertPtrs;
using gpu::gib;
using gpu::GpuExperts;
using gpu::kAlign;

struct DevLayer {
  float* wqkv = nullptr;  // [q_dim + 2 kv_dim rows][n_embd]
  float* wo = nullptr;    // [n_embd][q_dim]
  float* attn_norm = nullptr;
  float* q_norm = nullptr;  // nullptr without qk_norm (llama)
  float* k_norm = nullptr;
  float* ffn_norm = nullptr;
  float* router = nullptr;  // [n_expert][n_embd]; nullptr on glm4moe's dense layers
  float* bqkv = nullptr;    // glm4moe's q/k/v biases, as wqkv's rows (zeros where absent)
  gpu::DevSigmoidMoe moe;   // glm4moe: the dense MLP or the shared expert, as in the file
  // gpt-oss (nullptr otherwise): the output projection's and router's biases, each head's sink
  // logit, and the experts' biases ([n_expert][n_ff_exp] gate and up, [n_expert][n_embd] down).
  float* bo = nullptr;
  float* router_b = nullptr;
  float* sinks = nullptr;
  float* exp_gate_b = nullptr;
  float* exp_up_b = nullptr;
  float* exp_down_b = nullptr;
};

// Device bytes of a vector uploaded as f32 (none when it is empty).
uint64_t vec_bytes(const std::vector<float>& v) {
  return v.empty() ? 0 : align_up(v.size() * 4, kAlign);
}

// The routers made on the host (HostRouter): SigmoidMoe's (GLM-4.5) and the top-k softmax
// (gpt-oss); those models also prefill layer by layer.
bool host_routed(const ModelParams& p) { return p.router != RouterKind::Softmax; }

// Whether a layer has q/k/v biases (glm4moe's attention_bias; any of the three).
bool has_qkv_bias(const LayerWeights& w) { return !w.bq.empty() || !w.bk.empty() || !w.bv.empty(); }

// The model's RoPE (NEOX for qwen3moe, NORM for llama) over `rows` consecutive rows of `heads`
// vectors, row r at position pos0 + r.
cudaError_t rope_rows(const ModelParams& p, float* x, uint32_t rows, uint32_t heads, uint32_t pos0,
                      cudaStream_t stream) {
  const float base = static_cast<float>(p.rope_base);
  if (p.rope == RopeType::Norm) {
    return kernels::rope_norm_rows(x, rows, heads, p.head_dim, p.n_rot, pos0, base, stream);
  }
  return kernels::rope_neox_rows(x, rows, heads, p.head_dim, p.n_rot, pos0, base, stream);
}

cudaError_t rope(const ModelParams& p, float* x, uint32_t heads, uint32_t pos,
                 cudaStream_t stream) {
  const float base = static_cast<float>(p.rope_base);
  if (p.rope == RopeType::Norm) {
    return kernels::rope_norm(x, heads, p.head_dim, p.n_rot, pos, base, stream);
  }
  return kernels::rope_neox(x, heads, p.head_dim, p.n_rot, pos, base, stream);
}

}  // namespace

Result<GpuOptions::PrefillGemm> parse_prefill_gemm(const std::string& text) {
  if (text == "f32") return GpuOptions::PrefillGemm::F32;
  if (text == "bf16") return GpuOptions::PrefillGemm::Bf16;
  return make_error(EINVAL, fmt::format("--prefill-gemm: '{}' is neither f32 nor bf16", text));
}

Result<GpuOptions> parse_vram_experts(const std::string& text) {
  GpuOptions g;
  if (text == "auto") return g;
  uint64_t v = 0;
  const char* end = text.data() + text.size();
  const auto [rest, ec] = std::from_chars(text.data(), end, v);
  if (ec != std::errc() || text.empty()) {
    return make_error(EINVAL, fmt::format("--vram-experts: '{}' is not a number of "
                                          "experts, a size (8G, 512M) or auto",
                                          text));
  }
  const std::string unit(rest, end);
  if (unit.empty()) {
    g.tier = v == 0 ? GpuOptions::Tier::InPlace : GpuOptions::Tier::Experts;
    g.value = v;
    return g;
  }
  const std::string units = "KMGT";
  const size_t u =
      unit.size() <= 3 ? units.find(static_cast<char>(std::toupper(unit[0]))) : std::string::npos;
  if (u == std::string::npos ||
      (unit.size() > 1 && unit.substr(1) != "B" && unit.substr(1) != "iB")) {
    return make_error(EINVAL, fmt::format("--vram-experts: unknown unit '{}' in '{}' "
                                          "(use K, M, G or T)",
                                          unit, text));
  }
  g.tier = GpuOptions::Tier::Bytes;
  g.value = v << (10 * (u + 1));
  return g;
}

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
  uint32_t pos = 0;  // the selected sequence's
  // Sequences (EngineOptions::sequences): each has its own KV cache of max_context positions;
  // kv_seq is the selected one's offset in k_cache and v_cache (floats).
  uint32_t seq = 0;
  uint64_t kv_seq = 0;
  std::vector<uint32_t> seq_pos;
  std::string device_name;
  uint64_t dense_device_bytes = 0;

  // The CUDA resources. Members are destroyed last to first, after ~Impl's body has synchronised
  // both streams, so this order is the teardown order, bottom up: the experts' owner (it gives
  // the daemon's holds back, then its events, the arena's registration and the VRAM tier's slots
  // go: no copy or kernel reads through them any more); then the cuBLAS handle and the streams
  // (nothing is enqueued on them); then the pinned mirrors and the device memory the streams'
  // work used.
  DeviceBytes dense_mem;   // the dense weights, as f32
  DeviceBytes moe_mem;     // glm4moe's dense MLPs and shared experts, as in the file
  DeviceBytes work_mem;    // activations, the KV cache and the routing buffers
  PinnedBytes host_mem;    // pinned mirrors of the routing results and logits
  DeviceBytes batch_mem;   // decode_batch()'s per-row buffers (sequences > 1)
  PinnedBytes batch_host;  // and its logits' pinned mirror
  DeviceBytes chunk_mem;   // prefill's per-chunk activations and the dequantised expert
  PinnedBytes chunk_host;  // prefill's routes (device -> host) and row lists (host -> device)
  CudaStream copy;
  CudaStream compute;
  CublasHandle blas;  // on `compute`
  std::unique_ptr<GpuExperts> experts;

  std::vector<DevLayer> layers;
  float* embd = nullptr;    // [n_vocab][n_embd]
  float* output = nullptr;  // [n_vocab][n_embd] (== embd when tied)
  float* output_norm = nullptr;
  float* k_cache = nullptr;  // [sequence][layer][pos][kv_dim]
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
  double* inv_freq = nullptr;     // gpt-oss: YaRN's rope frequencies, n_rot / 2 (else nullptr)
  double mscale = 1.0;            // and its attention factor
  float* sg = nullptr;            // glm4moe: the dense MLP's / shared expert's gate, up (widest)
  float* su = nullptr;
  float* sout = nullptr;          // glm4moe: its output, n_embd
  float* mout = nullptr;          // glm4moe: the MoE block's output, n_embd
  uint32_t* h_experts = nullptr;  // pinned mirrors
  float* h_weights = nullptr;
  float* h_probs = nullptr;
  float* h_logits = nullptr;

  // prefill(): up to `chunk` positions at once. Row-major [row][...] buffers of the chunk.
  uint32_t chunk = 0;
  uint32_t chunk_asked = 0;  // options.prefill_chunk (capped at max_context), before clamping
  uint64_t chunk_bytes = 0;
  float* cx = nullptr;           // [chunk][n_embd] residual streams
  float* cxn = nullptr;          // [chunk][n_embd] normalised inputs
  float* cq = nullptr;           // [chunk][q_dim]
  float* catt = nullptr;         // [chunk][q_dim] attention outputs
  float* cscores = nullptr;      // [chunk][max_context] one head's scores, then probabilities
  float* crl = nullptr;          // [chunk][n_expert] router logits
  uint32_t* d_routes = nullptr;  // [rows][k] experts, then [rows][k] weights (floats)
  uint32_t* d_rows = nullptr;    // [chunk][k] routing weights, then the chunk's tokens
  float* ceo = nullptr;          // [chunk][k][n_embd] every route slot's expert output
  std::vector<std::pair<uint32_t, uint32_t>> next_counts;  // (rows, expert): the lookahead's
  std::vector<uint32_t> next_rows;                         // [n_expert] the lookahead's rows
  // Both prefills' grouped expert GEMMs (run_experts_by_rows); its xe is also hint_next_layer's
  // normed rows.
  gpu::RowsScratch rows_scratch;
  std::vector<ExpertHint> next_hints;
  uint32_t* h_routes = nullptr;  // pinned mirrors of d_routes and d_rows
  uint32_t* h_rows = nullptr;
  std::vector<uint32_t> expert_rows;  // [n_expert] rows routed to each expert this layer
  std::vector<ExpertHint> needed_hints;
  std::vector<RoutingRecord> chunk_log;  // [row][layer], appended in decode's order
  // glm4moe's and gpt-oss's prefill, layer by layer over the chunk (prefill_layerwise): cx, cxn
  // and crl above, and each row's routes.
  uint64_t ce = 0;         // row stride of cx and cxn: n_embd rounded up to 64 floats
  uint64_t cne = 0;        // n_expert rounded up to 64 floats
  uint64_t crs = 0;        // row stride of crl and h_crl: (1 + lookahead) * cne
  float* crw = nullptr;    // [chunk][k] routing weights on the device
  float* h_crl = nullptr;  // pinned mirrors ([chunk][n_expert], [chunk][k])
  float* h_crw = nullptr;
  std::vector<uint32_t> csel;    // [chunk][k] the chunk's routes (both prefills)
  std::vector<uint8_t> cneeded;  // [n_expert] routed to by the chunk at this layer
  // rows_attention() (chunks of gpu::kDenseGemmRows or more): each row's q, k, v and its attention
  // output, rows lqs and las floats apart (nullptr: row by row).
  uint64_t lqs = 0;
  uint64_t las = 0;
  float* lqkv = nullptr;
  float* latt = nullptr;

  // decode_batch() (sequences > 1): each row's residual, normalised input, routing weights
  // ([1 + depth][k], as d_weights), gate/up, SwiGLU and expert outputs (as gu, h, eo), logits;
  // row strides 256-byte aligned.
  uint64_t bs_e = 0, bs_w = 0, bs_gu = 0, bs_h = 0, bs_eo = 0;
  float* bx = nullptr;
  float* bxn = nullptr;
  float* bw = nullptr;
  float* bgu = nullptr;
  float* bh = nullptr;
  float* beo = nullptr;
  float* bpad = nullptr;  // run_uses: a partial launch's filler outputs ([2k][ff] + [k][n_embd])
  float* d_blogits = nullptr;  // [sequences][n_vocab]
  float* h_blogits = nullptr;
  // glm4moe and gpt-oss (host routing): each row's router logits copied back (as h_probs, rows
  // bs_rl floats apart) and its routing weights on their way to bw ([sequences][k]), pinned.
  uint64_t bs_rl = 0;
  float* h_brl = nullptr;
  float* h_bw = nullptr;
  std::vector<uint32_t> bsel;      // [row][k] the step's routes at the current layer
  gpu::StepExperts step_experts;   // batch_moe's grouping of the step's routes by expert
  std::vector<ExpertHint> bhints;  // the step's hints at the current layer, every row's
  // decode_batch: route_and_hint() adds a row's candidates to the planner and leaves the rest
  // (take, send, routed()) to the step, so an expert several rows want is hinted once, scored by
  // all of them (HintPlanner: 1 - prod(1 - p)).
  bool batch_hints = false;
  std::vector<size_t> brec;  // [row] its routing record's index in routing_log, or SIZE_MAX

  // Per-layer scratch on the host.
  std::vector<uint32_t> selected;
  std::vector<float> weights;
  std::vector<ExpertPtrs> ptrs;
  std::vector<ExpertHint> last_hints;  // this layer's hints, for the VRAM prefetch
  gpu::HostRouter router;              // glm4moe's and gpt-oss's routing decisions and hints

  Impl(const DenseModel& m, ExpertSource& s, const EngineOptions& o, const GpuOptions& g)
      : model(m),
        source(s),
        p(m.params()),
        opts(o),
        gpu(g),
        planner(m.params(), o),
        router(m.params(), m.params().sigmoid_moe, opts) {
    if (p.router == RouterKind::Sigmoid) {
      for (uint32_t l = 0; l < p.n_layer; ++l) router.bias.emplace_back(m.layer(l).exp_bias);
    }
  }
  ~Impl();

  Status init();
  Status init_batch();
  Status decode_batch(std::span<const BatchRow> rows, std::span<float> logits);
  // decode()'s single-row buffers (x, xn, d_weights, gu, h, eo) and sequence pointed at row i's.
  void use_row(uint32_t i, uint32_t sequence) {
    select(sequence);
    x = bx + i * bs_e;
    xn = bxn + i * bs_e;
    d_weights = bw + i * bs_w;
    gu = bgu + i * bs_gu;
    h = bh + i * bs_h;
    eo = beo + i * bs_eo;
  }
  // The routed experts of every row at `layer` (bsel), each distinct one acquired once.
  Status batch_moe(uint32_t layer, uint32_t rows);
  // decode_batch()'s layer for glm4moe and gpt-oss: each row's attention and host routing, every
  // row's hints in one message, the routed experts by batch_moe, each row's FFN finished as
  // decode() finishes it.
  Status batch_host_layer(uint32_t layer, std::span<const BatchRow> rows);
  void select(uint32_t s) {
    seq_pos[seq] = pos;
    seq = s;
    pos = seq_pos[s];
    kv_seq = uint64_t{s} * p.n_layer * opts.max_context * p.n_head_kv * p.head_dim;
  }
  Status upload_dense();
  Status init_prefill();
  Status init_layerwise_prefill();
  // The output norm and head on `x` into `logits` (n_vocab), after a sync that gives the holds
  // back: the end of decode() and of the last prefill chunk.
  Status head(std::span<float> logits);
  // Sizes `chunk` (options.prefill_chunk capped at the context, halved until bytes_for(chunk) fits
  // half the free device memory) and allocates chunk_mem; chunk_asked, chunk_bytes follow.
  Status alloc_chunk_scratch(const std::function<uint64_t(uint64_t)>& bytes_for);
  Status prefill_layerwise(std::span<const uint32_t> tokens, std::span<float> logits);
  Status layerwise_layers(uint32_t n);
  // attention() for rows [0, n) of the layer-by-layer chunk (cx) at positions pos0..: the QKV
  // and output projections as GEMMs over the rows, the rest with decode()'s kernels row by row.
  Status rows_attention(uint32_t layer, uint32_t pos0, uint32_t n);
  // attention()'s middle for one position `at`: q (then k and v) as the QKV projection wrote
  // them, biased, normed and roped in place, k and v into the cache, the attention into out.
  Status attend(uint32_t layer, uint32_t at, float* q, float* out);
  uint64_t prefill_scratch_bytes(uint32_t rows) const;
  Status prefill_chunk(std::span<const uint32_t> tokens, bool last, std::span<float> logits);
  Status chunk_attention(uint32_t layer, uint32_t rows);
  Status chunk_moe(uint32_t layer, uint32_t rows);
  Status gemm(const float* w, uint32_t out_cols, uint32_t in_cols, const float* in, uint32_t rows,
              float* out, float beta);
  Status attention(uint32_t layer);
  Status route_and_hint(uint32_t layer);
  // Hints at most `budget` of the experts layer `next` will route the chunk's rows to (chunk_moe,
  // before this layer's experts compute). Overwrites rows_scratch.xe, crl, d_routes and h_routes.
  Status hint_next_layer(uint32_t next, uint32_t rows, uint64_t budget);
  // The chunk's rows of cx through `layer`'s FFN norm (into `normed`) and router: each row's top-k
  // experts then weights in d_routes, the first `words` of them copied to h_routes, synchronised.
  Status route_rows(uint32_t layer, uint32_t rows, float* normed, uint64_t words);
  Status moe(uint32_t layer);
  // decode()'s routed experts of one row: `chosen` (k) acquired and run (run_uses) on xn into gu,
  // h and eo; the caller combines them and finishes the layer.
  Status row_experts(uint32_t layer, std::span<const uint32_t> chosen);
  // One routed expert applied to one row: its weights, the row's normalised input, and where its
  // gate, up, SwiGLU and output go; `expert` is its index in the layer (gpt-oss's biases).
  struct ExpertUse {
    ExpertPtrs w;
    const float* x;
    float* gate;
    float* up;
    float* h;
    float* out;
    uint32_t expert = 0;
  };
  std::vector<ExpertUse> uses;
  Status run_uses(uint32_t layer, std::span<const ExpertUse> list);
  Status upload_sigmoid_moe();
  // glm4moe and gpt-oss: the router logits (this layer's and the lookahead's) copied back, the
  // routing and hints made on the host (HostRouter) as CpuEngine makes them.
  Status host_route(uint32_t layer);
  // host_route()'s device half for the row at x: the FFN norm into xn, the layer's router and the
  // lookahead's into rlogits, copied to `out` (pinned, [1 + depth][n_expert]) when the layer's
  // routing or hints need them (*copied set; the caller then synchronises before reading them).
  Status host_logits(uint32_t layer, float* out, bool* copied);
  // The host's routing weights (router.weights) to the device at `dev` through pinned `host`.
  Status weights_to_device(float* host, float* dev);
  // glm4moe and gpt-oss, after host_route: the dense MLP (glm4moe's leading layers), or the routed
  // experts (run_uses) then host_combine, into x.
  Status host_ffn(uint32_t layer);
  // The routed experts' outputs (eo) weighted by d_weights into x: gpt-oss's moe_combine, or
  // glm4moe's sum with its shared expert on xn.
  Status host_combine(uint32_t layer);
  Status gemv(const float* w, uint32_t rows, uint32_t cols, const float* in, float* out,
              float beta);
  uint64_t kv_index(uint32_t layer, uint32_t p_) const {
    return kv_seq + (uint64_t{layer} * opts.max_context + p_) * p.n_head_kv * p.head_dim;
  }
  uint32_t lookahead(uint32_t layer) const {
    if (opts.hints != HintSource::Router || opts.prefetch_depth == 0) return 0;
    return std::min(opts.prefetch_depth, p.n_layer - 1 - layer);
  }
};

GpuEngine::Impl::~Impl() {
  // The streams' work reads the held experts' bytes and every buffer: it must be done before a
  // hold is given back (by the experts' owner) or an owner goes. A failed sync is ignored: a
  // destructor cannot report it, and it fails only on a sticky error, after which the device runs
  // nothing more. The owners then go in member order (see the CUDA resources above).
  if (compute.valid()) (void)cudaStreamSynchronize(compute.get());
  if (copy.valid()) (void)cudaStreamSynchronize(copy.get());
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
  if (p.n_expert > 1024 || p.n_expert_used > 64) {
    return make_error(EINVAL, fmt::format("the GPU engine routes at most top-64 of 1024 experts; "
                                          "the model has top-{} of {}",
                                          p.n_expert_used, p.n_expert));
  }
  const bool glm = p.router == RouterKind::Sigmoid;  // SigmoidMoe's dense layers, shared experts
  if (host_routed(p) && 2 * p.n_expert_used > kernels::kMaxBatch) {
    return make_error(EINVAL, fmt::format("the GPU engine runs {} with at most top-{} experts; "
                                          "the model has top-{}",
                                          p.architecture, kernels::kMaxBatch / 2, p.n_expert_used));
  }
  EXPERTD_TRY(upload_dense());
  uint64_t mlp_ff = 0;  // the widest dense MLP or shared expert
  if (glm) {
    EXPERTD_TRY(upload_sigmoid_moe());
    for (const DevLayer& l : layers) {
      mlp_ff = std::max<uint64_t>({mlp_ff, l.moe.ffn_gate.rows, l.moe.shexp_gate.rows});
    }
  }

  // Activations, KV cache and the routing buffers.
  const uint32_t k = p.n_expert_used;
  const uint32_t d = opts.prefetch_depth;
  const uint64_t q_dim = uint64_t{p.n_head} * p.head_dim;
  const uint64_t kv_dim = uint64_t{p.n_head_kv} * p.head_dim;
  const uint64_t kv_values = uint64_t{opts.sequences} * p.n_layer * opts.max_context * kv_dim;
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
      {reinterpret_cast<void**>(&sg), mlp_ff * 4},
      {reinterpret_cast<void**>(&su), mlp_ff * 4},
      {reinterpret_cast<void**>(&sout), glm ? uint64_t{p.n_embd} * 4 : 0},
      {reinterpret_cast<void**>(&mout), glm ? uint64_t{p.n_embd} * 4 : 0},
  };
  uint64_t total = 0;
  for (const Part& part : parts) total += align_up(part.bytes, kAlign);
  Result<DeviceBytes> work = DeviceBytes::alloc(total);
  if (!work) {
    return make_error(ENOMEM,
                      fmt::format("cannot allocate {} of device memory for the KV cache "
                                  "({} positions x {} sequences) and activations on {}",
                                  gib(total), opts.max_context, opts.sequences, device_name));
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

  // Before the tier: Tier::Auto sizes itself from what is left. glm4moe's and gpt-oss's prefill
  // runs layer by layer over the chunk: the rows' buffers, the grouped experts' scratch and
  // rows_attention's.
  EXPERTD_TRY(host_routed(p) ? init_layerwise_prefill() : init_prefill());
  seq_pos.assign(opts.sequences, 0);
  if (opts.sequences > 1) EXPERTD_TRY(init_batch());

  // The source's host memory (registered once) and the VRAM tier.
  experts = std::make_unique<GpuExperts>(model, source, gpu, stats, compute.get(), copy.get());
  EXPERTD_TRY(experts->init(device_name));

  for (uint32_t l = 0; l < p.n_layer; ++l) {
    if (glm && !p.dense_layer(l) && !experts->shape(l).present) {
      return make_error(EINVAL, fmt::format("{}: layer {} has no routed experts", model.path(), l));
    }
  }
  selected.resize(k);
  weights.resize(k);
  ptrs.resize(k);
  return Ok{};
}

Status GpuEngine::Impl::upload_sigmoid_moe() {
  std::vector<uint8_t> scratch;
  uint64_t bytes = 0;
  EXPERTD_TRY_ASSIGN(
      moe_mem, gpu::carve_device(
                   [&](Carver& c) -> Status {
                     for (uint32_t l = 0; l < p.n_layer; ++l) {
                       EXPERTD_TRY(gpu::carve_sigmoid_moe(c, model, p.sigmoid_moe, l,
                                                          model.layer(l), layers[l].moe, scratch));
                     }
                     return Ok{};
                   },
                   [&](uint64_t n) {
                     bytes = std::max(n, kAlign);
                     return gpu::alloc_dense(bytes, "as in the file", model.path(), device_name);
                   }));
  dense_device_bytes += bytes;
  return Ok{};
}

Status GpuEngine::Impl::upload_dense() {
  const uint64_t q_dim = uint64_t{p.n_head} * p.head_dim;
  const uint64_t kv_dim = uint64_t{p.n_head_kv} * p.head_dim;
  const uint64_t e = p.n_embd;
  const bool tied = &model.output() == &model.token_embd();
  uint64_t layer_bytes = 0;
  for (uint32_t l = 0; l < p.n_layer; ++l) {
    layer_bytes += align_up((q_dim + 2 * kv_dim) * e * 4, kAlign) +
                   align_up(e * q_dim * 4, kAlign) + 2 * align_up(e * 4, kAlign) +
                   (p.qk_norm ? 2 * align_up(uint64_t{p.head_dim} * 4, kAlign) : 0) +
                   (has_qkv_bias(model.layer(l)) ? align_up((q_dim + 2 * kv_dim) * 4, kAlign) : 0) +
                   (p.dense_layer(l) ? 0 : align_up(uint64_t{p.n_expert} * e * 4, kAlign));
    const LayerWeights& w = model.layer(l);
    layer_bytes += vec_bytes(w.bo) + vec_bytes(w.gate_inp_b) + vec_bytes(w.sinks) +
                   vec_bytes(w.exp_gate_b) + vec_bytes(w.exp_up_b) + vec_bytes(w.exp_down_b);
  }
  std::vector<double> freqs;
  if (p.yarn.factor > 0.0) {
    // gpt-oss's config says truncate: false (the GGUF has no key for it), as CpuEngine.
    freqs = rope_inv_freq(p.n_rot, p.rope_base, p.yarn, /*truncate=*/false);
    mscale = yarn_mscale(p.yarn.factor);
    layer_bytes += align_up(freqs.size() * 8, kAlign);
  }
  const uint64_t table = align_up(uint64_t{p.n_vocab} * e * 4, kAlign);
  dense_device_bytes = layer_bytes + table * (tied ? 1 : 2) + align_up(e * 4, kAlign);
  EXPERTD_TRY_ASSIGN(dense_mem,
                     gpu::alloc_dense(dense_device_bytes, "as f32", model.path(), device_name));
  uint8_t* cursor = dense_mem.get();
  auto take = [&](uint64_t bytes) {
    float* out = reinterpret_cast<float*>(cursor);
    cursor += align_up(bytes, kAlign);
    return out;
  };
  std::vector<float> host;
  std::vector<uint8_t> scratch;
  // Dequantises `m` (rows x cols) into host[offset_rows...] as f32. A deferred model's matrices are
  // read from the file one at a time (DenseLoad::Deferred).
  auto dequant_into = [&](const Matrix& m, uint64_t first_row) -> Status {
    EXPERTD_TRY(dequant_check(m.type, m.cols));
    EXPERTD_TRY_ASSIGN(const std::span<const uint8_t> bytes, m.data(scratch));
    for (uint64_t r = 0; r < m.rows; ++r) {
      dequantize_row(m.type, bytes.data() + r * m.row_bytes, host.data() + (first_row + r) * m.cols,
                     m.cols);
    }
    return Ok{};
  };
  auto upload = [&](float* dst, const float* src, uint64_t count) -> Status {
    EXPERTD_CUDA_TRY(cudaMemcpy(dst, src, count * 4, cudaMemcpyHostToDevice));
    return Ok{};
  };
  // A non-empty vector into its own f32 buffer (dst stays nullptr for an empty one).
  auto upload_vec = [&](const std::vector<float>& v, float*& dst) -> Status {
    if (v.empty()) return Ok{};
    dst = take(v.size() * 4);
    return upload(dst, v.data(), v.size());
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
    if (p.qk_norm) {
      d.q_norm = take(uint64_t{p.head_dim} * 4);
      EXPERTD_TRY(upload(d.q_norm, w.q_norm.data(), p.head_dim));
      d.k_norm = take(uint64_t{p.head_dim} * 4);
      EXPERTD_TRY(upload(d.k_norm, w.k_norm.data(), p.head_dim));
    }
    if (has_qkv_bias(w)) {
      // One vector beside wqkv's rows, zeros for a projection without one (adding 0 is exact).
      d.bqkv = take((q_dim + 2 * kv_dim) * 4);
      host.assign(q_dim + 2 * kv_dim, 0.0f);
      const std::pair<const std::vector<float>*, uint64_t> parts[] = {
          {&w.bq, 0}, {&w.bk, q_dim}, {&w.bv, q_dim + kv_dim}};
      for (const auto& [b, at] : parts) {
        const uint64_t want = at == 0 ? q_dim : kv_dim;
        if (!b->empty() && b->size() != want) {
          return make_error(EINVAL, fmt::format("{}: layer {}: a q/k/v bias of {} values, the "
                                                "projection has {} rows",
                                                model.path(), l, b->size(), want));
        }
        std::copy(b->begin(), b->end(), host.begin() + static_cast<int64_t>(at));
      }
      EXPERTD_TRY(upload(d.bqkv, host.data(), host.size()));
    }
    EXPERTD_TRY(upload_vec(w.bo, d.bo));
    EXPERTD_TRY(upload_vec(w.gate_inp_b, d.router_b));
    EXPERTD_TRY(upload_vec(w.sinks, d.sinks));
    EXPERTD_TRY(upload_vec(w.exp_gate_b, d.exp_gate_b));
    EXPERTD_TRY(upload_vec(w.exp_up_b, d.exp_up_b));
    EXPERTD_TRY(upload_vec(w.exp_down_b, d.exp_down_b));
    if (p.dense_layer(l)) continue;  // no router
    d.router = take(uint64_t{p.n_expert} * e * 4);
    EXPERTD_TRY(upload_matrix(w.gate_inp, d.router));
  }
  if (!freqs.empty()) {
    inv_freq = reinterpret_cast<double*>(take(freqs.size() * 8));
    EXPERTD_CUDA_TRY(cudaMemcpy(inv_freq, freqs.data(), freqs.size() * 8, cudaMemcpyHostToDevice));
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
  EXPERTD_CUDA_TRY(kernels::rms_norm(x, w.attn_norm, xn, 1, p.n_embd, p.rms_eps, compute.get()));
  EXPERTD_TRY(gemv(w.wqkv, static_cast<uint32_t>(q_dim + 2 * kv_dim), p.n_embd, xn, qkv, 0.0f));
  EXPERTD_TRY(attend(layer, pos, qkv, att));
  // x += Wo att (beta = 1 accumulates into the residual stream), then gpt-oss's output bias.
  EXPERTD_TRY(gemv(w.wo, p.n_embd, static_cast<uint32_t>(q_dim), att, x, 1.0f));
  if (w.bo != nullptr) EXPERTD_CUDA_TRY(kernels::add(x, w.bo, p.n_embd, compute.get()));
  return Ok{};
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
  // Everything launched before (the previous layer's experts among it) has finished.
  EXPERTD_TRY(experts->sync_compute());

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
  }
  if (opts.prefetch_depth > 0 && !batch_hints) {
    const std::span<const ExpertHint> hints = planner.take(stats);
    last_hints.assign(hints.begin(), hints.end());
    if (!hints.empty() && !experts->hint_source().prefetch(hints)) ++stats.hint_errors;
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
  if (batch_hints) {
    brec.push_back(rec != nullptr ? routing_log->size() - 1 : SIZE_MAX);
    return Ok{};  // the step takes the hints and counts the routes (decode_batch)
  }
  planner.routed(layer, selected, stats, rec);
  return Ok{};
}

Status GpuEngine::Impl::run_uses(uint32_t layer, std::span<const ExpertUse> list) {
  // gate and up of every use, SwiGLU, down. Each use's result depends only on its own weights and
  // input, and on the launch's shape: matvec_batched plans a split-K launch by the jobs in it
  // (kernels/matvec_quant.cu: too many rows per CTA take the plain kernel, which sums a row in
  // another order). So every launch has decode()'s shape -- k uses, gate and up together as 2k
  // jobs, down as k -- a last, partial one filled with repeats of its first use that write into
  // bpad: decode() (one row's k uses) and decode_batch() (every row's) compute a row's experts to
  // the same bits. glm4moe and gpt-oss: the launches gpu::run_experts makes for one row's k
  // experts (its unclamped ds4_swiglu, or gpt-oss's biases and clamped SwiGLU).
  const GpuExperts::LayerShape& sh = experts->shape(layer);
  if (!sh.present) return make_error(EINVAL, fmt::format("layer {} has no routed experts", layer));
  const cudaStream_t st = compute.get();
  const DevLayer& l = layers[layer];
  const uint32_t ff = p.n_ff_exp;
  const uint32_t e = p.n_embd;
  const uint32_t k = p.n_expert_used;
  const uint32_t n = static_cast<uint32_t>(list.size());
  const bool host = host_routed(p);
  const bool oai = p.act == ExpertAct::ClampedSwiglu;
  if (n % k != 0 && bpad == nullptr) {
    return make_error(
        EINVAL, fmt::format("layer {}: {} expert uses, not whole launches of {}", layer, n, k));
  }
  if (sh.gate.type == sh.up.type && sh.gate.row_bytes == sh.up.row_bytes &&
      2 * k <= kernels::kMaxBatch) {
    for (uint32_t first = 0; first < n; first += k) {
      kernels::MatvecBatch b;
      const uint32_t real = std::min(k, n - first);
      b.count = 2 * k;
      for (uint32_t j = 0; j < k; ++j) {
        const ExpertUse& u = list[first + (j < real ? j : 0)];
        b.w[j] = u.w.gate;
        b.x[j] = u.x;
        b.y[j] = j < real ? u.gate : bpad + uint64_t{j} * ff;
        b.w[k + j] = u.w.up;
        b.x[k + j] = u.x;
        b.y[k + j] = j < real ? u.up : bpad + uint64_t{k + j} * ff;
      }
      EXPERTD_CUDA_TRY(kernels::matvec_batched(sh.gate.type, b, sh.gate.row_bytes, ff, e, st));
    }
  } else {
    for (const ExpertUse& u : list) {
      EXPERTD_CUDA_TRY(
          kernels::matvec(sh.gate.type, u.w.gate, sh.gate.row_bytes, ff, e, u.x, u.gate, st));
      EXPERTD_CUDA_TRY(kernels::matvec(sh.up.type, u.w.up, sh.up.row_bytes, ff, e, u.x, u.up, st));
    }
  }
  // qwen3moe, Mixtral: SwiGLU inside the down projection's launch (MatvecBatch::up,
  // bit-identical) when kernels::matvec_fuse_swiglu() says so; else its own launch into h.
  const bool fuse = !host && kernels::matvec_fuse_swiglu();
  if (oai) {
    // gpt-oss: each expert's biased, clamped SwiGLU (run_experts' OaiExperts).
    for (const ExpertUse& u : list) {
      const uint64_t at = uint64_t{u.expert} * ff;
      EXPERTD_CUDA_TRY(kernels::oai_swiglu(u.gate, u.up, l.exp_gate_b + at, l.exp_up_b + at, u.h,
                                           ff, kGptOssAlpha, kGptOssLimit, st));
    }
  } else if (host) {
    // glm4moe: run_experts' unclamped ds4_swiglu, elementwise, one launch per run of uses whose
    // gate, up and h follow the previous use's (decode()'s k uses are one run: its one launch).
    for (uint32_t a = 0; a < n;) {
      uint32_t z = a + 1;
      while (z < n && list[z].gate == list[z - 1].gate + ff && list[z].up == list[z - 1].up + ff &&
             list[z].h == list[z - 1].h + ff) {
        ++z;
      }
      EXPERTD_CUDA_TRY(
          kernels::ds4_swiglu(list[a].gate, list[a].up, list[a].h, uint64_t{z - a} * ff, 0.0f, st));
      a = z;
    }
  } else if (!fuse) {
    for (const ExpertUse& u : list) EXPERTD_CUDA_TRY(kernels::swiglu(u.gate, u.up, u.h, ff, st));
  }
  for (uint32_t first = 0; first < n; first += k) {
    kernels::MatvecBatch b;
    const uint32_t real = std::min(k, n - first);
    b.count = k;
    for (uint32_t j = 0; j < k; ++j) {
      const ExpertUse& u = list[first + (j < real ? j : 0)];
      b.w[j] = u.w.down;
      if (fuse) {
        b.x[j] = u.gate;
        b.up[j] = u.up;
      } else {
        b.x[j] = u.h;
      }
      b.y[j] = j < real ? u.out : bpad + 2 * uint64_t{k} * ff + uint64_t{j} * e;
    }
    EXPERTD_CUDA_TRY(kernels::matvec_batched(sh.down.type, b, sh.down.row_bytes, e, ff, st));
  }
  // gpt-oss: the down projection's bias, after it (run_experts').
  for (uint32_t i = 0; oai && i < n; ++i) {
    EXPERTD_CUDA_TRY(kernels::add(list[i].out, l.exp_down_b + uint64_t{list[i].expert} * e, e, st));
  }
  return Ok{};
}

Status GpuEngine::Impl::row_experts(uint32_t layer, std::span<const uint32_t> chosen) {
  const uint32_t k = p.n_expert_used;
  uint64_t waited = 0;
  EXPERTD_TRY(experts->acquire(layer, chosen, ptrs, &waited));
  stats.experts_used += k;
  // gu [2k][n_ff] (gates, then ups), h [k][n_ff], eo [k][n_embd], as run_experts lays them out.
  const uint64_t ff = p.n_ff_exp;
  uses.resize(k);
  for (uint32_t i = 0; i < k; ++i) {
    uses[i] = ExpertUse{ptrs[i],           xn,         gu + i * ff,
                        gu + (k + i) * ff, h + i * ff, eo + uint64_t{i} * p.n_embd,
                        chosen[i]};
  }
  return run_uses(layer, uses);
}

Status GpuEngine::Impl::moe(uint32_t layer) {
  EXPERTD_TRY(row_experts(layer, selected));
  EXPERTD_CUDA_TRY(
      kernels::moe_combine(eo, d_weights, x, p.n_expert_used, p.n_embd, compute.get()));
  return experts->finish_layer();
}

Status GpuEngine::Impl::host_logits(uint32_t layer, float* out, bool* copied) {
  const cudaStream_t st = compute.get();
  const uint32_t ne = p.n_expert;
  const uint32_t e = p.n_embd;
  EXPERTD_CUDA_TRY(kernels::rms_norm(x, layers[layer].ffn_norm, xn, 1, e, p.rms_eps, st));
  // The routers on the device (f32 GEMVs): this layer's, and the lookahead layers' on the same
  // residual through their own norms, as CpuEngine::send_hints applies them.
  if (router.computes(pos, layer)) {
    EXPERTD_TRY(gemv(layers[layer].router, ne, e, xn, rlogits, 0.0f));
    if (layers[layer].router_b != nullptr) {
      EXPERTD_CUDA_TRY(kernels::add(rlogits, layers[layer].router_b, ne, st));
    }
  }
  uint32_t rows = 1;
  for (uint32_t j = 1; j <= opts.prefetch_depth; ++j) {
    if (!router.looks_ahead(layer, j)) continue;
    float* in = pxn + uint64_t{j - 1} * e;
    const DevLayer& next = layers[layer + j];
    EXPERTD_CUDA_TRY(kernels::rms_norm(x, next.ffn_norm, in, 1, e, p.rms_eps, st));
    EXPERTD_TRY(gemv(next.router, ne, e, in, rlogits + uint64_t{j} * ne, 0.0f));
    if (next.router_b != nullptr) {
      EXPERTD_CUDA_TRY(kernels::add(rlogits + uint64_t{j} * ne, next.router_b, ne, st));
    }
    rows = j + 1;
  }
  // MoE layers always copy (and their caller syncs), scripted or not: it is where the previous
  // layer's holds go back.
  *copied = !p.dense_layer(layer) || rows > 1;
  if (*copied) {
    EXPERTD_CUDA_TRY(
        cudaMemcpyAsync(out, rlogits, uint64_t{rows} * ne * 4, cudaMemcpyDeviceToHost, st));
  }
  return Ok{};
}

Status GpuEngine::Impl::weights_to_device(float* host, float* dev) {
  const uint64_t k = p.n_expert_used;
  std::memcpy(host, router.weights.data(), k * 4);
  EXPERTD_CUDA_TRY(cudaMemcpyAsync(dev, host, k * 4, cudaMemcpyHostToDevice, compute.get()));
  return Ok{};
}

Status GpuEngine::Impl::host_route(uint32_t layer) {
  // h_probs is the pinned mirror of the logits ([1 + depth][n_expert]).
  bool copied = false;
  EXPERTD_TRY(host_logits(layer, h_probs, &copied));
  if (copied) EXPERTD_TRY(experts->sync_compute());
  // Hints and the routing decision, as CpuEngine makes them.
  router.route(pos, layer, h_probs, planner, stats, experts->hint_source(), routing_log);
  if (p.dense_layer(layer)) return Ok{};
  return weights_to_device(h_weights, d_weights);
}

Status GpuEngine::Impl::host_ffn(uint32_t layer) {
  const cudaStream_t st = compute.get();
  if (p.dense_layer(layer)) {
    // glm4moe's leading dense layers: the MLP as in the file.
    const gpu::DevSigmoidMoe& m = layers[layer].moe;
    EXPERTD_TRY(gpu::run_mlp(m.ffn_gate, m.ffn_up, m.ffn_down, xn, sg, su, sout, st));
    EXPERTD_CUDA_TRY(kernels::add(x, sout, p.n_embd, st));
    return Ok{};
  }
  EXPERTD_TRY(
      row_experts(layer, std::span<const uint32_t>(router.selected.data(), p.n_expert_used)));
  EXPERTD_TRY(experts->finish_layer());
  return host_combine(layer);
}

Status GpuEngine::Impl::host_combine(uint32_t layer) {
  const cudaStream_t st = compute.get();
  const uint32_t k = p.n_expert_used;
  if (p.act == ExpertAct::ClampedSwiglu) {
    // gpt-oss: x += the experts' outputs weighted (double sum, one rounding), as CpuEngine::moe.
    EXPERTD_CUDA_TRY(kernels::moe_combine(eo, d_weights, x, k, p.n_embd, st));
    return Ok{};
  }
  // glm4moe: x += the weighted routed sum plus the shared expert, as CpuEngine::moe adds them
  // (gpu::run_sigmoid_moe's sum).
  const gpu::DevSigmoidMoe& m = layers[layer].moe;
  const bool shared = m.shexp_gate.rows > 0;
  if (shared) {
    EXPERTD_TRY(gpu::run_mlp(m.shexp_gate, m.shexp_up, m.shexp_down, xn, sg, su, sout, st));
  }
  EXPERTD_CUDA_TRY(
      kernels::ds4_moe_sum(eo, d_weights, k, shared ? sout : nullptr, p.n_embd, mout, st));
  EXPERTD_CUDA_TRY(kernels::add(x, mout, p.n_embd, st));
  return Ok{};
}

// --- prefill, layer by layer (glm4moe, gpt-oss) ------------------------------------------------

Status GpuEngine::Impl::head(std::span<float> logits) {
  const cudaStream_t st = compute.get();
  EXPERTD_CUDA_TRY(kernels::rms_norm(x, output_norm, xn, 1, p.n_embd, p.rms_eps, st));
  EXPERTD_TRY(gemv(output, p.n_vocab, p.n_embd, xn, d_logits, 0.0f));
  return experts->logits_to_host(d_logits, h_logits, logits.first(p.n_vocab));
}

Status GpuEngine::Impl::init_layerwise_prefill() {
  const uint64_t k = p.n_expert_used;
  // Rows 256-byte aligned, as decode()'s single-row buffers are (cuBLAS reads and writes them).
  ce = align_up(p.n_embd, 64);
  cne = align_up(p.n_expert, 64);
  // Each row's router logits, then the lookahead layers' (route_chunk's `ahead`).
  crs = uint64_t{1 + opts.prefetch_depth} * cne;
  // The routed experts run grouped by expert over the chunk (run_experts_by_rows): their scratch
  // and every route slot's output.
  auto grouped_floats = [&](uint64_t c) {
    return gpu::RowsScratch::device_floats(p, c) + c * k * p.n_embd +
           gpu::RowsScratch::host_words(p, c);
  };
  // rows_attention's rows, for chunks that run it.
  lqs = align_up(uint64_t{p.n_head + 2 * p.n_head_kv} * p.head_dim, 64);
  las = align_up(uint64_t{p.n_head} * p.head_dim, 64);
  auto attention_floats = [&](uint64_t c) {
    return c >= gpu::kDenseGemmRows ? c * (lqs + las) : 0;
  };
  EXPERTD_TRY(alloc_chunk_scratch([&](uint64_t c) {
    return (c * ce * 2 + c * crs + c * k + grouped_floats(c) + attention_floats(c)) * 4 +
           14 * kAlign;
  }));
  const uint64_t c = chunk;
  uint8_t* cursor = chunk_mem.get();
  auto take = [&](uint64_t values) {
    uint8_t* out = cursor;
    cursor += align_up(values * 4, kAlign);
    return reinterpret_cast<float*>(out);
  };
  cx = take(c * ce);
  cxn = take(c * ce);
  crl = take(c * crs);
  crw = take(c * k);
  const uint64_t index_words = gpu::RowsScratch::host_words(p, c);
  ceo = take(c * k * p.n_embd);
  rows_scratch.xe = take(c * p.n_embd);
  rows_scratch.hg = take(c * p.n_ff_exp);
  rows_scratch.hu = take(c * p.n_ff_exp);
  rows_scratch.down = take(c * p.n_embd);
  rows_scratch.w = take(uint64_t{p.n_ff_exp} * p.n_embd);
  rows_scratch.d_index = reinterpret_cast<uint32_t*>(take(index_words));
  rows_scratch.groups.reserve(p.n_expert, c * k);
  if (c >= gpu::kDenseGemmRows) {
    lqkv = take(c * lqs);
    latt = take(c * las);
  }
  EXPERTD_TRY_ASSIGN(chunk_host, PinnedBytes::alloc((c * crs + c * k + index_words) * 4));
  h_crl = chunk_host.get<float>();
  h_crw = h_crl + c * crs;
  rows_scratch.h_index = reinterpret_cast<uint32_t*>(h_crw + c * k);
  csel.resize(c * k);
  cneeded.resize(p.n_expert);
  needed_hints.reserve(p.n_expert);
  return Ok{};
}

Status GpuEngine::Impl::prefill_layerwise(std::span<const uint32_t> tokens,
                                          std::span<float> logits) {
  const auto n = static_cast<uint32_t>(tokens.size());
  const uint64_t e = p.n_embd;
  const cudaStream_t st = compute.get();
  for (uint32_t i = 0; i < n; ++i) {
    EXPERTD_CUDA_TRY(cudaMemcpyAsync(cx + i * ce, embd + uint64_t{tokens[i]} * e, e * 4,
                                     cudaMemcpyDeviceToDevice, st));
  }
  const size_t logged = routing_log != nullptr ? routing_log->size() : 0;
  planner.begin_token();  // the planner dedups its hints over the chunk
  const uint32_t pos0 = pos;
  // attention(), the FFNs and the head work on `x`, `xn` and `pos`: pointed at each row in turn.
  float* const x_decode = x;
  float* const xn_decode = xn;
  Status done = layerwise_layers(n);
  if (done && !logits.empty()) {
    // decode()'s head on the last row.
    x = cx + uint64_t{n - 1} * ce;
    done = head(logits);
    if (done) done = experts->account_copy_time();
  }
  x = x_decode;
  xn = xn_decode;
  return end_prefill_chunk(std::move(done), routing_log, logged, n, pos0, pos, stats);
}

Status GpuEngine::Impl::attend(uint32_t layer, uint32_t at, float* q, float* out) {
  const DevLayer& w = layers[layer];
  const cudaStream_t st = compute.get();
  const uint32_t hd = p.head_dim;
  const uint64_t q_dim = uint64_t{p.n_head} * hd;
  const uint64_t kv_dim = uint64_t{p.n_head_kv} * hd;
  float* k = q + q_dim;
  float* v = k + kv_dim;
  if (w.bqkv != nullptr) {
    EXPERTD_CUDA_TRY(kernels::add(q, w.bqkv, static_cast<uint32_t>(q_dim + 2 * kv_dim), st));
  }
  if (p.qk_norm) {
    EXPERTD_CUDA_TRY(kernels::rms_norm(q, w.q_norm, q, p.n_head, hd, p.rms_eps, st));
    EXPERTD_CUDA_TRY(kernels::rms_norm(k, w.k_norm, k, p.n_head_kv, hd, p.rms_eps, st));
  }
  if (inv_freq != nullptr) {
    EXPERTD_CUDA_TRY(kernels::rope_neox_freqs(q, p.n_head, hd, p.n_rot, at, inv_freq, mscale, st));
    EXPERTD_CUDA_TRY(
        kernels::rope_neox_freqs(k, p.n_head_kv, hd, p.n_rot, at, inv_freq, mscale, st));
  } else {
    EXPERTD_CUDA_TRY(rope(p, q, p.n_head, at, st));
    EXPERTD_CUDA_TRY(rope(p, k, p.n_head_kv, at, st));
  }
  EXPERTD_CUDA_TRY(
      cudaMemcpyAsync(k_cache + kv_index(layer, at), k, kv_dim * 4, cudaMemcpyDeviceToDevice, st));
  EXPERTD_CUDA_TRY(
      cudaMemcpyAsync(v_cache + kv_index(layer, at), v, kv_dim * 4, cudaMemcpyDeviceToDevice, st));
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  // gpt-oss: a sliding layer sees its last swa_window positions, as CpuEngine::attend.
  const uint32_t first = p.sliding(layer) && at >= p.swa_window ? at + 1 - p.swa_window : 0;
  EXPERTD_CUDA_TRY(kernels::decode_attention(q, k_cache + kv_index(layer, 0),
                                             v_cache + kv_index(layer, 0), out, p.n_head,
                                             p.n_head_kv, hd, at + 1, scale, st, first, w.sinks));
  return Ok{};
}

Status GpuEngine::Impl::rows_attention(uint32_t layer, uint32_t pos0, uint32_t n) {
  const DevLayer& w = layers[layer];
  const cudaStream_t st = compute.get();
  const uint32_t hd = p.head_dim;
  const uint64_t q_dim = uint64_t{p.n_head} * hd;
  const uint64_t qkv_dim = q_dim + 2 * uint64_t{p.n_head_kv} * hd;
  for (uint32_t i = 0; i < n; ++i) {
    EXPERTD_CUDA_TRY(
        kernels::rms_norm(cx + i * ce, w.attn_norm, cxn + i * ce, 1, p.n_embd, p.rms_eps, st));
  }
  // The dense weights are f32 on the device: GEMMs on them as they are.
  const gpu::DevMat wqkv{GgmlType::F32, reinterpret_cast<const uint8_t*>(w.wqkv),
                         static_cast<uint32_t>(qkv_dim), p.n_embd, uint64_t{p.n_embd} * 4};
  EXPERTD_TRY(gpu::dense_rows(blas.get(), wqkv, cxn, ce, n, lqkv, lqs, nullptr, 0, st));
  // Row by row: row i's K and V go into the cache before it attends (the rows after it are not
  // read: causal).
  for (uint32_t i = 0; i < n; ++i) {
    EXPERTD_TRY(attend(layer, pos0 + i, lqkv + i * lqs, latt + i * las));
  }
  const gpu::DevMat wo{GgmlType::F32, reinterpret_cast<const uint8_t*>(w.wo), p.n_embd,
                       static_cast<uint32_t>(q_dim), q_dim * 4};
  // x += att Wo^T (beta = 1 accumulates into the residual streams, as decode()'s gemv), then
  // gpt-oss's output bias.
  EXPERTD_TRY(gpu::dense_rows(blas.get(), wo, latt, las, n, cx, ce, nullptr, 0, st, 1.0f));
  for (uint32_t i = 0; w.bo != nullptr && i < n; ++i) {
    EXPERTD_CUDA_TRY(kernels::add(cx + i * ce, w.bo, p.n_embd, st));
  }
  return Ok{};
}

Status GpuEngine::Impl::layerwise_layers(uint32_t n) {
  const uint32_t k = p.n_expert_used;
  const uint32_t ne = p.n_expert;
  const cudaStream_t st = compute.get();
  const uint32_t pos0 = pos;
  float* const xn_scratch = xn;
  // The daemon's cursor as the chunked prefill keeps it: the chunk's last position, each layer
  // named once its exact hints are out (route_chunk), so they target this pass.
  const uint32_t last = pos0 + n - 1;
  start_prefill_cursor(source, last, p.n_layer, stats);
  for (uint32_t layer = 0; layer < p.n_layer; ++layer) {
    const DevLayer& l = layers[layer];
    const bool dense = p.dense_layer(layer);
    // The chunk's attention: its projections as GEMMs over the rows (rows_attention) or each
    // position's attention() (it attends to the rows before it, written just now). Then each
    // row's FFN norm and its dense MLP or router, with decode()'s kernels in decode()'s order.
    const bool batched = n >= gpu::kDenseGemmRows && lqkv != nullptr;
    if (batched) EXPERTD_TRY(rows_attention(layer, pos0, n));
    for (uint32_t i = 0; i < n; ++i) {
      x = cx + i * ce;
      xn = xn_scratch;
      pos = pos0 + i;
      float* rn = cxn + i * ce;
      if (!batched) EXPERTD_TRY(attention(layer));
      EXPERTD_CUDA_TRY(kernels::rms_norm(x, l.ffn_norm, rn, 1, p.n_embd, p.rms_eps, st));
      if (dense) {
        EXPERTD_TRY(
            gpu::run_mlp(l.moe.ffn_gate, l.moe.ffn_up, l.moe.ffn_down, rn, sg, su, sout, st));
        EXPERTD_CUDA_TRY(kernels::add(x, sout, p.n_embd, st));
      } else {
        float* rl = crl + uint64_t{i} * crs;
        if (router.computes(pos, layer)) {
          EXPERTD_TRY(gemv(l.router, ne, p.n_embd, rn, rl, 0.0f));
          if (l.router_b != nullptr) EXPERTD_CUDA_TRY(kernels::add(rl, l.router_b, ne, st));
        }
        // The lookahead routers on this row's residual, as decode's route_and_hint runs them.
        for (uint32_t j = 1; j <= opts.prefetch_depth; ++j) {
          if (!router.looks_ahead(layer, j)) continue;
          const DevLayer& next = layers[layer + j];
          float* out = rl + uint64_t{j} * cne;
          EXPERTD_CUDA_TRY(kernels::rms_norm(x, next.ffn_norm, pxn, 1, p.n_embd, p.rms_eps, st));
          EXPERTD_TRY(gemv(next.router, ne, p.n_embd, pxn, out, 0.0f));
          if (next.router_b != nullptr) EXPERTD_CUDA_TRY(kernels::add(out, next.router_b, ne, st));
        }
      }
    }
    planner.from_layer(layer);
    if (dense) {
      planner.routed(layer, {}, stats, nullptr);  // routes nothing: closes the layer's hints
      if (!source.set_cursor(last, layer)) ++stats.hint_errors;
      continue;
    }
    // Every row's routing: one copy back, one sync, then decided on the host as decode() does.
    EXPERTD_CUDA_TRY(
        cudaMemcpyAsync(h_crl, crl, uint64_t{n} * crs * 4, cudaMemcpyDeviceToHost, st));
    EXPERTD_TRY(experts->sync_compute());
    const uint64_t budget = experts->hint_budget();
    EXPERTD_TRY(router.route_chunk(
        pos0, layer, n, h_crl, crs, opts.prefetch_depth > 0 ? cne : 0, budget, planner, stats,
        experts->hint_source(), routing_log, std::span<uint32_t>(csel.data(), uint64_t{n} * k),
        std::span<float>(h_crw, uint64_t{n} * k), cneeded, needed_hints));
    gpu::RowsHints hints{needed_hints, std::min<uint64_t>(needed_hints.size(), budget), budget};
    if (!source.set_cursor(last, layer)) ++stats.hint_errors;
    EXPERTD_CUDA_TRY(cudaMemcpyAsync(crw, h_crw, uint64_t{n} * k * 4, cudaMemcpyHostToDevice, st));
    if (p.act != ExpertAct::ClampedSwiglu) {
      // glm_ffn over the rows: the routed experts grouped by expert, each applied to all its rows
      // as GEMMs; then each row's shared expert and its weighted sum.
      EXPERTD_TRY(gpu::run_sigmoid_moe_rows(
          *experts, blas.get(), layer, n, std::span<const uint32_t>(csel.data(), uint64_t{n} * k),
          crw, l.moe, p, cxn, cx, ce, ptrs, rows_scratch, ceo,
          gpu::SigmoidMoeScratch{gu, h, eo, sg, su, sout}, mout, stats, st, &hints));
      continue;
    }
    // gptoss_ffn over the rows: the routed experts grouped by expert, each applied to all its rows
    // as GEMMs with its biases and clamped SwiGLU; then each row's weighted sum, as decode()'s.
    const gpu::OaiExperts oai{l.exp_gate_b, l.exp_up_b, l.exp_down_b, {}};
    EXPERTD_TRY(gpu::run_experts_by_rows(*experts, blas.get(), layer, n,
                                         std::span<const uint32_t>(csel.data(), uint64_t{n} * k),
                                         cxn, ce, ptrs, p, rows_scratch, ceo, stats, st,
                                         gpu::RowsOptions{.oai = &oai, .hints = &hints}));
    for (uint32_t i = 0; i < n; ++i) {
      EXPERTD_CUDA_TRY(kernels::moe_combine(ceo + uint64_t{i} * k * p.n_embd, crw + uint64_t{i} * k,
                                            cx + i * ce, k, p.n_embd, st));
    }
  }
  pos = pos0;
  xn = xn_scratch;
  return Ok{};
}

// --- prefill -----------------------------------------------------------------------------------

uint64_t GpuEngine::Impl::prefill_scratch_bytes(uint32_t rows) const {
  const uint64_t c = rows;
  const uint64_t k = p.n_expert_used;
  const uint64_t e = p.n_embd;
  const uint64_t q_dim = uint64_t{p.n_head} * p.head_dim;
  const uint64_t floats =
      c * e * 2 + c * q_dim * 2 + c * opts.max_context + c * p.n_expert + c * k * 2 + (c * k + c) +
      c * k * e + gpu::RowsScratch::device_floats(p, c) + gpu::RowsScratch::host_words(p, c);
  const uint64_t bf16 = gpu.prefill_gemm == GpuOptions::PrefillGemm::Bf16
                            ? gpu::RowsScratch::bf16_values(p, c) * 2
                            : 0;
  return floats * 4 + bf16 + 18 * kAlign;  // 17 buffers, each aligned
}

Status GpuEngine::Impl::alloc_chunk_scratch(const std::function<uint64_t(uint64_t)>& bytes_for) {
  chunk_asked = std::max(1u, std::min(opts.prefill_chunk, opts.max_context));
  chunk = chunk_asked;
  size_t free_b = 0;
  size_t total_b = 0;
  EXPERTD_CUDA_TRY(cudaMemGetInfo(&free_b, &total_b));
  // At most half of what is free (256 MiB kept back): the rest is the VRAM tier's. A chunk that
  // does not fit is halved rather than refused: prefill is only slower for it.
  const uint64_t reserve = uint64_t{256} << 20;
  const uint64_t budget = free_b > reserve ? (free_b - reserve) / 2 : 0;
  while (chunk > 1 && bytes_for(chunk) > budget) chunk = (chunk + 1) / 2;
  chunk_bytes = bytes_for(chunk);
  Result<DeviceBytes> mem = DeviceBytes::alloc(chunk_bytes);
  if (!mem) {
    return make_error(ENOMEM,
                      fmt::format("cannot allocate {} ({} bytes) of device memory for the "
                                  "prefill scratch of {} positions on {}; {} is free",
                                  gib(chunk_bytes), chunk_bytes, chunk, device_name, gib(free_b)));
  }
  chunk_mem = std::move(*mem);
  return Ok{};
}

Status GpuEngine::Impl::init_prefill() {
  EXPERTD_TRY(alloc_chunk_scratch(
      [&](uint64_t c) { return prefill_scratch_bytes(static_cast<uint32_t>(c)); }));
  const uint64_t c = chunk;
  const uint64_t k = p.n_expert_used;
  const uint64_t e = p.n_embd;
  const uint64_t q_dim = uint64_t{p.n_head} * p.head_dim;
  const uint64_t ff = p.n_ff_exp;
  uint8_t* cursor = chunk_mem.get();
  auto take = [&](uint64_t values) {
    uint8_t* out = cursor;
    cursor += align_up(values * 4, kAlign);
    return out;
  };
  cx = reinterpret_cast<float*>(take(c * e));
  cxn = reinterpret_cast<float*>(take(c * e));
  cq = reinterpret_cast<float*>(take(c * q_dim));
  catt = reinterpret_cast<float*>(take(c * q_dim));
  cscores = reinterpret_cast<float*>(take(c * opts.max_context));
  crl = reinterpret_cast<float*>(take(c * p.n_expert));
  d_routes = reinterpret_cast<uint32_t*>(take(c * k * 2));
  d_rows = reinterpret_cast<uint32_t*>(take(c * k + c));
  ceo = reinterpret_cast<float*>(take(c * k * e));
  const uint64_t index_words = gpu::RowsScratch::host_words(p, c);
  rows_scratch.xe = reinterpret_cast<float*>(take(c * e));
  rows_scratch.hg = reinterpret_cast<float*>(take(c * ff));
  rows_scratch.hu = reinterpret_cast<float*>(take(c * ff));
  rows_scratch.down = reinterpret_cast<float*>(take(c * e));
  rows_scratch.w = reinterpret_cast<float*>(take(ff * e));
  rows_scratch.d_index = reinterpret_cast<uint32_t*>(take(index_words));
  if (gpu.prefill_gemm == GpuOptions::PrefillGemm::Bf16) {
    rows_scratch.xeh = reinterpret_cast<__nv_bfloat16*>(take((c * e + 1) / 2));
    rows_scratch.hgh = reinterpret_cast<__nv_bfloat16*>(take((c * ff + 1) / 2));
  }
  rows_scratch.groups.reserve(p.n_expert, c * k);
  EXPERTD_TRY_ASSIGN(chunk_host, PinnedBytes::alloc((c * k * 2 + c * k + c + index_words) * 4));
  h_routes = chunk_host.get<uint32_t>();
  h_rows = h_routes + c * k * 2;
  rows_scratch.h_index = h_rows + c * k + c;
  csel.resize(c * k);
  expert_rows.resize(p.n_expert);
  needed_hints.reserve(p.n_expert);
  next_counts.reserve(p.n_expert);
  next_rows.resize(p.n_expert);
  next_hints.reserve(p.n_expert);
  return Ok{};
}

Status GpuEngine::Impl::route_rows(uint32_t layer, uint32_t rows, float* normed, uint64_t words) {
  const uint64_t rk = uint64_t{rows} * p.n_expert_used;
  EXPERTD_CUDA_TRY(kernels::rms_norm(cx, layers[layer].ffn_norm, normed, rows, p.n_embd, p.rms_eps,
                                     compute.get()));
  EXPERTD_TRY(gemm(layers[layer].router, p.n_expert, p.n_embd, normed, rows, crl, 0.0f));
  EXPERTD_CUDA_TRY(kernels::router_topk(crl, rows, p.n_expert, p.n_expert_used, p.norm_topk,
                                        d_routes, reinterpret_cast<float*>(d_routes + rk), nullptr,
                                        compute.get()));
  EXPERTD_CUDA_TRY(
      cudaMemcpyAsync(h_routes, d_routes, words * 4, cudaMemcpyDeviceToHost, compute.get()));
  EXPERTD_CUDA_TRY(gpu::timed_sync(compute.get(), stats));
  return Ok{};
}

Status GpuEngine::Impl::hint_next_layer(uint32_t next, uint32_t rows, uint64_t budget) {
  // decode's lookahead over the chunk: the next layer's router on this layer's residual through
  // the next layer's norm, each row's top-k; the distinct experts, those most rows want first.
  const uint64_t rk = uint64_t{rows} * p.n_expert_used;
  EXPERTD_TRY(route_rows(next, rows, rows_scratch.xe, rk));
  std::fill(next_rows.begin(), next_rows.end(), 0u);
  for (uint64_t i = 0; i < rk; ++i) {
    if (h_routes[i] < p.n_expert) ++next_rows[h_routes[i]];
  }
  next_counts.clear();
  for (uint32_t ex = 0; ex < p.n_expert; ++ex) {
    if (next_rows[ex] > 0) next_counts.emplace_back(next_rows[ex], ex);
  }
  std::stable_sort(next_counts.begin(), next_counts.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  const uint64_t send = std::min<uint64_t>(next_counts.size(), budget);
  stats.prefill_hints_held += next_counts.size() - send;
  if (send == 0) return Ok{};
  next_hints.clear();
  for (uint64_t i = 0; i < send; ++i) {
    next_hints.push_back(ExpertHint{next, next_counts[i].second, 0.5f});
  }
  if (!experts->hint_source().prefetch(next_hints)) ++stats.hint_errors;
  stats.prefill_lookahead_hints += send;
  return Ok{};
}

Status GpuEngine::Impl::gemm(const float* w, uint32_t out_cols, uint32_t in_cols, const float* in,
                             uint32_t rows, float* out, float beta) {
  return gpu::sgemm_rows(blas.get(), w, out_cols, in_cols, in, rows, out, beta);
}

Status GpuEngine::Impl::chunk_attention(uint32_t layer, uint32_t rows) {
  const DevLayer& w = layers[layer];
  const uint32_t hd = p.head_dim;
  const uint32_t q_dim = p.n_head * hd;
  const uint32_t kv_dim = p.n_head_kv * hd;
  const uint64_t e = p.n_embd;
  const uint32_t pos0 = pos;
  const uint32_t n_ctx = pos0 + rows;
  // K and V of the chunk go straight into the cache at its positions ([pos][kv_dim] rows).
  float* kc = k_cache + kv_index(layer, pos0);
  float* vc = v_cache + kv_index(layer, pos0);
  EXPERTD_CUDA_TRY(
      kernels::rms_norm(cx, w.attn_norm, cxn, rows, p.n_embd, p.rms_eps, compute.get()));
  EXPERTD_TRY(gemm(w.wqkv, q_dim, p.n_embd, cxn, rows, cq, 0.0f));
  EXPERTD_TRY(gemm(w.wqkv + uint64_t{q_dim} * e, kv_dim, p.n_embd, cxn, rows, kc, 0.0f));
  EXPERTD_TRY(gemm(w.wqkv + uint64_t{q_dim + kv_dim} * e, kv_dim, p.n_embd, cxn, rows, vc, 0.0f));
  if (p.qk_norm) {
    EXPERTD_CUDA_TRY(
        kernels::rms_norm(cq, w.q_norm, cq, rows * p.n_head, hd, p.rms_eps, compute.get()));
    EXPERTD_CUDA_TRY(
        kernels::rms_norm(kc, w.k_norm, kc, rows * p.n_head_kv, hd, p.rms_eps, compute.get()));
  }
  EXPERTD_CUDA_TRY(rope_rows(p, cq, rows, p.n_head, pos0, compute.get()));
  EXPERTD_CUDA_TRY(rope_rows(p, kc, rows, p.n_head_kv, pos0, compute.get()));
  // Per query head: scores[row][t] = q_row . k_t * scale over the cache's positions 0..n_ctx-1
  // (column-major: S^T[n_ctx x rows] = K^T-as-stored^T Q^T), the causal softmax, then
  // att[row][head] = P V.
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  const float one = 1.0f;
  const float zero = 0.0f;
  const uint32_t group = p.n_head / p.n_head_kv;
  const float* k_layer = k_cache + kv_index(layer, 0);
  const float* v_layer = v_cache + kv_index(layer, 0);
  for (uint32_t head = 0; head < p.n_head; ++head) {
    const uint64_t kv_off = uint64_t{head / group} * hd;
    EXPERTD_CUBLAS_TRY(cublasSgemm(blas.get(), CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n_ctx),
                                   static_cast<int>(rows), static_cast<int>(hd), &scale,
                                   k_layer + kv_off, static_cast<int>(kv_dim),
                                   cq + uint64_t{head} * hd, static_cast<int>(q_dim), &zero,
                                   cscores, static_cast<int>(n_ctx)));
    EXPERTD_CUDA_TRY(kernels::causal_softmax(cscores, rows, n_ctx, pos0, compute.get()));
    EXPERTD_CUBLAS_TRY(cublasSgemm(
        blas.get(), CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(hd), static_cast<int>(rows),
        static_cast<int>(n_ctx), &one, v_layer + kv_off, static_cast<int>(kv_dim), cscores,
        static_cast<int>(n_ctx), &zero, catt + uint64_t{head} * hd, static_cast<int>(q_dim)));
  }
  // x += att Wo^T (beta = 1 accumulates into the residual streams).
  return gemm(w.wo, p.n_embd, q_dim, catt, rows, cx, 1.0f);
}

Status GpuEngine::Impl::chunk_moe(uint32_t layer, uint32_t rows) {
  const uint32_t k = p.n_expert_used;
  const uint64_t rk = uint64_t{rows} * k;
  const uint32_t pos0 = pos;
  // The chunk's routes (experts and weights): one copy, one sync per layer.
  EXPERTD_TRY(route_rows(layer, rows, cxn, rk * 2));
  EXPERTD_TRY(experts->synced());

  // The decisions (the script's where it has one), counted per expert; the log and the hint
  // statistics per position, as decode() keeps them.
  uint32_t* sel_all = h_routes;
  float* w_all = reinterpret_cast<float*>(h_routes + rk);
  float* up_w = reinterpret_cast<float*>(h_rows);
  std::fill(expert_rows.begin(), expert_rows.end(), 0u);
  for (uint32_t r = 0; r < rows; ++r) {
    const std::span<uint32_t> sel(sel_all + uint64_t{r} * k, k);
    const std::span<float> wts(w_all + uint64_t{r} * k, k);
    if (!take_scripted_route(opts, pos0 + r, layer, sel, wts, stats)) {
      for (const uint32_t ex : sel) {
        if (ex >= p.n_expert) {
          return make_error(EIO, fmt::format("layer {} position {}: the router kernel chose "
                                             "expert {} of {}",
                                             layer, pos0 + r, ex, p.n_expert));
        }
      }
    }
    std::copy(wts.begin(), wts.end(), up_w + uint64_t{r} * k);
    // Kept apart from h_routes, which the next layer's lookahead overwrites.
    std::copy(sel.begin(), sel.end(), csel.begin() + uint64_t{r} * k);
    for (const uint32_t ex : sel) ++expert_rows[ex];
    RoutingRecord* rec = nullptr;
    if (routing_log != nullptr) {
      rec = &chunk_log[uint64_t{r} * p.n_layer + layer];
      *rec = RoutingRecord{pos0 + r,
                           layer,
                           std::vector<uint32_t>(sel.begin(), sel.end()),
                           std::vector<float>(wts.begin(), wts.end()),
                           {}};
    }
    planner.routed(layer, sel, stats, rec);
  }
  // The layer's distinct experts, ascending (as run_experts_by_rows acquires them).
  needed_hints.clear();
  for (uint32_t ex = 0; ex < p.n_expert; ++ex) {
    if (expert_rows[ex] > 0) needed_hints.push_back(ExpertHint{layer, ex, 1.0f, true});
  }
  EXPERTD_CUDA_TRY(cudaMemcpyAsync(d_rows, h_rows, rk * 4, cudaMemcpyHostToDevice, compute.get()));
  // Every expert the layer needs is asked for at once, so the daemon reads them in parallel
  // while the first ones compute: as many as the daemon's slots keep until their acquire, the
  // rest as the groups' acquires free room (run_experts_by_rows). Then, with room left, the next
  // layer's.
  const uint64_t budget = experts->hint_budget();
  gpu::RowsHints hints{needed_hints, 0, budget};
  experts->hint_within(needed_hints, 0, budget, hints.sent, stats);
  stats.prefill_hints_held += needed_hints.size() - hints.sent;
  if (layer + 1 < p.n_layer && lookahead(layer) > 0 && !p.dense_layer(layer + 1) &&
      budget > needed_hints.size()) {
    EXPERTD_TRY(hint_next_layer(layer + 1, rows, budget - needed_hints.size()));
  }
  if (!source.set_cursor(pos0 + rows - 1, layer)) ++stats.hint_errors;

  // Acquired at most top-k at a time (what a daemon cache sized for decode can hold), each
  // applied to all its rows as GEMMs, the holds given back once their kernels are done.
  EXPERTD_TRY(gpu::run_experts_by_rows(
      *experts, blas.get(), layer, rows, std::span<const uint32_t>(csel.data(), rk), cxn, p.n_embd,
      ptrs, p, rows_scratch, ceo, stats, compute.get(),
      gpu::RowsOptions{.bf16 = gpu.prefill_gemm == GpuOptions::PrefillGemm::Bf16,
                       .hints = &hints}));
  stats.prefill_experts += needed_hints.size();
  EXPERTD_CUDA_TRY(kernels::moe_combine_rows(ceo, reinterpret_cast<const float*>(d_rows), cx, rows,
                                             k, p.n_embd, compute.get()));
  return Ok{};
}

Status GpuEngine::Impl::prefill_chunk(std::span<const uint32_t> tokens, bool last,
                                      std::span<float> logits) {
  const uint32_t rows = static_cast<uint32_t>(tokens.size());
  const uint64_t ck = uint64_t{chunk} * p.n_expert_used;
  // The tokens sit after the row lists' room, so the layers' uploads never overwrite them.
  uint32_t* h_tokens = h_rows + ck;
  uint32_t* d_tokens = d_rows + ck;
  std::copy(tokens.begin(), tokens.end(), h_tokens);
  EXPERTD_CUDA_TRY(cudaMemcpyAsync(d_tokens, h_tokens, uint64_t{rows} * 4, cudaMemcpyHostToDevice,
                                   compute.get()));
  EXPERTD_CUDA_TRY(kernels::gather_rows(embd, d_tokens, rows, p.n_embd, cx, compute.get()));
  planner.begin_token();
  if (routing_log != nullptr) chunk_log.assign(uint64_t{rows} * p.n_layer, RoutingRecord{});
  // The chunk is one pass over the layers (as CpuEngine's): the daemon's cursor names the chunk's
  // last position and starts before layer 0; chunk_moe moves it to each layer once the layer's
  // exact hints are out, so they target this pass (a hint for the cursor's own layer is for the
  // next token, beyond any prefetch depth, and the daemon would not read it ahead).
  start_prefill_cursor(source, pos + rows - 1, p.n_layer, stats);
  for (uint32_t layer = 0; layer < p.n_layer; ++layer) {
    EXPERTD_TRY(chunk_attention(layer, rows));
    EXPERTD_TRY(chunk_moe(layer, rows));
  }
  if (last) {
    EXPERTD_CUDA_TRY(kernels::rms_norm(cx + uint64_t{rows - 1} * p.n_embd, output_norm, xn, 1,
                                       p.n_embd, p.rms_eps, compute.get()));
    EXPERTD_TRY(gemv(output, p.n_vocab, p.n_embd, xn, d_logits, 0.0f));
    EXPERTD_CUDA_TRY(cudaMemcpyAsync(h_logits, d_logits, uint64_t{p.n_vocab} * 4,
                                     cudaMemcpyDeviceToHost, compute.get()));
  }
  EXPERTD_CUDA_TRY(gpu::timed_sync(compute.get(), stats));
  if (last) std::memcpy(logits.data(), h_logits, uint64_t{p.n_vocab} * 4);
  if (routing_log != nullptr) {
    for (RoutingRecord& rec : chunk_log) routing_log->push_back(std::move(rec));
  }
  pos += rows;
  stats.tokens += rows;
  stats.prefill_tokens += rows;
  ++stats.prefill_chunks;
  return Ok{};
}

// --- decode_batch: one step of several sequences ------------------------------------------------

Status GpuEngine::Impl::init_batch() {
  const uint64_t S = opts.sequences;
  const uint64_t k = p.n_expert_used;
  const uint64_t ff = p.n_ff_exp;
  bs_e = align_up(p.n_embd, 64);
  bs_w = align_up(uint64_t{1 + opts.prefetch_depth} * k, 64);
  bs_gu = align_up(2 * k * ff, 64);
  bs_h = align_up(k * ff, 64);
  bs_eo = align_up(k * p.n_embd, 64);
  const uint64_t vocab = align_up(p.n_vocab, 64);
  // The rows' buffers, and bpad: a partial launch's filler outputs (run_uses).
  const uint64_t floats = S * (2 * bs_e + bs_w + bs_gu + bs_h + bs_eo + vocab) + bs_gu + bs_eo;
  // Host routing: each row's logits as host_logits copies them, and its k routing weights.
  bs_rl = host_routed(p) ? uint64_t{1 + opts.prefetch_depth} * p.n_expert : 0;
  const uint64_t host_floats = S * (p.n_vocab + bs_rl + (host_routed(p) ? k : 0));
  Result<DeviceBytes> mem = DeviceBytes::alloc(floats * 4);
  if (!mem) {
    return make_error(ENOMEM, fmt::format("cannot allocate {} of device memory for the rows of {} "
                                          "sequences on {}",
                                          gib(floats * 4), S, device_name));
  }
  batch_mem = std::move(*mem);
  float* at = reinterpret_cast<float*>(batch_mem.get());
  auto take = [&](uint64_t n) {
    float* out = at;
    at += n;
    return out;
  };
  bx = take(S * bs_e);
  bxn = take(S * bs_e);
  bw = take(S * bs_w);
  bgu = take(S * bs_gu);
  bh = take(S * bs_h);
  beo = take(S * bs_eo);
  bpad = take(bs_gu + bs_eo);  // 64-float aligned, as the rows' buffers
  d_blogits = take(S * p.n_vocab);
  EXPERTD_TRY_ASSIGN(batch_host, PinnedBytes::alloc(host_floats * 4));
  h_blogits = batch_host.get<float>();
  if (host_routed(p)) {
    h_brl = h_blogits + S * p.n_vocab;
    h_bw = h_brl + S * bs_rl;
  }
  bsel.resize(S * k);
  step_experts.reserve(p.n_expert, S * k);
  return Ok{};
}

Status GpuEngine::Impl::decode_batch(std::span<const BatchRow> rows, std::span<float> logits) {
  const uint32_t n = static_cast<uint32_t>(rows.size());
  const uint32_t k = p.n_expert_used;
  const uint64_t e = p.n_embd;
  const uint64_t v = p.n_vocab;
  const cudaStream_t st = compute.get();
  seq_pos[seq] = pos;
  EXPERTD_TRY(
      check_batch_room(rows, opts.max_context, [&](uint32_t s) -> uint32_t { return seq_pos[s]; }));
  const uint64_t t0 = monotonic_ns();
  // decode()'s single-row buffers point at each row's in turn (use_row); put back whatever
  // happens.
  const uint32_t was = seq;
  float* const x0 = x;
  float* const xn0 = xn;
  float* const w0 = d_weights;
  float* const gu0 = gu;
  float* const h0 = h;
  float* const eo0 = eo;
  auto forward = [&]() -> Status {
    uint32_t last = 0;
    for (uint32_t i = 0; i < n; ++i) {
      last = std::max(last, seq_pos[rows[i].sequence]);
      EXPERTD_CUDA_TRY(cudaMemcpyAsync(bx + i * bs_e, embd + uint64_t{rows[i].token} * e, e * 4,
                                       cudaMemcpyDeviceToDevice, st));
    }
    planner.begin_token();  // one step: each (layer, expert) hinted once for all the rows
    for (uint32_t layer = 0; layer < p.n_layer; ++layer) {
      if (!source.set_cursor(last, layer)) ++stats.hint_errors;
      if (host_routed(p)) {
        EXPERTD_TRY(batch_host_layer(layer, rows));
        continue;
      }
      brec.clear();
      for (uint32_t i = 0; i < n; ++i) {
        use_row(i, rows[i].sequence);
        EXPERTD_TRY(attention(layer));
        EXPERTD_TRY(route_and_hint(layer));
        std::copy(selected.begin(), selected.end(), bsel.begin() + uint64_t{i} * k);
      }
      // Every row's candidates, once each, scored by all the rows: one message to the daemon.
      bhints.clear();
      if (opts.prefetch_depth > 0) {
        const std::span<const ExpertHint> hints = planner.take(stats);
        bhints.assign(hints.begin(), hints.end());
        if (!hints.empty() && !experts->hint_source().prefetch(hints)) ++stats.hint_errors;
      }
      for (uint32_t i = 0; i < n; ++i) {
        const size_t r = brec[i];
        planner.routed(layer, std::span<const uint32_t>(bsel.data() + uint64_t{i} * k, k), stats,
                       r == SIZE_MAX ? nullptr : &(*routing_log)[r]);
      }
      EXPERTD_TRY(batch_moe(layer, n));
      for (uint32_t i = 0; i < n; ++i) {
        EXPERTD_CUDA_TRY(
            kernels::moe_combine(beo + i * bs_eo, bw + i * bs_w, bx + i * bs_e, k, p.n_embd, st));
      }
      EXPERTD_TRY(experts->prefetch(layer, opts.prefetch_depth, p.n_layer, bhints));
    }
    // decode()'s head for each row.
    for (uint32_t i = 0; i < n; ++i) {
      EXPERTD_CUDA_TRY(kernels::rms_norm(bx + i * bs_e, output_norm, bxn + i * bs_e, 1, p.n_embd,
                                         p.rms_eps, st));
      EXPERTD_TRY(gemv(output, p.n_vocab, p.n_embd, bxn + i * bs_e, d_blogits + i * v, 0.0f));
    }
    return experts->logits_to_host(d_blogits, h_blogits, logits.first(n * v));
  };
  batch_hints = true;
  const Status done = forward();
  batch_hints = false;
  x = x0;
  xn = xn0;
  d_weights = w0;
  gu = gu0;
  h = h0;
  eo = eo0;
  select(was);
  EXPERTD_TRY(done);
  experts->measure_tiers();
  for (const BatchRow& r : rows) ++seq_pos[r.sequence];
  pos = seq_pos[seq];
  count_batch_step(stats, n, t0);
  return Ok{};
}

Status GpuEngine::Impl::batch_host_layer(uint32_t layer, std::span<const BatchRow> rows) {
  const uint32_t n = static_cast<uint32_t>(rows.size());
  const uint32_t k = p.n_expert_used;
  const bool dense = p.dense_layer(layer);
  // Each row's attention and router logits, as decode()'s host_route computes them (its logits
  // into its own pinned rows: rlogits and pxn are reused row after row, in stream order), then
  // one sync for all the rows: where the previous layer's holds go back.
  bool copied = false;
  for (uint32_t i = 0; i < n; ++i) {
    use_row(i, rows[i].sequence);
    EXPERTD_TRY(attention(layer));
    EXPERTD_TRY(host_logits(layer, h_brl + i * bs_rl, &copied));
  }
  if (copied) EXPERTD_TRY(experts->sync_compute());
  // Every row's lookahead candidates, once each, scored by all the rows (HintPlanner): one
  // message to the daemon, as the Softmax step sends them.
  planner.from_layer(layer);
  for (uint32_t i = 0; i < n; ++i) {
    router.add_lookahead(seq_pos[rows[i].sequence], layer, h_brl + i * bs_rl, p.n_expert, planner);
  }
  const std::span<const ExpertHint> hints = planner.take(stats);
  bhints.assign(hints.begin(), hints.end());
  if (!hints.empty() && !experts->hint_source().prefetch(hints)) ++stats.hint_errors;
  if (dense) {
    // glm4moe's leading dense layers: routes nothing (this closes the layer's hints), then each
    // row's MLP as decode() runs it.
    planner.routed(layer, {}, stats, nullptr);
    for (uint32_t i = 0; i < n; ++i) {
      use_row(i, rows[i].sequence);
      EXPERTD_TRY(host_ffn(layer));
    }
  } else {
    // Each row's routing decision (logged and counted as decode()'s), its weights to the device.
    for (uint32_t i = 0; i < n; ++i) {
      const uint32_t at = seq_pos[rows[i].sequence];
      router.decide(at, layer, h_brl + i * bs_rl, planner, stats, routing_log);
      for (uint32_t j = 0; j < k; ++j) {
        const uint32_t ex = router.selected[j];
        if (ex >= p.n_expert) {
          return make_error(EIO, fmt::format("layer {} position {}: routed to expert {} of {}",
                                             layer, at, ex, p.n_expert));
        }
        bsel[uint64_t{i} * k + j] = ex;
      }
      EXPERTD_TRY(weights_to_device(h_bw + uint64_t{i} * k, bw + i * bs_w));
    }
    // The step's distinct experts, each acquired once, applied to every row routing to it with
    // decode()'s kernels (run_uses); then each row's sum as decode() makes it.
    EXPERTD_TRY(batch_moe(layer, n));
    for (uint32_t i = 0; i < n; ++i) {
      use_row(i, rows[i].sequence);
      EXPERTD_TRY(host_combine(layer));
    }
  }
  return experts->prefetch(layer, opts.prefetch_depth, p.n_layer, bhints);
}

Status GpuEngine::Impl::batch_moe(uint32_t layer, uint32_t rows) {
  const uint32_t k = p.n_expert_used;
  const uint64_t ff = p.n_ff_exp;
  // Each distinct expert of the step acquired once (gpu::StepExperts) and applied to every row
  // that routes to it with decode()'s kernels.
  return step_experts.run(
      *experts, layer, std::span<const uint32_t>(bsel.data(), uint64_t{rows} * k), k, ptrs, stats,
      [&](std::span<const uint32_t> group, std::span<const gpu::StepUse> list) {
        uses.clear();
        for (const gpu::StepUse& u : list) {
          float* gu_i = bgu + u.row * bs_gu;
          uses.push_back(ExpertUse{ptrs[u.expert], bxn + u.row * bs_e, gu_i + u.slot * ff,
                                   gu_i + (k + u.slot) * ff, bh + u.row * bs_h + u.slot * ff,
                                   beo + u.row * bs_eo + uint64_t{u.slot} * p.n_embd,
                                   group[u.expert]});
        }
        return run_uses(layer, uses);
      });
}

// --- GpuEngine ---------------------------------------------------------------------------------

GpuEngine::GpuEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GpuEngine::~GpuEngine() = default;

Result<std::unique_ptr<GpuEngine>> GpuEngine::create(const DenseModel& model, ExpertSource& source,
                                                     const EngineOptions& options,
                                                     const GpuOptions& gpu) {
  const ModelParams& p = model.params();
  const FamilyInfo& family = family_info(p.family);
  if (family.engine != EngineClass::Generic || !family.caps.cuda) {
    return make_error(ENOTSUP,
                      fmt::format("{}: GpuEngine runs {}, not '{}' (use create_gpu_engine)",
                                  model.path(), family_list([](const FamilyInfo& f) {
                                    return f.engine == EngineClass::Generic && f.caps.cuda;
                                  }),
                                  p.architecture));
  }
  if (p.act == ExpertAct::ClampedSwiglu) {
    for (uint32_t l = 0; l < p.n_layer; ++l) {
      const LayerWeights& w = model.layer(l);
      if (w.exp_gate_b.empty() || w.exp_up_b.empty() || w.exp_down_b.empty()) {
        return make_error(EINVAL, fmt::format("{}: {} layer {} lacks its expert biases",
                                              model.path(), model.params().architecture, l));
      }
    }
  }
  EXPERTD_TRY(check_engine_options(p, options, kMaxSequences));
  auto impl = std::make_unique<Impl>(model, source, options, gpu);
  EXPERTD_TRY(impl->init());
  return std::unique_ptr<GpuEngine>(new GpuEngine(std::move(impl)));
}

Result<std::unique_ptr<Engine>> create_gpu_engine(const DenseModel& model, ExpertSource& source,
                                                  const EngineOptions& options,
                                                  const GpuOptions& gpu) {
  const FamilyInfo& family = family_info(model.params().family);
  if (!family.caps.cuda) {
    return make_error(ENOTSUP,
                      fmt::format("{}: no CUDA engine runs '{}' (the CUDA engines run {}); "
                                  "use the CPU engine (--cpu)",
                                  model.path(), model.params().architecture,
                                  family_list([](const FamilyInfo& f) { return f.caps.cuda; })));
  }
  switch (family.engine) {
    case EngineClass::DeepSeek4: {
      EXPERTD_TRY_ASSIGN(std::unique_ptr<Ds4GpuEngine> e,
                         Ds4GpuEngine::create(model, source, options, gpu));
      return std::unique_ptr<Engine>(std::move(e));
    }
    case EngineClass::DeepSeek3: {
      EXPERTD_TRY_ASSIGN(std::unique_ptr<Ds3GpuEngine> e,
                         Ds3GpuEngine::create(model, source, options, gpu));
      return std::unique_ptr<Engine>(std::move(e));
    }
    case EngineClass::Generic:
      break;
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
    if (host_routed(p)) {
      EXPERTD_TRY(m.host_route(layer));
      EXPERTD_TRY(m.host_ffn(layer));
    } else {
      EXPERTD_TRY(m.route_and_hint(layer));
      EXPERTD_TRY(m.moe(layer));
    }
    const std::span<const ExpertHint> hinted =
        host_routed(p) ? std::span<const ExpertHint>(m.router.last_hints) : m.last_hints;
    EXPERTD_TRY(m.experts->prefetch(layer, m.opts.prefetch_depth, p.n_layer, hinted));
  }
  EXPERTD_TRY(m.head(logits));
  m.experts->measure_tiers();
  ++m.pos;
  ++m.stats.tokens;
  m.stats.decode_ns += monotonic_ns() - t0;
  return Ok{};
}

uint32_t GpuEngine::prefill_chunk_size() const { return impl_->chunk; }

Status GpuEngine::prefill_chunk(std::span<const uint32_t> tokens, std::span<float> logits) {
  // One pass over the layers: the tier keeps the residents of the layers it has not reached.
  const gpu::TierSweep sweep(*impl_->experts, tokens.size());
  // glm4moe and gpt-oss (biases, dense layers, host routing, shared expert, sinks, windows):
  // layer by layer over the chunk, the projections and experts as GEMMs over the rows, each
  // expert read once per chunk.
  if (host_routed(impl_->p)) return impl_->prefill_layerwise(tokens, logits);
  return impl_->prefill_chunk(tokens, !logits.empty(), logits);
}

uint32_t GpuEngine::sequences() const { return impl_->opts.sequences; }
uint32_t GpuEngine::selected_sequence() const { return impl_->seq; }

Status GpuEngine::select_sequence(uint32_t sequence) {
  EXPERTD_TRY(Engine::select_sequence(sequence));
  impl_->select(sequence);
  return Ok{};
}

Status GpuEngine::decode_batch(std::span<const BatchRow> rows, std::span<float> logits) {
  EXPERTD_TRY(check_batch(*this, rows, logits.size()));
  // An engine of one sequence has no rows' buffers: decode() is its step. Otherwise every family
  // runs the rows layer by layer, each distinct (layer, expert) of the step acquired once.
  if (impl_->bx == nullptr) return Engine::decode_batch(rows, logits);
  return impl_->decode_batch(rows, logits);
}

bool GpuEngine::truncate(uint32_t n) {
  // The KV cache is per position: the first n stay valid, the rest are overwritten as
  // fed again.
  if (n > impl_->pos) return false;
  impl_->pos = n;
  return true;
}

void GpuEngine::reset() { impl_->pos = 0; }
uint32_t GpuEngine::position() const { return impl_->pos; }
const EngineStats& GpuEngine::stats() const { return impl_->stats; }
EngineStats& GpuEngine::mutable_stats() { return impl_->stats; }
const ModelParams& GpuEngine::params() const { return impl_->p; }
const EngineOptions& GpuEngine::options() const { return impl_->opts; }
void GpuEngine::set_routing_log(std::vector<RoutingRecord>* log) { impl_->routing_log = log; }
uint32_t GpuEngine::vram_slots() const { return impl_->experts->slots(); }
uint64_t GpuEngine::vram_slot_bytes() const { return impl_->experts->slot_bytes(); }

std::string GpuEngine::description() const {
  const Impl& m = *impl_;
  const GpuExperts& x = *m.experts;
  const std::string tier = x.description();
  const std::string how =
      !host_routed(m.p) ? ""
      : m.lqkv != nullptr
          ? fmt::format(", layer by layer, the attention's projections as GEMMs from {} rows",
                        gpu::kDenseGemmRows)
          : ", layer by layer";
  const std::string prefill =
      m.chunk == m.chunk_asked
          ? fmt::format("prefill in chunks of {}{} ({} scratch)", m.chunk, how, gib(m.chunk_bytes))
          : fmt::format("prefill in chunks of {}{}, clamped from {} to fit its {} scratch", m.chunk,
                        how, m.chunk_asked, gib(m.chunk_bytes));
  const bool bf16 = m.gpu.prefill_gemm == GpuOptions::PrefillGemm::Bf16 && !host_routed(m.p);
  return fmt::format(
      "CUDA engine on {}: dense weights {} as f32 (cuBLAS){}, {}, {}{}{}", m.device_name,
      gib(m.dense_device_bytes),
      m.p.router == RouterKind::Sigmoid ? ", dense MLPs and shared experts as in the file" : "",
      tier, prefill, bf16 ? ", experts' GEMMs in bf16" : "",
      x.arena_registered() ? "" : "; arena not registered: pageable copies");
}

}  // namespace expertd::engine
