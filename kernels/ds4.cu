// DeepSeek-V4's decode ops (ds4.cuh). Each kernel is written next to the lines of
// engine/ds4_cpu_engine.cc it mirrors; the comments say where the order of operations differs.
#include <cmath>

#include "kernels/ds4.cuh"
#include "kernels/reduce.cuh"

namespace expertd::kernels {
namespace {

using detail::block_reduce;
using detail::dot;
using detail::kThreads;

__device__ double sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

uint32_t blocks_for(uint64_t n) { return static_cast<uint32_t>((n + kThreads - 1) / kThreads); }

// One block per row: rms_norm / rms_norm_plain.
__global__ void rms_norm_kernel(const float* x, const float* w, float* y, uint32_t n, float eps) {
  __shared__ double red[kThreads];
  const float* xr = x + static_cast<uint64_t>(blockIdx.x) * n;
  float* yr = y + static_cast<uint64_t>(blockIdx.x) * n;
  double ss = 0.0;
  for (uint32_t i = threadIdx.x; i < n; i += kThreads) {
    ss += static_cast<double>(xr[i]) * static_cast<double>(xr[i]);
  }
  ss = block_reduce<false>(ss, red);
  const double r = 1.0 / sqrt(ss / static_cast<double>(n) + static_cast<double>(eps));
  for (uint32_t i = threadIdx.x; i < n; i += kThreads) {
    const double v = static_cast<double>(xr[i]) * r;
    yr[i] = static_cast<float>(w != nullptr ? v * static_cast<double>(w[i]) : v);
  }
}

// One thread: hc_mix's weights, line for line.
__global__ void hc_weights_kernel(const float* mixes, const float* scale, const float* base,
                                  uint32_t hc, uint32_t iters, float eps, double* pre, double* post,
                                  double* comb) {
  for (uint32_t i = 0; i < hc; ++i) {
    pre[i] = sigmoid(static_cast<double>(mixes[i]) * scale[0] + base[i]) + eps;
    post[i] = 2.0 * sigmoid(static_cast<double>(mixes[hc + i]) * scale[1] + base[hc + i]);
  }
  for (uint32_t i = 0; i < hc; ++i) {
    double* row = comb + i * hc;
    for (uint32_t j = 0; j < hc; ++j) {
      const uint32_t k = 2 * hc + i * hc + j;
      row[j] = static_cast<double>(mixes[k]) * scale[2] + base[k];
    }
    double mx = row[0];
    for (uint32_t j = 1; j < hc; ++j) mx = fmax(mx, row[j]);
    double sum = 0.0;
    for (uint32_t j = 0; j < hc; ++j) {
      row[j] = exp(row[j] - mx);
      sum += row[j];
    }
    for (uint32_t j = 0; j < hc; ++j) row[j] /= sum;
    for (uint32_t j = 0; j < hc; ++j) row[j] += eps;
  }
  const uint32_t rounds = iters > 0 ? iters : 1;  // the reference normalises columns at least once
  for (uint32_t it = 0; it < rounds; ++it) {
    if (it > 0) {  // rows, from the second round on
      for (uint32_t i = 0; i < hc; ++i) {
        double s = 0.0;
        for (uint32_t j = 0; j < hc; ++j) s += comb[i * hc + j];
        for (uint32_t j = 0; j < hc; ++j) comb[i * hc + j] /= s + eps;
      }
    }
    for (uint32_t j = 0; j < hc; ++j) {
      double s = 0.0;
      for (uint32_t i = 0; i < hc; ++i) s += comb[i * hc + j];
      for (uint32_t i = 0; i < hc; ++i) comb[i * hc + j] /= s + eps;
    }
  }
}

__global__ void hc_head_kernel(const float* mixes, float scale, const float* base, uint32_t hc,
                               float eps, double* pre) {
  for (uint32_t i = 0; i < hc; ++i) {
    pre[i] = sigmoid(static_cast<double>(mixes[i]) * scale + base[i]) + eps;
  }
}

__global__ void hc_collapse_kernel(const float* streams, const double* pre, uint32_t hc, uint32_t n,
                                   float* out) {
  const uint32_t j = blockIdx.x * kThreads + threadIdx.x;
  if (j >= n) return;
  double acc = 0.0;
  for (uint32_t i = 0; i < hc; ++i) acc += pre[i] * streams[static_cast<uint64_t>(i) * n + j];
  out[j] = static_cast<float>(acc);
}

__global__ void hc_expand_kernel(float* streams, const float* out, const double* post,
                                 const double* comb, uint32_t hc, uint32_t n) {
  const uint32_t j = blockIdx.x * kThreads + threadIdx.x;
  if (j >= n) return;
  float old[kDs4MaxHc];
  for (uint32_t k = 0; k < hc; ++k) old[k] = streams[static_cast<uint64_t>(k) * n + j];
  for (uint32_t i = 0; i < hc; ++i) {
    double v = post[i] * out[j];
    for (uint32_t k = 0; k < hc; ++k) v += comb[k * hc + i] * old[k];
    streams[static_cast<uint64_t>(i) * n + j] = static_cast<float>(v);
  }
}

// Thread (head, pair).
__global__ void rope_kernel(float* v, uint32_t heads, uint32_t dim, uint32_t n_rot, uint32_t pos,
                            const double* inv_freq, bool inverse) {
  const uint32_t half = n_rot / 2;
  const uint32_t t = blockIdx.x * kThreads + threadIdx.x;
  if (t >= heads * half) return;
  const uint32_t h = t / half;
  const uint32_t i = t % half;
  float* r = v + static_cast<uint64_t>(h) * dim + (dim - n_rot);
  const double a = static_cast<double>(pos) * inv_freq[i];
  const double c = cos(a);
  const double s = inverse ? -sin(a) : sin(a);
  const double x0 = r[2 * i];
  const double x1 = r[2 * i + 1];
  r[2 * i] = static_cast<float>(x0 * c - x1 * s);
  r[2 * i + 1] = static_cast<float>(x1 * c + x0 * s);
}

// Thread per channel: compress()'s window softmax.
__global__ void compress_entry_kernel(const float* kv, const float* gate, const float* prev_kv,
                                      const float* prev_gate, uint32_t n_prev, uint32_t ratio,
                                      uint32_t coff, uint32_t dim, float* entry) {
  const uint32_t c = blockIdx.x * kThreads + threadIdx.x;
  if (c >= dim) return;
  const uint64_t width = static_cast<uint64_t>(coff) * dim;
  const uint64_t own = coff == 2 ? dim : 0;
  double mx = -INFINITY;
  for (uint32_t t = 0; t < n_prev; ++t) mx = fmax(mx, static_cast<double>(prev_gate[t * dim + c]));
  for (uint32_t t = 0; t < ratio; ++t)
    mx = fmax(mx, static_cast<double>(gate[t * width + own + c]));
  double sum = 0.0;
  double acc = 0.0;
  for (uint32_t t = 0; t < n_prev; ++t) {
    const double x = exp(prev_gate[t * dim + c] - mx);
    sum += x;
    acc += x * prev_kv[t * dim + c];
  }
  for (uint32_t t = 0; t < ratio; ++t) {
    const double x = exp(gate[t * width + own + c] - mx);
    sum += x;
    acc += x * kv[t * width + own + c];
  }
  entry[c] = static_cast<float>(acc / sum);
}

// Thread per entry, heads in order: select_entries()'s score.
__global__ void index_scores_kernel(const float* q, const float* w, const float* entries,
                                    uint32_t n, uint32_t heads, uint32_t dim, double* scores) {
  const uint32_t t = blockIdx.x * kThreads + threadIdx.x;
  if (t >= n) return;
  const double head_scale = 1.0 / sqrt(static_cast<double>(heads));
  const double softmax_scale = 1.0 / sqrt(static_cast<double>(dim));
  const float* k = entries + static_cast<uint64_t>(t) * dim;
  double score = 0.0;
  for (uint32_t h = 0; h < heads; ++h) {
    const double qk = dot(q + static_cast<uint64_t>(h) * dim, k, dim);
    score += (qk > 0 ? qk * softmax_scale : 0.0) * (w[h] * head_scale);
  }
  scores[t] = score;
}

// Thread per entry: its rank in (score descending, index ascending) is its place.
__global__ void top_entries_kernel(const double* scores, uint32_t n, uint32_t keep,
                                   uint32_t* chosen) {
  const uint32_t t = blockIdx.x * kThreads + threadIdx.x;
  if (t >= n) return;
  const double s = scores[t];
  uint32_t rank = 0;
  for (uint32_t u = 0; u < n && rank < keep; ++u) {
    const double o = scores[u];
    rank += (o > s || (o == s && u < t)) ? 1u : 0u;
  }
  if (rank < keep) chosen[rank] = t;
}

// Block per head: attention()'s loop over heads.
__global__ void attention_kernel(const float* q, const float* window, uint32_t ring, uint32_t first,
                                 uint32_t n_window, const float* entries, const uint32_t* chosen,
                                 uint32_t n_entries, const float* sinks, uint32_t hd,
                                 double* scratch, uint32_t stride, float* out) {
  __shared__ double red[kThreads];
  const uint32_t h = blockIdx.x;
  const float* qh = q + static_cast<uint64_t>(h) * hd;
  double* sc = scratch + static_cast<uint64_t>(h) * stride;
  const uint32_t n = n_window + n_entries;
  const double scale = 1.0 / sqrt(static_cast<double>(hd));
  auto key = [&](uint32_t i) -> const float* {
    if (i < n_window) return window + static_cast<uint64_t>((first + i) % ring) * hd;
    const uint32_t e = chosen != nullptr ? chosen[i - n_window] : i - n_window;
    return entries + static_cast<uint64_t>(e) * hd;
  };
  const double sink = sinks[h];
  double mx = sink;
  for (uint32_t i = threadIdx.x; i < n; i += kThreads) {
    sc[i] = dot(qh, key(i), hd) * scale;
    mx = fmax(mx, sc[i]);
  }
  mx = block_reduce<true>(mx, red);
  double part = 0.0;
  for (uint32_t i = threadIdx.x; i < n; i += kThreads) {
    sc[i] = exp(sc[i] - mx);
    part += sc[i];
  }
  // The reference adds exp(sink - mx) first and the rest in order; here in a tree.
  const double sum = exp(sink - mx) + block_reduce<false>(part, red);
  __syncthreads();  // every sc[i] written before any channel reads it
  for (uint32_t c = threadIdx.x; c < hd; c += kThreads) {
    double acc = 0.0;
    for (uint32_t i = 0; i < n; ++i) acc += (sc[i] / sum) * key(i)[c];
    out[static_cast<uint64_t>(h) * hd + c] = static_cast<float>(acc);
  }
}

__device__ float silu(float x) {
  return static_cast<float>(x / (1.0 + exp(-static_cast<double>(x))));
}

__global__ void swiglu_kernel(const float* gate, const float* up, float* out, uint64_t n,
                              float limit) {
  const uint64_t j = static_cast<uint64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (j >= n) return;
  float g = gate[j];
  float u = up[j];
  if (limit > 0) {
    g = fminf(g, limit);
    u = fminf(fmaxf(u, -limit), limit);
  }
  out[j] = __fmul_rn(silu(g), u);
}

__global__ void moe_sum_kernel(const float* expert_out, const float* weights, uint32_t k,
                               const float* shared, uint32_t n, float* out) {
  const uint32_t j = blockIdx.x * kThreads + threadIdx.x;
  if (j >= n) return;
  double acc = 0.0;
  for (uint32_t i = 0; i < k; ++i) {
    acc += static_cast<double>(weights[i]) * expert_out[static_cast<uint64_t>(i) * n + j];
  }
  if (shared != nullptr) acc += shared[j];
  out[j] = static_cast<float>(acc);
}

}  // namespace

cudaError_t ds4_rms_norm(const float* x, const float* w, float* y, uint32_t rows, uint32_t n,
                         float eps, cudaStream_t stream) {
  if (rows == 0 || n == 0) return cudaSuccess;
  rms_norm_kernel<<<rows, kThreads, 0, stream>>>(x, w, y, n, eps);
  return cudaGetLastError();
}

cudaError_t ds4_hc_weights(const float* mixes, const float* scale, const float* base, uint32_t hc,
                           uint32_t iters, float eps, double* pre, double* post, double* comb,
                           cudaStream_t stream) {
  if (hc == 0 || hc > kDs4MaxHc) return cudaErrorInvalidValue;
  hc_weights_kernel<<<1, 1, 0, stream>>>(mixes, scale, base, hc, iters, eps, pre, post, comb);
  return cudaGetLastError();
}

cudaError_t ds4_hc_head(const float* mixes, float scale, const float* base, uint32_t hc, float eps,
                        double* pre, cudaStream_t stream) {
  if (hc == 0 || hc > kDs4MaxHc) return cudaErrorInvalidValue;
  hc_head_kernel<<<1, 1, 0, stream>>>(mixes, scale, base, hc, eps, pre);
  return cudaGetLastError();
}

cudaError_t ds4_hc_collapse(const float* streams, const double* pre, uint32_t hc, uint32_t n,
                            float* out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  hc_collapse_kernel<<<blocks_for(n), kThreads, 0, stream>>>(streams, pre, hc, n, out);
  return cudaGetLastError();
}

cudaError_t ds4_hc_expand(float* streams, const float* out, const double* post, const double* comb,
                          uint32_t hc, uint32_t n, cudaStream_t stream) {
  if (hc == 0 || hc > kDs4MaxHc) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  hc_expand_kernel<<<blocks_for(n), kThreads, 0, stream>>>(streams, out, post, comb, hc, n);
  return cudaGetLastError();
}

cudaError_t ds4_rope(float* v, uint32_t heads, uint32_t dim, uint32_t n_rot, uint32_t pos,
                     const double* inv_freq, bool inverse, cudaStream_t stream) {
  if (n_rot > dim || n_rot % 2 != 0) return cudaErrorInvalidValue;
  const uint64_t threads = uint64_t{heads} * (n_rot / 2);
  if (threads == 0) return cudaSuccess;
  rope_kernel<<<blocks_for(threads), kThreads, 0, stream>>>(v, heads, dim, n_rot, pos, inv_freq,
                                                            inverse);
  return cudaGetLastError();
}

cudaError_t ds4_compress_entry(const float* kv, const float* gate, const float* prev_kv,
                               const float* prev_gate, uint32_t n_prev, uint32_t ratio,
                               uint32_t coff, uint32_t dim, float* entry, cudaStream_t stream) {
  if (coff != 1 && coff != 2) return cudaErrorInvalidValue;
  if (dim == 0) return cudaSuccess;
  compress_entry_kernel<<<blocks_for(dim), kThreads, 0, stream>>>(kv, gate, prev_kv, prev_gate,
                                                                  n_prev, ratio, coff, dim, entry);
  return cudaGetLastError();
}

cudaError_t ds4_index_scores(const float* q, const float* w, const float* entries, uint32_t n,
                             uint32_t heads, uint32_t dim, double* scores, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  index_scores_kernel<<<blocks_for(n), kThreads, 0, stream>>>(q, w, entries, n, heads, dim, scores);
  return cudaGetLastError();
}

cudaError_t ds4_top_entries(const double* scores, uint32_t n, uint32_t keep, uint32_t* chosen,
                            cudaStream_t stream) {
  if (n == 0 || keep == 0) return cudaSuccess;
  top_entries_kernel<<<blocks_for(n), kThreads, 0, stream>>>(scores, n, keep, chosen);
  return cudaGetLastError();
}

cudaError_t ds4_attention(const float* q, const float* window, uint32_t ring, uint32_t first,
                          uint32_t n_window, const float* entries, const uint32_t* chosen,
                          uint32_t n_entries, const float* sinks, uint32_t n_head, uint32_t hd,
                          double* scratch, uint32_t stride, float* out, cudaStream_t stream) {
  if (ring == 0 || stride < n_window + n_entries) return cudaErrorInvalidValue;
  if (n_head == 0) return cudaSuccess;
  attention_kernel<<<n_head, kThreads, 0, stream>>>(q, window, ring, first, n_window, entries,
                                                    chosen, n_entries, sinks, hd, scratch, stride,
                                                    out);
  return cudaGetLastError();
}

cudaError_t ds4_swiglu(const float* gate, const float* up, float* out, uint64_t n, float limit,
                       cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  swiglu_kernel<<<blocks_for(n), kThreads, 0, stream>>>(gate, up, out, n, limit);
  return cudaGetLastError();
}

cudaError_t ds4_moe_sum(const float* expert_out, const float* weights, uint32_t k,
                        const float* shared, uint32_t n, float* out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  moe_sum_kernel<<<blocks_for(n), kThreads, 0, stream>>>(expert_out, weights, k, shared, n, out);
  return cudaGetLastError();
}

}  // namespace expertd::kernels
