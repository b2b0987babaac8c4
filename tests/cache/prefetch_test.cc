// The scheduler's prefetch telemetry by depth (docs/CACHE.md, "Prefetch telemetry"), driven with
// known sequences of cursors, hints and acquires over a real forged model and real reads: which
// depth each hint counts at, which loads it starts, and how each load ends (useful, wasted by
// eviction, by cancellation or by its session going away); recall from the acquires; the runtime
// cache limit and evict_all.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <string>

#include "cache/store.h"
#include "tests/cache/store_harness.h"

namespace expertd {
namespace {

using test::forge;
using test::Harness;
using test::small_cache;
using test::TempDir;

// Bucket of depth d (1..8; 8 and more share the last).
const PrefetchDepthStats& at(const Scheduler& s, uint32_t depth) {
  return s.depths()[std::min(depth, kPrefetchDepthBuckets) - 1];
}

class PrefetchTelemetry : public ::testing::TestWithParam<BackendKind> {
 protected:
  void SetUp() override {
    model_ = forge(dir_.path(), "--layers 8 --experts 8 --embd 256 --ff 512 --seed 11");
  }
  // The bytes one prefetch load of `key` reads (every slice widened to the DIO alignment).
  static uint64_t read_bytes(Harness& h, ExpertKey key) {
    std::array<ExpertSlice, 3> slices{};
    std::array<SlicePlacement, 3> place{};
    const uint32_t n = h.store->layouts().place(key.layer, key.expert, slices, place);
    uint64_t bytes = 0;
    for (uint32_t i = 0; i < n; ++i) bytes += place[i].read_bytes;
    return bytes;
  }
  void release(Harness& h, const Completion& c) {
    ASSERT_GE(c.slot, 0);
    ASSERT_EQ(h.sched().release(c.session, static_cast<uint32_t>(c.slot)), 0);
  }

  TempDir dir_;
  std::string model_;
};

TEST_P(PrefetchTelemetry, DepthsUsefulWastedAndRecallFollowTheHints) {
  StoreOptions o = small_cache(64ull << 20);
  o.scheduler.prefetch_depth = 4;
  Harness h(model_, GetParam(), o);
  const uint64_t bytes = read_bytes(h, {1, 0});

  h.sched().set_cursor(0, 0, 0);
  ASSERT_EQ(h.sched().prefetch(0, {1, 0}, 0.9f), 0);  // depth 1
  ASSERT_EQ(h.sched().prefetch(0, {2, 1}, 0.9f), 0);  // depth 2
  ASSERT_EQ(h.sched().prefetch(0, {3, 2}, 0.9f), 0);  // depth 3
  // The cursor's own layer is the next token's: 8 layers ahead, beyond the prefetch depth.
  ASSERT_EQ(h.sched().prefetch(0, {0, 3}, 0.9f), 0);
  ASSERT_TRUE(h.drain());
  {
    const Scheduler& s = h.sched();
    for (uint32_t d = 1; d <= 3; ++d) {
      EXPECT_EQ(at(s, d).hints, 1u) << "depth " << d;
      EXPECT_EQ(at(s, d).loads, 1u) << "depth " << d;
    }
    EXPECT_EQ(at(s, 8).hints, 1u);
    EXPECT_EQ(at(s, 8).loads, 0u) << "queued: 8 layers is beyond prefetch depth 4";
    EXPECT_EQ(at(s, 4).hints, 0u);
  }

  // Layer 1: the hinted expert is READY (useful at depth 1, and recalled at depth 1); the other is
  // a miss nobody hinted.
  h.sched().set_cursor(0, 0, 1);
  release(h, h.get({1, 0}));
  release(h, h.get({1, 5}));
  // Layer 2: useful at depth 2. A second hint for it at depth 1 counts as a hint, not a load.
  ASSERT_EQ(h.sched().prefetch(0, {2, 1}, 0.9f), 0);
  h.sched().set_cursor(0, 0, 2);
  release(h, h.get({2, 1}));
  // Layer 3's prefetched expert is evicted before anyone wants it: wasted at depth 3.
  ASSERT_TRUE(h.store->cache().evict({3, 2}));
  {
    const Scheduler& s = h.sched();
    EXPECT_EQ(s.stats().acquires, 3u);
    EXPECT_EQ(at(s, 1).useful, 1u);
    EXPECT_EQ(at(s, 1).useful_bytes, bytes);
    EXPECT_EQ(at(s, 1).hints, 2u);
    EXPECT_EQ(at(s, 1).loads, 1u);
    EXPECT_EQ(at(s, 1).hinted_acquires, 2u) << "(1, 0) at depth 1, (2, 1) again at depth 1";
    EXPECT_EQ(at(s, 2).useful, 1u);
    EXPECT_EQ(at(s, 2).hinted_acquires, 1u);
    EXPECT_EQ(at(s, 3).useful, 0u);
    EXPECT_EQ(at(s, 3).wasted, 1u);
    EXPECT_EQ(at(s, 3).wasted_bytes, read_bytes(h, {3, 2}));
    EXPECT_EQ(s.stats().prefetch_useful, 2u);
  }

  // The next token reaches layer 0: the depth-8 hint for it starts, lands, and is used there.
  h.sched().set_cursor(0, 1, 0);
  ASSERT_TRUE(h.drain());
  release(h, h.get({0, 3}));
  EXPECT_EQ(at(h.sched(), 8).loads, 1u);
  EXPECT_EQ(at(h.sched(), 8).useful, 1u);
  EXPECT_EQ(at(h.sched(), 8).hinted_acquires, 1u);

  // A hint recalls only the token it was for: hinted for token 1's layer 4, acquired at token 2's.
  ASSERT_EQ(h.sched().prefetch(0, {4, 6}, 0.9f), 0);  // depth 4, token 1
  ASSERT_TRUE(h.drain());
  h.sched().set_cursor(0, 2, 4);
  release(h, h.get({4, 6}));
  EXPECT_EQ(at(h.sched(), 4).hinted_acquires, 0u) << "hinted for token 1, used at 2";
  EXPECT_EQ(at(h.sched(), 4).useful, 1u) << "the read still served an acquire";

  // A load the cursor passes while it reads is cancelled: wasted, with the bytes it read.
  ASSERT_EQ(h.sched().prefetch(0, {5, 7}, 0.9f), 0);  // depth 1
  h.sched().pump();
  h.sched().set_cursor(0, 2, 6);
  ASSERT_TRUE(h.drain());
  EXPECT_EQ(h.sched().stats().prefetch_cancelled, 1u);
  EXPECT_EQ(at(h.sched(), 1).wasted, 1u);
  EXPECT_LE(at(h.sched(), 1).wasted_bytes, read_bytes(h, {5, 7}));

  // One session: its own counters are the model's.
  const PrefetchDepths& mine = h.sched().session_depths(0);
  for (uint32_t b = 0; b < kPrefetchDepthBuckets; ++b) {
    const PrefetchDepthStats& m = h.sched().depths()[b];
    EXPECT_EQ(mine[b].hints, m.hints) << "bucket " << b;
    EXPECT_EQ(mine[b].loads, m.loads) << "bucket " << b;
    EXPECT_EQ(mine[b].useful, m.useful) << "bucket " << b;
    EXPECT_EQ(mine[b].wasted, m.wasted) << "bucket " << b;
    EXPECT_EQ(mine[b].useful_bytes, m.useful_bytes) << "bucket " << b;
    EXPECT_EQ(mine[b].wasted_bytes, m.wasted_bytes) << "bucket " << b;
    EXPECT_EQ(mine[b].hinted_acquires, m.hinted_acquires) << "bucket " << b;
  }
}

TEST_P(PrefetchTelemetry, AGoneSessionsPrefetchesAreWastedAndItsCountersReset) {
  StoreOptions o = small_cache(64ull << 20);
  o.scheduler.prefetch_depth = 2;
  Harness h(model_, GetParam(), o);
  h.sched().set_cursor(3, 0, 0);
  ASSERT_EQ(h.sched().prefetch(3, {1, 1}, 0.9f), 0);
  ASSERT_TRUE(h.drain());  // READY, never acquired
  ASSERT_EQ(h.sched().prefetch(3, {2, 2}, 0.9f), 0);
  h.sched().pump();  // reading
  h.sched().drop_session(3);
  ASSERT_TRUE(h.drain());
  const Scheduler& s = h.sched();
  EXPECT_EQ(at(s, 2).wasted, 1u) << "its load in flight was cancelled";
  EXPECT_EQ(h.sched().session_depths(3)[0].hints, 0u) << "the id may be reused: counters reset";
  EXPECT_EQ(h.sched().session_depths(3)[1].wasted, 0u);
  // Its READY prefetch stays cached; when it goes, the model counts it wasted.
  EXPECT_EQ(h.store->evict_all(), 1u);
  EXPECT_EQ(at(s, 1).wasted, 1u);
  EXPECT_EQ(h.sched().session_depths(3)[0].wasted, 0u);
  // The hints of a gone session recall nothing.
  h.sched().set_cursor(0, 0, 1);
  const Completion c = h.get({1, 1});
  EXPECT_EQ(at(s, 1).hinted_acquires, 0u);
  ASSERT_GE(c.slot, 0);
}

TEST_P(PrefetchTelemetry, StagingRecyclingAnUnusedPrefetchIsWaste) {
  StoreOptions o = small_cache(0);
  o.staging_slots = 2;
  o.scheduler.prefetch_depth = 2;
  Harness h(model_, GetParam(), o);
  h.sched().set_cursor(0, 0, 0);
  for (uint32_t e = 0; e < 3; ++e) ASSERT_EQ(h.sched().prefetch(0, {1, e}, 0.9f), 0);
  ASSERT_TRUE(h.drain());
  const Scheduler& s = h.sched();
  EXPECT_EQ(at(s, 1).loads, 3u);
  EXPECT_EQ(at(s, 1).wasted, 1u) << "two staging slots: the third load pushed one out";
  EXPECT_EQ(at(s, 1).wasted_bytes, read_bytes(h, {1, 0}));
  EXPECT_EQ(s.stats().evictions, 1u);
}

TEST_P(PrefetchTelemetry, CacheLimitAndEvictAll) {
  Harness probe(model_, GetParam(), small_cache(0));
  const uint64_t slot = probe.store->layouts().slot_bytes();
  StoreOptions o = small_cache(16 * slot);
  o.staging_slots = 2;
  Harness h(model_, GetParam(), o);
  ASSERT_EQ(h.store->cache().slot_count(), 16u);
  for (uint32_t e = 0; e < 8; ++e) release(h, h.get({0, e}));
  EXPECT_EQ(h.store->cache().ready_count(), 8u);

  EXPECT_EQ(h.store->cache().set_limit(4), 4u);
  EXPECT_EQ(h.store->cache().ready_count(), 4u);
  EXPECT_EQ(h.sched().stats().evictions, 4u);
  // Acquiring 8 more experts one at a time never takes more than 4 cache slots.
  for (uint32_t e = 0; e < 8; ++e) {
    release(h, h.get({1, e}));
    EXPECT_LE(h.store->cache().ready_count() + h.store->cache().loading_count(), 4u);
  }
  EXPECT_EQ(h.store->cache().set_limit(0), 0u);
  EXPECT_EQ(h.store->cache().limit(), 16u);

  // evict_all: nothing cached or staged is left but what a client holds.
  const Completion held = h.get({2, 0});
  ASSERT_GE(held.slot, 0);
  EXPECT_GT(h.store->evict_all(), 0u);
  EXPECT_EQ(h.store->cache().ready_count() + h.store->staging().ready_count(), 1u);
  EXPECT_TRUE(h.store->cache().lookup({2, 0}) >= 0 || h.store->staging().lookup({2, 0}) >= 0)
      << "the held expert stays";
  release(h, held);
  // The cache still works afterwards, with the policy's history gone.
  release(h, h.get({3, 3}));
  EXPECT_GE(h.store->cache().lookup({3, 3}), 0);
}

// Exact hints (a prefill's routing: the engine will acquire them) are read on a fresh daemon,
// whose automatic depth is 0 until predicted hints earn it; one for the cursor's own layer is for
// this token, not the next. They count apart (exact_*), never as evidence for a depth, and a
// fixed depth of 0 (prefetch off) reads none.
TEST_P(PrefetchTelemetry, ExactHintsAreReadAtAnyDepthAndAreNoEvidence) {
  Harness h(model_, GetParam(), small_cache(64ull << 20));  // the default: automatic depth
  ASSERT_TRUE(h.sched().prefetch_depth_auto());
  ASSERT_EQ(h.sched().prefetch_depth_now(), 0u) << "a fresh scheduler has no evidence";
  const Scheduler& s = h.sched();

  // The cursor's own layer and layers 1 and 6 ahead, exactly; the next layer predicted.
  h.sched().set_cursor(0, 0, 2);
  ASSERT_EQ(h.sched().prefetch(0, {2, 0}, 1.0f, true), 0);
  ASSERT_EQ(h.sched().prefetch(0, {3, 1}, 1.0f, true), 0);
  ASSERT_EQ(h.sched().prefetch(0, {8 - 1, 2}, 1.0f, true), 0);
  ASSERT_EQ(h.sched().prefetch(0, {3, 3}, 0.9f), 0);
  ASSERT_TRUE(h.drain());
  EXPECT_EQ(s.stats().exact_hints, 3u);
  EXPECT_EQ(s.stats().exact_loads, 3u) << "read at automatic depth 0";
  EXPECT_EQ(s.stats().prefetch_loads, 3u) << "the predicted hint waits for evidence";
  for (uint32_t d = 1; d <= kPrefetchDepthBuckets; ++d) {
    EXPECT_EQ(at(s, d).loads, 0u) << "depth " << d;
    EXPECT_EQ(at(s, d).hints, d == 1 ? 1u : 0u) << "depth " << d << ": only the predicted hint";
  }
  release(h, h.get({2, 0}));  // this token's: READY, not cancelled as a passed one
  h.sched().set_cursor(0, 0, 3);
  release(h, h.get({3, 1}));
  h.sched().set_cursor(0, 0, 7);
  release(h, h.get({7, 2}));
  EXPECT_EQ(s.stats().misses, 0u);
  EXPECT_EQ(s.stats().prefetch_useful, 3u);
  EXPECT_EQ(s.stats().exact_wasted, 0u);
  for (uint32_t d = 1; d <= kPrefetchDepthBuckets; ++d) EXPECT_EQ(at(s, d).useful, 0u);

  // Many exact hints, each acquired where it said: still no evidence, the depth stays 0. The same
  // pattern of predicted hints lifts it (the estimate works; exact hints are kept out of it).
  auto run = [&](uint32_t token0, bool exact) {
    for (uint32_t t = token0; t < token0 + 6; ++t) {
      for (uint32_t l = 0; l + 1 < 8; ++l) {
        const ExpertKey key{l + 1, t % 8};
        h.sched().set_cursor(0, t, l);
        ASSERT_EQ(h.sched().prefetch(0, key, exact ? 1.0f : 0.9f, exact), 0);
        ASSERT_TRUE(h.drain());
        h.sched().set_cursor(0, t, l + 1);
        release(h, h.get(key));
        ASSERT_TRUE(h.store->cache().evict(key));  // absent again: the next hint needs a read
      }
    }
    h.sched().set_cursor(0, token0 + 6, 0);  // the tokens passed: their hints are settled
  };
  h.store->evict_all();  // every hinted expert absent: each hint needs its read
  run(1, true);
  EXPECT_EQ(s.stats().exact_loads, 3u + 42u);
  EXPECT_EQ(s.stats().exact_wasted, 0u);
  EXPECT_EQ(h.sched().prefetch_depth_now(), 0u) << "42 right exact hints are not evidence";
  run(7, false);
  EXPECT_GE(h.sched().prefetch_depth_now(), 1u) << "42 right predicted hints are";

  // Read and evicted before its acquire: an exact hint's waste, in no depth's counts.
  const uint64_t wasted_at_1 = at(s, 1).wasted;
  h.sched().set_cursor(0, 20, 0);
  ASSERT_EQ(h.sched().prefetch(0, {5, 5}, 1.0f, true), 0);
  ASSERT_TRUE(h.drain());
  ASSERT_TRUE(h.store->cache().evict({5, 5}));
  EXPECT_EQ(s.stats().exact_wasted, 1u);
  EXPECT_EQ(at(s, 1).wasted, wasted_at_1);

  // A fixed depth of 0 is prefetch off: exact hints too.
  const uint64_t loads = s.stats().prefetch_loads;
  h.sched().set_prefetch_depth(0);
  ASSERT_EQ(h.sched().prefetch(0, {6, 6}, 1.0f, true), 0);
  ASSERT_TRUE(h.drain());
  EXPECT_EQ(s.stats().prefetch_loads, loads);
  EXPECT_LT(h.store->cache().lookup({6, 6}), 0);
}

std::string backend_name(const ::testing::TestParamInfo<BackendKind>& info) {
  return info.param == BackendKind::Uring ? "uring" : "pread";
}

INSTANTIATE_TEST_SUITE_P(Store, PrefetchTelemetry,
                         ::testing::Values(BackendKind::Uring, BackendKind::Pread), backend_name);

}  // namespace
}  // namespace expertd
