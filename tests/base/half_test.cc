#include "base/half.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

namespace expertd {
namespace {

bool f16_is_nan(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0; }
bool bf16_is_nan(uint16_t b) { return (b & 0x7f80u) == 0x7f80u && (b & 0x7fu) != 0; }
float bits(uint32_t u) { return std::bit_cast<float>(u); }

TEST(Half, EveryF16ValueRoundTripsExactly) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const auto x = static_cast<uint16_t>(h);
    const float f = f16_to_float(x);
    if (f16_is_nan(x)) {
      EXPECT_TRUE(std::isnan(f)) << std::hex << h;
      EXPECT_TRUE(f16_is_nan(float_to_f16(f))) << std::hex << h;
      EXPECT_EQ(std::signbit(f), (h & 0x8000u) != 0);
      continue;
    }
    EXPECT_EQ(float_to_f16(f), x) << std::hex << h;
  }
}

TEST(Half, F16ToFloatKnownValues) {
  EXPECT_EQ(f16_to_float(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_float(0xc000), -2.0f);
  EXPECT_EQ(f16_to_float(0x7bff), 65504.0f);
  EXPECT_EQ(f16_to_float(0x0400), 0x1p-14f);  // smallest normal
  EXPECT_EQ(f16_to_float(0x0001), 0x1p-24f);  // smallest subnormal
  EXPECT_EQ(f16_to_float(0x03ff), 1023 * 0x1p-24f);
  EXPECT_EQ(f16_to_float(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(f16_to_float(0xfc00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::signbit(f16_to_float(0x8000)));
  EXPECT_EQ(f16_to_float(0x8000), 0.0f);
}

TEST(Half, FloatToF16RoundsToNearestEven) {
  // Halfway between 1 and 1 + 2^-10 goes to the even 1; halfway above 1 + 2^-10 goes up.
  EXPECT_EQ(float_to_f16(1.0f + 0x1p-11f), 0x3c00);
  EXPECT_EQ(float_to_f16(1.0f + 3 * 0x1p-11f), 0x3c02);
  EXPECT_EQ(float_to_f16(std::nextafter(1.0f + 0x1p-11f, 2.0f)), 0x3c01);
  EXPECT_EQ(float_to_f16(std::nextafter(1.0f + 0x1p-11f, 0.0f)), 0x3c00);
  // A carry out of the mantissa bumps the exponent: 2 - 2^-12 rounds to 2.
  EXPECT_EQ(float_to_f16(2.0f - 0x1p-12f), 0x4000);
  // The top of the range: 65519.99 stays 65504, 65520 (halfway, odd mantissa) is infinity.
  EXPECT_EQ(float_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_f16(std::nextafter(65520.0f, 0.0f)), 0x7bff);
  EXPECT_EQ(float_to_f16(65520.0f), 0x7c00);
  EXPECT_EQ(float_to_f16(-1e9f), 0xfc00);
  EXPECT_EQ(float_to_f16(std::numeric_limits<float>::max()), 0x7c00);
}

TEST(Half, FloatToF16Subnormals) {
  EXPECT_EQ(float_to_f16(0x1p-24f), 0x0001);
  EXPECT_EQ(float_to_f16(0x1p-25f), 0x0000);            // tie to even: 0
  EXPECT_EQ(float_to_f16(-0x1p-25f), 0x8000);           // keeps the sign
  EXPECT_EQ(float_to_f16(1.5f * 0x1p-25f), 0x0001);     // above the tie
  EXPECT_EQ(float_to_f16(3 * 0x1p-25f), 0x0002);        // 1.5 ulp: tie to even 2
  EXPECT_EQ(float_to_f16(5 * 0x1p-25f), 0x0002);        // 2.5 ulp: tie to even 2
  EXPECT_EQ(float_to_f16(1023 * 0x1p-24f), 0x03ff);     // largest subnormal
  EXPECT_EQ(float_to_f16(1023.5f * 0x1p-24f), 0x0400);  // rounds up into the normals
  EXPECT_EQ(float_to_f16(0x1p-14f), 0x0400);
  EXPECT_EQ(float_to_f16(1e-30f), 0x0000);
  EXPECT_EQ(float_to_f16(bits(0x00000001)), 0x0000);  // a float subnormal
}

TEST(Half, FloatToF16InfinityAndNan) {
  EXPECT_EQ(float_to_f16(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(float_to_f16(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_TRUE(f16_is_nan(float_to_f16(std::numeric_limits<float>::quiet_NaN())));
  // A NaN whose payload lies only in the low bits must not turn into infinity.
  EXPECT_TRUE(f16_is_nan(float_to_f16(bits(0x7f800001))));
  EXPECT_EQ(float_to_f16(bits(0xffc00000)) & 0x8000, 0x8000);  // sign kept
}

TEST(Half, EveryBf16ValueRoundTripsExactly) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const auto x = static_cast<uint16_t>(b);
    const float f = bf16_to_float(x);
    EXPECT_EQ(std::bit_cast<uint32_t>(f), b << 16);
    if (bf16_is_nan(x)) {
      EXPECT_TRUE(bf16_is_nan(float_to_bf16(f))) << std::hex << b;
      continue;
    }
    EXPECT_EQ(float_to_bf16(f), x) << std::hex << b;
  }
}

TEST(Half, FloatToBf16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16(1.0f + 0x1p-8f), 0x3f80);      // tie: even
  EXPECT_EQ(float_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82);  // tie: even, up
  EXPECT_EQ(float_to_bf16(std::nextafter(1.0f + 0x1p-8f, 2.0f)), 0x3f81);
  EXPECT_EQ(float_to_bf16(-2.0f), 0xc000);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7f80);  // rounds to infinity
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(float_to_bf16(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_EQ(float_to_bf16(bits(0x00000001)), 0x0000);  // float subnormals round too
  EXPECT_EQ(float_to_bf16(bits(0x00008000)), 0x0000);  // tie: even
  EXPECT_EQ(float_to_bf16(bits(0x00018000)), 0x0002);  // tie: even, up
}

TEST(Half, FloatToBf16KeepsNan) {
  // Truncating 0x7f800001 would give infinity; it must stay a (quiet) NaN.
  EXPECT_TRUE(bf16_is_nan(float_to_bf16(bits(0x7f800001))));
  EXPECT_TRUE(bf16_is_nan(float_to_bf16(bits(0xff800001))));
  EXPECT_EQ(float_to_bf16(bits(0xff800001)) & 0x8000, 0x8000);
  EXPECT_TRUE(bf16_is_nan(float_to_bf16(std::numeric_limits<float>::quiet_NaN())));
}

}  // namespace
}  // namespace expertd
