// Test-only GGUF byte builder. It writes every field by hand, so a test can write values a real
// writer never would (a wrong count, a bad type id, a truncated string), and it remembers the byte
// offset of every field it writes so a test can assert the "at byte N" of an error message.
//
// ByteWriter is the raw layer: little-endian scalars, GGUF strings, named marks, patches.
// GgufBuilder lays out a whole file (header, key/values, tensor infos, aligned data) from a list of
// key/values and tensors; the result is valid unless the test asks otherwise, and a test breaks it
// by patching a marked field. Mark names:
//   magic, version, n_tensors, n_kv
//   kv[i] (the key's length), kv[i].type, kv[i].value; arrays add kv[i].elem_type, kv[i].count
//   key:NAME (same offset as kv[i] for key NAME), value:NAME (same as kv[i].value)
//   ti[i] (the tensor name's length), ti[i].n_dims, ti[i].ne[d], ti[i].type, ti[i].offset
//   data (the data section), data:NAME (tensor NAME's first byte)
#pragma once

#include <stdlib.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "storage/ggml_types.h"
#include "storage/gguf.h"
#include "testing/temp_dir.h"  // TempDir, for the tests that write these images

namespace expertd::test {

class ByteWriter {
 public:
  template <typename T>
  ByteWriter& le(T v) {
    const size_t at = bytes_.size();
    bytes_.resize(at + sizeof(T));
    std::memcpy(bytes_.data() + at, &v, sizeof(T));  // hosts are little-endian (gguf.cc asserts)
    return *this;
  }
  ByteWriter& u8(uint8_t v) { return le(v); }
  ByteWriter& u32(uint32_t v) { return le(v); }
  ByteWriter& u64(uint64_t v) { return le(v); }
  ByteWriter& raw(std::string_view s) {
    bytes_.insert(bytes_.end(), s.begin(), s.end());
    return *this;
  }
  ByteWriter& raw(std::span<const uint8_t> s) {
    bytes_.insert(bytes_.end(), s.begin(), s.end());
    return *this;
  }
  // A GGUF string: u64 length, then the bytes (no terminator).
  ByteWriter& str(std::string_view s) { return u64(s.size()).raw(s); }
  ByteWriter& pad_to(uint64_t alignment) {
    while (bytes_.size() % alignment != 0) bytes_.push_back(0);
    return *this;
  }

  // Names the current position.
  ByteWriter& mark(const std::string& field) {
    marks_[field] = bytes_.size();
    return *this;
  }

  uint64_t size() const { return bytes_.size(); }
  std::vector<uint8_t>& bytes() { return bytes_; }
  std::map<std::string, uint64_t>& marks() { return marks_; }

 private:
  std::vector<uint8_t> bytes_;
  std::map<std::string, uint64_t> marks_;
};

// A laid-out file: its bytes and where each named field starts.
struct GgufImage {
  std::vector<uint8_t> bytes;
  std::map<std::string, uint64_t> marks;
  uint64_t data_offset = 0;

  uint64_t at(const std::string& field) const {
    const auto it = marks.find(field);
    if (it == marks.end()) throw std::out_of_range("no mark named " + field);
    return it->second;
  }
  // Overwrites the bytes at `offset` with v (little-endian).
  template <typename T>
  GgufImage& put(uint64_t offset, T v) {
    if (offset + sizeof(T) > bytes.size()) throw std::out_of_range("patch past the end");
    std::memcpy(bytes.data() + offset, &v, sizeof(T));
    return *this;
  }
  template <typename T>
  GgufImage& put(const std::string& field, T v) {
    return put(at(field), v);
  }
  GgufImage& truncate(uint64_t size) {
    bytes.resize(size);
    return *this;
  }
  std::span<const uint8_t> span() const { return bytes; }
  void write(const std::string& path) const {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
    if (!out) throw std::runtime_error("cannot write " + path);
  }
};

// Byte j of tensor number i's data: distinct per tensor so a test can check it reads the right one.
inline uint8_t tensor_fill_byte(size_t i, uint64_t j) {
  return static_cast<uint8_t>(i * 37 + j * 7 + 1);
}

// The bytes a tensor of `type` and shape `ne` holds; 32 for a type id with no valid size (unknown
// or removed), so such a tensor still gets a data range; UINT64_MAX when the size overflows.
inline uint64_t tensor_bytes(uint32_t type, const std::vector<uint64_t>& ne) {
  const auto traits = ggml_type_traits(type);
  if (!traits || traits->removed || ne.empty()) return 32;
  uint64_t elems = 1;
  for (uint64_t n : ne) {
    if (__builtin_mul_overflow(elems, n, &elems)) return UINT64_MAX;
  }
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(elems / traits->block_elems, traits->block_bytes, &bytes)) {
    return UINT64_MAX;
  }
  return bytes;
}

inline uint64_t saturating_add(uint64_t a, uint64_t b) {
  uint64_t sum = 0;
  return __builtin_add_overflow(a, b, &sum) ? UINT64_MAX : sum;
}

class GgufBuilder {
 public:
  explicit GgufBuilder(uint32_t version = 3) : version_(version) {}

  // Scalars, one per GGUF value type.
  GgufBuilder& kv_u8(std::string key, uint8_t v) { return scalar(std::move(key), 0, v); }
  GgufBuilder& kv_i8(std::string key, int8_t v) { return scalar(std::move(key), 1, v); }
  GgufBuilder& kv_u16(std::string key, uint16_t v) { return scalar(std::move(key), 2, v); }
  GgufBuilder& kv_i16(std::string key, int16_t v) { return scalar(std::move(key), 3, v); }
  GgufBuilder& kv_u32(std::string key, uint32_t v) { return scalar(std::move(key), 4, v); }
  GgufBuilder& kv_i32(std::string key, int32_t v) { return scalar(std::move(key), 5, v); }
  GgufBuilder& kv_f32(std::string key, float v) { return scalar(std::move(key), 6, v); }
  GgufBuilder& kv_bool(std::string key, bool v) {
    return scalar(std::move(key), 7, static_cast<uint8_t>(v ? 1 : 0));
  }
  GgufBuilder& kv_str(std::string key, std::string v) {
    return kv_raw(std::move(key), 8, [v = std::move(v)](ByteWriter& w, const std::string& f) {
      w.mark(f + ".value").str(v);
    });
  }
  GgufBuilder& kv_u64(std::string key, uint64_t v) { return scalar(std::move(key), 10, v); }
  GgufBuilder& kv_i64(std::string key, int64_t v) { return scalar(std::move(key), 11, v); }
  GgufBuilder& kv_f64(std::string key, double v) { return scalar(std::move(key), 12, v); }

  // An array of fixed-size elements; T must have the element type's size (uint8_t for BOOL).
  template <typename T>
  GgufBuilder& kv_array(std::string key, GgufValueType elem, std::vector<T> values) {
    return kv_raw(std::move(key), 9,
                  [elem, values = std::move(values)](ByteWriter& w, const std::string& f) {
                    w.mark(f + ".value").mark(f + ".elem_type").u32(static_cast<uint32_t>(elem));
                    w.mark(f + ".count").u64(values.size());
                    for (const T& v : values) w.le(v);
                  });
  }
  GgufBuilder& kv_str_array(std::string key, std::vector<std::string> values) {
    return kv_raw(std::move(key), 9,
                  [values = std::move(values)](ByteWriter& w, const std::string& f) {
                    w.mark(f + ".value").mark(f + ".elem_type").u32(8);
                    w.mark(f + ".count").u64(values.size());
                    for (const auto& v : values) w.str(v);
                  });
  }

  // A key/value with any type id (valid or not) and a payload the test writes itself.
  GgufBuilder& kv_raw(std::string key, uint32_t type,
                      std::function<void(ByteWriter&, const std::string& field)> payload) {
    kvs_.push_back(Kv{std::move(key), type, std::move(payload)});
    return *this;
  }

  // A tensor whose data the builder places at the next aligned offset (or at `rel_offset`).
  GgufBuilder& tensor(std::string name, std::vector<uint64_t> ne, GgmlType type,
                      std::optional<uint64_t> rel_offset = std::nullopt) {
    return tensor_raw(std::move(name), std::move(ne), static_cast<uint32_t>(type), rel_offset);
  }
  GgufBuilder& tensor_raw(std::string name, std::vector<uint64_t> ne, uint32_t type,
                          std::optional<uint64_t> rel_offset = std::nullopt) {
    tensors_.push_back(Tensor{std::move(name), std::move(ne), type, rel_offset});
    return *this;
  }

  // Adds general.alignment (uint32) and lays the data out with it.
  GgufBuilder& alignment(uint32_t a) {
    layout_alignment_ = a;
    return kv_u32("general.alignment", a);
  }
  // Lays the data out with `a` without writing any key.
  GgufBuilder& layout_alignment(uint64_t a) {
    layout_alignment_ = a;
    return *this;
  }
  // ggml pads after the last tensor too; without it the file ends at the last tensor's last byte.
  GgufBuilder& trailing_padding(bool on) {
    trailing_padding_ = on;
    return *this;
  }

  GgufImage build() const {
    ByteWriter w;
    w.mark("magic").raw("GGUF");
    w.mark("version").u32(version_);
    w.mark("n_tensors").u64(tensors_.size());
    w.mark("n_kv").u64(kvs_.size());
    for (size_t i = 0; i < kvs_.size(); ++i) {
      const std::string f = "kv[" + std::to_string(i) + "]";
      w.mark(f).mark("key:" + kvs_[i].key).str(kvs_[i].key);
      w.mark(f + ".type").u32(kvs_[i].type);
      kvs_[i].payload(w, f);
      const auto value = w.marks().find(f + ".value");
      if (value != w.marks().end()) w.marks()["value:" + kvs_[i].key] = value->second;
    }
    // Data layout first: tensor infos carry the offsets.
    std::vector<uint64_t> rel(tensors_.size());
    std::vector<uint64_t> size(tensors_.size());
    uint64_t next = 0;
    for (size_t i = 0; i < tensors_.size(); ++i) {
      size[i] = tensor_bytes(tensors_[i].type, tensors_[i].ne);
      next = (next + layout_alignment_ - 1) / layout_alignment_ * layout_alignment_;
      rel[i] = tensors_[i].rel_offset.value_or(next);
      next = std::max(next, saturating_add(rel[i], size[i]));
    }
    for (size_t i = 0; i < tensors_.size(); ++i) {
      const Tensor& t = tensors_[i];
      const std::string f = "ti[" + std::to_string(i) + "]";
      w.mark(f).mark("tensor:" + t.name).str(t.name);
      w.mark(f + ".n_dims").u32(static_cast<uint32_t>(t.ne.size()));
      for (size_t d = 0; d < t.ne.size(); ++d) {
        w.mark(f + ".ne[" + std::to_string(d) + "]").u64(t.ne[d]);
      }
      w.mark(f + ".type").u32(t.type);
      w.mark(f + ".offset").u64(rel[i]);
    }
    w.pad_to(layout_alignment_);
    GgufImage image;
    image.data_offset = w.size();
    w.mark("data");
    // Shapes a test made absurd on purpose get no data at all: the file ends after the infos.
    constexpr uint64_t kMaxDataBytes = 64ull << 20;
    uint64_t end = 0;
    for (size_t i = 0; i < tensors_.size(); ++i) {
      end = std::max(end, saturating_add(rel[i], size[i]));
    }
    if (end <= kMaxDataBytes) {
      std::vector<uint8_t> data(end, 0);
      for (size_t i = 0; i < tensors_.size(); ++i) {
        w.marks()["data:" + tensors_[i].name] = image.data_offset + rel[i];
        for (uint64_t j = 0; j < size[i]; ++j) data[rel[i] + j] = tensor_fill_byte(i, j);
      }
      w.raw(data);
    }
    if (trailing_padding_) w.pad_to(layout_alignment_);
    image.bytes = std::move(w.bytes());
    image.marks = std::move(w.marks());
    return image;
  }

 private:
  struct Kv {
    std::string key;
    uint32_t type;
    std::function<void(ByteWriter&, const std::string&)> payload;
  };
  struct Tensor {
    std::string name;
    std::vector<uint64_t> ne;
    uint32_t type;
    std::optional<uint64_t> rel_offset;
  };

  template <typename T>
  GgufBuilder& scalar(std::string key, uint32_t type, T v) {
    return kv_raw(std::move(key), type,
                  [v](ByteWriter& w, const std::string& f) { w.mark(f + ".value").le(v); });
  }

  uint32_t version_;
  uint64_t layout_alignment_ = kGgufDefaultAlignment;
  bool trailing_padding_ = true;
  std::vector<Kv> kvs_;
  std::vector<Tensor> tensors_;
};

// An n-shard split model, shard i (0-based) holding tensors "t{i}.a" (f32 [8]) and "t{i}.b"
// (q8_0 [32]); shard 0 carries general.architecture and split.tensors.count. Write shard i to
// split_path(prefix, i + 1, n).
inline std::vector<GgufImage> split_model(uint32_t n) {
  std::vector<GgufImage> shards;
  for (uint32_t i = 0; i < n; ++i) {
    GgufBuilder b;
    if (i == 0) b.kv_str("general.architecture", "llama").kv_u32("llama.block_count", 2);
    b.kv_u16("split.no", static_cast<uint16_t>(i)).kv_u16("split.count", static_cast<uint16_t>(n));
    if (i == 0) b.kv_i32("split.tensors.count", static_cast<int32_t>(2 * n));
    b.tensor("t" + std::to_string(i) + ".a", {8}, GgmlType::F32)
        .tensor("t" + std::to_string(i) + ".b", {32}, GgmlType::Q8_0);
    shards.push_back(b.build());
  }
  return shards;
}

}  // namespace expertd::test
