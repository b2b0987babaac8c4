#include "forge/content.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
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

// deepseek4's additive terms stay small and its hyper-connection scales near 1; qwen3moe's
// names keep the fan-in amplitude (the deepseek4 rules touch no name a qwen3moe forge writes).
TEST(ForgeContent, Deepseek4ValueRanges) {
  const float small = 1.0f / 128;
  for (const char* name :
       {"blk.0.hc_attn_fn.weight", "blk.3.hc_ffn_base.weight", "output_hc_fn.weight",
        "blk.1.attn_compressor_ape.weight", "blk.1.indexer_compressor_ape.weight",
        "blk.2.attn_sinks.weight", "blk.5.exp_probs_b.bias"}) {
    EXPECT_EQ(forge_value_range(name, 16384).center, 0.0f) << name;
    EXPECT_EQ(forge_value_range(name, 16384).amplitude, small) << name;
  }
  for (const char* name :
       {"blk.0.hc_attn_scale.weight", "blk.0.hc_ffn_scale.weight", "output_hc_scale.weight",
        "blk.0.attn_compressor_norm.weight", "blk.0.attn_kv_a_norm.weight"}) {
    EXPECT_EQ(forge_value_range(name, 3).center, 1.0f) << name;
    EXPECT_EQ(forge_value_range(name, 3).amplitude, 1.0f / 16) << name;
  }
  for (const char* name : {"blk.0.attn_q.weight", "blk.0.ffn_gate_inp.weight",
                           "blk.0.ffn_up_exps.weight", "output.weight", "token_embd.weight"}) {
    EXPECT_NEAR(forge_value_range(name, 256).amplitude, std::sqrt(3.0 / 256), 1e-7) << name;
  }
  const auto hc = tensor("blk.0.hc_attn_fn.weight", GgmlType::F32, {16384, 24});
  std::vector<float> v;
  ASSERT_TRUE(test::dequantize(GgmlType::F32, expected(3, hc, 0, hc.bytes), v));
  EXPECT_LE(test::stats(v).max_abs, small);
  EXPECT_GT(test::stats(v).stddev, 0.5 * small / std::sqrt(3.0));
}

// A hash-routing table: any byte range equals the whole table there; rows are distinct experts.
TEST(ForgeContent, HashTableRowsAnyRange) {
  auto t = tensor("blk.1.ffn_gate_tid2eid.weight", GgmlType::I32, {6, 500});
  const auto whole = [&] {
    std::vector<uint8_t> out(t.bytes);
    EXPECT_TRUE(forge_expected_bytes(4, t, 0, out, 256));
    return out;
  }();
  std::mt19937_64 rng(11);
  for (int i = 0; i < 200; ++i) {
    const uint64_t off = rng() % (t.bytes + 1);
    const uint64_t n = rng() % (t.bytes - off + 1) % 200;
    std::vector<uint8_t> part(n);
    ASSERT_TRUE(forge_expected_bytes(4, t, off, part, 256));
    ASSERT_TRUE(std::equal(part.begin(), part.end(), whole.begin() + off)) << off << "+" << n;
  }
  std::vector<int32_t> ids(t.bytes / 4);
  std::memcpy(ids.data(), whole.data(), t.bytes);
  for (uint64_t row = 0; row < 500; ++row) {
    const std::set<int32_t> r(ids.begin() + row * 6, ids.begin() + row * 6 + 6);
    ASSERT_EQ(r.size(), 6u) << row;
    ASSERT_GE(*r.begin(), 0);
    ASSERT_LT(*r.rbegin(), 256);
  }
  // All of a 6-of-6 table is a permutation; another seed or layer gives another table.
  auto full = tensor("blk.0.ffn_gate_tid2eid.weight", GgmlType::I32, {6, 4});
  std::vector<uint8_t> perm(full.bytes);
  ASSERT_TRUE(forge_expected_bytes(4, full, 0, perm, 6));
  std::vector<int32_t> p(24);
  std::memcpy(p.data(), perm.data(), perm.size());
  for (int row = 0; row < 4; ++row) {
    EXPECT_EQ(std::set<int32_t>(p.begin() + row * 6, p.begin() + row * 6 + 6),
              (std::set<int32_t>{0, 1, 2, 3, 4, 5}));
  }
  std::vector<uint8_t> other(t.bytes);
  ASSERT_TRUE(forge_expected_bytes(5, t, 0, other, 256));
  EXPECT_NE(other, whole);
  // Only tables of that name are i32 content; any other i32 tensor is refused.
  std::vector<uint8_t> out(8);
  EXPECT_FALSE(forge_expected_bytes(4, tensor("blk.1.other.weight", GgmlType::I32, {2}), 0, out));
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
  EXPECT_EQ(info->expert_count, 0u);  // no architecture: no expert count

  forged.set_string("general.architecture", "deepseek4");
  forged.set_u32("deepseek4.expert_count", 256);
  meta = forged.serialize_metadata();
  src = memory_source("forged.gguf", meta);
  f = GgufFile::parse(*src);
  ASSERT_TRUE(f);
  info = forge_info(*f);
  ASSERT_TRUE(info) << info.error().message;
  EXPECT_EQ(info->expert_count, 256u);

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
