// engine/dequant against the `gguf` Python package (llama.cpp's gguf-py): the committed vectors
// in tests/fixtures/dequant/ are random blocks of each type and what gguf.quants.dequantize makes
// of them; the engine's functions must give the same floats, bit for bit.
#include "engine/dequant.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>

#include "tests/engine/fixture.h"

namespace expertd::engine {
namespace {

using test::fixture_path;

class DequantVectors : public ::testing::TestWithParam<const char*> {};

TEST_P(DequantVectors, MatchesGgufPy) {
  const std::string name = GetParam();
  const auto manifest = test::read_json(fixture_path("dequant/vectors.json"));
  const auto& entry = manifest.at("types").at(name);
  const std::vector<uint8_t> raw = test::read_bytes(fixture_path("dequant/" + name + ".raw"));
  const std::vector<float> expected = test::read_f32(fixture_path("dequant/" + name + ".f32"));
  ASSERT_EQ(expected.size(), entry.at("elements").get<size_t>());
  ASSERT_EQ(raw.size(), entry.at("raw_bytes").get<size_t>());
  const auto type = ggml_type_from_name(name);
  ASSERT_TRUE(type.has_value());

  std::vector<float> got(expected.size());
  const Status st = dequantize(*type, raw, got);
  ASSERT_TRUE(st) << st.error().message;
  size_t mismatches = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::bit_cast<uint32_t>(got[i]) != std::bit_cast<uint32_t>(expected[i])) {
      if (mismatches++ < 5) {
        ADD_FAILURE() << name << " element " << i << ": " << got[i] << ", gguf-py " << expected[i];
      }
    }
  }
  EXPECT_EQ(mismatches, 0u) << name;

  // The per-row entry point used by matvec gives the same result one block row at a time.
  const uint32_t block = ggml_traits(*type).block_elems;
  const uint32_t block_bytes = ggml_traits(*type).block_bytes;
  std::vector<float> row(block);
  for (size_t b = 0; b < expected.size() / block; ++b) {
    dequantize_row(*type, raw.data() + b * block_bytes, row.data(), block);
    ASSERT_EQ(std::memcmp(row.data(), expected.data() + b * block, block * 4), 0) << name << b;
  }
}

INSTANTIATE_TEST_SUITE_P(Types, DequantVectors,
                         ::testing::Values("f32", "f16", "bf16", "q8_0", "q4_k", "q6_k", "mxfp4"),
                         [](const auto& p) { return std::string(p.param); });

TEST(Dequant, UnsupportedTypeIsAnErrorNamingIt) {
  const Status st = dequant_check(GgmlType::Q5_K, 256);
  ASSERT_FALSE(st);
  EXPECT_EQ(st.error().message,
            "q5_k: the engine cannot dequantise this type (supported: f32, f16, bf16, q8_0, q4_k, "
            "q6_k, mxfp4)");
  EXPECT_FALSE(expert_type_supported(GgmlType::IQ2_XXS));
}

TEST(Dequant, PartialBlocksAndWrongSizesAreErrors) {
  const Status partial = dequant_check(GgmlType::Q4_K, 100);
  ASSERT_FALSE(partial);
  EXPECT_EQ(partial.error().message,
            "q4_k: a row of 100 elements is not a whole number of 256-element blocks");
  std::vector<uint8_t> raw(34);
  std::vector<float> out(64);
  const Status size = dequantize(GgmlType::Q8_0, raw, out);
  ASSERT_FALSE(size);
  EXPECT_EQ(size.error().message, "q8_0: 64 elements need 68 bytes, got 34");
  EXPECT_TRUE(dequantize(GgmlType::MXFP4, raw, out));  // two 17-byte blocks
  const std::vector<uint8_t> odd(35);
  const Status mx = dequantize(GgmlType::MXFP4, odd, out);
  ASSERT_FALSE(mx);
  EXPECT_EQ(mx.error().message, "mxfp4: 64 elements need 34 bytes, got 35");
}

// The MXFP4 layout by hand: e8m0 exponent first, element j the low nibble of qs[j] and element
// j + 16 its high nibble, value kvalue * 2^(e - 128) with kvalues the e2m1 values doubled.
TEST(Dequant, Mxfp4BlockLayout) {
  std::vector<uint8_t> raw(17, 0);
  raw[0] = 130;                // 2^(130 - 128) = 4
  raw[1] = 0x1 | (0xf << 4);   // element 0: kvalue 1, element 16: kvalue -12
  raw[16] = 0x7 | (0x9 << 4);  // element 15: 12, element 31: -1
  raw[8] = 0x8;                // element 7: kvalue 0 ("-0")
  std::vector<float> out(32);
  ASSERT_TRUE(dequantize(GgmlType::MXFP4, raw, out));
  EXPECT_EQ(out[0], 4.0f);
  EXPECT_EQ(out[16], -48.0f);
  EXPECT_EQ(out[15], 48.0f);
  EXPECT_EQ(out[31], -4.0f);
  EXPECT_EQ(std::bit_cast<uint32_t>(out[7]), 0u);
  EXPECT_EQ(out[1], 0.0f);
  raw[0] = 0;  // ggml: 2^-128, a subnormal
  ASSERT_TRUE(dequantize(GgmlType::MXFP4, raw, out));
  EXPECT_EQ(out[0], std::ldexp(1.0f, -128));
}

}  // namespace
}  // namespace expertd::engine
