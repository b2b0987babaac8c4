#include "engine/gpu_experts.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include "base/clock.h"
#include "engine/cpu_ops.h"
#include "engine/ds3_cpu_engine.h"
#include "engine/routing.h"
#include "kernels/check.h"
#include "kernels/combine.cuh"
#include "kernels/dequant.cuh"
#include "kernels/ds4.cuh"
#include "kernels/matvec.cuh"
#include "kernels/prefill.cuh"
#include "kernels/swiglu.cuh"
#include "storage/slice_map.h"

namespace expertd::engine::gpu {

using cuda::CudaEvent;
using cuda::DeviceBytes;
using cuda::HostRegistration;

std::string gib(uint64_t bytes) {
  return fmt::format("{:.2f} GiB", static_cast<double>(bytes) / (uint64_t{1} << 30));
}

namespace {
// The bytes of an expert's three matrices.
uint64_t view_bytes(const ExpertView& v) {
  return v.gate.rows * v.gate.row_bytes + v.up.rows * v.up.row_bytes +
         v.down.rows * v.down.row_bytes;
}
}  // namespace

cudaError_t timed_sync(cudaStream_t stream, EngineStats& stats) {
  const uint64_t t0 = monotonic_ns();
  const cudaError_t err = cudaStreamSynchronize(stream);
  stats.sync_ns += monotonic_ns() - t0;
  return err;
}

Status carve_matrix(Carver& c, const DenseModel& model, const Matrix& m, DevMat& dst,
                    std::vector<uint8_t>& scratch) {
  if (c.counting()) {
    if (!expert_type_supported(m.type)) {
      return make_error(EINVAL, fmt::format("{}: tensor {} is {}, which the GPU kernels do not "
                                            "read",
                                            model.path(), m.name, ggml_type_name(m.type)));
    }
    if (m.rows > UINT32_MAX || m.cols > UINT32_MAX) {
      return make_error(EINVAL, fmt::format("{}: tensor {} is too large for the GPU kernels",
                                            model.path(), m.name));
    }
  }
  dst.type = m.type;
  dst.rows = static_cast<uint32_t>(m.rows);
  dst.cols = static_cast<uint32_t>(m.cols);
  dst.row_bytes = m.row_bytes;
  const uint8_t* src = nullptr;
  if (!c.counting()) {
    EXPERTD_TRY_ASSIGN(const std::span<const uint8_t> bytes, m.data(scratch));
    src = bytes.data();
  }
  dst.data = c.take(m.size(), src);
  return Ok{};
}

Status carve_sigmoid_moe(Carver& c, const DenseModel& model, const SigmoidMoe& d, uint32_t layer,
                         const SigmoidMoeWeights& w, DevSigmoidMoe& dst,
                         std::vector<uint8_t>& scratch) {
  if (layer < d.dense_lead) {
    EXPERTD_TRY(carve_matrix(c, model, w.ffn_gate, dst.ffn_gate, scratch));
    EXPERTD_TRY(carve_matrix(c, model, w.ffn_up, dst.ffn_up, scratch));
    return carve_matrix(c, model, w.ffn_down, dst.ffn_down, scratch);
  }
  if (d.n_shared == 0) return Ok{};
  EXPERTD_TRY(carve_matrix(c, model, w.shexp_gate, dst.shexp_gate, scratch));
  EXPERTD_TRY(carve_matrix(c, model, w.shexp_up, dst.shexp_up, scratch));
  return carve_matrix(c, model, w.shexp_down, dst.shexp_down, scratch);
}

Status run_sigmoid_moe(GpuExperts& experts, uint32_t layer, std::span<const uint32_t> selected,
                       std::span<ExpertPtrs> ptrs, const DevSigmoidMoe& m, const ModelParams& p,
                       const float* x, const float* weights, const SigmoidMoeScratch& s, float* y,
                       EngineStats& stats, cudaStream_t st) {
  const auto k = static_cast<uint32_t>(selected.size());
  uint64_t waited = 0;
  EXPERTD_TRY(experts.acquire(layer, selected, ptrs, &waited));
  stats.experts_used += k;
  EXPERTD_TRY(run_experts(experts.shape(layer), std::span<const ExpertPtrs>(ptrs.data(), k),
                          p.n_ff_exp, p.n_embd, x, 0.0f, s.gu, s.h, s.eo, st));
  EXPERTD_TRY(experts.finish_layer());
  const bool shared = m.shexp_gate.rows > 0;
  if (shared) {
    EXPERTD_TRY(run_mlp(m.shexp_gate, m.shexp_up, m.shexp_down, x, s.g, s.u, s.shared, st));
  }
  EXPERTD_CUDA_TRY(
      kernels::ds4_moe_sum(s.eo, weights, k, shared ? s.shared : nullptr, p.n_embd, y, st));
  return Ok{};
}

Status sgemm_rows(cublasHandle_t blas, const float* w, uint64_t w_stride, uint32_t out_cols,
                  uint32_t in_cols, const float* in, uint64_t in_stride, uint32_t rows, float* out,
                  uint64_t out_stride, float beta) {
  // Column-major, out^T = w^T-as-stored^T in^T.
  const float alpha = 1.0f;
  EXPERTD_CUBLAS_TRY(cublasSgemm(blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(out_cols),
                                 static_cast<int>(rows), static_cast<int>(in_cols), &alpha, w,
                                 static_cast<int>(w_stride), in, static_cast<int>(in_stride), &beta,
                                 out, static_cast<int>(out_stride)));
  return Ok{};
}

Status sgemm_rows(cublasHandle_t blas, const float* w, uint32_t out_cols, uint32_t in_cols,
                  const float* in, uint32_t rows, float* out, float beta) {
  return sgemm_rows(blas, w, in_cols, out_cols, in_cols, in, in_cols, rows, out, out_cols, beta);
}

Status gemm_bf16_rows(cublasHandle_t blas, const __nv_bfloat16* w, uint32_t out_cols,
                      uint32_t in_cols, const __nv_bfloat16* in, uint32_t rows, float* out) {
  const float alpha = 1.0f;
  const float beta = 0.0f;
  EXPERTD_CUBLAS_TRY(cublasGemmEx(
      blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(out_cols), static_cast<int>(rows),
      static_cast<int>(in_cols), &alpha, w, CUDA_R_16BF, static_cast<int>(in_cols), in, CUDA_R_16BF,
      static_cast<int>(in_cols), &beta, out, CUDA_R_32F, static_cast<int>(out_cols),
      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return Ok{};
}

uint64_t dense_rows_tile(const DevMat& m, uint64_t cap) {
  if (m.type == GgmlType::F32 || m.rows == 0 || m.cols == 0) return 0;
  const uint64_t whole = uint64_t{m.rows} * m.cols;
  // Whole rows only: a cap below one row still takes one.
  return std::max<uint64_t>(m.cols, std::min(whole, cap / m.cols * m.cols));
}

Status dense_rows(cublasHandle_t blas, const DevMat& m, const float* in, uint64_t in_stride,
                  uint32_t rows, float* out, uint64_t out_stride, float* tile, uint64_t tile_floats,
                  cudaStream_t stream, float beta) {
  if (rows == 0) return Ok{};
  if (in_stride < m.cols || out_stride < m.rows) {
    return make_error(EINVAL, fmt::format("dense_rows: row strides {} and {} below the matrix's "
                                          "{} columns and {} rows",
                                          in_stride, out_stride, m.cols, m.rows));
  }
  if (m.type == GgmlType::F32) {
    if (m.row_bytes % 4 != 0 || m.row_bytes / 4 < m.cols) {
      return make_error(EINVAL, fmt::format("dense_rows: f32 rows of {} bytes for {} columns",
                                            m.row_bytes, m.cols));
    }
    return sgemm_rows(blas, reinterpret_cast<const float*>(m.data), m.row_bytes / 4, m.rows, m.cols,
                      in, in_stride, rows, out, out_stride, beta);
  }
  const uint64_t per_tile = tile_floats / m.cols;
  if (tile == nullptr || per_tile == 0) {
    return make_error(EINVAL, fmt::format("dense_rows: a tile of {} floats holds no row of {} "
                                          "columns",
                                          tile_floats, m.cols));
  }
  // Rows back to back (as a file stores them) dequantise as one run; padded rows one at a time.
  const std::optional<uint64_t> packed = ggml_row_bytes(m.type, m.cols);
  const bool contiguous = packed && *packed == m.row_bytes;
  for (uint64_t r0 = 0; r0 < m.rows; r0 += per_tile) {
    const uint64_t t = std::min<uint64_t>(per_tile, m.rows - r0);
    for (uint64_t r = 0; r < t; r += contiguous ? t : 1) {
      const uint64_t count = contiguous ? t : 1;
      EXPERTD_CUDA_TRY(kernels::dequantize(m.type, m.data + (r0 + r) * m.row_bytes,
                                           tile + r * m.cols, count * m.cols, stream));
    }
    EXPERTD_TRY(sgemm_rows(blas, tile, m.cols, static_cast<uint32_t>(t), m.cols, in, in_stride,
                           rows, out + r0, out_stride, beta));
  }
  return Ok{};
}

Status run_experts_by_rows(GpuExperts& experts, cublasHandle_t blas, uint32_t layer, uint32_t n,
                           std::span<const uint32_t> routes, const float* xn, uint64_t stride,
                           std::span<ExpertPtrs> ptrs, const ModelParams& p, RowsScratch& s,
                           float* eo, EngineStats& stats, cudaStream_t st, const RowsOptions& o) {
  const uint32_t k = p.n_expert_used;
  const uint32_t ne = p.n_expert;
  const uint64_t nk = uint64_t{n} * k;
  if (routes.size() < nk || ptrs.size() < k) {
    return make_error(EINVAL, "run_experts_by_rows: scratch smaller than the chunk");
  }
  if (o.bf16 && (s.xeh == nullptr || s.hgh == nullptr)) {
    return make_error(EINVAL, "run_experts_by_rows: bf16 GEMMs without their bf16 scratch");
  }
  for (uint64_t i = 0; i < nk; ++i) {
    if (routes[i] >= ne) {
      return make_error(EIO,
                        fmt::format("layer {}: routed to expert {} of {}", layer, routes[i], ne));
    }
  }
  // Rows by expert (each expert's rows ascending) and where each row's output goes: its route
  // slot, so a row's experts are summed in its route's order.
  s.groups.build(routes.first(nk));
  const std::span<const uint32_t> needed = s.groups.needed();
  uint32_t at = 0;
  for (const uint32_t ex : needed) {
    for (const uint32_t slot : s.groups.slots(ex)) {
      s.h_index[at] = slot / k;
      s.h_index[nk + at] = slot;
      ++at;
    }
  }
  EXPERTD_CUDA_TRY(cudaMemcpyAsync(s.d_index, s.h_index, nk * 2 * 4, cudaMemcpyHostToDevice, st));
  const GpuExperts::LayerShape& sh = experts.shape(layer);
  if (!sh.present) return make_error(EINVAL, fmt::format("layer {} has no routed experts", layer));
  const uint32_t ff = p.n_ff_exp;
  const uint32_t e = p.n_embd;
  const uint64_t proj = uint64_t{ff} * e;
  auto* wh = reinterpret_cast<__nv_bfloat16*>(s.w);
  // One projection of the expert in `q` on `rows` rows: in (f32, or its bf16 copy) -> out.
  auto project = [&](const GpuExperts::Proj& t, const void* q, uint32_t out_cols, uint32_t in_cols,
                     const float* in, const __nv_bfloat16* in_h, uint32_t rows,
                     float* out) -> Status {
    if (o.bf16) {
      EXPERTD_CUDA_TRY(kernels::dequantize_bf16(t.type, q, wh, proj, st));
      return gemm_bf16_rows(blas, wh, out_cols, in_cols, in_h, rows, out);
    }
    EXPERTD_CUDA_TRY(kernels::dequantize(t.type, q, s.w, proj, st));
    return sgemm_rows(blas, s.w, out_cols, in_cols, in, rows, out);
  };
  uint32_t first = 0;  // the group's first expert's entry in the row lists
  for (size_t g0 = 0; g0 < needed.size(); g0 += k) {
    const auto group = static_cast<uint32_t>(std::min<size_t>(k, needed.size() - g0));
    const std::span<const uint32_t> experts_of = needed.subspan(g0, group);
    if (o.before_acquire) o.before_acquire(experts_of);
    uint64_t waited = 0;
    EXPERTD_TRY(experts.acquire(layer, experts_of, ptrs, &waited));
    if (o.acquired) o.acquired(experts_of, waited);
    for (uint32_t j = 0; j < group; ++j) {
      const uint32_t ex = experts_of[j];
      const auto rows = static_cast<uint32_t>(s.groups.slots(ex).size());
      const uint32_t* gather = s.d_index + first;
      const uint32_t* dest = s.d_index + nk + first;
      first += rows;
      EXPERTD_CUDA_TRY(kernels::gather_rows_strided(xn, stride, gather, rows, e, s.xe, st));
      if (o.bf16) EXPERTD_CUDA_TRY(kernels::to_bf16(s.xe, s.xeh, uint64_t{rows} * e, st));
      EXPERTD_TRY(project(sh.gate, ptrs[j].gate, ff, e, s.xe, s.xeh, rows, s.hg));
      EXPERTD_TRY(project(sh.up, ptrs[j].up, ff, e, s.xe, s.xeh, rows, s.hu));
      if (o.ds4_clamp) {
        EXPERTD_CUDA_TRY(
            kernels::ds4_swiglu(s.hg, s.hu, s.hg, uint64_t{rows} * ff, *o.ds4_clamp, st));
      } else if (o.oai == nullptr) {
        EXPERTD_CUDA_TRY(kernels::swiglu(s.hg, s.hu, s.hg, uint64_t{rows} * ff, st));
      } else {
        const uint64_t bias = uint64_t{ex} * ff;
        EXPERTD_CUDA_TRY(kernels::oai_swiglu_rows(s.hg, s.hu, o.oai->gate_b + bias,
                                                  o.oai->up_b + bias, s.hg, rows, ff, kGptOssAlpha,
                                                  kGptOssLimit, st));
      }
      if (o.bf16) EXPERTD_CUDA_TRY(kernels::to_bf16(s.hg, s.hgh, uint64_t{rows} * ff, st));
      EXPERTD_TRY(project(sh.down, ptrs[j].down, e, ff, s.hg, s.hgh, rows, s.down));
      if (o.oai != nullptr) {
        EXPERTD_CUDA_TRY(kernels::add_rows(s.down, o.oai->down_b + uint64_t{ex} * e, rows, e, st));
      }
      EXPERTD_CUDA_TRY(kernels::scatter_rows(s.down, dest, rows, e, eo, st));
    }
    EXPERTD_TRY(experts.finish_layer());
    EXPERTD_TRY(experts.sync_compute());
    if (o.hints != nullptr) {
      experts.hint_within(o.hints->exact, g0 + group, o.hints->budget, o.hints->sent, stats);
    }
  }
  stats.experts_used += needed.size();
  if (o.bf16) stats.prefill_bf16_gemms += 3 * needed.size();
  return Ok{};
}

Status run_sigmoid_moe_rows(GpuExperts& experts, cublasHandle_t blas, uint32_t layer, uint32_t n,
                            std::span<const uint32_t> routes, const float* weights,
                            const DevSigmoidMoe& m, const ModelParams& p, const float* xn, float* x,
                            uint64_t stride, std::span<ExpertPtrs> ptrs, RowsScratch& rows,
                            float* eo, const SigmoidMoeScratch& s, float* y, EngineStats& stats,
                            cudaStream_t st, RowsHints* hints) {
  EXPERTD_TRY(run_experts_by_rows(experts, blas, layer, n, routes, xn, stride, ptrs, p, rows, eo,
                                  stats, st, RowsOptions{.hints = hints}));
  const uint32_t k = p.n_expert_used;
  const bool shared = m.shexp_gate.rows > 0;
  for (uint32_t i = 0; i < n; ++i) {
    if (shared) {
      EXPERTD_TRY(
          run_mlp(m.shexp_gate, m.shexp_up, m.shexp_down, xn + i * stride, s.g, s.u, s.shared, st));
    }
    EXPERTD_CUDA_TRY(kernels::ds4_moe_sum(eo + uint64_t{i} * k * p.n_embd,
                                          weights + uint64_t{i} * k, k, shared ? s.shared : nullptr,
                                          p.n_embd, y, st));
    EXPERTD_CUDA_TRY(kernels::add(x + i * stride, y, p.n_embd, st));
  }
  return Ok{};
}

HostRouter::HostRouter(const ModelParams& p_, const SigmoidMoe& d_, const EngineOptions& opts_)
    : p(p_),
      d(d_),
      opts(opts_),
      gptoss(p_.router == RouterKind::TopkSoftmax),
      selected(p_.n_expert_used),
      weights(p_.n_expert_used),
      probs(p_.n_expert),
      sel(p_.n_expert),
      order(p_.n_expert) {}

bool HostRouter::computes(uint32_t pos, uint32_t layer) const {
  return layer >= d.dense_lead &&
         (opts.script == nullptr || opts.script->find(pos, layer) == nullptr);
}

bool HostRouter::looks_ahead(uint32_t layer, uint32_t j) const {
  const uint32_t next = layer + j;
  return next < p.n_layer && next >= d.dense_lead &&
         !(opts.script != nullptr && opts.hints == HintSource::Script);
}

void HostRouter::route(uint32_t pos, uint32_t layer, const float* logits, HintPlanner& planner,
                       EngineStats& stats, ExpertSource& hints_to,
                       std::vector<RoutingRecord>* log) {
  // Hints for the next layers, as the CPU engines' send_hints sends them.
  planner.from_layer(layer);
  add_lookahead(pos, layer, logits, p.n_expert, planner);
  const std::span<const ExpertHint> hints = planner.take(stats);
  last_hints.assign(hints.begin(), hints.end());
  if (!hints.empty() && !hints_to.prefetch(hints)) ++stats.hint_errors;
  if (layer < d.dense_lead) {
    planner.routed(layer, {}, stats, nullptr);  // routes nothing: closes the layer's hints
    return;
  }
  decide(pos, layer, logits, planner, stats, log);
}

void HostRouter::add_lookahead(uint32_t pos, uint32_t layer, const float* logits, uint64_t ahead,
                               HintPlanner& planner) {
  const uint32_t ne = p.n_expert;
  const bool scripted_hints = opts.script != nullptr && opts.hints == HintSource::Script;
  for (uint32_t j = 1; j <= opts.prefetch_depth && layer + j < p.n_layer; ++j) {
    const uint32_t next = layer + j;
    if (next < d.dense_lead) continue;  // no experts
    if (scripted_hints) {
      add_scripted_hints(*opts.script, pos, layer, next, planner);
      continue;
    }
    const float* row = logits + uint64_t{j} * ahead;
    if (gptoss) {
      // CpuEngine::hint_probs: the softmax over every expert.
      for (uint32_t e = 0; e < ne; ++e) probs[e] = row[e];
      softmax(probs.data(), ne);
    } else {
      ds3_hint_probs(d, bias[next], std::span<const float>(row, ne), probs);
    }
    planner.add_ranked(next, std::span<const double>(probs.data(), ne));
  }
}

void HostRouter::decide(uint32_t pos, uint32_t layer, const float* logits, HintPlanner& planner,
                        EngineStats& stats, std::vector<RoutingRecord>* log) {
  const uint32_t ne = p.n_expert;
  const uint32_t k = p.n_expert_used;
  // The routing decision, as the CPU engines' route makes it.
  if (take_scripted_route(opts, pos, layer, selected, weights, stats)) {
    // the script's route
  } else if (gptoss) {
    gptoss_route(std::span<const float>(logits, ne), k, probs, order,
                 std::span<double>(sel.data(), k), selected, weights);
  } else {
    ds3_route(d, bias[layer], std::span<const float>(logits, ne), k, probs, sel, order, selected,
              weights);
  }
  RoutingRecord* rec = log_route(log, pos, layer, selected, weights);
  planner.routed(layer, std::span<const uint32_t>(selected.data(), k), stats, rec);
}

Status HostRouter::route_chunk(uint32_t pos0, uint32_t layer, uint32_t n, const float* logits,
                               uint64_t stride, uint64_t ahead, uint64_t budget,
                               HintPlanner& planner, EngineStats& stats, ExpertSource& hints_to,
                               std::vector<RoutingRecord>* log, std::span<uint32_t> routes,
                               std::span<float> route_weights, std::vector<uint8_t>& seen,
                               std::vector<ExpertHint>& hints) {
  const uint32_t k = p.n_expert_used;
  const uint32_t ne = p.n_expert;
  std::fill(seen.begin(), seen.end(), uint8_t{0});
  hints.clear();
  for (uint32_t i = 0; i < n; ++i) {
    decide(pos0 + i, layer, logits + uint64_t{i} * stride, planner, stats, log);
    for (uint32_t j = 0; j < k; ++j) {
      const uint32_t ex = selected[j];
      if (ex >= ne) {
        return make_error(EIO, fmt::format("layer {} position {}: routed to expert {} of {}", layer,
                                           pos0 + i, ex, ne));
      }
      routes[uint64_t{i} * k + j] = ex;
      route_weights[uint64_t{i} * k + j] = weights[j];
      seen[ex] = 1;
    }
  }
  // Ascending, the order run_experts_by_rows acquires them in.
  for (uint32_t ex = 0; ex < ne; ++ex) {
    if (seen[ex] != 0) hints.push_back(ExpertHint{layer, ex, 1.0f, true});
  }
  // The layer's distinct experts hinted at once and exactly: the daemon reads each while the rows
  // before its first use compute; the repeats find it in VRAM or the daemon's cache.
  // As many as the daemon's slots keep until their acquire; the rest are read when acquired.
  stats.prefill_experts += hints.size();
  const uint64_t exact = std::min<uint64_t>(hints.size(), budget);
  stats.prefill_hints += exact;
  stats.prefill_hints_held += hints.size() - exact;
  if (exact > 0 && !hints_to.prefetch(std::span<const ExpertHint>(hints.data(), exact))) {
    ++stats.hint_errors;
  }
  // The next layers' experts, from every row's lookahead logits, into what the budget leaves: the
  // daemon reads them while this layer's rows compute.
  if (ahead == 0) return Ok{};
  for (uint32_t i = 0; i < n; ++i) {
    add_lookahead(pos0 + i, layer, logits + uint64_t{i} * stride, ahead, planner);
  }
  const std::span<const ExpertHint> next = planner.take(stats);
  const uint64_t room = budget - exact;
  const uint64_t send = std::min<uint64_t>(next.size(), room);
  stats.prefill_hints_held += next.size() - send;
  stats.prefill_lookahead_hints += send;
  if (send > 0 && !hints_to.prefetch(next.first(send))) ++stats.hint_errors;
  return Ok{};
}

void GpuExperts::hint_within(std::span<const ExpertHint> hints, size_t acquired, uint64_t budget,
                             size_t& sent, EngineStats& stats) {
  const uint64_t room = std::min<uint64_t>(budget, hints.size());
  const auto upto = static_cast<size_t>(std::min<uint64_t>(hints.size(), acquired + room));
  if (upto <= sent) return;
  if (!hints_.prefetch(hints.subspan(sent, upto - sent))) ++stats.hint_errors;
  stats.prefill_hints += upto - sent;
  sent = upto;
}

uint64_t GpuExperts::hint_budget() const {
  const uint32_t slots = source_.host_resident(p_.n_expert, {});
  if (slots == 0) return UINT64_MAX;
  return std::max<uint64_t>(p_.n_expert_used, static_cast<uint64_t>(kHintFill * slots));
}

Status run_mlp(const DevMat& gate, const DevMat& up, const DevMat& down, const float* x, float* g,
               float* u, float* y, cudaStream_t st) {
  EXPERTD_CUDA_TRY(
      kernels::matvec(gate.type, gate.data, gate.row_bytes, gate.rows, gate.cols, x, g, st));
  EXPERTD_CUDA_TRY(kernels::matvec(up.type, up.data, up.row_bytes, up.rows, up.cols, x, u, st));
  EXPERTD_CUDA_TRY(kernels::ds4_swiglu(g, u, g, gate.rows, 0.0f, st));
  EXPERTD_CUDA_TRY(
      kernels::matvec(down.type, down.data, down.row_bytes, down.rows, down.cols, g, y, st));
  return Ok{};
}

Status run_experts(const GpuExperts::LayerShape& sh, std::span<const ExpertPtrs> ptrs, uint32_t ff,
                   uint32_t e, const float* x, float clamp, float* gu, float* h, float* out,
                   cudaStream_t st, const OaiExperts* oai) {
  const auto k = static_cast<uint32_t>(ptrs.size());
  if (sh.gate.type == sh.up.type && sh.gate.row_bytes == sh.up.row_bytes) {
    kernels::MatvecBatch b;
    b.count = 2 * k;
    for (uint32_t i = 0; i < k; ++i) {
      b.w[i] = ptrs[i].gate;
      b.x[i] = x;
      b.y[i] = gu + uint64_t{i} * ff;
      b.w[k + i] = ptrs[i].up;
      b.x[k + i] = x;
      b.y[k + i] = gu + uint64_t{k + i} * ff;
    }
    EXPERTD_CUDA_TRY(kernels::matvec_batched(sh.gate.type, b, sh.gate.row_bytes, ff, e, st));
  } else {
    for (uint32_t i = 0; i < k; ++i) {
      EXPERTD_CUDA_TRY(kernels::matvec(sh.gate.type, ptrs[i].gate, sh.gate.row_bytes, ff, e, x,
                                       gu + uint64_t{i} * ff, st));
      EXPERTD_CUDA_TRY(kernels::matvec(sh.up.type, ptrs[i].up, sh.up.row_bytes, ff, e, x,
                                       gu + uint64_t{k + i} * ff, st));
    }
  }
  if (oai == nullptr) {
    EXPERTD_CUDA_TRY(
        kernels::ds4_swiglu(gu, gu + uint64_t{k} * ff, h, uint64_t{k} * ff, clamp, st));
  } else {
    for (uint32_t i = 0; i < k; ++i) {
      const uint64_t at = uint64_t{oai->selected[i]} * ff;
      EXPERTD_CUDA_TRY(kernels::oai_swiglu(gu + uint64_t{i} * ff, gu + uint64_t{k + i} * ff,
                                           oai->gate_b + at, oai->up_b + at, h + uint64_t{i} * ff,
                                           ff, kGptOssAlpha, kGptOssLimit, st));
    }
  }
  kernels::MatvecBatch b;
  b.count = k;
  for (uint32_t i = 0; i < k; ++i) {
    b.w[i] = ptrs[i].down;
    b.x[i] = h + uint64_t{i} * ff;
    b.y[i] = out + uint64_t{i} * e;
  }
  EXPERTD_CUDA_TRY(kernels::matvec_batched(sh.down.type, b, sh.down.row_bytes, e, ff, st));
  for (uint32_t i = 0; oai != nullptr && i < k; ++i) {
    EXPERTD_CUDA_TRY(
        kernels::add(out + uint64_t{i} * e, oai->down_b + uint64_t{oai->selected[i]} * e, e, st));
  }
  return Ok{};
}

Result<DeviceBytes> alloc_work(uint64_t bytes, uint32_t positions, const std::string& device_name) {
  Result<DeviceBytes> work = DeviceBytes::alloc(bytes);
  if (!work) {
    return make_error(ENOMEM, fmt::format("cannot allocate {} of device memory for the caches "
                                          "({} positions) and activations on {}",
                                          gib(bytes), positions, device_name));
  }
  EXPERTD_CUDA_TRY(cudaMemset(work->get(), 0, bytes));
  return work;
}

Result<DeviceBytes> alloc_dense(uint64_t bytes, std::string_view what,
                                const std::string& model_path, const std::string& device_name) {
  size_t free_b = 0;
  size_t total_b = 0;
  EXPERTD_CUDA_TRY(cudaMemGetInfo(&free_b, &total_b));
  if (bytes + (uint64_t{256} << 20) > free_b) {
    return make_error(ENOMEM,
                      fmt::format("{}: the dense weights need {} of device memory {}, {} is "
                                  "free on {}",
                                  model_path, gib(bytes), what, gib(free_b), device_name));
  }
  Result<DeviceBytes> dense = DeviceBytes::alloc(bytes);
  if (!dense) {
    return make_error(ENOMEM, fmt::format("cannot allocate {} for the dense weights on {}",
                                          gib(bytes), device_name));
  }
  return dense;
}

GpuExperts::GpuExperts(const DenseModel& model, ExpertSource& source, const GpuOptions& gpu,
                       EngineStats& stats, cudaStream_t compute, cudaStream_t copy)
    : model_(model),
      source_(source),
      p_(model.params()),
      gpu_(gpu),
      stats_(stats),
      compute_(compute),
      copy_(copy),
      hints_(source) {}

GpuExperts::~GpuExperts() {
  // The owner synchronised both streams: nothing reads the held bytes any more.
  for (size_t i = 0; i < demand_holds_.size(); ++i) {
    (void)give_back(std::span<const ExpertView>(&demand_holds_[i], 1), demand_kept_[i] != 0);
  }
  for (const PrefetchHold& held : prefetch_holds_) {
    (void)give_back(std::span<const ExpertView>(&held.view, 1), true);
  }
}

Status GpuExperts::init(const std::string& device_name) {
  EXPERTD_TRY_ASSIGN(copy_start_, CudaEvent::create(cudaEventDefault));
  EXPERTD_TRY_ASSIGN(copy_end_, CudaEvent::create(cudaEventDefault));
  // The source's host memory, registered once (read-only: the arena is mapped PROT_READ).
  const std::span<const uint8_t> hm = source_.host_memory();
  if (!hm.empty()) {
    Result<HostRegistration> reg = HostRegistration::create(
        hm.data(), hm.size(), cudaHostRegisterReadOnly | cudaHostRegisterMapped);
    if (!reg) {
      if (gpu_.tier == GpuOptions::Tier::InPlace) {
        return make_error(EIO, fmt::format("in-place mode: registering the daemon's arena ({}) "
                                           "failed: {}",
                                           gib(hm.size()), reg.error().message));
      }
    } else {
      arena_ = std::move(*reg);
      host_base_ = hm.data();
      host_bytes_ = hm.size();
      void* dev = nullptr;
      EXPERTD_CUDA_TRY(cudaHostGetDevicePointer(&dev, const_cast<uint8_t*>(hm.data()), 0));
      dev_base_ = static_cast<uint8_t*>(dev);
    }
  } else if (gpu_.tier == GpuOptions::Tier::InPlace) {
    return make_error(EINVAL,
                      "in-place mode needs an expert source with registrable host memory "
                      "(the daemon's arena)");
  }
  EXPERTD_TRY(setup_tier(device_name));
  const uint32_t k = p_.n_expert_used;
  views_.resize(k);
  missing_.reserve(k);
  missing_index_.reserve(k);
  ready_flags_.resize(p_.n_expert);
  if (tier_) {
    host_resident_.resize(uint64_t{p_.n_layer} * p_.n_expert);
    hints_.set_tier(tier_.get(), uint64_t{p_.n_layer} * p_.n_expert);
  }
  return preload();
}

Status GpuExperts::preload() {
  if (!tier_ || !gpu_.preload) return Ok{};
  const uint64_t t0 = monotonic_ns();
  // Which experts: whole layers from the last MoE layer back while the free slots last (the
  // earliest of them perhaps in part), then loaded from the earliest layer on.
  struct Group {
    uint32_t layer;
    uint32_t count;
  };
  std::vector<Group> layers;
  uint32_t room = tier_->capacity() - tier_->size();
  uint32_t total = 0;
  for (uint32_t l = p_.n_layer; l-- > 0 && room > 0;) {
    if (!shapes_[l].present) continue;
    const uint32_t n = std::min(room, p_.n_expert);
    layers.push_back(Group{l, n});
    room -= n;
    total += n;
  }
  std::reverse(layers.begin(), layers.end());
  const uint32_t k = p_.n_expert_used;
  std::vector<ExpertView> views(k);
  std::vector<uint32_t> ids;
  ids.reserve(k);
  uint32_t done = 0;
  const uint64_t bytes0 = stats_.vram_preload_bytes;
  for (const Group& g : layers) {
    for (uint32_t e0 = 0; e0 < g.count; e0 += k) {
      ids.clear();
      for (uint32_t e = e0; e < std::min(g.count, e0 + k); ++e) {
        if (!tier_->contains(g.layer, e)) ids.push_back(e);
      }
      if (ids.empty()) continue;
      const std::span<ExpertView> held(views.data(), ids.size());
      if (auto st = source_.get(g.layer, ids, held); !st) {
        // A head start, not a need: the engine runs with what is in (the description says why
        // the rest is not), as it would with --no-vram-preload. Device errors below still fail.
        preload_note_ = fmt::format("the preload stopped at layer {} experts {}..{}: {}", g.layer,
                                    ids.front(), ids.back(), st.error().message);
        stats_.vram_preload_ns += monotonic_ns() - t0;
        return Ok{};
      }
      Status st = Ok{};
      for (size_t i = 0; i < ids.size() && st; ++i) {
        const uint32_t slot = tier_->insert(g.layer, ids[i], false, true);
        if (slot == VramTier::kNone) {
          st = make_error(EIO, fmt::format("preloading the VRAM tier: no free slot for layer {} "
                                           "expert {}",
                                           g.layer, ids[i]));
          break;
        }
        st = copy_expert(held[i], slot, Copy::Preload);
        if (!st) tier_->erase(slot);
      }
      // The copies read the daemon's slots: they complete before the holds go back.
      const cudaError_t synced = cudaStreamSynchronize(copy_);
      if (synced != cudaSuccess && st) {
        st = cuda::cuda_error(synced, "cudaStreamSynchronize(copy)", __FILE__, __LINE__);
      }
      if (auto rel = source_.release_kept(held); !rel && st) st = std::move(rel);
      if (!st) return st;
      done += static_cast<uint32_t>(ids.size());
      stats_.vram_preloaded += ids.size();
    }
    if (gpu_.preload_progress) {
      gpu_.preload_progress(done, total, stats_.vram_preload_bytes - bytes0);
    }
  }
  stats_.vram_preload_ns += monotonic_ns() - t0;
  return Ok{};
}

Status GpuExperts::setup_tier(const std::string& device_name) {
  // A device slot holds one expert's gate, up and down bytes, each 256-aligned, plus room for
  // the padding a daemon slot may place between them (copied as one span when it fits).
  EXPERTD_TRY_ASSIGN(const SliceMap map, SliceMap::build(model_.gguf()));
  shapes_.resize(p_.n_layer);
  uint64_t expert_bytes = 0;
  for (const MoeLayer& ml : map.layers()) {
    if (ml.layer >= p_.n_layer) continue;
    LayerShape& sh = shapes_[ml.layer];
    uint64_t sum = 0;
    for (uint32_t i = 0; i < ml.slice_count; ++i) {
      const ExpertSlice& es = ml.expert0[i];
      if (!expert_type_supported(es.type)) {
        return make_error(EINVAL, fmt::format("{}: layer {} {} experts are {}, which the GPU "
                                              "kernels do not read",
                                              model_.path(), ml.layer, slice_kind_name(es.kind),
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
    return make_error(EINVAL, fmt::format("{}: no routed expert tensors", model_.path()));
  }
  slot_bytes_ = align_up(expert_bytes + 3 * 4096, kAlign);
  const uint64_t all = uint64_t{p_.n_layer} * p_.n_expert;
  uint64_t slots = 0;
  switch (gpu_.tier) {
    case GpuOptions::Tier::InPlace:
      return Ok{};
    case GpuOptions::Tier::Experts:
      slots = gpu_.value;
      break;
    case GpuOptions::Tier::Bytes:
      slots = gpu_.value / slot_bytes_;
      break;
    case GpuOptions::Tier::Auto: {
      size_t free_b = 0;
      size_t total_b = 0;
      EXPERTD_CUDA_TRY(cudaMemGetInfo(&free_b, &total_b));
      slots = std::min<uint64_t>(all, free_b / 2 / slot_bytes_);
      break;
    }
  }
  slots = std::min(slots, all);
  if (slots < p_.n_expert_used) {
    // A layer computes its top-k experts together, each pinned in a slot until the layer is
    // done: fewer slots than that cannot run a layer from VRAM.
    const std::string asked =
        gpu_.tier == GpuOptions::Tier::Experts ? fmt::format("{}", gpu_.value)
        : gpu_.tier == GpuOptions::Tier::Bytes
            ? fmt::format("{} ({} slots of {})", gib(gpu_.value), slots, gib(slot_bytes_))
            : fmt::format("auto ({} slots of {} in half the free VRAM)", slots, gib(slot_bytes_));
    return make_error(EINVAL,
                      fmt::format("--vram-experts {}: the VRAM tier needs at least {} experts "
                                  "(top-{}: one layer's routed experts are computed together, "
                                  "each in its own slot; {} each, {} in all for {}); use "
                                  "--vram-experts {} or more, or 0 for the in-place mode",
                                  asked, p_.n_expert_used, p_.n_expert_used, gib(slot_bytes_),
                                  gib(uint64_t{p_.n_expert_used} * slot_bytes_), model_.path(),
                                  p_.n_expert_used));
  }
  Result<DeviceBytes> slots_mem = DeviceBytes::alloc(slots * slot_bytes_);
  if (!slots_mem) {
    size_t free_b = 0;
    size_t total_b = 0;
    EXPERTD_CUDA_TRY(cudaMemGetInfo(&free_b, &total_b));
    return make_error(ENOMEM,
                      fmt::format("--vram-experts: a VRAM tier of {} experts needs {}; {} is "
                                  "free on {}",
                                  slots, gib(slots * slot_bytes_), gib(free_b), device_name));
  }
  tier_mem_ = std::move(*slots_mem);
  const std::string_view policy =
      gpu_.policy.empty() ? VramTier::kDefaultPolicy : std::string_view(gpu_.policy);
  EXPERTD_TRY_ASSIGN(
      tier_, VramTier::create(static_cast<uint32_t>(slots), p_.n_layer, p_.n_expert, policy));
  ready_event_.resize(slots);
  use_event_.resize(slots);
  slot_ptrs_.resize(slots);
  for (uint64_t s = 0; s < slots; ++s) {
    EXPERTD_TRY_ASSIGN(ready_event_[s], CudaEvent::create(cudaEventDisableTiming));
    EXPERTD_TRY_ASSIGN(use_event_[s], CudaEvent::create(cudaEventDisableTiming));
  }
  return Ok{};
}

Status TierHintFilter::prefetch(std::span<const ExpertHint> hints) {
  if (tier_ == nullptr) return inner_.prefetch(hints);
  kept_.clear();
  for (const ExpertHint& h : hints) {
    if (!tier_->contains(h.layer, h.expert)) kept_.push_back(h);
  }
  if (kept_.empty()) return Ok{};
  return inner_.prefetch(kept_);
}

Result<ExpertPtrs> GpuExperts::in_place(const ExpertView& v) const {
  ExpertPtrs out;
  const WeightView* parts[3] = {&v.gate, &v.up, &v.down};
  const void** dst[3] = {&out.gate, &out.up, &out.down};
  for (int i = 0; i < 3; ++i) {
    const uint8_t* ptr = parts[i]->data;
    const uint64_t bytes = parts[i]->rows * parts[i]->row_bytes;
    if (!arena_.valid() || ptr < host_base_ || ptr + bytes > host_base_ + host_bytes_) {
      return make_error(EINVAL, fmt::format("layer {} expert {}: the held expert lies outside the "
                                            "registered arena",
                                            v.layer, v.expert));
    }
    *dst[i] = dev_base_ + (ptr - host_base_);
  }
  return out;
}

void GpuExperts::count_copy(uint64_t bytes, Copy kind) {
  if (kind == Copy::Preload) {
    stats_.vram_preload_bytes += bytes;
    return;
  }
  stats_.copy_bytes += bytes;
  if (kind == Copy::Demand) stats_.demand_copy_bytes += bytes;
}

Status GpuExperts::copy_expert(const ExpertView& v, uint32_t slot, Copy kind) {
  auto* dst = tier_mem_.get() + uint64_t{slot} * slot_bytes_;
  const WeightView* parts[3] = {&v.gate, &v.up, &v.down};
  const uint8_t* lo = parts[0]->data;
  const uint8_t* hi = lo;
  for (const WeightView* w : parts) {
    lo = std::min(lo, w->data);
    hi = std::max(hi, w->data + w->rows * w->row_bytes);
  }
  // The copy may start only when the slot's previous readers are done.
  EXPERTD_CUDA_TRY(cudaStreamWaitEvent(copy_, use_event_[slot].get(), 0));
  ExpertPtrs& sp = slot_ptrs_[slot];
  const bool in_arena = arena_.valid() && lo >= host_base_ && hi <= host_base_ + host_bytes_;
  if (in_arena && static_cast<uint64_t>(hi - lo) <= slot_bytes_) {
    // One span: the expert's slices as they lie in the daemon's slot.
    EXPERTD_CUDA_TRY(
        cudaMemcpyAsync(dst, lo, static_cast<uint64_t>(hi - lo), cudaMemcpyHostToDevice, copy_));
    sp.gate = dst + (v.gate.data - lo);
    sp.up = dst + (v.up.data - lo);
    sp.down = dst + (v.down.data - lo);
    count_copy(static_cast<uint64_t>(hi - lo), kind);
  } else {
    uint64_t off = 0;
    const void** dsts[3] = {&sp.gate, &sp.up, &sp.down};
    for (int i = 0; i < 3; ++i) {
      const uint64_t bytes = parts[i]->rows * parts[i]->row_bytes;
      EXPERTD_CUDA_TRY(
          cudaMemcpyAsync(dst + off, parts[i]->data, bytes, cudaMemcpyHostToDevice, copy_));
      *dsts[i] = dst + off;
      off += align_up(bytes, kAlign);
      count_copy(bytes, kind);
    }
  }
  EXPERTD_CUDA_TRY(cudaEventRecord(ready_event_[slot].get(), copy_));
  return Ok{};
}

Status GpuExperts::acquire(uint32_t layer, std::span<const uint32_t> experts,
                           std::span<ExpertPtrs> out, uint64_t* waited_ns) {
  const uint32_t k = static_cast<uint32_t>(experts.size());
  *waited_ns = 0;
  if (k > views_.size() || out.size() < k) {
    return make_error(
        EINVAL, fmt::format("layer {}: {} experts asked, at most {}", layer, k, views_.size()));
  }
  // Pins left by a layer that failed half-way (a successful one leaves none).
  for (const uint32_t slot : used_slots_) tier_->unpin(slot);
  used_slots_.clear();
  if (tier_ && tier_->sweeping()) tier_->sweep_to(layer);
  if (!tier_) {
    const uint64_t t0 = monotonic_ns();
    EXPERTD_TRY(source_.get(layer, experts, std::span<ExpertView>(views_.data(), k)));
    *waited_ns = monotonic_ns() - t0;
    stats_.stall_ns += *waited_ns;
    for (uint32_t i = 0; i < k; ++i) {
      demand_holds_.push_back(views_[i]);
      demand_kept_.push_back(0);
      auto pp = in_place(views_[i]);
      if (!pp) return pp.error();
      out[i] = *pp;
      stats_.streamed_bytes += view_bytes(views_[i]);
    }
    return Ok{};
  }
  missing_.clear();
  missing_index_.clear();
  for (uint32_t i = 0; i < k; ++i) {
    const uint32_t slot = tier_->find(layer, experts[i]);
    if (slot == VramTier::kNone) {
      missing_.push_back(experts[i]);
      missing_index_.push_back(i);
      continue;
    }
    ++stats_.vram_hits;
    if (tier_->take_prefetched(slot)) ++stats_.vram_prefetch_used;
    tier_->pin(slot);
    used_slots_.push_back(slot);
    out[i] = slot_ptrs_[slot];
    EXPERTD_CUDA_TRY(cudaStreamWaitEvent(compute_, ready_event_[slot].get(), 0));
  }
  if (missing_.empty()) return Ok{};
  stats_.vram_misses += missing_.size();
  const uint64_t t0 = monotonic_ns();
  EXPERTD_TRY(source_.get(layer, missing_, std::span<ExpertView>(views_.data(), missing_.size())));
  *waited_ns = monotonic_ns() - t0;
  stats_.stall_ns += *waited_ns;
  // Every hold is given back after the next compute sync, as a client copy once its copy into
  // the tier was enqueued: recorded before anything below can fail.
  const size_t first_hold = demand_holds_.size();
  for (size_t j = 0; j < missing_.size(); ++j) {
    demand_holds_.push_back(views_[j]);
    demand_kept_.push_back(0);
  }
  if (!copy_timing_) EXPERTD_CUDA_TRY(cudaEventRecord(copy_start_.get(), copy_));
  // Without a registered arena there is no way to read an expert but from VRAM: admit every miss.
  const bool force = !arena_.valid();
  for (size_t j = 0; j < missing_.size(); ++j) {
    VramTier::Entry evicted;
    const uint32_t slot = tier_->insert(layer, missing_[j], false, force, &evicted);
    EXPERTD_TRY(unkeep(evicted));
    if (slot == VramTier::kNone) {
      if (force) return make_error(EIO, fmt::format("layer {}: every VRAM slot is pinned", layer));
      // Not admitted: read in place from the registered arena for this use, displacing nothing.
      auto pp = in_place(views_[j]);
      if (!pp) return pp.error();
      out[missing_index_[j]] = *pp;
      ++stats_.vram_streamed;
      stats_.streamed_bytes += view_bytes(views_[j]);
      continue;
    }
    tier_->pin(slot);
    used_slots_.push_back(slot);
    if (auto st = copy_expert(views_[j], slot, Copy::Demand); !st) {
      tier_->erase(slot);
      return st;
    }
    demand_kept_[first_hold + j] = 1;
    EXPERTD_CUDA_TRY(cudaStreamWaitEvent(compute_, ready_event_[slot].get(), 0));
    out[missing_index_[j]] = slot_ptrs_[slot];
  }
  EXPERTD_CUDA_TRY(cudaEventRecord(copy_end_.get(), copy_));
  copy_timing_ = true;
  return Ok{};
}

Status GpuExperts::finish_layer() {
  for (const uint32_t slot : used_slots_) {
    EXPERTD_CUDA_TRY(cudaEventRecord(use_event_[slot].get(), compute_));
    tier_->unpin(slot);
  }
  used_slots_.clear();
  return Ok{};
}

Status GpuExperts::prefetch(uint32_t layer, uint32_t depth, uint32_t n_layer,
                            std::span<const ExpertHint> hints) {
  if (!tier_) return Ok{};
  // The experts hinted for the next layers that the daemon holds READY: acquire (a host hit)
  // and copy ahead of their layer, on the copy stream, behind this layer's demand copies.
  const uint32_t k = p_.n_expert_used;
  uint32_t budget = tier_->capacity() > 2 * k ? tier_->capacity() - 2 * k : 0;
  for (uint32_t j = 1; j <= depth && layer + j < n_layer && budget > 0; ++j) {
    const uint32_t next = layer + j;
    candidates_.clear();
    for (const ExpertHint& hint : hints) {
      if (hint.layer == next && !tier_->contains(next, hint.expert))
        candidates_.push_back(hint.expert);
    }
    if (candidates_.empty()) continue;
    source_.host_ready(next, candidates_,
                       std::span<uint8_t>(ready_flags_.data(), candidates_.size()));
    for (size_t i = 0; i < candidates_.size() && budget > 0; ++i) {
      if (ready_flags_[i] == 0) continue;
      ExpertView v;
      if (!source_.get(next, std::span<const uint32_t>(&candidates_[i], 1),
                       std::span<ExpertView>(&v, 1))) {
        continue;  // evicted meanwhile: a hint, not a failure
      }
      // Not forced: a prefetch never displaces an expert the policy values more.
      VramTier::Entry evicted;
      const uint32_t slot = tier_->insert(next, candidates_[i], true, false, &evicted);
      EXPERTD_TRY(unkeep(evicted));
      if (slot == VramTier::kNone) {
        EXPERTD_TRY(source_.release(std::span<const ExpertView>(&v, 1)));
        continue;
      }
      if (auto st = copy_expert(v, slot, Copy::Prefetch); !st) {
        tier_->erase(slot);
        (void)source_.release(std::span<const ExpertView>(&v, 1));
        return st;
      }
      prefetch_holds_.push_back(PrefetchHold{v, slot});
      ++stats_.vram_prefetches;
      --budget;
    }
  }
  return Ok{};
}

Status GpuExperts::give_back(std::span<const ExpertView> views, bool kept) {
  return kept && gpu_.coordinate ? source_.release_kept(views) : source_.release(views);
}

Status GpuExperts::unkeep(const VramTier::Entry& evicted) {
  if (!gpu_.coordinate || evicted.layer == VramTier::kNone) return Ok{};
  return source_.unkeep(evicted.layer, evicted.expert);
}

Status GpuExperts::release_demand_holds() {
  Status result = Ok{};
  for (size_t i = 0; i < demand_holds_.size(); ++i) {
    auto st = give_back(std::span<const ExpertView>(&demand_holds_[i], 1), demand_kept_[i] != 0);
    if (!st && result) result = std::move(st);
  }
  demand_holds_.clear();
  demand_kept_.clear();
  return result;
}

void GpuExperts::measure_tiers() {
  if (!tier_) return;
  const uint32_t host = source_.host_resident(p_.n_expert, host_resident_);
  if (host == 0) return;
  stats_.tiers_distinct = tier_->distinct_with(host_resident_);
  stats_.tiers_capacity = tier_->capacity() + host;
  stats_.tiers_distinct_sum += stats_.tiers_distinct;
  ++stats_.tiers_samples;
}

Status GpuExperts::release_finished_prefetch_holds(bool all) {
  Status result = Ok{};
  size_t kept = 0;
  for (size_t i = 0; i < prefetch_holds_.size(); ++i) {
    PrefetchHold& held = prefetch_holds_[i];
    const cudaError_t q = all ? cudaSuccess : cudaEventQuery(ready_event_[held.slot].get());
    if (q == cudaErrorNotReady) {
      prefetch_holds_[kept++] = held;
      continue;
    }
    if (q != cudaSuccess) {
      cudaGetLastError();
      result = cuda::cuda_error(q, "cudaEventQuery(ready_event[slot])", __FILE__, __LINE__);
    }
    auto st = give_back(std::span<const ExpertView>(&held.view, 1), true);
    if (!st && result) result = std::move(st);
  }
  prefetch_holds_.resize(kept);
  return result;
}

Status GpuExperts::sync_compute() {
  EXPERTD_CUDA_TRY(timed_sync(compute_, stats_));
  return synced();
}

Status GpuExperts::logits_to_host(const float* device, float* host, std::span<float> out) {
  EXPERTD_CUDA_TRY(
      cudaMemcpyAsync(host, device, out.size() * sizeof(float), cudaMemcpyDeviceToHost, compute_));
  EXPERTD_CUDA_TRY(timed_sync(compute_, stats_));
  EXPERTD_TRY(release_demand_holds());
  EXPERTD_TRY(release_finished_prefetch_holds(false));
  std::memcpy(out.data(), host, out.size() * sizeof(float));
  return Ok{};
}

Status GpuExperts::synced() {
  EXPERTD_TRY(release_demand_holds());
  EXPERTD_TRY(release_finished_prefetch_holds(false));
  return account_copy_time();
}

Status GpuExperts::account_copy_time() {
  if (!copy_timing_) return Ok{};
  float ms = 0.0f;
  if (cudaEventQuery(copy_end_.get()) == cudaSuccess) {
    EXPERTD_CUDA_TRY(cudaEventElapsedTime(&ms, copy_start_.get(), copy_end_.get()));
    stats_.copy_ns += static_cast<uint64_t>(static_cast<double>(ms) * 1e6);
    copy_timing_ = false;
  }
  return Ok{};
}

std::string GpuExperts::description() const {
  if (!tier_) return "in-place experts (kernels read the daemon's pinned arena over PCIe)";
  std::string filled;
  if (stats_.vram_preloaded > 0) {
    filled =
        fmt::format(", {} experts of the last layers filled at start ({} in {:.1f} s, not timed)",
                    stats_.vram_preloaded, gib(stats_.vram_preload_bytes),
                    static_cast<double>(stats_.vram_preload_ns) / 1e9);
  }
  if (!preload_note_.empty()) filled += fmt::format(" ({})", preload_note_);
  return fmt::format("VRAM expert tier of {} experts ({}, {} policy{}{})", slots(),
                     gib(uint64_t{slots()} * slot_bytes_), tier_->policy_name(),
                     gpu_.coordinate ? ", coordinated with the daemon" : "", filled);
}

void StepExperts::reserve(uint32_t n_expert, uint64_t slots) {
  groups_.reserve(n_expert, slots);
  uses_.reserve(slots);
}

Status StepExperts::run(
    GpuExperts& experts, uint32_t layer, std::span<const uint32_t> routes, uint32_t k,
    std::span<ExpertPtrs> ptrs, EngineStats& stats,
    const std::function<Status(std::span<const uint32_t> group, std::span<const StepUse> uses)>&
        apply,
    const std::function<void(std::span<const uint32_t> group)>& before_acquire,
    const std::function<void(std::span<const uint32_t> group, uint64_t waited)>& acquired) {
  groups_.build(routes);
  const std::span<const uint32_t> needed = groups_.needed();
  for (size_t g0 = 0; g0 < needed.size(); g0 += k) {
    const std::span<const uint32_t> group =
        needed.subspan(g0, std::min<size_t>(k, needed.size() - g0));
    if (before_acquire) before_acquire(group);
    uint64_t waited = 0;
    EXPERTD_TRY(experts.acquire(layer, group, ptrs.first(group.size()), &waited));
    if (acquired) acquired(group, waited);
    // The group's route slots (row * k + slot), row by row as the rows route to them.
    uses_.clear();
    for (uint32_t g = 0; g < group.size(); ++g) {
      for (const uint32_t s : groups_.slots(group[g])) uses_.push_back(StepUse{g, s / k, s % k});
    }
    std::sort(uses_.begin(), uses_.end(), [](const StepUse& a, const StepUse& b) {
      return a.row != b.row ? a.row < b.row : a.slot < b.slot;
    });
    EXPERTD_TRY(apply(group, uses_));
    EXPERTD_TRY(experts.finish_layer());
    // The next group's acquire may need this one's slots and holds back.
    if (g0 + k < needed.size()) EXPERTD_TRY(experts.sync_compute());
  }
  stats.experts_used += needed.size();  // acquired and computed, as a prefill chunk counts them
  stats.batch_experts += needed.size();
  return Ok{};
}

}  // namespace expertd::engine::gpu
