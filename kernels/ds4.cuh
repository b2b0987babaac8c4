// DeepSeek-V4's own decode ops, for Ds4GpuEngine. Each mirrors a step of the CPU reference
// (engine/ds4_cpu_engine.cc) in the same order of operations and precision: float storage, double
// where the reference uses double (every dot product, norm sum, softmax, the HyperConnection
// weights and sums, RoPE angles). Sequential sums run in the reference's order where a thread owns
// them (a dot product, a channel's attention sum); block-wide sums (a norm's sum of squares, a
// softmax denominator) are reduced in a tree, which differs from the reference's sequential sum
// only in the last bits of a double.
//
// The small ops (HyperConnection weights with Sinkhorn-Knopp on hc x hc, hc <= 16) run in one
// thread; the rest in one block per row or head, or one thread per element. n, dims and counts
// are as the engine sizes them; a zero count launches nothing and succeeds.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace expertd::kernels {

inline constexpr uint32_t kDs4MaxHc = 16;

// rows vectors of n: y = x / sqrt(mean(x^2) + eps), times w when w is not null (y may alias x).
cudaError_t ds4_rms_norm(const float* x, const float* w, float* y, uint32_t rows, uint32_t n,
                         float eps, cudaStream_t stream);

// A HyperConnection's weights from its mixes ((2 + hc) * hc): pre = sigmoid(m * scale[0] + base)
// + eps, post = 2 sigmoid(m * scale[1] + base), comb = row softmax + eps then Sinkhorn-Knopp
// (columns, then iters - 1 rounds of rows and columns). pre, post: hc; comb: hc * hc.
cudaError_t ds4_hc_weights(const float* mixes, const float* scale, const float* base, uint32_t hc,
                           uint32_t iters, float eps, double* pre, double* post, double* comb,
                           cudaStream_t stream);

// The HyperHead's weights: pre[i] = sigmoid(mixes[i] * scale + base[i]) + eps.
cudaError_t ds4_hc_head(const float* mixes, float scale, const float* base, uint32_t hc, float eps,
                        double* pre, cudaStream_t stream);

// out[j] = sum_i pre[i] * streams[i][j] (streams: hc vectors of n).
cudaError_t ds4_hc_collapse(const float* streams, const double* pre, uint32_t hc, uint32_t n,
                            float* out, cudaStream_t stream);

// In place: streams[i][j] = post[i] * out[j] + sum_k comb[k][i] * streams[k][j].
cudaError_t ds4_hc_expand(float* streams, const float* out, const double* post, const double* comb,
                          uint32_t hc, uint32_t n, cudaStream_t stream);

// Interleaved RoPE on the trailing n_rot of each of `heads` vectors of `dim`: pairs (2i, 2i+1)
// rotated by pos * inv_freq[i] (inv_freq: n_rot / 2 doubles in device memory), by the conjugate
// rotation when `inverse`.
cudaError_t ds4_rope(float* v, uint32_t heads, uint32_t dim, uint32_t n_rot, uint32_t pos,
                     const double* inv_freq, bool inverse, cudaStream_t stream);

// One compressed entry of `dim` channels from a complete window: per channel c, the softmax over
// the window's slots of the gates weighting the projections. kv, gate: [ratio][coff * dim], this
// window's own half at offset dim when coff == 2; prev_kv, prev_gate: [n_prev][dim], the previous
// window's first half (n_prev = 0 or ratio).
cudaError_t ds4_compress_entry(const float* kv, const float* gate, const float* prev_kv,
                               const float* prev_gate, uint32_t n_prev, uint32_t ratio,
                               uint32_t coff, uint32_t dim, float* entry, cudaStream_t stream);

// The Lightning Indexer's scores of n entries ([n][dim]): scores[t] = sum_h relu(q_h . k_t) *
// dim^-0.5 * w[h] * heads^-0.5 (q: [heads][dim], w: heads).
cudaError_t ds4_index_scores(const float* q, const float* w, const float* entries, uint32_t n,
                             uint32_t heads, uint32_t dim, double* scores, cudaStream_t stream);

// chosen[0, min(n, keep)): the indices of the largest scores, largest first, ties to the lower
// index.
cudaError_t ds4_top_entries(const double* scores, uint32_t n, uint32_t keep, uint32_t* chosen,
                            cudaStream_t stream);

// Decode attention of n_head query heads over one shared K=V head: keys are the window ring's
// positions first .. first + n_window - 1 (slot (first + i) % ring, [ring][hd]) and then the
// entries chosen[0, n_entries) of `entries` ([*][hd]; chosen null: entries 0, 1, ...). A per-head
// sink joins the softmax's denominator. scratch: n_head * stride doubles, stride >= n_window +
// n_entries. out: [n_head][hd].
cudaError_t ds4_attention(const float* q, const float* window, uint32_t ring, uint32_t first,
                          uint32_t n_window, const float* entries, const uint32_t* chosen,
                          uint32_t n_entries, const float* sinks, uint32_t n_head, uint32_t hd,
                          double* scratch, uint32_t stride, float* out, cudaStream_t stream);

// out[i] = silu(min(gate[i], limit)) * clamp(up[i], -limit, limit) (limit 0: no clamp); out may
// alias gate or up.
cudaError_t ds4_swiglu(const float* gate, const float* up, float* out, uint64_t n, float limit,
                       cudaStream_t stream);

// out[j] = sum_i weights[i] * expert_out[i][j] + shared[j] (shared may be null), in double.
cudaError_t ds4_moe_sum(const float* expert_out, const float* weights, uint32_t k,
                        const float* shared, uint32_t n, float* out, cudaStream_t stream);

}  // namespace expertd::kernels
