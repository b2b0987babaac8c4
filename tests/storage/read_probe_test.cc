// The raw read loops of the storage benchmark and the daemon's start-up probe, on a small model
// written by expert-forge: every method reads exactly the bytes it was given, in order, and
// reports a positive rate; the probe answers with one of its candidates. No timing assertions.
#include "storage/read_probe.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "storage/gguf.h"
#include "storage/slice_map.h"
#include "testing/process.h"
#include "testing/temp_dir.h"

namespace expertd {
namespace {

namespace fs = std::filesystem;

using test::TempDir;

// A forged model, its expert slices as ranges (in slice-map order) and an open probe.
class ReadProbeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto forged = test::forge_model(
        dir_.path(), "model",
        "--layers 3 --experts 6 --embd 256 --ff 320 --expert-type q8_0 --alignment 32 --seed 5");
    ASSERT_TRUE(forged) << forged.error().message;
    path_ = *forged;
    auto model = GgufModel::open(path_);
    ASSERT_TRUE(model) << model.error().message;
    auto map = SliceMap::build(*model);
    ASSERT_TRUE(map) << map.error().message;
    std::array<ExpertSlice, 3> s{};
    for (const MoeLayer& l : map->layers()) {
      for (uint32_t e = 0; e < map->expert_count(); ++e) {
        const uint32_t n = map->slices(l.layer, e, s);
        for (uint32_t i = 0; i < n; ++i) ranges_.push_back({s[i].shard, s[i].offset, s[i].bytes});
      }
    }
    ASSERT_EQ(ranges_.size(), 3u * 6u * 3u);
    const std::string paths[] = {path_};
    auto probe = ReadProbe::open(paths);
    if (!probe && probe.error().message.find("O_DIRECT") != std::string::npos) {
      GTEST_SKIP() << probe.error().message;
    }
    ASSERT_TRUE(probe) << probe.error().message;
    probe_ = std::make_unique<ReadProbe>(std::move(*probe));
  }

  uint64_t total_bytes() const {
    uint64_t n = 0;
    for (const ProbeRange& r : ranges_) n += r.bytes;
    return n;
  }
  // Bytes read by widened reads of every range (none of them ends at the end of the file).
  uint64_t widened_bytes() const {
    const uint64_t a = probe_->alignment();
    uint64_t n = 0;
    for (const ProbeRange& r : ranges_)
      n += (r.offset + r.bytes + a - 1) / a * a - r.offset / a * a;
    return n;
  }
  // One pass over the ranges: the byte budget stops new ranges once it is reached.
  ProbeBudget one_pass() const { return ProbeBudget{0.0, total_bytes()}; }

  void expect_one_pass(const ProbeResult& r, bool widened) const {
    EXPECT_EQ(r.ranges, ranges_.size());
    EXPECT_EQ(r.bytes, total_bytes());
    if (widened) {
      EXPECT_EQ(r.bytes_read, widened_bytes());
    }
    EXPECT_EQ(r.next_range, 0u);  // wrapped back to the start
    EXPECT_GT(r.seconds, 0.0);
    EXPECT_GT(r.gbps(), 0.0);
  }

  TempDir dir_;
  std::string path_;
  std::vector<ProbeRange> ranges_;
  std::unique_ptr<ReadProbe> probe_;
};

TEST_F(ReadProbeTest, PreadReadsEveryRangeOnceWidened) {
  auto r = probe_->pread_whole(ranges_, one_pass());
  ASSERT_TRUE(r) << r.error().message;
  expect_one_pass(*r, true);
  EXPECT_GE(r->reads, ranges_.size());
}

TEST_F(ReadProbeTest, UringReadsEveryRangeOnceAtEveryShape) {
  const uint32_t depths[] = {1, 4, 64};
  const uint64_t chunks[] = {4096, 1u << 20, 0};
  for (const uint32_t qd : depths) {
    for (const uint64_t chunk : chunks) {
      SCOPED_TRACE(describe_read_config({qd, chunk}));
      auto r = probe_->uring(ranges_, {qd, chunk}, one_pass());
      ASSERT_TRUE(r) << r.error().message;
      expect_one_pass(*r, true);
      // Chunks of 4 KiB cut every (widened) slice into several reads; whole slices need one each.
      if (chunk == 0) {
        EXPECT_EQ(r->reads, ranges_.size());
      } else if (chunk == 4096) {
        EXPECT_GT(r->reads, 2 * ranges_.size());
      }
    }
  }
}

TEST_F(ReadProbeTest, MmapTouchesEveryPageOfEveryRange) {
  auto r = probe_->mmap_fault(ranges_, one_pass());
  ASSERT_TRUE(r) << r.error().message;
  expect_one_pass(*r, false);
  uint64_t pages = 0;
  for (const ProbeRange& p : ranges_) pages += (p.offset + p.bytes + 4095) / 4096 - p.offset / 4096;
  EXPECT_EQ(r->reads, pages);
  EXPECT_EQ(r->bytes_read, pages * 4096);
}

TEST_F(ReadProbeTest, SequentialReadsTheRegionInBlocks) {
  const uint64_t size = probe_->file(0).size_bytes;
  auto r = probe_->sequential(0, 0, size, {8, 1u << 20}, ProbeBudget{0.0, size});
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(r->bytes, size);
  EXPECT_EQ(r->ranges, (size + (1u << 20) - 1) >> 20);
  EXPECT_GT(r->gbps(), 0.0);
}

// The last bytes of the file: the widened read runs past the end and comes back short, which
// every method must accept.
TEST_F(ReadProbeTest, RangeEndingAtTheEndOfTheFile) {
  // (When the file happens to end on the alignment, the read is simply not short.)
  const uint64_t size = probe_->file(0).size_bytes;
  const ProbeRange tail[] = {{0, size - 1000, 1000}};
  const ProbeBudget budget{0.0, 1000};
  auto p = probe_->pread_whole(tail, budget);
  ASSERT_TRUE(p) << p.error().message;
  EXPECT_EQ(p->bytes, 1000u);
  auto u = probe_->uring(tail, {4, 0}, budget);
  ASSERT_TRUE(u) << u.error().message;
  EXPECT_EQ(u->bytes, 1000u);
  auto m = probe_->mmap_fault(tail, budget);
  ASSERT_TRUE(m) << m.error().message;
  EXPECT_EQ(m->bytes, 1000u);
}

// Interleaved runs continue through the list: two half passes read what one pass reads.
TEST_F(ReadProbeTest, ContinuesWhereTheLastRunStopped) {
  uint64_t half = 0;
  size_t n = 0;
  while (n < ranges_.size() / 2) half += ranges_[n++].bytes;
  auto a = probe_->uring(ranges_, {4, 0}, ProbeBudget{0.0, half});
  ASSERT_TRUE(a) << a.error().message;
  EXPECT_EQ(a->ranges, n);
  EXPECT_EQ(a->next_range, n);
  auto b = probe_->pread_whole(ranges_, ProbeBudget{0.0, total_bytes() - half}, a->next_range);
  ASSERT_TRUE(b) << b.error().message;
  EXPECT_EQ(a->bytes + b->bytes, total_bytes());
  EXPECT_EQ(b->next_range, 0u);
}

// With a destination, ranges land one after another at aligned places: check the bytes there
// against buffered reads of the file, for whole-slice reads and for reads cut in 4 KiB chunks.
TEST_F(ReadProbeTest, DestinationReceivesEveryRangeInPlace) {
  const uint64_t a = probe_->alignment();
  std::vector<uint64_t> place;
  uint64_t end = 0;
  for (const ProbeRange& r : ranges_) {
    place.push_back(end);
    end += (r.offset + r.bytes + a - 1) / a * a - r.offset / a * a;
  }
  const uint64_t region = (end + 4095) / 4096 * 4096;
  void* mem = nullptr;
  ASSERT_EQ(::posix_memalign(&mem, 4096, region), 0);
  std::unique_ptr<uint8_t, decltype(&::free)> buf(static_cast<uint8_t*>(mem), &::free);
  probe_->set_destination(buf.get(), region);
  const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  for (const ReadConfig c : {ReadConfig{1, 0}, ReadConfig{8, 4096}, ReadConfig{0, 0}}) {
    std::memset(buf.get(), 0xee, region);
    auto r = c.queue_depth == 0 ? probe_->pread_whole(ranges_, one_pass())
                                : probe_->uring(ranges_, c, one_pass());
    ASSERT_TRUE(r) << r.error().message;
    expect_one_pass(*r, true);
    for (size_t i = 0; i < ranges_.size(); ++i) {
      const ProbeRange& pr = ranges_[i];
      std::vector<uint8_t> want(pr.bytes);
      ASSERT_EQ(::pread(fd, want.data(), pr.bytes, static_cast<off_t>(pr.offset)),
                static_cast<ssize_t>(pr.bytes));
      const uint8_t* got = buf.get() + place[i] + pr.offset % a;
      ASSERT_EQ(std::memcmp(got, want.data(), pr.bytes), 0)
          << "range " << i << " with " << (c.queue_depth ? describe_read_config(c) : "pread");
    }
  }
  ::close(fd);
  // Too small for the queue depth: refused, with the sizes in the message.
  probe_->set_destination(buf.get(), 4096);
  auto small = probe_->uring(ranges_, {4, 0}, one_pass());
  ASSERT_FALSE(small);
  EXPECT_NE(small.error().message.find("destination"), std::string::npos);
  probe_->set_destination(nullptr, 0);
}

TEST_F(ReadProbeTest, BestConfigIsOneOfTheCandidates) {
  const ReadConfig candidates[] = {{1, 0}, {2, 64u << 10}, {8, 1u << 20}};
  auto c = probe_best_read_config(*probe_, ranges_, ProbeOptions{0.3, 2, 0.02}, candidates);
  ASSERT_TRUE(c) << c.error().message;
  EXPECT_NE(std::find(std::begin(candidates), std::end(candidates), c->config),
            std::end(candidates));
  ASSERT_EQ(c->trials.size(), 3u);
  for (size_t i = 0; i < c->trials.size(); ++i) {
    EXPECT_EQ(c->trials[i].config, candidates[i]);
    EXPECT_GT(c->trials[i].result.bytes, 0u);
  }
  EXPECT_GT(c->gbps, 0.0);

  auto d = probe_best_read_config(*probe_, ranges_, ProbeOptions{0.3, 1, 0.02});
  ASSERT_TRUE(d) << d.error().message;
  const auto defaults = default_read_candidates();
  EXPECT_NE(std::find(defaults.begin(), defaults.end(), d->config), defaults.end());
}

TEST_F(ReadProbeTest, BadInputIsAnError) {
  const ProbeRange outside[] = {{0, probe_->file(0).size_bytes - 10, 20}};
  auto r = probe_->uring(outside, {4, 0}, one_pass());
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("outside the files"), std::string::npos) << r.error().message;
  const ProbeRange bad_file[] = {{1, 0, 10}};
  EXPECT_FALSE(probe_->pread_whole(bad_file, one_pass()));
  EXPECT_FALSE(probe_->mmap_fault({}, one_pass()));
  EXPECT_FALSE(probe_->uring(ranges_, {0, 0}, one_pass()));
  EXPECT_FALSE(probe_->uring(ranges_, {4, 0}, ProbeBudget{0.0, 0}));
  const std::string missing[] = {dir_.path() + "/missing.gguf"};
  auto p = ReadProbe::open(missing);
  ASSERT_FALSE(p);
  EXPECT_NE(p.error().message.find("missing.gguf"), std::string::npos) << p.error().message;
}

}  // namespace
}  // namespace expertd
