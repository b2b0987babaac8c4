// The CPU reference kernels: plain loops in float with double accumulation, written for clarity
// and as the yardstick the CUDA kernels are compared against. None allocates.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "engine/model.h"

namespace expertd::engine {

// y[r] = sum_c W[r][c] * x[c] for every row r of `w`, accumulated in double. Each row is
// dequantised into `row` (w.cols floats) first. `w` must have passed dequant_check.
void matvec(const WeightView& w, const float* x, float* y, float* row);

// The batched form, the CPU "GEMM" of prefill: y[i][r] = sum_c W[r][c] * x[i][c] for n inputs
// (rows x_stride / y_stride floats apart). Each row of `w` is dequantised once for all n inputs;
// every output is the same double-accumulated dot matvec computes, so the results are identical.
void matmul(const WeightView& w, const float* x, size_t x_stride, float* y, size_t y_stride,
            size_t n, float* row);

// y = x / sqrt(mean(x^2) + eps) * weight over n elements (y may alias x).
void rms_norm(const float* x, const float* weight, float* y, size_t n, float eps);

// NEOX rotary embedding (llama.cpp's rope type 2, Hugging Face's rotate_half): the first n_rot
// dimensions of `v` are rotated in pairs (i, i + n_rot/2) by pos * base^(-2i/n_rot).
void rope_neox(float* v, uint32_t n_rot, uint32_t pos, double base);
// NORM rotary embedding (llama.cpp's rope type 0, `llama`): pairs (2i, 2i + 1), the same angles.
void rope_norm(float* v, uint32_t n_rot, uint32_t pos, double base);
// The model's rope type.
inline void rope(RopeType type, float* v, uint32_t n_rot, uint32_t pos, double base) {
  if (type == RopeType::Norm) {
    rope_norm(v, n_rot, pos, base);
  } else {
    rope_neox(v, n_rot, pos, base);
  }
}

// NEOX rotation by pos * inv_freq[i], the cos and sin scaled by `mscale` (YaRN's attention
// factor, as transformers applies it).
void rope_neox_freqs(float* v, uint32_t n_rot, uint32_t pos, const double* inv_freq, double mscale);

// Inverse frequencies of n_rot / 2 rope pairs: base^(-2i/n_rot), or with YaRN (factor > 0) the
// blend of interpolated (/ factor) and extrapolated frequencies over the correction range of
// beta_fast..beta_slow rotations in orig_ctx positions (transformers' _compute_yarn_parameters).
// DeepSeek rounds the correction range outwards (`truncate`); gpt-oss's config says truncate:
// false.
std::vector<double> rope_inv_freq(uint32_t n_rot, double base, const Yarn& yarn,
                                  bool truncate = true);
// YaRN's attention factor for `factor` (1 without scaling).
inline double yarn_mscale(double factor) {
  return factor > 1.0 ? 0.1 * std::log(factor) + 1.0 : 1.0;
}

// Rotary embedding on adjacent pairs (llama.cpp's rope type 0; the interleaved layout DeepSeek's
// checkpoints use): pair (2i, 2i + 1) of v[0, 2 * inv_freq.size()) turns by pos * inv_freq[i],
// backwards when `inverse`.
void rope_pairs(float* v, std::span<const double> inv_freq, uint32_t pos, bool inverse = false);

// In place: p[i] = exp(p[i] - max) / sum over n elements, computed in double.
void softmax(double* p, size_t n);

// prefill(): a chunk's route slots (position * k + slot) grouped by expert: the experts routed to,
// in index order, and each one's slots in position order. Sized by reserve(); build() does not
// allocate.
class ExpertGroups {
 public:
  void reserve(uint32_t n_expert, uint64_t slots);
  // routes: [position][k] expert ids, each < n_expert.
  void build(std::span<const uint32_t> routes);
  std::span<const uint32_t> needed() const { return {needed_.data(), n_needed_}; }
  std::span<const uint32_t> slots(uint32_t expert) const {
    return {by_expert_.data() + first_[expert], first_[expert + 1] - first_[expert]};
  }

 private:
  std::vector<uint32_t> by_expert_;  // slots, expert by expert
  std::vector<uint32_t> first_;      // [n_expert + 1]: expert e's slots start at first_[e]
  std::vector<uint32_t> needed_;
  uint32_t n_needed_ = 0;
};

inline double dot(const float* a, const float* b, size_t n) {
  double s = 0.0;
  for (size_t i = 0; i < n; ++i) s += static_cast<double>(a[i]) * static_cast<double>(b[i]);
  return s;
}

}  // namespace expertd::engine
