// Test support for the storage engine tests: a store over one model with its own backend, driven
// inline on the test's thread (temporary directories and forged models come from testing/).
#pragma once

#include <gtest/gtest.h>

#include <cerrno>
#include <memory>
#include <string>
#include <vector>

#include "forge/verifier.h"
#include "testing/expertd_fixture.h"

namespace expertd::test {

// The forged model DIR/model.gguf.
inline std::string forge(const std::string& dir, const std::string& args) {
  return forge(dir, "model", args);
}

struct Sink final : CompletionSink {
  void complete(const Completion& c) override { done.push_back(c); }
  std::vector<Completion> done;
};

// A store over one model with its own backend, driven inline.
struct Harness {
  Harness(const std::string& model_path, BackendKind kind, StoreOptions options,
          const FaultOptions* faults = nullptr) {
    auto model = GgufModel::open(model_path);
    EXPECT_TRUE(model) << model.error().message;
    std::vector<std::string> paths;
    for (const auto& s : model->shards()) paths.push_back(s.path());
    std::string reason;
    auto b = make_backend(kind, BackendOptions{}, &reason);
    EXPECT_TRUE(b) << b.error().message;
    backend = std::move(*b);
    if (faults != nullptr) backend = make_faulty_backend(std::move(backend), *faults);
    const auto st = backend->open_files(paths);
    EXPECT_TRUE(st) << st.error().message;
    std::vector<uint32_t> files;
    for (uint32_t i = 0; i < paths.size(); ++i) files.push_back(i);
    auto s = ExpertStore::create("m", std::move(*model), *backend, files, options, sink);
    EXPECT_TRUE(s) << s.error().message;
    store = std::move(*s);
    iovec iov{store->arena().data(), store->arena().size()};
    (void)backend->register_buffers({&iov, 1});
    auto v = ForgeVerifier::create(store->model(), store->slice_map(), store->layouts());
    EXPECT_TRUE(v) << v.error().message;
    verifier = std::move(*v);
    reactor = std::make_unique<StoreReactor>(*backend);
    reactor->add(store.get(), 0, static_cast<uint32_t>(paths.size()));
  }
  Scheduler& sched() { return store->scheduler(); }
  bool drain() { return reactor->drain(20'000); }
  // Acquires one expert and waits for it; returns the completion.
  Completion get(ExpertKey key, uint64_t tag = 1) {
    sink.done.clear();
    EXPECT_EQ(sched().acquire(0, key, tag), 0);
    EXPECT_TRUE(drain());
    EXPECT_EQ(sink.done.size(), 1u);
    return sink.done.empty() ? Completion{0, 0, -EPIPE, 0, key} : sink.done.back();
  }

  Sink sink;
  std::unique_ptr<ReadBackend> backend;
  std::unique_ptr<ExpertStore> store;
  std::unique_ptr<ForgeVerifier> verifier;
  std::unique_ptr<StoreReactor> reactor;
};

inline StoreOptions small_cache(uint64_t slots_bytes) {
  StoreOptions o;
  o.cache_bytes = slots_bytes;
  o.lock_memory = false;
  return o;
}

}  // namespace expertd::test
