#include "storage/gguf_writer.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <liburing.h>
#include <stdio.h>  // renameat2, RENAME_NOREPLACE
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <new>
#include <utility>

#include "base/check.h"
#include "storage/owned_ring.h"

namespace expertd {
namespace {

constexpr uint32_t kGgufVersion = 3;
// O_DIRECT alignment of memory, offsets and sizes: 4 KiB suits 512 B and 4 KiB sector devices.
constexpr uint64_t kDirectAlign = 4096;
constexpr std::string_view kAlignmentKey = "general.alignment";

static_assert(std::endian::native == std::endian::little, "the writer emits host-order integers");

template <typename T>
void put_le(std::vector<uint8_t>& out, T v) {
  const size_t at = out.size();
  out.resize(at + sizeof(T));
  std::memcpy(out.data() + at, &v, sizeof(T));
}

void put_str(std::vector<uint8_t>& out, std::string_view s) {
  put_le<uint64_t>(out, s.size());
  out.insert(out.end(), s.begin(), s.end());
}

uint64_t align_up(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

std::string dir_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

GgufWriter::GgufWriter(uint64_t alignment) : alignment_(alignment) {
  EXPERTD_CHECK_GE(alignment, 1);
  EXPERTD_CHECK_LE(alignment, (1ull << 30));
  EXPERTD_CHECK_EQ((alignment & (alignment - 1)), 0);
  if (alignment != kGgufDefaultAlignment) {
    put_scalar(kAlignmentKey, GgufValueType::UINT32, static_cast<uint32_t>(alignment));
  }
}

GgufWriter::~GgufWriter() { discard(); }

GgufWriter::GgufWriter(GgufWriter&& other) noexcept
    : alignment_(other.alignment_),
      state_(other.state_),
      kvs_(std::move(other.kvs_)),
      kv_index_(std::move(other.kv_index_)),
      tensors_(std::move(other.tensors_)),
      tensor_index_(std::move(other.tensor_index_)),
      data_bytes_(other.data_bytes_),
      options_(other.options_),
      path_(std::move(other.path_)),
      fd_(std::move(other.fd_)),
      temp_exists_(std::exchange(other.temp_exists_, false)),
      direct_(other.direct_),
      buffer_cap_(other.buffer_cap_),
      buffer_(std::move(other.buffer_)),
      dio_(std::move(other.dio_)),
      stage_(std::exchange(other.stage_, nullptr)),
      buffered_(other.buffered_),
      file_pos_(other.file_pos_),
      cur_tensor_(other.cur_tensor_),
      cur_written_(other.cur_written_) {
  other.state_ = State::kFailed;
}

// ---------------------------------------------------------------------------------------------
// Metadata

void GgufWriter::put_kv(std::string_view key, GgufValueType type, std::vector<uint8_t> payload) {
  EXPERTD_CHECK_EQ(state_, State::kCollecting);
  const auto it = kv_index_.find(std::string(key));
  if (it != kv_index_.end()) {
    kvs_[it->second].type = type;
    kvs_[it->second].payload = std::move(payload);
    return;
  }
  kv_index_.emplace(std::string(key), kvs_.size());
  kvs_.push_back(Kv{std::string(key), type, std::move(payload)});
}

template <typename T>
void GgufWriter::put_scalar(std::string_view key, GgufValueType type, T v) {
  std::vector<uint8_t> p;
  put_le<T>(p, v);
  put_kv(key, type, std::move(p));
}

template <typename T>
void GgufWriter::put_array(std::string_view key, GgufValueType elem, std::span<const T> v) {
  std::vector<uint8_t> p;
  p.reserve(12 + v.size() * sizeof(T));
  put_le<uint32_t>(p, static_cast<uint32_t>(elem));
  put_le<uint64_t>(p, v.size());
  for (const T& x : v) {
    if constexpr (std::is_same_v<T, bool>) {
      put_le<uint8_t>(p, x ? 1 : 0);
    } else if constexpr (std::is_same_v<T, std::string> || std::is_same_v<T, std::string_view>) {
      put_str(p, x);
    } else {
      put_le<T>(p, x);
    }
  }
  put_kv(key, GgufValueType::ARRAY, std::move(p));
}

// general.alignment decides the layout, so only the constructor may set it.
#define EXPERTD_ASSERT_NOT_ALIGNMENT(key) EXPERTD_CHECK_NE((key), kAlignmentKey)

void GgufWriter::set_u8(std::string_view k, uint8_t v) {
  EXPERTD_ASSERT_NOT_ALIGNMENT(k);
  put_scalar(k, GgufValueType::UINT8, v);
}
void GgufWriter::set_i8(std::string_view k, int8_t v) {
  EXPERTD_ASSERT_NOT_ALIGNMENT(k);
  put_scalar(k, GgufValueType::INT8, v);
}
void GgufWriter::set_u16(std::string_view k, uint16_t v) {
  EXPERTD_ASSERT_NOT_ALIGNMENT(k);
  put_scalar(k, GgufValueType::UINT16, v);
}
void GgufWriter::set_i16(std::string_view k, int16_t v) {
  EXPERTD_ASSERT_NOT_ALIGNMENT(k);
  put_scalar(k, GgufValueType::INT16, v);
}
void GgufWriter::set_u32(std::string_view k, uint32_t v) {
  EXPERTD_ASSERT_NOT_ALIGNMENT(k);
  put_scalar(k, GgufValueType::UINT32, v);
}
void GgufWriter::set_i32(std::string_view k, int32_t v) {
  EXPERTD_ASSERT_NOT_ALIGNMENT(k);
  put_scalar(k, GgufValueType::INT32, v);
}
void GgufWriter::set_u64(std::string_view k, uint64_t v) {
  EXPERTD_ASSERT_NOT_ALIGNMENT(k);
  put_scalar(k, GgufValueType::UINT64, v);
}
void GgufWriter::set_i64(std::string_view k, int64_t v) {
  EXPERTD_ASSERT_NOT_ALIGNMENT(k);
  put_scalar(k, GgufValueType::INT64, v);
}
void GgufWriter::set_f32(std::string_view k, float v) {
  EXPERTD_ASSERT_NOT_ALIGNMENT(k);
  put_scalar(k, GgufValueType::FLOAT32, v);
}
void GgufWriter::set_f64(std::string_view k, double v) {
  EXPERTD_ASSERT_NOT_ALIGNMENT(k);
  put_scalar(k, GgufValueType::FLOAT64, v);
}
void GgufWriter::set_bool(std::string_view k, bool v) {
  EXPERTD_ASSERT_NOT_ALIGNMENT(k);
  put_scalar<uint8_t>(k, GgufValueType::BOOL, v ? 1 : 0);
}
void GgufWriter::set_string(std::string_view k, std::string_view v) {
  EXPERTD_ASSERT_NOT_ALIGNMENT(k);
  std::vector<uint8_t> p;
  put_str(p, v);
  put_kv(k, GgufValueType::STRING, std::move(p));
}

#define EXPERTD_SET_ARRAY(T, ELEM)                                       \
  void GgufWriter::set_array(std::string_view k, std::span<const T> v) { \
    EXPERTD_ASSERT_NOT_ALIGNMENT(k);                                     \
    put_array<T>(k, GgufValueType::ELEM, v);                             \
  }
EXPERTD_SET_ARRAY(uint8_t, UINT8)
EXPERTD_SET_ARRAY(int8_t, INT8)
EXPERTD_SET_ARRAY(uint16_t, UINT16)
EXPERTD_SET_ARRAY(int16_t, INT16)
EXPERTD_SET_ARRAY(uint32_t, UINT32)
EXPERTD_SET_ARRAY(int32_t, INT32)
EXPERTD_SET_ARRAY(uint64_t, UINT64)
EXPERTD_SET_ARRAY(int64_t, INT64)
EXPERTD_SET_ARRAY(float, FLOAT32)
EXPERTD_SET_ARRAY(double, FLOAT64)
EXPERTD_SET_ARRAY(bool, BOOL)
EXPERTD_SET_ARRAY(std::string, STRING)
EXPERTD_SET_ARRAY(std::string_view, STRING)
#undef EXPERTD_SET_ARRAY
#undef EXPERTD_ASSERT_NOT_ALIGNMENT

Status GgufWriter::set_value(std::string_view key, const GgufValue& value) {
  EXPERTD_CHECK_NE(key, kAlignmentKey);
  auto bad = [&](std::string_view what) {
    return make_error(EINVAL, fmt::format("key '{}': {}", key, what));
  };
  std::vector<uint8_t> p;
  if (value.type == GgufValueType::ARRAY) {
    const GgufArray* a = value.as_array();
    if (a == nullptr) return bad("array type without an array value");
    if (a->elem_type == GgufValueType::ARRAY) return bad("nested arrays are not supported");
    put_le<uint32_t>(p, static_cast<uint32_t>(a->elem_type));
    put_le<uint64_t>(p, a->count);
    if (a->elem_type == GgufValueType::STRING) {
      if (a->string_ends.size() != a->count) return bad("string array count mismatch");
      for (uint64_t i = 0; i < a->count; ++i) put_str(p, a->string_at(i));
    } else {
      if (a->raw.size() != a->count * gguf_scalar_bytes(a->elem_type)) {
        return bad("array byte size mismatch");
      }
      p.insert(p.end(), a->raw.begin(), a->raw.end());
    }
    put_kv(key, GgufValueType::ARRAY, std::move(p));
    return Ok{};
  }
  if (value.type == GgufValueType::STRING) {
    const std::string* s = value.as_string();
    if (s == nullptr) return bad("string type without a string value");
    put_str(p, *s);
    put_kv(key, GgufValueType::STRING, std::move(p));
    return Ok{};
  }
  if (static_cast<uint32_t>(value.type) > static_cast<uint32_t>(GgufValueType::FLOAT64)) {
    return bad(fmt::format("unknown value type {}", static_cast<uint32_t>(value.type)));
  }
  const auto u = value.as_u64();
  const auto i = value.as_i64();
  const auto f = value.as_f64();
  const auto b = value.as_bool();
  switch (value.type) {
    case GgufValueType::UINT8:
    case GgufValueType::UINT16:
    case GgufValueType::UINT32:
    case GgufValueType::UINT64: {
      if (!u) return bad("unsigned type without an unsigned value");
      const uint32_t w = gguf_scalar_bytes(value.type);
      if (w < 8 && (*u >> (8 * w)) != 0) return bad("value does not fit its type");
      const uint64_t x = *u;
      p.resize(w);
      std::memcpy(p.data(), &x, w);  // little-endian: the low bytes
      break;
    }
    case GgufValueType::INT8:
    case GgufValueType::INT16:
    case GgufValueType::INT32:
    case GgufValueType::INT64: {
      if (!i) return bad("signed type without a signed value");
      const uint32_t w = gguf_scalar_bytes(value.type);
      const int64_t lim = w < 8 ? (int64_t{1} << (8 * w - 1)) : 0;
      if (w < 8 && (*i < -lim || *i >= lim)) return bad("value does not fit its type");
      const int64_t x = *i;
      p.resize(w);
      std::memcpy(p.data(), &x, w);
      break;
    }
    case GgufValueType::FLOAT32:
      if (!f) return bad("float type without a float value");
      put_le<float>(p, static_cast<float>(*f));
      break;
    case GgufValueType::FLOAT64:
      if (!f) return bad("float type without a float value");
      put_le<double>(p, *f);
      break;
    case GgufValueType::BOOL:
      if (!b) return bad("bool type without a bool value");
      put_le<uint8_t>(p, *b ? 1 : 0);
      break;
    case GgufValueType::STRING:
    case GgufValueType::ARRAY:
      break;  // handled above
  }
  put_kv(key, value.type, std::move(p));
  return Ok{};
}

Status GgufWriter::add_tensor(std::string_view name, GgmlType type, std::span<const uint64_t> ne) {
  EXPERTD_CHECK_EQ(state_, State::kCollecting);
  auto bad = [&](std::string_view what) {
    return make_error(EINVAL, fmt::format("tensor '{}': {}", name, what));
  };
  if (name.empty()) return bad("empty name");
  if (tensor_index_.count(std::string(name)) != 0) return bad("duplicate name");
  if (ne.empty() || ne.size() > kGgufMaxDims) {
    return bad(fmt::format("{} dimensions; a tensor has 1..{}", ne.size(), kGgufMaxDims));
  }
  const GgmlTypeTraits& traits = ggml_traits(type);
  GgufTensorInfo t;
  t.name = std::string(name);
  t.n_dims = static_cast<uint32_t>(ne.size());
  t.type = type;
  uint64_t elems = 1;
  for (size_t d = 0; d < ne.size(); ++d) {
    if (ne[d] == 0) return bad(fmt::format("ne[{}] is 0", d));
    if (ne[d] > static_cast<uint64_t>(INT64_MAX) || __builtin_mul_overflow(elems, ne[d], &elems) ||
        elems > static_cast<uint64_t>(INT64_MAX)) {
      return bad("element count overflows");
    }
    t.ne[d] = ne[d];
  }
  const auto row = ggml_row_bytes(type, t.ne[0]);
  if (!row) {
    return bad(fmt::format("ne0 {} is not a multiple of the {} block size {}", t.ne[0], traits.name,
                           traits.block_elems));
  }
  t.nb[0] = traits.block_bytes;
  t.nb[1] = *row;
  for (uint32_t d = 2; d < kGgufMaxDims; ++d) {
    if (__builtin_mul_overflow(t.nb[d - 1], t.ne[d - 1], &t.nb[d])) {
      return bad("byte size overflows");
    }
  }
  uint64_t end = 0;
  if (__builtin_mul_overflow(t.nb[3], t.ne[3], &t.bytes) ||
      __builtin_add_overflow(data_bytes_, t.bytes, &end) || end > (uint64_t{1} << 62)) {
    return bad("byte size overflows");
  }
  t.rel_offset = data_bytes_;
  data_bytes_ = align_up(end, alignment_);
  tensor_index_.emplace(t.name, tensors_.size());
  tensors_.push_back(std::move(t));
  return Ok{};
}

// ---------------------------------------------------------------------------------------------
// Layout

uint64_t GgufWriter::metadata_bytes() const {
  uint64_t n = 4 + 4 + 8 + 8;  // magic, version, n_tensors, n_kv
  for (const Kv& kv : kvs_) n += 8 + kv.key.size() + 4 + kv.payload.size();
  for (const GgufTensorInfo& t : tensors_) n += 8 + t.name.size() + 4 + 8 * t.n_dims + 4 + 8;
  return n;
}

uint64_t GgufWriter::data_offset() const { return align_up(metadata_bytes(), alignment_); }

std::vector<uint8_t> GgufWriter::serialize_metadata() const {
  std::vector<uint8_t> out;
  out.reserve(data_offset());
  put_le<uint32_t>(out, 0x46554747u);  // "GGUF"
  put_le<uint32_t>(out, kGgufVersion);
  put_le<uint64_t>(out, tensors_.size());
  put_le<uint64_t>(out, kvs_.size());
  for (const Kv& kv : kvs_) {
    put_str(out, kv.key);
    put_le<uint32_t>(out, static_cast<uint32_t>(kv.type));
    out.insert(out.end(), kv.payload.begin(), kv.payload.end());
  }
  for (const GgufTensorInfo& t : tensors_) {
    put_str(out, t.name);
    put_le<uint32_t>(out, t.n_dims);
    for (uint32_t d = 0; d < t.n_dims; ++d) put_le<uint64_t>(out, t.ne[d]);
    put_le<uint32_t>(out, static_cast<uint32_t>(t.type));
    put_le<uint64_t>(out, t.rel_offset);
  }
  EXPERTD_CHECK_EQ(out.size(), metadata_bytes());
  out.resize(data_offset(), 0);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Writing

namespace {

struct AlignedDelete {
  void operator()(uint8_t* p) const { ::operator delete[](p, std::align_val_t{kDirectAlign}); }
};
using AlignedBuffer = std::unique_ptr<uint8_t[], AlignedDelete>;

AlignedBuffer aligned_buffer(uint64_t bytes) {
  return AlignedBuffer(
      static_cast<uint8_t*>(::operator new[](bytes, std::align_val_t{kDirectAlign})));
}

}  // namespace

// Two aligned stages: the writer fills one while the other's write is in flight. With a ring the
// write runs in the kernel (no thread of ours); without one (io_uring refused) it is a plain
// pwrite and the stages simply alternate.
struct GgufWriter::DirectIo {
  AlignedBuffer stage[2];
  int filling = 0;
  OwnedRing ring;  // after the stages: it goes first (invalid when io_uring is refused)
  bool in_flight = false;
  uint64_t in_flight_at = 0;
  uint64_t in_flight_bytes = 0;

  ~DirectIo() {
    // The kernel may still be reading a stage: wait before the memory goes.
    if (ring.valid() && in_flight) {
      io_uring_cqe* cqe = nullptr;
      while (io_uring_wait_cqe(ring.get(), &cqe) == -EINTR) {
      }
    }
  }
};

Error GgufWriter::io_error(std::string_view what, int err) const {
  return make_error(err, fmt::format("{}: {}: {}", temp_path(), what, std::strerror(err)));
}

void GgufWriter::discard() {
  dio_.reset();  // first: waits for a write in flight
  fd_.reset();
  if (temp_exists_) {
    ::unlink(temp_path().c_str());
    temp_exists_ = false;
  }
  buffer_.reset();
  stage_ = nullptr;
}

Status GgufWriter::fail(Error error) {
  discard();
  state_ = State::kFailed;
  return error;
}

Status GgufWriter::begin(const std::string& path, const GgufWriterOptions& options) {
  EXPERTD_CHECK_EQ(state_, State::kCollecting);
  EXPERTD_CHECK_GT(options.buffer_bytes, 0);
  EXPERTD_CHECK_LE(options.buffer_bytes, (1u << 30));
  options_ = options;
  path_ = path;
  struct stat st {};
  if (!options.overwrite && ::lstat(path.c_str(), &st) == 0) {
    state_ = State::kFailed;
    return make_error(EEXIST, fmt::format("{}: already exists", path));
  }
  const std::string tmp = temp_path();
  constexpr int kFlags = O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC;
  direct_ = false;
  if (options.direct_io) {
    fd_ = UniqueFd(::open(tmp.c_str(), kFlags | O_DIRECT, 0644));
    direct_ = fd_.valid();
  }
  if (!fd_.valid()) fd_ = UniqueFd(::open(tmp.c_str(), kFlags, 0644));
  if (!fd_.valid()) {
    const int e = errno;
    state_ = State::kFailed;
    return make_error(e, fmt::format("{}: cannot create: {}", tmp, std::strerror(e)));
  }
  temp_exists_ = true;
  state_ = State::kWriting;
  // Reserving the whole file up front turns a full disk into an error now rather than after
  // minutes of writing. File systems without fallocate simply skip it.
  const uint64_t total = file_bytes();
  if (total > 0 && ::fallocate(fd_.get(), 0, 0, static_cast<off_t>(total)) != 0) {
    const int e = errno;
    if (e != EOPNOTSUPP && e != ENOSYS && e != EINVAL) {
      return fail(io_error(fmt::format("cannot reserve {} bytes", total), e));
    }
  }
  buffer_cap_ = align_up(options.buffer_bytes, kDirectAlign);
  if (direct_) {
    dio_ = std::make_unique<DirectIo>();
    dio_->stage[0] = aligned_buffer(buffer_cap_);
    dio_->stage[1] = aligned_buffer(buffer_cap_);
    io_uring_params params{};
    (void)dio_->ring.init(2, params);  // refused: plain pwrite
    stage_ = dio_->stage[0].get();
  } else {
    buffer_ = std::make_unique<uint8_t[]>(buffer_cap_);
    stage_ = buffer_.get();
  }
  buffered_ = 0;
  file_pos_ = 0;
  cur_tensor_ = 0;
  cur_written_ = 0;
  const uint64_t data = data_offset();
  for (GgufTensorInfo& t : tensors_) t.offset = data + t.rel_offset;
  const std::vector<uint8_t> meta = serialize_metadata();
  EXPERTD_TRY(append(meta));
  // Tensors of zero bytes cannot exist (every ne >= 1), so the first tensor is the current one.
  return Ok{};
}

Status GgufWriter::flush_with(std::span<const uint8_t> tail) {
  EXPERTD_CHECK(!direct_);
  iovec iov[2] = {{stage_, buffered_}, {const_cast<uint8_t*>(tail.data()), tail.size()}};
  int first = buffered_ == 0 ? 1 : 0;
  const int last = tail.empty() ? 1 : 2;
  const uint64_t total = buffered_ + tail.size();
  const uint64_t at = file_pos_ - buffered_;  // file offset of the stage's first byte
  uint64_t done = 0;
  while (first < last) {
    const ssize_t n = ::writev(fd_.get(), iov + first, last - first);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int e = errno;
      return fail(
          io_error(fmt::format("write of {} bytes at byte {} failed", total - done, at + done), e));
    }
    if (n == 0) return fail(io_error("write made no progress", EIO));
    done += static_cast<uint64_t>(n);
    // Skip the fully written vectors, then advance into a partly written one.
    auto left = static_cast<size_t>(n);
    while (first < last && left >= iov[first].iov_len) {
      left -= iov[first].iov_len;
      ++first;
    }
    if (first < last) {
      iov[first].iov_base = static_cast<uint8_t*>(iov[first].iov_base) + left;
      iov[first].iov_len -= left;
    }
  }
  EXPERTD_CHECK_EQ(done, total);
  file_pos_ += tail.size();
  buffered_ = 0;
  return Ok{};
}

Status GgufWriter::wait_direct() {
  DirectIo& d = *dio_;
  if (!d.in_flight) return Ok{};
  io_uring_cqe* cqe = nullptr;
  int rc = 0;
  while ((rc = io_uring_wait_cqe(d.ring.get(), &cqe)) == -EINTR) {
  }
  if (rc < 0) return fail(io_error("io_uring_wait_cqe failed", -rc));
  const int res = cqe->res;
  io_uring_cqe_seen(d.ring.get(), cqe);
  d.in_flight = false;
  if (res < 0) {
    return fail(io_error(
        fmt::format("write of {} bytes at byte {} failed", d.in_flight_bytes, d.in_flight_at),
        -res));
  }
  if (static_cast<uint64_t>(res) != d.in_flight_bytes) {
    // O_DIRECT writes are not continued: the rest would start at an unaligned offset.
    return fail(io_error(fmt::format("short write: {} of {} bytes at byte {}", res,
                                     d.in_flight_bytes, d.in_flight_at),
                         EIO));
  }
  return Ok{};
}

Status GgufWriter::submit_direct() {
  DirectIo& d = *dio_;
  const uint64_t at = file_pos_ - buffered_;
  const uint64_t bytes = align_up(buffered_, kDirectAlign);
  EXPERTD_CHECK_EQ(at % kDirectAlign, 0);
  EXPERTD_CHECK_LE(bytes, buffer_cap_);
  if (bytes == 0) return Ok{};
  std::memset(stage_ + buffered_, 0, bytes - buffered_);  // only the last block is partial
  EXPERTD_TRY(wait_direct());  // the other stage's write: it is about to be filled
  if (d.ring.valid()) {
    io_uring_sqe* sqe = io_uring_get_sqe(d.ring.get());
    EXPERTD_CHECK_NE(sqe, nullptr);  // depth 2, at most 1 in flight
    io_uring_prep_write(sqe, fd_.get(), stage_, static_cast<unsigned>(bytes), at);
    int rc = 0;
    while ((rc = io_uring_submit(d.ring.get())) == -EINTR) {
    }
    if (rc < 0) return fail(io_error("io_uring_submit failed", -rc));
    d.in_flight = true;
    d.in_flight_at = at;
    d.in_flight_bytes = bytes;
  } else {
    uint64_t done = 0;
    while (done < bytes) {
      const ssize_t n =
          ::pwrite(fd_.get(), stage_ + done, bytes - done, static_cast<off_t>(at + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int e = n < 0 ? errno : EIO;
        return fail(io_error(
            fmt::format("write of {} bytes at byte {} failed", bytes - done, at + done), e));
      }
      done += static_cast<uint64_t>(n);
    }
  }
  d.filling ^= 1;
  stage_ = d.stage[d.filling].get();
  buffered_ = 0;
  return Ok{};
}

Status GgufWriter::flush_direct_tail() {
  EXPERTD_TRY(submit_direct());
  EXPERTD_TRY(wait_direct());
  // The zero padding of the last block is not part of the file.
  if (::ftruncate(fd_.get(), static_cast<off_t>(file_pos_)) != 0) {
    const int e = errno;
    return fail(io_error(fmt::format("truncate to {} bytes failed", file_pos_), e));
  }
  return Ok{};
}

Status GgufWriter::append(std::span<const uint8_t> data) {
  const uint64_t cap = buffer_cap_;
  // Buffered mode: a large span goes straight to the file behind the buffered bytes, no copy.
  if (!direct_ && data.size() >= cap / 2) return flush_with(data);
  while (!data.empty()) {
    const uint64_t take = std::min<uint64_t>(cap - buffered_, data.size());
    std::memcpy(stage_ + buffered_, data.data(), take);
    buffered_ += take;
    file_pos_ += take;
    data = data.subspan(take);
    if (buffered_ == cap) EXPERTD_TRY(direct_ ? submit_direct() : flush_with({}));
  }
  return Ok{};
}

Status GgufWriter::append_zeros(uint64_t n) {
  static constexpr uint8_t kZeros[4096] = {};
  while (n > 0) {
    const uint64_t take = std::min<uint64_t>(n, sizeof(kZeros));
    EXPERTD_TRY(append(std::span<const uint8_t>(kZeros, take)));
    n -= take;
  }
  return Ok{};
}

Status GgufWriter::write(std::span<const uint8_t> data) {
  EXPERTD_CHECK_EQ(state_, State::kWriting);
  while (!data.empty()) {
    if (cur_tensor_ >= tensors_.size()) {
      return fail(make_error(EINVAL, fmt::format("{}: {} bytes of tensor data past the last "
                                                 "tensor",
                                                 temp_path(), data.size())));
    }
    const GgufTensorInfo& t = tensors_[cur_tensor_];
    const uint64_t take = std::min<uint64_t>(t.bytes - cur_written_, data.size());
    EXPERTD_TRY(append(data.first(take)));
    data = data.subspan(take);
    cur_written_ += take;
    if (cur_written_ == t.bytes) {
      EXPERTD_TRY(append_zeros(align_up(t.bytes, alignment_) - t.bytes));
      ++cur_tensor_;
      cur_written_ = 0;
    }
  }
  return Ok{};
}

Status GgufWriter::finish() {
  EXPERTD_CHECK_EQ(state_, State::kWriting);
  if (cur_tensor_ != tensors_.size()) {
    const GgufTensorInfo& t = tensors_[cur_tensor_];
    return fail(make_error(EINVAL, fmt::format("{}: tensor '{}' received {} of its {} bytes",
                                               temp_path(), t.name, cur_written_, t.bytes)));
  }
  EXPERTD_TRY(direct_ ? flush_direct_tail() : flush_with({}));
  EXPERTD_CHECK_EQ(file_pos_, file_bytes());
  dio_.reset();
  buffer_.reset();
  stage_ = nullptr;
  if (options_.sync && ::fsync(fd_.get()) != 0) {
    const int e = errno;
    return fail(io_error("fsync failed", e));
  }
  // Closed by hand, not by the owner: close(2) can report a write error the file system deferred.
  if (::close(fd_.release()) != 0) {
    const int e = errno;
    return fail(io_error("close failed", e));
  }
  state_ = State::kFinished;
  return Ok{};
}

Status GgufWriter::commit() {
  EXPERTD_CHECK_EQ(state_, State::kFinished);
  const std::string tmp = temp_path();
  int rc = 0;
  if (options_.overwrite) {
    rc = ::rename(tmp.c_str(), path_.c_str());
  } else {
    // NOREPLACE: a file created at PATH since begin() is never clobbered.
    rc = ::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, path_.c_str(), RENAME_NOREPLACE);
  }
  if (rc != 0) {
    const int e = errno;
    return fail(make_error(e, fmt::format("{}: cannot rename {} to it: {}", path_, tmp,
                                          e == EEXIST ? "already exists" : std::strerror(e))));
  }
  temp_exists_ = false;
  state_ = State::kCommitted;
  if (options_.sync) {
    // The rename is durable only once the directory entry is.
    const std::string dir = dir_of(path_);
    const UniqueFd dfd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (dfd.valid()) {
      const int src = ::fsync(dfd.get());
      const int e = errno;
      if (src != 0 && e != EINVAL) {
        return make_error(
            e, fmt::format("{}: fsync of directory {} failed: {}", path_, dir, std::strerror(e)));
      }
    }
  }
  return Ok{};
}

}  // namespace expertd
