// The storage engine end to end: real GGUF files written by expert-forge (or by GgufWriter with
// the forge's content), real io_uring (and the pread pool, and the fault injector), the real
// arena. Every READY slot is checked byte for byte by ForgeVerifier.
#include "cache/store.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "forge/content.h"
#include "storage/gguf_writer.h"
#include "tests/cache/store_harness.h"

namespace expertd {
namespace {

namespace fs = std::filesystem;
using test::forge;
using test::Harness;
using test::small_cache;
using test::TempDir;

class Backends : public ::testing::TestWithParam<BackendKind> {};

std::string backend_name(const ::testing::TestParamInfo<BackendKind>& info) {
  return info.param == BackendKind::Uring ? "uring" : "pread";
}

// Loads every expert of the model once and checks every byte. One session, never more acquires
// held or waiting than the slots it may hold (Scheduler::session_bound): a session at its bound is
// refused, since it could only wait for its own releases.
void load_all_and_verify(Harness& h) {
  const SliceMap& map = h.store->slice_map();
  std::vector<ExpertKey> keys;
  for (const auto& layer : map.layers()) {
    for (uint32_t e = 0; e < map.expert_count(); ++e) keys.push_back(ExpertKey{layer.layer, e});
  }
  const uint32_t bound = h.sched().session_bound(0);
  ASSERT_GT(bound, 0u);
  std::map<uint64_t, ExpertKey> want;
  size_t seen = 0;
  size_t issued = 0;
  for (int spins = 0; seen < keys.size() && spins < 100000; ++spins) {
    // Released as completions arrive, so a cache smaller than the model keeps going.
    for (; issued < keys.size() && issued - seen < bound; ++issued) {
      want[issued + 1] = keys[issued];
      ASSERT_EQ(h.sched().acquire(0, keys[issued], issued + 1), 0);
    }
    ASSERT_GE(h.reactor->run_once(10, {}), 0);
    for (; seen < h.sink.done.size(); ++seen) {
      const Completion& c = h.sink.done[seen];
      ASSERT_GE(c.slot, 0) << "layer " << c.key.layer << " expert " << c.key.expert << ": "
                           << std::strerror(-c.slot);
      EXPECT_EQ(want[c.tag], c.key);
      h.verifier->loaded(c.key, static_cast<uint32_t>(c.slot),
                         h.store->slot_data(static_cast<uint32_t>(c.slot)), 0);
      ASSERT_EQ(h.sched().release(0, static_cast<uint32_t>(c.slot)), 0);
    }
  }
  ASSERT_EQ(seen, want.size());
  EXPECT_EQ(h.verifier->failures(), 0u)
      << (h.verifier->messages().empty() ? "" : h.verifier->messages().front());
  EXPECT_EQ(h.verifier->verified(), want.size());
}

TEST_P(Backends, EveryExpertArrivesByteExactAt32ByteAlignedOffsets) {
  TempDir dir;
  const std::string model = forge(dir.path(),
                                  "--layers 3 --experts 8 --embd 256 --ff 320 "
                                  "--expert-type q8_0 --alignment 32 --seed 3");
  Harness h(model, GetParam(), small_cache(64ull << 20));
  // q8_0 rows of 256 elements are 272 bytes: slices start at 32-byte, not 4096-byte, offsets.
  bool unaligned = false;
  for (const auto& l : h.store->slice_map().layers()) {
    unaligned |= l.expert0[0].offset % 4096 != 0;
  }
  EXPECT_TRUE(unaligned);
  load_all_and_verify(h);
}

TEST_P(Backends, SplitModelsAndQ4KVerify) {
  TempDir dir;
  forge(dir.path(),
        "--layers 4 --experts 6 --embd 256 --ff 512 --expert-type q4_k --split 3 "
        "--seed 9");
  Harness h(dir.path() + "/model-00001-of-00003.gguf", GetParam(), small_cache(64ull << 20));
  load_all_and_verify(h);
}

TEST_P(Backends, SmallCacheEvictsAndStillVerifies) {
  TempDir dir;
  const std::string model = forge(dir.path(),
                                  "--layers 4 --experts 8 --embd 256 --ff 256 "
                                  "--expert-type q6_k --seed 4");
  Harness probe(model, GetParam(), small_cache(0));
  const uint64_t slot = probe.store->layouts().slot_bytes();
  Harness h(model, GetParam(), small_cache(5 * slot));
  EXPECT_EQ(h.store->cache().slot_count(), 5u);
  load_all_and_verify(h);
  // 32 experts through 5 cache and 8 staging slots: each loaded once, at least 19 evictions.
  EXPECT_EQ(h.sched().stats().loads_done, 32u);
  EXPECT_GE(h.sched().stats().evictions, 19u);
}

// The last expert slice of this file ends exactly at the end of the file, and the file size is
// not a multiple of the direct-I/O alignment: the widened read comes back short, as it must.
TEST_P(Backends, SliceEndingAtEndOfFile) {
  TempDir dir;
  const std::string path = dir.path() + "/eof.gguf";
  GgufWriter w(32);
  w.set_string("general.architecture", "qwen3moe");
  w.set_u32("qwen3moe.block_count", 1);
  w.set_u32("qwen3moe.expert_count", 4);
  w.set_u32("qwen3moe.expert_used_count", 2);
  w.set_u64(kForgeSeedKey, 77);
  w.set_u32(kForgeVersionKey, kForgeVersion);
  const uint64_t gate[] = {64, 96, 4};
  const uint64_t down[] = {96, 64, 4};
  ASSERT_TRUE(w.add_tensor("blk.0.ffn_gate_exps.weight", GgmlType::Q8_0, gate));
  ASSERT_TRUE(w.add_tensor("blk.0.ffn_up_exps.weight", GgmlType::Q8_0, gate));
  ASSERT_TRUE(w.add_tensor("blk.0.ffn_down_exps.weight", GgmlType::Q8_0, down));
  ASSERT_TRUE(w.begin(path));
  for (const auto& t : w.tensors()) {
    std::vector<uint8_t> bytes(t.bytes);
    ASSERT_TRUE(forge_expected_bytes(77, t, 0, bytes));
    ASSERT_TRUE(w.write(bytes));
  }
  ASSERT_TRUE(w.finish());
  ASSERT_TRUE(w.commit());
  const auto size = fs::file_size(path);
  auto m = GgufModel::open(path);
  ASSERT_TRUE(m);
  const auto* last = m->meta().find_tensor("blk.0.ffn_down_exps.weight");
  ASSERT_EQ(last->offset + last->bytes, size) << "the down tensor must end the file";
  ASSERT_NE(size % 4096, 0u);
  Harness h(path, GetParam(), small_cache(8ull << 20));
  load_all_and_verify(h);
}

TEST_P(Backends, DuplicateAcquiresCoalesceIntoOneRead) {
  TempDir dir;
  const std::string model = forge(dir.path(),
                                  "--layers 2 --experts 4 --embd 256 --ff 256 "
                                  "--seed 5");
  StoreOptions o = small_cache(16ull << 20);
  o.scheduler.chunk_bytes = 0;  // one read per slice
  Harness h(model, GetParam(), o);
  for (uint64_t tag = 1; tag <= 5; ++tag) ASSERT_EQ(h.sched().acquire(0, {1, 2}, tag), 0);
  ASSERT_TRUE(h.drain());
  ASSERT_EQ(h.sink.done.size(), 5u);
  const int32_t slot = h.sink.done[0].slot;
  for (const auto& c : h.sink.done) EXPECT_EQ(c.slot, slot);
  EXPECT_EQ(h.sched().stats().misses, 1u);
  EXPECT_EQ(h.sched().stats().coalesced, 4u);
  EXPECT_EQ(h.sched().stats().loads_done, 1u);
  EXPECT_EQ(h.sched().stats().reads, 3u) << "gate, up and down: one read each";
  EXPECT_EQ(h.store->cache().refs(static_cast<uint32_t>(slot)), 5u);
}

TEST_P(Backends, HeldExpertsSurvivePressureAndBusyIsReportedNotHung) {
  TempDir dir;
  const std::string model = forge(dir.path(),
                                  "--layers 2 --experts 8 --embd 256 --ff 256 "
                                  "--seed 6");
  Harness probe(model, GetParam(), small_cache(0));
  StoreOptions o = small_cache(3 * probe.store->layouts().slot_bytes());
  o.staging_slots = 1;
  Harness h(model, GetParam(), o);
  const Completion a = h.get({0, 0});
  const Completion b = h.get({0, 1});
  const Completion c = h.get({0, 2});
  ASSERT_GE(a.slot, 0);
  ASSERT_GE(b.slot, 0);
  ASSERT_GE(c.slot, 0);
  // Cache (3) and staging (1) can take one more; then a request waits for a release.
  const Completion d = h.get({0, 3});
  ASSERT_GE(d.slot, 0);
  h.sink.done.clear();
  // The session that holds every slot could only wait for itself: refused at once.
  ASSERT_EQ(h.sched().acquire(0, {1, 1}, 98), 0);
  ASSERT_EQ(h.sink.done.size(), 1u);
  EXPECT_EQ(h.sink.done[0].slot, -EBUSY);
  h.sink.done.clear();
  // Another session waits for a release.
  ASSERT_EQ(h.sched().acquire(1, {1, 0}, 99), 0);
  for (int i = 0; i < 20; ++i) h.reactor->run_once(5, {});
  EXPECT_TRUE(h.sink.done.empty()) << "no slot is free: the acquire waits";
  // The held experts are still there, byte-exact.
  for (const Completion& x : {a, b, c}) {
    h.verifier->loaded(x.key, static_cast<uint32_t>(x.slot),
                       h.store->slot_data(static_cast<uint32_t>(x.slot)), 0);
    EXPECT_EQ(h.store->cache().lookup(x.key), x.slot);
  }
  EXPECT_EQ(h.verifier->failures(), 0u);
  ASSERT_EQ(h.sched().release(0, static_cast<uint32_t>(b.slot)), 0);
  ASSERT_TRUE(h.drain());
  ASSERT_EQ(h.sink.done.size(), 1u);
  EXPECT_EQ(h.sink.done[0].key, (ExpertKey{1, 0}));
  EXPECT_GE(h.sink.done[0].slot, 0);
  EXPECT_EQ(h.store->cache().lookup({0, 0}), a.slot) << "held: never evicted";
  EXPECT_EQ(h.store->cache().lookup({0, 2}), c.slot) << "held: never evicted";
  EXPECT_EQ(h.sched().release(0, 12345), -EINVAL) << "a slot that does not exist";
}

TEST_P(Backends, PrefetchesPassedByTheCursorAreDroppedOrCancelled) {
  TempDir dir;
  const std::string model = forge(dir.path(),
                                  "--layers 8 --experts 8 --embd 256 --ff 512 "
                                  "--seed 7");
  StoreOptions o = small_cache(64ull << 20);
  o.scheduler.prefetch_depth = 2;
  Harness h(model, GetParam(), o);
  h.sched().set_cursor(0, 0, 0);
  // Layers 1..2 are within depth 2 of layer 0; layer 6 is not, and stays queued.
  for (uint32_t e = 0; e < 4; ++e) {
    ASSERT_EQ(h.sched().prefetch(0, {1, e}, 0.9f), 0);
    ASSERT_EQ(h.sched().prefetch(0, {6, e}, 0.9f), 0);
  }
  ASSERT_TRUE(h.drain());
  EXPECT_EQ(h.sched().stats().prefetch_loads, 4u);
  for (uint32_t e = 0; e < 4; ++e) EXPECT_GE(h.store->cache().lookup({1, e}), 0);
  for (uint32_t e = 0; e < 4; ++e) EXPECT_LT(h.store->cache().lookup({6, e}), 0);
  // Three of the four are used: the hints one layer ahead are right often enough (the scheduler's
  // own estimate of their precision) to keep prefetching at that depth.
  for (const uint32_t e : {0u, 1u, 3u}) EXPECT_GE(h.get({1, e}).slot, 0);
  // The cursor jumps past layer 6: the queued hints are dropped without a read.
  const uint64_t reads = h.sched().stats().reads;
  h.sched().set_cursor(0, 0, 7);
  ASSERT_TRUE(h.drain());
  EXPECT_EQ(h.sched().stats().reads, reads);
  EXPECT_EQ(h.sched().stats().prefetch_dropped, 4u);
  // A prefetch that is reading when the cursor passes it is cancelled.
  h.sched().set_cursor(0, 1, 4);
  ASSERT_EQ(h.sched().prefetch(0, {5, 5}, 0.9f), 0);  // the next layer: eligible at once
  h.sched().pump();
  h.sched().set_cursor(0, 1, 6);  // layer 5 of token 1 is behind
  ASSERT_TRUE(h.drain());
  EXPECT_EQ(h.sched().stats().prefetch_cancelled, 1u);
  EXPECT_LT(h.store->cache().lookup({5, 5}), 0) << "a cancelled load leaves no slot behind";
  // An acquire of a prefetched expert counts as useful.
  const Completion c = h.get({1, 2});
  EXPECT_GE(c.slot, 0);
  EXPECT_EQ(h.sched().stats().prefetch_useful, 4u);
}

// Prefetches must not take the disk from a read a client waits for: once a demand read is in
// flight, no prefetch read is issued beside it while more than one is out, so they drain to one
// and stay there until the demand's expert is READY (completions held back a few waits each, so
// several reads are out at once). Whether they reach one before the demand completes depends on
// the machine's timing (under ASan on a quiet machine the demand can win), so the test checks that
// their count never grows beside a demand read, and that once at one it stays there.
TEST_P(Backends, APrefetchReadsBesideADemandReadOneAtATime) {
  TempDir dir;
  const std::string model = forge(dir.path(),
                                  "--layers 8 --experts 8 --embd 256 --ff 512 "
                                  "--seed 7");
  FaultOptions f;
  f.delay_rate = 1.0;
  f.max_delay_waits = 3;
  StoreOptions o = small_cache(64ull << 20);
  o.scheduler.prefetch_depth = 2;
  o.scheduler.queue_depth = 8;
  o.scheduler.chunk_bytes = 16 << 10;  // several reads per expert
  Harness h(model, GetParam(), o, &f);
  h.sched().set_cursor(0, 0, 0);
  for (uint32_t e = 0; e < 6; ++e) ASSERT_EQ(h.sched().prefetch(0, {1, e}, 0.9f), 0);
  h.sched().pump();
  ASSERT_GT(h.sched().prefetch_reads_in_flight(), 1u);
  ASSERT_EQ(h.sched().acquire(0, {2, 7}, 1), 0);
  uint32_t demand_steps = 0;
  bool drained = false;  // the prefetch reads beside the demand came down to one
  uint32_t before = h.sched().prefetch_reads_in_flight();
  const uint32_t at_acquire = before;
  for (int i = 0; i < 10'000 && h.sink.done.empty(); ++i) {
    ASSERT_GE(h.reactor->run_once(5, {}), 0);
    const uint32_t all = h.sched().reads_in_flight();
    const uint32_t pre = h.sched().prefetch_reads_in_flight();
    if (all == pre) continue;  // no demand read out now
    ++demand_steps;
    EXPECT_LE(pre, std::max(1u, before))
        << "step " << i << ": a prefetch read issued beside a demand read (" << all
        << " reads in flight)";
    before = pre;
    if (pre <= 1) drained = true;
    if (drained) {
      EXPECT_LE(pre, 1u) << "step " << i << ": " << all << " reads in flight";
    }
  }
  ASSERT_EQ(h.sink.done.size(), 1u);
  EXPECT_GE(h.sink.done[0].slot, 0);
  EXPECT_GT(demand_steps, 3u);
  std::printf(
      "prefetch reads beside the demand: %u at its acquire, %s while it was out (%u steps)\n",
      at_acquire, drained ? "down to one or none" : "still draining when it completed",
      demand_steps);
  // The prefetches finish afterwards, at full depth again.
  ASSERT_TRUE(h.drain());
  EXPECT_EQ(h.sched().stats().prefetch_loads, 6u);
  for (uint32_t e = 0; e < 6; ++e) EXPECT_GE(h.store->cache().lookup({1, e}), 0);
  EXPECT_EQ(h.sched().prefetch_reads_in_flight(), 0u);
}

TEST_P(Backends, StagingNeverEvictsHotExperts) {
  TempDir dir;
  const std::string model = forge(dir.path(),
                                  "--layers 4 --experts 8 --embd 256 --ff 256 "
                                  "--seed 8");
  Harness probe(model, GetParam(), small_cache(0));
  StoreOptions o = small_cache(4 * probe.store->layouts().slot_bytes());
  o.staging_slots = 2;
  o.scheduler.prefetch_depth = 4;
  o.scheduler.staging_probability = 1.0;  // every prefetch streams
  Harness h(model, GetParam(), o);
  std::vector<ExpertKey> hot = {{0, 0}, {1, 1}, {2, 2}, {3, 3}};
  for (const auto& k : hot) {
    const Completion c = h.get(k);
    ASSERT_GE(c.slot, 0);
    ASSERT_EQ(h.sched().release(0, static_cast<uint32_t>(c.slot)), 0);
  }
  h.sched().set_cursor(0, 0, 0);
  // Many low-confidence hints: all stream through the 2 staging slots.
  for (uint32_t round = 0; round < 3; ++round) {
    for (uint32_t e = 4; e < 8; ++e) ASSERT_EQ(h.sched().prefetch(0, {1 + round % 3, e}, 0.1f), 0);
    ASSERT_TRUE(h.drain());
  }
  EXPECT_GT(h.sched().stats().staged_loads, 2u);
  for (const auto& k : hot) {
    EXPECT_GE(h.store->cache().lookup(k), 0) << "hot expert " << k.layer << "/" << k.expert;
  }
  EXPECT_EQ(h.sched().stats().evictions, h.sched().stats().staged_loads - 2)
      << "only staging slots were recycled";
}

TEST_P(Backends, CacheSizeZeroStreamsThroughStaging) {
  TempDir dir;
  const std::string model = forge(dir.path(),
                                  "--layers 2 --experts 4 --embd 256 --ff 256 "
                                  "--seed 10");
  StoreOptions o = small_cache(0);
  o.staging_slots = 2;
  Harness h(model, GetParam(), o);
  EXPECT_EQ(h.store->cache().slot_count(), 0u);
  load_all_and_verify(h);
  EXPECT_EQ(h.sched().stats().staged_loads, 8u);
}

INSTANTIATE_TEST_SUITE_P(Store, Backends, ::testing::Values(BackendKind::Uring, BackendKind::Pread),
                         backend_name);

// --- Faults: only the affected expert fails; everything else arrives byte-exact.

TEST(StoreFaults, EioFailsOnlyTheExpertItHits) {
  TempDir dir;
  const std::string model = forge(dir.path(),
                                  "--layers 2 --experts 8 --embd 256 --ff 512 "
                                  "--seed 12");
  auto m = GgufModel::open(model);
  ASSERT_TRUE(m);
  auto map = SliceMap::build(*m);
  std::array<ExpertSlice, 3> sl{};
  ASSERT_EQ(map->slices(1, 5, sl), 3u);
  FaultOptions f;
  f.eio_rate = 1.0;
  f.eio_file = 0;
  // The middle of layer 1 expert 5's up slice: no widened read of a neighbour reaches it.
  f.eio_offset = sl[1].offset + sl[1].bytes / 2;
  f.eio_bytes = 1;
  Harness h(model, BackendKind::Uring, small_cache(64ull << 20), &f);
  uint64_t tag = 0;
  for (uint32_t l = 0; l < 2; ++l) {
    for (uint32_t e = 0; e < 8; ++e) ASSERT_EQ(h.sched().acquire(0, {l, e}, ++tag), 0);
  }
  ASSERT_TRUE(h.drain());
  ASSERT_EQ(h.sink.done.size(), 16u);
  for (const Completion& c : h.sink.done) {
    if (c.key == ExpertKey{1, 5}) {
      EXPECT_EQ(c.slot, -EIO);
    } else {
      ASSERT_GE(c.slot, 0);
      h.verifier->loaded(c.key, static_cast<uint32_t>(c.slot),
                         h.store->slot_data(static_cast<uint32_t>(c.slot)), 0);
    }
  }
  EXPECT_EQ(h.verifier->verified(), 15u);
  EXPECT_EQ(h.verifier->failures(), 0u);
  EXPECT_EQ(h.sched().stats().loads_failed, 1u);
  EXPECT_LT(h.store->cache().lookup({1, 5}), 0) << "a failed load leaves no slot behind";
}

// A failing read is retried with backoff, not given up at once: with 30% of reads failing and
// enough retries every expert arrives byte-exact, and the retries are counted for the shard. The
// retries wait in the scheduler, not in a sleep: the test's loop only calls run_once.
TEST(StoreFaults, EioIsRetriedWithBackoffUntilTheExpertArrives) {
  TempDir dir;
  const std::string model =
      forge(dir.path(), "--layers 2 --experts 8 --embd 256 --ff 512 --seed 3");
  FaultOptions f;
  f.seed = 5;
  f.eio_rate = 0.3;
  StoreOptions o = small_cache(64ull << 20);
  o.scheduler.chunk_bytes = 64 << 10;
  o.scheduler.read_retries = 40;  // 0.3^41: no chunk runs out of tries
  o.scheduler.retry_backoff_ns = 100'000;
  Harness h(model, BackendKind::Uring, o, &f);
  load_all_and_verify(h);
  const SchedulerStats& st = h.sched().stats();
  EXPECT_EQ(st.loads_failed, 0u);
  EXPECT_GT(st.read_retries, 10u);
  ASSERT_EQ(h.sched().shard_read_retries().size(), 1u);
  EXPECT_EQ(h.sched().shard_read_retries()[0], st.read_retries);
  EXPECT_EQ(h.sched().failures(), 0u);
}

// The last retry fails the expert, and the failure is recorded where it happened.
TEST(StoreFaults, AFailedLoadIsRecordedWithItsFileOffsetAndErrno) {
  TempDir dir;
  const std::string model =
      forge(dir.path(), "--layers 2 --experts 8 --embd 256 --ff 512 --seed 3");
  auto m = GgufModel::open(model);
  ASSERT_TRUE(m);
  auto map = SliceMap::build(*m);
  std::array<ExpertSlice, 3> sl{};
  ASSERT_EQ(map->slices(0, 2, sl), 3u);
  FaultOptions f;
  f.eio_rate = 1.0;
  f.eio_offset = sl[0].offset + sl[0].bytes / 2;
  f.eio_bytes = 1;
  StoreOptions o = small_cache(64ull << 20);
  o.scheduler.retry_backoff_ns = 100'000;
  Harness h(model, BackendKind::Uring, o, &f);
  const Completion c = h.get({0, 2});
  EXPECT_EQ(c.slot, -EIO);
  ASSERT_EQ(h.sched().failures(), 1u);
  const LoadFailure& fail = h.sched().failure(0);
  EXPECT_EQ(fail.key, (ExpertKey{0, 2}));
  EXPECT_EQ(fail.error, -EIO);
  EXPECT_EQ(fail.retries, 3u);
  EXPECT_LE(fail.offset, f.eio_offset);
  EXPECT_GT(fail.offset + fail.len, f.eio_offset);
  EXPECT_EQ(h.sched().stats().read_retries, 3u);
  EXPECT_EQ(h.sched().shard_loads_failed()[0], 1u);
  // Another expert is not touched by it.
  EXPECT_GE(h.get({0, 3}).slot, 0);
}

class FaultMix : public ::testing::TestWithParam<BackendKind> {};

TEST_P(FaultMix, ShortReadsEagainDelaysAndReorderingStillDeliverEveryByte) {
  TempDir dir;
  const std::string model = forge(dir.path(),
                                  "--layers 3 --experts 8 --embd 512 --ff 768 "
                                  "--expert-type q4_k --alignment 32 --seed 13");
  FaultOptions f;
  f.seed = 99;
  f.short_rate = 0.3;
  f.eagain_rate = 0.2;
  f.delay_rate = 0.2;
  f.reorder = true;
  StoreOptions o = small_cache(64ull << 20);
  o.scheduler.chunk_bytes = 64 << 10;
  Harness h(model, GetParam(), o, &f);
  load_all_and_verify(h);
  EXPECT_GT(h.sched().stats().short_reads, 10u);
  EXPECT_GT(h.sched().stats().eagain_retries, 10u);
  EXPECT_GT(h.sched().stats().buffered_requeues, 0u) << "unaligned remainders were injected";
}

INSTANTIATE_TEST_SUITE_P(Store, FaultMix, ::testing::Values(BackendKind::Uring, BackendKind::Pread),
                         backend_name);

}  // namespace
}  // namespace expertd
