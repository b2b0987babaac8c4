// decode_batch() against each sequence decoded alone, for any engine (the CPU engine in
// family_test.cc, the CUDA engine in gpu_engine_test.cc): four sequences with different prompts,
// decoded together while rows join and leave, give each sequence's logits exactly as that
// sequence decoded alone by an engine of one sequence, step after step; the selected sequence and
// its position are unchanged; bad batches are refused naming the row. `grouped`: the engine
// acquires each (layer, expert) once per step (EngineStats::batch_experts), so fewer experts than
// the rows one by one, and sends each layer's lookahead hints for all the rows as one message
// (ExpertSource::prefetch at most twice per layer and step, with the exact hints, not per row).
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/expert_source.h"
#include "engine/model.h"
#include "tests/engine/file_expert_source.h"

namespace expertd::engine::test {

// Counts the prefetch() calls that carry hints; everything else passes through.
class PrefetchCounter final : public ForwardingSource {
 public:
  using ForwardingSource::ForwardingSource;
  Status prefetch(std::span<const ExpertHint> hints) override {
    if (!hints.empty()) ++calls;
    return inner_.prefetch(hints);
  }
  uint64_t calls = 0;
};

using MakeEngine = std::function<Result<std::unique_ptr<Engine>>(const DenseModel&, ExpertSource&,
                                                                 const EngineOptions&)>;

inline void expect_batch_is_each_alone(const std::string& gguf, DenseLoad load,
                                       const MakeEngine& make, bool grouped) {
  auto model = DenseModel::load(gguf, load);
  ASSERT_TRUE(model) << model.error().message;
  const uint32_t vocab = model->params().n_vocab;
  constexpr uint32_t kSeqs = 4;
  constexpr uint32_t kSteps = 6;
  auto file_source = FileExpertSource::open(*model);
  ASSERT_TRUE(file_source);
  PrefetchCounter source(**file_source);
  EngineOptions o{32, 1, 0};
  o.prefill_chunk = 4;
  o.sequences = kSeqs;
  auto made = make(*model, source, o);
  ASSERT_TRUE(made) << made.error().message;
  Engine& eng = **made;
  ASSERT_EQ(eng.sequences(), kSeqs);
  EngineOptions one = o;
  one.sequences = 1;

  std::vector<std::vector<uint32_t>> prompts(kSeqs), tokens(kSeqs);
  std::vector<std::vector<std::vector<float>>> alone(kSeqs);
  uint64_t alone_experts = 0;
  for (uint32_t s = 0; s < kSeqs; ++s) {
    for (uint32_t i = 0; i < 3 + s; ++i) prompts[s].push_back((s * 31 + i * 7 + 2) % vocab);
    for (uint32_t t = 0; t < kSteps; ++t) tokens[s].push_back((s * 13 + t * 5 + 1) % vocab);
    auto solo_source = FileExpertSource::open(*model);
    ASSERT_TRUE(solo_source);
    auto solo = make(*model, **solo_source, one);
    ASSERT_TRUE(solo) << solo.error().message;
    std::vector<float> logits(vocab);
    ASSERT_TRUE((*solo)->prefill(prompts[s], logits));
    const uint64_t before = (*solo)->stats().experts_used;
    for (uint32_t t = 0; t < kSteps; ++t) {
      ASSERT_TRUE((*solo)->decode(tokens[s][t], logits));
      alone[s].push_back(logits);
    }
    alone_experts += (*solo)->stats().experts_used - before;
  }

  std::vector<float> logits(vocab);
  for (uint32_t s = 0; s < kSeqs; ++s) {
    ASSERT_TRUE(eng.select_sequence(s));
    ASSERT_TRUE(eng.prefill(prompts[s], logits));
  }
  ASSERT_TRUE(eng.select_sequence(1));
  const uint64_t before = eng.stats().batch_experts;
  const uint64_t rows_before = eng.stats().batch_rows;
  const uint64_t prefetches_before = source.calls;
  uint64_t rows_fed = 0;
  uint64_t steps_run = 0;
  std::vector<uint32_t> step(kSeqs, 0);
  // Step r: sequence 3 joins at step 1, sequence 0 leaves after step 3; the rest run throughout.
  for (uint32_t r = 0; r < kSteps + 2; ++r) {
    std::vector<BatchRow> rows;
    for (uint32_t s = 0; s < kSeqs; ++s) {
      const bool in = step[s] < kSteps && !(s == 3 && r < 1) && !(s == 0 && r > 3);
      if (in) rows.push_back(BatchRow{s, tokens[s][step[s]]});
    }
    if (rows.empty()) break;
    std::vector<float> out(rows.size() * vocab);
    ASSERT_TRUE(eng.decode_batch(rows, out));
    rows_fed += rows.size();
    ++steps_run;
    for (size_t i = 0; i < rows.size(); ++i) {
      const uint32_t s = rows[i].sequence;
      const std::vector<float> got(out.begin() + static_cast<int64_t>(i * vocab),
                                   out.begin() + static_cast<int64_t>((i + 1) * vocab));
      EXPECT_EQ(got, alone[s][step[s]]) << "sequence " << s << ", step " << step[s];
      ++step[s];
    }
  }
  EXPECT_EQ(eng.selected_sequence(), 1u);
  EXPECT_EQ(eng.position(), prompts[1].size() + kSteps);
  // Sequence 0 left after 4 steps; the others decoded every token.
  EXPECT_EQ(step[0], 4u);
  for (uint32_t s = 1; s < kSeqs; ++s) EXPECT_EQ(step[s], kSteps) << s;
  if (grouped) {
    EXPECT_EQ(eng.stats().batch_rows - rows_before, rows_fed);
    const uint64_t batched = eng.stats().batch_experts - before;
    EXPECT_GT(batched, 0u);
    EXPECT_LT(batched, alone_experts) << "rows sharing an expert share its acquire";
    const uint64_t prefetches = source.calls - prefetches_before;
    EXPECT_GT(prefetches, 0u);
    // Per layer and step: the lookahead's message (every row's candidates in it) and, where the
    // step needs more experts than one acquire takes, the layer's exact hints; never one per row.
    EXPECT_LE(prefetches, 2 * steps_run * model->params().n_layer);
    EXPECT_LT(prefetches, rows_fed * model->params().n_layer);
  }
  // Bad batches are refused naming the row.
  std::vector<float> out(2 * vocab);
  const BatchRow twice[] = {{2, 1}, {2, 1}};
  EXPECT_NE(eng.decode_batch(twice, out).error().message.find("sequence 2 has two rows"),
            std::string::npos);
  const BatchRow beyond[] = {{kSeqs, 1}};
  EXPECT_NE(eng.decode_batch(beyond, out).error().message.find("the engine holds 4"),
            std::string::npos);
}

}  // namespace expertd::engine::test
