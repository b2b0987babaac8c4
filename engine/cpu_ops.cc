#include "engine/cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "engine/dequant.h"

namespace expertd::engine {

void matvec(const WeightView& w, const float* x, float* y, float* row) {
  for (uint64_t r = 0; r < w.rows; ++r) {
    dequantize_row(w.type, w.data + r * w.row_bytes, row, w.cols);
    y[r] = static_cast<float>(dot(row, x, w.cols));
  }
}

void matmul(const WeightView& w, const float* x, size_t x_stride, float* y, size_t y_stride,
            size_t n, float* row) {
  for (uint64_t r = 0; r < w.rows; ++r) {
    dequantize_row(w.type, w.data + r * w.row_bytes, row, w.cols);
    for (size_t i = 0; i < n; ++i) {
      y[i * y_stride + r] = static_cast<float>(dot(row, x + i * x_stride, w.cols));
    }
  }
}

void ExpertGroups::reserve(uint32_t n_expert, uint64_t slots) {
  by_expert_.resize(slots);
  first_.resize(uint64_t{n_expert} + 1);
  needed_.resize(n_expert);
}

void ExpertGroups::build(std::span<const uint32_t> routes) {
  // A counting sort: count, prefix sums, place, then shift the starts back.
  const auto n_expert = static_cast<uint32_t>(needed_.size());
  std::fill(first_.begin(), first_.end(), 0u);
  for (const uint32_t x : routes) ++first_[x + 1];
  n_needed_ = 0;
  for (uint32_t x = 0; x < n_expert; ++x) {
    if (first_[x + 1] != 0) needed_[n_needed_++] = x;
    first_[x + 1] += first_[x];
  }
  for (uint32_t s = 0; s < routes.size(); ++s) by_expert_[first_[routes[s]]++] = s;
  for (uint32_t x = n_expert; x > 0; --x) first_[x] = first_[x - 1];
  first_[0] = 0;
}

void rms_norm(const float* x, const float* weight, float* y, size_t n, float eps) {
  double ss = 0.0;
  for (size_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  const double scale = 1.0 / std::sqrt(ss / static_cast<double>(n) + static_cast<double>(eps));
  for (size_t i = 0; i < n; ++i) {
    y[i] = static_cast<float>(static_cast<double>(x[i]) * scale * static_cast<double>(weight[i]));
  }
}

namespace {

// Rotates pair i, (v[i * step], v[i * step + offset]), for i < n_rot / 2.
void rotate_pairs(float* v, uint32_t n_rot, uint32_t pos, double base, uint32_t step,
                  uint32_t offset) {
  for (uint32_t i = 0; i < n_rot / 2; ++i) {
    const double theta =
        static_cast<double>(pos) * std::pow(base, -2.0 * static_cast<double>(i) / n_rot);
    const double c = std::cos(theta);
    const double s = std::sin(theta);
    float* a = v + uint64_t{i} * step;
    const double x0 = a[0];
    const double x1 = a[offset];
    a[0] = static_cast<float>(x0 * c - x1 * s);
    a[offset] = static_cast<float>(x0 * s + x1 * c);
  }
}

}  // namespace

void rope_neox(float* v, uint32_t n_rot, uint32_t pos, double base) {
  rotate_pairs(v, n_rot, pos, base, /*step=*/1, /*offset=*/n_rot / 2);
}

void rope_norm(float* v, uint32_t n_rot, uint32_t pos, double base) {
  rotate_pairs(v, n_rot, pos, base, /*step=*/2, /*offset=*/1);
}

void rope_neox_freqs(float* v, uint32_t n_rot, uint32_t pos, const double* inv_freq,
                     double mscale) {
  const uint32_t half = n_rot / 2;
  for (uint32_t i = 0; i < half; ++i) {
    const double theta = static_cast<double>(pos) * inv_freq[i];
    const double c = std::cos(theta) * mscale;
    const double s = std::sin(theta) * mscale;
    const double x0 = v[i];
    const double x1 = v[i + half];
    v[i] = static_cast<float>(x0 * c - x1 * s);
    v[i + half] = static_cast<float>(x0 * s + x1 * c);
  }
}

std::vector<double> rope_inv_freq(uint32_t n_rot, double base, const Yarn& yarn, bool truncate) {
  const uint32_t dim = n_rot;
  std::vector<double> f(dim / 2);
  for (uint32_t i = 0; i < dim / 2; ++i) f[i] = 1.0 / std::pow(base, 2.0 * i / dim);
  if (yarn.factor <= 0.0) return f;
  const double orig = yarn.orig_ctx;
  auto corr = [&](double rot) {
    return dim * std::log(orig / (rot * 2.0 * std::numbers::pi)) / (2.0 * std::log(base));
  };
  double low = corr(yarn.beta_fast);
  double high = corr(yarn.beta_slow);
  if (truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;
  for (uint32_t i = 0; i < dim / 2; ++i) {
    const double extrapolate = 1.0 - std::clamp((i - low) / (high - low), 0.0, 1.0);
    f[i] = f[i] / yarn.factor * (1.0 - extrapolate) + f[i] * extrapolate;
  }
  return f;
}

void rope_pairs(float* v, std::span<const double> inv_freq, uint32_t pos, bool inverse) {
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    const double a = static_cast<double>(pos) * inv_freq[i];
    const double c = std::cos(a);
    const double s = inverse ? -std::sin(a) : std::sin(a);
    const double x0 = v[2 * i];
    const double x1 = v[2 * i + 1];
    v[2 * i] = static_cast<float>(x0 * c - x1 * s);
    v[2 * i + 1] = static_cast<float>(x1 * c + x0 * s);
  }
}

void softmax(double* p, size_t n) {
  double mx = p[0];
  for (size_t i = 1; i < n; ++i) mx = std::max(mx, p[i]);
  double sum = 0.0;
  for (size_t i = 0; i < n; ++i) {
    p[i] = std::exp(p[i] - mx);
    sum += p[i];
  }
  for (size_t i = 0; i < n; ++i) p[i] /= sum;
}

}  // namespace expertd::engine
