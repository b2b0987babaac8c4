// GgufWriter: writes one GGUF v3 file (little-endian), streaming tensor data of any size.
//
// The writer owns the metadata (key/values in insertion order, tensor infos in data order), the
// open temporary file `PATH.tmp` and one staging buffer. A file appears under its final name only
// through commit(), after every byte was written and (by default) fsynced, so a failed or
// interrupted write never leaves a half file under PATH; the destructor removes an uncommitted
// temporary file.
//
// States, asserted on every call:
//   COLLECTING --begin()--> WRITING --finish()--> FINISHED --commit()--> COMMITTED
//   A failed begin/write/finish/commit moves to FAILED: the temporary file is closed and removed.
// Metadata can change only while COLLECTING; tensor data is accepted only while WRITING.
//
// Layout (as ggml's gguf writer): header, key/values, tensor infos, zero padding to the
// alignment, then each tensor's data at its aligned relative offset, each followed by zero
// padding to the alignment (the last one too).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "base/fd.h"
#include "expertd/result.h"
#include "storage/ggml_types.h"
#include "storage/gguf.h"

namespace expertd {

struct GgufWriterOptions {
  bool overwrite = false;  // commit() replaces an existing file at PATH
  bool sync = true;        // fsync the file before the rename and the directory after
  // Write with O_DIRECT where the file system allows it: no copy into the page cache (on a
  // virtio disk here: 1.9 GB/s against 0.3-0.9 GB/s buffered) and the new file is not left
  // cached, so the first read of a fresh model really comes from the disk. Falls back to
  // buffered writes when open(O_DIRECT) is refused.
  bool direct_io = true;
  // Staging buffer (rounded up to 4 KiB). Buffered mode sends spans of half of it or more
  // straight to the file; direct mode copies everything through two of them, as O_DIRECT needs
  // aligned memory, offsets and sizes, and writes one (through io_uring, where available) while
  // the caller fills the other.
  uint64_t buffer_bytes = 8u << 20;
};

class GgufWriter {
 public:
  // `alignment` must be a power of two in [1, 2^30]. The writer owns the key general.alignment:
  // it writes it (u32) exactly when the alignment is not the default 32.
  explicit GgufWriter(uint64_t alignment = kGgufDefaultAlignment);
  ~GgufWriter();
  GgufWriter(GgufWriter&& other) noexcept;
  GgufWriter& operator=(GgufWriter&& other) = delete;
  GgufWriter(const GgufWriter&) = delete;
  GgufWriter& operator=(const GgufWriter&) = delete;

  // --- Metadata (COLLECTING). Setting a key again replaces its value in place.
  void set_u8(std::string_view key, uint8_t v);
  void set_i8(std::string_view key, int8_t v);
  void set_u16(std::string_view key, uint16_t v);
  void set_i16(std::string_view key, int16_t v);
  void set_u32(std::string_view key, uint32_t v);
  void set_i32(std::string_view key, int32_t v);
  void set_u64(std::string_view key, uint64_t v);
  void set_i64(std::string_view key, int64_t v);
  void set_f32(std::string_view key, float v);
  void set_f64(std::string_view key, double v);
  void set_bool(std::string_view key, bool v);
  void set_string(std::string_view key, std::string_view v);

  void set_array(std::string_view key, std::span<const uint8_t> v);
  void set_array(std::string_view key, std::span<const int8_t> v);
  void set_array(std::string_view key, std::span<const uint16_t> v);
  void set_array(std::string_view key, std::span<const int16_t> v);
  void set_array(std::string_view key, std::span<const uint32_t> v);
  void set_array(std::string_view key, std::span<const int32_t> v);
  void set_array(std::string_view key, std::span<const uint64_t> v);
  void set_array(std::string_view key, std::span<const int64_t> v);
  void set_array(std::string_view key, std::span<const float> v);
  void set_array(std::string_view key, std::span<const double> v);
  void set_array(std::string_view key, std::span<const bool> v);
  void set_array(std::string_view key, std::span<const std::string> v);
  void set_array(std::string_view key, std::span<const std::string_view> v);

  // Copies a value read by GgufFile (e.g. to rewrite a model). Errors on a malformed value.
  Status set_value(std::string_view key, const GgufValue& value);

  bool has_key(std::string_view key) const { return kv_index_.count(std::string(key)) != 0; }
  size_t kv_count() const { return kvs_.size(); }

  // Appends a tensor after the previous one. Errors name the tensor: an empty or duplicate name,
  // 0 or more than 4 dims, a zero dimension, ne0 not a multiple of the type's block size, or a
  // size that overflows.
  Status add_tensor(std::string_view name, GgmlType type, std::span<const uint64_t> ne);

  // Tensor infos as the reader will see them: name, n_dims, ne, nb, type, rel_offset and bytes;
  // `offset` (absolute) is 0 until begin() fixes the metadata, then final.
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }

  // --- Layout (any state). Sizes of what begin() will write.
  uint64_t alignment() const { return alignment_; }
  uint64_t metadata_bytes() const;  // header + key/values + tensor infos, unpadded
  uint64_t data_offset() const;     // metadata_bytes() rounded up to the alignment
  uint64_t data_bytes() const { return data_bytes_; }  // every tensor, each padded
  uint64_t file_bytes() const { return data_offset() + data_bytes_; }
  // Header, key/values, tensor infos and the padding up to data_offset().
  std::vector<uint8_t> serialize_metadata() const;

  // --- Writing.
  // COLLECTING -> WRITING: creates PATH.tmp (truncating a stale one), reserves file_bytes() on
  // disk where the file system supports it, writes the metadata. Errors when PATH exists and
  // !options.overwrite, naming PATH.
  Status begin(const std::string& path, const GgufWriterOptions& options = {});
  // The next bytes of tensor data, in tensor order; a span may cross tensor boundaries. The
  // padding between tensors is written by the writer. Errors on more bytes than the tensors hold.
  Status write(std::span<const uint8_t> data);
  // WRITING -> FINISHED: checks that every tensor byte arrived, flushes, fsyncs, closes.
  Status finish();
  // FINISHED -> COMMITTED: renames PATH.tmp to PATH (refusing to replace an existing PATH unless
  // options.overwrite) and fsyncs the directory.
  Status commit();

  const std::string& path() const { return path_; }
  bool direct_io() const { return direct_; }  // after begin(): whether O_DIRECT is in use
  std::string temp_path() const { return path_ + ".tmp"; }
  uint64_t bytes_written() const { return file_pos_; }  // handed to the file, buffered or not

 private:
  enum class State { kCollecting, kWriting, kFinished, kCommitted, kFailed };

  struct Kv {
    std::string key;
    GgufValueType type;
    std::vector<uint8_t> payload;  // the encoded value after the u32 type field
  };

  void put_kv(std::string_view key, GgufValueType type, std::vector<uint8_t> payload);
  template <typename T>
  void put_scalar(std::string_view key, GgufValueType type, T v);
  template <typename T>
  void put_array(std::string_view key, GgufValueType elem, std::span<const T> v);

  Status append(std::span<const uint8_t> data);  // through the staging buffer
  Status append_zeros(uint64_t n);
  Status flush_with(std::span<const uint8_t> tail);  // buffered: one writev of buffer + tail
  Status submit_direct();      // direct: write the full stage behind, switch stages
  Status wait_direct();        // direct: wait for the write behind, if any
  Status flush_direct_tail();  // direct: the last partial block, zero-padded, then ftruncate
  Error io_error(std::string_view what, int err) const;
  Status fail(Error error);  // -> FAILED, closes and removes the temporary file
  void discard();

  uint64_t alignment_;
  State state_ = State::kCollecting;
  std::vector<Kv> kvs_;
  std::unordered_map<std::string, size_t> kv_index_;
  std::vector<GgufTensorInfo> tensors_;
  std::unordered_map<std::string, size_t> tensor_index_;
  uint64_t data_bytes_ = 0;  // running end of the data section (padded)

  // Writing.
  GgufWriterOptions options_;
  std::string path_;
  UniqueFd fd_;  // the temporary file
  bool temp_exists_ = false;
  struct DirectIo;  // O_DIRECT state: the second stage and the io_uring ring
  bool direct_ = false;
  uint64_t buffer_cap_ = 0;
  std::unique_ptr<uint8_t[]> buffer_;  // buffered mode's stage
  std::unique_ptr<DirectIo> dio_;      // direct mode's stages and ring
  uint8_t* stage_ = nullptr;           // the stage being filled
  uint64_t buffered_ = 0;              // bytes in the stage
  uint64_t file_pos_ = 0;              // bytes handed to write(), including buffered ones
  size_t cur_tensor_ = 0;              // tensor receiving data
  uint64_t cur_written_ = 0;           // bytes of it received
};

}  // namespace expertd
