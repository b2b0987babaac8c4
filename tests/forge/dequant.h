// Test helpers: dequantisation of the forge's types, the scale checks a loader would make, and
// summary statistics.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "base/half.h"
#include "engine/dequant.h"
#include "expertd/result.h"
#include "storage/ggml_types.h"

namespace expertd::test {

inline float load_f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_float(h);
}

// The engine's dequantisers (engine/dequant.h, checked bit for bit against gguf-py's), plus q4_0,
// which the forge writes but the engine does not read.
inline Status dequantize(GgmlType type, std::span<const uint8_t> in, std::vector<float>& out) {
  const auto& tr = ggml_traits(type);
  if (in.size() % tr.block_bytes != 0) return make_error(EINVAL, "partial block");
  const size_t blocks = in.size() / tr.block_bytes;
  out.assign(blocks * tr.block_elems, 0.0f);
  if (type != GgmlType::Q4_0) return engine::dequantize(type, in, out);
  for (size_t b = 0; b < blocks; ++b) {
    const uint8_t* x = in.data() + b * tr.block_bytes;
    float* y = out.data() + b * tr.block_elems;
    const float d = load_f16(x);
    for (int j = 0; j < 16; ++j) {
      y[j] = d * static_cast<float>((x[2 + j] & 0xf) - 8);
      y[j + 16] = d * static_cast<float>((x[2 + j] >> 4) - 8);
    }
  }
  return Ok{};
}

// Every f16 scale (d, and dmin for q4_k) of every block is finite and > 0; every mxfp4 exponent is
// one of ggml's normal, finite scales (2..254).
inline Status check_scales(GgmlType type, std::span<const uint8_t> in) {
  const auto& tr = ggml_traits(type);
  if (type == GgmlType::MXFP4) {
    for (size_t b = 0; b * tr.block_bytes < in.size(); ++b) {
      const uint8_t e = in[b * tr.block_bytes];
      if (e < 2 || e > 254) {
        return make_error(EINVAL,
                          "block " + std::to_string(b) + " exponent is " + std::to_string(e));
      }
    }
    return Ok{};
  }
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
