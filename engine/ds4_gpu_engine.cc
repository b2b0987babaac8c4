#include "engine/ds4_gpu_engine.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "base/clock.h"
#include "engine/ds4_cpu_engine.h"
#include "engine/gpu_experts.h"
#include "engine/routing.h"
#include "kernels/check.h"
#include "kernels/combine.cuh"
#include "kernels/cuda_raii.h"
#include "kernels/dequant.cuh"
#include "kernels/ds4.cuh"
#include "kernels/matvec.cuh"
#include "kernels/prefill.cuh"
#include "storage/ggml_types.h"

namespace expertd::engine {
namespace {

using cuda::CublasHandle;
using cuda::CudaStream;
using cuda::DeviceBytes;
using cuda::PinnedBytes;
using gpu::align_up;
using gpu::Carver;
using gpu::DevMat;
using gpu::ExpertPtrs;
using gpu::gib;
using gpu::GpuExperts;
using gpu::kAlign;

struct DevComp {
  DevMat wkv, wgate;
  const float* ape = nullptr;   // [ratio][coff * dim]
  const float* norm = nullptr;  // dim
  uint32_t coff = 0;
  uint32_t dim = 0;
};

struct DevLayer {
  DevMat hc_attn_fn, hc_ffn_fn;
  const float *hc_attn_base = nullptr, *hc_attn_scale = nullptr;
  const float *hc_ffn_base = nullptr, *hc_ffn_scale = nullptr;
  const float* attn_norm = nullptr;
  const float* sinks = nullptr;
  const float* q_a_norm = nullptr;
  const float* kv_norm = nullptr;
  const float* ffn_norm = nullptr;
  DevMat wq_a, wq_b, wkv, wo_a, wo_b;
  bool has_comp = false;
  bool has_index = false;
  DevComp comp, index;
  DevMat index_q_b, index_proj;
  DevMat gate_inp;
  bool has_shexp = false;
  DevMat shexp_gate, shexp_up, shexp_down;
};

// One compressor's running state on the device; count and has_prev are known on the host.
struct DevCompState {
  float* kv = nullptr;         // [ratio][coff * dim] this window
  float* gate = nullptr;       // [ratio][coff * dim] (position bias added)
  float* prev_kv = nullptr;    // [ratio][dim] the previous window's first half
  float* prev_gate = nullptr;  // [ratio][dim]
  float* entries = nullptr;    // [max entries][dim]
  bool has_prev = false;
  uint32_t count = 0;
};

struct DevLayerState {
  float* window = nullptr;  // [window][head_dim] ring
  DevCompState comp, index;
};

// A compressor's host-side running state, as a checkpoint keeps it.
struct HostComp {
  uint32_t count = 0;
  bool has_prev = false;
};

// truncate(): the running state at the position its slot holds (Ds4CheckpointSlots). The device
// part is a copy of the running region (every layer's window ring and compressor buffers); the
// entries are append-only, so their counts say which are the checkpoint's.
struct Checkpoint {
  uint8_t* running = nullptr;   // device, running_bytes
  std::vector<HostComp> comps;  // [layer][comp, index]
};

// What a sequence carries from one position to the next (EngineOptions::sequences of them): its
// position, its attention state on the device (window ring, compressors, entries: the ring and
// compressor buffers one region of running_bytes), its checkpoints and the ids fed so far.
struct Seq {
  uint32_t pos = 0;
  std::vector<DevLayerState> state;     // [layer]
  uint8_t* running = nullptr;           // the region's first buffer (state[0].window)
  std::vector<Checkpoint> checkpoints;  // [kCheckpoints], by slot
  Ds4CheckpointSlots saved;             // which position each checkpoint holds
  std::vector<uint32_t> fed;            // [max_context]: the id at each position
};

// The per-token buffers whose contents live from one phase of a layer to a later one, which
// decode_batch() keeps one of per row (decode()'s own are one more): the mHC streams, the FFN
// site's post and comb mixes, the MoE input, the router logits and their pinned mirror, the routing
// weights and their pinned mirror, the routed experts' outputs.
struct RowBufs {
  float* streams = nullptr;    // [hc][n_embd]
  double* post = nullptr;      // hc
  double* comb = nullptr;      // hc * hc
  float* xn = nullptr;         // n_embd
  float* rlogits = nullptr;    // [1 + depth][n_expert]
  float* d_weights = nullptr;  // k
  float* eo = nullptr;         // [k][n_embd]
  float* h_rlogits = nullptr;  // pinned, [1 + depth][n_expert]
  float* h_weights = nullptr;  // pinned, k
};

// One (row, route slot) of a batch step's layer: an acquired expert, the row's MoE input and where
// that slot's output goes.
struct ExpertUse {
  ExpertPtrs w;
  const float* x = nullptr;
  float* out = nullptr;
};

// `bytes` of device memory for the sequences' caches and the activations (zeroed); the error
// names the size, the positions, the sequences and the device.
Result<DeviceBytes> alloc_state(uint64_t bytes, uint32_t positions, uint32_t sequences,
                                const std::string& device_name) {
  Result<DeviceBytes> mem = DeviceBytes::alloc(bytes);
  if (!mem) {
    return make_error(ENOMEM, fmt::format("cannot allocate {} ({} bytes) of device memory for the "
                                          "caches ({} positions x {} sequences) and activations "
                                          "on {}",
                                          gib(bytes), bytes, positions, sequences, device_name));
  }
  EXPERTD_CUDA_TRY(cudaMemset(mem->get(), 0, bytes));
  return mem;
}

}  // namespace

struct Ds4GpuEngine::Impl {
  const DenseModel& model;
  ExpertSource& source;
  const ModelParams& p;
  const Ds4Params& d;
  const Ds4Weights& w;
  EngineOptions opts;
  GpuOptions gpu;
  HintPlanner planner;
  EngineStats stats;
  std::vector<RoutingRecord>* routing_log = nullptr;
  // The sequences, the selected one, and the one the per-token code works on (`cur`: the selected
  // one's, a row's during decode_batch()).
  std::vector<Seq> seqs;
  uint32_t seq = 0;
  Seq* cur = nullptr;
  std::string device_name;
  uint64_t dense_device_bytes = 0;

  // The CUDA resources, destroyed last to first after ~Impl's body synchronised both streams:
  // the experts' owner (gives back its holds, then its events, registration and tier memory),
  // the streams (nothing is enqueued on them), then the pinned mirrors and device memory.
  DeviceBytes dense_mem;   // the dense weights, as in the file
  DeviceBytes work_mem;    // caches and activations
  PinnedBytes host_mem;    // pinned mirrors of the router logits, the weights and the logits
  PinnedBytes batch_host;  // decode_batch()'s pinned mirrors (sequences > 1)
  DeviceBytes chunk_mem;   // prefill's chunk scratch
  PinnedBytes
      chunk_host;  // prefill's router logits (device -> host) and row lists (host -> device)
  CudaStream copy;
  CudaStream compute;
  CublasHandle blas;  // on `compute`
  std::unique_ptr<GpuExperts> experts;

  // Dense weights.
  std::vector<DevLayer> layers;
  DevMat embd, output, hc_head_fn;
  const float* output_norm = nullptr;
  const float* hc_head_base = nullptr;
  const double* freq_main = nullptr;      // n_rot / 2
  const double* freq_compress = nullptr;  // n_rot / 2

  // Caches and activations. Every layer's window ring and compressor buffers (not the entries)
  // of a sequence lie in [running, running + running_bytes): one copy saves or restores them.
  uint64_t running_bytes = 0;
  // The per-token buffers below: streams, post, comb, xn, rlogits, d_weights, eo, h_rlogits and
  // h_weights point at decode()'s own (`solo`) or, in decode_batch(), at a row's (`brows`).
  float* streams = nullptr;  // [hc][n_embd]
  float* flat = nullptr;     // hc * n_embd, normalised
  float* mixes = nullptr;    // (2 + hc) * hc
  double* pre = nullptr;     // hc
  double* post = nullptr;    // hc
  double* comb = nullptr;    // hc * hc
  float* collapsed = nullptr;
  float* xn = nullptr;
  float* qr = nullptr;
  float* q = nullptr;
  float* kv = nullptr;
  float* att = nullptr;
  float* grouped = nullptr;
  float* out = nullptr;
  float* entry = nullptr;
  float* iq = nullptr;
  float* iw = nullptr;
  double* iscore = nullptr;
  uint32_t* chosen = nullptr;
  double* scores = nullptr;  // [n_head][score_stride]
  uint32_t score_stride = 0;
  float* pxn = nullptr;      // [depth][n_embd]
  float* rlogits = nullptr;  // [1 + depth][n_expert]
  float* d_weights = nullptr;
  float* gu = nullptr;  // [2k][n_ff]: gate outputs then up outputs
  float* hbuf = nullptr;
  float* eo = nullptr;  // [k][n_embd]
  float* sg = nullptr;  // shared expert: gate, up (n_ff * n_shared)
  float* su = nullptr;
  float* sout = nullptr;  // n_embd
  float* d_logits = nullptr;
  float* h_rlogits = nullptr;  // pinned mirrors
  float* h_weights = nullptr;
  float* h_logits = nullptr;
  RowBufs solo;  // decode()'s

  // decode_batch() (sequences > 1): each row's buffers, every row's logits and their pinned
  // mirror, the step's routes at the current layer, the distinct experts of the layer
  // (ascending) and a needed expert's index among them, the expert uses of one group, each row's
  // routing record (its index in routing_log, or SIZE_MAX).
  std::vector<RowBufs> brows;
  float* d_blogits = nullptr;  // [sequences][n_vocab]
  float* h_blogits = nullptr;
  std::vector<uint32_t> bsel;     // [row][k]
  gpu::StepExperts step_experts;  // batch_moe's grouping of the step's routes by expert
  std::vector<ExpertUse> uses;
  std::vector<size_t> brec;

  // prefill(): C = min(prefill_chunk, max_context) positions; row-major [row][...] buffers.
  uint32_t chunk = 0;
  uint64_t chunk_bytes = 0;
  float* cstreams = nullptr;  // [C][hc][n_embd] every position's mHC streams
  double* cpost = nullptr;    // [C][hc] the FFN site's post mix per position
  double* ccomb = nullptr;    // [C][hc][hc] and comb
  float* cxn = nullptr;       // [C][n_embd] normalised MoE inputs
  float* crl = nullptr;       // [C][1 + depth][n_expert] router logits, then the lookahead's
  float* d_cw = nullptr;      // [C][k] routing weights
  float* ceo = nullptr;       // [C][k][n_embd] every route slot's expert output
  float* cmoe = nullptr;      // [C][n_embd] each position's MoE output
  float* h_crl = nullptr;     // pinned mirrors of crl and d_cw
  float* h_cw = nullptr;
  // The routed experts' GEMMs over the chunk's rows (run_experts_by_rows); its groups are the
  // chunk's layer's route slots by expert.
  gpu::RowsScratch rows_scratch;
  std::vector<uint32_t> csel;      // [C][k] routes
  std::vector<float> cweights;     // [C][k]
  std::vector<ExpertHint> exact;   // a layer's needed experts' hints, n_expert
  std::vector<uint8_t> hash_mark;  // [expert]: hinted for this chunk's hash layer

  // Host scratch.
  std::vector<double> probs, sel;
  std::vector<uint32_t> order;
  std::vector<uint32_t> selected;
  std::vector<float> weights;
  std::vector<uint8_t> ready;
  std::vector<ExpertPtrs> ptrs;
  std::vector<ExpertHint> hash_hints;
  std::vector<ExpertHint> last_hints;

  // truncate(): each sequence's checkpoints are device copies in work_mem.
  bool replaying = false;  // truncate() is feeding positions again
  uint64_t refed = 0;

  Impl(const DenseModel& m, ExpertSource& s, const EngineOptions& o, const GpuOptions& g)
      : model(m),
        source(s),
        p(m.params()),
        d(m.params().ds4),
        w(*m.ds4()),
        opts(o),
        gpu(g),
        planner(m.params(), o) {
    if (opts.prefetch_width == 0) opts.prefetch_width = p.n_expert_used;
  }
  ~Impl();

  Status init();
  Status carve_dense(Carver& c);
  void carve_work(Carver& c);
  // The per-token code's buffers at `r`'s.
  void point_at(const RowBufs& r);
  Status mv(const DevMat& m, const float* x, float* y);
  Status hc_mix(const DevMat& fn, const float* scale, const float* base);
  Status hc_expand();
  Status attention(uint32_t layer);
  Status compress(const DevComp& cw, DevCompState& s, uint32_t ratio);
  Status select_entries(uint32_t layer);
  void hint_hash_layers(uint32_t token);
  // route() in parts: the MoE input (xn) and the routers' logits copied back into h_rlogits (no
  // sync); after the sync, the lookahead's candidates added to the planner; the routing decision
  // into selected/weights, the weights uploaded into d_weights.
  Status route_logits(uint32_t layer);
  void add_hints(uint32_t layer);
  Status decide(uint32_t layer, uint32_t token);
  Status route(uint32_t layer, uint32_t token);
  Status moe(uint32_t layer);
  // The end of moe(): the shared expert on xn and the MoE sum of eo into out.
  Status moe_out(uint32_t layer);
  // The HyperHead, output norm and head on streams into the device's `dst` (n_vocab).
  Status head_logits(float* dst);
  Status head(std::span<float> logits);

  Status decode_batch(std::span<const BatchRow> rows, std::span<float> logits);
  // Every hash layer's experts of the rows' tokens, each (layer, expert) once, in one message.
  void hint_hash_rows(std::span<const BatchRow> rows);
  // The distinct experts of every row's routes at `layer` (bsel), each acquired once (ascending,
  // top-k at a time) and applied to every row routing to it, into the rows' eo.
  Status batch_moe(uint32_t layer, uint32_t rows);
  // run_experts of decode() for up to k uses of one acquire.
  Status run_uses(uint32_t layer, std::span<const ExpertUse> list);

  Status init_prefill();
  void carve_chunk(Carver& c);
  Status gemm(const float* w, uint32_t out_cols, uint32_t in_cols, const float* in, uint32_t rows,
              float* out);
  Status prefill_chunk(std::span<const uint32_t> tokens, std::span<float> logits);
  Status chunk_attention(uint32_t layer, uint32_t i);
  void chunk_route(uint32_t layer, std::span<const uint32_t> tokens);
  Status prefill_moe(uint32_t layer, uint32_t n);

  void reset();
  Status save_checkpoint();
  Status restore_checkpoint(int slot);
  bool truncate(uint32_t n);
};

Ds4GpuEngine::Impl::~Impl() {
  // The streams' work reads the held experts' bytes and every buffer: it must be done before a
  // hold is given back (experts' destructor) or an owner goes. A failed sync is ignored: it fails
  // only on a sticky error, after which the device runs nothing more.
  if (compute.valid()) (void)cudaStreamSynchronize(compute.get());
  if (copy.valid()) (void)cudaStreamSynchronize(copy.get());
}

Status Ds4GpuEngine::Impl::carve_dense(Carver& c) {
  // Each matrix as read; the kernels read f32, f16, bf16, q8_0, q4_k, q6_k and mxfp4. A deferred
  // model's matrices are read from the file one at a time (DenseLoad::Deferred).
  std::vector<uint8_t> scratch;
  auto mat = [&](const Matrix& m, DevMat& dst) {
    return gpu::carve_matrix(c, model, m, dst, scratch);
  };
  auto vec = [&](const std::vector<float>& v) -> const float* {
    return c.take_n<float>(v.size(), v.data());
  };
  EXPERTD_TRY(mat(model.token_embd(), embd));
  EXPERTD_TRY(mat(model.output(), output));
  EXPERTD_TRY(mat(w.hc_head_fn, hc_head_fn));
  output_norm = vec(model.output_norm());
  hc_head_base = vec(w.hc_head_base);
  const std::vector<double> fm = ds4_inv_freq(p.n_rot, p.rope_base, nullptr);
  const std::vector<double> fc = ds4_inv_freq(p.n_rot, d.compress_rope_base, &d);
  freq_main = c.take_n<double>(fm.size(), fm.data());
  freq_compress = c.take_n<double>(fc.size(), fc.data());
  layers.resize(p.n_layer);
  for (uint32_t i = 0; i < p.n_layer; ++i) {
    const Ds4LayerWeights& l = w.layers[i];
    DevLayer& dl = layers[i];
    EXPERTD_TRY(mat(l.hc_attn_fn, dl.hc_attn_fn));
    EXPERTD_TRY(mat(l.hc_ffn_fn, dl.hc_ffn_fn));
    dl.hc_attn_base = vec(l.hc_attn_base);
    dl.hc_attn_scale = vec(l.hc_attn_scale);
    dl.hc_ffn_base = vec(l.hc_ffn_base);
    dl.hc_ffn_scale = vec(l.hc_ffn_scale);
    dl.attn_norm = vec(l.attn_norm);
    dl.sinks = vec(l.sinks);
    dl.q_a_norm = vec(l.q_a_norm);
    dl.kv_norm = vec(l.kv_norm);
    dl.ffn_norm = vec(l.ffn_norm);
    EXPERTD_TRY(mat(l.wq_a, dl.wq_a));
    EXPERTD_TRY(mat(l.wq_b, dl.wq_b));
    EXPERTD_TRY(mat(l.wkv, dl.wkv));
    EXPERTD_TRY(mat(l.wo_a, dl.wo_a));
    EXPERTD_TRY(mat(l.wo_b, dl.wo_b));
    auto comp = [&](const Ds4Compressor& cw, DevComp& dst) -> Status {
      EXPERTD_TRY(mat(cw.wkv, dst.wkv));
      EXPERTD_TRY(mat(cw.wgate, dst.wgate));
      dst.ape = vec(cw.ape);
      dst.norm = vec(cw.norm);
      dst.coff = cw.coff;
      dst.dim = cw.dim;
      return Ok{};
    };
    dl.has_comp = l.compressor.has_value();
    if (dl.has_comp) EXPERTD_TRY(comp(*l.compressor, dl.comp));
    dl.has_index = l.index_comp.has_value();
    if (dl.has_index) {
      EXPERTD_TRY(comp(*l.index_comp, dl.index));
      EXPERTD_TRY(mat(l.index_q_b, dl.index_q_b));
      EXPERTD_TRY(mat(l.index_proj, dl.index_proj));
    }
    EXPERTD_TRY(mat(l.gate_inp, dl.gate_inp));
    dl.has_shexp = d.n_shared > 0;
    if (dl.has_shexp) {
      EXPERTD_TRY(mat(l.shexp_gate, dl.shexp_gate));
      EXPERTD_TRY(mat(l.shexp_up, dl.shexp_up));
      EXPERTD_TRY(mat(l.shexp_down, dl.shexp_down));
    }
  }
  return Ok{};
}

void Ds4GpuEngine::Impl::carve_work(Carver& c) {
  const uint32_t hc = d.hc;
  const uint64_t e = p.n_embd;
  const uint64_t q_dim = uint64_t{p.n_head} * p.head_dim;
  const uint32_t k = p.n_expert_used;
  const uint32_t depth = opts.prefetch_depth;
  const uint64_t ne = p.n_expert;
  uint32_t max_entries = 0;
  uint64_t ff_sh = p.n_ff_exp;
  for (uint32_t i = 0; i < p.n_layer; ++i) {
    const DevLayer& dl = layers[i];
    if (dl.has_comp)
      max_entries = std::max(max_entries, opts.max_context / d.compress_ratio[i] + 1);
    if (dl.has_shexp) ff_sh = std::max<uint64_t>(ff_sh, dl.shexp_gate.rows);
  }
  // Each sequence's state: its running state first, every layer's in one region, then the
  // append-only entries, then the checkpoints' copies of the region.
  seqs.resize(opts.sequences);
  for (Seq& sq : seqs) {
    sq.state.resize(p.n_layer);
    const uint64_t running_at = c.total();
    for (uint32_t i = 0; i < p.n_layer; ++i) {
      DevLayerState& s = sq.state[i];
      const DevLayer& dl = layers[i];
      const uint32_t ratio = d.compress_ratio[i];
      s.window = c.take_n<float>(uint64_t{d.window} * p.head_dim);
      auto comp = [&](const DevComp& cw, DevCompState& cs) {
        cs.kv = c.take_n<float>(uint64_t{ratio} * cw.coff * cw.dim);
        cs.gate = c.take_n<float>(uint64_t{ratio} * cw.coff * cw.dim);
        cs.prev_kv = c.take_n<float>(uint64_t{ratio} * cw.dim);
        cs.prev_gate = c.take_n<float>(uint64_t{ratio} * cw.dim);
      };
      if (dl.has_comp) comp(dl.comp, s.comp);
      if (dl.has_index) comp(dl.index, s.index);
    }
    running_bytes = c.total() - running_at;                       // the same for every sequence
    sq.running = reinterpret_cast<uint8_t*>(sq.state[0].window);  // the region's first buffer
    for (uint32_t i = 0; i < p.n_layer; ++i) {
      DevLayerState& s = sq.state[i];
      const DevLayer& dl = layers[i];
      const uint32_t ratio = d.compress_ratio[i];
      if (dl.has_comp) {
        s.comp.entries = c.take_n<float>(uint64_t{opts.max_context / ratio + 1} * dl.comp.dim);
      }
      if (dl.has_index) {
        s.index.entries = c.take_n<float>(uint64_t{opts.max_context / ratio + 1} * dl.index.dim);
      }
    }
    sq.checkpoints.resize(kCheckpoints);
    for (Checkpoint& cp : sq.checkpoints) {
      cp.running = c.take(running_bytes);
      cp.comps.resize(2 * uint64_t{p.n_layer});
    }
  }
  // decode()'s per-token buffers.
  const uint32_t cdim = std::max(p.head_dim, d.index_dim);
  auto row_bufs = [&](RowBufs& r) {
    r.streams = c.take_n<float>(hc * e);
    r.post = c.take_n<double>(hc);
    r.comb = c.take_n<double>(uint64_t{hc} * hc);
    r.xn = c.take_n<float>(e);
    r.rlogits = c.take_n<float>(uint64_t{1 + depth} * ne);
    r.d_weights = c.take_n<float>(k);
    r.eo = c.take_n<float>(uint64_t{k} * e);
  };
  row_bufs(solo);
  flat = c.take_n<float>(hc * e);
  mixes = c.take_n<float>(uint64_t{2 + hc} * hc);
  pre = c.take_n<double>(hc);
  collapsed = c.take_n<float>(e);
  qr = c.take_n<float>(d.q_lora_rank);
  q = c.take_n<float>(q_dim);
  kv = c.take_n<float>(p.head_dim);
  att = c.take_n<float>(q_dim);
  grouped = c.take_n<float>(uint64_t{d.o_groups} * d.o_lora_rank);
  out = c.take_n<float>(e);
  entry = c.take_n<float>(cdim);
  iq = c.take_n<float>(uint64_t{d.index_heads} * d.index_dim);
  iw = c.take_n<float>(d.index_heads);
  iscore = c.take_n<double>(max_entries);
  chosen = c.take_n<uint32_t>(max_entries);
  score_stride = d.window + max_entries;
  scores = c.take_n<double>(uint64_t{p.n_head} * score_stride);
  pxn = c.take_n<float>(uint64_t{std::max(depth, 1u)} * e);
  gu = c.take_n<float>(2 * uint64_t{k} * p.n_ff_exp);
  hbuf = c.take_n<float>(uint64_t{k} * p.n_ff_exp);
  sg = c.take_n<float>(ff_sh);
  su = c.take_n<float>(ff_sh);
  sout = c.take_n<float>(e);
  d_logits = c.take_n<float>(p.n_vocab);
  // decode_batch()'s rows, each buffer 256-byte aligned as decode()'s (the kernels see the same
  // alignment), and every row's logits.
  if (opts.sequences > 1) {
    brows.resize(opts.sequences);
    for (RowBufs& r : brows) row_bufs(r);
    d_blogits = c.take_n<float>(uint64_t{opts.sequences} * p.n_vocab);
  }
}

Status Ds4GpuEngine::Impl::init() {
  std::string why;
  if (!cuda_device_available(&why)) return make_error(ENODEV, why);
  EXPERTD_CUDA_TRY(cudaSetDevice(gpu.device));
  cudaDeviceProp prop{};
  EXPERTD_CUDA_TRY(cudaGetDeviceProperties(&prop, gpu.device));
  device_name =
      fmt::format("{} (sm_{}{}, {})", prop.name, prop.major, prop.minor, gib(prop.totalGlobalMem));
  if (d.hc == 0 || d.hc > kernels::kDs4MaxHc) {
    return make_error(EINVAL, fmt::format("{}: {} hyper-connection streams; the GPU engine runs "
                                          "1 to {}",
                                          model.path(), d.hc, kernels::kDs4MaxHc));
  }
  if (2 * p.n_expert_used > kernels::kMaxBatch || d.o_groups > kernels::kMaxBatch) {
    return make_error(EINVAL, fmt::format("the GPU engine runs at most top-{} experts and {} "
                                          "output groups; the model has top-{} and {}",
                                          kernels::kMaxBatch / 2, kernels::kMaxBatch,
                                          p.n_expert_used, d.o_groups));
  }
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
  EXPERTD_TRY_ASSIGN(work_mem, gpu::carve_device(
                                   [&](Carver& c) -> Status {
                                     carve_work(c);
                                     return Ok{};
                                   },
                                   [&](uint64_t n) {
                                     return alloc_state(n, opts.max_context, opts.sequences,
                                                        device_name);
                                   }));

  const uint32_t k = p.n_expert_used;
  const uint32_t depth = opts.prefetch_depth;
  const uint64_t rl = uint64_t{1 + depth} * p.n_expert;
  const uint64_t host_floats = rl + k + p.n_vocab;
  EXPERTD_TRY_ASSIGN(host_mem, PinnedBytes::alloc(host_floats * 4));
  solo.h_rlogits = host_mem.get<float>();
  solo.h_weights = solo.h_rlogits + rl;
  h_logits = solo.h_weights + k;
  if (!brows.empty()) {
    const uint64_t rows = brows.size();
    EXPERTD_TRY_ASSIGN(batch_host, PinnedBytes::alloc((rows * (rl + k) + rows * p.n_vocab) * 4));
    float* at = batch_host.get<float>();
    for (RowBufs& r : brows) {
      r.h_rlogits = at;
      r.h_weights = at + rl;
      at += rl + k;
    }
    h_blogits = at;
    bsel.resize(rows * k);
    step_experts.reserve(p.n_expert, uint64_t{rows} * k);
    uses.reserve(rows * k);
    brec.reserve(rows);
  }
  point_at(solo);
  seq = 0;
  cur = &seqs[0];

  // Before the tier: Tier::Auto sizes itself from what is left.
  EXPERTD_TRY(init_prefill());
  experts = std::make_unique<GpuExperts>(model, source, gpu, stats, compute.get(), copy.get());
  EXPERTD_TRY(experts->init(device_name));
  for (uint32_t i = 0; i < p.n_layer; ++i) {
    if (!experts->shape(i).present) {
      return make_error(EINVAL, fmt::format("{}: layer {} has no routed experts", model.path(), i));
    }
  }

  probs.resize(p.n_expert);
  sel.resize(p.n_expert);
  order.resize(p.n_expert);
  selected.resize(k);
  weights.resize(k);
  ready.resize(k);
  ptrs.resize(k);
  // A batch step hints every hash layer's experts of all its rows at once.
  hash_hints.reserve(uint64_t{d.hash_layers} *
                     std::min<uint64_t>(p.n_expert, uint64_t{opts.sequences} * k));
  for (Seq& sq : seqs) sq.fed.resize(opts.max_context);
  return Ok{};
}

void Ds4GpuEngine::Impl::point_at(const RowBufs& r) {
  streams = r.streams;
  post = r.post;
  comb = r.comb;
  xn = r.xn;
  rlogits = r.rlogits;
  d_weights = r.d_weights;
  eo = r.eo;
  h_rlogits = r.h_rlogits;
  h_weights = r.h_weights;
}

Status Ds4GpuEngine::Impl::mv(const DevMat& m, const float* x, float* y) {
  EXPERTD_CUDA_TRY(
      kernels::matvec(m.type, m.data, m.row_bytes, m.rows, m.cols, x, y, compute.get()));
  return Ok{};
}

Status Ds4GpuEngine::Impl::hc_mix(const DevMat& fn, const float* scale, const float* base) {
  const uint32_t hc = d.hc;
  const cudaStream_t s = compute.get();
  EXPERTD_CUDA_TRY(kernels::ds4_rms_norm(streams, nullptr, flat, 1, hc * p.n_embd, p.rms_eps, s));
  EXPERTD_TRY(mv(fn, flat, mixes));
  EXPERTD_CUDA_TRY(
      kernels::ds4_hc_weights(mixes, scale, base, hc, d.hc_iters, d.hc_eps, pre, post, comb, s));
  EXPERTD_CUDA_TRY(kernels::ds4_hc_collapse(streams, pre, hc, p.n_embd, collapsed, s));
  return Ok{};
}

Status Ds4GpuEngine::Impl::hc_expand() {
  EXPERTD_CUDA_TRY(kernels::ds4_hc_expand(streams, out, post, comb, d.hc, p.n_embd, compute.get()));
  return Ok{};
}

Status Ds4GpuEngine::Impl::compress(const DevComp& cw, DevCompState& s, uint32_t ratio) {
  const cudaStream_t st = compute.get();
  const uint32_t dim = cw.dim;
  const uint64_t width = uint64_t{cw.coff} * dim;
  const uint32_t j = cur->pos % ratio;
  float* kvj = s.kv + j * width;
  float* gj = s.gate + j * width;
  EXPERTD_TRY(mv(cw.wkv, xn, kvj));
  EXPERTD_TRY(mv(cw.wgate, xn, gj));
  EXPERTD_CUDA_TRY(kernels::add(gj, cw.ape + j * width, static_cast<uint32_t>(width), st));
  if (j != ratio - 1) return Ok{};
  const uint32_t n_prev = cw.coff == 2 && s.has_prev ? ratio : 0;
  EXPERTD_CUDA_TRY(kernels::ds4_compress_entry(s.kv, s.gate, s.prev_kv, s.prev_gate, n_prev, ratio,
                                               cw.coff, dim, entry, st));
  if (cw.coff == 2) {  // keep this window's first half for the next entry
    EXPERTD_CUDA_TRY(cudaMemcpy2DAsync(s.prev_kv, uint64_t{dim} * 4, s.kv, width * 4,
                                       uint64_t{dim} * 4, ratio, cudaMemcpyDeviceToDevice, st));
    EXPERTD_CUDA_TRY(cudaMemcpy2DAsync(s.prev_gate, uint64_t{dim} * 4, s.gate, width * 4,
                                       uint64_t{dim} * 4, ratio, cudaMemcpyDeviceToDevice, st));
    s.has_prev = true;
  }
  float* dst = s.entries + uint64_t{s.count} * dim;
  EXPERTD_CUDA_TRY(kernels::ds4_rms_norm(entry, cw.norm, dst, 1, dim, p.rms_eps, st));
  EXPERTD_CUDA_TRY(
      kernels::ds4_rope(dst, 1, dim, p.n_rot, s.count * ratio, freq_compress, false, st));
  ++s.count;
  return Ok{};
}

Status Ds4GpuEngine::Impl::select_entries(uint32_t layer) {
  const DevLayer& dl = layers[layer];
  const DevCompState& s = cur->state[layer].index;
  const cudaStream_t st = compute.get();
  const uint32_t di = d.index_dim;
  EXPERTD_TRY(mv(dl.index_q_b, qr, iq));
  EXPERTD_CUDA_TRY(
      kernels::ds4_rope(iq, d.index_heads, di, p.n_rot, cur->pos, freq_compress, false, st));
  EXPERTD_TRY(mv(dl.index_proj, xn, iw));
  EXPERTD_CUDA_TRY(
      kernels::ds4_index_scores(iq, iw, s.entries, s.count, d.index_heads, di, iscore, st));
  EXPERTD_CUDA_TRY(
      kernels::ds4_top_entries(iscore, s.count, std::min(s.count, d.index_topk), chosen, st));
  return Ok{};
}

Status Ds4GpuEngine::Impl::attention(uint32_t layer) {
  const DevLayer& dl = layers[layer];
  DevLayerState& ls = cur->state[layer];
  const cudaStream_t st = compute.get();
  const uint32_t hd = p.head_dim;
  const Ds4Attention type = d.attention[layer];
  const bool compressed = type != Ds4Attention::Sliding;
  const double* freq = compressed ? freq_compress : freq_main;
  EXPERTD_CUDA_TRY(kernels::ds4_rms_norm(collapsed, dl.attn_norm, xn, 1, p.n_embd, p.rms_eps, st));
  EXPERTD_TRY(mv(dl.wq_a, xn, qr));
  EXPERTD_CUDA_TRY(kernels::ds4_rms_norm(qr, dl.q_a_norm, qr, 1, d.q_lora_rank, p.rms_eps, st));
  EXPERTD_TRY(mv(dl.wq_b, qr, q));
  EXPERTD_CUDA_TRY(kernels::ds4_rms_norm(q, nullptr, q, p.n_head, hd, p.rms_eps, st));
  EXPERTD_CUDA_TRY(kernels::ds4_rope(q, p.n_head, hd, p.n_rot, cur->pos, freq, false, st));
  EXPERTD_TRY(mv(dl.wkv, xn, kv));
  EXPERTD_CUDA_TRY(kernels::ds4_rms_norm(kv, dl.kv_norm, kv, 1, hd, p.rms_eps, st));
  EXPERTD_CUDA_TRY(kernels::ds4_rope(kv, 1, hd, p.n_rot, cur->pos, freq, false, st));
  EXPERTD_CUDA_TRY(cudaMemcpyAsync(ls.window + uint64_t{cur->pos % d.window} * hd, kv,
                                   uint64_t{hd} * 4, cudaMemcpyDeviceToDevice, st));

  // The compressed entries this position attends: all of an HCA layer's, the indexer's choice of
  // a CSA layer's.
  uint32_t n_entries = 0;
  const float* entries = nullptr;
  const uint32_t* pick = nullptr;
  if (compressed) {
    const uint32_t ratio = d.compress_ratio[layer];
    EXPERTD_TRY(compress(dl.comp, ls.comp, ratio));
    if (dl.has_index) EXPERTD_TRY(compress(dl.index, ls.index, ratio));
    entries = ls.comp.entries;
    if (type == Ds4Attention::Compressed) {
      EXPERTD_TRY(select_entries(layer));
      n_entries = std::min(ls.comp.count, d.index_topk);
      pick = chosen;
    } else {
      n_entries = ls.comp.count;
    }
  }
  const uint32_t first = cur->pos + 1 > d.window ? cur->pos + 1 - d.window : 0;
  const uint32_t n_window = cur->pos + 1 - first;
  EXPERTD_CUDA_TRY(kernels::ds4_attention(q, ls.window, d.window, first, n_window, entries, pick,
                                          n_entries, dl.sinks, p.n_head, hd, scores, score_stride,
                                          att, st));
  EXPERTD_CUDA_TRY(kernels::ds4_rope(att, p.n_head, hd, p.n_rot, cur->pos, freq, true, st));
  // Grouped output projection: group g's heads through rows [g * o_lora_rank, ...) of wo_a.
  const uint64_t gin = uint64_t{p.n_head} * hd / d.o_groups;
  kernels::MatvecBatch b;
  b.count = d.o_groups;
  for (uint32_t g = 0; g < d.o_groups; ++g) {
    b.w[g] = dl.wo_a.data + uint64_t{g} * d.o_lora_rank * dl.wo_a.row_bytes;
    b.x[g] = att + g * gin;
    b.y[g] = grouped + uint64_t{g} * d.o_lora_rank;
  }
  EXPERTD_CUDA_TRY(
      kernels::matvec_batched(dl.wo_a.type, b, dl.wo_a.row_bytes, d.o_lora_rank, dl.wo_a.cols, st));
  return mv(dl.wo_b, grouped, out);
}

void Ds4GpuEngine::Impl::hint_hash_layers(uint32_t token) {
  if (!opts.hash_hints || d.hash_layers == 0) return;
  hash_hints.clear();
  const uint32_t k = p.n_expert_used;
  for (uint32_t layer = 0; layer < d.hash_layers; ++layer) {
    const uint32_t* ex = w.layers[layer].tid2eid.data() + uint64_t{token} * k;
    for (uint32_t i = 0; i < k; ++i) hash_hints.push_back(ExpertHint{layer, ex[i], 1.0f, true});
  }
  stats.hash_hints += hash_hints.size();
  if (!experts->hint_source().prefetch(hash_hints)) ++stats.hint_errors;
}

Status Ds4GpuEngine::Impl::route_logits(uint32_t layer) {
  const cudaStream_t st = compute.get();
  const uint32_t ne = p.n_expert;
  const bool scripted_hints = opts.script != nullptr && opts.hints == HintSource::Script;
  EXPERTD_CUDA_TRY(
      kernels::ds4_rms_norm(collapsed, layers[layer].ffn_norm, xn, 1, p.n_embd, p.rms_eps, st));
  // The routers on the device: this layer's, and the lookahead layers' on the same collapsed
  // stream through their own norms (learned layers only: hash layers were hinted at the token).
  const ScriptedRoute* scripted =
      opts.script != nullptr ? opts.script->find(cur->pos, layer) : nullptr;
  if (scripted == nullptr) EXPERTD_TRY(mv(layers[layer].gate_inp, xn, rlogits));
  uint32_t rows = 1;
  for (uint32_t j = 1; j <= opts.prefetch_depth; ++j) {
    const uint32_t next = layer + j;
    if (next >= p.n_layer || next < d.hash_layers || scripted_hints) continue;
    float* in = pxn + uint64_t{j - 1} * p.n_embd;
    EXPERTD_CUDA_TRY(
        kernels::ds4_rms_norm(collapsed, layers[next].ffn_norm, in, 1, p.n_embd, p.rms_eps, st));
    EXPERTD_TRY(mv(layers[next].gate_inp, in, rlogits + uint64_t{j} * ne));
    rows = j + 1;
  }
  EXPERTD_CUDA_TRY(
      cudaMemcpyAsync(h_rlogits, rlogits, uint64_t{rows} * ne * 4, cudaMemcpyDeviceToHost, st));
  return Ok{};
}

void Ds4GpuEngine::Impl::add_hints(uint32_t layer) {
  // Hints for the next layers, as Ds4CpuEngine::send_hints sends them.
  const uint32_t ne = p.n_expert;
  const bool scripted_hints = opts.script != nullptr && opts.hints == HintSource::Script;
  planner.from_layer(layer);
  for (uint32_t j = 1; j <= opts.prefetch_depth && layer + j < p.n_layer; ++j) {
    const uint32_t next = layer + j;
    if (next < d.hash_layers) continue;  // hinted exactly at the token
    if (scripted_hints) {
      add_scripted_hints(*opts.script, cur->pos, layer, next, planner);
      continue;
    }
    ds4_hint_probs(w.layers[next], std::span<const float>(h_rlogits + uint64_t{j} * ne, ne), probs);
    planner.add_ranked(next, std::span<const double>(probs.data(), ne));
  }
}

Status Ds4GpuEngine::Impl::decide(uint32_t layer, uint32_t token) {
  // The routing decision, as Ds4CpuEngine::route makes it.
  const uint32_t k = p.n_expert_used;
  const uint32_t ne = p.n_expert;
  const bool hash = layer < d.hash_layers;
  const ScriptedRoute* scripted =
      opts.script != nullptr ? opts.script->find(cur->pos, layer) : nullptr;
  if (scripted != nullptr) {
    std::copy(scripted->experts.begin(), scripted->experts.end(), selected.begin());
    std::copy(scripted->weights.begin(), scripted->weights.end(), weights.begin());
    ++stats.scripted_routes;
  } else {
    ds4_route(d, w.layers[layer], hash, token, std::span<const float>(h_rlogits, ne), k, probs, sel,
              order, selected, weights);
  }
  std::memcpy(h_weights, weights.data(), uint64_t{k} * 4);
  EXPERTD_CUDA_TRY(cudaMemcpyAsync(d_weights, h_weights, uint64_t{k} * 4, cudaMemcpyHostToDevice,
                                   compute.get()));
  return Ok{};
}

Status Ds4GpuEngine::Impl::route(uint32_t layer, uint32_t token) {
  const uint32_t k = p.n_expert_used;
  const bool hash = layer < d.hash_layers;
  EXPERTD_TRY(route_logits(layer));
  // Everything launched before (the previous layer's experts among it) has finished.
  EXPERTD_TRY(experts->sync_compute());

  add_hints(layer);
  const std::span<const ExpertHint> hints = planner.take(stats);
  last_hints.assign(hints.begin(), hints.end());
  if (!hints.empty() && !experts->hint_source().prefetch(hints)) ++stats.hint_errors;

  EXPERTD_TRY(decide(layer, token));
  RoutingRecord* rec = nullptr;
  if (routing_log != nullptr) {
    routing_log->push_back(RoutingRecord{cur->pos, layer, selected, weights, {}});
    rec = &routing_log->back();
  }
  if (!hash) planner.routed(layer, std::span<const uint32_t>(selected.data(), k), stats, rec);
  return Ok{};
}

Status Ds4GpuEngine::Impl::moe(uint32_t layer) {
  const cudaStream_t st = compute.get();
  const uint32_t k = p.n_expert_used;
  const bool hash = layer < d.hash_layers;
  const std::span<const uint32_t> chosen_experts(selected.data(), k);
  source.host_ready(layer, chosen_experts, ready);
  uint64_t waited = 0;
  EXPERTD_TRY(experts->acquire(layer, chosen_experts, ptrs, &waited));
  stats.experts_used += k;
  const uint64_t n_ready = static_cast<uint64_t>(std::count(ready.begin(), ready.end(), 1));
  (hash ? stats.hash_experts : stats.learned_experts) += k;
  (hash ? stats.hash_ready : stats.learned_ready) += n_ready;
  (hash ? stats.hash_stall_ns : stats.learned_stall_ns) += waited;

  // gate and up of every expert, the clamped SwiGLU, down.
  EXPERTD_TRY(gpu::run_experts(experts->shape(layer), std::span<const ExpertPtrs>(ptrs.data(), k),
                               p.n_ff_exp, p.n_embd, xn, d.clamp_exp[layer], gu, hbuf, eo, st));
  EXPERTD_TRY(experts->finish_layer());
  return moe_out(layer);
}

Status Ds4GpuEngine::Impl::moe_out(uint32_t layer) {
  const DevLayer& dl = layers[layer];
  const cudaStream_t st = compute.get();
  if (dl.has_shexp) {
    EXPERTD_TRY(mv(dl.shexp_gate, xn, sg));
    EXPERTD_TRY(mv(dl.shexp_up, xn, su));
    EXPERTD_CUDA_TRY(kernels::ds4_swiglu(sg, su, sg, dl.shexp_gate.rows, d.clamp_shexp[layer], st));
    EXPERTD_TRY(mv(dl.shexp_down, sg, sout));
  }
  EXPERTD_CUDA_TRY(kernels::ds4_moe_sum(eo, d_weights, p.n_expert_used,
                                        dl.has_shexp ? sout : nullptr, p.n_embd, out, st));
  return Ok{};
}

Status Ds4GpuEngine::Impl::head_logits(float* dst) {
  // HyperHead: collapse the streams, then the output norm and head.
  const cudaStream_t st = compute.get();
  const uint32_t hc = d.hc;
  EXPERTD_CUDA_TRY(kernels::ds4_rms_norm(streams, nullptr, flat, 1, hc * p.n_embd, p.rms_eps, st));
  EXPERTD_TRY(mv(hc_head_fn, flat, mixes));
  EXPERTD_CUDA_TRY(
      kernels::ds4_hc_head(mixes, w.hc_head_scale, hc_head_base, hc, d.hc_eps, pre, st));
  EXPERTD_CUDA_TRY(kernels::ds4_hc_collapse(streams, pre, hc, p.n_embd, collapsed, st));
  EXPERTD_CUDA_TRY(kernels::ds4_rms_norm(collapsed, output_norm, xn, 1, p.n_embd, p.rms_eps, st));
  return mv(output, xn, dst);
}

Status Ds4GpuEngine::Impl::head(std::span<float> logits) {
  EXPERTD_TRY(head_logits(d_logits));
  return experts->logits_to_host(d_logits, h_logits, logits.first(p.n_vocab));
}

// --- prefill -----------------------------------------------------------------------------------

void Ds4GpuEngine::Impl::carve_chunk(Carver& c) {
  const uint64_t n = chunk;
  const uint64_t hc = d.hc;
  const uint64_t e = p.n_embd;
  const uint64_t k = p.n_expert_used;
  const uint64_t ff = p.n_ff_exp;
  cstreams = c.take_n<float>(n * hc * e);
  cpost = c.take_n<double>(n * hc);
  ccomb = c.take_n<double>(n * hc * hc);
  cxn = c.take_n<float>(n * e);
  crl = c.take_n<float>(n * (1 + opts.prefetch_depth) * p.n_expert);
  d_cw = c.take_n<float>(n * k);
  rows_scratch.d_index = c.take_n<uint32_t>(gpu::RowsScratch::host_words(p, n));
  rows_scratch.xe = c.take_n<float>(n * e);
  rows_scratch.hg = c.take_n<float>(n * ff);
  rows_scratch.hu = c.take_n<float>(n * ff);
  rows_scratch.down = c.take_n<float>(n * e);
  ceo = c.take_n<float>(n * k * e);
  cmoe = c.take_n<float>(n * e);
  rows_scratch.w = c.take_n<float>(ff * e);
}

Status Ds4GpuEngine::Impl::init_prefill() {
  chunk = std::max(1u, std::min(opts.prefill_chunk, opts.max_context));
  Carver cc;
  carve_chunk(cc);
  chunk_bytes = cc.total();
  Result<DeviceBytes> mem = DeviceBytes::alloc(chunk_bytes);
  if (!mem) {
    return make_error(ENOMEM, fmt::format("cannot allocate {} ({} bytes) of device memory for the "
                                          "prefill scratch of {} positions (--prefill-chunk) on {}",
                                          gib(chunk_bytes), chunk_bytes, chunk, device_name));
  }
  chunk_mem = std::move(*mem);
  cc.start(chunk_mem.get());
  carve_chunk(cc);
  const uint64_t k = p.n_expert_used;
  const uint64_t rl = uint64_t{chunk} * (1 + opts.prefetch_depth) * p.n_expert;
  EXPERTD_TRY_ASSIGN(
      chunk_host,
      PinnedBytes::alloc((rl + uint64_t{chunk} * k + gpu::RowsScratch::host_words(p, chunk)) * 4));
  h_crl = chunk_host.get<float>();
  h_cw = h_crl + rl;
  rows_scratch.h_index = reinterpret_cast<uint32_t*>(h_cw + uint64_t{chunk} * k);
  EXPERTD_TRY_ASSIGN(blas, CublasHandle::create(compute.get()));
  EXPERTD_CUBLAS_TRY(cublasSetPointerMode(blas.get(), CUBLAS_POINTER_MODE_HOST));
  EXPERTD_CUBLAS_TRY(cublasSetMathMode(blas.get(), CUBLAS_PEDANTIC_MATH));  // true f32, no TF32
  rows_scratch.groups.reserve(p.n_expert, uint64_t{chunk} * k);
  csel.resize(uint64_t{chunk} * k);
  cweights.resize(uint64_t{chunk} * k);
  exact.resize(p.n_expert);
  hash_mark.resize(p.n_expert);
  return Ok{};
}

Status Ds4GpuEngine::Impl::gemm(const float* wt, uint32_t out_cols, uint32_t in_cols,
                                const float* in, uint32_t rows, float* o) {
  // o[rows][out_cols] = in[rows][in_cols] wt^T, wt row-major [out_cols][in_cols].
  return gpu::sgemm_rows(blas.get(), wt, out_cols, in_cols, in, rows, o);
}

Status Ds4GpuEngine::Impl::chunk_attention(uint32_t layer, uint32_t i) {
  // decode()'s per-position code on row i: the caller points streams, post and comb at the row's
  // chunk buffers and pos at its position.
  const DevLayer& l = layers[layer];
  const cudaStream_t st = compute.get();
  const uint32_t ne = p.n_expert;
  EXPERTD_TRY(hc_mix(l.hc_attn_fn, l.hc_attn_scale, l.hc_attn_base));
  EXPERTD_TRY(attention(layer));
  EXPERTD_TRY(hc_expand());
  EXPERTD_TRY(hc_mix(l.hc_ffn_fn, l.hc_ffn_scale, l.hc_ffn_base));
  float* x = cxn + uint64_t{i} * p.n_embd;
  float* rl = crl + uint64_t{i} * (1 + opts.prefetch_depth) * ne;
  EXPERTD_CUDA_TRY(kernels::ds4_rms_norm(collapsed, l.ffn_norm, x, 1, p.n_embd, p.rms_eps, st));
  EXPERTD_TRY(mv(l.gate_inp, x, rl));
  // The lookahead routers on this position's collapsed stream, as route() runs them.
  const bool scripted_hints = opts.script != nullptr && opts.hints == HintSource::Script;
  for (uint32_t j = 1; j <= opts.prefetch_depth && !scripted_hints; ++j) {
    const uint32_t next = layer + j;
    if (next >= p.n_layer || next < d.hash_layers) continue;
    EXPERTD_CUDA_TRY(
        kernels::ds4_rms_norm(collapsed, layers[next].ffn_norm, pxn, 1, p.n_embd, p.rms_eps, st));
    EXPERTD_TRY(mv(layers[next].gate_inp, pxn, rl + uint64_t{j} * ne));
  }
  return Ok{};
}

void Ds4GpuEngine::Impl::chunk_route(uint32_t layer, std::span<const uint32_t> tokens) {
  // Each position's lookahead hints and routing decision, as Ds4CpuEngine::prefill_chunk makes
  // them (pos walks the chunk for the script).
  const uint32_t k = p.n_expert_used;
  const uint32_t ne = p.n_expert;
  const bool hash = layer < d.hash_layers;
  const bool scripted_hints = opts.script != nullptr && opts.hints == HintSource::Script;
  const uint32_t p0 = cur->pos;
  for (uint32_t i = 0; i < tokens.size(); ++i) {
    cur->pos = p0 + i;
    const float* rl = h_crl + uint64_t{i} * (1 + opts.prefetch_depth) * ne;
    planner.from_layer(layer);
    for (uint32_t j = 1; j <= opts.prefetch_depth && layer + j < p.n_layer; ++j) {
      const uint32_t next = layer + j;
      if (next < d.hash_layers) continue;  // hinted exactly at the chunk
      if (scripted_hints) {
        add_scripted_hints(*opts.script, cur->pos, layer, next, planner);
        continue;
      }
      ds4_hint_probs(w.layers[next], std::span<const float>(rl + uint64_t{j} * ne, ne), probs);
      planner.add_ranked(next, std::span<const double>(probs.data(), ne));
    }
    const std::span<uint32_t> route(csel.data() + uint64_t{i} * k, k);
    const std::span<float> wts(cweights.data() + uint64_t{i} * k, k);
    if (!take_scripted_route(opts, cur->pos, layer, route, wts, stats)) {
      ds4_route(d, w.layers[layer], hash, tokens[i], std::span<const float>(rl, ne), k, probs, sel,
                order, route, wts);
    }
    log_route(routing_log, cur->pos, layer, route, wts);
  }
  cur->pos = p0;
  // The lookahead's candidates, at most what the daemon's slots keep beside this layer's experts
  // (hinted next, in prefill_moe).
  const std::span<const ExpertHint> hints = planner.take(stats);
  const uint64_t budget = experts->hint_budget();
  const uint64_t room = budget > p.n_expert ? budget - p.n_expert : 0;
  const uint64_t send = std::min<uint64_t>(hints.size(), room);
  stats.prefill_hints_held += hints.size() - send;
  stats.prefill_lookahead_hints += send;
  if (send > 0 && !experts->hint_source().prefetch(hints.first(send))) ++stats.hint_errors;
}

Status Ds4GpuEngine::Impl::prefill_moe(uint32_t layer, uint32_t n) {
  const DevLayer& dl = layers[layer];
  const cudaStream_t st = compute.get();
  const uint32_t k = p.n_expert_used;
  const uint32_t e = p.n_embd;
  const uint64_t rk = uint64_t{n} * k;
  const bool hash = layer < d.hash_layers;
  // The layer's groups, built by the caller (run_experts_by_rows builds the same from csel).
  const std::span<const uint32_t> needed = rows_scratch.groups.needed();
  const auto n_needed = static_cast<uint32_t>(needed.size());
  // Learned layers: every needed expert hinted before any is acquired (hash layers were hinted
  // at the chunk's start), as many as the daemon's slots keep until their acquire; the rest as
  // the groups' acquires free room (a learned layer of a chunk wants ~250 of 256 experts: hinted
  // at once beyond the cache, they were read, evicted unused and read again).
  const bool exact_hints = !hash && n_needed > k;
  const uint64_t budget = experts->hint_budget();
  gpu::RowsHints hints{std::span<const ExpertHint>(exact.data(), n_needed), 0, budget};
  if (exact_hints) {
    for (uint32_t i = 0; i < n_needed; ++i) exact[i] = ExpertHint{layer, needed[i], 1.0f, true};
    experts->hint_within(hints.exact, 0, budget, hints.sent, stats);
    stats.prefill_hints_held += n_needed - hints.sent;
  }
  if (!source.set_cursor(cur->pos + n - 1, layer)) ++stats.hint_errors;

  // The weights (the previous layer's upload is done: the layer's router copy synchronised the
  // stream), then the experts held at most top-k at a time (what a daemon cache sized for decode
  // can hold), each applied to all its rows as GEMMs, the holds given back once their kernels are
  // done; each group's readiness and wait counted as a hash or a learned layer's.
  std::copy_n(cweights.data(), rk, h_cw);
  EXPERTD_CUDA_TRY(cudaMemcpyAsync(d_cw, h_cw, rk * 4, cudaMemcpyHostToDevice, st));
  gpu::RowsOptions o;
  o.ds4_clamp = d.clamp_exp[layer];
  if (exact_hints) o.hints = &hints;
  o.before_acquire = [&](std::span<const uint32_t> group) {
    source.host_ready(layer, group, std::span<uint8_t>(ready.data(), group.size()));
  };
  o.acquired = [&](std::span<const uint32_t> group, uint64_t waited) {
    const auto n_ready =
        static_cast<uint64_t>(std::count(ready.begin(), ready.begin() + group.size(), 1));
    (hash ? stats.hash_experts : stats.learned_experts) += group.size();
    (hash ? stats.hash_ready : stats.learned_ready) += n_ready;
    (hash ? stats.hash_stall_ns : stats.learned_stall_ns) += waited;
  };
  EXPERTD_TRY(gpu::run_experts_by_rows(
      *experts, blas.get(), layer, n, std::span<const uint32_t>(csel.data(), rk), cxn, e,
      std::span<ExpertPtrs>(ptrs.data(), k), p, rows_scratch, ceo, stats, st, o));
  stats.prefill_experts += n_needed;
  // Per position, as decode() does: the shared expert, then the routed slots summed in route
  // order with it.
  for (uint32_t i = 0; i < n; ++i) {
    const float* x = cxn + uint64_t{i} * e;
    if (dl.has_shexp) {
      EXPERTD_TRY(mv(dl.shexp_gate, x, sg));
      EXPERTD_TRY(mv(dl.shexp_up, x, su));
      EXPERTD_CUDA_TRY(
          kernels::ds4_swiglu(sg, su, sg, dl.shexp_gate.rows, d.clamp_shexp[layer], st));
      EXPERTD_TRY(mv(dl.shexp_down, sg, sout));
    }
    EXPERTD_CUDA_TRY(kernels::ds4_moe_sum(ceo + uint64_t{i} * k * e, d_cw + uint64_t{i} * k, k,
                                          dl.has_shexp ? sout : nullptr, e, cmoe + uint64_t{i} * e,
                                          st));
  }
  return Ok{};
}

Status Ds4GpuEngine::Impl::prefill_chunk(std::span<const uint32_t> tokens,
                                         std::span<float> logits) {
  // One pass over the layers: the tier keeps the residents of the layers it has not reached.
  const gpu::TierSweep sweep(*experts, tokens.size());
  const auto n = static_cast<uint32_t>(tokens.size());
  const cudaStream_t st = compute.get();
  const uint32_t hc = d.hc;
  const uint64_t e = p.n_embd;
  const uint64_t se = hc * e;  // one position's streams
  const uint32_t p0 = cur->pos;
  const uint32_t last = p0 + n - 1;
  for (uint32_t i = 0; i < n; ++i) {
    float* s = cstreams + i * se;
    EXPERTD_CUDA_TRY(
        kernels::dequantize(embd.type, embd.data + uint64_t{tokens[i]} * embd.row_bytes, s, e, st));
    for (uint32_t h = 1; h < hc; ++h) {
      EXPERTD_CUDA_TRY(cudaMemcpyAsync(s + h * e, s, e * 4, cudaMemcpyDeviceToDevice, st));
    }
  }
  const size_t logged = routing_log != nullptr ? routing_log->size() : 0;
  // The chunk is one pass over the layers (see CpuEngine::prefill_chunk): the cursor names its
  // last position and starts before layer 0, so the hints below target this pass.
  planner.begin_token();
  start_prefill_cursor(source, last, p.n_layer, stats);
  const bool hash_hints_on = opts.hash_hints && d.hash_layers > 0;
  if (hash_hints_on) {
    hint_hash_layer(experts->hint_source(), w, 0, p.n_expert_used, tokens, hash_mark, hash_hints,
                    stats);
  }
  float* const streams0 = streams;
  double* const post0 = post;
  double* const comb0 = comb;
  for (uint32_t layer = 0; layer < p.n_layer; ++layer) {
    if (hash_hints_on && layer + 1 < d.hash_layers) {  // one hash layer ahead
      hint_hash_layer(experts->hint_source(), w, layer + 1, p.n_expert_used, tokens, hash_mark,
                      hash_hints, stats);
    }
    // Position by position in order: the window and compressors advance one position at a time.
    // decode()'s code runs on each row's own streams and mixes in place.
    Status s = Ok{};
    for (uint32_t i = 0; i < n && s; ++i) {
      cur->pos = p0 + i;
      streams = cstreams + i * se;
      post = cpost + uint64_t{i} * hc;
      comb = ccomb + uint64_t{i} * hc * hc;
      s = chunk_attention(layer, i);
    }
    streams = streams0;
    post = post0;
    comb = comb0;
    cur->pos = p0;
    EXPERTD_TRY(std::move(s));
    // The chunk's router logits: one copy, one sync per layer.
    const uint64_t rl = uint64_t{n} * (1 + opts.prefetch_depth) * p.n_expert;
    EXPERTD_CUDA_TRY(cudaMemcpyAsync(h_crl, crl, rl * 4, cudaMemcpyDeviceToHost, st));
    EXPERTD_TRY(experts->sync_compute());
    // This layer's records start here: the chunk's predictions go to them, not to earlier layers'.
    const size_t layer_first = routing_log != nullptr ? routing_log->size() : 0;
    chunk_route(layer, tokens);
    ExpertGroups& groups = rows_scratch.groups;
    groups.build(std::span<const uint32_t>(csel.data(), uint64_t{n} * p.n_expert_used));
    if (layer >= d.hash_layers) {
      routed_chunk(planner, layer, groups.needed(), stats, routing_log, layer_first);
    }
    EXPERTD_TRY(prefill_moe(layer, n));
    // Each position's MoE output goes into its streams with its own post and comb.
    for (uint32_t i = 0; i < n; ++i) {
      EXPERTD_CUDA_TRY(kernels::ds4_hc_expand(cstreams + i * se, cmoe + i * e,
                                              cpost + uint64_t{i} * hc,
                                              ccomb + uint64_t{i} * hc * hc, hc, p.n_embd, st));
    }
  }
  if (!logits.empty()) {
    streams = cstreams + (n - 1) * se;
    Status s = head(logits);
    streams = streams0;
    EXPERTD_TRY(std::move(s));
  } else {
    EXPERTD_CUDA_TRY(gpu::timed_sync(st, stats));
    EXPERTD_TRY(experts->release_demand_holds());
    EXPERTD_TRY(experts->release_finished_prefetch_holds(false));
  }
  cur->pos = p0 + n;
  // Token-major routing records (the chunk logged them layer by layer), the positions counted.
  finish_prefill_chunk(routing_log, logged, n, stats);
  if (replaying) return Ok{};  // truncate() feeds ids from `fed` and keeps only its last position
  std::copy(tokens.begin(), tokens.end(), cur->fed.begin() + p0);
  return save_checkpoint();
}

// --- truncate ----------------------------------------------------------------------------------

void Ds4GpuEngine::Impl::reset() {
  cur->pos = 0;
  cur->saved.clear();
  for (DevLayerState& s : cur->state) {
    s.comp.count = s.index.count = 0;
    s.comp.has_prev = s.index.has_prev = false;
  }
}

Status Ds4GpuEngine::Impl::save_checkpoint() {
  const int slot = cur->saved.pick(cur->pos);
  if (slot < 0) return Ok{};
  Checkpoint& cp = cur->checkpoints[slot];
  // On the compute stream, which writes the state: after every kernel of the positions before
  // pos, before any of the next one.
  EXPERTD_CUDA_TRY(cudaMemcpyAsync(cp.running, cur->running, running_bytes,
                                   cudaMemcpyDeviceToDevice, compute.get()));
  for (uint32_t i = 0; i < p.n_layer; ++i) {
    cp.comps[2 * i] = HostComp{cur->state[i].comp.count, cur->state[i].comp.has_prev};
    cp.comps[2 * i + 1] = HostComp{cur->state[i].index.count, cur->state[i].index.has_prev};
  }
  cur->saved.hold(slot, cur->pos);
  return Ok{};
}

Status Ds4GpuEngine::Impl::restore_checkpoint(int slot) {
  const Checkpoint& cp = cur->checkpoints[slot];
  // Ordered, on the compute stream, after the work of the positions being dropped and before the
  // prefill that follows.
  EXPERTD_CUDA_TRY(cudaMemcpyAsync(cur->running, cp.running, running_bytes,
                                   cudaMemcpyDeviceToDevice, compute.get()));
  for (uint32_t i = 0; i < p.n_layer; ++i) {
    cur->state[i].comp.count = cp.comps[2 * i].count;
    cur->state[i].comp.has_prev = cp.comps[2 * i].has_prev;
    cur->state[i].index.count = cp.comps[2 * i + 1].count;
    cur->state[i].index.has_prev = cp.comps[2 * i + 1].has_prev;
  }
  cur->pos = cur->saved.pos(slot);
  return Ok{};
}

bool Ds4GpuEngine::Impl::truncate(uint32_t n) {
  if (n == cur->pos) return true;
  if (n > cur->pos) return false;
  // The latest checkpoint at or before n (position 0 is the reset state).
  const int best = cur->saved.latest_at_or_before(n);
  Status st = Ok{};
  if (best >= 0) {
    st = restore_checkpoint(best);
  } else {
    reset();  // position 0; fed keeps the ids
  }
  // Feed [pos, n) again in prefill chunks, from the ids kept. Only n is kept as a checkpoint: the
  // chunk ends on the way would push out the older ones.
  replaying = true;
  while (st && cur->pos < n) {
    const uint32_t m = std::min(chunk, n - cur->pos);
    refed += m;
    st = prefill_chunk(std::span<const uint32_t>(cur->fed.data() + cur->pos, m), {});
  }
  replaying = false;
  if (st && cur->pos > 0) st = save_checkpoint();
  if (!st) {
    reset();
    return false;
  }
  return true;
}

// --- decode_batch: one step of several sequences ------------------------------------------------

void Ds4GpuEngine::Impl::hint_hash_rows(std::span<const BatchRow> rows) {
  if (!opts.hash_hints || d.hash_layers == 0) return;
  hash_hints.clear();
  const uint32_t k = p.n_expert_used;
  for (uint32_t layer = 0; layer < d.hash_layers; ++layer) {
    std::fill(hash_mark.begin(), hash_mark.end(), 0);
    const uint32_t* tid2eid = w.layers[layer].tid2eid.data();
    for (const BatchRow& r : rows) {
      for (uint32_t i = 0; i < k; ++i) {
        const uint32_t ex = tid2eid[uint64_t{r.token} * k + i];
        if (ex >= hash_mark.size() || hash_mark[ex] != 0) continue;
        hash_mark[ex] = 1;
        hash_hints.push_back(ExpertHint{layer, ex, 1.0f, true});
      }
    }
  }
  std::fill(hash_mark.begin(), hash_mark.end(), 0);
  stats.hash_hints += hash_hints.size();
  if (!hash_hints.empty() && !experts->hint_source().prefetch(hash_hints)) ++stats.hint_errors;
}

Status Ds4GpuEngine::Impl::run_uses(uint32_t layer, std::span<const ExpertUse> list) {
  // gpu::run_experts as decode() calls it (k experts on one x), on up to k uses of different rows:
  // the same launches with the same shapes -- 2k gate and up jobs (or one matvec each), the
  // clamped SwiGLU over decode()'s gu into hbuf, k down jobs. The quantised matvec picks its
  // kernel (split-K or not) from the job count too, so a launch never has fewer jobs than
  // decode()'s: the jobs past the uses repeat the first use into decode()'s own scratch (gu's,
  // hbuf's and solo.eo's unused slots). Each job's result depends only on its own weights and
  // vector, and SwiGLU is elementwise, so each use's output is the bits decode() computes for it.
  const GpuExperts::LayerShape& sh = experts->shape(layer);
  const cudaStream_t st = compute.get();
  const uint32_t k = p.n_expert_used;
  const auto m = static_cast<uint32_t>(list.size());
  const uint64_t ff = p.n_ff_exp;
  const uint32_t e = p.n_embd;
  if (m == 0) return Ok{};
  if (sh.gate.type == sh.up.type && sh.gate.row_bytes == sh.up.row_bytes) {
    kernels::MatvecBatch b;
    b.count = 2 * k;
    for (uint32_t j = 0; j < k; ++j) {
      const ExpertUse& u = list[j < m ? j : 0];
      b.w[j] = u.w.gate;
      b.x[j] = u.x;
      b.y[j] = gu + j * ff;
      b.w[k + j] = u.w.up;
      b.x[k + j] = u.x;
      b.y[k + j] = gu + (k + j) * ff;
    }
    EXPERTD_CUDA_TRY(kernels::matvec_batched(sh.gate.type, b, sh.gate.row_bytes,
                                             static_cast<uint32_t>(ff), e, st));
  } else {
    for (uint32_t j = 0; j < m; ++j) {
      EXPERTD_CUDA_TRY(kernels::matvec(sh.gate.type, list[j].w.gate, sh.gate.row_bytes,
                                       static_cast<uint32_t>(ff), e, list[j].x, gu + j * ff, st));
      EXPERTD_CUDA_TRY(kernels::matvec(sh.up.type, list[j].w.up, sh.up.row_bytes,
                                       static_cast<uint32_t>(ff), e, list[j].x, gu + (k + j) * ff,
                                       st));
    }
  }
  EXPERTD_CUDA_TRY(kernels::ds4_swiglu(gu, gu + uint64_t{k} * ff, hbuf, uint64_t{m} * ff,
                                       d.clamp_exp[layer], st));
  kernels::MatvecBatch b;
  b.count = k;
  for (uint32_t j = 0; j < k; ++j) {
    const uint32_t from = j < m ? j : 0;
    b.w[j] = list[from].w.down;
    b.x[j] = hbuf + from * ff;
    b.y[j] = j < m ? list[j].out : solo.eo + uint64_t{j} * e;
  }
  EXPERTD_CUDA_TRY(kernels::matvec_batched(sh.down.type, b, sh.down.row_bytes, e,
                                           static_cast<uint32_t>(ff), st));
  return Ok{};
}

Status Ds4GpuEngine::Impl::batch_moe(uint32_t layer, uint32_t rows) {
  const uint32_t k = p.n_expert_used;
  const uint64_t e = p.n_embd;
  const bool hash = layer < d.hash_layers;
  // Each distinct expert of the step acquired once (gpu::StepExperts) and applied to every row
  // that routes to it with decode()'s kernels (run_uses, k uses a launch as decode()'s), into the
  // row's eo at the route slot's place; the hash / learned counters count the step's acquires
  // (distinct experts), as prefill's do.
  return step_experts.run(
      *experts, layer, std::span<const uint32_t>(bsel.data(), uint64_t{rows} * k), k, ptrs, stats,
      [&](std::span<const uint32_t>, std::span<const gpu::StepUse> list) -> Status {
        uses.clear();
        for (const gpu::StepUse& u : list) {
          uses.push_back(ExpertUse{ptrs[u.expert], brows[u.row].xn, brows[u.row].eo + u.slot * e});
        }
        for (size_t u0 = 0; u0 < uses.size(); u0 += k) {
          EXPERTD_TRY(run_uses(
              layer,
              std::span<const ExpertUse>(uses.data() + u0, std::min<size_t>(k, uses.size() - u0))));
        }
        return Ok{};
      },
      [&](std::span<const uint32_t> group) {
        source.host_ready(layer, group, std::span<uint8_t>(ready.data(), group.size()));
      },
      [&](std::span<const uint32_t> group, uint64_t waited) {
        const auto n_ready = static_cast<uint64_t>(
            std::count(ready.begin(), ready.begin() + group.size(), uint8_t{1}));
        (hash ? stats.hash_experts : stats.learned_experts) += group.size();
        (hash ? stats.hash_ready : stats.learned_ready) += n_ready;
        (hash ? stats.hash_stall_ns : stats.learned_stall_ns) += waited;
      });
}

Status Ds4GpuEngine::Impl::decode_batch(std::span<const BatchRow> rows, std::span<float> logits) {
  const auto n = static_cast<uint32_t>(rows.size());
  const uint32_t k = p.n_expert_used;
  const uint64_t e = p.n_embd;
  const uint64_t v = p.n_vocab;
  const cudaStream_t st = compute.get();
  EXPERTD_TRY(check_batch_room(rows, opts.max_context,
                               [&](uint32_t s) -> uint32_t { return seqs[s].pos; }));
  const uint64_t t0 = monotonic_ns();
  // decode()'s per-token code works on row i: its sequence's state and position, its buffers.
  auto use_row = [&](uint32_t i) {
    cur = &seqs[rows[i].sequence];
    point_at(brows[i]);
  };
  auto forward = [&]() -> Status {
    uint32_t last = 0;
    for (uint32_t i = 0; i < n; ++i) {
      last = std::max(last, seqs[rows[i].sequence].pos);
      float* s = brows[i].streams;
      EXPERTD_CUDA_TRY(kernels::dequantize(
          embd.type, embd.data + uint64_t{rows[i].token} * embd.row_bytes, s, e, st));
      for (uint32_t h = 1; h < d.hc; ++h) {
        EXPERTD_CUDA_TRY(cudaMemcpyAsync(s + h * e, s, e * 4, cudaMemcpyDeviceToDevice, st));
      }
    }
    planner.begin_token();  // one step: each (layer, expert) hinted once for all the rows
    hint_hash_rows(rows);
    for (uint32_t layer = 0; layer < p.n_layer; ++layer) {
      if (!source.set_cursor(last, layer)) ++stats.hint_errors;
      const DevLayer& l = layers[layer];
      const bool hash = layer < d.hash_layers;
      // Each row's attention on its own sequence, its FFN-site mix and its routers' logits.
      for (uint32_t i = 0; i < n; ++i) {
        use_row(i);
        EXPERTD_TRY(hc_mix(l.hc_attn_fn, l.hc_attn_scale, l.hc_attn_base));
        EXPERTD_TRY(attention(layer));
        EXPERTD_TRY(hc_expand());
        EXPERTD_TRY(hc_mix(l.hc_ffn_fn, l.hc_ffn_scale, l.hc_ffn_base));
        EXPERTD_TRY(route_logits(layer));
      }
      // One sync for the rows' logits (the previous layer's experts have finished too).
      EXPERTD_TRY(experts->sync_compute());
      // Each row's candidates and routing decision; the candidates go out once each, scored by
      // all the rows, in one message.
      brec.clear();
      for (uint32_t i = 0; i < n; ++i) {
        use_row(i);
        add_hints(layer);
        EXPERTD_TRY(decide(layer, rows[i].token));
        std::copy(selected.begin(), selected.end(), bsel.begin() + uint64_t{i} * k);
        if (routing_log != nullptr) {
          routing_log->push_back(RoutingRecord{cur->pos, layer, selected, weights, {}});
          brec.push_back(routing_log->size() - 1);
        } else {
          brec.push_back(SIZE_MAX);
        }
      }
      const std::span<const ExpertHint> hints = planner.take(stats);
      last_hints.assign(hints.begin(), hints.end());
      if (!hints.empty() && !experts->hint_source().prefetch(hints)) ++stats.hint_errors;
      for (uint32_t i = 0; i < n && !hash; ++i) {
        const size_t r = brec[i];
        planner.routed(layer, std::span<const uint32_t>(bsel.data() + uint64_t{i} * k, k), stats,
                       r == SIZE_MAX ? nullptr : &(*routing_log)[r]);
      }
      EXPERTD_TRY(batch_moe(layer, n));
      for (uint32_t i = 0; i < n; ++i) {
        use_row(i);
        EXPERTD_TRY(moe_out(layer));
        EXPERTD_TRY(hc_expand());
      }
      EXPERTD_TRY(experts->prefetch(layer, opts.prefetch_depth, p.n_layer, last_hints));
    }
    // decode()'s head for each row, the logits back in one copy.
    for (uint32_t i = 0; i < n; ++i) {
      use_row(i);
      EXPERTD_TRY(head_logits(d_blogits + i * v));
    }
    return experts->logits_to_host(d_blogits, h_blogits, logits.first(n * v));
  };
  Status done = forward();
  point_at(solo);
  cur = &seqs[seq];
  if (!done) return done;
  experts->measure_tiers();
  // Every row's sequence moves on, then decode()'s checkpoints are saved (a failed save leaves
  // no row behind the device state it already holds).
  for (uint32_t i = 0; i < n; ++i) {
    Seq& s = seqs[rows[i].sequence];
    s.fed[s.pos] = rows[i].token;
    ++s.pos;
  }
  for (uint32_t i = 0; i < n && done; ++i) {
    cur = &seqs[rows[i].sequence];
    if (cur->pos % kCheckpointEvery == 0) done = save_checkpoint();
  }
  cur = &seqs[seq];
  count_batch_step(stats, n, t0);
  return done;
}

// --- Ds4GpuEngine ------------------------------------------------------------------------------

Ds4GpuEngine::Ds4GpuEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Ds4GpuEngine::~Ds4GpuEngine() = default;

Result<std::unique_ptr<Ds4GpuEngine>> Ds4GpuEngine::create(const DenseModel& model,
                                                           ExpertSource& source,
                                                           const EngineOptions& options,
                                                           const GpuOptions& gpu) {
  EXPERTD_TRY(check_ds4_engine(model, options, GpuEngine::kMaxSequences));
  auto impl = std::make_unique<Impl>(model, source, options, gpu);
  EXPERTD_TRY(impl->init());
  return std::unique_ptr<Ds4GpuEngine>(new Ds4GpuEngine(std::move(impl)));
}

Status Ds4GpuEngine::decode(uint32_t token, std::span<float> logits) {
  Impl& m = *impl_;
  const ModelParams& p = m.p;
  Seq& sq = *m.cur;
  EXPERTD_TRY(check_decode(p, m.opts, sq.pos, token, logits.size()));
  const uint64_t t0 = monotonic_ns();
  const cudaStream_t st = m.compute.get();
  const uint64_t e = p.n_embd;
  EXPERTD_CUDA_TRY(kernels::dequantize(
      m.embd.type, m.embd.data + uint64_t{token} * m.embd.row_bytes, m.streams, e, st));
  for (uint32_t i = 1; i < m.d.hc; ++i) {
    EXPERTD_CUDA_TRY(
        cudaMemcpyAsync(m.streams + i * e, m.streams, e * 4, cudaMemcpyDeviceToDevice, st));
  }
  m.planner.begin_token();
  m.hint_hash_layers(token);
  for (uint32_t layer = 0; layer < p.n_layer; ++layer) {
    if (!m.source.set_cursor(sq.pos, layer)) ++m.stats.hint_errors;
    const DevLayer& l = m.layers[layer];
    EXPERTD_TRY(m.hc_mix(l.hc_attn_fn, l.hc_attn_scale, l.hc_attn_base));
    EXPERTD_TRY(m.attention(layer));
    EXPERTD_TRY(m.hc_expand());
    EXPERTD_TRY(m.hc_mix(l.hc_ffn_fn, l.hc_ffn_scale, l.hc_ffn_base));
    EXPERTD_TRY(m.route(layer, token));
    EXPERTD_TRY(m.moe(layer));
    EXPERTD_TRY(m.hc_expand());
    EXPERTD_TRY(m.experts->prefetch(layer, m.opts.prefetch_depth, p.n_layer, m.last_hints));
  }
  EXPERTD_TRY(m.head(logits));
  m.experts->measure_tiers();
  sq.fed[sq.pos] = token;
  ++sq.pos;
  ++m.stats.tokens;
  if (sq.pos % kCheckpointEvery == 0) EXPERTD_TRY(m.save_checkpoint());
  m.stats.decode_ns += monotonic_ns() - t0;
  return Ok{};
}

uint32_t Ds4GpuEngine::prefill_chunk_size() const { return impl_->chunk; }

Status Ds4GpuEngine::prefill_chunk(std::span<const uint32_t> tokens, std::span<float> logits) {
  return impl_->prefill_chunk(tokens, logits);
}

void Ds4GpuEngine::reset() { impl_->reset(); }
uint32_t Ds4GpuEngine::sequences() const { return impl_->opts.sequences; }
uint32_t Ds4GpuEngine::selected_sequence() const { return impl_->seq; }

Status Ds4GpuEngine::select_sequence(uint32_t sequence) {
  EXPERTD_TRY(Engine::select_sequence(sequence));
  impl_->seq = sequence;
  impl_->cur = &impl_->seqs[sequence];
  return Ok{};
}

Status Ds4GpuEngine::decode_batch(std::span<const BatchRow> rows, std::span<float> logits) {
  EXPERTD_TRY(check_batch(*this, rows, logits.size()));
  // An engine of one sequence has no rows' buffers: decode() is its step.
  if (impl_->brows.empty()) return Engine::decode_batch(rows, logits);
  return impl_->decode_batch(rows, logits);
}
bool Ds4GpuEngine::truncate(uint32_t n) { return impl_->truncate(n); }
uint64_t Ds4GpuEngine::refed_positions() const { return impl_->refed; }

uint32_t Ds4GpuEngine::position() const { return impl_->cur->pos; }
const EngineStats& Ds4GpuEngine::stats() const { return impl_->stats; }
EngineStats& Ds4GpuEngine::mutable_stats() { return impl_->stats; }
const ModelParams& Ds4GpuEngine::params() const { return impl_->p; }
const EngineOptions& Ds4GpuEngine::options() const { return impl_->opts; }
void Ds4GpuEngine::set_routing_log(std::vector<RoutingRecord>* log) { impl_->routing_log = log; }
uint32_t Ds4GpuEngine::vram_slots() const { return impl_->experts->slots(); }
uint64_t Ds4GpuEngine::vram_slot_bytes() const { return impl_->experts->slot_bytes(); }

std::string Ds4GpuEngine::description() const {
  const Impl& m = *impl_;
  const GpuExperts& x = *m.experts;
  const std::string tier = x.description();
  const std::string seqs =
      m.opts.sequences > 1 ? fmt::format(", {} sequences (batched decode)", m.opts.sequences) : "";
  return fmt::format(
      "CUDA engine ({}) on {}: dense weights {} as in the file (fused "
      "matvec), {}, prefill in chunks of {} ({} scratch){}{}",
      family_info(Family::DeepSeek4).arch, m.device_name, gib(m.dense_device_bytes), tier, m.chunk,
      gib(m.chunk_bytes), seqs,
      x.arena_registered() ? "" : "; arena not registered: pageable copies");
}

}  // namespace expertd::engine
