#include "kernels/attention.cuh"

namespace expertd::kernels {
namespace {

constexpr uint32_t kMaxWarps = 16;
constexpr uint32_t kMaxHeadDim = 512;
// From this many positions on a head gets 16 warps instead of 8: more loads in flight per SM.
constexpr uint32_t kWidePositions = 4096;

__device__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// One block per query head. Each warp takes U positions at a time (positions warp*U.., then
// n_warps*U further on) and keeps an online softmax over them: its running max m, the sum l of
// exp(s - m) and acc[i] = sum exp(s - m) * v[i]. Lane j holds elements j, j+32, ... (P of them) of
// q, of the k and v rows it reads (so each row is read as coalesced 128-byte segments) and of acc.
// The warps' states are merged through shared memory at the end. Nothing depends on n_pos beyond
// the loop count, so any context length works with no scratch.
template <int P, int U>
__global__ void __launch_bounds__(kMaxWarps * 32)
    attention_kernel(const float* __restrict__ q, const float* __restrict__ k_cache,
                     const float* __restrict__ v_cache, float* __restrict__ out, uint32_t n_head_kv,
                     uint32_t head_dim, uint32_t group, uint32_t n_pos, float scale, uint32_t first,
                     const float* __restrict__ sinks) {
  extern __shared__ float smem[];  // acc[n_warps][head_dim], then m[n_warps], l[n_warps]
  const uint32_t h = blockIdx.x;
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t warp = threadIdx.x / 32;
  const uint32_t n_warps = blockDim.x / 32;
  const uint64_t pos_stride = uint64_t{n_head_kv} * head_dim;  // floats per cache position
  const uint64_t kv_off = uint64_t{h / group} * head_dim;

  float qr[P];
#pragma unroll
  for (int j = 0; j < P; ++j) {
    const uint32_t i = lane + 32 * j;
    qr[j] = i < head_dim ? q[uint64_t{h} * head_dim + i] : 0.0f;
  }
  float m = -INFINITY;
  float l = 0.0f;
  float acc[P];
#pragma unroll
  for (int j = 0; j < P; ++j) acc[j] = 0.0f;

  for (uint32_t t0 = first + warp * U; t0 < n_pos; t0 += n_warps * U) {
    // All loads of the step first, so U k rows and U v rows are in flight together.
    float kr[U][P];
    float vr[U][P];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const uint32_t t = t0 + u;
      const float* kp = k_cache + uint64_t{t} * pos_stride + kv_off;
      const float* vp = v_cache + uint64_t{t} * pos_stride + kv_off;
#pragma unroll
      for (int j = 0; j < P; ++j) {
        const uint32_t i = lane + 32 * j;
        const bool ok = t < n_pos && i < head_dim;
        kr[u][j] = ok ? kp[i] : 0.0f;
        vr[u][j] = ok ? vp[i] : 0.0f;
      }
    }
    float s[U];
    float mx = m;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float d = 0.0f;
#pragma unroll
      for (int j = 0; j < P; ++j) d = fmaf(qr[j], kr[u][j], d);
      d = warp_sum(d);
      s[u] = t0 + u < n_pos ? d * scale : -INFINITY;
      mx = fmaxf(mx, s[u]);
    }
    // mx is finite (position t0 is valid), so exp(m - mx) is 0 on the first step, not NaN.
    const float corr = expf(m - mx);
    l *= corr;
#pragma unroll
    for (int j = 0; j < P; ++j) acc[j] *= corr;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const float p = expf(s[u] - mx);  // 0 for the positions past n_pos
      l += p;
#pragma unroll
      for (int j = 0; j < P; ++j) acc[j] = fmaf(p, vr[u][j], acc[j]);
    }
    m = mx;
  }

  float* s_acc = smem;
  float* s_m = smem + n_warps * head_dim;
  float* s_l = s_m + n_warps;
#pragma unroll
  for (int j = 0; j < P; ++j) {
    const uint32_t i = lane + 32 * j;
    if (i < head_dim) s_acc[warp * head_dim + i] = acc[j];
  }
  if (lane == 0) {
    s_m[warp] = m;
    s_l[warp] = l;
  }
  __syncthreads();
  // Warp 0 always saw position `first`, so the overall max is finite; a warp that saw no position
  // has m = -inf, l = 0 and acc = 0 and weighs exp(-inf) = 0. A sink joins the max and the
  // denominator only.
  float mall = -INFINITY;
  for (uint32_t w = 0; w < n_warps; ++w) mall = fmaxf(mall, s_m[w]);
  if (sinks != nullptr) mall = fmaxf(mall, sinks[h]);
  float lall = 0.0f;
  for (uint32_t w = 0; w < n_warps; ++w) lall += s_l[w] * expf(s_m[w] - mall);
  if (sinks != nullptr) lall += expf(sinks[h] - mall);
  for (uint32_t i = threadIdx.x; i < head_dim; i += blockDim.x) {
    float o = 0.0f;
    for (uint32_t w = 0; w < n_warps; ++w) o += s_acc[w * head_dim + i] * expf(s_m[w] - mall);
    out[uint64_t{h} * head_dim + i] = o / lall;
  }
}

template <int P, int U>
cudaError_t launch(const float* q, const float* k_cache, const float* v_cache, float* out,
                   uint32_t n_head, uint32_t n_head_kv, uint32_t head_dim, uint32_t n_pos,
                   float scale, uint32_t first, const float* sinks, cudaStream_t stream) {
  const uint32_t warps = n_pos - first >= kWidePositions ? kMaxWarps : kMaxWarps / 2;
  const size_t smem = (size_t{warps} * head_dim + 2 * warps) * sizeof(float);
  attention_kernel<P, U><<<n_head, warps * 32, smem, stream>>>(q, k_cache, v_cache, out, n_head_kv,
                                                               head_dim, n_head / n_head_kv, n_pos,
                                                               scale, first, sinks);
  return cudaGetLastError();
}

}  // namespace

cudaError_t decode_attention(const float* q, const float* k_cache, const float* v_cache, float* out,
                             uint32_t n_head, uint32_t n_head_kv, uint32_t head_dim, uint32_t n_pos,
                             float scale, cudaStream_t stream, uint32_t first, const float* sinks) {
  if (q == nullptr || k_cache == nullptr || v_cache == nullptr || out == nullptr || n_head == 0 ||
      n_head_kv == 0 || n_head % n_head_kv != 0 || head_dim == 0 || head_dim > kMaxHeadDim ||
      n_pos == 0 || first >= n_pos || n_head > 0x7fffffffu) {
    return cudaErrorInvalidValue;
  }
  const uint32_t per_lane = (head_dim + 31) / 32;
  if (per_lane == 1) {
    return launch<1, 8>(q, k_cache, v_cache, out, n_head, n_head_kv, head_dim, n_pos, scale, first,
                        sinks, stream);
  }
  if (per_lane == 2) {
    return launch<2, 4>(q, k_cache, v_cache, out, n_head, n_head_kv, head_dim, n_pos, scale, first,
                        sinks, stream);
  }
  if (per_lane <= 4) {
    return launch<4, 4>(q, k_cache, v_cache, out, n_head, n_head_kv, head_dim, n_pos, scale, first,
                        sinks, stream);
  }
  if (per_lane <= 8) {
    return launch<8, 2>(q, k_cache, v_cache, out, n_head, n_head_kv, head_dim, n_pos, scale, first,
                        sinks, stream);
  }
  return launch<16, 1>(q, k_cache, v_cache, out, n_head, n_head_kv, head_dim, n_pos, scale, first,
                       sinks, stream);
}

}  // namespace expertd::kernels
