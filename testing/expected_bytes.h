// ExpectedBytes: what a SlotView of a forged model must hold, recomputed from the model file's
// forge seed (forge_expected_bytes), so a test checks every byte the daemon served without a
// second read path. Owns the opened model; read-only after construction (threads may share it).
#pragma once

#include <cstdint>
#include <string>

#include "expertd/client.h"
#include "storage/gguf.h"

namespace expertd::test {

class ExpectedBytes {
 public:
  // A test failure (EXPECT) when `path` is not a forged model.
  explicit ExpectedBytes(const std::string& path);

  // Bytes of the view that differ from the forged content: 0 when exact, UINT64_MAX when the
  // view cannot be checked (no slices, or a slice names no tensor of the model).
  uint64_t wrong_bytes(const client::SlotView& v) const;
  // "" when the view is exact, else which slice differs (or why it cannot be checked).
  std::string difference(const client::SlotView& v) const;
  bool right(const client::SlotView& v) const { return difference(v).empty(); }

 private:
  GgufModel model_;
  uint64_t seed_ = 0;
};

}  // namespace expertd::test
