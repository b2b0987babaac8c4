// libFuzzer target for the GGUF metadata parser (memory only: no files). A crash, a sanitizer
// report, an abort, or a malloc over -malloc_limit_mb is a bug; so is a broken invariant below,
// which traps. See docs/FUZZING.md.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "storage/ggml_types.h"
#include "storage/gguf.h"

namespace {

using expertd::GgufArray;
using expertd::GgufFile;
using expertd::GgufLimits;
using expertd::GgufValueType;

#define FUZZ_CHECK(cond)           \
  do {                             \
    if (!(cond)) __builtin_trap(); \
  } while (0)

constexpr std::string_view kName = "fuzz.gguf";

// An error is one line "fuzz.gguf: {field} at byte {N}: {what}" with N inside the input. Names
// from the file appear only between single quotes, which gguf.cc escapes inside names, so the
// text outside quotes is the parser's own.
void check_error(const expertd::Error& e, size_t size) {
  FUZZ_CHECK(e.message.rfind(std::string(kName) + ": ", 0) == 0);
  FUZZ_CHECK(e.message.find('\n') == std::string::npos);
  std::string m;
  bool quoted = false;
  for (char c : e.message) {
    if (c == '\'') quoted = !quoted;
    if (!quoted && c != '\'') m += c;
  }
  FUZZ_CHECK(!quoted);
  const size_t at = m.find(" at byte ");
  FUZZ_CHECK(at != std::string::npos);
  const size_t digits = at + 9;
  size_t end = digits;
  uint64_t offset = 0;
  while (end < m.size() && m[end] >= '0' && m[end] <= '9') {
    offset = offset * 10 + static_cast<uint64_t>(m[end] - '0');
    ++end;
  }
  FUZZ_CHECK(end > digits && end < m.size() && m[end] == ':');
  FUZZ_CHECK(offset <= size);
}

void exercise_array(const GgufArray& a) {
  const uint32_t w = expertd::gguf_scalar_bytes(a.elem_type);
  if (a.elem_type == GgufValueType::STRING) {
    FUZZ_CHECK(a.string_ends.size() == a.count);
    FUZZ_CHECK(a.count == 0 || a.string_ends.back() == a.chars.size());
    uint64_t total = 0;
    for (uint64_t i = 0; i < a.count; ++i) {
      FUZZ_CHECK(a.string_ends[i] >= (i == 0 ? 0 : a.string_ends[i - 1]));
      total += a.string_at(i).size();
    }
    FUZZ_CHECK(total == a.chars.size());
    FUZZ_CHECK(!a.int_at(0).has_value());
    return;
  }
  FUZZ_CHECK(a.elem_type != GgufValueType::ARRAY && w != 0);
  FUZZ_CHECK(a.raw.size() == a.count * w);
  for (uint64_t i = 0; i < a.count && i < 64; ++i) {
    (void)a.int_at(i);
    (void)a.float_at(i);
  }
  FUZZ_CHECK(!a.int_at(a.count).has_value());
  FUZZ_CHECK(!a.float_at(a.count).has_value());
}

void check_file(const GgufFile& f, size_t size) {
  FUZZ_CHECK(f.version() == 2 || f.version() == 3);
  FUZZ_CHECK(f.file_size() == size);
  const uint64_t a = f.alignment();
  FUZZ_CHECK(a != 0 && (a & (a - 1)) == 0);
  FUZZ_CHECK(f.data_offset() % a == 0);
  for (const auto& kv : f.kvs()) {
    FUZZ_CHECK(!kv.key.empty() && kv.offset < size);
    FUZZ_CHECK(f.find(kv.key) == &kv.value);
    const auto& v = kv.value;
    (void)v.as_u64();
    (void)v.as_i64();
    (void)v.as_f64();
    (void)v.as_bool();
    (void)v.as_string();
    if (const GgufArray* arr = v.as_array()) exercise_array(*arr);
    FUZZ_CHECK((v.type == GgufValueType::ARRAY) == (v.as_array() != nullptr));
    FUZZ_CHECK((v.type == GgufValueType::STRING) == (v.as_string() != nullptr));
  }
  for (const auto& t : f.tensors()) {
    FUZZ_CHECK(f.find_tensor(t.name) == &t);
    FUZZ_CHECK(t.n_dims >= 1 && t.n_dims <= expertd::kGgufMaxDims);
    FUZZ_CHECK(t.rel_offset % a == 0);
    FUZZ_CHECK(t.offset == f.data_offset() + t.rel_offset);
    FUZZ_CHECK(t.bytes > 0 && t.offset <= size && t.bytes <= size - t.offset);
    const auto traits = expertd::ggml_type_traits(static_cast<uint32_t>(t.type));
    FUZZ_CHECK(traits && !traits->removed);
    FUZZ_CHECK(expertd::ggml_row_bytes(t.type, t.ne[0]) == t.nb[1]);
    FUZZ_CHECK(t.nb[0] == traits->block_bytes);
    for (uint32_t d = t.n_dims; d < expertd::kGgufMaxDims; ++d) FUZZ_CHECK(t.ne[d] == 1);
    FUZZ_CHECK(t.bytes == t.nb[3] * t.ne[3]);
  }
}

void parse_and_check(std::span<const uint8_t> bytes, const GgufLimits& limits) {
  const auto src = expertd::memory_source(std::string(kName), bytes);
  auto r = GgufFile::parse(*src, limits);
  if (r) {
    check_file(*r, bytes.size());
  } else {
    check_error(r.error(), bytes.size());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> bytes(data, size);
  parse_and_check(bytes, GgufLimits{});
  // Tight limits reach the limit checks with inputs a fuzzer can make.
  GgufLimits tight;
  tight.max_string_bytes = 64;
  tight.max_array_elems = 64;
  tight.max_kv_count = 16;
  tight.max_tensor_count = 16;
  tight.max_metadata_bytes = 4096;
  parse_and_check(bytes, tight);
  // The split-name parser sees file names, which a user controls too. (Only names that end in
  // ".gguf" can match; skipping the rest keeps std::regex off the hot path.)
  const std::string_view name(reinterpret_cast<const char*>(data), size);
  if (size <= 256 && name.ends_with(".gguf")) {
    if (const auto s = expertd::parse_split_name(std::string(name))) {
      FUZZ_CHECK(expertd::parse_split_name(expertd::split_path(s->prefix, s->no, s->count)));
    }
  }
  return 0;
}
