#include "engine/dequant.h"

#include <cstring>
#include <string>

#include "base/check.h"
#include "base/half.h"

namespace expertd::engine {
namespace {

float load_f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return f16_to_float(h);
}

// ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j from the 12 packed bytes.
void scale_min_k4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = static_cast<uint8_t>((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4));
    *m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

constexpr size_t kQk8 = 32;
constexpr size_t kQ8Bytes = 34;  // f16 d, int8 qs[32]
constexpr size_t kQkK = 256;
constexpr size_t kQ4KBytes = 144;  // f16 d, f16 dmin, u8 scales[12], u8 qs[128]
constexpr size_t kQ6KBytes = 210;  // u8 ql[128], u8 qh[64], i8 scales[16], f16 d
constexpr size_t kQkMxfp4 = 32;
constexpr size_t kMxfp4Bytes = 17;  // u8 e (e8m0), u8 qs[16]

// The e2m1 values doubled (ggml's kvalues_mxfp4), paired with half the e8m0 scale below.
constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// ggml's GGML_E8M0_TO_FP32_HALF: 2^(e - 128) built from bits (e = 0 and 1 are subnormals, e = 255
// is 2^127, not NaN), exactly as ggml-impl.h and gguf-py compute it.
float e8m0_to_float_half(uint8_t e) {
  const uint32_t bits = e < 2 ? uint32_t{0x00200000} << e : uint32_t{e - 1u} << 23;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

}  // namespace

void dequantize_f32(const uint8_t* src, float* dst, size_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

void dequantize_f16(const uint8_t* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = load_f16(src + 2 * i);
}

void dequantize_bf16(const uint8_t* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    uint16_t b;
    std::memcpy(&b, src + 2 * i, sizeof(b));
    dst[i] = bf16_to_float(b);
  }
}

void dequantize_q8_0(const uint8_t* src, float* dst, size_t n) {
  EXPERTD_CHECK_EQ(n % kQk8, 0);
  for (size_t b = 0; b < n / kQk8; ++b) {
    const uint8_t* x = src + b * kQ8Bytes;
    const float d = load_f16(x);
    for (size_t i = 0; i < kQk8; ++i) {
      *dst++ = d * static_cast<float>(static_cast<int8_t>(x[2 + i]));
    }
  }
}

void dequantize_q4_k(const uint8_t* src, float* dst, size_t n) {
  EXPERTD_CHECK_EQ(n % kQkK, 0);
  for (size_t b = 0; b < n / kQkK; ++b) {
    const uint8_t* x = src + b * kQ4KBytes;
    const float d = load_f16(x);
    const float dmin = load_f16(x + 2);
    const uint8_t* scales = x + 4;
    const uint8_t* q = x + 16;
    for (int j = 0, is = 0; j < static_cast<int>(kQkK); j += 64, is += 2) {
      uint8_t sc = 0;
      uint8_t m = 0;
      scale_min_k4(is, scales, &sc, &m);
      const float d1 = d * sc;
      const float m1 = dmin * m;
      scale_min_k4(is + 1, scales, &sc, &m);
      const float d2 = d * sc;
      const float m2 = dmin * m;
      for (int l = 0; l < 32; ++l) *dst++ = d1 * static_cast<float>(q[l] & 0xf) - m1;
      for (int l = 0; l < 32; ++l) *dst++ = d2 * static_cast<float>(q[l] >> 4) - m2;
      q += 32;
    }
  }
}

void dequantize_q6_k(const uint8_t* src, float* dst, size_t n) {
  EXPERTD_CHECK_EQ(n % kQkK, 0);
  for (size_t b = 0; b < n / kQkK; ++b) {
    const uint8_t* x = src + b * kQ6KBytes;
    const uint8_t* ql = x;
    const uint8_t* qh = x + 128;
    const auto* sc = reinterpret_cast<const int8_t*>(x + 192);
    const float d = load_f16(x + 208);
    for (size_t half = 0; half < 2; ++half) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = ((ql[l] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        dst[l] = d * sc[is] * static_cast<float>(q1);
        dst[l + 32] = d * sc[is + 2] * static_cast<float>(q2);
        dst[l + 64] = d * sc[is + 4] * static_cast<float>(q3);
        dst[l + 96] = d * sc[is + 6] * static_cast<float>(q4);
      }
      dst += 128;
      ql += 64;
      qh += 32;
      sc += 8;
    }
  }
}

void dequantize_mxfp4(const uint8_t* src, float* dst, size_t n) {
  EXPERTD_CHECK_EQ(n % kQkMxfp4, 0);
  for (size_t b = 0; b < n / kQkMxfp4; ++b) {
    const uint8_t* x = src + b * kMxfp4Bytes;
    const float d = e8m0_to_float_half(x[0]);
    const uint8_t* qs = x + 1;
    for (size_t j = 0; j < kQkMxfp4 / 2; ++j) {
      dst[j] = static_cast<float>(kMxfp4Values[qs[j] & 0xf]) * d;
      dst[j + kQkMxfp4 / 2] = static_cast<float>(kMxfp4Values[qs[j] >> 4]) * d;
    }
    dst += kQkMxfp4;
  }
}

namespace {

// "f32, f16, bf16, q8_0, q4_k, q6_k, mxfp4".
std::string expert_type_names() {
  std::string names;
  for (const GgmlType t : kExpertTypes) {
    if (!names.empty()) names += ", ";
    names += ggml_type_name(t);
  }
  return names;
}

}  // namespace

Status dequant_check(GgmlType type, uint64_t ne0) {
  if (!expert_type_supported(type)) {
    return make_error(ENOTSUP, std::string(ggml_type_name(type)) +
                                   ": the engine cannot dequantise this type (supported: " +
                                   expert_type_names() + ")");
  }
  const uint32_t block = ggml_traits(type).block_elems;
  if (ne0 == 0 || ne0 % block != 0) {
    return make_error(EINVAL, std::string(ggml_type_name(type)) + ": a row of " +
                                  std::to_string(ne0) + " elements is not a whole number of " +
                                  std::to_string(block) + "-element blocks");
  }
  return Ok{};
}

void dequantize_row(GgmlType type, const uint8_t* src, float* dst, size_t n) {
  switch (type) {
    case GgmlType::F32:
      return dequantize_f32(src, dst, n);
    case GgmlType::F16:
      return dequantize_f16(src, dst, n);
    case GgmlType::BF16:
      return dequantize_bf16(src, dst, n);
    case GgmlType::Q8_0:
      return dequantize_q8_0(src, dst, n);
    case GgmlType::Q4_K:
      return dequantize_q4_k(src, dst, n);
    case GgmlType::Q6_K:
      return dequantize_q6_k(src, dst, n);
    case GgmlType::MXFP4:
      return dequantize_mxfp4(src, dst, n);
    default:
      EXPERTD_UNREACHABLE("dequantize_row: unchecked type");
  }
}

Status dequantize(GgmlType type, std::span<const uint8_t> src, std::span<float> dst) {
  EXPERTD_TRY(dequant_check(type, dst.size()));
  const auto bytes = ggml_row_bytes(type, dst.size());
  if (!bytes || *bytes != src.size()) {
    return make_error(EINVAL, std::string(ggml_type_name(type)) + ": " +
                                  std::to_string(dst.size()) + " elements need " +
                                  std::to_string(bytes.value_or(0)) + " bytes, got " +
                                  std::to_string(src.size()));
  }
  dequantize_row(type, src.data(), dst.data(), dst.size());
  return Ok{};
}

}  // namespace expertd::engine
