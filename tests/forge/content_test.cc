#include "forge/content.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "base/half.h"
#include "forge/plan.h"
#include "storage/gguf_writer.h"
#include "tests/forge/dequant.h"

namespace expertd {
namespace {

GgufTensorInfo tensor(std::string name, GgmlType type, std::vector<uint64_t> ne) {
  GgufTensorInfo t;
  t.name = std::move(name);
  t.type = type;
  t.n_dims = static_cast<uint32_t>(ne.size());
  for (size_t i = 0; i < ne.size(); ++i) t.ne[i] = ne[i];
  const uint64_t row = *ggml_row_bytes(type, t.ne[0]);
  t.bytes = row * t.ne[1] * t.ne[2] * t.ne[3];
  return t;
}

std::vector<uint8_t> expected(uint64_t seed, const GgufTensorInfo& t, uint64_t off, uint64_t n) {
  std::vector<uint8_t> out(n);
  auto st = forge_expected_bytes(seed, t, off, out);
  EXPECT_TRUE(st) << (st ? "" : st.error().message);
  return out;
}

const GgmlType kTypes[] = {GgmlType::F32,  GgmlType::F16,  GgmlType::BF16, GgmlType::Q8_0,
                           GgmlType::Q4_0, GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::MXFP4};

// Any byte range gives the bytes of the whole tensor at that place: block boundaries, partial
// blocks at both ends, ranges inside one block, empty ranges.
TEST(ForgeContent, AnyRangeMatchesTheWholeTensor) {
  std::mt19937_64 rng(7);
  for (const GgmlType type : kTypes) {
    SCOPED_TRACE(std::string(ggml_type_name(type)));
    const auto t = tensor("blk.3.ffn_down_exps.weight", type, {256, 6, 3});
    const auto whole = expected(5, t, 0, t.bytes);
    for (int i = 0; i < 200; ++i) {
      const uint64_t off = rng() % (t.bytes + 1);
      const uint64_t n = rng() % (t.bytes - off + 1) % 1000;
      const auto part = expected(5, t, off, n);
      ASSERT_TRUE(std::equal(part.begin(), part.end(), whole.begin() + off)) << off << "+" << n;
    }
    // A tensor whose element count is not a whole number of generation blocks.
    const auto odd = tensor("odd_norm.weight", type == GgmlType::F32 ? type : GgmlType::F32, {37});
    const auto all = expected(5, odd, 0, odd.bytes);
    EXPECT_EQ(expected(5, odd, 100, 48), std::vector<uint8_t>(all.begin() + 100, all.end()));
  }
}

TEST(ForgeContent, DependsOnSeedNameAndPositionOnly) {
  const auto a = tensor("blk.0.ffn_up_exps.weight", GgmlType::Q4_K, {512, 4, 2});
  const auto b = tensor("blk.1.ffn_up_exps.weight", GgmlType::Q4_K, {512, 4, 2});
  auto a_moved = a;
  a_moved.rel_offset = 4096;  // placement does not matter
  a_moved.offset = 123456;
  EXPECT_EQ(expected(1, a, 0, a.bytes), expected(1, a_moved, 0, a.bytes));
  EXPECT_NE(expected(1, a, 0, a.bytes), expected(2, a, 0, a.bytes));
  EXPECT_NE(expected(1, a, 0, a.bytes), expected(1, b, 0, b.bytes));
  // Experts of one tensor differ from each other.
  const uint64_t expert = a.bytes / 2;
  EXPECT_NE(expected(1, a, 0, expert), expected(1, a, expert, expert));
}

TEST(ForgeContent, RejectsRangesOutsideTheTensorAndUnsupportedTypes) {
  const auto t = tensor("x.weight", GgmlType::Q8_0, {32, 2});
  std::vector<uint8_t> out(10);
  auto st = forge_expected_bytes(1, t, t.bytes - 5, out);
  ASSERT_FALSE(st);
  EXPECT_NE(st.error().message.find("x.weight"), std::string::npos);
  const auto q5 = tensor("y.weight", GgmlType::Q5_K, {256});
  st = forge_expected_bytes(1, q5, 0, out);
  ASSERT_FALSE(st);
  EXPECT_NE(st.error().message.find("q5_k"), std::string::npos);
}

// Dequantised, a forged tensor looks like a trained one: zero-mean noise of about the fan-in
// amplitude, inside +-1.3 x amplitude; norms are 1 + small noise. Every scale is finite and > 0.
TEST(ForgeContent, ValuesAndScalesAreSensible) {
  for (const GgmlType type : kTypes) {
    for (const uint64_t ne0 : {uint64_t{256}, uint64_t{4096}, uint64_t{1} << 20}) {
      SCOPED_TRACE(::testing::Message() << ggml_type_name(type) << " ne0 " << ne0);
      const auto t = tensor("blk.0.attn_q.weight", type, {ne0, 1024 * 1024 / ne0});
      const auto bytes = expected(9, t, 0, t.bytes);
      std::vector<float> v;
      auto st = test::dequantize(type, bytes, v);
      ASSERT_TRUE(st) << st.error().message;
      auto sc = test::check_scales(type, bytes);
      ASSERT_TRUE(sc) << sc.error().message;
      const float a = forge_value_range(t.name, ne0).amplitude;
      EXPECT_NEAR(a, std::sqrt(3.0 / static_cast<double>(ne0)), 1e-6);
      const auto s = test::stats(v);
      EXPECT_LT(std::fabs(s.mean), 0.05 * a);
      EXPECT_GT(s.stddev, 0.4 * a / std::sqrt(3.0));
      EXPECT_LT(s.stddev, 1.3 * a / std::sqrt(3.0));
      EXPECT_LE(s.max_abs, 1.3 * a);
    }
    const auto norm = tensor("blk.0.attn_norm.weight", type, {4096});
    std::vector<float> v;
    ASSERT_TRUE(test::dequantize(type, expected(9, norm, 0, norm.bytes), v));
    if (ggml_traits(type).block_elems == 1) {  // float types carry the centre
      for (const float x : v) ASSERT_NEAR(x, 1.0f, 1.0f / 16 + 1e-2f);
    } else {  // quantised ones are symmetric noise of amplitude 1 + 1/16
      EXPECT_LE(test::stats(v).max_abs, 1.3 * (1 + 1.0 / 16));
    }
  }
}

TEST(ForgeContent, ForgeInfoNeedsTheForgeKeys) {
  GgufWriter plain;
  plain.set_string("general.architecture", "qwen3moe");
  auto meta = plain.serialize_metadata();
  auto src = memory_source("plain.gguf", meta);
  auto f = GgufFile::parse(*src);
  ASSERT_TRUE(f);
  auto info = forge_info(*f);
  ASSERT_FALSE(info);
  EXPECT_EQ(info.error().message, "plain.gguf: not a forged model: no expertd.forge.seed key");

  GgufWriter forged;
  forged.set_u64(kForgeSeedKey, 77);
  forged.set_u32(kForgeVersionKey, kForgeVersion);
  meta = forged.serialize_metadata();
  src = memory_source("forged.gguf", meta);
  f = GgufFile::parse(*src);
  ASSERT_TRUE(f);
  info = forge_info(*f);
  ASSERT_TRUE(info) << info.error().message;
  EXPECT_EQ(info->seed, 77u);
  EXPECT_EQ(info->version, kForgeVersion);

  GgufWriter future;
  future.set_u64(kForgeSeedKey, 77);
  future.set_u32(kForgeVersionKey, kForgeVersion + 1);
  meta = future.serialize_metadata();
  src = memory_source("future.gguf", meta);
  f = GgufFile::parse(*src);
  ASSERT_TRUE(f);
  info = forge_info(*f);
  ASSERT_FALSE(info);
  EXPECT_NE(info.error().message.find("content version 2"), std::string::npos);
}

TEST(ForgeVocab, ByteTokensMergesAndControlTokens) {
  const ForgeVocab v = make_forge_vocab(1000);
  ASSERT_EQ(v.tokens.size(), 1000u);
  ASSERT_EQ(v.types.size(), 1000u);
  EXPECT_EQ(v.tokens[0], "!");                // GPT-2 order: printable bytes first
  EXPECT_EQ(v.tokens[187], "\xc3\xbf");       // U+00FF, the last printable byte
  EXPECT_EQ(v.tokens[188], "\xc4\x80");       // U+0100 stands for byte 0
  EXPECT_EQ(v.tokens[188 + 32], "\xc4\xa0");  // U+0120 'Ġ' stands for the space
  EXPECT_EQ(v.tokens[v.bos], "<|endoftext|>");
  EXPECT_EQ(v.tokens[v.eos], "<|im_end|>");
  EXPECT_EQ(v.types[v.bos], 3);
  EXPECT_EQ(v.types[v.eos], 3);
  EXPECT_EQ(v.types[500], 1);
  std::set<std::string> unique(v.tokens.begin(), v.tokens.end());
  EXPECT_EQ(unique.size(), v.tokens.size());
  // Every synthetic token is the merge of two earlier tokens, listed in order.
  ASSERT_EQ(v.merges.size(), 1000u - 256 - 2);
  for (size_t i = 0; i < v.merges.size(); ++i) {
    const std::string& m = v.merges[i];
    const size_t sp = m.find(' ');
    ASSERT_NE(sp, std::string::npos);
    EXPECT_EQ(m.substr(0, sp) + m.substr(sp + 1), v.tokens[256 + i]);
    EXPECT_TRUE(unique.count(m.substr(0, sp)) && unique.count(m.substr(sp + 1))) << m;
  }
  EXPECT_EQ(make_forge_vocab(1000).tokens, v.tokens);  // deterministic
}

}  // namespace
}  // namespace expertd
