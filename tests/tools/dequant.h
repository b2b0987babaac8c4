// Test helpers: ggml's reference dequantisation of the forge's types (dequantize_row_* in
// ggml-quants.c), the scale checks a loader would make, and summary statistics.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "storage/ggml_types.h"
#include "storage/half.h"
#include "storage/result.h"

namespace expertd::test {

inline float load_f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_float(h);
}

// ggml's get_scale_min_k4.
inline void scale_min_k4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = static_cast<uint8_t>((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4));
    *m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

inline Status dequantize(GgmlType type, std::span<const uint8_t> in, std::vector<float>& out) {
  const auto& tr = ggml_traits(type);
  if (in.size() % tr.block_bytes != 0) return make_error(EINVAL, "partial block");
  const size_t blocks = in.size() / tr.block_bytes;
  out.assign(blocks * tr.block_elems, 0.0f);
  float* y = out.data();
  for (size_t b = 0; b < blocks; ++b) {
    const uint8_t* x = in.data() + b * tr.block_bytes;
    switch (type) {
      case GgmlType::F32:
        std::memcpy(y, x, 4);
        break;
      case GgmlType::F16:
        *y = load_f16(x);
        break;
      case GgmlType::BF16: {
        uint16_t v;
        std::memcpy(&v, x, 2);
        *y = bf16_to_float(v);
        break;
      }
      case GgmlType::Q8_0: {
        const float d = load_f16(x);
        for (int i = 0; i < 32; ++i) y[i] = d * static_cast<float>(static_cast<int8_t>(x[2 + i]));
        break;
      }
      case GgmlType::Q4_0: {
        const float d = load_f16(x);
        for (int j = 0; j < 16; ++j) {
          y[j] = d * static_cast<float>((x[2 + j] & 0xf) - 8);
          y[j + 16] = d * static_cast<float>((x[2 + j] >> 4) - 8);
        }
        break;
      }
      case GgmlType::Q4_K: {
        const float d = load_f16(x);
        const float dmin = load_f16(x + 2);
        const uint8_t* scales = x + 4;
        const uint8_t* q = x + 16;
        float* o = y;
        for (int j = 0, is = 0; j < 256; j += 64, is += 2) {
          uint8_t sc = 0, m = 0;
          scale_min_k4(is, scales, &sc, &m);
          const float d1 = d * sc, m1 = dmin * m;
          scale_min_k4(is + 1, scales, &sc, &m);
          const float d2 = d * sc, m2 = dmin * m;
          for (int l = 0; l < 32; ++l) *o++ = d1 * static_cast<float>(q[l] & 0xf) - m1;
          for (int l = 0; l < 32; ++l) *o++ = d2 * static_cast<float>(q[l] >> 4) - m2;
          q += 32;
        }
        break;
      }
      case GgmlType::Q6_K: {
        const uint8_t* ql = x;
        const uint8_t* qh = x + 128;
        const auto* sc = reinterpret_cast<const int8_t*>(x + 192);
        const float d = load_f16(x + 208);
        float* o = y;
        for (int n = 0; n < 256; n += 128) {
          for (int l = 0; l < 32; ++l) {
            const int is = l / 16;
            const int q1 = ((ql[l] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32;
            const int q2 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            o[l] = d * sc[is] * static_cast<float>(q1);
            o[l + 32] = d * sc[is + 2] * static_cast<float>(q2);
            o[l + 64] = d * sc[is + 4] * static_cast<float>(q3);
            o[l + 96] = d * sc[is + 6] * static_cast<float>(q4);
          }
          o += 128;
          ql += 64;
          qh += 32;
          sc += 8;
        }
        break;
      }
      default:
        return make_error(EINVAL, "type not handled by the test dequantiser");
    }
    y += tr.block_elems;
  }
  return Ok{};
}

// Every f16 scale (d, and dmin for q4_k) of every block is finite and > 0.
inline Status check_scales(GgmlType type, std::span<const uint8_t> in) {
  const auto& tr = ggml_traits(type);
  std::vector<size_t> at;  // byte offsets of the f16 scales inside a block
  switch (type) {
    case GgmlType::Q8_0:
    case GgmlType::Q4_0:
      at = {0};
      break;
    case GgmlType::Q4_K:
      at = {0, 2};
      break;
    case GgmlType::Q6_K:
      at = {208};
      break;
    default:
      return Ok{};
  }
  for (size_t b = 0; b * tr.block_bytes < in.size(); ++b) {
    for (const size_t o : at) {
      const float d = load_f16(in.data() + b * tr.block_bytes + o);
      if (!std::isfinite(d) || !(d > 0.0f)) {
        return make_error(EINVAL, "block " + std::to_string(b) + " scale at +" + std::to_string(o) +
                                      " is " + std::to_string(d));
      }
    }
  }
  return Ok{};
}

struct Stats {
  double mean = 0;
  double stddev = 0;
  double max_abs = 0;
};

inline Stats stats(const std::vector<float>& v) {
  Stats s;
  for (const float x : v) {
    s.mean += x;
    s.max_abs = std::max(s.max_abs, static_cast<double>(std::fabs(x)));
  }
  s.mean /= static_cast<double>(v.size());
  for (const float x : v) s.stddev += (x - s.mean) * (x - s.mean);
  s.stddev = std::sqrt(s.stddev / static_cast<double>(v.size()));
  return s;
}

}  // namespace expertd::test
