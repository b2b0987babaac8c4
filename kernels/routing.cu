#include "kernels/routing.cuh"

namespace expertd::kernels {
namespace {

constexpr uint32_t kMaxThreads = 256;
constexpr uint32_t kSlots = 4;  // experts per thread: kMaxThreads * kSlots covers n_expert
constexpr uint32_t kMaxExperts = kMaxThreads * kSlots;
constexpr uint32_t kMaxK = 64;
constexpr uint32_t kNone = 0xffffffffu;

// Ranks (p, e) pairs: the larger probability first, equal probabilities the lower index first (the
// CPU reference's top_indices order). A slot with no expert carries p = -1, below every
// probability.
__device__ bool better(double pa, uint32_t ea, double pb, uint32_t eb) {
  return pa > pb || (pa == pb && ea < eb);
}

__device__ void warp_best(double& p, uint32_t& e) {
  for (int o = 16; o > 0; o >>= 1) {
    const double po = __shfl_xor_sync(0xffffffffu, p, o);
    const uint32_t eo = __shfl_xor_sync(0xffffffffu, e, o);
    if (better(po, eo, p, e)) {
      p = po;
      e = eo;
    }
  }
}

// Block-wide max or sum of one double per thread; every thread gets the result. `red` must not be
// in use by another reduction (the trailing barrier makes it free again on return).
template <bool kMax>
__device__ double block_reduce(double v, double* red) {
  for (int o = 16; o > 0; o >>= 1) {
    const double other = __shfl_xor_sync(0xffffffffu, v, o);
    v = kMax ? fmax(v, other) : v + other;
  }
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  double r = red[0];
  for (uint32_t w = 1; w < blockDim.x / 32; ++w) r = kMax ? fmax(r, red[w]) : r + red[w];
  __syncthreads();
  return r;
}

// One block per row; expert e lives in slot e / blockDim.x of thread e % blockDim.x. The softmax is
// computed in double like the CPU reference's, so the order of the top k (and the ties in it) is
// the reference's; then k rounds of a block-wide argmax pick the experts.
__global__ void __launch_bounds__(kMaxThreads)
    router_topk_kernel(const float* logits, uint32_t n_expert, uint32_t k, bool norm_topk,
                       uint32_t* experts, float* weights, float* probs) {
  __shared__ double red[kMaxThreads / 32];
  __shared__ double best_p[kMaxThreads / 32];
  __shared__ uint32_t best_e[kMaxThreads / 32];
  __shared__ double chosen_p[kMaxK];
  __shared__ uint32_t chosen_e[kMaxK];
  const uint64_t row = blockIdx.x;
  const float* lr = logits + row * n_expert;

  double p[kSlots];
  double mx = -INFINITY;
#pragma unroll
  for (uint32_t s = 0; s < kSlots; ++s) {
    const uint32_t e = threadIdx.x + s * blockDim.x;
    p[s] = e < n_expert ? static_cast<double>(lr[e]) : -INFINITY;
    mx = fmax(mx, p[s]);
  }
  mx = block_reduce<true>(mx, red);
  double sum = 0.0;
#pragma unroll
  for (uint32_t s = 0; s < kSlots; ++s) {
    const uint32_t e = threadIdx.x + s * blockDim.x;
    p[s] = e < n_expert ? exp(p[s] - mx) : 0.0;
    sum += p[s];
  }
  sum = block_reduce<false>(sum, red);
#pragma unroll
  for (uint32_t s = 0; s < kSlots; ++s) {
    const uint32_t e = threadIdx.x + s * blockDim.x;
    if (e < n_expert) {
      p[s] /= sum;
      if (probs != nullptr) probs[row * n_expert + e] = static_cast<float>(p[s]);
    } else {
      p[s] = -1.0;
    }
  }

  const uint32_t warp = threadIdx.x / 32;
  const uint32_t lane = threadIdx.x % 32;
  for (uint32_t j = 0; j < k; ++j) {
    double bp = -1.0;
    uint32_t be = kNone;
#pragma unroll
    for (uint32_t s = 0; s < kSlots; ++s) {
      const uint32_t e = threadIdx.x + s * blockDim.x;
      if (better(p[s], e, bp, be)) {
        bp = p[s];
        be = e;
      }
    }
    warp_best(bp, be);
    if (lane == 0) {
      best_p[warp] = bp;
      best_e[warp] = be;
    }
    __syncthreads();
    if (warp == 0) {
      bp = lane < blockDim.x / 32 ? best_p[lane] : -1.0;
      be = lane < blockDim.x / 32 ? best_e[lane] : kNone;
      warp_best(bp, be);
      if (lane == 0) {
        chosen_p[j] = bp;
        chosen_e[j] = be;
      }
    }
    __syncthreads();
    // The winner's owner retires it (k <= n_expert, so there always is a winner).
    const uint32_t won = chosen_e[j];
#pragma unroll
    for (uint32_t s = 0; s < kSlots; ++s) {
      if (threadIdx.x + s * blockDim.x == won) p[s] = -1.0;
    }
  }

  if (threadIdx.x == 0) {
    double total = 0.0;  // in selection order, as the reference sums
    for (uint32_t j = 0; j < k; ++j) total += chosen_p[j];
    for (uint32_t j = 0; j < k; ++j) {
      experts[row * k + j] = chosen_e[j];
      weights[row * k + j] = static_cast<float>(norm_topk ? chosen_p[j] / total : chosen_p[j]);
    }
  }
}

}  // namespace

cudaError_t router_topk(const float* logits, uint32_t rows, uint32_t n_expert, uint32_t k,
                        bool norm_topk, uint32_t* experts, float* weights, float* probs,
                        cudaStream_t stream) {
  if (logits == nullptr || experts == nullptr || weights == nullptr || rows == 0 ||
      rows > 0x7fffffffu || n_expert == 0 || n_expert > kMaxExperts || k == 0 || k > kMaxK ||
      k > n_expert) {
    return cudaErrorInvalidValue;
  }
  uint32_t threads = (n_expert + 31) / 32 * 32;
  if (threads > kMaxThreads) threads = kMaxThreads;
  router_topk_kernel<<<rows, threads, 0, stream>>>(logits, n_expert, k, norm_topk, experts, weights,
                                                   probs);
  return cudaGetLastError();
}

}  // namespace expertd::kernels
