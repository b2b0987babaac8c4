// GGUF v2/v3 metadata reader for untrusted files.
//
// GgufFile parses one file's header, key/value metadata and tensor infos from a ByteSource without
// reading tensor data. Every count, length, size, product and offset is checked (against
// overflow, against the bytes left in the file and against GgufLimits) before it is used, so a
// hostile file yields one Error naming the file, the field and the byte offset: never a crash, an
// assert or an allocation larger than the limits allow.
//
// GgufModel opens a single file or all shards of a split model (NAME-00001-of-0000N.gguf, with
// split.no / split.count / split.tensors.count) and checks the shards against each other and the
// MoE expert tensors against `<arch>.expert_count`.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <variant>
#include <vector>

#include "base/fd.h"
#include "expertd/result.h"
#include "storage/ggml_types.h"

namespace expertd {

// A random-access source of bytes: a file (pread) or a memory buffer (fuzzing, tests).
class ByteSource {
 public:
  virtual ~ByteSource() = default;
  virtual uint64_t size() const = 0;
  virtual const std::string& name() const = 0;  // used in error messages
  // Reads exactly dst.size() bytes at `offset`; an Error on a short read or an I/O failure.
  virtual Status read_exact(uint64_t offset, std::span<uint8_t> dst) const = 0;
};

// Opens `path` read-only (buffered I/O; metadata is small). Error names the path and errno.
Result<std::unique_ptr<ByteSource>> open_file_source(const std::string& path);
// Reads an already-open fd (e.g. one expertd passed); `name` is used in error messages.
Result<std::unique_ptr<ByteSource>> fd_source(std::string name, UniqueFd fd);
// Wraps caller-owned bytes; they must outlive the source.
std::unique_ptr<ByteSource> memory_source(std::string name, std::span<const uint8_t> bytes);

enum class GgufValueType : uint32_t {
  UINT8 = 0,
  INT8 = 1,
  UINT16 = 2,
  INT16 = 3,
  UINT32 = 4,
  INT32 = 5,
  FLOAT32 = 6,
  BOOL = 7,
  STRING = 8,
  ARRAY = 9,
  UINT64 = 10,
  INT64 = 11,
  FLOAT64 = 12,
};
std::string_view gguf_value_type_name(GgufValueType type);  // "uint8", ..., "array"
// Byte size of a fixed-size scalar type; 0 for STRING and ARRAY.
uint32_t gguf_scalar_bytes(GgufValueType type);

// An array value. Numeric and bool elements are kept packed little-endian in `raw`
// (count * gguf_scalar_bytes(elem_type) bytes); string elements are kept in one buffer with end
// offsets so a 150k-token vocabulary costs 8 bytes per entry of overhead.
struct GgufArray {
  GgufValueType elem_type = GgufValueType::UINT8;
  uint64_t count = 0;
  std::vector<uint8_t> raw;
  std::string chars;
  std::vector<uint64_t> string_ends;

  std::string_view string_at(uint64_t i) const;  // requires elem_type == STRING, i < count
  // Element i of an integer array as int64 (uint64 values above INT64_MAX give nullopt).
  std::optional<int64_t> int_at(uint64_t i) const;
  std::optional<double> float_at(uint64_t i) const;  // FLOAT32/FLOAT64 (and integers)
};

struct GgufValue {
  GgufValueType type = GgufValueType::UINT8;
  // UINT*: uint64_t, INT*: int64_t, FLOAT*: double, BOOL: bool, STRING: string, ARRAY: GgufArray.
  std::variant<uint64_t, int64_t, double, bool, std::string, GgufArray> v;

  std::optional<uint64_t> as_u64() const;  // any integer type holding a value >= 0
  std::optional<int64_t> as_i64() const;   // any integer type holding a value that fits
  std::optional<double> as_f64() const;    // float or integer types
  std::optional<bool> as_bool() const;
  const std::string* as_string() const;
  const GgufArray* as_array() const;
};

struct GgufKv {
  std::string key;
  GgufValue value;
  uint64_t offset = 0;  // byte offset of the key in the file
};

inline constexpr uint32_t kGgufMaxDims = 4;

struct GgufTensorInfo {
  std::string name;
  uint32_t n_dims = 0;
  std::array<uint64_t, kGgufMaxDims> ne{1, 1, 1, 1};  // dims past n_dims are 1
  std::array<uint64_t, kGgufMaxDims> nb{0, 0, 0, 0};  // byte strides, as ggml computes them
  GgmlType type = GgmlType::F32;
  uint64_t rel_offset = 0;   // as stored: relative to the data section
  uint64_t offset = 0;       // absolute byte offset in the file
  uint64_t bytes = 0;        // size of the tensor's data
  uint64_t info_offset = 0;  // where its tensor-info record starts, for error messages
};

// Caps that bound the memory a hostile file can make the parser allocate. The defaults hold real
// models (Qwen3 vocabularies of 152k strings, DeepSeek's 1.8k tensors per shard) with room to
// spare.
struct GgufLimits {
  uint64_t max_string_bytes = 16ull << 20;
  uint64_t max_array_elems = 16ull << 20;
  uint64_t max_kv_count = 1ull << 16;
  uint64_t max_tensor_count = 1ull << 20;
  uint64_t max_metadata_bytes = 512ull << 20;  // parsed keys, values and names together
};

class GgufFile {
 public:
  // Parses the metadata of `source`. The source is not kept.
  static Result<GgufFile> parse(const ByteSource& source, const GgufLimits& limits = {});
  static Result<GgufFile> open(const std::string& path, const GgufLimits& limits = {});

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t file_size() const { return file_size_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }  // start of the data section
  const std::vector<GgufKv>& kvs() const { return kvs_; }
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }

  const GgufValue* find(std::string_view key) const;
  const GgufTensorInfo* find_tensor(std::string_view name) const;

 private:
  friend class GgufParser;
  std::string path_;
  uint32_t version_ = 0;
  uint64_t file_size_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::vector<GgufKv> kvs_;
  std::vector<GgufTensorInfo> tensors_;
  std::unordered_map<std::string, size_t> kv_index_;
  std::unordered_map<std::string, size_t> tensor_index_;
};

// The default alignment of the data section and of every tensor when general.alignment is absent.
inline constexpr uint64_t kGgufDefaultAlignment = 32;

struct GgufTensorRef {
  uint32_t shard = 0;
  const GgufTensorInfo* info = nullptr;
};

// A model: one file, or every shard of a split model in shard order. Shard 0 carries the model
// metadata (general.architecture and `<arch>.*`).
class GgufModel {
 public:
  GgufModel() = default;
  GgufModel(GgufModel&&) = default;
  GgufModel& operator=(GgufModel&&) = default;
  GgufModel(const GgufModel&) = delete;  // tensor_index_ points into shards_
  GgufModel& operator=(const GgufModel&) = delete;

  // `path` is a single file or the first shard (NAME-00001-of-0000N.gguf).
  static Result<GgufModel> open(const std::string& path, const GgufLimits& limits = {});
  // A model from already-open files, every shard in order (e.g. the fds expertd passes), with the
  // same checks as open() but the file names'. The model keeps the sources: sources() reads the
  // tensor data through them.
  static Result<GgufModel> from_sources(std::vector<std::unique_ptr<ByteSource>> sources,
                                        const GgufLimits& limits = {});

  const std::vector<GgufFile>& shards() const { return shards_; }
  // The sources from_sources() kept, one per shard; empty for a model open() read by path.
  const std::vector<std::shared_ptr<const ByteSource>>& sources() const { return sources_; }
  const GgufFile& meta() const { return shards_.front(); }
  const std::string& architecture() const { return architecture_; }
  // `<arch>.<suffix>`, e.g. arch_key("expert_count") == "qwen3moe.expert_count".
  std::string arch_key(std::string_view suffix) const;
  const GgufValue* find_arch(std::string_view suffix) const;

  std::optional<GgufTensorRef> find_tensor(std::string_view name) const;
  uint64_t tensor_count() const;

 private:
  // The shards' split keys, tensor index and expert shapes: open() and from_sources() share it.
  Status check_and_index(bool count_key);

  std::vector<GgufFile> shards_;
  std::vector<std::shared_ptr<const ByteSource>> sources_;
  std::string architecture_;
  std::unordered_map<std::string, GgufTensorRef> tensor_index_;
};

// Split-model file name helpers: "NAME-00002-of-00005.gguf".
struct SplitName {
  std::string prefix;  // NAME (directory included)
  uint32_t no = 0;     // 1-based, as in the file name
  uint32_t count = 0;
};
std::optional<SplitName> parse_split_name(const std::string& path);
std::string split_path(const std::string& prefix, uint32_t no_1based, uint32_t count);

}  // namespace expertd
