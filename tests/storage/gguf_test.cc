// Valid GGUF files, written byte by byte with GgufBuilder, parse to the values, offsets, strides
// and byte counts the bytes say. The malformed cases are in gguf_malformed_test.cc.
#include "storage/gguf.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "storage/ggml_types.h"
#include "testing/paths.h"
#include "tests/storage/gguf_bytes.h"

namespace expertd {
namespace {

using test::GgufBuilder;
using test::GgufImage;
using test::TempDir;
using test::tensor_fill_byte;
using VT = GgufValueType;

GgufFile open_ok(const TempDir& dir, const std::string& name, const GgufImage& image) {
  const std::string path = dir.file(name);
  image.write(path);
  auto file = GgufFile::open(path);
  if (!file) ADD_FAILURE() << file.error().message;
  return file ? std::move(file).value() : GgufFile{};
}

GgufModel open_model_ok(const std::string& path) {
  auto model = GgufModel::open(path);
  if (!model) ADD_FAILURE() << model.error().message;
  return model ? std::move(model).value() : GgufModel{};
}

// ---------------------------------------------------------------------------------------------
// Header

class GgufVersionTest : public ::testing::TestWithParam<uint32_t> {};

TEST_P(GgufVersionTest, EmptyFileHasHeaderOnly) {
  TempDir dir;
  const GgufImage image = GgufBuilder(GetParam()).build();
  ASSERT_EQ(image.bytes.size(), 32u);  // 24-byte header padded to the default alignment
  const GgufFile f = open_ok(dir, "empty.gguf", image);
  EXPECT_EQ(f.path(), dir.file("empty.gguf"));
  EXPECT_EQ(f.version(), GetParam());
  EXPECT_EQ(f.file_size(), 32u);
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_EQ(f.data_offset(), 32u);
  EXPECT_TRUE(f.kvs().empty());
  EXPECT_TRUE(f.tensors().empty());
  EXPECT_EQ(f.find("general.architecture"), nullptr);
  EXPECT_EQ(f.find_tensor("x"), nullptr);
}

// ---------------------------------------------------------------------------------------------
// Key/values

TEST_P(GgufVersionTest, EveryScalarType) {
  TempDir dir;
  const GgufImage image = GgufBuilder(GetParam())
                              .kv_u8("t.u8", 200)
                              .kv_i8("t.i8", -100)
                              .kv_u16("t.u16", 60000)
                              .kv_i16("t.i16", -30000)
                              .kv_u32("t.u32", 4000000000u)
                              .kv_i32("t.i32", -2000000000)
                              .kv_f32("t.f32", 1.5f)
                              .kv_bool("t.bool", true)
                              .kv_str("t.str", "h\xc3\xa9llo")
                              .kv_u64("t.u64", 0x8000000000000005ull)
                              .kv_i64("t.i64", -(int64_t{1} << 62))
                              .kv_f64("t.f64", 3.25)
                              .kv_bool("t.false", false)
                              .kv_str("t.empty", "")
                              .build();
  const GgufFile f = open_ok(dir, "scalars.gguf", image);
  ASSERT_EQ(f.kvs().size(), 14u);
  const std::vector<std::pair<std::string, VT>> want = {
      {"t.u8", VT::UINT8},    {"t.i8", VT::INT8},      {"t.u16", VT::UINT16},
      {"t.i16", VT::INT16},   {"t.u32", VT::UINT32},   {"t.i32", VT::INT32},
      {"t.f32", VT::FLOAT32}, {"t.bool", VT::BOOL},    {"t.str", VT::STRING},
      {"t.u64", VT::UINT64},  {"t.i64", VT::INT64},    {"t.f64", VT::FLOAT64},
      {"t.false", VT::BOOL},  {"t.empty", VT::STRING},
  };
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE(want[i].first);
    EXPECT_EQ(f.kvs()[i].key, want[i].first);
    EXPECT_EQ(f.kvs()[i].value.type, want[i].second);
    EXPECT_EQ(f.kvs()[i].offset, image.at("kv[" + std::to_string(i) + "]"));
    EXPECT_EQ(f.find(want[i].first), &f.kvs()[i].value);
  }

  EXPECT_EQ(f.find("t.u8")->as_u64(), 200u);
  EXPECT_EQ(f.find("t.u8")->as_i64(), 200);
  EXPECT_EQ(f.find("t.i8")->as_i64(), -100);
  EXPECT_EQ(f.find("t.i8")->as_u64(), std::nullopt);  // negative
  EXPECT_EQ(f.find("t.u16")->as_u64(), 60000u);
  EXPECT_EQ(f.find("t.i16")->as_i64(), -30000);
  EXPECT_EQ(f.find("t.u32")->as_u64(), 4000000000u);
  EXPECT_EQ(f.find("t.i32")->as_i64(), -2000000000);
  EXPECT_EQ(f.find("t.f32")->as_f64(), 1.5);
  EXPECT_EQ(f.find("t.f32")->as_u64(), std::nullopt);
  EXPECT_EQ(f.find("t.bool")->as_bool(), true);
  EXPECT_EQ(f.find("t.false")->as_bool(), false);
  EXPECT_EQ(f.find("t.bool")->as_u64(), std::nullopt);
  ASSERT_NE(f.find("t.str")->as_string(), nullptr);
  EXPECT_EQ(*f.find("t.str")->as_string(), "h\xc3\xa9llo");
  EXPECT_EQ(*f.find("t.empty")->as_string(), "");
  EXPECT_EQ(f.find("t.str")->as_u64(), std::nullopt);
  EXPECT_EQ(f.find("t.u64")->as_u64(), 0x8000000000000005ull);
  EXPECT_EQ(f.find("t.u64")->as_i64(), std::nullopt);  // above INT64_MAX
  EXPECT_EQ(f.find("t.i64")->as_i64(), -(int64_t{1} << 62));
  EXPECT_EQ(f.find("t.f64")->as_f64(), 3.25);
  EXPECT_EQ(f.find("t.u32")->as_f64(), 4000000000.0);
  EXPECT_EQ(f.find("t.u32")->as_string(), nullptr);
  EXPECT_EQ(f.find("t.u32")->as_array(), nullptr);
  EXPECT_EQ(f.find("t.u32")->as_bool(), std::nullopt);
}

TEST_P(GgufVersionTest, ArraysOfEveryElementType) {
  TempDir dir;
  const std::string with_nul("nul\0in", 6);
  const GgufImage image =
      GgufBuilder(GetParam())
          .kv_array<uint8_t>("a.u8", VT::UINT8, {0, 255})
          .kv_array<int8_t>("a.i8", VT::INT8, {-128, 127})
          .kv_array<uint16_t>("a.u16", VT::UINT16, {0, 65535})
          .kv_array<int16_t>("a.i16", VT::INT16, {-32768, 32767})
          .kv_array<uint32_t>("a.u32", VT::UINT32, {0, 4294967295u})
          .kv_array<int32_t>("a.i32", VT::INT32, {std::numeric_limits<int32_t>::min(), 7})
          .kv_array<float>("a.f32", VT::FLOAT32, {-1.5f, 2.25f})
          .kv_array<uint8_t>("a.bool", VT::BOOL, {1, 0, 1})
          .kv_array<uint64_t>("a.u64", VT::UINT64, {5, std::numeric_limits<uint64_t>::max()})
          .kv_array<int64_t>("a.i64", VT::INT64, {std::numeric_limits<int64_t>::min(), 9})
          .kv_array<double>("a.f64", VT::FLOAT64, {1e300, -0.5})
          .kv_str_array("a.str", {"", "a", "h\xc3\xa9llo", with_nul})
          .kv_array<uint32_t>("a.empty", VT::UINT32, {})
          .kv_str_array("a.empty_str", {})
          .build();
  const GgufFile f = open_ok(dir, "arrays.gguf", image);
  ASSERT_EQ(f.kvs().size(), 14u);
  auto arr = [&](const char* key) -> const GgufArray& {
    const GgufValue* v = f.find(key);
    EXPECT_NE(v, nullptr) << key;
    EXPECT_EQ(v->type, VT::ARRAY) << key;
    EXPECT_NE(v->as_array(), nullptr) << key;
    return *v->as_array();
  };

  const struct {
    const char* key;
    VT elem;
    uint64_t count;
    size_t raw_bytes;
  } shapes[] = {
      {"a.u8", VT::UINT8, 2, 2},     {"a.i8", VT::INT8, 2, 2},
      {"a.u16", VT::UINT16, 2, 4},   {"a.i16", VT::INT16, 2, 4},
      {"a.u32", VT::UINT32, 2, 8},   {"a.i32", VT::INT32, 2, 8},
      {"a.f32", VT::FLOAT32, 2, 8},  {"a.bool", VT::BOOL, 3, 3},
      {"a.u64", VT::UINT64, 2, 16},  {"a.i64", VT::INT64, 2, 16},
      {"a.f64", VT::FLOAT64, 2, 16}, {"a.str", VT::STRING, 4, 0},
      {"a.empty", VT::UINT32, 0, 0}, {"a.empty_str", VT::STRING, 0, 0},
  };
  for (const auto& s : shapes) {
    SCOPED_TRACE(s.key);
    const GgufArray& a = arr(s.key);
    EXPECT_EQ(a.elem_type, s.elem);
    EXPECT_EQ(a.count, s.count);
    EXPECT_EQ(a.raw.size(), s.raw_bytes);
    EXPECT_EQ(a.int_at(s.count), std::nullopt);  // one past the end
  }

  EXPECT_EQ(arr("a.u8").int_at(1), 255);
  EXPECT_EQ(arr("a.i8").int_at(0), -128);
  EXPECT_EQ(arr("a.u16").int_at(1), 65535);
  EXPECT_EQ(arr("a.i16").int_at(0), -32768);
  EXPECT_EQ(arr("a.u32").int_at(1), 4294967295);
  EXPECT_EQ(arr("a.i32").int_at(0), std::numeric_limits<int32_t>::min());
  EXPECT_EQ(arr("a.i32").int_at(1), 7);
  EXPECT_EQ(arr("a.f32").float_at(0), -1.5);
  EXPECT_EQ(arr("a.f32").float_at(1), 2.25);
  EXPECT_EQ(arr("a.f32").int_at(0), std::nullopt);
  EXPECT_EQ(arr("a.bool").int_at(0), std::nullopt);  // a bool is not an integer
  EXPECT_EQ(arr("a.bool").raw, (std::vector<uint8_t>{1, 0, 1}));
  EXPECT_EQ(arr("a.u64").int_at(0), 5);
  EXPECT_EQ(arr("a.u64").int_at(1), std::nullopt);  // above INT64_MAX
  EXPECT_EQ(arr("a.u64").float_at(1), 18446744073709551615.0);
  EXPECT_EQ(arr("a.i64").int_at(0), std::numeric_limits<int64_t>::min());
  EXPECT_EQ(arr("a.f64").float_at(0), 1e300);
  EXPECT_EQ(arr("a.f64").float_at(1), -0.5);
  EXPECT_EQ(arr("a.i8").float_at(1), 127.0);

  const GgufArray& s = arr("a.str");
  EXPECT_EQ(s.string_at(0), "");
  EXPECT_EQ(s.string_at(1), "a");
  EXPECT_EQ(s.string_at(2), "h\xc3\xa9llo");
  EXPECT_EQ(s.string_at(3), with_nul);
  EXPECT_EQ(s.int_at(0), std::nullopt);
  EXPECT_EQ(s.float_at(0), std::nullopt);
  EXPECT_EQ(s.chars.size(), 0u + 1 + 6 + 6);
}

// A 2000-entry vocabulary and its scores: the array path at a realistic shape.
TEST(GgufFileTest, VocabularySizedStringArray) {
  TempDir dir;
  std::vector<std::string> tokens;
  std::vector<float> scores;
  for (int i = 0; i < 2000; ++i) {
    tokens.push_back("tok" + std::to_string(i));
    scores.push_back(-static_cast<float>(i));
  }
  const GgufImage image = GgufBuilder()
                              .kv_str("tokenizer.ggml.model", "gpt2")
                              .kv_str_array("tokenizer.ggml.tokens", tokens)
                              .kv_array<float>("tokenizer.ggml.scores", VT::FLOAT32, scores)
                              .build();
  const GgufFile f = open_ok(dir, "vocab.gguf", image);
  const GgufArray* t = f.find("tokenizer.ggml.tokens")->as_array();
  ASSERT_NE(t, nullptr);
  ASSERT_EQ(t->count, 2000u);
  EXPECT_EQ(t->string_at(0), "tok0");
  EXPECT_EQ(t->string_at(1999), "tok1999");
  EXPECT_EQ(f.find("tokenizer.ggml.scores")->as_array()->float_at(1234), -1234.0);
}

INSTANTIATE_TEST_SUITE_P(V2AndV3, GgufVersionTest, ::testing::Values(2u, 3u),
                         [](const auto& p) { return "v" + std::to_string(p.param); });

// ---------------------------------------------------------------------------------------------
// Tensors

struct WantTensor {
  const char* name;
  uint32_t n_dims;
  std::array<uint64_t, 4> ne;
  std::array<uint64_t, 4> nb;
  uint64_t bytes;
  uint64_t rel_offset;
};

void expect_tensors(const GgufFile& f, const GgufImage& image,
                    const std::vector<WantTensor>& want) {
  ASSERT_EQ(f.tensors().size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    const GgufTensorInfo& t = f.tensors()[i];
    SCOPED_TRACE(want[i].name);
    EXPECT_EQ(t.name, want[i].name);
    EXPECT_EQ(f.find_tensor(want[i].name), &t);
    EXPECT_EQ(t.n_dims, want[i].n_dims);
    EXPECT_EQ(t.ne, want[i].ne);
    EXPECT_EQ(t.nb, want[i].nb);
    EXPECT_EQ(t.bytes, want[i].bytes);
    EXPECT_EQ(t.rel_offset, want[i].rel_offset);
    EXPECT_EQ(t.offset, f.data_offset() + t.rel_offset);
    EXPECT_EQ(t.offset, image.at(std::string("data:") + want[i].name));
    EXPECT_EQ(t.info_offset, image.at("ti[" + std::to_string(i) + "]"));
    // The offset points at this tensor's bytes, first and last.
    ASSERT_LE(t.offset + t.bytes, image.bytes.size());
    EXPECT_EQ(image.bytes[t.offset], tensor_fill_byte(i, 0));
    EXPECT_EQ(image.bytes[t.offset + t.bytes - 1], tensor_fill_byte(i, t.bytes - 1));
  }
}

TEST_P(GgufVersionTest, TensorOffsetsStridesAndBytes) {
  TempDir dir;
  const GgufImage image = GgufBuilder(GetParam())
                              .kv_str("general.architecture", "llama")
                              .tensor("f32", {4, 3}, GgmlType::F32)
                              .tensor("f16", {8}, GgmlType::F16)
                              .tensor("q4_0", {64, 2}, GgmlType::Q4_0)
                              .tensor("q8_0", {32, 2, 2}, GgmlType::Q8_0)
                              .tensor("q4_k", {256, 1, 1, 2}, GgmlType::Q4_K)
                              .tensor("bf16", {3, 5}, GgmlType::BF16)
                              .build();
  const GgufFile f = open_ok(dir, "tensors.gguf", image);
  EXPECT_EQ(f.data_offset(), image.data_offset);
  EXPECT_EQ(f.data_offset() % 32, 0u);
  EXPECT_EQ(f.file_size(), image.bytes.size());
  // ggml: nb[0] = block bytes, nb[1] = row bytes, nb[i] = nb[i-1] * ne[i-1]; offsets aligned 32.
  expect_tensors(f, image,
                 {
                     {"f32", 2, {4, 3, 1, 1}, {4, 16, 48, 48}, 48, 0},
                     {"f16", 1, {8, 1, 1, 1}, {2, 16, 16, 16}, 16, 64},
                     {"q4_0", 2, {64, 2, 1, 1}, {18, 36, 72, 72}, 72, 96},
                     {"q8_0", 3, {32, 2, 2, 1}, {34, 34, 68, 136}, 136, 192},
                     {"q4_k", 4, {256, 1, 1, 2}, {144, 144, 144, 144}, 288, 352},
                     {"bf16", 2, {3, 5, 1, 1}, {2, 6, 30, 30}, 30, 640},
                 });
  EXPECT_EQ(f.tensors()[0].type, GgmlType::F32);
  EXPECT_EQ(f.tensors()[4].type, GgmlType::Q4_K);
}

TEST(GgufFileTest, CustomAlignment) {
  TempDir dir;
  const GgufImage image = GgufBuilder()
                              .alignment(64)
                              .tensor("a", {3}, GgmlType::F32)
                              .tensor("b", {32}, GgmlType::Q8_0)
                              .build();
  const GgufFile f = open_ok(dir, "align64.gguf", image);
  EXPECT_EQ(f.alignment(), 64u);
  EXPECT_EQ(f.data_offset() % 64, 0u);
  expect_tensors(f, image,
                 {
                     {"a", 1, {3, 1, 1, 1}, {4, 12, 12, 12}, 12, 0},
                     {"b", 1, {32, 1, 1, 1}, {34, 34, 34, 34}, 34, 64},
                 });
}

TEST(GgufFileTest, AlignmentOneMeansNoPadding) {
  TempDir dir;
  const GgufImage image = GgufBuilder()
                              .alignment(1)
                              .tensor("a", {3}, GgmlType::F32)
                              .tensor("b", {1}, GgmlType::I8)
                              .tensor("c", {1}, GgmlType::F64)
                              .build();
  const GgufFile f = open_ok(dir, "align1.gguf", image);
  EXPECT_EQ(f.alignment(), 1u);
  EXPECT_EQ(f.data_offset(), image.at("ti[2].offset") + 8);  // straight after the last info
  expect_tensors(f, image,
                 {
                     {"a", 1, {3, 1, 1, 1}, {4, 12, 12, 12}, 12, 0},
                     {"b", 1, {1, 1, 1, 1}, {1, 1, 1, 1}, 1, 12},
                     {"c", 1, {1, 1, 1, 1}, {8, 8, 8, 8}, 8, 13},
                 });
}

TEST(GgufFileTest, AlignmentMayBeAnyUnsignedIntegerType) {
  TempDir dir;
  const GgufImage image = GgufBuilder()
                              .kv_u64("general.alignment", 128)
                              .layout_alignment(128)
                              .tensor("a", {3}, GgmlType::F32)
                              .tensor("b", {3}, GgmlType::F32)
                              .build();
  const GgufFile f = open_ok(dir, "align128.gguf", image);
  EXPECT_EQ(f.alignment(), 128u);
  EXPECT_EQ(f.tensors()[1].rel_offset, 128u);
}

TEST(GgufFileTest, ExplicitOffsetsMayLeaveGapsAndComeInAnyOrder) {
  TempDir dir;
  const GgufImage image = GgufBuilder()
                              .tensor("late", {8}, GgmlType::F32, 128)
                              .tensor("early", {8}, GgmlType::F32, 0)
                              .build();
  const GgufFile f = open_ok(dir, "gaps.gguf", image);
  EXPECT_EQ(f.tensors()[0].offset, f.data_offset() + 128);
  EXPECT_EQ(f.tensors()[1].offset, f.data_offset());
}

TEST(GgufFileTest, EveryValidGgmlTypeParses) {
  TempDir dir;
  GgufBuilder b;
  std::vector<uint32_t> ids;
  for (uint32_t id = 0; id < ggml_type_id_limit(); ++id) {
    const auto t = ggml_type_traits(id);
    ASSERT_TRUE(t.has_value());
    if (t->removed) continue;
    ids.push_back(id);
    b.tensor_raw(std::string(t->name), {t->block_elems * 2, 3}, id);
  }
  const GgufImage image = b.build();
  const GgufFile f = open_ok(dir, "types.gguf", image);
  ASSERT_EQ(f.tensors().size(), ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto traits = *ggml_type_traits(ids[i]);
    const GgufTensorInfo& t = f.tensors()[i];
    SCOPED_TRACE(traits.name);
    EXPECT_EQ(static_cast<uint32_t>(t.type), ids[i]);
    EXPECT_EQ(t.nb[0], traits.block_bytes);
    EXPECT_EQ(t.nb[1], 2u * traits.block_bytes);
    EXPECT_EQ(t.bytes, 6u * traits.block_bytes);
  }
}

TEST(GgufFileTest, MemorySourceMatchesFile) {
  TempDir dir;
  const GgufImage image = GgufBuilder()
                              .kv_str("general.architecture", "llama")
                              .tensor("w", {32, 4}, GgmlType::Q8_0)
                              .build();
  const GgufFile from_file = open_ok(dir, "m.gguf", image);
  const auto src = memory_source("in-memory", image.span());
  auto from_memory = GgufFile::parse(*src);
  ASSERT_TRUE(from_memory) << from_memory.error().message;
  EXPECT_EQ(from_memory->path(), "in-memory");
  EXPECT_EQ(from_memory->data_offset(), from_file.data_offset());
  EXPECT_EQ(from_memory->tensors()[0].offset, from_file.tensors()[0].offset);
  EXPECT_EQ(from_memory->tensors()[0].bytes, from_file.tensors()[0].bytes);
}

// Records how far into the file the parser reads.
class MetadataOnlySource final : public ByteSource {
 public:
  explicit MetadataOnlySource(std::span<const uint8_t> bytes) : bytes_(bytes) {}
  uint64_t size() const override { return bytes_.size(); }
  const std::string& name() const override { return name_; }
  Status read_exact(uint64_t offset, std::span<uint8_t> dst) const override {
    max_read_end_ = std::max<uint64_t>(max_read_end_, offset + dst.size());
    if (offset + dst.size() > bytes_.size()) return make_error(EIO, "short read");
    std::copy_n(bytes_.data() + offset, dst.size(), dst.data());
    return Ok{};
  }
  uint64_t max_read_end() const { return max_read_end_; }

 private:
  std::string name_ = "metadata-only";
  std::span<const uint8_t> bytes_;
  mutable uint64_t max_read_end_ = 0;
};

TEST(GgufFileTest, ParseDoesNotReadFarIntoTensorData) {
  // 4 MiB of tensor data after ~100 bytes of metadata: the parser reads through a 64 KiB window,
  // so it may touch the first 64 KiB but never the bulk of the data.
  GgufBuilder b;
  b.kv_str("general.architecture", "llama").tensor("big", {1024, 1024}, GgmlType::F32);
  const GgufImage image = b.build();
  ASSERT_GT(image.bytes.size(), 4u << 20);
  MetadataOnlySource src(image.span());
  auto f = GgufFile::parse(src);
  ASSERT_TRUE(f) << f.error().message;
  EXPECT_LE(src.max_read_end(), image.data_offset + (64u << 10));
  EXPECT_EQ(f->tensors()[0].bytes, 4u << 20);
}

// ---------------------------------------------------------------------------------------------
// Models

TEST(GgufModelTest, SingleFile) {
  TempDir dir;
  const GgufImage image = GgufBuilder()
                              .kv_str("general.architecture", "llama")
                              .kv_u32("llama.context_length", 4096)
                              .tensor("token_embd.weight", {32, 10}, GgmlType::Q8_0)
                              .tensor("output.weight", {32, 10}, GgmlType::F16)
                              .build();
  image.write(dir.file("model.gguf"));
  const GgufModel m = open_model_ok(dir.file("model.gguf"));
  ASSERT_EQ(m.shards().size(), 1u);
  EXPECT_EQ(m.architecture(), "llama");
  EXPECT_EQ(m.arch_key("context_length"), "llama.context_length");
  ASSERT_NE(m.find_arch("context_length"), nullptr);
  EXPECT_EQ(m.find_arch("context_length")->as_u64(), 4096u);
  EXPECT_EQ(m.find_arch("expert_count"), nullptr);
  EXPECT_EQ(m.tensor_count(), 2u);
  const auto ref = m.find_tensor("output.weight");
  ASSERT_TRUE(ref.has_value());
  EXPECT_EQ(ref->shard, 0u);
  EXPECT_EQ(ref->info->name, "output.weight");
  EXPECT_EQ(ref->info->type, GgmlType::F16);
  EXPECT_FALSE(m.find_tensor("missing.weight").has_value());
}

GgufBuilder moe_builder(uint32_t n_expert, uint64_t ne2) {
  GgufBuilder b;
  b.kv_str("general.architecture", "qwen3moe")
      .kv_u32("qwen3moe.expert_count", n_expert)
      .kv_u32("qwen3moe.expert_used_count", 2)
      .tensor("blk.0.ffn_gate_inp.weight", {32, n_expert}, GgmlType::F32)
      .tensor("blk.0.ffn_gate_exps.weight", {32, 8, ne2}, GgmlType::Q8_0)
      .tensor("blk.0.ffn_up_exps.weight", {32, 8, ne2}, GgmlType::Q8_0)
      .tensor("blk.0.ffn_down_exps.weight", {32, 32, ne2}, GgmlType::Q8_0)
      .tensor("blk.0.ffn_gate_shexp.weight", {32, 8}, GgmlType::Q8_0);
  return b;
}

TEST(GgufModelTest, MoeExpertTensorsMatchExpertCount) {
  TempDir dir;
  moe_builder(4, 4).build().write(dir.file("moe.gguf"));
  const GgufModel m = open_model_ok(dir.file("moe.gguf"));
  EXPECT_EQ(m.architecture(), "qwen3moe");
  EXPECT_EQ(m.tensor_count(), 5u);
  EXPECT_EQ(m.find_tensor("blk.0.ffn_down_exps.weight")->info->ne[2], 4u);
}

TEST(GgufModelTest, FusedGateUpExperts) {
  TempDir dir;
  GgufBuilder()
      .kv_str("general.architecture", "glm4moe")
      .kv_u32("glm4moe.expert_count", 2)
      .tensor("blk.3.ffn_gate_up_exps.weight", {32, 16, 2}, GgmlType::Q8_0)
      .tensor("blk.3.ffn_down_exps.weight", {32, 32, 2}, GgmlType::Q8_0)
      .build()
      .write(dir.file("fused.gguf"));
  const GgufModel m = open_model_ok(dir.file("fused.gguf"));
  EXPECT_EQ(m.tensor_count(), 2u);
}

std::vector<std::string> write_split(const TempDir& dir, uint32_t n) {
  std::vector<std::string> paths;
  const auto shards = test::split_model(n);
  for (uint32_t i = 0; i < n; ++i) {
    paths.push_back(split_path(dir.file("model"), i + 1, n));
    shards[i].write(paths.back());
  }
  return paths;
}

TEST(GgufModelTest, SplitModelOpensEveryShard) {
  TempDir dir;
  const auto paths = write_split(dir, 3);
  EXPECT_EQ(paths[0], dir.file("model-00001-of-00003.gguf"));
  const GgufModel m = open_model_ok(paths[0]);
  ASSERT_EQ(m.shards().size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(m.shards()[i].path(), paths[i]);
  EXPECT_EQ(m.architecture(), "llama");
  EXPECT_EQ(&m.meta(), &m.shards()[0]);
  EXPECT_EQ(m.tensor_count(), 6u);
  const auto ref = m.find_tensor("t2.b");
  ASSERT_TRUE(ref.has_value());
  EXPECT_EQ(ref->shard, 2u);
  EXPECT_EQ(ref->info, m.shards()[2].find_tensor("t2.b"));
  EXPECT_EQ(m.find_tensor("t0.a")->shard, 0u);
}

TEST(GgufModelTest, OneShardSplitModel) {
  TempDir dir;
  const auto paths = write_split(dir, 1);
  const GgufModel m = open_model_ok(paths[0]);
  EXPECT_EQ(m.shards().size(), 1u);
  EXPECT_EQ(m.tensor_count(), 2u);
}

TEST(GgufModelTest, MovedModelKeepsItsTensorIndex) {
  TempDir dir;
  const auto paths = write_split(dir, 2);
  GgufModel a = open_model_ok(paths[0]);
  const GgufModel b = std::move(a);
  EXPECT_EQ(b.find_tensor("t1.a")->info->name, "t1.a");
}

// Open files named for messages, as the engine gets them from expertd.
std::vector<std::unique_ptr<ByteSource>> fd_sources(const std::vector<std::string>& paths,
                                                    const std::vector<uint32_t>& order) {
  std::vector<std::unique_ptr<ByteSource>> out;
  for (const uint32_t i : order) {
    UniqueFd fd(::open(paths[i].c_str(), O_RDONLY | O_CLOEXEC));
    auto src = fd_source(fmt::format("expertd:m/shard{}", i), std::move(fd));
    EXPECT_TRUE(src) << src.error().message;
    out.push_back(std::move(*src));
  }
  return out;
}

TEST(GgufModelTest, FromSourcesReadsEveryShardThroughItsFd) {
  TempDir dir;
  const auto paths = write_split(dir, 3);
  auto m = GgufModel::from_sources(fd_sources(paths, {0, 1, 2}));
  ASSERT_TRUE(m) << m.error().message;
  ASSERT_EQ(m->shards().size(), 3u);
  ASSERT_EQ(m->sources().size(), 3u);
  EXPECT_EQ(m->shards()[2].path(), "expertd:m/shard2");
  EXPECT_EQ(m->tensor_count(), 6u);
  const auto ref = m->find_tensor("t2.b");
  ASSERT_TRUE(ref.has_value());
  EXPECT_EQ(ref->shard, 2u);
  // The kept source reads the tensor's bytes, as a read by path does.
  std::vector<uint8_t> by_fd(ref->info->bytes);
  std::vector<uint8_t> by_path(ref->info->bytes);
  ASSERT_TRUE(m->sources()[2]->read_exact(ref->info->offset, by_fd));
  auto file = open_file_source(paths[2]);
  ASSERT_TRUE(file);
  ASSERT_TRUE((*file)->read_exact(ref->info->offset, by_path));
  EXPECT_EQ(by_fd, by_path);
  // A model opened by path keeps no sources.
  EXPECT_TRUE(open_model_ok(paths[0]).sources().empty());
}

TEST(GgufModelTest, FromSourcesRefusesMissingAndMisorderedShards) {
  TempDir dir;
  const auto paths = write_split(dir, 3);
  auto missing = GgufModel::from_sources(fd_sources(paths, {0, 1}));
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.error().message.find("the model has 3 shards but 2 files were given"),
            std::string::npos)
      << missing.error().message;
  auto swapped = GgufModel::from_sources(fd_sources(paths, {0, 2, 1}));
  ASSERT_FALSE(swapped);
  EXPECT_NE(swapped.error().message.find("expertd:m/shard2: split.no"), std::string::npos)
      << swapped.error().message;
  EXPECT_FALSE(GgufModel::from_sources({}));
}

TEST(GgufSplitNameTest, ParseAndFormat) {
  const auto s = parse_split_name("/m/Qwen3-235B-A22B-Q4_K_M-00002-of-00005.gguf");
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->prefix, "/m/Qwen3-235B-A22B-Q4_K_M");
  EXPECT_EQ(s->no, 2u);
  EXPECT_EQ(s->count, 5u);
  EXPECT_EQ(split_path(s->prefix, 1, 5), "/m/Qwen3-235B-A22B-Q4_K_M-00001-of-00005.gguf");
  EXPECT_FALSE(parse_split_name("model.gguf").has_value());
  EXPECT_FALSE(parse_split_name("model-0001-of-0002.gguf").has_value());
  EXPECT_FALSE(parse_split_name("model-00001-of-00002.bin").has_value());
}

// ---------------------------------------------------------------------------------------------
// The ggml type table

TEST(GgmlTypesTest, TableMatchesGgml) {
  EXPECT_EQ(ggml_type_id_limit(), 42u);
  const struct {
    uint32_t id;
    const char* name;
    uint32_t block_elems;
    uint32_t block_bytes;
  } known[] = {
      {0, "f32", 1, 4},       {1, "f16", 1, 2},       {2, "q4_0", 32, 18},
      {8, "q8_0", 32, 34},    {10, "q2_k", 256, 84},  {12, "q4_k", 256, 144},
      {14, "q6_k", 256, 210}, {15, "q8_k", 256, 292}, {23, "iq4_xs", 256, 136},
      {30, "bf16", 1, 2},     {35, "tq2_0", 256, 66}, {39, "mxfp4", 32, 17},
      {40, "nvfp4", 64, 36},  {41, "q1_0", 128, 18},
  };
  for (const auto& k : known) {
    SCOPED_TRACE(k.name);
    const auto t = ggml_type_traits(k.id);
    ASSERT_TRUE(t.has_value());
    EXPECT_EQ(t->name, k.name);
    EXPECT_EQ(t->block_elems, k.block_elems);
    EXPECT_EQ(t->block_bytes, k.block_bytes);
    EXPECT_FALSE(t->removed);
    EXPECT_EQ(ggml_type_from_name(k.name), static_cast<GgmlType>(k.id));
  }
  for (uint32_t id : {4u, 5u, 31u, 32u, 33u, 36u, 37u, 38u}) {
    ASSERT_TRUE(ggml_type_traits(id).has_value()) << id;
    EXPECT_TRUE(ggml_type_traits(id)->removed) << id;
    EXPECT_EQ(ggml_type_from_name(ggml_type_traits(id)->name), std::nullopt) << id;
  }
  EXPECT_EQ(ggml_type_traits(42), std::nullopt);
  EXPECT_EQ(ggml_type_traits(0xffffffffu), std::nullopt);
  EXPECT_EQ(ggml_type_from_name("Q4_K"), GgmlType::Q4_K);
  EXPECT_EQ(ggml_type_from_name("q9_9"), std::nullopt);
  EXPECT_EQ(ggml_type_name(GgmlType::IQ2_XXS), "iq2_xxs");
}

TEST(GgmlTypesTest, RowBytes) {
  EXPECT_EQ(ggml_row_bytes(GgmlType::Q4_0, 64), 36u);
  EXPECT_EQ(ggml_row_bytes(GgmlType::Q4_K, 512), 288u);
  EXPECT_EQ(ggml_row_bytes(GgmlType::F32, 3), 12u);
  EXPECT_EQ(ggml_row_bytes(GgmlType::Q4_0, 33), std::nullopt);         // not whole blocks
  EXPECT_EQ(ggml_row_bytes(GgmlType::F32, 1ull << 62), std::nullopt);  // 2^64 bytes
  EXPECT_EQ(ggml_row_bytes(GgmlType::F32, 0), 0u);
}

// ---------------------------------------------------------------------------------------------
// The fuzzer's seed corpus stays valid: each seed parses (so mutations start from deep paths).

TEST(GgufSeedCorpusTest, EverySeedParses) {
  const std::filesystem::path corpus = test::data_path("fuzz-corpus");
  ASSERT_TRUE(std::filesystem::is_directory(corpus)) << corpus;
  size_t seeds = 0;
  for (const auto& entry : std::filesystem::directory_iterator(corpus)) {
    SCOPED_TRACE(entry.path().string());
    ++seeds;
    EXPECT_LE(entry.file_size(), 4096u);
    auto f = GgufFile::open(entry.path().string());
    EXPECT_TRUE(f) << f.error().message;
  }
  EXPECT_GE(seeds, 5u);
}

}  // namespace
}  // namespace expertd
