// Malformed-file tests: a copy of a committed fixture GGUF with one thing changed (a tensor left
// out or reshaped, a key replaced or added), and the message DenseModel::load gives for it.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "engine/model.h"
#include "storage/gguf.h"
#include "storage/gguf_writer.h"

namespace expertd::engine::test {

struct Edit {
  std::string drop_tensor;                   // leave this tensor out
  std::string key;                           // replace this key's value (a set_key that
                                             // writes nothing drops the key) ...
  std::function<void(GgufWriter&)> set_key;  // ... with this
  std::string reshape_tensor;                // write this tensor with ne ...
  std::vector<uint64_t> new_ne;              // ... (its bytes truncated or zero-padded)
  std::string rename_to;                     // and, if set, under this name
  std::string arch_to;  // general.architecture and every ARCH.* key's prefix become this
};

inline std::string rewrite(const std::string& src, const std::string& dst, const Edit& edit) {
  auto file = GgufFile::open(src);
  EXPECT_TRUE(file) << file.error().message;
  GgufWriter w(file->alignment());
  const GgufValue* arch_value = file->find("general.architecture");
  const std::string* arch_name = arch_value != nullptr ? arch_value->as_string() : nullptr;
  const std::string arch = arch_name != nullptr ? *arch_name : "";
  for (const GgufKv& kv : file->kvs()) {
    if (kv.key == edit.key) {
      edit.set_key(w);
    } else if (!edit.arch_to.empty() && kv.key == "general.architecture") {
      w.set_string("general.architecture", edit.arch_to);
    } else if (!edit.arch_to.empty() && kv.key.rfind(arch + ".", 0) == 0) {
      EXPECT_TRUE(w.set_value(edit.arch_to + kv.key.substr(arch.size()), kv.value));
    } else if (kv.key != "general.alignment") {
      EXPECT_TRUE(w.set_value(kv.key, kv.value));
    }
  }
  if (!edit.key.empty() && !w.has_key(edit.key)) edit.set_key(w);
  std::vector<const GgufTensorInfo*> kept;
  std::vector<uint64_t> sizes;
  for (const GgufTensorInfo& t : file->tensors()) {
    if (t.name == edit.drop_tensor) continue;
    std::vector<uint64_t> ne(t.ne.begin(), t.ne.begin() + t.n_dims);
    std::string name = t.name;
    if (t.name == edit.reshape_tensor) {
      ne = edit.new_ne;
      if (!edit.rename_to.empty()) name = edit.rename_to;
    }
    EXPECT_TRUE(w.add_tensor(name, t.type, ne)) << name;
    kept.push_back(&t);
    sizes.push_back(w.tensors().back().bytes);
  }
  EXPECT_TRUE(
      w.begin(dst, GgufWriterOptions{.overwrite = true, .sync = false, .direct_io = false}));
  std::ifstream in(src, std::ios::binary);
  for (size_t i = 0; i < kept.size(); ++i) {
    std::vector<uint8_t> bytes(sizes[i], 0);
    in.seekg(static_cast<std::streamoff>(kept[i]->offset));
    in.read(reinterpret_cast<char*>(bytes.data()),
            static_cast<std::streamsize>(std::min(sizes[i], kept[i]->bytes)));
    EXPECT_TRUE(w.write(bytes));
  }
  EXPECT_TRUE(w.finish());
  EXPECT_TRUE(w.commit());
  return dst;
}

inline std::string load_error(const std::string& path) {
  auto model = DenseModel::load(path);
  if (model) return "(loaded)";
  return model.error().message;
}

}  // namespace expertd::engine::test
