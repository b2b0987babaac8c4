#include "storage/gguf.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <numeric>
#include <regex>
#include <set>

#include "base/check.h"
#include "base/fd.h"

namespace expertd {

// ---------------------------------------------------------------------------------------------
// Byte sources

namespace {

class FileSource final : public ByteSource {
 public:
  FileSource(std::string name, UniqueFd fd, uint64_t size)
      : name_(std::move(name)), fd_(std::move(fd)), size_(size) {}

  uint64_t size() const override { return size_; }
  const std::string& name() const override { return name_; }

  Status read_exact(uint64_t offset, std::span<uint8_t> dst) const override {
    size_t done = 0;
    while (done < dst.size()) {
      const ssize_t n = ::pread(fd_.get(), dst.data() + done, dst.size() - done,
                                static_cast<off_t>(offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        const int e = errno;
        return make_error(e, fmt::format("{}: read of {} bytes at byte {} failed: {}", name_,
                                         dst.size(), offset, std::strerror(e)));
      }
      if (n == 0) {
        return make_error(
            EIO, fmt::format("{}: unexpected end of file at byte {}", name_, offset + done));
      }
      done += static_cast<size_t>(n);
    }
    return Ok{};
  }

 private:
  std::string name_;
  UniqueFd fd_;
  uint64_t size_;
};

class MemorySource final : public ByteSource {
 public:
  MemorySource(std::string name, std::span<const uint8_t> bytes)
      : name_(std::move(name)), bytes_(bytes) {}
  uint64_t size() const override { return bytes_.size(); }
  const std::string& name() const override { return name_; }
  Status read_exact(uint64_t offset, std::span<uint8_t> dst) const override {
    if (offset > bytes_.size() || dst.size() > bytes_.size() - offset) {
      return make_error(EIO, fmt::format("{}: unexpected end of file at byte {}", name_, offset));
    }
    std::memcpy(dst.data(), bytes_.data() + offset, dst.size());
    return Ok{};
  }

 private:
  std::string name_;
  std::span<const uint8_t> bytes_;
};

}  // namespace

Result<std::unique_ptr<ByteSource>> open_file_source(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) {
    const int e = errno;
    return make_error(e, fmt::format("{}: cannot open: {}", path, std::strerror(e)));
  }
  return fd_source(path, std::move(fd));
}

Result<std::unique_ptr<ByteSource>> fd_source(std::string name, UniqueFd fd) {
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) {
    const int e = errno;
    return make_error(e, fmt::format("{}: cannot stat: {}", name, std::strerror(e)));
  }
  if (!S_ISREG(st.st_mode) && !S_ISBLK(st.st_mode)) {
    return make_error(EINVAL, fmt::format("{}: not a regular file", name));
  }
  return std::unique_ptr<ByteSource>(std::make_unique<FileSource>(
      std::move(name), std::move(fd), static_cast<uint64_t>(st.st_size)));
}

std::unique_ptr<ByteSource> memory_source(std::string name, std::span<const uint8_t> bytes) {
  return std::make_unique<MemorySource>(std::move(name), bytes);
}

// ---------------------------------------------------------------------------------------------
// Values

std::string_view gguf_value_type_name(GgufValueType type) {
  switch (type) {
    case GgufValueType::UINT8:
      return "uint8";
    case GgufValueType::INT8:
      return "int8";
    case GgufValueType::UINT16:
      return "uint16";
    case GgufValueType::INT16:
      return "int16";
    case GgufValueType::UINT32:
      return "uint32";
    case GgufValueType::INT32:
      return "int32";
    case GgufValueType::FLOAT32:
      return "float32";
    case GgufValueType::BOOL:
      return "bool";
    case GgufValueType::STRING:
      return "string";
    case GgufValueType::ARRAY:
      return "array";
    case GgufValueType::UINT64:
      return "uint64";
    case GgufValueType::INT64:
      return "int64";
    case GgufValueType::FLOAT64:
      return "float64";
  }
  return "invalid";
}

uint32_t gguf_scalar_bytes(GgufValueType type) {
  switch (type) {
    case GgufValueType::UINT8:
    case GgufValueType::INT8:
    case GgufValueType::BOOL:
      return 1;
    case GgufValueType::UINT16:
    case GgufValueType::INT16:
      return 2;
    case GgufValueType::UINT32:
    case GgufValueType::INT32:
    case GgufValueType::FLOAT32:
      return 4;
    case GgufValueType::UINT64:
    case GgufValueType::INT64:
    case GgufValueType::FLOAT64:
      return 8;
    case GgufValueType::STRING:
    case GgufValueType::ARRAY:
      return 0;
  }
  return 0;
}

namespace {

bool is_valid_value_type(uint32_t t) { return t <= static_cast<uint32_t>(GgufValueType::FLOAT64); }

template <typename T>
T load_le(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));  // GGUF is little-endian, as is every host we build for
  return v;
}
static_assert(std::endian::native == std::endian::little, "expertd assumes a little-endian host");

// Names read from the file go into one-line error messages: control bytes, quotes and backslashes
// are escaped and long names cut, so a hostile name can neither forge a line nor flood the log.
std::string printable(std::string_view s) {
  constexpr size_t kMaxChars = 80;
  std::string out;
  for (size_t i = 0; i < s.size() && i < kMaxChars; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c == 0x7f || c == '\'' || c == '\\') {
      out += fmt::format("\\x{:02x}", c);
    } else {
      out += static_cast<char>(c);
    }
  }
  if (s.size() > kMaxChars) out += fmt::format("...({} bytes)", s.size());
  return out;
}

// A tensor-info record is name (u64 length + bytes), n_dims (u32), ne[n_dims] (u64 each),
// type (u32), offset (u64): errors found after parsing point at the field they name.
uint64_t n_dims_at(const GgufTensorInfo& t) { return t.info_offset + 8 + t.name.size(); }
uint64_t ne_at(const GgufTensorInfo& t, uint32_t d) { return n_dims_at(t) + 4 + 8 * uint64_t{d}; }
uint64_t rel_offset_at(const GgufTensorInfo& t) { return ne_at(t, t.n_dims) + 4; }

// Decodes one packed scalar of `type` at p into the variant alternative GgufValue uses.
GgufValue decode_scalar(GgufValueType type, const uint8_t* p) {
  GgufValue v;
  v.type = type;
  switch (type) {
    case GgufValueType::UINT8:
      v.v = uint64_t{load_le<uint8_t>(p)};
      break;
    case GgufValueType::INT8:
      v.v = int64_t{load_le<int8_t>(p)};
      break;
    case GgufValueType::UINT16:
      v.v = uint64_t{load_le<uint16_t>(p)};
      break;
    case GgufValueType::INT16:
      v.v = int64_t{load_le<int16_t>(p)};
      break;
    case GgufValueType::UINT32:
      v.v = uint64_t{load_le<uint32_t>(p)};
      break;
    case GgufValueType::INT32:
      v.v = int64_t{load_le<int32_t>(p)};
      break;
    case GgufValueType::UINT64:
      v.v = load_le<uint64_t>(p);
      break;
    case GgufValueType::INT64:
      v.v = load_le<int64_t>(p);
      break;
    case GgufValueType::FLOAT32:
      v.v = double{load_le<float>(p)};
      break;
    case GgufValueType::FLOAT64:
      v.v = load_le<double>(p);
      break;
    case GgufValueType::BOOL:
      v.v = load_le<uint8_t>(p) != 0;
      break;
    case GgufValueType::STRING:
    case GgufValueType::ARRAY:
      EXPERTD_UNREACHABLE("not a scalar");
      break;
  }
  return v;
}

}  // namespace

std::string_view GgufArray::string_at(uint64_t i) const {
  EXPERTD_CHECK_EQ(elem_type, GgufValueType::STRING);
  EXPERTD_CHECK_LT(i, count);
  const uint64_t begin = i == 0 ? 0 : string_ends[i - 1];
  return std::string_view(chars).substr(begin, string_ends[i] - begin);
}

std::optional<int64_t> GgufArray::int_at(uint64_t i) const {
  const uint32_t w = gguf_scalar_bytes(elem_type);
  if (i >= count || w == 0) return std::nullopt;
  return decode_scalar(elem_type, raw.data() + i * w).as_i64();
}

std::optional<double> GgufArray::float_at(uint64_t i) const {
  const uint32_t w = gguf_scalar_bytes(elem_type);
  if (i >= count || w == 0) return std::nullopt;
  return decode_scalar(elem_type, raw.data() + i * w).as_f64();
}

std::optional<uint64_t> GgufValue::as_u64() const {
  if (const auto* u = std::get_if<uint64_t>(&v)) return *u;
  if (const auto* s = std::get_if<int64_t>(&v); s && *s >= 0) return static_cast<uint64_t>(*s);
  return std::nullopt;
}

std::optional<int64_t> GgufValue::as_i64() const {
  if (const auto* s = std::get_if<int64_t>(&v)) return *s;
  if (const auto* u = std::get_if<uint64_t>(&v); u && *u <= INT64_MAX) {
    return static_cast<int64_t>(*u);
  }
  return std::nullopt;
}

std::optional<double> GgufValue::as_f64() const {
  if (const auto* d = std::get_if<double>(&v)) return *d;
  if (const auto* u = std::get_if<uint64_t>(&v)) return static_cast<double>(*u);
  if (const auto* s = std::get_if<int64_t>(&v)) return static_cast<double>(*s);
  return std::nullopt;
}

std::optional<bool> GgufValue::as_bool() const {
  if (const auto* b = std::get_if<bool>(&v)) return *b;
  return std::nullopt;
}

const std::string* GgufValue::as_string() const { return std::get_if<std::string>(&v); }
const GgufArray* GgufValue::as_array() const { return std::get_if<GgufArray>(&v); }

// ---------------------------------------------------------------------------------------------
// Parser

// Reads the metadata of one file through a 64 KiB window; tracks the position and the field
// being read so every error can say where it happened.
class GgufParser {
 public:
  GgufParser(const ByteSource& src, const GgufLimits& limits) : src_(src), limits_(limits) {}

  Result<GgufFile> run();

 private:
  static constexpr size_t kWindowBytes = 64 * 1024;

  Error fail(std::string_view field, uint64_t at, std::string_view what) const {
    return make_error(EINVAL, fmt::format("{}: {} at byte {}: {}", src_.name(), field, at, what));
  }
  uint64_t remaining() const { return src_.size() - pos_; }

  // Copies `n` bytes at the current position, through the window.
  Status read(std::string_view field, void* dst, uint64_t n);
  template <typename T>
  Result<T> scalar(std::string_view field) {
    T v{};
    EXPERTD_TRY(read(field, &v, sizeof(T)));
    return v;
  }
  Status charge(std::string_view field, uint64_t at, uint64_t bytes);
  Result<std::string> string(std::string_view field);
  Result<GgufValue> value(std::string_view field, GgufValueType type, bool in_array);
  Result<GgufArray> array(std::string_view field);
  Status header();
  Status kv(uint64_t index);
  Status tensor_info(uint64_t index);
  Status resolve_alignment();
  Status place_tensors();

  const ByteSource& src_;
  const GgufLimits& limits_;
  GgufFile file_;
  uint64_t pos_ = 0;
  uint64_t n_tensors_ = 0;
  uint64_t n_kv_ = 0;
  uint64_t metadata_bytes_ = 0;
  std::vector<uint8_t> window_;
  uint64_t window_start_ = 0;
};

Status GgufParser::read(std::string_view field, void* dst, uint64_t n) {
  if (n > remaining()) {
    return fail(field, pos_,
                fmt::format("file truncated: needs {} bytes, {} remain (file is {} bytes)", n,
                            remaining(), src_.size()));
  }
  auto* out = static_cast<uint8_t*>(dst);
  while (n > 0) {
    const bool in_window = pos_ >= window_start_ && pos_ < window_start_ + window_.size();
    if (!in_window) {
      const uint64_t len = std::min<uint64_t>(kWindowBytes, src_.size() - pos_);
      window_.resize(len);
      window_start_ = pos_;
      if (auto st = src_.read_exact(pos_, window_); !st) {
        window_.clear();
        return st.take_error();
      }
    }
    const uint64_t avail = window_start_ + window_.size() - pos_;
    const uint64_t take = std::min(avail, n);
    std::memcpy(out, window_.data() + (pos_ - window_start_), take);
    out += take;
    pos_ += take;
    n -= take;
  }
  return Ok{};
}

Status GgufParser::charge(std::string_view field, uint64_t at, uint64_t bytes) {
  if (__builtin_add_overflow(metadata_bytes_, bytes, &metadata_bytes_) ||
      metadata_bytes_ > limits_.max_metadata_bytes) {
    return fail(field, at,
                fmt::format("metadata exceeds the limit of {} bytes", limits_.max_metadata_bytes));
  }
  return Ok{};
}

Result<std::string> GgufParser::string(std::string_view field) {
  const uint64_t at = pos_;
  uint64_t len = 0;
  EXPERTD_TRY_ASSIGN(len, scalar<uint64_t>(field));
  if (len > limits_.max_string_bytes) {
    return fail(field, at,
                fmt::format("string length {} exceeds the limit of {} bytes", len,
                            limits_.max_string_bytes));
  }
  if (len > remaining()) {
    return fail(field, at,
                fmt::format("string length {} runs past the end of the file ({} bytes remain)", len,
                            remaining()));
  }
  EXPERTD_TRY(charge(field, at, len));
  std::string s(len, '\0');
  EXPERTD_TRY(read(field, s.data(), len));
  return s;
}

Result<GgufArray> GgufParser::array(std::string_view field) {
  const uint64_t at = pos_;
  uint32_t elem_raw = 0;
  EXPERTD_TRY_ASSIGN(elem_raw, scalar<uint32_t>(field));
  if (!is_valid_value_type(elem_raw)) {
    return fail(field, at, fmt::format("unknown array element type {}", elem_raw));
  }
  const auto elem = static_cast<GgufValueType>(elem_raw);
  if (elem == GgufValueType::ARRAY) {
    return fail(field, at, "nested arrays are not supported");
  }
  const uint64_t count_at = pos_;
  uint64_t count = 0;
  EXPERTD_TRY_ASSIGN(count, scalar<uint64_t>(field));
  if (count > limits_.max_array_elems) {
    return fail(field, count_at,
                fmt::format("array count {} exceeds the limit of {} elements", count,
                            limits_.max_array_elems));
  }
  GgufArray arr;
  arr.elem_type = elem;
  arr.count = count;
  if (elem == GgufValueType::STRING) {
    // Every string needs at least its 8-byte length: reject counts the file cannot hold before
    // reserving anything.
    if (count > remaining() / 8) {
      return fail(field, count_at,
                  fmt::format("array of {} strings cannot fit in the {} bytes that remain", count,
                              remaining()));
    }
    EXPERTD_TRY(charge(field, count_at, count * 8));
    arr.string_ends.reserve(count);
    for (uint64_t i = 0; i < count; ++i) {
      std::string s;
      EXPERTD_TRY_ASSIGN(s, string(field));
      arr.chars += s;
      arr.string_ends.push_back(arr.chars.size());
    }
    return arr;
  }
  const uint64_t w = gguf_scalar_bytes(elem);
  if (count > remaining() / w) {
    return fail(field, count_at,
                fmt::format("array of {} {} values ({} bytes each) runs past the end of the file "
                            "({} bytes remain)",
                            count, gguf_value_type_name(elem), w, remaining()));
  }
  EXPERTD_TRY(charge(field, count_at, count * w));
  arr.raw.resize(count * w);
  EXPERTD_TRY(read(field, arr.raw.data(), count * w));
  return arr;
}

Result<GgufValue> GgufParser::value(std::string_view field, GgufValueType type, bool in_array) {
  (void)in_array;
  GgufValue v;
  v.type = type;
  if (type == GgufValueType::STRING) {
    EXPERTD_TRY_ASSIGN(v.v, string(field));
    return v;
  }
  if (type == GgufValueType::ARRAY) {
    EXPERTD_TRY_ASSIGN(v.v, array(field));
    return v;
  }
  uint8_t buf[8] = {};
  EXPERTD_TRY(read(field, buf, gguf_scalar_bytes(type)));
  return decode_scalar(type, buf);
}

Status GgufParser::header() {
  uint32_t magic = 0;
  EXPERTD_TRY_ASSIGN(magic, scalar<uint32_t>("magic"));
  if (magic != 0x46554747u) {  // "GGUF" read little-endian
    return fail("magic", 0,
                fmt::format("not a GGUF file (magic is 0x{:08x}, expected \"GGUF\")", magic));
  }
  uint32_t version = 0;
  EXPERTD_TRY_ASSIGN(version, scalar<uint32_t>("version"));
  if ((version & 0xffffu) == 0 && (version >> 16) != 0) {
    return fail("version", 4,
                fmt::format("version field 0x{:08x} looks byte-swapped: big-endian GGUF files are "
                            "not supported",
                            version));
  }
  if (version == 1) {
    return fail("version", 4, "GGUF version 1 is not supported (versions 2 and 3 are)");
  }
  if (version != 2 && version != 3) {
    return fail(
        "version", 4,
        fmt::format("unsupported GGUF version {} (versions 2 and 3 are supported)", version));
  }
  file_.version_ = version;
  EXPERTD_TRY_ASSIGN(n_tensors_, scalar<uint64_t>("n_tensors"));
  if (n_tensors_ > limits_.max_tensor_count) {
    return fail("n_tensors", 8,
                fmt::format("tensor count {} exceeds the limit of {}", n_tensors_,
                            limits_.max_tensor_count));
  }
  EXPERTD_TRY_ASSIGN(n_kv_, scalar<uint64_t>("n_kv"));
  if (n_kv_ > limits_.max_kv_count) {
    return fail(
        "n_kv", 16,
        fmt::format("key/value count {} exceeds the limit of {}", n_kv_, limits_.max_kv_count));
  }
  // A key/value needs at least 8 (key length) + 4 (type) + 1 bytes; a tensor info at least
  // 8 + 4 + 8 + 4 + 8. Counts the file cannot hold are rejected before anything is reserved.
  uint64_t kv_min = 0;
  uint64_t tensor_min = 0;
  uint64_t min_bytes = 0;
  if (__builtin_mul_overflow(n_kv_, 13, &kv_min) ||
      __builtin_mul_overflow(n_tensors_, 32, &tensor_min) ||
      __builtin_add_overflow(kv_min, tensor_min, &min_bytes) || min_bytes > remaining()) {
    return fail("n_kv", 16,
                fmt::format("{} key/values and {} tensor infos cannot fit in the {} bytes that "
                            "remain",
                            n_kv_, n_tensors_, remaining()));
  }
  return Ok{};
}

Status GgufParser::kv(uint64_t index) {
  const uint64_t at = pos_;
  const std::string field = fmt::format("kv[{}].key", index);
  GgufKv entry;
  entry.offset = at;
  EXPERTD_TRY_ASSIGN(entry.key, string(field));
  if (entry.key.empty()) return fail(field, at, "empty key");
  const std::string vfield = fmt::format("kv[{}] '{}'", index, printable(entry.key));
  if (file_.kv_index_.count(entry.key) != 0) {
    return fail(vfield, at, "duplicate key");
  }
  const uint64_t type_at = pos_;
  uint32_t type_raw = 0;
  EXPERTD_TRY_ASSIGN(type_raw, scalar<uint32_t>(vfield + " type"));
  if (!is_valid_value_type(type_raw)) {
    return fail(vfield + " type", type_at, fmt::format("unknown value type {}", type_raw));
  }
  EXPERTD_TRY_ASSIGN(entry.value, value(vfield, static_cast<GgufValueType>(type_raw), false));
  file_.kv_index_.emplace(entry.key, file_.kvs_.size());
  file_.kvs_.push_back(std::move(entry));
  return Ok{};
}

Status GgufParser::resolve_alignment() {
  const auto it = file_.kv_index_.find("general.alignment");
  if (it == file_.kv_index_.end()) return Ok{};
  const GgufKv& kv = file_.kvs_[it->second];
  const auto a = kv.value.as_u64();
  if (!a || kv.value.type == GgufValueType::BOOL) {
    return fail(
        "general.alignment", kv.offset,
        fmt::format("must be an unsigned integer, found {}", gguf_value_type_name(kv.value.type)));
  }
  if (*a == 0 || (*a & (*a - 1)) != 0) {
    return fail("general.alignment", kv.offset,
                fmt::format("alignment {} is not a power of two", *a));
  }
  if (*a > (1ull << 30)) {
    return fail("general.alignment", kv.offset, fmt::format("alignment {} exceeds 1 GiB", *a));
  }
  file_.alignment_ = *a;
  return Ok{};
}

Status GgufParser::tensor_info(uint64_t index) {
  GgufTensorInfo t;
  t.info_offset = pos_;
  const std::string field = fmt::format("tensor_info[{}]", index);
  EXPERTD_TRY_ASSIGN(t.name, string(field + ".name"));
  const std::string named = fmt::format("tensor_info[{}] '{}'", index, printable(t.name));
  if (t.name.empty()) return fail(field + ".name", t.info_offset, "empty tensor name");
  if (file_.tensor_index_.count(t.name) != 0) {
    return fail(named + ".name", t.info_offset, "duplicate tensor name");
  }
  const uint64_t dims_at = pos_;
  EXPERTD_TRY_ASSIGN(t.n_dims, scalar<uint32_t>(named + ".n_dims"));
  if (t.n_dims == 0 || t.n_dims > kGgufMaxDims) {
    return fail(named + ".n_dims", dims_at,
                fmt::format("n_dims {} is outside 1..{}", t.n_dims, kGgufMaxDims));
  }
  uint64_t elems = 1;
  for (uint32_t d = 0; d < t.n_dims; ++d) {
    const uint64_t at = pos_;
    const std::string f = fmt::format("{}.ne[{}]", named, d);
    EXPERTD_TRY_ASSIGN(t.ne[d], scalar<uint64_t>(f));
    if (t.ne[d] == 0) return fail(f, at, "dimension is 0: a tensor must hold data");
    if (t.ne[d] > static_cast<uint64_t>(INT64_MAX) ||
        __builtin_mul_overflow(elems, t.ne[d], &elems) ||
        elems > static_cast<uint64_t>(INT64_MAX)) {
      return fail(f, at, fmt::format("element count overflows (dimension {})", t.ne[d]));
    }
  }
  const uint64_t type_at = pos_;
  uint32_t type_raw = 0;
  EXPERTD_TRY_ASSIGN(type_raw, scalar<uint32_t>(named + ".type"));
  const auto traits = ggml_type_traits(type_raw);
  if (!traits) {
    return fail(named + ".type", type_at, fmt::format("unknown ggml type {}", type_raw));
  }
  if (traits->removed) {
    return fail(named + ".type", type_at,
                fmt::format("ggml type {} ({}) was removed from ggml and is not supported",
                            type_raw, traits->name));
  }
  t.type = static_cast<GgmlType>(type_raw);
  const auto row = ggml_row_bytes(t.type, t.ne[0]);
  if (!row) {
    return fail(named + ".ne[0]", ne_at(t, 0),
                fmt::format("ne0 {} is not a multiple of the {} block size {}", t.ne[0],
                            traits->name, traits->block_elems));
  }
  t.nb[0] = traits->block_bytes;
  t.nb[1] = *row;
  for (uint32_t d = 2; d < kGgufMaxDims; ++d) {
    if (__builtin_mul_overflow(t.nb[d - 1], t.ne[d - 1], &t.nb[d])) {
      return fail(named, t.info_offset, "tensor byte size overflows 64 bits");
    }
  }
  if (__builtin_mul_overflow(t.nb[3], t.ne[3], &t.bytes)) {
    return fail(named, t.info_offset, "tensor byte size overflows 64 bits");
  }
  const uint64_t off_at = pos_;
  EXPERTD_TRY_ASSIGN(t.rel_offset, scalar<uint64_t>(named + ".offset"));
  if (t.rel_offset % file_.alignment_ != 0) {
    return fail(named + ".offset", off_at,
                fmt::format("offset {} is not a multiple of the alignment {}", t.rel_offset,
                            file_.alignment_));
  }
  EXPERTD_TRY(charge(named, t.info_offset, sizeof(GgufTensorInfo)));
  file_.tensor_index_.emplace(t.name, file_.tensors_.size());
  file_.tensors_.push_back(std::move(t));
  return Ok{};
}

Status GgufParser::place_tensors() {
  // The data section starts at the first aligned offset after the tensor infos.
  const uint64_t a = file_.alignment_;
  const uint64_t data = (pos_ + a - 1) / a * a;  // pos_ <= size < 2^63 and a <= 2^30: no overflow
  if (data > src_.size() && !file_.tensors_.empty()) {
    return fail("data section", pos_,
                fmt::format("file truncated: the data section would start at byte {} but the "
                            "file is {} bytes",
                            data, src_.size()));
  }
  file_.data_offset_ = data;
  const uint64_t data_bytes = data > src_.size() ? 0 : src_.size() - data;
  for (auto& t : file_.tensors_) {
    if (t.rel_offset > data_bytes || t.bytes > data_bytes - t.rel_offset) {
      return fail(fmt::format("tensor '{}'.offset", printable(t.name)), rel_offset_at(t),
                  fmt::format("data [{}, +{}) runs past the end of the file: the data section "
                              "holds {} bytes from byte {}",
                              t.rel_offset, t.bytes, data_bytes, data));
    }
    t.offset = data + t.rel_offset;
  }
  std::vector<size_t> order(file_.tensors_.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t x, size_t y) {
    return file_.tensors_[x].rel_offset < file_.tensors_[y].rel_offset;
  });
  for (size_t i = 1; i < order.size(); ++i) {
    const auto& prev = file_.tensors_[order[i - 1]];
    const auto& cur = file_.tensors_[order[i]];
    if (prev.rel_offset + prev.bytes > cur.rel_offset) {
      return fail(fmt::format("tensor '{}'.offset", printable(cur.name)), rel_offset_at(cur),
                  fmt::format("data [{}, +{}) overlaps tensor '{}' at [{}, +{})", cur.rel_offset,
                              cur.bytes, printable(prev.name), prev.rel_offset, prev.bytes));
    }
  }
  return Ok{};
}

Result<GgufFile> GgufParser::run() {
  file_.path_ = src_.name();
  file_.file_size_ = src_.size();
  file_.alignment_ = kGgufDefaultAlignment;
  EXPERTD_TRY(header());
  file_.kvs_.reserve(n_kv_);
  for (uint64_t i = 0; i < n_kv_; ++i) EXPERTD_TRY(kv(i));
  EXPERTD_TRY(resolve_alignment());
  file_.tensors_.reserve(n_tensors_);
  for (uint64_t i = 0; i < n_tensors_; ++i) EXPERTD_TRY(tensor_info(i));
  EXPERTD_TRY(place_tensors());
  return std::move(file_);
}

Result<GgufFile> GgufFile::parse(const ByteSource& source, const GgufLimits& limits) {
  GgufParser parser(source, limits);
  return parser.run();
}

Result<GgufFile> GgufFile::open(const std::string& path, const GgufLimits& limits) {
  auto src = open_file_source(path);
  if (!src) return src.take_error();
  return parse(**src, limits);
}

const GgufValue* GgufFile::find(std::string_view key) const {
  const auto it = kv_index_.find(std::string(key));
  return it == kv_index_.end() ? nullptr : &kvs_[it->second].value;
}

const GgufTensorInfo* GgufFile::find_tensor(std::string_view name) const {
  const auto it = tensor_index_.find(std::string(name));
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

// ---------------------------------------------------------------------------------------------
// Models and split shards

std::optional<SplitName> parse_split_name(const std::string& path) {
  static const std::regex re(R"(^(.*)-([0-9]{5})-of-([0-9]{5})\.gguf$)");
  std::smatch m;
  if (!std::regex_match(path, m, re)) return std::nullopt;
  SplitName s;
  s.prefix = m[1].str();
  s.no = static_cast<uint32_t>(std::stoul(m[2].str()));
  s.count = static_cast<uint32_t>(std::stoul(m[3].str()));
  return s;
}

std::string split_path(const std::string& prefix, uint32_t no_1based, uint32_t count) {
  return fmt::format("{}-{:05d}-of-{:05d}.gguf", prefix, no_1based, count);
}

namespace {

Error model_error(const GgufFile& f, std::string_view field, uint64_t at, std::string_view what) {
  return make_error(EINVAL, fmt::format("{}: {} at byte {}: {}", f.path(), field, at, what));
}

uint64_t kv_offset(const GgufFile& f, std::string_view key) {
  for (const auto& kv : f.kvs()) {
    if (kv.key == key) return kv.offset;
  }
  return 0;
}

// Reads an integer split.* key; absent gives nullopt, a non-integer an Error.
Result<std::optional<uint64_t>> split_key(const GgufFile& f, std::string_view key) {
  const GgufValue* v = f.find(key);
  if (v == nullptr) return std::optional<uint64_t>{};
  const auto u = v->as_u64();
  if (!u || v->type == GgufValueType::BOOL) {
    return model_error(
        f, key, kv_offset(f, key),
        fmt::format("must be a non-negative integer, found {}", gguf_value_type_name(v->type)));
  }
  return std::optional<uint64_t>{*u};
}

bool is_moe_expert_tensor(std::string_view name) {
  static const std::regex re(R"(^blk\.[0-9]+\.ffn_(gate|up|down|gate_up)_exps\.weight$)");
  return std::regex_match(name.begin(), name.end(), re);
}

}  // namespace

Result<GgufModel> GgufModel::open(const std::string& path, const GgufLimits& limits) {
  GgufModel model;
  GgufFile first;
  EXPERTD_TRY_ASSIGN(first, GgufFile::open(path, limits));
  std::optional<uint64_t> count_key;
  EXPERTD_TRY_ASSIGN(count_key, split_key(first, "split.count"));
  const auto name = parse_split_name(path);
  const uint64_t declared = count_key.value_or(1);

  if (name && name->no != 1) {
    return make_error(
        EINVAL, fmt::format("{}: this is shard {} of {}; open the first shard {}", path, name->no,
                            name->count, split_path(name->prefix, 1, name->count)));
  }
  if (!name && declared > 1) {
    return model_error(first, "split.count", kv_offset(first, "split.count"),
                       fmt::format("the file declares {} shards but its name does not follow "
                                   "NAME-00001-of-{:05d}.gguf",
                                   declared, declared));
  }
  if (name && name->count > 1 && !count_key) {
    return model_error(first, "split.count", 0,
                       fmt::format("the file name says {} shards but the split.count key is "
                                   "missing",
                                   name->count));
  }
  if (name && count_key && *count_key != name->count) {
    return model_error(
        first, "split.count", kv_offset(first, "split.count"),
        fmt::format("split.count is {} but the file name says {} shards", *count_key, name->count));
  }
  if (name && name->count == 0) {
    return make_error(EINVAL, fmt::format("{}: the file name says 0 shards", path));
  }

  model.shards_.push_back(std::move(first));
  const uint32_t n = name ? name->count : 1;
  for (uint32_t i = 2; i <= n; ++i) {
    const std::string p = split_path(name->prefix, i, n);
    GgufFile shard;
    EXPERTD_TRY_ASSIGN(shard, GgufFile::open(p, limits));
    model.shards_.push_back(std::move(shard));
  }
  // Every shard must be a distinct file.
  std::set<std::pair<dev_t, ino_t>> seen;
  for (const GgufFile& s : model.shards_) {
    struct stat st {};
    if (::stat(s.path().c_str(), &st) == 0 && !seen.insert({st.st_dev, st.st_ino}).second) {
      return make_error(
          EINVAL, fmt::format("{}: duplicate shard: the same file as an earlier shard", s.path()));
    }
  }
  EXPERTD_TRY(model.check_and_index(count_key.has_value()));
  return model;
}

Result<GgufModel> GgufModel::from_sources(std::vector<std::unique_ptr<ByteSource>> sources,
                                          const GgufLimits& limits) {
  if (sources.empty()) return make_error(EINVAL, "a GGUF model needs at least one file");
  GgufModel model;
  for (const auto& src : sources) {
    GgufFile shard;
    EXPERTD_TRY_ASSIGN(shard, GgufFile::parse(*src, limits));
    model.shards_.push_back(std::move(shard));
  }
  std::optional<uint64_t> count_key;
  EXPERTD_TRY_ASSIGN(count_key, split_key(model.meta(), "split.count"));
  if (count_key.value_or(1) != sources.size()) {
    return model_error(model.meta(), "split.count", kv_offset(model.meta(), "split.count"),
                       fmt::format("the model has {} shards but {} files were given",
                                   count_key.value_or(1), sources.size()));
  }
  EXPERTD_TRY(model.check_and_index(count_key.has_value()));
  for (auto& src : sources) model.sources_.push_back(std::move(src));
  return model;
}

Status GgufModel::check_and_index(bool count_key) {
  GgufModel& model = *this;  // the checks read as they did in open()
  const auto n = static_cast<uint32_t>(model.shards_.size());
  // Every shard must say which it is and agree on the count.
  uint64_t total_tensors = 0;
  for (uint32_t i = 0; i < model.shards_.size(); ++i) {
    const GgufFile& s = model.shards_[i];
    total_tensors += s.tensors().size();
    if (n == 1 && !count_key) continue;
    std::optional<uint64_t> no;
    std::optional<uint64_t> cnt;
    EXPERTD_TRY_ASSIGN(no, split_key(s, "split.no"));
    EXPERTD_TRY_ASSIGN(cnt, split_key(s, "split.count"));
    if (!no) return model_error(s, "split.no", 0, "missing in a split model's shard");
    if (!cnt) return model_error(s, "split.count", 0, "missing in a split model's shard");
    if (*no != i) {
      return model_error(s, "split.no", kv_offset(s, "split.no"),
                         fmt::format("is {} but the file name makes this shard {} (0-based): "
                                     "shards are duplicated or misnamed",
                                     *no, i));
    }
    if (*cnt != n) {
      return model_error(s, "split.count", kv_offset(s, "split.count"),
                         fmt::format("is {} but the model has {} shards", *cnt, n));
    }
  }
  if (n > 1 || count_key) {
    std::optional<uint64_t> declared_tensors;
    EXPERTD_TRY_ASSIGN(declared_tensors, split_key(model.meta(), "split.tensors.count"));
    if (!declared_tensors) {
      return model_error(model.meta(), "split.tensors.count", 0,
                         "missing in a split model's first shard");
    }
    if (*declared_tensors != total_tensors) {
      return model_error(model.meta(), "split.tensors.count",
                         kv_offset(model.meta(), "split.tensors.count"),
                         fmt::format("is {} but the {} shards hold {} tensors", *declared_tensors,
                                     n, total_tensors));
    }
  }

  for (uint32_t i = 0; i < model.shards_.size(); ++i) {
    for (const auto& t : model.shards_[i].tensors()) {
      const auto [it, inserted] = model.tensor_index_.emplace(t.name, GgufTensorRef{i, &t});
      if (!inserted) {
        return model_error(model.shards_[i],
                           fmt::format("tensor_info '{}'.name", printable(t.name)), t.info_offset,
                           fmt::format("duplicate tensor name: also in {}",
                                       model.shards_[it->second.shard].path()));
      }
    }
  }

  if (const GgufValue* arch = model.meta().find("general.architecture")) {
    if (const std::string* s = arch->as_string()) model.architecture_ = *s;
  }

  // Expert tensors are [ne0, ne1, n_expert]: the expert dimension must be <arch>.expert_count.
  std::optional<uint64_t> expert_count;
  const GgufValue* ec = model.architecture_.empty() ? nullptr : model.find_arch("expert_count");
  if (ec != nullptr) expert_count = ec->as_u64();
  for (uint32_t i = 0; i < model.shards_.size(); ++i) {
    for (const auto& t : model.shards_[i].tensors()) {
      if (!is_moe_expert_tensor(t.name)) continue;
      const GgufFile& s = model.shards_[i];
      if (t.n_dims != 3) {
        return model_error(
            s, fmt::format("tensor_info '{}'.n_dims", printable(t.name)), n_dims_at(t),
            fmt::format("an expert tensor must have 3 dimensions, found {}", t.n_dims));
      }
      if (!expert_count) {
        return model_error(model.meta(),
                           model.architecture_.empty() ? std::string("general.architecture")
                                                       : model.arch_key("expert_count"),
                           0,
                           fmt::format("missing or not an integer, but tensor '{}' holds "
                                       "experts",
                                       printable(t.name)));
      }
      if (t.ne[2] != *expert_count) {
        return model_error(s, fmt::format("tensor_info '{}'.ne[2]", printable(t.name)), ne_at(t, 2),
                           fmt::format("expert dimension {} disagrees with {} = {}", t.ne[2],
                                       model.arch_key("expert_count"), *expert_count));
      }
    }
  }
  return Ok{};
}

std::string GgufModel::arch_key(std::string_view suffix) const {
  return fmt::format("{}.{}", architecture_, suffix);
}

const GgufValue* GgufModel::find_arch(std::string_view suffix) const {
  return meta().find(arch_key(suffix));
}

std::optional<GgufTensorRef> GgufModel::find_tensor(std::string_view name) const {
  const auto it = tensor_index_.find(std::string(name));
  if (it == tensor_index_.end()) return std::nullopt;
  return it->second;
}

uint64_t GgufModel::tensor_count() const { return tensor_index_.size(); }

}  // namespace expertd
