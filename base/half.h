// IEEE binary16 (ggml's f16) and bfloat16 conversions, header-only and dependency-free so the
// forge, the GGUF tools and the CPU reference engine share one definition.
//
// float -> f16 and float -> bf16 round to nearest, ties to even, in integer arithmetic (the result
// does not depend on the FPU rounding mode or on FMA contraction). Infinities map to infinities,
// a NaN stays a NaN of the same sign (quiet, keeping the top payload bits), values too large for
// f16 become infinity and values too small become signed zero; f16 subnormals are produced and
// read exactly. float_to_f16 equals the F16C instruction (vcvtps2ph, round to nearest) on all 2^32
// inputs; widening keeps every bit, so a signalling NaN stays signalling.
#pragma once

#include <bit>
#include <cstdint>

namespace expertd {

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  if (exp != 0) return std::bit_cast<float>(sign | ((exp + 112) << 23) | (mant << 13));
  // Zero or subnormal: mant * 2^-24 is exact in float.
  const float magnitude = static_cast<float>(mant) * 0x1p-24f;
  return std::bit_cast<float>(sign | std::bit_cast<uint32_t>(magnitude));
}

inline uint16_t float_to_f16(float f) {
  // Every candidate result is computed and the right one selected, without branches: the forge
  // converts hundreds of millions of values and the branchy form runs at half the speed.
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;

  // |f| >= 2^-14, a normal f16: re-bias the exponent (127 -> 15) and round the 13 dropped
  // mantissa bits to nearest even; a carry out of the mantissa correctly bumps the exponent.
  uint32_t m = abs - (112u << 23);
  m += 0xfffu + ((m >> 13) & 1u);
  const uint32_t normal = m >> 13;

  // |f| < 2^-14, a subnormal f16 q * 2^-24: q is the mantissa (with its implicit bit) shifted
  // right by 126 - exponent places, rounded to nearest even. Shifts past 31 give 0 like 31 does;
  // q == 0x400 is the smallest normal, encoded right.
  int32_t shift = 126 - static_cast<int32_t>(abs >> 23);
  shift = shift < 14 ? 14 : (shift > 31 ? 31 : shift);
  const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
  const uint32_t q = mant >> shift;
  const uint32_t rest = mant & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  const uint32_t subnormal = q + ((rest > half) | ((rest == half) & q));

  // NaN stays a quiet NaN with the top payload bits; from 65520 (halfway between 65504, the
  // largest f16, whose mantissa is odd, and 65536) up, and infinity, round to infinity.
  const uint32_t nan = 0x7e00u | ((abs >> 13) & 0x1ffu);
  uint32_t r = abs >= 0x38800000u ? normal : subnormal;
  r = abs >= 0x477ff000u ? 0x7c00u : r;
  r = abs > 0x7f800000u ? nan : r;
  return static_cast<uint16_t>(sign | r);
}

inline float bf16_to_float(uint16_t b) {
  return std::bit_cast<float>(static_cast<uint32_t>(b) << 16);
}

inline uint16_t float_to_bf16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  // Round to nearest even; a carry into the exponent is right (up to infinity).
  const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  const uint32_t nan = (x >> 16) | 0x40u;  // truncated, quiet
  return static_cast<uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

}  // namespace expertd
