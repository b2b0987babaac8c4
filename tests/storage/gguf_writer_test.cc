#include "storage/gguf_writer.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "storage/gguf.h"
#include "testing/temp_dir.h"

namespace expertd {
namespace {

namespace fs = std::filesystem;

class GgufWriterTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_FALSE(dir_.path().empty()) << "mkdtemp failed"; }
  std::string path(const std::string& name) const { return dir_.file(name); }

  test::TempDir dir_{"expertd-gguf-writer"};
};

std::vector<uint8_t> read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

std::vector<uint8_t> pattern(size_t n, uint8_t salt) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i * 131 + salt);
  return v;
}

Status write_file(GgufWriter& w, const std::string& path, const std::vector<uint8_t>& data,
                  const GgufWriterOptions& options = {}) {
  EXPERTD_TRY(w.begin(path, options));
  EXPERTD_TRY(w.write(data));
  EXPERTD_TRY(w.finish());
  return w.commit();
}

// Every GGUF value type, scalar and array, written and read back through GgufFile.
TEST_F(GgufWriterTest, WritesEveryValueTypeAndReadsItBack) {
  GgufWriter w;
  w.set_u8("u8", 200);
  w.set_i8("i8", -100);
  w.set_u16("u16", 60000);
  w.set_i16("i16", -30000);
  w.set_u32("u32", 4000000000u);
  w.set_i32("i32", -2000000000);
  w.set_f32("f32", 1.5f);
  w.set_bool("bool", true);
  w.set_string("string", "hello, gguf");
  w.set_u64("u64", 18000000000000000000ull);
  w.set_i64("i64", -9000000000000000000ll);
  w.set_f64("f64", -2.25e300);
  const std::vector<uint8_t> a_u8 = {1, 2, 255};
  const std::vector<int8_t> a_i8 = {-128, 0, 127};
  const std::vector<uint16_t> a_u16 = {0, 65535};
  const std::vector<int16_t> a_i16 = {-32768, 32767};
  const std::vector<uint32_t> a_u32 = {7, 4294967295u};
  const std::vector<int32_t> a_i32 = {-1, 2147483647};
  const std::vector<float> a_f32 = {0.5f, -0.25f};
  const bool a_bool[] = {true, false, true};
  const std::vector<std::string> a_str = {"a", "", "ĠtokenĊ"};
  const std::vector<uint64_t> a_u64 = {1ull << 63};
  const std::vector<int64_t> a_i64 = {-(1ll << 62), 5};
  const std::vector<double> a_f64 = {3.0, 1e-300};
  const std::vector<std::string_view> a_sv = {"x", "yz"};
  w.set_array("a.u8", std::span<const uint8_t>(a_u8));
  w.set_array("a.i8", std::span<const int8_t>(a_i8));
  w.set_array("a.u16", std::span<const uint16_t>(a_u16));
  w.set_array("a.i16", std::span<const int16_t>(a_i16));
  w.set_array("a.u32", std::span<const uint32_t>(a_u32));
  w.set_array("a.i32", std::span<const int32_t>(a_i32));
  w.set_array("a.f32", std::span<const float>(a_f32));
  w.set_array("a.bool", std::span<const bool>(a_bool));
  w.set_array("a.str", std::span<const std::string>(a_str));
  w.set_array("a.u64", std::span<const uint64_t>(a_u64));
  w.set_array("a.i64", std::span<const int64_t>(a_i64));
  w.set_array("a.f64", std::span<const double>(a_f64));
  w.set_array("a.sv", std::span<const std::string_view>(a_sv));
  w.set_array("a.empty", std::span<const std::string>());
  w.set_u32("u32", 42);  // replacing keeps one entry, in place
  EXPECT_EQ(w.kv_count(), 26u);

  const uint64_t ne[] = {64, 3};
  ASSERT_TRUE(w.add_tensor("t", GgmlType::F16, ne));
  const auto data = pattern(64 * 3 * 2, 1);
  auto st = write_file(w, path("all.gguf"), data);
  ASSERT_TRUE(st) << st.error().message;

  auto f = GgufFile::open(path("all.gguf"));
  ASSERT_TRUE(f) << f.error().message;
  EXPECT_EQ(f->version(), 3u);
  ASSERT_EQ(f->kvs().size(), 26u);
  EXPECT_EQ(f->kvs()[4].key, "u32");  // replaced in place
  auto type_of = [&](const char* k) { return f->find(k)->type; };
  EXPECT_EQ(type_of("u8"), GgufValueType::UINT8);
  EXPECT_EQ(f->find("u8")->as_u64(), 200u);
  EXPECT_EQ(type_of("i8"), GgufValueType::INT8);
  EXPECT_EQ(f->find("i8")->as_i64(), -100);
  EXPECT_EQ(type_of("u16"), GgufValueType::UINT16);
  EXPECT_EQ(f->find("u16")->as_u64(), 60000u);
  EXPECT_EQ(type_of("i16"), GgufValueType::INT16);
  EXPECT_EQ(f->find("i16")->as_i64(), -30000);
  EXPECT_EQ(type_of("u32"), GgufValueType::UINT32);
  EXPECT_EQ(f->find("u32")->as_u64(), 42u);
  EXPECT_EQ(type_of("i32"), GgufValueType::INT32);
  EXPECT_EQ(f->find("i32")->as_i64(), -2000000000);
  EXPECT_EQ(type_of("f32"), GgufValueType::FLOAT32);
  EXPECT_EQ(f->find("f32")->as_f64(), 1.5);
  EXPECT_EQ(type_of("bool"), GgufValueType::BOOL);
  EXPECT_EQ(f->find("bool")->as_bool(), true);
  EXPECT_EQ(type_of("string"), GgufValueType::STRING);
  EXPECT_EQ(*f->find("string")->as_string(), "hello, gguf");
  EXPECT_EQ(type_of("u64"), GgufValueType::UINT64);
  EXPECT_EQ(f->find("u64")->as_u64(), 18000000000000000000ull);
  EXPECT_EQ(type_of("i64"), GgufValueType::INT64);
  EXPECT_EQ(f->find("i64")->as_i64(), -9000000000000000000ll);
  EXPECT_EQ(type_of("f64"), GgufValueType::FLOAT64);
  EXPECT_EQ(f->find("f64")->as_f64(), -2.25e300);

  auto arr = [&](const char* k, GgufValueType elem, uint64_t count) -> const GgufArray& {
    const GgufValue* v = f->find(k);
    EXPECT_NE(v, nullptr) << k;
    EXPECT_EQ(v->type, GgufValueType::ARRAY) << k;
    const GgufArray* a = v->as_array();
    EXPECT_NE(a, nullptr) << k;
    EXPECT_EQ(a->elem_type, elem) << k;
    EXPECT_EQ(a->count, count) << k;
    return *a;
  };
  EXPECT_EQ(arr("a.u8", GgufValueType::UINT8, 3).int_at(2), 255);
  EXPECT_EQ(arr("a.i8", GgufValueType::INT8, 3).int_at(0), -128);
  EXPECT_EQ(arr("a.u16", GgufValueType::UINT16, 2).int_at(1), 65535);
  EXPECT_EQ(arr("a.i16", GgufValueType::INT16, 2).int_at(0), -32768);
  EXPECT_EQ(arr("a.u32", GgufValueType::UINT32, 2).int_at(1), 4294967295ll);
  EXPECT_EQ(arr("a.i32", GgufValueType::INT32, 2).int_at(0), -1);
  EXPECT_EQ(arr("a.f32", GgufValueType::FLOAT32, 2).float_at(1), -0.25);
  EXPECT_EQ(arr("a.bool", GgufValueType::BOOL, 3).raw, (std::vector<uint8_t>{1, 0, 1}));
  const GgufArray& s = arr("a.str", GgufValueType::STRING, 3);
  EXPECT_EQ(s.string_at(0), "a");
  EXPECT_EQ(s.string_at(1), "");
  EXPECT_EQ(s.string_at(2), "ĠtokenĊ");
  EXPECT_EQ(arr("a.u64", GgufValueType::UINT64, 1).int_at(0), std::nullopt);  // > INT64_MAX
  EXPECT_EQ(arr("a.i64", GgufValueType::INT64, 2).int_at(0), -(1ll << 62));
  EXPECT_EQ(arr("a.f64", GgufValueType::FLOAT64, 2).float_at(1), 1e-300);
  EXPECT_EQ(arr("a.sv", GgufValueType::STRING, 2).string_at(1), "yz");
  arr("a.empty", GgufValueType::STRING, 0);

  ASSERT_EQ(f->tensors().size(), 1u);
  const GgufTensorInfo& t = f->tensors()[0];
  EXPECT_EQ(t.name, "t");
  EXPECT_EQ(t.type, GgmlType::F16);
  EXPECT_EQ(t.n_dims, 2u);
  EXPECT_EQ(t.ne[0], 64u);
  EXPECT_EQ(t.ne[1], 3u);
  EXPECT_EQ(t.offset, w.tensors()[0].offset);
  const auto bytes = read_all(path("all.gguf"));
  ASSERT_EQ(bytes.size(), w.file_bytes());
  EXPECT_TRUE(std::equal(data.begin(), data.end(), bytes.begin() + t.offset));
}

// Values copied with set_value re-serialise to the same bytes.
TEST_F(GgufWriterTest, SetValueCopiesAFilesMetadata) {
  GgufWriter w;
  w.set_string("general.architecture", "qwen3moe");
  w.set_i16("i16", -5);
  w.set_f32("f32", 0.1f);
  w.set_bool("b", false);
  const std::vector<std::string> toks = {"a", "bc"};
  const std::vector<int32_t> types = {1, 3};
  w.set_array("toks", std::span<const std::string>(toks));
  w.set_array("types", std::span<const int32_t>(types));
  const auto meta = w.serialize_metadata();
  ASSERT_EQ(meta.size(), w.data_offset());
  auto src = memory_source("meta", meta);
  auto f = GgufFile::parse(*src);
  ASSERT_TRUE(f) << f.error().message;

  GgufWriter copy;
  for (const GgufKv& kv : f->kvs()) ASSERT_TRUE(copy.set_value(kv.key, kv.value)) << kv.key;
  EXPECT_EQ(copy.serialize_metadata(), meta);

  GgufValue bad;
  bad.type = GgufValueType::UINT8;
  bad.v = uint64_t{300};
  auto st = copy.set_value("too.big", bad);
  ASSERT_FALSE(st);
  EXPECT_NE(st.error().message.find("too.big"), std::string::npos);
}

// Tensors are placed at aligned offsets and padded with zeros; a span may cross tensors and the
// stage size; direct and buffered writing give the same file.
TEST_F(GgufWriterTest, PlacesAndPadsTensorsAtTheAlignment) {
  for (const uint64_t alignment : {uint64_t{32}, uint64_t{1}, uint64_t{4096}}) {
    for (const bool direct : {true, false}) {
      SCOPED_TRACE(::testing::Message() << "alignment " << alignment << " direct " << direct);
      GgufWriter w(alignment);
      w.set_string("k", "v");
      const uint64_t a[] = {34 * 32};  // q8_0: 1088 elements, 1156 bytes
      const uint64_t b[] = {3};        // f32: 12 bytes
      const uint64_t c[] = {256, 7, 2};
      ASSERT_TRUE(w.add_tensor("a", GgmlType::Q8_0, a));
      ASSERT_TRUE(w.add_tensor("b", GgmlType::F32, b));
      ASSERT_TRUE(w.add_tensor("c", GgmlType::Q4_K, c));
      uint64_t total = 0;
      for (const auto& t : w.tensors()) {
        EXPECT_EQ(t.rel_offset % alignment, 0u) << t.name;
        total += t.bytes;
      }
      const auto data = pattern(total, static_cast<uint8_t>(alignment));
      GgufWriterOptions o;
      o.direct_io = direct;
      o.buffer_bytes = 4096;  // small stage: many flushes
      const std::string p = path("aligned.gguf");
      ASSERT_TRUE(w.begin(p, o));
      // Odd-sized pieces that cross tensor and stage boundaries.
      for (uint64_t off = 0; off < total;) {
        const uint64_t n = std::min<uint64_t>(997, total - off);
        ASSERT_TRUE(w.write(std::span<const uint8_t>(data.data() + off, n)));
        off += n;
      }
      auto st = w.finish();
      ASSERT_TRUE(st) << st.error().message;
      ASSERT_TRUE(w.commit());

      auto f = GgufFile::open(p);
      ASSERT_TRUE(f) << f.error().message;
      EXPECT_EQ(f->alignment(), alignment);
      const GgufValue* ak = f->find("general.alignment");
      if (alignment == 32) {
        EXPECT_EQ(ak, nullptr);
      } else {
        ASSERT_NE(ak, nullptr);
        EXPECT_EQ(ak->type, GgufValueType::UINT32);
        EXPECT_EQ(ak->as_u64(), alignment);
      }
      const auto bytes = read_all(p);
      ASSERT_EQ(bytes.size(), w.file_bytes());
      EXPECT_EQ(f->data_offset() % alignment, 0u);
      uint64_t src = 0;
      for (const auto& t : f->tensors()) {
        EXPECT_EQ(t.offset % alignment, 0u);
        EXPECT_TRUE(
            std::equal(data.begin() + src, data.begin() + src + t.bytes, bytes.begin() + t.offset))
            << t.name;
        const uint64_t end = t.offset + t.bytes;
        const uint64_t padded = (end + alignment - 1) / alignment * alignment;
        for (uint64_t i = end; i < padded; ++i) ASSERT_EQ(bytes[i], 0) << t.name << " pad " << i;
        src += t.bytes;
      }
      EXPECT_EQ(bytes.size() % alignment, 0u);
      fs::remove(p);
    }
  }
}

TEST_F(GgufWriterTest, RejectsBadTensors) {
  GgufWriter w;
  const uint64_t ok[] = {32};
  ASSERT_TRUE(w.add_tensor("t", GgmlType::Q8_0, ok));
  auto expect_error = [&](std::string_view name, GgmlType type, std::span<const uint64_t> ne,
                          std::string_view what) {
    auto st = w.add_tensor(name, type, ne);
    ASSERT_FALSE(st) << name;
    EXPECT_NE(st.error().message.find(what), std::string::npos) << st.error().message;
    EXPECT_NE(st.error().message.find(name), std::string::npos) << st.error().message;
  };
  const uint64_t odd[] = {33};
  const uint64_t zero[] = {32, 0};
  const uint64_t five[] = {1, 1, 1, 1, 1};
  const uint64_t huge[] = {1ull << 40, 1ull << 40};
  expect_error("t", GgmlType::F32, ok, "duplicate");
  expect_error("odd", GgmlType::Q8_0, odd, "not a multiple of the q8_0 block size 32");
  expect_error("zero", GgmlType::F32, zero, "ne[1] is 0");
  expect_error("five", GgmlType::F32, five, "5 dimensions");
  expect_error("huge", GgmlType::F32, huge, "overflows");
  EXPECT_EQ(w.tensors().size(), 1u);
}

TEST_F(GgufWriterTest, RefusesToReplaceAFileUnlessAskedTo) {
  const std::string p = path("exists.gguf");
  { std::ofstream(p) << "precious"; }
  GgufWriter w;
  const uint64_t ne[] = {4};
  ASSERT_TRUE(w.add_tensor("t", GgmlType::F32, ne));
  auto st = w.begin(p);
  ASSERT_FALSE(st);
  EXPECT_EQ(st.error().code, EEXIST);
  EXPECT_NE(st.error().message.find(p), std::string::npos);
  EXPECT_EQ(read_all(p).size(), 8u);
  EXPECT_FALSE(fs::exists(p + ".tmp"));

  GgufWriter w2;
  ASSERT_TRUE(w2.add_tensor("t", GgmlType::F32, ne));
  GgufWriterOptions o;
  o.overwrite = true;
  ASSERT_TRUE(write_file(w2, p, pattern(16, 0), o));
  EXPECT_EQ(read_all(p).size(), w2.file_bytes());
}

TEST_F(GgufWriterTest, AnUnfinishedFileLeavesNothingBehind) {
  const std::string p = path("partial.gguf");
  {
    GgufWriter w;
    const uint64_t ne[] = {1024};
    ASSERT_TRUE(w.add_tensor("t", GgmlType::F32, ne));
    ASSERT_TRUE(w.begin(p));
    ASSERT_TRUE(w.write(pattern(100, 0)));
    EXPECT_TRUE(fs::exists(p + ".tmp"));
  }
  EXPECT_FALSE(fs::exists(p));
  EXPECT_FALSE(fs::exists(p + ".tmp"));

  // Too little data: finish() names the tensor, too much: write() says so; both clean up.
  GgufWriter w;
  const uint64_t ne[] = {8};
  ASSERT_TRUE(w.add_tensor("first", GgmlType::F32, ne));
  ASSERT_TRUE(w.add_tensor("second", GgmlType::F32, ne));
  ASSERT_TRUE(w.begin(p));
  ASSERT_TRUE(w.write(pattern(40, 0)));
  auto st = w.finish();
  ASSERT_FALSE(st);
  EXPECT_NE(st.error().message.find("tensor 'second' received 8 of its 32 bytes"),
            std::string::npos)
      << st.error().message;
  EXPECT_FALSE(fs::exists(p + ".tmp"));

  GgufWriter w2;
  ASSERT_TRUE(w2.add_tensor("only", GgmlType::F32, ne));
  ASSERT_TRUE(w2.begin(p));
  st = w2.write(pattern(33, 0));
  ASSERT_FALSE(st);
  EXPECT_NE(st.error().message.find("past the last tensor"), std::string::npos);
  EXPECT_FALSE(fs::exists(p + ".tmp"));
  EXPECT_FALSE(fs::exists(p));
}

TEST_F(GgufWriterTest, ACreateFailureNamesThePath) {
  GgufWriter w;
  const std::string p = path("no/such/dir/x.gguf");
  auto st = w.begin(p);
  ASSERT_FALSE(st);
  EXPECT_EQ(st.error().code, ENOENT);
  EXPECT_NE(st.error().message.find(p + ".tmp"), std::string::npos) << st.error().message;
}

}  // namespace
}  // namespace expertd
