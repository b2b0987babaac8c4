// Decoders of the ggml block formats on the device: the layouts of ggml's block_* structs
// (ggml-common.h) and the float operations of its reference dequantize_row_* (engine/dequant.cc is
// the CPU twin). dequant.cu decodes whole blocks with them; matvec_float.cu and matvec_quant.cu
// share the f16 widening (matvec_quant.cu reads the quants themselves in its own fused way).
//
// The element decoders (Deq, dequant8_*) use __fmul_rn/__fsub_rn, which keep nvcc from
// contracting the reference's multiply-subtract into an FMA, so their results are bit-identical to
// engine/dequant.cc. They read bytes one at a time: `src` need not be aligned.
//
// Internal to kernels/ (included by .cu files only); everything is in kernels::detail.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "storage/ggml_types.h"

namespace expertd::kernels::detail {

// The f16 in the low 16 bits, widened exactly (subnormals included).
__device__ __forceinline__ float half_bits_to_float(uint32_t bits) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(static_cast<unsigned short>(bits & 0xffffu)));
  return f;
}

__device__ __forceinline__ uint32_t u16_at(const uint8_t* p) {
  return uint32_t{p[0]} | (uint32_t{p[1]} << 8);
}

template <GgmlType T>
struct Deq;

template <>
struct Deq<GgmlType::F32> {
  static __device__ float at(const uint8_t* src, uint64_t e) {
    const uint8_t* p = src + 4 * e;
    return __uint_as_float(u16_at(p) | (u16_at(p + 2) << 16));
  }
};

template <>
struct Deq<GgmlType::F16> {
  static __device__ float at(const uint8_t* src, uint64_t e) {
    return half_bits_to_float(u16_at(src + 2 * e));
  }
};

template <>
struct Deq<GgmlType::BF16> {
  static __device__ float at(const uint8_t* src, uint64_t e) {
    return __uint_as_float(u16_at(src + 2 * e) << 16);
  }
};

// Plain types: any n, so elements past n are not read.
template <GgmlType T>
__device__ inline void dequant8_plain(const uint8_t* src, uint64_t e0, uint64_t n, float* out) {
#pragma unroll
  for (uint32_t i = 0; i < 8; ++i) out[i] = e0 + i < n ? Deq<T>::at(src, e0 + i) : 0.0f;
}

// block_q8_0 { f16 d; int8 qs[32]; }
__device__ inline void dequant8_q8_0(const uint8_t* src, uint64_t e0, float* out) {
  const uint8_t* blk = src + (e0 / 32) * 34;
  const uint32_t l0 = static_cast<uint32_t>(e0 % 32);
  const float d = half_bits_to_float(u16_at(blk));
#pragma unroll
  for (uint32_t i = 0; i < 8; ++i) {
    out[i] = __fmul_rn(d, static_cast<float>(static_cast<int8_t>(blk[2 + l0 + i])));
  }
}

// ggml's get_scale_min_k4.
__device__ inline void scale_min_k4(uint32_t j, const uint8_t* q, uint32_t* sc, uint32_t* m) {
  if (j < 4) {
    *sc = q[j] & 63u;
    *m = q[j + 4] & 63u;
  } else {
    *sc = (q[j + 4] & 0xfu) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// block_q4_K { f16 d; f16 dmin; u8 scales[12]; u8 qs[128]; }: element 64c + l of a block is the low
// nibble of qs[32c + l] (scale 2c) for l < 32, the high nibble of qs[32c + l - 32] (scale 2c + 1)
// for l >= 32.
__device__ inline void dequant8_q4_k(const uint8_t* src, uint64_t e0, float* out) {
  const uint8_t* blk = src + (e0 / 256) * 144;
  const uint32_t j = static_cast<uint32_t>(e0 % 256);
  const uint32_t c = j / 64;
  const uint32_t hi = (j / 32) & 1u;
  const uint32_t l0 = j % 32;
  uint32_t sc = 0;
  uint32_t m = 0;
  scale_min_k4(2 * c + hi, blk + 4, &sc, &m);
  const float d1 = __fmul_rn(half_bits_to_float(u16_at(blk)), static_cast<float>(sc));
  const float m1 = __fmul_rn(half_bits_to_float(u16_at(blk + 2)), static_cast<float>(m));
  const uint8_t* q = blk + 16 + 32 * c + l0;
#pragma unroll
  for (uint32_t i = 0; i < 8; ++i) {
    const uint32_t v = hi ? (q[i] >> 4) : (q[i] & 0xfu);
    out[i] = __fsub_rn(__fmul_rn(d1, static_cast<float>(v)), m1);
  }
}

// block_q6_K { u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d; }: element 128h + 32q + l (q < 4,
// l < 32) takes its low four bits from ql[64h + 32(q & 1) + l] (low nibble for q < 2, high for
// q >= 2), its high two from bits 2q of qh[32h + l], and scale 8h + l/16 + 2q.
__device__ inline void dequant8_q6_k(const uint8_t* src, uint64_t e0, float* out) {
  const uint8_t* blk = src + (e0 / 256) * 210;
  const uint32_t j = static_cast<uint32_t>(e0 % 256);
  const uint32_t h = j / 128;
  const uint32_t quarter = (j % 128) / 32;
  const uint32_t l0 = j % 32;
  const uint8_t* ql = blk + 64 * h + 32 * (quarter & 1u);
  const uint8_t* qh = blk + 128 + 32 * h;
  const int sc = static_cast<int8_t>(blk[192 + 8 * h + l0 / 16 + 2 * quarter]);
  const float ds = __fmul_rn(half_bits_to_float(u16_at(blk + 208)), static_cast<float>(sc));
#pragma unroll
  for (uint32_t i = 0; i < 8; ++i) {
    const uint32_t l = l0 + i;
    const uint32_t lo = quarter >= 2 ? (ql[l] >> 4) : (ql[l] & 0xfu);
    const uint32_t hb = (qh[l] >> (2 * quarter)) & 3u;
    const int v = static_cast<int>(lo | (hb << 4)) - 32;
    out[i] = __fmul_rn(ds, static_cast<float>(v));
  }
}

// ggml's GGML_E8M0_TO_FP32_HALF: 2^(e - 128), e = 0 and 1 subnormal, e = 255 2^127 (not NaN).
__device__ __forceinline__ float e8m0_to_float_half(uint32_t e) {
  return __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1u) << 23);
}

// kvalues_mxfp4, the e2m1 values doubled: magnitudes 0, 1, 2, 3, 4, 6, 8, 12 as the bytes of a
// word pair (nibble bits 0-2), bit 3 the sign.
inline constexpr uint32_t kE2m1Lo = 0x03020100u;
inline constexpr uint32_t kE2m1Hi = 0x0c080604u;

__device__ __forceinline__ int e2m1_value(uint32_t nibble) {
  const uint32_t m = nibble & 7u;
  const int mag = static_cast<int>(((m < 4 ? kE2m1Lo : kE2m1Hi) >> (8 * (m & 3u))) & 0xffu);
  return nibble & 8u ? -mag : mag;
}

// block_mxfp4 { u8 e; u8 qs[16]; }: element j < 16 is the low nibble of qs[j], element j + 16 the
// high nibble of qs[j]; value kvalue * 2^(e - 128) (dequantize_row_mxfp4).
__device__ inline void dequant8_mxfp4(const uint8_t* src, uint64_t e0, float* out) {
  const uint8_t* blk = src + (e0 / 32) * 17;
  const uint32_t l0 = static_cast<uint32_t>(e0 % 32);
  const float d = e8m0_to_float_half(blk[0]);
  const uint8_t* qs = blk + 1 + l0 % 16;
  const uint32_t shift = l0 >= 16 ? 4 : 0;
#pragma unroll
  for (uint32_t i = 0; i < 8; ++i) {
    out[i] = __fmul_rn(static_cast<float>(e2m1_value(qs[i] >> shift)), d);
  }
}

// Element i (0 or 1) of a word of two 16-bit values, or the word itself for f32.
template <GgmlType T>
__device__ __forceinline__ float plain_elem(uint32_t word, uint32_t i) {
  if constexpr (T == GgmlType::F32) {
    return __uint_as_float(word);
  } else if constexpr (T == GgmlType::F16) {
    return half_bits_to_float(i == 0 ? word : word >> 16);
  } else {
    return __uint_as_float(i == 0 ? word << 16 : word & 0xffff0000u);
  }
}

// silu(gate) * up: silu in double, rounded to float, times up in float, the CPU reference's
// operations exactly. kernels::swiglu and the matvecs' fused SwiGLU (MatvecBatch::up) both use
// this, so the fused down projection sees the same vector as swiglu then matvec.
__device__ __forceinline__ float swiglu_value(float gate, float up) {
  const double g = gate;
  const float silu = static_cast<float>(g / (1.0 + exp(-g)));
  return __fmul_rn(silu, up);
}

}  // namespace expertd::kernels::detail
