#include "engine/ds3_gpu_engine.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "base/clock.h"
#include "engine/ds3_cpu_engine.h"
#include "engine/gpu_experts.h"
#include "engine/routing.h"
#include "kernels/check.h"
#include "kernels/combine.cuh"
#include "kernels/cuda_raii.h"
#include "kernels/dequant.cuh"
#include "kernels/ds3.cuh"
#include "kernels/ds4.cuh"
#include "kernels/matvec.cuh"

namespace expertd::engine {
namespace {

using cuda::CublasHandle;
using cuda::CudaStream;
using cuda::DeviceBytes;
using cuda::PinnedBytes;
using gpu::Carver;
using gpu::DevMat;
using gpu::ExpertPtrs;
using gpu::gib;
using gpu::GpuExperts;

struct DevLayer {
  const float* attn_norm = nullptr;
  const float* q_a_norm = nullptr;
  const float* kv_a_norm = nullptr;
  const float* ffn_norm = nullptr;
  DevMat wq_a, wq_b, wq, wkv_a, wk_b, wv_b, wo;
  DevMat gate_inp;         // MoE layers
  gpu::DevSigmoidMoe moe;  // the dense MLP, or the shared experts
};

// The most floats a dense projection is dequantised into at once (64 MiB).
constexpr uint64_t kDenseTileFloats = uint64_t{16} << 20;

// The rows of matrix `head` of a stacked per-head matrix ([n_head * rows][cols]).
const uint8_t* head_rows(const DevMat& m, uint32_t head, uint32_t rows) {
  return m.data + uint64_t{head} * rows * m.row_bytes;
}

}  // namespace

struct Ds3GpuEngine::Impl {
  const DenseModel& model;
  ExpertSource& source;
  const ModelParams& p;
  const Ds3Params& d;
  const Ds3Weights& w;
  EngineOptions opts;
  GpuOptions gpu;
  HintPlanner planner;
  EngineStats stats;
  std::vector<RoutingRecord>* routing_log = nullptr;
  uint32_t pos = 0;  // the selected sequence's
  // Sequences (EngineOptions::sequences): each has its own latent and rope-key cache; `latent` and
  // `krope` below point at the selected one's (select()).
  uint32_t seq = 0;
  std::vector<uint32_t> seq_pos;
  std::string device_name;
  uint64_t dense_device_bytes = 0;
  double kq_scale = 1.0;

  // The CUDA resources, destroyed last to first after ~Impl's body synchronised both streams:
  // the experts' owner (gives back its holds, then its events, registration and tier memory),
  // the streams (nothing is enqueued on them), then the pinned mirrors and device memory.
  DeviceBytes dense_mem;   // the dense weights, as in the file
  DeviceBytes work_mem;    // the latent caches and activations (decode_batch()'s rows too)
  PinnedBytes host_mem;    // pinned mirrors of the router logits, the weights and the logits
  PinnedBytes batch_host;  // decode_batch()'s: each row's router logits, weights and logits
  CudaStream copy;
  CudaStream compute;
  CublasHandle blas;  // prefill's expert GEMMs (f32, CUBLAS_PEDANTIC_MATH)
  std::unique_ptr<GpuExperts> experts;

  // Dense weights.
  std::vector<DevLayer> layers;
  DevMat embd, output;
  const float* output_norm = nullptr;
  const double* freq = nullptr;  // n_rot / 2

  // Caches and activations.
  float* latent_all = nullptr;  // [sequence][layer][max_context][kv_lora_rank]
  float* krope_all = nullptr;   // [sequence][layer][max_context][n_rot]
  float* latent = nullptr;      // the selected sequence's [layer][max_context][kv_lora_rank]
  float* krope = nullptr;       // the selected sequence's [layer][max_context][n_rot]
  float* x = nullptr;           // residual, n_embd
  float* xn = nullptr;
  float* qa = nullptr;       // q_lora_rank
  float* q = nullptr;        // n_head * head_dim
  float* kva = nullptr;      // kv_lora_rank + n_rot
  float* qabs = nullptr;     // n_head * kv_lora_rank
  float* olat = nullptr;     // n_head * kv_lora_rank
  float* att = nullptr;      // n_head * v_head_dim
  double* scores = nullptr;  // [n_head][max_context]
  float* out = nullptr;
  float* pxn = nullptr;      // [depth][n_embd]
  float* rlogits = nullptr;  // [1 + depth][n_expert]
  float* d_weights = nullptr;
  float* gu = nullptr;  // [2k][n_ff]: gate outputs then up outputs
  float* hbuf = nullptr;
  float* eo = nullptr;  // [k][n_embd]
  float* sg = nullptr;  // dense MLP / shared experts: gate, up (the widest)
  float* su = nullptr;
  float* sout = nullptr;  // n_embd
  float* d_logits = nullptr;
  float* h_rlogits = nullptr;  // pinned mirrors
  float* h_weights = nullptr;
  float* h_logits = nullptr;
  // prefill(): `chunk` positions layer by layer (prefill_chunk).
  uint32_t chunk = 1;
  uint64_t ce = 0;         // row stride of cx and cxn: n_embd rounded up to 64 floats
  uint64_t cne = 0;        // n_expert rounded up to 64 floats
  uint64_t crs = 0;        // row stride of crl and h_crl: (1 + lookahead) * cne
  float* cx = nullptr;     // [chunk][ce] the chunk's residuals
  float* cxn = nullptr;    // [chunk][ce] their FFN-normed rows
  float* crl = nullptr;    // [chunk][crs] router logits, then the lookahead layers'
  float* cw = nullptr;     // [chunk][k] routing weights
  float* h_crl = nullptr;  // pinned mirrors
  float* h_cw = nullptr;
  float* ceo = nullptr;           // [chunk][k][n_embd] every route slot's expert output
  gpu::RowsScratch rows_scratch;  // the expert GEMMs over the chunk's rows (run_experts_by_rows)
  // chunk_attention(), for chunks of gpu::kDenseGemmRows or more: each row's normed input, query
  // latent, query, latent and rope key, attention output and projection, rows 64 floats aligned.
  struct {
    uint64_t e = 0, qa = 0, q = 0, kv = 0, v = 0;  // row strides
    float* xn = nullptr;
    float* qa_rows = nullptr;
    float* q_rows = nullptr;
    float* kv_rows = nullptr;
    float* att = nullptr;
    float* out = nullptr;
    float* tile = nullptr;  // a dense projection, dequantised (gpu::dense_rows)
    uint64_t tile_floats = 0;
  } ca;
  std::vector<uint32_t> csel;   // [chunk][k] the chunk's routes
  std::vector<uint8_t> needed;  // per expert: routed to by the chunk at this layer
  std::vector<ExpertHint> chunk_hints;
  // decode_batch() (sequences > 1; bx null otherwise): a row per sequence at most (S), each with
  // decode()'s per-row state in its own buffers, rows 256-byte aligned: the residual, the
  // normalised input (attention's, then the FFN's), the router logits ([1 + depth][n_expert], as
  // rlogits), the routing weights (k) and the routed experts' outputs ([k][n_embd], as eo), the
  // logits. bgate, bup, bh: one group of experts' uses (a row's route slot each, at most S * k),
  // gate and up outputs and their SwiGLU, n_ff_exp floats apart.
  uint64_t be = 0;    // row stride of bx and bxn: n_embd rounded up to 64 floats
  uint64_t brs = 0;   // of brl and h_brl: (1 + depth) * n_expert rounded up
  uint64_t bws = 0;   // of bw and h_bw: k rounded up
  uint64_t beos = 0;  // of beo: k * n_embd rounded up
  float* bx = nullptr;
  float* bxn = nullptr;
  float* brl = nullptr;
  float* bw = nullptr;
  float* beo = nullptr;
  float* bgate = nullptr;
  float* bup = nullptr;
  float* bh = nullptr;
  float* d_blogits = nullptr;  // [S][n_vocab]
  float* h_brl = nullptr;      // pinned mirrors
  float* h_bw = nullptr;
  float* h_blogits = nullptr;
  std::vector<uint32_t> bpos;      // [row] its sequence's position
  std::vector<uint32_t> bsel;      // [row][k] the step's routes at the current layer
  std::vector<ExpertHint> bhints;  // the step's hints at the current layer, every row's
  gpu::StepExperts step_experts;   // batch_moe's grouping of the step's routes by expert

  // Host scratch.
  gpu::HostRouter router;  // the routing decisions and hints
  std::vector<ExpertPtrs> ptrs;

  Impl(const DenseModel& m, ExpertSource& s, const EngineOptions& o, const GpuOptions& g)
      : model(m),
        source(s),
        p(m.params()),
        d(m.params().ds3),
        w(*m.ds3()),
        opts(o),
        gpu(g),
        planner(m.params(), o),
        router(m.params(), m.params().ds3, opts) {
    if (opts.prefetch_width == 0) opts.prefetch_width = p.n_expert_used;
    for (const Ds3LayerWeights& l : w.layers) router.bias.emplace_back(l.exp_bias);
  }
  ~Impl();

  Status init();
  Status carve_dense(Carver& c);
  void carve_work(Carver& c);
  Status mv(const DevMat& m, const float* in, float* y);
  // One matvec per head of a stacked per-head matrix (rows x cols each), batched.
  Status per_head(const DevMat& m, uint32_t rows, const float* in, uint64_t in_stride, float* y,
                  uint64_t y_stride);
  Status attention(uint32_t layer);
  // attention() for rows [0, n) of the chunk (cx) at positions pos0.., the dense projections as
  // GEMMs over the rows, the rest row by row (attend()).
  Status chunk_attention(uint32_t layer, uint32_t pos0, uint32_t n);
  // attention()'s middle for one position `at`: its latent and rope key (from kv, wkv_a's output)
  // into the cache, the roped query (qrow, in place) through attn_k_b, the attention over the
  // cache and attn_v_b into out_row.
  Status attend(uint32_t layer, uint32_t at, float* qrow, const float* kv, float* out_row);
  Status mlp(const DevMat& gate, const DevMat& up, const DevMat& down, float* y);
  // route()'s device half: this layer's router on xn (unless scripted) and the lookahead layers'
  // on x through their own norms, into rl ([1 + depth][n_expert]); `rows` = 1 + the deepest
  // lookahead computed (the rows to copy back).
  Status routers(uint32_t layer, float* rl, uint32_t& rows);
  Status route(uint32_t layer);
  Status moe(uint32_t layer);
  Status head(std::span<float> logits);
  Status prefill_chunk(std::span<const uint32_t> tokens, std::span<float> logits);
  Status prefill_layers(uint32_t n);
  // Sequence s selected: its position, and its caches for attend().
  void select(uint32_t s) {
    seq_pos[seq] = pos;
    seq = s;
    pos = seq_pos[s];
    const uint64_t per = uint64_t{p.n_layer} * opts.max_context;
    latent = latent_all + uint64_t{s} * per * d.kv_lora_rank;
    krope = krope_all + uint64_t{s} * per * p.n_rot;
  }
  Status decode_batch(std::span<const BatchRow> rows, std::span<float> logits);
  // The step's routed experts of `layer` (bsel, n rows), each distinct one acquired once.
  Status batch_moe(uint32_t layer, uint32_t n);
  // One group's uses (their experts at ptrs) through decode()'s run_experts kernels.
  Status run_uses(uint32_t layer, std::span<const gpu::StepUse> list);
};

Ds3GpuEngine::Impl::~Impl() {
  // The streams' work reads the held experts' bytes and every buffer: it must be done before a
  // hold is given back (experts' destructor) or an owner goes.
  if (compute.valid()) (void)cudaStreamSynchronize(compute.get());
  if (copy.valid()) (void)cudaStreamSynchronize(copy.get());
}

Status Ds3GpuEngine::Impl::carve_dense(Carver& c) {
  std::vector<uint8_t> scratch;
  auto mat = [&](const Matrix& m, DevMat& dst) {
    return gpu::carve_matrix(c, model, m, dst, scratch);
  };
  auto vec = [&](const std::vector<float>& v) -> const float* {
    return c.take_n<float>(v.size(), v.data());
  };
  EXPERTD_TRY(mat(model.token_embd(), embd));
  EXPERTD_TRY(mat(model.output(), output));
  output_norm = vec(model.output_norm());
  const std::vector<double> f = ds3_inv_freq(p);
  freq = c.take_n<double>(f.size(), f.data());
  layers.resize(p.n_layer);
  for (uint32_t i = 0; i < p.n_layer; ++i) {
    const Ds3LayerWeights& l = w.layers[i];
    DevLayer& dl = layers[i];
    dl.attn_norm = vec(l.attn_norm);
    dl.kv_a_norm = vec(l.kv_a_norm);
    dl.ffn_norm = vec(l.ffn_norm);
    if (d.q_lora_rank > 0) {
      dl.q_a_norm = vec(l.q_a_norm);
      EXPERTD_TRY(mat(l.wq_a, dl.wq_a));
      EXPERTD_TRY(mat(l.wq_b, dl.wq_b));
    } else {
      EXPERTD_TRY(mat(l.wq, dl.wq));
    }
    EXPERTD_TRY(mat(l.wkv_a, dl.wkv_a));
    EXPERTD_TRY(mat(l.wk_b, dl.wk_b));
    EXPERTD_TRY(mat(l.wv_b, dl.wv_b));
    EXPERTD_TRY(mat(l.wo, dl.wo));
    EXPERTD_TRY(gpu::carve_sigmoid_moe(c, model, d, i, l, dl.moe, scratch));
    if (i >= d.dense_lead) EXPERTD_TRY(mat(l.gate_inp, dl.gate_inp));
  }
  return Ok{};
}

void Ds3GpuEngine::Impl::carve_work(Carver& c) {
  const uint64_t e = p.n_embd;
  const uint64_t ctx = opts.max_context;
  const uint64_t lat = d.kv_lora_rank;
  const uint64_t heads = p.n_head;
  const uint32_t k = p.n_expert_used;
  const uint32_t depth = opts.prefetch_depth;
  const uint64_t ff = std::max<uint64_t>(d.n_ff, uint64_t{p.n_ff_exp} * std::max(1u, d.n_shared));
  const uint64_t seqs = opts.sequences;
  latent_all = c.take_n<float>(seqs * p.n_layer * ctx * lat);
  krope_all = c.take_n<float>(seqs * p.n_layer * ctx * p.n_rot);
  latent = latent_all;
  krope = krope_all;
  x = c.take_n<float>(e);
  xn = c.take_n<float>(e);
  qa = c.take_n<float>(d.q_lora_rank);
  q = c.take_n<float>(heads * p.head_dim);
  kva = c.take_n<float>(lat + p.n_rot);
  qabs = c.take_n<float>(heads * lat);
  olat = c.take_n<float>(heads * lat);
  att = c.take_n<float>(heads * d.v_head_dim);
  scores = c.take_n<double>(heads * ctx);
  out = c.take_n<float>(e);
  pxn = c.take_n<float>(uint64_t{std::max(depth, 1u)} * e);
  rlogits = c.take_n<float>(uint64_t{1 + depth} * p.n_expert);
  d_weights = c.take_n<float>(k);
  gu = c.take_n<float>(2 * uint64_t{k} * p.n_ff_exp);
  hbuf = c.take_n<float>(uint64_t{k} * p.n_ff_exp);
  eo = c.take_n<float>(uint64_t{k} * e);
  sg = c.take_n<float>(ff);
  su = c.take_n<float>(ff);
  sout = c.take_n<float>(e);
  d_logits = c.take_n<float>(p.n_vocab);
  chunk = std::max(1u, std::min(opts.prefill_chunk, opts.max_context));
  // Rows 256-byte aligned, as decode()'s single-row buffers are.
  ce = gpu::align_up(e, 64);
  cne = gpu::align_up(p.n_expert, 64);
  crs = uint64_t{1 + opts.prefetch_depth} * cne;
  cx = c.take_n<float>(uint64_t{chunk} * ce);
  cxn = c.take_n<float>(uint64_t{chunk} * ce);
  crl = c.take_n<float>(uint64_t{chunk} * crs);
  cw = c.take_n<float>(uint64_t{chunk} * k);
  ceo = c.take_n<float>(uint64_t{chunk} * k * e);
  rows_scratch.xe = c.take_n<float>(uint64_t{chunk} * e);
  rows_scratch.hg = c.take_n<float>(uint64_t{chunk} * p.n_ff_exp);
  rows_scratch.hu = c.take_n<float>(uint64_t{chunk} * p.n_ff_exp);
  rows_scratch.down = c.take_n<float>(uint64_t{chunk} * e);
  rows_scratch.w = c.take_n<float>(uint64_t{p.n_ff_exp} * e);
  rows_scratch.d_index = c.take_n<uint32_t>(gpu::RowsScratch::host_words(p, chunk));
  if (chunk >= gpu::kDenseGemmRows) {
    ca.e = gpu::align_up(e, 64);
    ca.qa = gpu::align_up(d.q_lora_rank, 64);
    ca.q = gpu::align_up(heads * p.head_dim, 64);
    ca.kv = gpu::align_up(lat + p.n_rot, 64);
    ca.v = gpu::align_up(heads * d.v_head_dim, 64);
    ca.xn = c.take_n<float>(uint64_t{chunk} * ca.e);
    ca.qa_rows = c.take_n<float>(uint64_t{chunk} * ca.qa);
    ca.q_rows = c.take_n<float>(uint64_t{chunk} * ca.q);
    ca.kv_rows = c.take_n<float>(uint64_t{chunk} * ca.kv);
    ca.att = c.take_n<float>(uint64_t{chunk} * ca.v);
    ca.out = c.take_n<float>(uint64_t{chunk} * ca.e);
    ca.tile_floats = 0;
    for (const DevLayer& l : layers) {
      for (const DevMat* m : {&l.wq_a, &l.wq_b, &l.wq, &l.wkv_a, &l.wo}) {
        ca.tile_floats = std::max(ca.tile_floats, gpu::dense_rows_tile(*m, kDenseTileFloats));
      }
    }
    ca.tile = ca.tile_floats > 0 ? c.take_n<float>(ca.tile_floats) : nullptr;
  }
  if (seqs > 1) {
    be = gpu::align_up(e, 64);
    brs = gpu::align_up(uint64_t{1 + depth} * p.n_expert, 64);
    bws = gpu::align_up(k, 64);
    beos = gpu::align_up(uint64_t{k} * e, 64);
    bx = c.take_n<float>(seqs * be);
    bxn = c.take_n<float>(seqs * be);
    brl = c.take_n<float>(seqs * brs);
    bw = c.take_n<float>(seqs * bws);
    beo = c.take_n<float>(seqs * beos);
    bgate = c.take_n<float>(seqs * k * p.n_ff_exp);
    bup = c.take_n<float>(seqs * k * p.n_ff_exp);
    bh = c.take_n<float>(seqs * k * p.n_ff_exp);
    d_blogits = c.take_n<float>(seqs * p.n_vocab);
  }
}

Status Ds3GpuEngine::Impl::init() {
  std::string why;
  if (!cuda_device_available(&why)) return make_error(ENODEV, why);
  EXPERTD_CUDA_TRY(cudaSetDevice(gpu.device));
  cudaDeviceProp prop{};
  EXPERTD_CUDA_TRY(cudaGetDeviceProperties(&prop, gpu.device));
  device_name =
      fmt::format("{} (sm_{}{}, {})", prop.name, prop.major, prop.minor, gib(prop.totalGlobalMem));
  if (2 * p.n_expert_used > kernels::kMaxBatch) {
    return make_error(EINVAL, fmt::format("the GPU engine runs at most top-{} experts; the model "
                                          "has top-{}",
                                          kernels::kMaxBatch / 2, p.n_expert_used));
  }
  kq_scale = ds3_kq_scale(p);
  EXPERTD_TRY_ASSIGN(compute, CudaStream::create(cudaStreamNonBlocking));
  EXPERTD_TRY_ASSIGN(copy, CudaStream::create(cudaStreamNonBlocking));

  // Dense weights: count, check the free memory, allocate, upload. Then caches and activations.
  EXPERTD_TRY_ASSIGN(dense_mem, gpu::carve_device([&](Carver& c) { return carve_dense(c); },
                                                  [&](uint64_t n) {
                                                    dense_device_bytes = n;
                                                    return gpu::alloc_dense(n, "as in the file",
                                                                            model.path(),
                                                                            device_name);
                                                  }));
  EXPERTD_TRY_ASSIGN(
      work_mem, gpu::carve_device(
                    [&](Carver& c) -> Status {
                      carve_work(c);
                      return Ok{};
                    },
                    [&](uint64_t n) -> Result<DeviceBytes> {
                      Result<DeviceBytes> mem = DeviceBytes::alloc(n);
                      if (!mem) {
                        return make_error(
                            ENOMEM,
                            fmt::format("cannot allocate {} of device memory for "
                                        "the latent caches ({} positions x {} "
                                        "sequences) and activations on {}",
                                        gib(n), opts.max_context, opts.sequences, device_name));
                      }
                      EXPERTD_CUDA_TRY(cudaMemset(mem->get(), 0, n));
                      return mem;
                    }));
  seq_pos.assign(opts.sequences, 0);

  const uint32_t k = p.n_expert_used;
  const uint32_t depth = opts.prefetch_depth;
  const uint64_t host_floats = uint64_t{1 + depth} * p.n_expert + k + p.n_vocab +
                               uint64_t{chunk} * (crs + k) + gpu::RowsScratch::host_words(p, chunk);
  EXPERTD_TRY_ASSIGN(host_mem, PinnedBytes::alloc(host_floats * 4));
  h_rlogits = host_mem.get<float>();
  h_weights = h_rlogits + uint64_t{1 + depth} * p.n_expert;
  h_logits = h_weights + k;
  h_crl = h_logits + p.n_vocab;
  h_cw = h_crl + uint64_t{chunk} * crs;
  rows_scratch.h_index = reinterpret_cast<uint32_t*>(h_cw + uint64_t{chunk} * k);
  rows_scratch.groups.reserve(p.n_expert, uint64_t{chunk} * p.n_expert_used);
  EXPERTD_TRY_ASSIGN(blas, CublasHandle::create(compute.get()));
  EXPERTD_CUBLAS_TRY(cublasSetPointerMode(blas.get(), CUBLAS_POINTER_MODE_HOST));
  EXPERTD_CUBLAS_TRY(cublasSetMathMode(blas.get(), CUBLAS_PEDANTIC_MATH));  // true f32, no TF32
  csel.resize(uint64_t{chunk} * k);
  needed.resize(p.n_expert);
  chunk_hints.reserve(p.n_expert);
  if (bx != nullptr) {
    const uint64_t S = opts.sequences;
    EXPERTD_TRY_ASSIGN(batch_host, PinnedBytes::alloc(S * (brs + bws + p.n_vocab) * 4));
    h_brl = batch_host.get<float>();
    h_bw = h_brl + S * brs;
    h_blogits = h_bw + S * bws;
    bpos.resize(S);
    bsel.resize(S * k);
    step_experts.reserve(p.n_expert, S * k);
    bhints.reserve(uint64_t{std::max(depth, 1u)} * p.n_expert);
  }

  experts = std::make_unique<GpuExperts>(model, source, gpu, stats, compute.get(), copy.get());
  EXPERTD_TRY(experts->init(device_name));
  for (uint32_t i = d.dense_lead; i < p.n_layer; ++i) {
    if (!experts->shape(i).present) {
      return make_error(EINVAL, fmt::format("{}: layer {} has no routed experts", model.path(), i));
    }
  }
  ptrs.resize(k);
  return Ok{};
}

Status Ds3GpuEngine::Impl::mv(const DevMat& m, const float* in, float* y) {
  EXPERTD_CUDA_TRY(
      kernels::matvec(m.type, m.data, m.row_bytes, m.rows, m.cols, in, y, compute.get()));
  return Ok{};
}

Status Ds3GpuEngine::Impl::per_head(const DevMat& m, uint32_t rows, const float* in,
                                    uint64_t in_stride, float* y, uint64_t y_stride) {
  for (uint32_t h0 = 0; h0 < p.n_head; h0 += kernels::kMaxBatch) {
    kernels::MatvecBatch b;
    b.count = std::min(kernels::kMaxBatch, p.n_head - h0);
    for (uint32_t j = 0; j < b.count; ++j) {
      b.w[j] = head_rows(m, h0 + j, rows);
      b.x[j] = in + (h0 + j) * in_stride;
      b.y[j] = y + (h0 + j) * y_stride;
    }
    EXPERTD_CUDA_TRY(kernels::matvec_batched(m.type, b, m.row_bytes, rows, m.cols, compute.get()));
  }
  return Ok{};
}

Status Ds3GpuEngine::Impl::attention(uint32_t layer) {
  const DevLayer& l = layers[layer];
  const cudaStream_t st = compute.get();
  EXPERTD_CUDA_TRY(kernels::ds4_rms_norm(x, l.attn_norm, xn, 1, p.n_embd, p.rms_eps, st));
  if (d.q_lora_rank > 0) {
    EXPERTD_TRY(mv(l.wq_a, xn, qa));
    EXPERTD_CUDA_TRY(kernels::ds4_rms_norm(qa, l.q_a_norm, qa, 1, d.q_lora_rank, p.rms_eps, st));
    EXPERTD_TRY(mv(l.wq_b, qa, q));
  } else {
    EXPERTD_TRY(mv(l.wq, xn, q));
  }
  EXPERTD_TRY(mv(l.wkv_a, xn, kva));
  EXPERTD_TRY(attend(layer, pos, q, kva, att));
  EXPERTD_TRY(mv(l.wo, att, out));
  EXPERTD_CUDA_TRY(kernels::add(x, out, p.n_embd, st));
  return Ok{};
}

Status Ds3GpuEngine::Impl::attend(uint32_t layer, uint32_t at, float* qrow, const float* kv,
                                  float* out_row) {
  const DevLayer& l = layers[layer];
  const cudaStream_t st = compute.get();
  const uint32_t hd = p.head_dim;
  const uint32_t lat = d.kv_lora_rank;
  const uint64_t ctx = opts.max_context;
  // This position's latent and rope key go straight into the cache.
  float* c = latent + (layer * ctx + at) * lat;
  float* kr = krope + (layer * ctx + at) * p.n_rot;
  EXPERTD_CUDA_TRY(kernels::ds4_rms_norm(kv, l.kv_a_norm, c, 1, lat, p.rms_eps, st));
  EXPERTD_CUDA_TRY(
      cudaMemcpyAsync(kr, kv + lat, uint64_t{p.n_rot} * 4, cudaMemcpyDeviceToDevice, st));
  EXPERTD_CUDA_TRY(kernels::ds4_rope(kr, 1, p.n_rot, p.n_rot, at, freq, false, st));
  EXPERTD_CUDA_TRY(kernels::ds4_rope(qrow, p.n_head, hd, p.n_rot, at, freq, false, st));
  // attn_k_b folds each head's non-rope query into the latent space.
  EXPERTD_TRY(per_head(l.wk_b, lat, qrow, hd, qabs, lat));
  EXPERTD_CUDA_TRY(kernels::ds3_mla_attention(
      qabs, qrow + d.qk_nope, hd, latent + layer * ctx * lat, krope + layer * ctx * p.n_rot, at + 1,
      p.n_head, lat, p.n_rot, kq_scale, scores, static_cast<uint32_t>(ctx), olat, st));
  return per_head(l.wv_b, d.v_head_dim, olat, lat, out_row, d.v_head_dim);
}

Status Ds3GpuEngine::Impl::chunk_attention(uint32_t layer, uint32_t pos0, uint32_t n) {
  const DevLayer& l = layers[layer];
  const cudaStream_t st = compute.get();
  const uint32_t e = p.n_embd;
  auto dense = [&](const DevMat& m, const float* in, uint64_t in_stride, float* y,
                   uint64_t y_stride) {
    return gpu::dense_rows(blas.get(), m, in, in_stride, n, y, y_stride, ca.tile, ca.tile_floats,
                           st);
  };
  for (uint32_t i = 0; i < n; ++i) {
    EXPERTD_CUDA_TRY(
        kernels::ds4_rms_norm(cx + i * ce, l.attn_norm, ca.xn + i * ca.e, 1, e, p.rms_eps, st));
  }
  if (d.q_lora_rank > 0) {
    EXPERTD_TRY(dense(l.wq_a, ca.xn, ca.e, ca.qa_rows, ca.qa));
    for (uint32_t i = 0; i < n; ++i) {
      float* r = ca.qa_rows + i * ca.qa;
      EXPERTD_CUDA_TRY(kernels::ds4_rms_norm(r, l.q_a_norm, r, 1, d.q_lora_rank, p.rms_eps, st));
    }
    EXPERTD_TRY(dense(l.wq_b, ca.qa_rows, ca.qa, ca.q_rows, ca.q));
  } else {
    EXPERTD_TRY(dense(l.wq, ca.xn, ca.e, ca.q_rows, ca.q));
  }
  EXPERTD_TRY(dense(l.wkv_a, ca.xn, ca.e, ca.kv_rows, ca.kv));
  // Row by row, decode()'s kernels: row i's latent goes into the cache before it attends (the
  // rows after it are not read: causal).
  for (uint32_t i = 0; i < n; ++i) {
    EXPERTD_TRY(
        attend(layer, pos0 + i, ca.q_rows + i * ca.q, ca.kv_rows + i * ca.kv, ca.att + i * ca.v));
  }
  EXPERTD_TRY(dense(l.wo, ca.att, ca.v, ca.out, ca.e));
  for (uint32_t i = 0; i < n; ++i) {
    EXPERTD_CUDA_TRY(kernels::add(cx + i * ce, ca.out + i * ca.e, e, st));
  }
  return Ok{};
}

Status Ds3GpuEngine::Impl::mlp(const DevMat& gate, const DevMat& up, const DevMat& down, float* y) {
  return gpu::run_mlp(gate, up, down, xn, sg, su, y, compute.get());
}

Status Ds3GpuEngine::Impl::routers(uint32_t layer, float* rl, uint32_t& rows) {
  const cudaStream_t st = compute.get();
  const uint32_t ne = p.n_expert;
  // The routers on the device: this layer's, and the lookahead layers' on the same residual
  // through their own norms.
  if (router.computes(pos, layer)) EXPERTD_TRY(mv(layers[layer].gate_inp, xn, rl));
  rows = 1;
  for (uint32_t j = 1; j <= opts.prefetch_depth; ++j) {
    if (!router.looks_ahead(layer, j)) continue;
    float* in = pxn + uint64_t{j - 1} * p.n_embd;
    EXPERTD_CUDA_TRY(
        kernels::ds4_rms_norm(x, layers[layer + j].ffn_norm, in, 1, p.n_embd, p.rms_eps, st));
    EXPERTD_TRY(mv(layers[layer + j].gate_inp, in, rl + uint64_t{j} * ne));
    rows = j + 1;
  }
  return Ok{};
}

Status Ds3GpuEngine::Impl::route(uint32_t layer) {
  const cudaStream_t st = compute.get();
  const uint32_t k = p.n_expert_used;
  const uint32_t ne = p.n_expert;
  const bool dense = layer < d.dense_lead;
  uint32_t rows = 1;
  EXPERTD_TRY(routers(layer, rlogits, rows));
  // MoE layers always sync here, scripted or not: it is where the previous layer's holds go back.
  if (!dense || rows > 1) {
    EXPERTD_CUDA_TRY(
        cudaMemcpyAsync(h_rlogits, rlogits, uint64_t{rows} * ne * 4, cudaMemcpyDeviceToHost, st));
    EXPERTD_TRY(experts->sync_compute());
  }
  // Hints and the routing decision, as Ds3CpuEngine makes them.
  router.route(pos, layer, h_rlogits, planner, stats, experts->hint_source(), routing_log);
  if (dense) return Ok{};
  std::memcpy(h_weights, router.weights.data(), uint64_t{k} * 4);
  EXPERTD_CUDA_TRY(
      cudaMemcpyAsync(d_weights, h_weights, uint64_t{k} * 4, cudaMemcpyHostToDevice, st));
  return Ok{};
}

Status Ds3GpuEngine::Impl::moe(uint32_t layer) {
  return gpu::run_sigmoid_moe(*experts, layer, router.selected, ptrs, layers[layer].moe, p, xn,
                              d_weights, gpu::SigmoidMoeScratch{gu, hbuf, eo, sg, su, sout}, out,
                              stats, compute.get());
}

Status Ds3GpuEngine::Impl::head(std::span<float> logits) {
  const cudaStream_t st = compute.get();
  EXPERTD_CUDA_TRY(kernels::ds4_rms_norm(x, output_norm, xn, 1, p.n_embd, p.rms_eps, st));
  EXPERTD_TRY(mv(output, xn, d_logits));
  return experts->logits_to_host(d_logits, h_logits, logits.first(p.n_vocab));
}

Status Ds3GpuEngine::Impl::prefill_chunk(std::span<const uint32_t> tokens,
                                         std::span<float> logits) {
  const auto n = static_cast<uint32_t>(tokens.size());
  const cudaStream_t st = compute.get();
  for (uint32_t i = 0; i < n; ++i) {
    EXPERTD_CUDA_TRY(kernels::dequantize(
        embd.type, embd.data + uint64_t{tokens[i]} * embd.row_bytes, cx + i * ce, p.n_embd, st));
  }
  const size_t logged = routing_log != nullptr ? routing_log->size() : 0;
  // One pass over the layers: the planner dedups its hints over the chunk.
  planner.begin_token();
  const uint32_t pos0 = pos;
  // attention(), mlp(), moe() and head() work on `x`, `xn` and `pos`: pointed at each row in turn.
  float* const x_row = x;
  float* const xn_row = xn;
  Status done = prefill_layers(n);
  if (done && !logits.empty()) {
    x = cx + uint64_t{n - 1} * ce;
    done = head(logits);
  }
  x = x_row;
  xn = xn_row;
  return end_prefill_chunk(std::move(done), routing_log, logged, n, pos0, pos, stats);
}

Status Ds3GpuEngine::Impl::prefill_layers(uint32_t n) {
  const uint32_t k = p.n_expert_used;
  const cudaStream_t st = compute.get();
  const uint32_t pos0 = pos;
  float* const xn_scratch = xn;  // attention()'s normed input
  // The daemon's cursor as GpuEngine's chunked prefill keeps it: the chunk's last position, each
  // layer named once its exact hints are out (route_chunk), so they target this pass.
  const uint32_t last = pos0 + n - 1;
  start_prefill_cursor(source, last, p.n_layer, stats);
  const bool batched = n >= gpu::kDenseGemmRows && ca.xn != nullptr;
  for (uint32_t layer = 0; layer < p.n_layer; ++layer) {
    const DevLayer& l = layers[layer];
    const bool dense = layer < d.dense_lead;
    // Attention: over the chunk's rows with the projections as GEMMs, or position by position as
    // decode() runs it (each attends to the rows before it, written just now). Then the FFN norm
    // of each row, as decode() computes it.
    if (batched) EXPERTD_TRY(chunk_attention(layer, pos0, n));
    for (uint32_t i = 0; i < n; ++i) {
      x = cx + i * ce;
      xn = xn_scratch;
      pos = pos0 + i;
      if (!batched) EXPERTD_TRY(attention(layer));
      EXPERTD_CUDA_TRY(
          kernels::ds4_rms_norm(x, l.ffn_norm, cxn + i * ce, 1, p.n_embd, p.rms_eps, st));
      if (dense) {
        xn = cxn + i * ce;
        EXPERTD_TRY(mlp(l.moe.ffn_gate, l.moe.ffn_up, l.moe.ffn_down, out));
        EXPERTD_CUDA_TRY(kernels::add(x, out, p.n_embd, st));
      } else {
        float* rl = crl + uint64_t{i} * crs;
        if (router.computes(pos, layer)) EXPERTD_TRY(mv(l.gate_inp, cxn + i * ce, rl));
        // The lookahead routers on this row's residual, as decode's route() runs them.
        for (uint32_t j = 1; j <= opts.prefetch_depth; ++j) {
          if (!router.looks_ahead(layer, j)) continue;
          EXPERTD_CUDA_TRY(kernels::ds4_rms_norm(x, layers[layer + j].ffn_norm, pxn, 1, p.n_embd,
                                                 p.rms_eps, st));
          EXPERTD_TRY(mv(layers[layer + j].gate_inp, pxn, rl + uint64_t{j} * cne));
        }
      }
    }
    planner.from_layer(layer);
    if (dense) {
      planner.routed(layer, {}, stats, nullptr);  // routes nothing: closes the layer's hints
      if (!source.set_cursor(last, layer)) ++stats.hint_errors;
      continue;
    }
    // Every row's routing: one copy back, one sync.
    EXPERTD_CUDA_TRY(
        cudaMemcpyAsync(h_crl, crl, uint64_t{n} * crs * 4, cudaMemcpyDeviceToHost, st));
    EXPERTD_TRY(experts->sync_compute());
    const uint64_t budget = experts->hint_budget();
    EXPERTD_TRY(router.route_chunk(pos0, layer, n, h_crl, crs, opts.prefetch_depth > 0 ? cne : 0,
                                   budget, planner, stats, experts->hint_source(), routing_log,
                                   std::span<uint32_t>(csel.data(), uint64_t{n} * k),
                                   std::span<float>(h_cw, uint64_t{n} * k), needed, chunk_hints));
    gpu::RowsHints hints{chunk_hints, std::min<uint64_t>(chunk_hints.size(), budget), budget};
    if (!source.set_cursor(last, layer)) ++stats.hint_errors;
    EXPERTD_CUDA_TRY(cudaMemcpyAsync(cw, h_cw, uint64_t{n} * k * 4, cudaMemcpyHostToDevice, st));
    // The routed experts grouped by expert, each applied to all its rows as GEMMs; then each row's
    // shared expert and its weighted sum, as decode()'s run_sigmoid_moe ends.
    EXPERTD_TRY(gpu::run_sigmoid_moe_rows(
        *experts, blas.get(), layer, n, std::span<const uint32_t>(csel.data(), uint64_t{n} * k), cw,
        l.moe, p, cxn, cx, ce, ptrs, rows_scratch, ceo,
        gpu::SigmoidMoeScratch{gu, hbuf, eo, sg, su, sout}, out, stats, st, &hints));
  }
  pos = pos0;
  xn = xn_scratch;
  return Ok{};
}

// --- decode_batch: one step of several sequences ----------------------------------------------

Status Ds3GpuEngine::Impl::decode_batch(std::span<const BatchRow> rows, std::span<float> logits) {
  const auto n = static_cast<uint32_t>(rows.size());
  const uint32_t k = p.n_expert_used;
  const uint32_t ne = p.n_expert;
  const uint64_t v = p.n_vocab;
  const cudaStream_t st = compute.get();
  seq_pos[seq] = pos;
  EXPERTD_TRY(
      check_batch_room(rows, opts.max_context, [&](uint32_t s) -> uint32_t { return seq_pos[s]; }));
  const uint64_t t0 = monotonic_ns();
  uint32_t last = 0;
  for (uint32_t i = 0; i < n; ++i) {
    bpos[i] = seq_pos[rows[i].sequence];
    last = std::max(last, bpos[i]);
  }
  // attention(), routers() and mlp() work on `x`, `xn`, `pos` and the selected sequence's cache:
  // pointed at each row's in turn; put back whatever happens.
  const uint32_t was = seq;
  float* const x0 = x;
  float* const xn0 = xn;
  auto use_row = [&](uint32_t i) {
    select(rows[i].sequence);
    x = bx + i * be;
    xn = bxn + i * be;
  };
  auto forward = [&]() -> Status {
    for (uint32_t i = 0; i < n; ++i) {
      EXPERTD_CUDA_TRY(kernels::dequantize(embd.type,
                                           embd.data + uint64_t{rows[i].token} * embd.row_bytes,
                                           bx + i * be, p.n_embd, st));
    }
    planner.begin_token();  // one step: each (layer, expert) hinted once for all the rows
    for (uint32_t layer = 0; layer < p.n_layer; ++layer) {
      if (!source.set_cursor(last, layer)) ++stats.hint_errors;
      const DevLayer& l = layers[layer];
      const bool dense = layer < d.dense_lead;
      // Each row as decode() runs it up to its routing: attention over its own sequence's cache,
      // the FFN norm, the routers (the dense MLP too, which the routing does not read); every
      // row's logits copied back behind one sync.
      bool copied = false;
      for (uint32_t i = 0; i < n; ++i) {
        use_row(i);
        EXPERTD_TRY(attention(layer));
        EXPERTD_CUDA_TRY(kernels::ds4_rms_norm(x, l.ffn_norm, xn, 1, p.n_embd, p.rms_eps, st));
        float* rl = brl + i * brs;
        uint32_t copy_rows = 1;
        EXPERTD_TRY(routers(layer, rl, copy_rows));
        if (!dense || copy_rows > 1) {
          EXPERTD_CUDA_TRY(cudaMemcpyAsync(h_brl + i * brs, rl, uint64_t{copy_rows} * ne * 4,
                                           cudaMemcpyDeviceToHost, st));
          copied = true;
        }
        if (dense) {
          EXPERTD_TRY(mlp(l.moe.ffn_gate, l.moe.ffn_up, l.moe.ffn_down, out));
          EXPERTD_CUDA_TRY(kernels::add(x, out, p.n_embd, st));
        }
      }
      // MoE layers always sync here: it is where the previous layer's holds go back.
      if (copied) EXPERTD_TRY(experts->sync_compute());
      // Every row's candidates, once each, scored by all the rows: one message to the daemon.
      planner.from_layer(layer);
      for (uint32_t i = 0; i < n; ++i)
        router.add_lookahead(bpos[i], layer, h_brl + i * brs, ne, planner);
      const std::span<const ExpertHint> hints = planner.take(stats);
      bhints.assign(hints.begin(), hints.end());
      if (!hints.empty() && !experts->hint_source().prefetch(hints)) ++stats.hint_errors;
      if (dense) {
        planner.routed(layer, {}, stats, nullptr);  // routes nothing: closes the layer's hints
      } else {
        // Each row's routing decision (logged and counted as decode()'s), then its weights.
        for (uint32_t i = 0; i < n; ++i) {
          router.decide(bpos[i], layer, h_brl + i * brs, planner, stats, routing_log);
          for (uint32_t j = 0; j < k; ++j) {
            const uint32_t ex = router.selected[j];
            if (ex >= ne) {
              return make_error(EIO, fmt::format("layer {} sequence {}: routed to expert {} of {}",
                                                 layer, rows[i].sequence, ex, ne));
            }
            bsel[uint64_t{i} * k + j] = ex;
          }
          std::memcpy(h_bw + i * bws, router.weights.data(), uint64_t{k} * 4);
        }
        EXPERTD_CUDA_TRY(
            cudaMemcpyAsync(bw, h_bw, uint64_t{n} * bws * 4, cudaMemcpyHostToDevice, st));
        EXPERTD_TRY(batch_moe(layer, n));
        // Each row as run_sigmoid_moe ends: its shared experts, the weighted sum, the residual.
        const bool shared = l.moe.shexp_gate.rows > 0;
        for (uint32_t i = 0; i < n; ++i) {
          if (shared) {
            EXPERTD_TRY(gpu::run_mlp(l.moe.shexp_gate, l.moe.shexp_up, l.moe.shexp_down,
                                     bxn + i * be, sg, su, sout, st));
          }
          EXPERTD_CUDA_TRY(kernels::ds4_moe_sum(beo + i * beos, bw + i * bws, k,
                                                shared ? sout : nullptr, p.n_embd, out, st));
          EXPERTD_CUDA_TRY(kernels::add(bx + i * be, out, p.n_embd, st));
        }
      }
      EXPERTD_TRY(experts->prefetch(layer, opts.prefetch_depth, p.n_layer, bhints));
    }
    // decode()'s head for each row; the logits back behind one sync.
    for (uint32_t i = 0; i < n; ++i) {
      EXPERTD_CUDA_TRY(kernels::ds4_rms_norm(bx + i * be, output_norm, bxn + i * be, 1, p.n_embd,
                                             p.rms_eps, st));
      EXPERTD_TRY(mv(output, bxn + i * be, d_blogits + i * v));
    }
    return experts->logits_to_host(d_blogits, h_blogits, logits.first(n * v));
  };
  const Status done = forward();
  x = x0;
  xn = xn0;
  select(was);
  EXPERTD_TRY(done);
  experts->measure_tiers();
  for (const BatchRow& r : rows) ++seq_pos[r.sequence];
  pos = seq_pos[seq];
  count_batch_step(stats, n, t0);
  return Ok{};
}

Status Ds3GpuEngine::Impl::batch_moe(uint32_t layer, uint32_t n) {
  const uint32_t k = p.n_expert_used;
  // Each distinct expert of the step acquired once (gpu::StepExperts) and applied to every row
  // that routes to it.
  return step_experts.run(*experts, layer, std::span<const uint32_t>(bsel.data(), uint64_t{n} * k),
                          k, ptrs, stats,
                          [&](std::span<const uint32_t>, std::span<const gpu::StepUse> uses) {
                            return run_uses(layer, uses);
                          });
}

Status Ds3GpuEngine::Impl::run_uses(uint32_t layer, std::span<const gpu::StepUse> list) {
  // run_experts' kernels on each use (its expert on its row's normalised input): gate and up (one
  // launch of 2k jobs when they share a type and row size, else a matvec each), SwiGLU (an
  // elementwise kernel: any span gives the same bits), down (a launch of k jobs). Every launch
  // has decode()'s job count -- a last, partial one is filled with repeats of its first use that
  // write into decode()'s own gu / eo, unused by the step -- because the matvec's launch plan
  // depends on the jobs per launch (kernels/matvec_quant.cu: whether a split-K plan fits), and a
  // split sums a row in another order: with decode()'s count, a use's output is decode()'s to the
  // bit. A job's result depends only on its weights and input, not on the other jobs.
  const GpuExperts::LayerShape& sh = experts->shape(layer);
  const cudaStream_t st = compute.get();
  const uint32_t k = p.n_expert_used;
  const uint32_t e = p.n_embd;
  const uint32_t ff = p.n_ff_exp;
  const auto uses = static_cast<uint32_t>(list.size());
  if (uses == 0) return Ok{};
  auto input = [&](const gpu::StepUse& u) -> const float* { return bxn + u.row * be; };
  if (sh.gate.type == sh.up.type && sh.gate.row_bytes == sh.up.row_bytes) {
    for (uint32_t first = 0; first < uses; first += k) {
      const uint32_t real = std::min(k, uses - first);
      kernels::MatvecBatch b;
      b.count = 2 * k;
      for (uint32_t j = 0; j < k; ++j) {
        const gpu::StepUse& u = list[first + (j < real ? j : 0)];
        b.w[j] = ptrs[u.expert].gate;
        b.x[j] = input(u);
        b.y[j] = j < real ? bgate + uint64_t{first + j} * ff : gu + uint64_t{j} * ff;
        b.w[k + j] = ptrs[u.expert].up;
        b.x[k + j] = input(u);
        b.y[k + j] = j < real ? bup + uint64_t{first + j} * ff : gu + uint64_t{k + j} * ff;
      }
      EXPERTD_CUDA_TRY(kernels::matvec_batched(sh.gate.type, b, sh.gate.row_bytes, ff, e, st));
    }
  } else {
    for (uint32_t i = 0; i < uses; ++i) {
      const gpu::StepUse& u = list[i];
      EXPERTD_CUDA_TRY(kernels::matvec(sh.gate.type, ptrs[u.expert].gate, sh.gate.row_bytes, ff, e,
                                       input(u), bgate + uint64_t{i} * ff, st));
      EXPERTD_CUDA_TRY(kernels::matvec(sh.up.type, ptrs[u.expert].up, sh.up.row_bytes, ff, e,
                                       input(u), bup + uint64_t{i} * ff, st));
    }
  }
  EXPERTD_CUDA_TRY(kernels::ds4_swiglu(bgate, bup, bh, uint64_t{uses} * ff, 0.0f, st));
  for (uint32_t first = 0; first < uses; first += k) {
    const uint32_t real = std::min(k, uses - first);
    kernels::MatvecBatch b;
    b.count = k;
    for (uint32_t j = 0; j < k; ++j) {
      const uint32_t at = first + (j < real ? j : 0);
      const gpu::StepUse& u = list[at];
      b.w[j] = ptrs[u.expert].down;
      b.x[j] = bh + uint64_t{at} * ff;
      b.y[j] = j < real ? beo + u.row * beos + uint64_t{u.slot} * e : eo + uint64_t{j} * e;
    }
    EXPERTD_CUDA_TRY(kernels::matvec_batched(sh.down.type, b, sh.down.row_bytes, e, ff, st));
  }
  return Ok{};
}

// --- Ds3GpuEngine ------------------------------------------------------------------------------

Ds3GpuEngine::Ds3GpuEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Ds3GpuEngine::~Ds3GpuEngine() = default;

Result<std::unique_ptr<Ds3GpuEngine>> Ds3GpuEngine::create(const DenseModel& model,
                                                           ExpertSource& source,
                                                           const EngineOptions& options,
                                                           const GpuOptions& gpu) {
  EXPERTD_TRY(check_ds3_engine(model, options, GpuEngine::kMaxSequences));
  auto impl = std::make_unique<Impl>(model, source, options, gpu);
  EXPERTD_TRY(impl->init());
  return std::unique_ptr<Ds3GpuEngine>(new Ds3GpuEngine(std::move(impl)));
}

Status Ds3GpuEngine::decode(uint32_t token, std::span<float> logits) {
  Impl& m = *impl_;
  const ModelParams& p = m.p;
  EXPERTD_TRY(check_decode(p, m.opts, m.pos, token, logits.size()));
  const uint64_t t0 = monotonic_ns();
  const cudaStream_t st = m.compute.get();
  EXPERTD_CUDA_TRY(kernels::dequantize(
      m.embd.type, m.embd.data + uint64_t{token} * m.embd.row_bytes, m.x, p.n_embd, st));
  m.planner.begin_token();
  for (uint32_t layer = 0; layer < p.n_layer; ++layer) {
    if (!m.source.set_cursor(m.pos, layer)) ++m.stats.hint_errors;
    const DevLayer& l = m.layers[layer];
    EXPERTD_TRY(m.attention(layer));
    EXPERTD_CUDA_TRY(kernels::ds4_rms_norm(m.x, l.ffn_norm, m.xn, 1, p.n_embd, p.rms_eps, st));
    EXPERTD_TRY(m.route(layer));
    if (layer < m.d.dense_lead) {
      EXPERTD_TRY(m.mlp(l.moe.ffn_gate, l.moe.ffn_up, l.moe.ffn_down, m.out));
    } else {
      EXPERTD_TRY(m.moe(layer));
    }
    EXPERTD_CUDA_TRY(kernels::add(m.x, m.out, p.n_embd, st));
    EXPERTD_TRY(m.experts->prefetch(layer, m.opts.prefetch_depth, p.n_layer, m.router.last_hints));
  }
  EXPERTD_TRY(m.head(logits));
  m.experts->measure_tiers();
  ++m.pos;
  ++m.stats.tokens;
  m.stats.decode_ns += monotonic_ns() - t0;
  return Ok{};
}

uint32_t Ds3GpuEngine::prefill_chunk_size() const { return impl_->chunk; }

Status Ds3GpuEngine::prefill_chunk(std::span<const uint32_t> tokens, std::span<float> logits) {
  // One pass over the layers: the tier keeps the residents of the layers it has not reached.
  const gpu::TierSweep sweep(*impl_->experts, tokens.size());
  return impl_->prefill_chunk(tokens, logits);
}

void Ds3GpuEngine::reset() { impl_->pos = 0; }

uint32_t Ds3GpuEngine::sequences() const { return impl_->opts.sequences; }
uint32_t Ds3GpuEngine::selected_sequence() const { return impl_->seq; }

Status Ds3GpuEngine::select_sequence(uint32_t sequence) {
  EXPERTD_TRY(Engine::select_sequence(sequence));
  impl_->select(sequence);
  return Ok{};
}

Status Ds3GpuEngine::decode_batch(std::span<const BatchRow> rows, std::span<float> logits) {
  EXPERTD_TRY(check_batch(*this, rows, logits.size()));
  // An engine of one sequence has no rows' buffers: decode() is its step.
  if (impl_->bx == nullptr) return Engine::decode_batch(rows, logits);
  return impl_->decode_batch(rows, logits);
}

bool Ds3GpuEngine::truncate(uint32_t n) {
  if (n > impl_->pos) return false;
  impl_->pos = n;
  return true;
}

uint32_t Ds3GpuEngine::position() const { return impl_->pos; }
const EngineStats& Ds3GpuEngine::stats() const { return impl_->stats; }
EngineStats& Ds3GpuEngine::mutable_stats() { return impl_->stats; }
const ModelParams& Ds3GpuEngine::params() const { return impl_->p; }
const EngineOptions& Ds3GpuEngine::options() const { return impl_->opts; }
void Ds3GpuEngine::set_routing_log(std::vector<RoutingRecord>* log) { impl_->routing_log = log; }

std::string Ds3GpuEngine::description() const {
  const Impl& m = *impl_;
  const GpuExperts& x = *m.experts;
  return fmt::format(
      "CUDA engine ({}) on {}: dense weights {} as in the file (fused "
      "matvec), latent KV cache{}, prefill in chunks of {} (layer by layer, each layer's experts "
      "hinted once per chunk and run as GEMMs over its rows{}), {}{}",
      family_info(Family::DeepSeek3).arch, m.device_name, gib(m.dense_device_bytes),
      m.opts.sequences > 1
          ? fmt::format(" for each of {} sequences (batched steps: each expert once per step)",
                        m.opts.sequences)
          : std::string(),
      m.chunk,
      m.ca.xn != nullptr
          ? fmt::format(", the attention's projections too from {} rows", gpu::kDenseGemmRows)
          : std::string(),
      x.description(), x.arena_registered() ? "" : "; arena not registered: pageable copies");
}

}  // namespace expertd::engine
