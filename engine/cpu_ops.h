// The CPU reference kernels: plain loops in float with double accumulation, written for clarity
// and as the yardstick the CUDA kernels are compared against. None allocates.
#pragma once

#include <cstddef>
#include <cstdint>

#include "engine/model.h"

namespace expertd::engine {

// y[r] = sum_c W[r][c] * x[c] for every row r of `w`, accumulated in double. Each row is
// dequantised into `row` (w.cols floats) first. `w` must have passed dequant_check.
void matvec(const WeightView& w, const float* x, float* y, float* row);

// y = x / sqrt(mean(x^2) + eps) * weight over n elements (y may alias x).
void rms_norm(const float* x, const float* weight, float* y, size_t n, float eps);

// NEOX rotary embedding (llama.cpp's rope type 2, Hugging Face's rotate_half): the first n_rot
// dimensions of `v` are rotated in pairs (i, i + n_rot/2) by pos * base^(-2i/n_rot).
void rope_neox(float* v, uint32_t n_rot, uint32_t pos, double base);

// In place: p[i] = exp(p[i] - max) / sum over n elements, computed in double.
void softmax(double* p, size_t n);

inline double dot(const float* a, const float* b, size_t n) {
  double s = 0.0;
  for (size_t i = 0; i < n; ++i) s += static_cast<double>(a[i]) * static_cast<double>(b[i]);
  return s;
}

}  // namespace expertd::engine
