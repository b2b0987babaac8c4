// expert-tune batch's model (tune/batch.h): streams of a trace decoded together, each step's layer
// reading the union of its rows' experts through one cache. Exact counts on hand-made traces, then
// issue 25's question on routing: do 4 streams read 2.5x fewer experts per token than one? On the
// shared Mixtral traces (real routing) when present, and on a generated trace (the twin) always.
#include "tune/batch.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "testing/expertd_fixture.h"
#include "trace/synth.h"
#include "trace/trace.h"

namespace expertd::tune {
namespace {

// A trace of `tokens`, each routed to route(token, layer).
template <typename F>
Trace make_trace(uint32_t tokens, uint32_t layers, uint32_t experts, F route) {
  Trace t;
  t.layers = layers;
  t.experts = experts;
  t.tokens = tokens;
  for (uint32_t i = 0; i < tokens; ++i) {
    for (uint32_t l = 0; l < layers; ++l)
      t.records.push_back(TraceRecord{i, l, route(i, l), {}, {}});
  }
  return t;
}

const BatchSimResult& find(const std::vector<BatchSimResult>& r, uint32_t streams,
                           uint32_t capacity) {
  for (const auto& x : r)
    if (x.streams == streams && x.capacity == capacity) return x;
  ADD_FAILURE() << "no result for " << streams << " streams, cache " << capacity;
  return r.front();
}

// Four streams whose tokens route alike share every read: a step reads one stream's experts for
// all four rows, so reads per token fall by exactly 4; streams routing to disjoint experts share
// none, and every row's experts are read.
TEST(BatchSim, SharedRoutesAreReadOnceDisjointOnesEach) {
  // 40 tokens in 4 segments of 10: token i routes like i % 10 (so the segments are alike).
  const Trace alike = make_trace(40, 3, 16, [](uint32_t i, uint32_t l) {
    return std::vector<uint32_t>{(i % 10 + l) % 16, (i % 10 + l + 5) % 16};
  });
  const std::vector<Trace> a{alike};
  const std::vector<uint32_t> streams{1, 4};
  const std::vector<uint32_t> tiny{2};
  auto r = simulate_batches(a, streams, tiny, "lru");
  ASSERT_TRUE(r) << r.error().message;
  const BatchSimResult& one = find(*r, 1, 2);
  const BatchSimResult& four = find(*r, 4, 2);
  EXPECT_EQ(one.tokens, 40u);
  EXPECT_EQ(four.steps, 10u);
  EXPECT_EQ(four.tokens, 40u);
  EXPECT_EQ(one.routed, 40u * 3 * 2);
  EXPECT_EQ(four.routed, 40u * 3 * 2);
  EXPECT_EQ(four.accesses, 10u * 3 * 2) << "one read per expert for the four rows";
  EXPECT_DOUBLE_EQ(four.distinct_per_layer(), 2.0);
  // A 2-slot cache keeps nothing from one layer to the next: every access misses.
  EXPECT_EQ(one.misses, one.accesses);
  EXPECT_EQ(four.misses, four.accesses);
  EXPECT_DOUBLE_EQ(one.misses_per_token() / four.misses_per_token(), 4.0);

  // Disjoint: segment s routes to experts 4s and 4s + 1 of every layer.
  const Trace apart = make_trace(40, 3, 16, [](uint32_t i, uint32_t) {
    const uint32_t s = i / 10;
    return std::vector<uint32_t>{4 * s, 4 * s + 1};
  });
  const std::vector<Trace> b{apart};
  r = simulate_batches(b, streams, tiny, "lru");
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_DOUBLE_EQ(find(*r, 4, 2).distinct_per_layer(), 8.0);
  EXPECT_EQ(find(*r, 4, 2).accesses, find(*r, 4, 2).routed);
}

TEST(BatchSim, BadArgumentsAreErrorsThatSaySo) {
  const Trace t = make_trace(8, 2, 4, [](uint32_t, uint32_t) { return std::vector<uint32_t>{0}; });
  const std::vector<Trace> one{t};
  const std::vector<uint32_t> ok{1};
  const std::vector<uint32_t> zero{0};
  const std::vector<uint32_t> too_many{9};
  auto r = simulate_batches(one, too_many, ok, "lru");
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("9 streams of 8 tokens"), std::string::npos)
      << r.error().message;
  r = simulate_batches(one, ok, zero, "lru");
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("0 experts"), std::string::npos) << r.error().message;
  r = simulate_batches(one, ok, ok, "nonesuch");
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("nonesuch"), std::string::npos) << r.error().message;
  r = simulate_batches(std::vector<Trace>{}, ok, ok, "lru");
  ASSERT_FALSE(r);
}

// Issue 25's premise on a routing trace: 4 streams share some experts (fewer distinct experts per
// step than their rows use), but through the caches of the peer configurations reads per token
// fall far less than 2.5x (through Belady's optimum too). Prints the table.
void expect_four_streams_fall_short(const std::vector<Trace>& traces, const char* what) {
  const std::vector<uint32_t> streams{1, 4};
  const std::vector<uint32_t> caches{32, 64, 128, 170};
  auto r = simulate_batches(traces, streams, caches, "cyclic-hint");
  ASSERT_TRUE(r) << r.error().message;
  for (const uint32_t c : caches) {
    const BatchSimResult& one = find(*r, 1, c);
    const BatchSimResult& four = find(*r, 4, c);
    const double uses = static_cast<double>(four.routed) / four.steps / four.layers;
    EXPECT_LT(four.distinct_per_layer(), uses) << "4 rows share experts";
    EXPECT_GT(four.distinct_per_layer(), one.distinct_per_layer());
    const double factor = one.misses_per_token() / four.misses_per_token();
    const double best = one.belady_misses_per_token() / four.belady_misses_per_token();
    EXPECT_LT(factor, 2.5) << "cache " << c;
    EXPECT_LT(best, 2.5) << "cache " << c;
    std::printf(
        "[ %s, cache %u ] distinct/layer %.2f (1 stream) %.2f (4, of %.2f uses); reads "
        "per token %.2f -> %.2f (%.2fx), Belady %.2f -> %.2f (%.2fx)\n",
        what, c, one.distinct_per_layer(), four.distinct_per_layer(), uses, one.misses_per_token(),
        four.misses_per_token(), factor, one.belady_misses_per_token(),
        four.belady_misses_per_token(), best);
  }
}

TEST(BatchSim, FourStreamsOfRealMixtralRoutingReadFarLessThan2Point5xFewer) {
  const auto dir = test::shared_traces_dir();
  if (!dir) GTEST_SKIP() << test::kNoSharedTraces;
  std::vector<Trace> traces;
  for (const char* name :
       {"mixtral-8x7b-humaneval0.trace.jsonl", "mixtral-8x7b-humaneval1.trace.jsonl"}) {
    auto t = load_trace(*dir + "/" + name);
    ASSERT_TRUE(t) << t.error().message;
    traces.push_back(std::move(*t));
  }
  expect_four_streams_fall_short(traces, "shared traces");
}

TEST(BatchSim, FourStreamsOfAGeneratedTraceReadFarLessThan2Point5xFewer) {
  const std::vector<Trace> traces{synthesize_trace(SynthParams::mixtral(300), 1)};
  expect_four_streams_fall_short(traces, "generated");
}

}  // namespace
}  // namespace expertd::tune
