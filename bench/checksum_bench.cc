// checksum_bench (Google Benchmark): what checking every load against the checksum manifest
// (`checksums = true`, cache/checksums.h) costs. In one run, over one forged model:
//  - BM_Load/0 and BM_Load/1: the storage engine (ExpertStore + StoreReactor over io_uring,
//    O_DIRECT) loads every expert of the model once per iteration in a seeded shuffle, into a
//    cache emptied before each pass; /1 checks each load's XXH3 before it becomes READY. Bytes
//    are the experts' bytes, so bytes_per_second is the engine's GB/s with and without the check;
//  - BM_Xxh3: XXH3-64 alone over one expert's bytes in memory, the check's own ceiling on one core.
// The model is forged once into a temporary directory (EXPERTD_BENCH_MODEL_ARGS overrides its
// expert-forge options).
#include <benchmark/benchmark.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cache/checksums.h"
#include "cache/store.h"
#include "testing/process.h"
#include "testing/temp_dir.h"

namespace expertd {
namespace {

struct Sink final : CompletionSink {
  void complete(const Completion& c) override { done.push_back(c); }
  std::vector<Completion> done;
};

// One forged model for the whole run.
struct Fixture {
  test::TempDir dir;
  std::string model;
  Fixture() {
    const char* args = std::getenv("EXPERTD_BENCH_MODEL_ARGS");
    auto m = test::forge_model(dir.path(), "bench",
                               args != nullptr ? args
                                               : "--layers 4 --experts 16 --embd 1024 --ff 1024 "
                                                 "--seed 21");
    if (!m) std::abort();
    model = *m;
  }
};

Fixture& fixture() {
  static Fixture f;
  return f;
}

void BM_Load(benchmark::State& state) {
  const bool check = state.range(0) != 0;
  auto model = GgufModel::open(fixture().model);
  if (!model) return state.SkipWithError(model.error().message.c_str());
  std::vector<std::string> paths;
  for (const auto& s : model->shards()) paths.push_back(s.path());
  std::string reason;
  auto backend = make_backend(BackendKind::Uring, BackendOptions{}, &reason);
  if (!backend || !(*backend)->open_files(paths)) return state.SkipWithError("backend");
  bool built = false;
  std::string write_error;
  auto map = SliceMap::build(*model);
  if (!map) return state.SkipWithError(map.error().message.c_str());
  auto manifest = ChecksumManifest::load_or_build(fixture().dir.path() + "/state", "bench", *model,
                                                  *map, &built, &write_error);
  if (!manifest) return state.SkipWithError(manifest.error().message.c_str());
  StoreOptions o;
  o.cache_bytes = 64ull << 20;
  o.lock_memory = false;
  o.scheduler.queue_depth = 32;
  const std::vector<uint32_t> files = {0};
  Sink sink;
  auto store = ExpertStore::create("bench", std::move(*model), **backend, files, o, sink);
  if (!store) return state.SkipWithError(store.error().message.c_str());
  iovec iov{(*store)->arena().data(), (*store)->arena().size()};
  (void)(*backend)->register_buffers({&iov, 1});
  if (check) (*store)->scheduler().set_checksums(manifest->table());
  StoreReactor reactor(**backend);
  reactor.add(store->get(), 0, 1);

  std::vector<ExpertKey> keys;
  const SliceMap& m = (*store)->slice_map();
  for (const auto& layer : m.layers()) {
    for (uint32_t e = 0; e < m.expert_count(); ++e) keys.push_back({layer.layer, e});
  }
  std::mt19937_64 rng(7);
  std::shuffle(keys.begin(), keys.end(), rng);
  uint64_t bytes = 0;
  for (const auto& layer : m.layers()) bytes += m.expert_bytes(layer.layer) * m.expert_count();

  for (auto _ : state) {
    state.PauseTiming();
    (void)(*store)->evict_all();
    sink.done.clear();
    state.ResumeTiming();
    uint64_t tag = 0;
    for (const ExpertKey k : keys) (void)(*store)->scheduler().acquire(0, k, ++tag);
    size_t seen = 0;
    while (seen < keys.size()) {
      if (reactor.run_once(10, {}) < 0) return state.SkipWithError("reactor");
      for (; seen < sink.done.size(); ++seen) {
        const Completion& c = sink.done[seen];
        if (c.slot < 0) return state.SkipWithError("a load failed");
        (void)(*store)->scheduler().release(0, static_cast<uint32_t>(c.slot));
      }
    }
  }
  state.SetBytesProcessed(static_cast<int64_t>(bytes * state.iterations()));
  state.counters["mismatches"] =
      static_cast<double>((*store)->scheduler().stats().checksum_mismatches);
}
BENCHMARK(BM_Load)
    ->Arg(0)
    ->Arg(1)
    ->ArgName("checksums")
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

void BM_Xxh3(benchmark::State& state) {
  std::vector<uint8_t> buf(static_cast<size_t>(state.range(0)));
  std::mt19937_64 rng(3);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  for (auto _ : state) benchmark::DoNotOptimize(XXH3_64bits(buf.data(), buf.size()));
  state.SetBytesProcessed(static_cast<int64_t>(buf.size() * state.iterations()));
}
BENCHMARK(BM_Xxh3)->Arg(3 << 20);

}  // namespace
}  // namespace expertd

BENCHMARK_MAIN();
