// The DeepSeek-V4 CPU forward against Hugging Face transformers (tests/fixtures/deepseek4-tiny,
// written by tools/reference/make_deepseek4_fixture.py: llama.cpp's converter made the GGUF),
// with experts read straight from the GGUF by the test-only source; the hash-layer hints; and the
// loader's errors on malformed deepseek4 files.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <map>
#include <set>

#include "engine/cpu_engine.h"
#include "engine/ds4_cpu_engine.h"
#include "storage/gguf_writer.h"
#include "testing/temp_dir.h"
#include "tests/engine/ds4_truncate_cuts.h"
#include "tests/engine/file_expert_source.h"
#include "tests/engine/fixture.h"
#include "tests/engine/gguf_edit.h"

namespace expertd::engine {
namespace {

using test::Edit;
using test::FileExpertSource;
using test::load_error;
using test::rewrite;

constexpr double kMaxRelErr = 1e-4;

struct Ds4Fixture {
  nlohmann::json meta;
  std::vector<uint32_t> tokens;
  uint32_t prompt = 0;
  uint32_t vocab = 0;

  static Ds4Fixture load() {
    Ds4Fixture f;
    f.meta = test::read_json(test::fixture_path("deepseek4-tiny/fixture.json"));
    f.tokens = f.meta.at("tokens").get<std::vector<uint32_t>>();
    f.prompt = f.meta.at("prompt_tokens").get<uint32_t>();
    f.vocab = f.meta.at("logits_shape").at(1).get<uint32_t>();
    return f;
  }
  static std::string gguf(const std::string& variant) {
    return test::fixture_path("deepseek4-tiny/model-" + variant + ".gguf");
  }
  // The mxfp4 and f32 files hold the same numbers (the f32 experts are the mxfp4 ones expanded).
  static std::string reference(const std::string& variant) {
    return variant == "q8_0" ? "q8_0" : "f32";
  }
  std::vector<float> logits(const std::string& variant) const {
    return test::read_f32(
        test::fixture_path("deepseek4-tiny/logits-" + reference(variant) + ".bin"));
  }
  std::vector<test::TraceEntry> trace(const std::string& variant) const {
    return test::read_trace(
        test::fixture_path("deepseek4-tiny/trace-" + reference(variant) + ".jsonl"));
  }
};

class Ds4Forward : public ::testing::TestWithParam<const char*> {};

TEST_P(Ds4Forward, LogitsRoutingAndGreedyTokensMatchTransformers) {
  const std::string variant = GetParam();
  const Ds4Fixture fx = Ds4Fixture::load();
  auto model = DenseModel::load(Ds4Fixture::gguf(variant));
  ASSERT_TRUE(model) << model.error().message;
  ASSERT_TRUE(model->params().is_ds4());
  auto source = FileExpertSource::open(*model);
  ASSERT_TRUE(source) << source.error().message;
  auto engine = create_cpu_engine(*model, **source, EngineOptions{64, 0, 0});
  ASSERT_TRUE(engine) << engine.error().message;
  std::vector<RoutingRecord> routing;
  (*engine)->set_routing_log(&routing);

  const std::vector<float> expected = fx.logits(variant);
  ASSERT_EQ(expected.size(), fx.tokens.size() * fx.vocab);
  std::vector<float> logits(fx.vocab);
  double worst = 0.0;
  for (size_t t = 0; t < fx.tokens.size(); ++t) {
    ASSERT_TRUE((*engine)->decode(fx.tokens[t], logits));
    const double err = test::rel_err(logits.data(), expected.data() + t * fx.vocab, fx.vocab);
    EXPECT_LE(err, kMaxRelErr) << variant << " position " << t;
    worst = std::max(worst, err);
    // Greedy: every generated token is the argmax after the previous one.
    if (t + 1 >= fx.prompt && t + 1 < fx.tokens.size() && variant != "q8_0") {
      const auto best = std::max_element(logits.begin(), logits.end()) - logits.begin();
      EXPECT_EQ(static_cast<uint32_t>(best), fx.tokens[t + 1]) << "position " << t;
    }
  }
  RecordProperty("max_rel_err", std::to_string(worst));
  std::printf("[ %s ] max relative error of the logits over %zu positions: %.3e\n", variant.c_str(),
              fx.tokens.size(), worst);

  const std::vector<test::TraceEntry> trace = fx.trace(variant);
  ASSERT_EQ(routing.size(), trace.size());
  for (size_t i = 0; i < trace.size(); ++i) {
    EXPECT_EQ(routing[i].token, trace[i].token);
    EXPECT_EQ(routing[i].layer, trace[i].layer);
    EXPECT_EQ(routing[i].experts, trace[i].experts) << "record " << i;
    for (size_t k = 0; k < trace[i].weights.size(); ++k) {
      EXPECT_NEAR(routing[i].weights[k], trace[i].weights[k], 1e-5) << "record " << i;
    }
  }
  EXPECT_EQ((*source)->gets(), (*source)->releases());
  const ModelParams& p = model->params();
  EXPECT_EQ((*engine)->stats().experts_used, fx.tokens.size() * p.n_layer * p.n_expert_used);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Ds4Forward, ::testing::Values("f32", "mxfp4", "q8_0"),
                         [](const auto& p) { return std::string(p.param); });

TEST(Ds4Forward, TheGreedyQ8_0TokensMatchTransformersOnTheDequantisedWeights) {
  const Ds4Fixture fx = Ds4Fixture::load();
  const auto greedy = fx.meta.at("greedy_q8_0").get<std::vector<uint32_t>>();
  auto model = DenseModel::load(Ds4Fixture::gguf("q8_0"));
  ASSERT_TRUE(model) << model.error().message;
  auto source = FileExpertSource::open(*model);
  ASSERT_TRUE(source);
  auto engine = create_cpu_engine(*model, **source, EngineOptions{64, 0, 0});
  ASSERT_TRUE(engine);
  std::vector<float> logits(fx.vocab);
  std::vector<uint32_t> seq(greedy.begin(), greedy.begin() + fx.prompt);
  for (uint32_t t = 0; t < fx.prompt; ++t) ASSERT_TRUE((*engine)->decode(seq[t], logits));
  while (seq.size() < greedy.size()) {
    seq.push_back(
        static_cast<uint32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin()));
    ASSERT_TRUE((*engine)->decode(seq.back(), logits));
  }
  EXPECT_EQ(seq, greedy);
}

// The q8_0 reference differs from the f32 one far beyond the tolerance, so a test cannot pass
// on the wrong file.
TEST(Ds4Forward, VariantsAreDistinguishable) {
  const Ds4Fixture fx = Ds4Fixture::load();
  const auto a = fx.logits("f32");
  const auto b = fx.logits("q8_0");
  EXPECT_GT(test::rel_err(a.data(), b.data(), a.size()), 20 * kMaxRelErr);
}

TEST(Ds4Forward, ReadsTheV4StructureFromTheFile) {
  auto model = DenseModel::load(Ds4Fixture::gguf("mxfp4"));
  ASSERT_TRUE(model) << model.error().message;
  const ModelParams& p = model->params();
  EXPECT_EQ(p.n_layer, 5u);
  EXPECT_EQ(p.ds4.hash_layers, 2u);
  EXPECT_EQ(p.ds4.hc, 4u);
  EXPECT_EQ(p.ds4.compress_ratio, (std::vector<uint32_t>{8, 4, 0, 4, 8}));
  EXPECT_EQ(p.ds4.attention,
            (std::vector<Ds4Attention>{Ds4Attention::Heavy, Ds4Attention::Compressed,
                                       Ds4Attention::Sliding, Ds4Attention::Compressed,
                                       Ds4Attention::Heavy}));
  EXPECT_DOUBLE_EQ(p.ds4.yarn_factor, 4.0);
  EXPECT_EQ(p.nextn_layers, 0u);
}

// Hash layers route by tid2eid[token]: their experts are hinted, exactly, as soon as the token is
// known and before layer 0 runs; learned layers are never hinted by that path.
TEST(Ds4Forward, HashLayersAreHintedExactlyBeforeLayerZero) {
  const Ds4Fixture fx = Ds4Fixture::load();
  auto model = DenseModel::load(Ds4Fixture::gguf("f32"));
  ASSERT_TRUE(model) << model.error().message;
  const ModelParams& p = model->params();
  auto source = FileExpertSource::open(*model);
  ASSERT_TRUE(source);
  auto engine = create_cpu_engine(*model, **source, EngineOptions{64, 0, 0});
  ASSERT_TRUE(engine);
  std::vector<RoutingRecord> routing;
  (*engine)->set_routing_log(&routing);
  std::vector<float> logits(fx.vocab);
  for (uint32_t t = 0; t < 6; ++t) {
    const size_t before = (*source)->hints().size();
    ASSERT_TRUE((*engine)->decode(fx.tokens[t], logits));
    const std::vector<ExpertHint> hints((*source)->hints().begin() + before,
                                        (*source)->hints().end());
    ASSERT_EQ(hints.size(), uint64_t{p.ds4.hash_layers} * p.n_expert_used) << "token " << t;
    for (uint32_t layer = 0; layer < p.ds4.hash_layers; ++layer) {
      const auto& rec = routing[t * p.n_layer + layer];
      ASSERT_EQ(rec.layer, layer);
      std::set<uint32_t> hinted;
      for (const ExpertHint& h : hints) {
        if (h.layer == layer) hinted.insert(h.expert);
      }
      EXPECT_EQ(hinted, std::set<uint32_t>(rec.experts.begin(), rec.experts.end()))
          << "token " << t << " layer " << layer;
    }
  }
  EXPECT_EQ((*engine)->stats().hash_hints, 6u * p.ds4.hash_layers * p.n_expert_used);
  EXPECT_EQ((*engine)->stats().hash_experts, 6u * p.ds4.hash_layers * p.n_expert_used);
  EXPECT_EQ((*engine)->stats().learned_experts,
            6u * (p.n_layer - p.ds4.hash_layers) * p.n_expert_used);

  // Turned off, no hint names a hash layer.
  auto source2 = FileExpertSource::open(*model);
  ASSERT_TRUE(source2);
  EngineOptions off{64, 0, 0};
  off.hash_hints = false;
  auto engine2 = create_cpu_engine(*model, **source2, off);
  ASSERT_TRUE(engine2);
  ASSERT_TRUE((*engine2)->decode(fx.tokens[0], logits));
  EXPECT_TRUE((*source2)->hints().empty());
  EXPECT_EQ((*engine2)->stats().hash_hints, 0u);
}

TEST(Ds4Forward, ResetStartsTheSequenceAgain) {
  const Ds4Fixture fx = Ds4Fixture::load();
  auto model = DenseModel::load(Ds4Fixture::gguf("q8_0"));
  ASSERT_TRUE(model);
  auto source = FileExpertSource::open(*model);
  ASSERT_TRUE(source);
  auto engine = create_cpu_engine(*model, **source, EngineOptions{64, 0, 0});
  ASSERT_TRUE(engine);
  const std::vector<float> expected = fx.logits("q8_0");
  std::vector<float> logits(fx.vocab);
  for (int round = 0; round < 2; ++round) {
    for (size_t t = 0; t < 20; ++t) ASSERT_TRUE((*engine)->decode(fx.tokens[t], logits));
    EXPECT_LE(test::rel_err(logits.data(), expected.data() + 19 * fx.vocab, fx.vocab), kMaxRelErr)
        << "round " << round;
    (*engine)->reset();
  }
}

// Prefix reuse: truncate(n) for any n restores the last checkpoint at or before n (prefill chunk
// ends, every kCheckpointEvery decoded positions) and feeds the rest again, so the logits that
// follow are a fresh run's to the bit: at a checkpoint, between two, in the middle of a
// compressor's window (ratios 4 and 8) and of the sliding window (8), and at 0 (the run and the
// cuts: ds4_truncate_cuts.h, which the CUDA engine's test shares).
TEST(Ds4Forward, TruncateToAnyPositionGivesTheLogitsOfAFreshRun) {
  auto model = DenseModel::load(Ds4Fixture::gguf("q8_0"));
  ASSERT_TRUE(model) << model.error().message;
  const uint32_t vocab = model->params().n_vocab;
  constexpr uint32_t kTokens = test::kDs4CutTokens;
  constexpr uint32_t kPrompt = test::kDs4CutPrompt;
  std::vector<uint32_t> ids(kTokens);
  for (uint32_t i = 0; i < kTokens; ++i) ids[i] = (i * 37 + 11) % vocab;
  EngineOptions o{kTokens + 8, 1, 0};
  o.prefill_chunk = test::kDs4CutChunk;

  // The reference: every position decoded once, each one's logits kept.
  auto ref_source = FileExpertSource::open(*model);
  ASSERT_TRUE(ref_source);
  auto ref = create_cpu_engine(*model, **ref_source, o);
  ASSERT_TRUE(ref) << ref.error().message;
  std::vector<std::vector<float>> want(kTokens, std::vector<float>(vocab));
  for (uint32_t t = 0; t < kTokens; ++t) ASSERT_TRUE((*ref)->decode(ids[t], want[t]));

  auto source = FileExpertSource::open(*model);
  ASSERT_TRUE(source);
  auto made = Ds4CpuEngine::create(*model, **source, o);
  ASSERT_TRUE(made) << made.error().message;
  Ds4CpuEngine& eng = **made;
  std::vector<float> logits(vocab);
  ASSERT_TRUE(eng.prefill(std::span<const uint32_t>(ids.data(), kPrompt), logits));
  EXPECT_EQ(logits, want[kPrompt - 1]);
  for (uint32_t t = kPrompt; t < test::kDs4CutDecoded; ++t) {
    ASSERT_TRUE(eng.decode(ids[t], logits));
  }
  EXPECT_FALSE(eng.truncate(test::kDs4CutDecoded + 1)) << "past the position";
  EXPECT_EQ(eng.position(), test::kDs4CutDecoded);

  for (const test::Ds4Cut& c : test::kDs4Cuts) {
    const uint64_t before = eng.refed_positions();
    ASSERT_TRUE(eng.truncate(c.n)) << c.n;
    EXPECT_EQ(eng.position(), c.n);
    EXPECT_EQ(eng.refed_positions() - before, c.refed) << "n " << c.n;
    for (uint32_t t = c.n; t < c.n + 3; ++t) {
      ASSERT_TRUE(eng.decode(ids[t], logits));
      EXPECT_EQ(logits, want[t]) << "cut at " << c.n << ", position " << t;
    }
  }
}

// The same cuts on sequence 0 of an engine of two, while sequence 1 (other ids) decodes between
// them through decode_batch(): each sequence keeps its own checkpoints, window and compressors, so
// sequence 0's cuts feed the same positions again as alone and give a fresh run's logits, and
// sequence 1's logits stay its own run's throughout.
TEST(Ds4Forward, TruncateOneSequenceLeavesTheOtherAlone) {
  auto model = DenseModel::load(Ds4Fixture::gguf("q8_0"));
  ASSERT_TRUE(model) << model.error().message;
  const uint32_t vocab = model->params().n_vocab;
  constexpr uint32_t kTokens = test::kDs4CutTokens;
  constexpr uint32_t kPrompt = test::kDs4CutPrompt;
  std::vector<uint32_t> ids(kTokens), other(kTokens);
  for (uint32_t i = 0; i < kTokens; ++i) {
    ids[i] = (i * 37 + 11) % vocab;
    other[i] = (i * 53 + 5) % vocab;
  }
  EngineOptions o{kTokens + 8, 1, 0};
  o.prefill_chunk = test::kDs4CutChunk;
  auto reference = [&](const std::vector<uint32_t>& stream) {
    auto src = FileExpertSource::open(*model);
    EXPECT_TRUE(src);
    auto ref = create_cpu_engine(*model, **src, o);
    EXPECT_TRUE(ref);
    std::vector<std::vector<float>> want(kTokens, std::vector<float>(vocab));
    for (uint32_t t = 0; t < kTokens; ++t) EXPECT_TRUE((*ref)->decode(stream[t], want[t]));
    return want;
  };
  const std::vector<std::vector<float>> want = reference(ids);
  const std::vector<std::vector<float>> want_other = reference(other);

  auto source = FileExpertSource::open(*model);
  ASSERT_TRUE(source);
  EngineOptions two = o;
  two.sequences = 2;
  auto made = Ds4CpuEngine::create(*model, **source, two);
  ASSERT_TRUE(made) << made.error().message;
  Ds4CpuEngine& eng = **made;
  std::vector<float> logits(vocab);
  ASSERT_TRUE(eng.select_sequence(1));
  ASSERT_TRUE(eng.prefill(std::span<const uint32_t>(other.data(), 4), logits));
  EXPECT_EQ(logits, want_other[3]);
  uint32_t next_other = 4;
  ASSERT_TRUE(eng.select_sequence(0));
  ASSERT_TRUE(eng.prefill(std::span<const uint32_t>(ids.data(), kPrompt), logits));
  EXPECT_EQ(logits, want[kPrompt - 1]);
  std::vector<float> both(2 * uint64_t{vocab});
  // Sequence 0 decodes to the first cut, sequence 1 beside it while it has ids.
  for (uint32_t t = kPrompt; t < test::kDs4CutDecoded; ++t) {
    if (next_other < kTokens / 2) {
      const BatchRow rows[] = {{0, ids[t]}, {1, other[next_other]}};
      ASSERT_TRUE(eng.decode_batch(rows, both));
      EXPECT_TRUE(std::equal(both.begin(), both.begin() + vocab, want[t].begin())) << t;
      EXPECT_TRUE(std::equal(both.begin() + vocab, both.end(), want_other[next_other].begin()))
          << next_other;
      ++next_other;
    } else {
      ASSERT_TRUE(eng.decode(ids[t], logits));
    }
  }
  ASSERT_EQ(eng.position(), test::kDs4CutDecoded);
  for (const test::Ds4Cut& c : test::kDs4Cuts) {
    const uint64_t before = eng.refed_positions();
    ASSERT_TRUE(eng.truncate(c.n)) << c.n;
    EXPECT_EQ(eng.position(), c.n);
    EXPECT_EQ(eng.refed_positions() - before, c.refed) << "n " << c.n;
    for (uint32_t t = c.n; t < c.n + 3; ++t) {
      // Sequence 1 takes a step with each of sequence 0's while it has ids left.
      if (next_other < kTokens) {
        const BatchRow rows[] = {{0, ids[t]}, {1, other[next_other]}};
        ASSERT_TRUE(eng.decode_batch(rows, both));
        EXPECT_TRUE(std::equal(both.begin(), both.begin() + vocab, want[t].begin()))
            << "cut at " << c.n << ", position " << t;
        EXPECT_TRUE(std::equal(both.begin() + vocab, both.end(), want_other[next_other].begin()))
            << "sequence 1 at " << next_other;
        ++next_other;
      } else {
        ASSERT_TRUE(eng.decode(ids[t], logits));
        EXPECT_EQ(logits, want[t]) << "cut at " << c.n << ", position " << t;
      }
    }
  }
  EXPECT_EQ(eng.selected_sequence(), 0u);
  ASSERT_TRUE(eng.select_sequence(1));
  EXPECT_EQ(eng.position(), next_other);
}

// Records the predicted hints (not exact ones) by layer; everything else passes through.
class PredictedHints final : public ForwardingSource {
 public:
  using ForwardingSource::ForwardingSource;
  Status prefetch(std::span<const ExpertHint> hints) override {
    for (const ExpertHint& h : hints) {
      if (!h.exact) by_layer[h.layer].insert(h.expert);
    }
    return inner_.prefetch(hints);
  }
  std::map<uint32_t, std::set<uint32_t>> by_layer;
};

// A prefill chunk's and a batch step's routing records: each record's `predicted` holds the
// experts predicted for its own layer (the pass's lookahead hints for that layer), not another
// layer's: the pass logs layer by layer, and each layer's predictions go to that layer's records.
TEST(Ds4Forward, APassesRoutingRecordsCarryTheirOwnLayersPredictions) {
  auto model = DenseModel::load(Ds4Fixture::gguf("q8_0"));
  ASSERT_TRUE(model) << model.error().message;
  const uint32_t vocab = model->params().n_vocab;
  auto file_source = FileExpertSource::open(*model);
  ASSERT_TRUE(file_source);
  PredictedHints source(**file_source);
  EngineOptions o{64, 2, 0};
  o.prefill_chunk = 8;
  o.sequences = 2;
  auto made = Ds4CpuEngine::create(*model, source, o);
  ASSERT_TRUE(made) << made.error().message;
  Ds4CpuEngine& eng = **made;
  std::vector<RoutingRecord> log;
  eng.set_routing_log(&log);
  std::vector<uint32_t> prompt(8);
  for (uint32_t i = 0; i < 8; ++i) prompt[i] = (i * 29 + 3) % vocab;
  std::vector<float> logits(2 * uint64_t{vocab});
  auto check = [&](const char* what) {
    uint64_t with_predictions = 0;
    for (const RoutingRecord& r : log) {
      std::set<uint32_t> got;
      for (const auto& [depth, experts] : r.predicted) got.insert(experts.begin(), experts.end());
      EXPECT_EQ(got, source.by_layer[r.layer])
          << what << ": position " << r.token << ", layer " << r.layer;
      with_predictions += !got.empty();
    }
    EXPECT_GT(with_predictions, 0u) << what;
    log.clear();
    source.by_layer.clear();
  };
  ASSERT_TRUE(eng.prefill(prompt, std::span<float>(logits.data(), vocab)));
  check("prefill");
  ASSERT_TRUE(eng.select_sequence(1));
  ASSERT_TRUE(eng.prefill(std::span<const uint32_t>(prompt.data(), 3),
                          std::span<float>(logits.data(), vocab)));
  log.clear();
  source.by_layer.clear();
  const BatchRow rows[] = {{0, 7}, {1, 11}};
  ASSERT_TRUE(eng.decode_batch(rows, logits));
  check("decode_batch");
}

// --- Malformed files: a copy of the fixture with one thing changed must fail to load with an
// error that names the tensor or key.

TEST(Ds4Malformed, TheUnchangedCopyLoads) {
  expertd::test::TempDir dir;
  const std::string copy = rewrite(Ds4Fixture::gguf("q8_0"), dir.path() + "/same.gguf", Edit{});
  EXPECT_EQ(load_error(copy), "(loaded)");
}

TEST(Ds4Malformed, AMissingTid2eidNamesTheTensor) {
  expertd::test::TempDir dir;
  Edit e;
  e.drop_tensor = "blk.1.ffn_gate_tid2eid.weight";
  const std::string msg = load_error(rewrite(Ds4Fixture::gguf("q8_0"), dir.path() + "/m.gguf", e));
  EXPECT_NE(msg.find("blk.1.ffn_gate_tid2eid.weight is missing"), std::string::npos) << msg;
}

TEST(Ds4Malformed, CompressRatiosShorterThanTheBlockCountNameTheKey) {
  expertd::test::TempDir dir;
  Edit e;
  e.key = "deepseek4.attention.compress_ratios";
  e.set_key = [](GgufWriter& w) {
    const std::vector<uint32_t> three{8, 4, 0};
    w.set_array("deepseek4.attention.compress_ratios", std::span<const uint32_t>(three));
  };
  const std::string msg = load_error(rewrite(Ds4Fixture::gguf("q8_0"), dir.path() + "/m.gguf", e));
  EXPECT_NE(msg.find("deepseek4.attention.compress_ratios has 3 entries, shorter than "
                     "block_count 5"),
            std::string::npos)
      << msg;
}

TEST(Ds4Malformed, AnHcTensorOfTheWrongShapeNamesTheTensorAndBothShapes) {
  expertd::test::TempDir dir;
  Edit e;
  e.reshape_tensor = "blk.2.hc_ffn_fn.weight";
  e.new_ne = {256, 20};  // 20 mixes instead of (2 + 4) * 4
  const std::string msg = load_error(rewrite(Ds4Fixture::gguf("q8_0"), dir.path() + "/m.gguf", e));
  EXPECT_NE(msg.find("tensor blk.2.hc_ffn_fn.weight: shape [256, 20, 1, 1], expected [256, 24]"),
            std::string::npos)
      << msg;
  Edit head;
  head.reshape_tensor = "output_hc_fn.weight";
  head.new_ne = {128, 4};
  const std::string msg2 =
      load_error(rewrite(Ds4Fixture::gguf("q8_0"), dir.path() + "/h.gguf", head));
  EXPECT_NE(msg2.find("tensor output_hc_fn.weight: shape [128, 4, 1, 1], expected [256, 4]"),
            std::string::npos)
      << msg2;
}

TEST(Ds4Malformed, ATid2eidEntryOutsideTheExpertsNamesTokenAndExpert) {
  expertd::test::TempDir dir;
  // Rewrite with every byte of blk.0's table set to 0xff (-1 as i32).
  const std::string src = Ds4Fixture::gguf("q8_0");
  const std::string dst = rewrite(src, dir.path() + "/t.gguf", Edit{});
  auto file = GgufFile::open(dst);
  ASSERT_TRUE(file);
  const GgufTensorInfo* t = file->find_tensor("blk.0.ffn_gate_tid2eid.weight");
  ASSERT_NE(t, nullptr);
  std::fstream f(dst, std::ios::binary | std::ios::in | std::ios::out);
  f.seekp(static_cast<std::streamoff>(t->offset));
  const std::vector<char> bad(8, static_cast<char>(0xff));
  f.write(bad.data(), static_cast<std::streamsize>(bad.size()));
  f.close();
  const std::string msg = load_error(dst);
  EXPECT_NE(msg.find("tensor blk.0.ffn_gate_tid2eid.weight: token 0 maps to expert -1"),
            std::string::npos)
      << msg;
}

TEST(Ds4Malformed, AnotherGatingFunctionNamesTheKey) {
  expertd::test::TempDir dir;
  Edit e;
  e.key = "deepseek4.expert_gating_func";
  e.set_key = [](GgufWriter& w) { w.set_u32("deepseek4.expert_gating_func", 1); };
  const std::string msg = load_error(rewrite(Ds4Fixture::gguf("q8_0"), dir.path() + "/m.gguf", e));
  EXPECT_NE(msg.find("deepseek4.expert_gating_func = 1"), std::string::npos) << msg;
}

}  // namespace
}  // namespace expertd::engine
