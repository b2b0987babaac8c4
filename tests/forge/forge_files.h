// What the forge tests share: run the real expert-forge, read a file back, check that every
// tensor of a forged model holds forge_expected_bytes, and that the engine's forward on it is sane.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "forge/content.h"
#include "storage/gguf.h"
#include "testing/paths.h"
#include "testing/process.h"
#include "tests/forge/dequant.h"

namespace expertd::test {

struct ForgeRun {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

// Runs expert-forge with `args` (separated by spaces).
inline ForgeRun run_forge(const std::string& args) {
  std::vector<std::string> argv{bin_path("expert-forge")};
  std::istringstream words(args);
  for (std::string w; words >> w;) argv.push_back(w);
  const RunResult r = run_command(argv);
  return ForgeRun{r.status, r.out + r.err};
}

inline std::vector<uint8_t> read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

// A tensor a loader asks for: name, GGUF type, ne.
struct WantTensor {
  std::string name;
  GgmlType type;
  std::vector<uint64_t> ne;
};

// `model` has exactly the tensors of `want`, each with its type and shape.
inline void expect_tensors(const GgufModel& model, const std::vector<WantTensor>& want) {
  EXPECT_EQ(model.tensor_count(), want.size());
  for (const WantTensor& w : want) {
    SCOPED_TRACE(w.name);
    const auto ref = model.find_tensor(w.name);
    ASSERT_TRUE(ref) << "missing";
    EXPECT_EQ(ggml_type_name(ref->info->type), ggml_type_name(w.type));
    ASSERT_EQ(ref->info->n_dims, w.ne.size());
    for (size_t d = 0; d < w.ne.size(); ++d) EXPECT_EQ(ref->info->ne[d], w.ne[d]) << "ne " << d;
  }
}

// Reads `n` bytes at `offset` of `path` with pread.
inline std::vector<uint8_t> pread_bytes(const std::string& path, uint64_t offset, uint64_t n) {
  std::vector<uint8_t> out(n);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  EXPECT_GE(fd, 0) << path;
  uint64_t done = 0;
  while (fd >= 0 && done < n) {
    const ssize_t r = ::pread(fd, out.data() + done, n - done, static_cast<off_t>(offset + done));
    if (r <= 0) break;
    done += static_cast<uint64_t>(r);
  }
  EXPECT_EQ(done, n) << path << " at " << offset;
  if (fd >= 0) ::close(fd);
  return out;
}

// Every tensor of every shard holds forge_expected_bytes, zero padding follows it, and every
// quantised block has finite positive scales. Returns the number of tensors checked.
inline uint64_t validate_forged_model(const GgufModel& model) {
  auto info = forge_info(model);
  EXPECT_TRUE(info) << info.error().message;
  if (!info) return 0;
  uint64_t checked = 0;
  for (const GgufFile& shard : model.shards()) {
    EXPECT_EQ(shard.file_size() % shard.alignment(), 0u) << shard.path();
    for (const GgufTensorInfo& t : shard.tensors()) {
      SCOPED_TRACE(shard.path() + ": " + t.name);
      EXPECT_EQ(t.offset % shard.alignment(), 0u);
      const uint64_t padded =
          (t.bytes + shard.alignment() - 1) / shard.alignment() * shard.alignment();
      const auto got =
          pread_bytes(shard.path(), t.offset, std::min(padded, shard.file_size() - t.offset));
      std::vector<uint8_t> want(t.bytes);
      auto st = forge_expected_bytes(info->seed, t, 0, want, info->expert_count);
      EXPECT_TRUE(st) << st.error().message;
      EXPECT_TRUE(std::equal(want.begin(), want.end(), got.begin())) << "tensor bytes differ";
      EXPECT_TRUE(std::all_of(got.begin() + static_cast<ptrdiff_t>(t.bytes), got.end(),
                              [](uint8_t b) { return b == 0; }))
          << "padding is not zero";
      auto sc = check_scales(t.type, want);
      EXPECT_TRUE(sc) << sc.error().message;
      ++checked;
    }
  }
  return checked;
}

// Decodes `n` tokens spread over the vocabulary: every step's logits are finite, of moderate size
// (rms in (1e-3, 100)) and differ from the step before. Returns the routing of every (token,
// layer).
inline std::vector<engine::RoutingRecord> expect_sane_forward(engine::Engine& eng, uint32_t vocab,
                                                              uint32_t n) {
  std::vector<engine::RoutingRecord> routing;
  eng.set_routing_log(&routing);
  std::vector<float> logits(vocab), previous;
  for (uint32_t t = 0; t < n; ++t) {
    const Status st = eng.decode((t * 37 + 11) % vocab, logits);
    EXPECT_TRUE(st) << "position " << t << ": " << st.error().message;
    if (!st) break;
    double sq = 0;
    for (const float x : logits) sq += double{x} * x;
    const double rms = std::sqrt(sq / static_cast<double>(logits.size()));
    EXPECT_TRUE(std::isfinite(rms)) << "position " << t;
    EXPECT_GT(rms, 1e-3) << "position " << t;
    EXPECT_LT(rms, 100.0) << "position " << t;
    EXPECT_NE(logits, previous) << "position " << t;
    previous = logits;
  }
  eng.set_routing_log(nullptr);
  return routing;
}

// The distinct experts of a routing log.
inline std::set<uint32_t> experts_used(const std::vector<engine::RoutingRecord>& routing) {
  std::set<uint32_t> used;
  for (const auto& r : routing) used.insert(r.experts.begin(), r.experts.end());
  return used;
}

}  // namespace expertd::test
