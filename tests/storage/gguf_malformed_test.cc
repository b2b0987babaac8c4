// Hostile GGUF files: each is rejected with exactly one line,
// "{path}: {field} at byte {offset}: {what}", naming the file, the field and where it starts, and
// the parser never allocates more than a small file could justify. Every file is a valid one from
// GgufBuilder with one field patched, so each test breaks exactly one rule.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <regex>
#include <string>
#include <vector>

#include "storage/ggml_types.h"
#include "storage/gguf.h"
#include "testing/alloc_probe.h"
#include "tests/storage/gguf_bytes.h"

namespace expertd {
namespace {

using test::AllocProbe;
using test::GgufBuilder;
using test::GgufImage;
using test::TempDir;
using ::testing::HasSubstr;
using ::testing::StartsWith;
using VT = GgufValueType;

constexpr size_t kMaxParseAlloc = 1 << 20;  // the files here are a few KiB

// A small valid file most tests break one field of: kv[0] general.architecture, kv[1]
// llama.block_count; ti[0] "blk.0.attn_q.weight" q8_0 [32, 4], ti[1] "output.weight" f32 [8, 2].
GgufBuilder base() {
  GgufBuilder b;
  b.kv_str("general.architecture", "llama")
      .kv_u32("llama.block_count", 1)
      .tensor("blk.0.attn_q.weight", {32, 4}, GgmlType::Q8_0)
      .tensor("output.weight", {8, 2}, GgmlType::F32);
  return b;
}

class GgufMalformedTest : public ::testing::Test {
 protected:
  std::string path(const std::string& suffix = "") const {
    return dir_.file(std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) +
                     suffix + ".gguf");
  }

  // Opens `image` from a file and from memory. Both must fail with EINVAL and one line that
  // starts "{name}: {field} at byte {at}: " and contains `what`, having allocated little.
  void expect_error(const GgufImage& image, const std::string& field, uint64_t at,
                    const std::string& what, const GgufLimits& limits = {}) {
    const std::string p = path();
    image.write(p);
    AllocProbe probe;
    auto f = GgufFile::open(p, limits);
    const size_t largest = probe.largest();
    ASSERT_FALSE(f) << "a malformed file parsed: " << p;
    const std::string& msg = f.error().message;
    EXPECT_EQ(f.error().code, EINVAL) << msg;
    EXPECT_THAT(msg, StartsWith(fmt::format("{}: {} at byte {}: ", p, field, at)));
    EXPECT_THAT(msg, HasSubstr(what));
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    EXPECT_LT(largest, kMaxParseAlloc) << msg;

    const auto src = memory_source("memory.gguf", image.span());
    auto m = GgufFile::parse(*src, limits);
    ASSERT_FALSE(m);
    EXPECT_EQ(m.error().message, "memory.gguf" + msg.substr(p.size()));
  }

  // Opens a model at `open_path`; the error must start "{error_path}: {field} at byte {at}: ".
  void expect_model_error(const std::string& open_path, const std::string& error_path,
                          const std::string& field, uint64_t at, const std::string& what) {
    auto m = GgufModel::open(open_path);
    ASSERT_FALSE(m) << "a malformed model opened: " << open_path;
    const std::string& msg = m.error().message;
    EXPECT_THAT(msg, StartsWith(fmt::format("{}: {} at byte {}: ", error_path, field, at)));
    EXPECT_THAT(msg, HasSubstr(what));
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }

  // As expect_model_error, for errors with no field or offset to name: "{error_path}: {what}".
  void expect_model_error_text(const std::string& open_path, const std::string& error_path,
                               const std::string& what) {
    auto m = GgufModel::open(open_path);
    ASSERT_FALSE(m) << "a malformed model opened: " << open_path;
    EXPECT_THAT(m.error().message, StartsWith(error_path + ": "));
    EXPECT_THAT(m.error().message, HasSubstr(what));
  }

  // Writes the shards of a split model under dir_ as model-0000i-of-0000n.gguf.
  std::vector<std::string> write_split(const std::vector<GgufImage>& shards) const {
    std::vector<std::string> paths;
    for (size_t i = 0; i < shards.size(); ++i) {
      paths.push_back(split_path(dir_.file("model"), static_cast<uint32_t>(i + 1),
                                 static_cast<uint32_t>(shards.size())));
      shards[i].write(paths.back());
    }
    return paths;
  }

  TempDir dir_;
};

// ---------------------------------------------------------------------------------------------
// Header

TEST_F(GgufMalformedTest, EmptyFile) {
  expect_error(GgufImage{}, "magic", 0, "file truncated: needs 4 bytes, 0 remain");
}

TEST_F(GgufMalformedTest, BadMagic) {
  GgufImage image = base().build();
  image.put<uint32_t>("magic", 0x746a6767);  // "ggjt", the pre-GGUF llama.cpp format
  expect_error(image, "magic", 0, "not a GGUF file (magic is 0x746a6767");
}

TEST_F(GgufMalformedTest, BigEndianFile) {
  GgufImage image = base().build();
  image.put<uint32_t>("version", 0x03000000);  // 3, byte-swapped
  expect_error(image, "version", 4, "big-endian GGUF files are not supported");
}

TEST_F(GgufMalformedTest, Version1) {
  GgufImage image = base().build();
  image.put<uint32_t>("version", 1);
  expect_error(image, "version", 4, "GGUF version 1 is not supported");
}

TEST_F(GgufMalformedTest, UnknownVersion) {
  for (uint32_t v : {0u, 4u, 0xffffffffu}) {
    SCOPED_TRACE(v);
    GgufImage image = base().build();
    image.put<uint32_t>("version", v);
    expect_error(image, "version", 4, fmt::format("unsupported GGUF version {}", v));
  }
}

TEST_F(GgufMalformedTest, AbsurdTensorCount) {
  GgufImage image = base().build();
  image.put<uint64_t>("n_tensors", uint64_t{1} << 60);
  expect_error(image, "n_tensors", 8, "tensor count 1152921504606846976 exceeds the limit");
}

TEST_F(GgufMalformedTest, AbsurdKvCount) {
  GgufImage image = base().build();
  image.put<uint64_t>("n_kv", ~uint64_t{0});
  expect_error(image, "n_kv", 16, "key/value count 18446744073709551615 exceeds the limit");
}

TEST_F(GgufMalformedTest, CountsTheFileCannotHold) {
  // Within the limits, but a million tensor infos need at least 32 MB.
  GgufImage image = base().build();
  image.put<uint64_t>("n_tensors", 1000000);
  expect_error(image, "n_kv", 16, "2 key/values and 1000000 tensor infos cannot fit");
}

TEST_F(GgufMalformedTest, CountsThatWrapWithRaisedLimits) {
  // 2^59 tensor infos x 32 bytes wraps to 0 in 64 bits: with the count limit lifted the size
  // check must still see that they cannot fit (and not reserve 2^59 entries).
  GgufLimits limits;
  limits.max_tensor_count = ~uint64_t{0};
  limits.max_kv_count = ~uint64_t{0};
  GgufImage image = base().build();
  image.put<uint64_t>("n_tensors", uint64_t{1} << 59);
  image.put<uint64_t>("n_kv", 0);
  expect_error(image, "n_kv", 16, "0 key/values and 576460752303423488 tensor infos cannot fit",
               limits);
}

TEST_F(GgufMalformedTest, HeaderTruncated) {
  const GgufImage full = base().build();
  GgufImage image = full;
  expect_error(image.truncate(20), "n_kv", 16, "file truncated: needs 8 bytes, 4 remain");
}

// ---------------------------------------------------------------------------------------------
// Key/values

TEST_F(GgufMalformedTest, UnknownValueType) {
  for (uint32_t type : {13u, 0xffffffffu}) {
    SCOPED_TRACE(type);
    const GgufImage image =
        GgufBuilder()
            .kv_u32("a", 1)
            .kv_raw("mystery", type, [](test::ByteWriter& w, const std::string&) { w.u32(0); })
            .build();
    expect_error(image, "kv[1] 'mystery' type", image.at("kv[1].type"),
                 fmt::format("unknown value type {}", type));
  }
}

TEST_F(GgufMalformedTest, NestedArray) {
  const GgufImage image = GgufBuilder()
                              .kv_raw("nested", 9,
                                      [](test::ByteWriter& w, const std::string& f) {
                                        w.mark(f + ".value").u32(9).u64(1);  // array of arrays
                                        w.u32(4).u64(1).u32(7);
                                      })
                              .build();
  expect_error(image, "kv[0] 'nested'", image.at("kv[0].value"), "nested arrays are not supported");
}

TEST_F(GgufMalformedTest, UnknownArrayElementType) {
  const GgufImage image = GgufBuilder()
                              .kv_raw("arr", 9,
                                      [](test::ByteWriter& w, const std::string& f) {
                                        w.mark(f + ".value").u32(13).u64(1).u32(0);
                                      })
                              .build();
  expect_error(image, "kv[0] 'arr'", image.at("kv[0].value"), "unknown array element type 13");
}

TEST_F(GgufMalformedTest, DuplicateKey) {
  const GgufImage image = GgufBuilder()
                              .kv_u32("llama.block_count", 1)
                              .kv_str("general.name", "x")
                              .kv_u32("llama.block_count", 2)
                              .build();
  expect_error(image, "kv[2] 'llama.block_count'", image.at("kv[2]"), "duplicate key");
}

TEST_F(GgufMalformedTest, EmptyKey) {
  const GgufImage image = GgufBuilder().kv_u32("", 1).build();
  expect_error(image, "kv[0].key", 24, "empty key");
}

TEST_F(GgufMalformedTest, KeyLengthPastEndOfFile) {
  GgufImage image = base().build();
  image.put<uint64_t>("kv[1]", 100000);
  expect_error(image, "kv[1].key", image.at("kv[1]"),
               "string length 100000 runs past the end of the file");
}

TEST_F(GgufMalformedTest, StringValueLengthPastEndOfFile) {
  GgufImage image = base().build();
  image.put<uint64_t>("value:general.architecture", 100000);
  expect_error(image, "kv[0] 'general.architecture'", image.at("value:general.architecture"),
               "string length 100000 runs past the end of the file");
}

TEST_F(GgufMalformedTest, StringOverTheLimitIsRefusedBeforeAllocating) {
  // A claimed 16 MiB + 1 string: over the default limit, refused without reserving it.
  GgufImage image = base().build();
  image.put<uint64_t>("value:general.architecture", (uint64_t{16} << 20) + 1);
  expect_error(image, "kv[0] 'general.architecture'", image.at("value:general.architecture"),
               "string length 16777217 exceeds the limit of 16777216 bytes");
}

TEST_F(GgufMalformedTest, ClaimedHugeStringWithLimitLiftedStillAllocatesNothing) {
  GgufLimits limits;
  limits.max_string_bytes = ~uint64_t{0};
  limits.max_metadata_bytes = ~uint64_t{0};
  GgufImage image = base().build();
  image.put<uint64_t>("value:general.architecture", uint64_t{1} << 62);
  expect_error(image, "kv[0] 'general.architecture'", image.at("value:general.architecture"),
               "string length 4611686018427387904 runs past the end of the file", limits);
}

TEST_F(GgufMalformedTest, ArrayCountAbsurd) {
  GgufImage image = GgufBuilder().kv_array<uint32_t>("arr", VT::UINT32, {1, 2, 3}).build();
  image.put<uint64_t>("kv[0].count", uint64_t{1} << 60);
  expect_error(image, "kv[0] 'arr'", image.at("kv[0].count"),
               "array count 1152921504606846976 exceeds the limit of 16777216 elements");
}

TEST_F(GgufMalformedTest, ArrayCountPastEndOfFile) {
  GgufImage image = GgufBuilder().kv_array<uint32_t>("arr", VT::UINT32, {1, 2, 3}).build();
  image.put<uint64_t>("kv[0].count", 1000000);
  expect_error(image, "kv[0] 'arr'", image.at("kv[0].count"),
               "array of 1000000 uint32 values (4 bytes each) runs past the end of the file");
}

TEST_F(GgufMalformedTest, StringArrayCountAbsurd) {
  GgufImage image = GgufBuilder().kv_str_array("tokenizer.ggml.tokens", {"a", "b"}).build();
  image.put<uint64_t>("kv[0].count", uint64_t{1} << 60);
  expect_error(image, "kv[0] 'tokenizer.ggml.tokens'", image.at("kv[0].count"),
               "array count 1152921504606846976 exceeds the limit");
}

TEST_F(GgufMalformedTest, StringArrayCountPastEndOfFile) {
  GgufImage image = GgufBuilder().kv_str_array("tokenizer.ggml.tokens", {"a", "b"}).build();
  image.put<uint64_t>("kv[0].count", 10000000);
  expect_error(image, "kv[0] 'tokenizer.ggml.tokens'", image.at("kv[0].count"),
               "array of 10000000 strings cannot fit");
}

TEST_F(GgufMalformedTest, StringInArrayPastEndOfFile) {
  GgufImage image = GgufBuilder().kv_str_array("tokenizer.ggml.tokens", {"abc", "de", "f"}).build();
  const uint64_t second = image.at("kv[0].count") + 8 + 8 + 3;  // after "abc"
  image.put<uint64_t>(second, 5000);
  expect_error(image, "kv[0] 'tokenizer.ggml.tokens'", second,
               "string length 5000 runs past the end of the file");
}

TEST_F(GgufMalformedTest, AlignmentOfTheWrongType) {
  struct Case {
    GgufBuilder builder;
    const char* found;
  };
  std::vector<Case> cases;
  cases.push_back({GgufBuilder().kv_str("general.alignment", "32"), "string"});
  cases.push_back({GgufBuilder().kv_f32("general.alignment", 32.0f), "float32"});
  cases.push_back({GgufBuilder().kv_bool("general.alignment", true), "bool"});
  cases.push_back({GgufBuilder().kv_i32("general.alignment", -32), "int32"});
  cases.push_back(
      {GgufBuilder().kv_array<uint32_t>("general.alignment", VT::UINT32, {32}), "array"});
  for (auto& c : cases) {
    SCOPED_TRACE(c.found);
    const GgufImage image = c.builder.kv_u32("x", 0).build();
    expect_error(image, "general.alignment", image.at("kv[0]"),
                 fmt::format("must be an unsigned integer, found {}", c.found));
  }
}

TEST_F(GgufMalformedTest, AlignmentZeroOrNotAPowerOfTwo) {
  for (uint32_t a : {0u, 3u, 48u, 0xffffffffu}) {
    SCOPED_TRACE(a);
    const GgufImage image = GgufBuilder().kv_u32("x", 1).kv_u32("general.alignment", a).build();
    expect_error(image, "general.alignment", image.at("kv[1]"),
                 fmt::format("alignment {} is not a power of two", a));
  }
}

TEST_F(GgufMalformedTest, AlignmentOverOneGiB) {
  const GgufImage image = GgufBuilder().kv_u64("general.alignment", uint64_t{1} << 31).build();
  expect_error(image, "general.alignment", image.at("kv[0]"), "alignment 2147483648 exceeds 1 GiB");
}

// ---------------------------------------------------------------------------------------------
// Tensor infos

TEST_F(GgufMalformedTest, TooManyDimensions) {
  GgufImage image = base().build();
  image.put<uint32_t>("ti[1].n_dims", 5);
  expect_error(image, "tensor_info[1] 'output.weight'.n_dims", image.at("ti[1].n_dims"),
               "n_dims 5 is outside 1..4");
}

TEST_F(GgufMalformedTest, ZeroDimensions) {
  GgufImage image = base().build();
  image.put<uint32_t>("ti[0].n_dims", 0);
  expect_error(image, "tensor_info[0] 'blk.0.attn_q.weight'.n_dims", image.at("ti[0].n_dims"),
               "n_dims 0 is outside 1..4");
}

TEST_F(GgufMalformedTest, DimensionOfZero) {
  GgufImage image = base().build();
  image.put<uint64_t>("ti[1].ne[1]", 0);
  expect_error(image, "tensor_info[1] 'output.weight'.ne[1]", image.at("ti[1].ne[1]"),
               "dimension is 0: a tensor must hold data");
}

TEST_F(GgufMalformedTest, ElementCountOverflows) {
  struct Case {
    std::vector<uint64_t> ne;
    int bad_dim;
  };
  const Case cases[] = {
      {{uint64_t{1} << 40, uint64_t{1} << 30}, 1},  // 2^70
      {{uint64_t{1} << 63, 1}, 0},                  // one dimension past INT64_MAX
      {{uint64_t{1} << 32, uint64_t{1} << 31}, 1},  // 2^63: past INT64_MAX
      {{1 << 16, 1 << 16, 1 << 16, 1 << 16}, 3},    // 2^64
  };
  for (const auto& c : cases) {
    const GgufImage image = GgufBuilder().tensor("huge", c.ne, GgmlType::F32).build();
    const std::string ne = fmt::format("ne[{}]", c.bad_dim);
    SCOPED_TRACE(ne);
    expect_error(image, "tensor_info[0] 'huge'." + ne, image.at("ti[0]." + ne),
                 "element count overflows");
  }
}

TEST_F(GgufMalformedTest, ByteSizeOverflows) {
  // 2^62 f64 elements fit in int64, their 2^65 bytes do not fit in 64 bits.
  const GgufImage image =
      GgufBuilder().tensor("w", {uint64_t{1} << 31, uint64_t{1} << 31}, GgmlType::F64).build();
  expect_error(image, "tensor_info[0] 'w'", image.at("ti[0]"),
               "tensor byte size overflows 64 bits");
}

TEST_F(GgufMalformedTest, RowNotAMultipleOfTheBlockSize) {
  GgufImage image = base().build();
  image.put<uint64_t>("ti[0].ne[0]", 33);
  expect_error(image, "tensor_info[0] 'blk.0.attn_q.weight'.ne[0]", image.at("ti[0].ne[0]"),
               "ne0 33 is not a multiple of the q8_0 block size 32");
}

TEST_F(GgufMalformedTest, UnknownGgmlType) {
  for (uint32_t type : {42u, 99u, 0xffffffffu}) {
    SCOPED_TRACE(type);
    GgufImage image = base().build();
    image.put<uint32_t>("ti[1].type", type);
    expect_error(image, "tensor_info[1] 'output.weight'.type", image.at("ti[1].type"),
                 fmt::format("unknown ggml type {}", type));
  }
}

TEST_F(GgufMalformedTest, RemovedGgmlType) {
  const std::pair<uint32_t, const char*> removed[] = {
      {4, "q4_2"},      {5, "q4_3"},        {31, "q4_0_4_4"},   {32, "q4_0_4_8"},
      {33, "q4_0_8_8"}, {36, "iq4_nl_4_4"}, {37, "iq4_nl_4_8"}, {38, "iq4_nl_8_8"},
  };
  for (const auto& [id, name] : removed) {
    SCOPED_TRACE(name);
    GgufImage image = base().build();
    image.put<uint32_t>("ti[0].type", id);
    expect_error(image, "tensor_info[0] 'blk.0.attn_q.weight'.type", image.at("ti[0].type"),
                 fmt::format("ggml type {} ({}) was removed from ggml", id, name));
  }
}

TEST_F(GgufMalformedTest, UnalignedOffset) {
  GgufImage image = base().build();
  image.put<uint64_t>("ti[1].offset", image.at("data:output.weight") - image.data_offset + 4);
  expect_error(image, "tensor_info[1] 'output.weight'.offset", image.at("ti[1].offset"),
               "is not a multiple of the alignment 32");
}

TEST_F(GgufMalformedTest, OffsetUnalignedForCustomAlignment) {
  const GgufImage image = GgufBuilder()
                              .alignment(256)
                              .tensor("a", {8}, GgmlType::F32)
                              .tensor("b", {8}, GgmlType::F32, 128)
                              .build();
  expect_error(image, "tensor_info[1] 'b'.offset", image.at("ti[1].offset"),
               "offset 128 is not a multiple of the alignment 256");
}

TEST_F(GgufMalformedTest, TensorPastEndOfFile) {
  GgufImage image = base().trailing_padding(false).build();
  image.truncate(image.bytes.size() - 1);  // output.weight [160, +64) loses its last byte
  ASSERT_EQ(image.at("data:output.weight") - image.data_offset, 160u);
  expect_error(image, "tensor 'output.weight'.offset", image.at("ti[1].offset"),
               "data [160, +64) runs past the end of the file");
}

TEST_F(GgufMalformedTest, TensorOffsetFarPastEndOfFile) {
  GgufImage image = base().build();
  image.put<uint64_t>("ti[0].offset", uint64_t{1} << 62);
  expect_error(image, "tensor 'blk.0.attn_q.weight'.offset", image.at("ti[0].offset"),
               "data [4611686018427387904, +136) runs past the end of the file");
}

TEST_F(GgufMalformedTest, OverlappingTensors) {
  // a holds [0, 48); b claims [32, 64).
  const GgufImage image =
      GgufBuilder().tensor("a", {12}, GgmlType::F32).tensor("b", {8}, GgmlType::F32, 32).build();
  expect_error(image, "tensor 'b'.offset", image.at("ti[1].offset"),
               "data [32, +32) overlaps tensor 'a' at [0, +48)");
}

TEST_F(GgufMalformedTest, DuplicateTensorName) {
  const GgufImage image = GgufBuilder()
                              .tensor("w", {8}, GgmlType::F32)
                              .tensor("v", {8}, GgmlType::F32)
                              .tensor("w", {8}, GgmlType::F32)
                              .build();
  expect_error(image, "tensor_info[2] 'w'.name", image.at("ti[2]"), "duplicate tensor name");
}

TEST_F(GgufMalformedTest, EmptyTensorName) {
  const GgufImage image = GgufBuilder().tensor("", {8}, GgmlType::F32).build();
  expect_error(image, "tensor_info[0].name", image.at("ti[0]"), "empty tensor name");
}

TEST_F(GgufMalformedTest, DataSectionTruncated) {
  // The file ends right after the tensor infos, before the padding to the data section.
  GgufImage image = base().build();
  const uint64_t infos_end = image.at("ti[1].offset") + 8;
  ASSERT_NE(infos_end % 32, 0u);
  image.truncate(infos_end);
  expect_error(
      image, "data section", infos_end,
      fmt::format("file truncated: the data section would start at byte {}", image.data_offset));
}

TEST_F(GgufMalformedTest, NamesFromTheFileCannotBreakTheMessage) {
  // A hostile name with a newline, a quote and an escape sequence stays on one escaped line.
  const std::string name = "evil\nline' \x1b[31m";
  const GgufImage image = GgufBuilder().kv_u32(name, 1).kv_u32(name, 2).build();
  expect_error(image, "kv[1] 'evil\\x0aline\\x27 \\x1b[31m'", image.at("kv[1]"), "duplicate key");
}

TEST_F(GgufMalformedTest, LongNamesAreCutInTheMessage) {
  const std::string name(100000, 'k');
  const GgufImage image = GgufBuilder().tensor(name, {8}, GgmlType::F32).build();
  GgufImage bad = image;
  bad.put<uint32_t>("ti[0].type", 99);
  expect_error(bad, fmt::format("tensor_info[0] '{}...(100000 bytes)'.type", std::string(80, 'k')),
               bad.at("ti[0].type"), "unknown ggml type 99");
}

// ---------------------------------------------------------------------------------------------
// Truncation anywhere

// Every strict prefix of a valid file (every value type, arrays, strings, tensors, data ending at
// the last byte) is an error naming an offset inside the prefix, from memory and from a file.
TEST_F(GgufMalformedTest, EveryPrefixOfAValidFileIsAnError) {
  const GgufImage image = GgufBuilder()
                              .kv_str("general.architecture", "llama")
                              .kv_u8("u8", 1)
                              .kv_i8("i8", -1)
                              .kv_u16("u16", 2)
                              .kv_i16("i16", -2)
                              .kv_u32("u32", 3)
                              .kv_i32("i32", -3)
                              .kv_f32("f32", 0.5f)
                              .kv_bool("bool", true)
                              .kv_u64("u64", 4)
                              .kv_i64("i64", -4)
                              .kv_f64("f64", 0.25)
                              .kv_array<uint16_t>("arr.u16", VT::UINT16, {1, 2, 3})
                              .kv_str_array("arr.str", {"ab", "", "cde"})
                              .alignment(64)
                              .tensor("a", {32, 2}, GgmlType::Q8_0)
                              .tensor("b", {3}, GgmlType::F32)
                              .trailing_padding(false)
                              .build();
  {
    const auto src = memory_source("full.gguf", image.span());
    auto full = GgufFile::parse(*src);
    ASSERT_TRUE(full) << full.error().message;
    ASSERT_EQ(full->tensors().back().offset + full->tensors().back().bytes, image.bytes.size());
  }
  const std::regex shape(R"(^([^:]+): (.+) at byte ([0-9]+): (.*)$)");
  const std::regex kind("truncated|past the end|cannot fit");
  const std::string p = path();
  size_t files = 0;
  for (size_t len = 0; len < image.bytes.size(); ++len) {
    SCOPED_TRACE(len);
    const std::span<const uint8_t> prefix = image.span().first(len);
    const auto src = memory_source("prefix.gguf", prefix);
    AllocProbe probe;
    auto r = GgufFile::parse(*src);
    ASSERT_FALSE(r) << "a " << len << "-byte prefix parsed";
    EXPECT_LT(probe.largest(), kMaxParseAlloc);
    std::smatch m;
    const std::string& msg = r.error().message;
    ASSERT_TRUE(std::regex_match(msg, m, shape)) << msg;
    EXPECT_EQ(m[1].str(), "prefix.gguf");
    EXPECT_LE(std::stoull(m[3].str()), len) << msg;
    EXPECT_TRUE(std::regex_search(m[4].str(), kind)) << msg;

    GgufImage cut = image;
    cut.truncate(len).write(p);
    auto f = GgufFile::open(p);
    ASSERT_FALSE(f);
    EXPECT_EQ(f.error().message, p + msg.substr(std::string("prefix.gguf").size()));
    ++files;
  }
  EXPECT_EQ(files, image.bytes.size());
}

// ---------------------------------------------------------------------------------------------
// Limits

TEST_F(GgufMalformedTest, MetadataByteLimit) {
  // Keys and values are charged as they are read: k0 (2) + 400 + k1 (2) + 400 + k2 (2) + 400
  // passes 1000 at the third value.
  GgufLimits limits;
  limits.max_metadata_bytes = 1000;
  const std::string v(400, 'v');
  const GgufImage image = GgufBuilder().kv_str("k0", v).kv_str("k1", v).kv_str("k2", v).build();
  expect_error(image, "kv[2] 'k2'", image.at("value:k2"),
               "metadata exceeds the limit of 1000 bytes", limits);
}

TEST_F(GgufMalformedTest, ArrayElementLimit) {
  GgufLimits limits;
  limits.max_array_elems = 10;
  const GgufImage image =
      GgufBuilder().kv_array<uint8_t>("a", VT::UINT8, std::vector<uint8_t>(11, 0)).build();
  expect_error(image, "kv[0] 'a'", image.at("kv[0].count"),
               "array count 11 exceeds the limit of 10 elements", limits);
}

TEST_F(GgufMalformedTest, StringLimit) {
  GgufLimits limits;
  limits.max_string_bytes = 12;  // "general.name" just fits
  const GgufImage image = GgufBuilder().kv_str("general.name", "1234567890123").build();
  expect_error(image, "kv[0] 'general.name'", image.at("value:general.name"),
               "string length 13 exceeds the limit of 12 bytes", limits);
}

TEST_F(GgufMalformedTest, KvAndTensorCountLimits) {
  GgufLimits limits;
  limits.max_kv_count = 1;
  expect_error(base().build(), "n_kv", 16, "key/value count 2 exceeds the limit of 1", limits);
  limits = GgufLimits{};
  limits.max_tensor_count = 1;
  expect_error(base().build(), "n_tensors", 8, "tensor count 2 exceeds the limit of 1", limits);
}

// ---------------------------------------------------------------------------------------------
// Split models

TEST_F(GgufMalformedTest, MissingShard) {
  const auto paths = write_split(test::split_model(3));
  ASSERT_EQ(::unlink(paths[2].c_str()), 0);
  expect_model_error_text(paths[0], paths[2], "cannot open: No such file or directory");
}

TEST_F(GgufMalformedTest, NonFirstShardGiven) {
  const auto paths = write_split(test::split_model(3));
  expect_model_error_text(paths[1], paths[1],
                          fmt::format("this is shard 2 of 3; open the first shard {}", paths[0]));
}

TEST_F(GgufMalformedTest, TwoShardsWithTheSameSplitNo) {
  auto shards = test::split_model(3);
  shards[2].put<uint16_t>("value:split.no", 1);  // shard 3 says it is shard 2
  const auto paths = write_split(shards);
  expect_model_error(paths[0], paths[2], "split.no", shards[2].at("key:split.no"),
                     "is 1 but the file name makes this shard 2 (0-based): shards are duplicated");
}

TEST_F(GgufMalformedTest, SameFileTwiceAsShards) {
  const auto paths = write_split(test::split_model(2));
  ASSERT_EQ(::unlink(paths[1].c_str()), 0);
  ASSERT_EQ(::symlink(paths[0].c_str(), paths[1].c_str()), 0);
  expect_model_error_text(paths[0], paths[1], "duplicate shard: the same file as an earlier shard");
}

TEST_F(GgufMalformedTest, ShardSplitCountDisagrees) {
  auto shards = test::split_model(3);
  shards[1].put<uint16_t>("value:split.count", 4);
  const auto paths = write_split(shards);
  expect_model_error(paths[0], paths[1], "split.count", shards[1].at("key:split.count"),
                     "is 4 but the model has 3 shards");
}

TEST_F(GgufMalformedTest, FirstShardSplitCountDisagreesWithFileName) {
  auto shards = test::split_model(3);
  shards[0].put<uint16_t>("value:split.count", 2);
  const auto paths = write_split(shards);
  expect_model_error(paths[0], paths[0], "split.count", shards[0].at("key:split.count"),
                     "split.count is 2 but the file name says 3 shards");
}

TEST_F(GgufMalformedTest, SplitTensorsCountDisagrees) {
  auto shards = test::split_model(3);
  shards[0].put<int32_t>("value:split.tensors.count", 5);
  const auto paths = write_split(shards);
  expect_model_error(paths[0], paths[0], "split.tensors.count",
                     shards[0].at("key:split.tensors.count"),
                     "is 5 but the 3 shards hold 6 tensors");
}

TEST_F(GgufMalformedTest, SplitKeyMissingInAShard) {
  auto shards = test::split_model(2);
  shards[1] = GgufBuilder()
                  .kv_u16("split.count", 2)
                  .tensor("t1.a", {8}, GgmlType::F32)
                  .tensor("t1.b", {32}, GgmlType::Q8_0)
                  .build();
  const auto paths = write_split(shards);
  expect_model_error(paths[0], paths[1], "split.no", 0, "missing in a split model's shard");
}

TEST_F(GgufMalformedTest, SplitKeyOfTheWrongType) {
  auto shards = test::split_model(2);
  shards[1] = GgufBuilder()
                  .kv_str("split.no", "1")
                  .kv_u16("split.count", 2)
                  .tensor("t1.a", {8}, GgmlType::F32)
                  .tensor("t1.b", {32}, GgmlType::Q8_0)
                  .build();
  const auto paths = write_split(shards);
  expect_model_error(paths[0], paths[1], "split.no", shards[1].at("key:split.no"),
                     "must be a non-negative integer, found string");
}

TEST_F(GgufMalformedTest, DuplicateTensorAcrossShards) {
  auto shards = test::split_model(2);
  shards[1] = GgufBuilder()
                  .kv_u16("split.no", 1)
                  .kv_u16("split.count", 2)
                  .tensor("t1.a", {8}, GgmlType::F32)
                  .tensor("t0.a", {8}, GgmlType::F32)  // also in shard 1
                  .build();
  const auto paths = write_split(shards);
  expect_model_error(paths[0], paths[1], "tensor_info 't0.a'.name", shards[1].at("ti[1]"),
                     fmt::format("duplicate tensor name: also in {}", paths[0]));
}

TEST_F(GgufMalformedTest, MalformedLaterShardNamesThatShard) {
  auto shards = test::split_model(3);
  shards[2].put<uint32_t>("ti[1].type", 4);
  const auto paths = write_split(shards);
  expect_model_error(paths[0], paths[2], "tensor_info[1] 't2.b'.type", shards[2].at("ti[1].type"),
                     "ggml type 4 (q4_2) was removed");
}

TEST_F(GgufMalformedTest, SplitCountWithoutASplitFileName) {
  GgufImage image = test::split_model(2)[0];
  const std::string p = dir_.file("model.gguf");
  image.write(p);
  expect_model_error(p, p, "split.count", image.at("key:split.count"),
                     "the file declares 2 shards but its name does not follow "
                     "NAME-00001-of-00002.gguf");
}

TEST_F(GgufMalformedTest, SplitFileNameWithoutSplitCount) {
  const std::string p = split_path(dir_.file("model"), 1, 2);
  base().build().write(p);
  expect_model_error(p, p, "split.count", 0,
                     "the file name says 2 shards but the split.count key is missing");
}

// ---------------------------------------------------------------------------------------------
// MoE expert tensors

GgufBuilder moe(uint64_t expert_count, uint64_t up_experts) {
  GgufBuilder b;
  b.kv_str("general.architecture", "qwen3moe")
      .kv_u32("qwen3moe.expert_count", static_cast<uint32_t>(expert_count))
      .tensor("blk.0.ffn_gate_exps.weight", {32, 8, expert_count}, GgmlType::Q8_0)
      .tensor("blk.0.ffn_up_exps.weight", {32, 8, up_experts}, GgmlType::Q8_0)
      .tensor("blk.0.ffn_down_exps.weight", {32, 32, expert_count}, GgmlType::Q8_0);
  return b;
}

TEST_F(GgufMalformedTest, ExpertDimensionDisagreesWithExpertCount) {
  const GgufImage image = moe(4, 3).build();
  const std::string p = path();
  image.write(p);
  expect_model_error(p, p, "tensor_info 'blk.0.ffn_up_exps.weight'.ne[2]", image.at("ti[1].ne[2]"),
                     "expert dimension 3 disagrees with qwen3moe.expert_count = 4");
}

TEST_F(GgufMalformedTest, ExpertTensorNotThreeDimensional) {
  const GgufImage image = GgufBuilder()
                              .kv_str("general.architecture", "qwen3moe")
                              .kv_u32("qwen3moe.expert_count", 4)
                              .tensor("blk.2.ffn_down_exps.weight", {32, 128}, GgmlType::Q8_0)
                              .build();
  const std::string p = path();
  image.write(p);
  expect_model_error(p, p, "tensor_info 'blk.2.ffn_down_exps.weight'.n_dims",
                     image.at("ti[0].n_dims"), "an expert tensor must have 3 dimensions, found 2");
}

TEST_F(GgufMalformedTest, ExpertCountMissing) {
  const GgufImage image = GgufBuilder()
                              .kv_str("general.architecture", "qwen3moe")
                              .tensor("blk.0.ffn_gate_exps.weight", {32, 8, 4}, GgmlType::Q8_0)
                              .build();
  const std::string p = path();
  image.write(p);
  expect_model_error(p, p, "qwen3moe.expert_count", 0,
                     "missing or not an integer, but tensor 'blk.0.ffn_gate_exps.weight' holds "
                     "experts");
}

TEST_F(GgufMalformedTest, ExpertTensorsWithoutArchitecture) {
  const GgufImage image =
      GgufBuilder().tensor("blk.0.ffn_gate_exps.weight", {32, 8, 4}, GgmlType::Q8_0).build();
  const std::string p = path();
  image.write(p);
  expect_model_error(p, p, "general.architecture", 0, "missing or not an integer");
}

TEST_F(GgufMalformedTest, ExpertDimensionDisagreesInALaterShard) {
  auto shards = test::split_model(2);
  shards[0] = GgufBuilder()
                  .kv_str("general.architecture", "qwen3moe")
                  .kv_u32("qwen3moe.expert_count", 8)
                  .kv_u16("split.no", 0)
                  .kv_u16("split.count", 2)
                  .kv_i32("split.tensors.count", 2)
                  .tensor("blk.0.ffn_gate_exps.weight", {32, 8, 8}, GgmlType::Q8_0)
                  .build();
  shards[1] = GgufBuilder()
                  .kv_u16("split.no", 1)
                  .kv_u16("split.count", 2)
                  .tensor("blk.1.ffn_gate_exps.weight", {32, 8, 7}, GgmlType::Q8_0)
                  .build();
  const auto paths = write_split(shards);
  expect_model_error(paths[0], paths[1], "tensor_info 'blk.1.ffn_gate_exps.weight'.ne[2]",
                     shards[1].at("ti[0].ne[2]"),
                     "expert dimension 7 disagrees with qwen3moe.expert_count = 8");
}

}  // namespace
}  // namespace expertd
